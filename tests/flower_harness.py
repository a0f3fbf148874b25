"""Run the real app through Flower's simulation engine or the `flwr` CLI, hermetically.

Everything that starts Flower uses a private FLWR_HOME and RAY_TMPDIR and kills, by PID,
every process it started (a detached local SuperLink otherwise outlives the test run).
"""
from __future__ import annotations

import json
import os
import signal
import socket
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
        "FLOWER_SSL_STATE_DIR": str(tmp / "node-state"),  # nodes' saved state stays in the test's folder
    })
    for k in ("FLWR_HOME", "RAY_TMPDIR"):
        Path(env[k]).mkdir(parents=True, exist_ok=True)
    return env


def run_simulation_inprocess(run_config: dict[str, Any], results_dir: Path, num_supernodes: int = 3,
                             run_name: str = "run", client_cpus: float = 1.0) -> Path:
    """The app's defaults + ``run_config``, run in Flower's simulation engine in this process."""
    from flower_apps.simulate import fused_run_config, run_simulation_inprocess as sim

    cfg = {**fused_run_config(None), "results-dir": str(results_dir), "run-name": run_name,
           "round-timeout": 300.0, **run_config}
    return sim(cfg, num_supernodes, client_cpus=client_cpus)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- processes
def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """True for a running (not zombie) process."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_pids(pids: list[int], grace: float = 5.0) -> list[int]:
    """SIGTERM, wait ``grace``, then SIGKILL; returns the pids still alive at the end."""
    pids = [p for p in dict.fromkeys(pids) if p != os.getpid()]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for p in pids:
            if alive(p):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + wait
        while time.time() < deadline and any(alive(p) for p in pids):
            time.sleep(0.1)
        if not any(alive(p) for p in pids):
            return []
    return [p for p in pids if alive(p)]



def pids_with_env(key: str, value: str) -> list[int]:
    """Live processes whose environment has ``key=value`` (ours inherit FLWR_HOME)."""
    needle = f"{key}={value}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and alive(int(d.name)):
            out.append(int(d.name))
    return out


def stop_local_superlink(env: dict[str, str]) -> None:
    """Kill every process started under this FLWR_HOME / RAY_TMPDIR (a managed local
    SuperLink, its superexec, flwr-simulation and Ray), found by their inherited environment."""
    pids = pids_with_env("FLWR_HOME", env["FLWR_HOME"]) + pids_with_env("RAY_TMPDIR", env["RAY_TMPDIR"])
    left = kill_pids(pids + [c for p in pids for c in descendants(p)])
    if left:
        raise RuntimeError(f"processes left after stopping the local SuperLink: {left}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flwr_cli(args: list[str], env: dict[str, str], timeout: float = 600, cwd: Path = ROOT
             ) -> subprocess.CompletedProcess:
    flwr = str(Path(sys.executable).parent / "flwr")
    return subprocess.run([flwr, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts of torch tensors (same keys)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].detach().cpu().double() - b[k].detach().cpu().double()).abs().max()) if a[k].numel() else 0.0
               for k in a)


def split_reference(task, k: int):
    """An in-process reference of a split run over ``k`` clients (the equivalence tests): the
    library's model for ``task`` in train mode, its cut, its top part, and each client's labeled
    set; returns ``(env, model, cut, top, datas)``."""
    from split_layer.cut import resolve_cut, split_model
    from tasks.env import library_env

    env = library_env(task, k, "all")
    model = env.build_model()
    model.train()
    cut = resolve_cut(model, task.cut)
    _, top = split_model(model, cut)
    datas = [env.bundle.train.subset(env.plan.clients[i].labeled) for i in range(k)]
    return env, model, cut, top, datas


class Managed:
    """A context manager over ``start()`` / ``stop()`` for what a test starts (a deployment, a
    Ray cluster): ``stop()`` runs on leaving, and also when ``start()`` itself fails halfway."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

