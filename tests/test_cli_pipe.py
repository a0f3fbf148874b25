"""Every ``python -m flower_apps.<command>`` ends quietly when its reader closes the pipe early."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["attack", "config", "cost", "papers", "report", "simulate"]

# a command's main that writes more than a pipe holds, through flower_apps.cli.run as every command does
_BIG_WRITER = ("import sys\nfrom flower_apps.cli import run\n"
               "def main():\n    print('x' * 1_000_000)\n    return 0\nrun(main)\n")


def test_a_reader_that_closes_the_pipe_ends_the_command_with_status_1_and_no_traceback():
    proc = subprocess.Popen([sys.executable, "-c", _BIG_WRITER], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.read(1) == b"x"
    proc.stdout.close()            # as `| head -c 1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == ""


def test_a_command_whose_reader_reads_everything_exits_with_mains_status():
    out = subprocess.run([sys.executable, "-c", _BIG_WRITER.replace("return 0", "return 3")], cwd=ROOT,
                         capture_output=True, timeout=60)
    assert out.returncode == 3 and len(out.stdout) == 1_000_001 and out.stderr == b""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_enters_through_the_shared_runner(command):
    src = (ROOT / "flower_apps" / f"{command}.py").read_text()
    entry = src[src.index('if __name__ == "__main__":'):]
    assert "run(main)" in entry and "sys.exit(main())" not in entry
