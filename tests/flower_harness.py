"""Run the real app through Flower's simulation engine or the `flwr` CLI, hermetically.

Everything that starts Flower uses a private FLWR_HOME and RAY_TMPDIR and kills, by PID,
every process it started (a detached local SuperLink otherwise outlives the test run).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def hermetic_env(tmp: Path) -> dict[str, str]:
    """Env vars for a private Flower home and Ray temp dir (Ray's AF_UNIX socket paths
    must stay under 107 bytes, so its dir is a short one directly under /tmp)."""
    import tempfile

    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(tmp / "flwr-home"),
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "RAY_DEDUP_LOGS": "0",
    })
    for k in ("FLWR_HOME", "RAY_TMPDIR"):
        Path(env[k]).mkdir(parents=True, exist_ok=True)
    return env


def run_simulation_inprocess(run_config: dict[str, Any], results_dir: Path, num_supernodes: int = 3,
                             run_name: str = "run") -> Path:
    """The app's defaults + ``run_config``, run in Flower's simulation engine in this process."""
    from flower_apps.simulate import fused_run_config, run_simulation_inprocess as sim

    cfg = {**fused_run_config(None), "results-dir": str(results_dir), "run-name": run_name,
           "round-timeout": 300.0, **run_config}
    return sim(cfg, num_supernodes)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _pids_matching(pattern: str) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if pattern in args and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


def kill_tree(pids: list[int], grace: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for p in pids:
            try:
                os.kill(p, sig)
                alive.append(p)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while alive and time.time() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.1)
        if not alive:
            return


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def stop_local_superlink(env: dict[str, str]) -> None:
    """Kill the managed local SuperLink started under this FLWR_HOME, and its children."""
    home = env["FLWR_HOME"]
    pids = _pids_matching(home)
    ray = _pids_matching(env["RAY_TMPDIR"])
    kill_tree(pids + ray)


def flwr_cli(args: list[str], env: dict[str, str], timeout: float = 600, cwd: Path = ROOT
             ) -> subprocess.CompletedProcess:
    flwr = str(Path(sys.executable).parent / "flwr")
    return subprocess.run([flwr, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
