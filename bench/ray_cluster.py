"""Flower's simulation engine on a multi-node Ray cluster: a two-node cluster on this
machine, a few rounds of a full-model and a split algorithm on it, every process stopped.

Flower's Ray backend calls ``ray.init()`` without an address, so it joins the cluster named by
``RAY_ADDRESS`` (Ray's own rule) and places ClientApp actors on every node of that cluster
(``client_resources`` per actor, as many actors as the cluster's resources hold). The ServerApp
and the ServerApp's grid stay in the process that runs the simulation; only the ClientApps run
on the cluster's nodes. This script stands a cluster up the way ``ray start`` does on real
machines, with every node on loopback and in its own process group:

* head: ``ray start --head --node-ip-address 127.0.0.1 --port P --num-cpus C --block``;
* each further node: ``ray start --address 127.0.0.1:P --node-ip-address 127.0.0.1 --num-cpus C
  --block`` (on real machines: the head's reachable address and the node's own);

then runs ``python -m flower_apps.simulate`` (and with ``--flwr-run``, ``flwr run .`` on a
private managed SuperLink) with ``RAY_ADDRESS=127.0.0.1:P``, records which node each ClientApp
actor ran on (the actors are descendants of that node's raylet), and stops every process it
started by PID, also on failure or Ctrl-C. Its ports are free ones and Ray's temp dir a private one.

    python bench/ray_cluster.py                        # fedavg and scala, 2 rounds, 4 SuperNodes
    python bench/ray_cluster.py --algos fedavg splitfed-v1 --rounds 3 --nodes 3 --flwr-run
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.flower_harness import Managed, cmdline, descendants, free_port, kill_pids  # noqa: E402

ACTOR_TITLE = "ray::ClientAppActor"


class LocalRayCluster(Managed):
    """``nodes`` Ray nodes on loopback, each a ``ray start --block`` process in its own session,
    ``cpus`` CPUs each. ``address`` is what ``RAY_ADDRESS`` takes. A context manager
    (:class:`tests.flower_harness.Managed`): leaving it, or a failed start, stops every process
    of every node (SIGTERM, then SIGKILL) and raises if one is left."""

    def __init__(self, workdir: Path, nodes: int = 2, cpus: float = 1, start_timeout: float = 120.0):
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self.workdir = Path(workdir)
        self.nodes, self.cpus, self.start_timeout = nodes, cpus, start_timeout
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Ray's AF_UNIX socket paths must stay under 107 bytes: a short private dir under /tmp
        self.temp_dir = tempfile.mkdtemp(prefix="rayc", dir="/tmp")
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "RAY_TMPDIR": self.temp_dir, "OMP_NUM_THREADS": "1",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.env.pop("RAY_ADDRESS", None)

    # ------------------------------------------------------------------ start / stop
    def _ports(self) -> list[str]:
        """Free ports for everything a node would otherwise bind at a fixed default (two nodes on
        one machine would collide on the dashboard agent's 52365, the client server's 10001)."""
        return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                "--dashboard-agent-listen-port", str(free_port()),
                "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]

    def _start_node(self, i: int) -> None:
        common = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus), "--block",
                  "--disable-usage-stats", *self._ports()]
        if i == 0:
            args = ["ray", "start", "--head", "--port", str(self.port), "--temp-dir", self.temp_dir,
                    "--include-dashboard=false", "--ray-client-server-port", str(free_port()), *common]
        else:
            args = ["ray", "start", "--address", self.address, *common]
        with open(self.workdir / f"ray-node{i}.log", "w") as log:   # (the node keeps its own handle)
            self.procs.append(subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        self._wait_alive(i + 1)

    def alive_nodes(self) -> int:
        """Alive nodes as the cluster's GCS reports them (a short driver that joins and leaves)."""
        code = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))" % self.address)
        r = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True,
                           timeout=60)
        try:
            return int(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return 0

    def _wait_alive(self, n: int) -> None:
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RuntimeError(f"Ray node {i} exited with {p.returncode}:\n{self.log(i)[-3000:]}")
            if self.alive_nodes() >= n:
                return
            time.sleep(1.0)
        raise RuntimeError(f"Ray cluster at {self.address}: {n} node(s) not alive after "
                           f"{self.start_timeout:.0f} s:\n{self.log(len(self.procs) - 1)[-3000:]}")

    def log(self, i: int) -> str:
        try:
            return (self.workdir / f"ray-node{i}.log").read_text()
        except OSError:
            return ""

    def pids(self) -> list[int]:
        return [q for p in self.procs for q in (p.pid, *descendants(p.pid))]

    def stop(self) -> None:
        pids = self.pids()
        for p in self.procs:  # the whole session of each node first, then every PID left
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        left = kill_pids(pids + self.pids())
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        if left:
            raise RuntimeError(f"Ray processes left after stopping the cluster: {left}")

    def start(self) -> None:
        for i in range(self.nodes):
            self._start_node(i)

    # ------------------------------------------------------------------ observation
    def actors(self) -> dict[int, set[int]]:
        """Node index -> PIDs of the ClientApp actors running on it now."""
        return {i: {q for q in descendants(p.pid) if cmdline(q).startswith(ACTOR_TITLE)}
                for i, p in enumerate(self.procs)}


class ActorWatch:
    """Polls the cluster's ClientApp actors while a run goes on: which node ran which actor. An
    actor already there when the watch starts (a previous run's, still exiting) is not counted."""

    def __init__(self, cluster: LocalRayCluster, every: float = 0.25):
        self.cluster, self.every = cluster, every
        self.seen: dict[int, set[int]] = {i: set() for i in range(cluster.nodes)}
        self._before: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for i, pids in self.cluster.actors().items():
                self.seen[i] |= pids - self._before
            self._stop.wait(self.every)

    def __enter__(self) -> "ActorWatch":
        self._before = set().union(*self.cluster.actors().values())
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _final(folder: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {"rounds": len(rows), "accuracy": [round(float(r["accuracy"]), 4) for r in rows]}


def run_simulate(cluster: LocalRayCluster, algo: str, rounds: int, supernodes: int, results: Path,
                 extra: str = "", timeout: float = 900.0) -> dict[str, Any]:
    """``python -m flower_apps.simulate`` on the cluster: the run folder, accuracy per round, the
    wall time and the actors seen on each node."""
    cfg = (f"algo='{algo}' num-rounds={rounds} results-dir='{results}' run-name='{algo}' "
           f"fraction-train=1.0 min-nodes={supernodes} {extra}").strip()
    cmd = [sys.executable, "-m", "flower_apps.simulate", "--num-supernodes", str(supernodes),
           "--run-config", cfg]
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    t0 = time.time()
    with ActorWatch(cluster) as watch:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = {"algo": algo, "command": f"RAY_ADDRESS={cluster.address} python " + " ".join(
        a if " " not in a else f'"{a}"' for a in cmd[1:]), "rc": r.returncode,
        "seconds": round(time.time() - t0, 1), "actors_per_node": {i: len(s) for i, s in watch.seen.items()}}
    if r.returncode != 0:
        out["error"] = (r.stdout + r.stderr)[-4000:]
        return out
    folder = Path(r.stdout.strip().splitlines()[-1])
    return {**out, "folder": str(folder), **_final(folder)}


def run_flwr(cluster: LocalRayCluster, algo: str, rounds: int, supernodes: int, results: Path,
             workdir: Path, timeout: float = 900.0) -> dict[str, Any]:
    """``flwr run .`` on a private managed local SuperLink whose simulation joins the cluster
    (the SuperLink and its ``flwr-simulation`` inherit ``RAY_ADDRESS``)."""
    from tests.flower_harness import flwr_cli, hermetic_env, stop_local_superlink

    env = {**hermetic_env(workdir), **{k: v for k, v in cluster.env.items() if k != "RAY_TMPDIR"},
           "RAY_ADDRESS": cluster.address,
           # a private managed SuperLink on free ports: a user's own local SuperLink is untouched
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    fed = f"num-supernodes={supernodes} client-resources-num-cpus=1"  # Flower's default is 2 per ClientApp
    cfg = (f"algo='{algo}' num-rounds={rounds} results-dir='{results}' run-name='flwr-{algo}' "
           f"fraction-train=1.0 min-nodes={supernodes}")
    t0 = time.time()
    try:
        with ActorWatch(cluster) as watch:
            r = flwr_cli(["run", ".", "--stream", "--federation-config", fed, "--run-config", cfg],
                         env, timeout=timeout)
    finally:
        stop_local_superlink(env)
    out = {"algo": algo, "command": f"RAY_ADDRESS={cluster.address} flwr run . --stream "
           f"--federation-config \"{fed}\" --run-config \"{cfg}\"", "rc": r.returncode,
           "seconds": round(time.time() - t0, 1), "actors_per_node": {i: len(s) for i, s in watch.seen.items()}}
    folder = results / f"flwr-{algo}"
    if r.returncode != 0 or not (folder / "metrics.jsonl").exists():
        out["error"] = (r.stdout + r.stderr)[-4000:]
        return out
    return {**out, "folder": str(folder), **_final(folder)}


def _print(r: dict[str, Any]) -> None:
    print(f"$ {r['command']}", flush=True)
    if r["rc"] != 0 or "rounds" not in r:
        print(f"  FAILED (exit {r['rc']}):\n{r.get('error', '')}", flush=True)
        return
    print(f"  {r['how']:20s} {r['algo']:8s} {r['rounds']} rounds, accuracy "
          f"{' -> '.join(f'{a:.4f}' for a in r['accuracy'])}, ClientApp actors per node "
          f"{r['actors_per_node']}, {r['seconds']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes (head included)")
    ap.add_argument("--cpus", type=float, default=1, help="CPUs each node offers (1 actor per CPU)")
    ap.add_argument("--algos", nargs="+", default=["fedavg", "scala"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--supernodes", type=int, default=4)
    ap.add_argument("--flwr-run", action="store_true", help="also run each algorithm with `flwr run .`")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args(argv)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ray-cluster-") as tmp:
        work = Path(tmp)
        t0 = time.time()
        with LocalRayCluster(work, nodes=args.nodes, cpus=args.cpus) as cluster:
            print(f"cluster: {cluster.nodes} nodes at {cluster.address} ({time.time() - t0:.1f} s to start), "
                  f"{cluster.alive_nodes()} alive", flush=True)
            for algo in args.algos:
                res = run_simulate(cluster, algo, args.rounds, args.supernodes, work / "results")
                results.append({"how": "flower_apps.simulate", **res})
                _print(results[-1])
                if args.flwr_run:
                    res = run_flwr(cluster, algo, args.rounds, args.supernodes, work / "results", work)
                    results.append({"how": "flwr run", **res})
                    _print(results[-1])
            pids = cluster.pids()
        left = [p for p in pids if Path(f"/proc/{p}").exists() and cmdline(p)]
        print(f"stopped: {len(pids)} cluster processes, {len(left)} left", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    ok = all(r["rc"] == 0 and r.get("rounds") == args.rounds for r in results)
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
