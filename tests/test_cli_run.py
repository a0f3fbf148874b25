"""The README's run command through the real `flwr` CLI and a managed local SuperLink."""
import re
from pathlib import Path

import pytest

from tests.flower_harness import ROOT, flwr_cli, free_port, hermetic_env, read_metrics, stop_local_superlink

pytestmark = pytest.mark.e2e


def test_flwr_run_dot_on_the_embedded_default(tmp_path):
    """The README's quickstart, `flwr run . --stream --federation-config "client-resources-num-cpus=1"`,
    as a new user types it: no environment variable (the [tool.uv] overrides make the SuperLink's
    per-run `uv sync` a no-op), Flower's default federation (2 simulated SuperNodes) with both
    ClientApps at once, so `split-transport='auto'` takes the stream; only the rounds are cut short."""
    env = hermetic_env(tmp_path)
    env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)
    # a private managed SuperLink on free ports, so a user's own local SuperLink is untouched
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
    results = tmp_path / "results"
    try:
        proc = flwr_cli(["run", ".", "--stream", "--federation-config", "client-resources-num-cpus=1",
                         "--run-config", f"num-rounds=2 semisfl.k-s=5 semisfl.k-u=3 results-dir='{results}' "
                                         f"run-name='cli'"],
                        env=env, timeout=400, cwd=ROOT)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert "round 2/2 | acc" in out, out[-3000:]
        assert "split-transport='auto': stream" in out, out[-3000:]
        # the SuperLink ran its dependency installation, and it installed nothing
        assert "No additional application dependencies needed installation" in out, out[-3000:]
        rows = read_metrics(results / "cli")
        assert [r["round"] for r in rows] == [1, 2] and rows[-1]["participants"] == 2
        # the default algorithm is Semi-SFL: split rounds with teacher and student features
        cfg = __import__("json").loads((results / "cli" / "config.json").read_text())
        assert cfg["algo"] == "semisfl" and cfg["server-labels"] == 500
        assert rows[-1]["split-exchanges"] == 4 and "teacher-accuracy" in rows[-1], rows[-1]
        assert (results / "cli" / "model.pt").exists() and (results / "cli" / "curves.png").exists()
        # the run got its own environment under FLWR_HOME, and no package landed in it (it is
        # removed after the run; if not, it holds none)
        made = [Path(p) for p in re.findall(r"Created env for run in: (\S+)", out)]
        assert made and all(p.parent == tmp_path / "flwr-home" / "runtime-envs" for p in made), out[-3000:]
        for p in made:
            assert not list(p.glob("lib/python*/site-packages/*/__init__.py")), sorted(p.glob("lib/python*/site-packages/*"))
    finally:
        stop_local_superlink(env)


def test_flwr_run_rejects_unknown_key_before_starting(tmp_path):
    """Flower refuses a run-config key the app does not declare when the run is submitted: exit 1,
    its ``[code: 15] Invalid run configuration.``, and no run starts (no round, no run folder)."""
    env = hermetic_env(tmp_path)
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(free_port())
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(free_port())
    results = tmp_path / "results"
    try:
        proc = flwr_cli(["run", ".", "--run-config", f"no-such-key=1 results-dir='{results}'"], env=env,
                        timeout=120, cwd=ROOT)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-3000:]
        assert "[code: 15] Invalid run configuration." in out, out[-3000:]
        assert "round 1/" not in out and not results.exists(), out[-3000:]
    finally:
        stop_local_superlink(env)
