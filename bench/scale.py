"""Server memory and round time against the number of sampled clients, side by side with
Flower's own FedAvg (a benchmark, not a test).

Both sides run in Flower's simulation engine (``flwr.simulation.run_simulation``, 1 CPU per
ClientApp, ``OMP_NUM_THREADS=1``), every node sampled each round, the same model, the same IID
shards of the embedded MNIST-5k training split (4,000 images), one local epoch of SGD (batch 32,
lr 0.05, momentum 0.9, the library's weak augmentation: the same local training call on both
sides) and a server-side evaluation on the test split after every round (in batches of the
library's ``eval_batch_size`` on both sides):

* ``library``: this library's ``fedavg`` (``flower_apps.simulate.run_simulation_inprocess``:
  the library's ServerApp with its results folder, checkpoints and metrics);
* ``flower``: ``flwr.serverapp.strategy.FedAvg`` with ``evaluate_fn``, and a minimal ClientApp
  that loads the global weights, runs the library's ``train_supervised`` on its shard and replies.

Each (side, model, clients) runs in a fresh process, which reports its peak resident memory
(``ru_maxrss``: the ServerApp's process; the ClientApps run in Ray's worker processes) and the
seconds of every round, from one server evaluation to the next on both sides (the library's
``wall-seconds`` differences: its metrics row and checkpoint count); the table shows the mean of
rounds 2..R and the ratios library / Flower, and each side's memory at the largest size over its
memory at the smallest.

    python bench/scale.py                                  # cnn 10 100 500 1000, resnet18 10 50 100
    python bench/scale.py --cnn 10 100 --resnet18 --rounds 3
    python bench/scale.py --profile --cnn 10 1000 --resnet18 --rounds 2   # what grows, by package
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _task(model: str, n: int, rounds: int, results: str) -> dict:
    from flower_apps.simulate import fused_run_config

    return {**fused_run_config(None), "algo": "fedavg", "model": model, "partition": "iid",
            "num-rounds": rounds, "fraction-train": 1.0, "min-nodes": n, "local-epochs": 1, "local-steps": 0,
            "batch-size": 32, "lr": 0.05, "momentum": 0.9, "weight-decay": 0.0, "device": "cpu",
            "results-dir": results, "run-name": f"scale-{model}-{n}",
            "round-timeout": 3600.0}


def run_library(model: str, n: int, rounds: int) -> list[float]:
    from flower_apps.simulate import run_simulation_inprocess

    with tempfile.TemporaryDirectory() as tmp:
        folder = run_simulation_inprocess(_task(model, n, rounds, tmp), n)
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
        # a round's whole wall time, as on the Flower side (from one evaluation to the next): the
        # round, its evaluation, and the previous round's metrics row and checkpoint
        walls = [float(r["wall-seconds"]) for r in rows]
        return [walls[0], *(b - a for a, b in zip(walls, walls[1:]))]


def _shard(task, n: int, pid: int):
    """Node ``pid``'s IID shard: the library's own partition of the same data (its plan)."""
    from tasks.env import library_env

    env = library_env(task, n, "all", partition_id=pid)
    return env


def run_flower(model: str, n: int, rounds: int) -> list[float]:
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from flower_apps.config import parse_run_config
    from tasks.env import library_env
    from tasks.training import derive_seed, eval_batch_size, make_sgd, num_local_steps, train_supervised

    task = parse_run_config(_task(model, n, rounds, tempfile.gettempdir())).task
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:   # the minimal ClientApp
        # the library fedavg client's local training, call for call (same shard, augmentation,
        # batches, optimizer), so that only the server side and the messages differ
        pid = int(context.node_config["partition-id"])
        env = _shard(task, n, pid)
        net = env.build_model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        data = env.labeled()
        train_supervised(net, data, aug=env.augmenter, steps=num_local_steps(task, len(data)),
                         batch_size=task.batch_size, optimizer=make_sgd(net.parameters(), task),
                         device=env.device, seed=derive_seed(task.seed, "fedavg", 1, pid))
        return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(data)})}), reply_to=msg)

    server = ServerApp()
    stamps: list[float] = []

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        env = library_env(task, n, "all")
        net = env.build_model()
        xt = env.augmenter.test(torch.from_numpy(env.test.x))
        yt = torch.from_numpy(env.test.y).long()
        bs = eval_batch_size(env.device)  # the library's evaluation batch: the same work on both sides

        def evaluate_fn(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            net.load_state_dict(arrays.to_torch_state_dict())
            net.eval()
            with torch.no_grad():
                acc = float(torch.cat([net(xt[i:i + bs]).argmax(1) for i in range(0, len(yt), bs)]).eq(yt)
                            .float().mean())
            stamps.append(time.time())
            return MetricRecord({"accuracy": acc})

        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n).start(
            grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=rounds, evaluate_fn=evaluate_fn)

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    run_simulation(server_app=server, client_app=client, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR"}})
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _package(filename: str) -> str:
    """Who allocated: a top-level package of this library, a site-package, or Python itself."""
    for ours in ("strategies", "split_layer", "tasks", "flower_apps", "bench"):
        if filename.startswith(str(ROOT / ours)):
            return ours + " (ours)"
    if "site-packages/" in filename:
        top = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        return {"google": "protobuf", "_pytest": "pytest"}.get(top, top.removesuffix(".py"))
    return "python"


def profile(model: str, n: int, rounds: int) -> dict:
    """The library side under ``tracemalloc``: at the moment the Python heap was largest, how
    much of it each package allocated (its line of code, the innermost frame), and the RSS then."""
    import threading
    import tracemalloc
    from collections import defaultdict

    tracemalloc.start(int(os.environ.get("BENCH_PROFILE_FRAMES", "1")))
    best: dict = {"traced": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            cur, _ = tracemalloc.get_traced_memory()
            if cur > 1.03 * best["traced"]:
                best.update(traced=cur, rss=_rss_mb(), snap=tracemalloc.take_snapshot())

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    run_library(model, n, rounds)
    stop.set()
    th.join()
    by: dict[str, float] = defaultdict(float)
    for st in best["snap"].statistics("filename"):
        by[_package(st.traceback[0].filename)] += st.size / 2**20
    top = [(str(st.traceback[0]), st.size / 2**20, st.count) for st in best["snap"].statistics("lineno")[:12]]
    # who called the largest allocation site (BENCH_PROFILE_FRAMES innermost frames, default 1:
    # more frames make a 1,000-client run far slower under tracemalloc)
    site = best["snap"].statistics("traceback")[0]
    return {"traced_mb": best["traced"] / 2**20, "rss_mb": best["rss"], "by_package": dict(by), "top_lines": top,
            "top_site": {"mb": site.size / 2**20, "blocks": site.count, "frames": [str(f) for f in site.traceback]}}


def one(side: str, model: str, n: int, rounds: int) -> None:
    """One measurement in this (fresh) process: prints a JSON line."""
    t0 = time.time()
    if side == "profile":
        print("RESULT " + json.dumps({"side": side, "model": model, "clients": n,
                                      **profile(model, n, rounds)}), flush=True)
        return
    secs = (run_library if side == "library" else run_flower)(model, n, rounds)
    print("RESULT " + json.dumps({"side": side, "model": model, "clients": n, "round_seconds": secs,
                                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                  "wall": time.time() - t0}), flush=True)


def measure(side: str, model: str, n: int, rounds: int, home: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "FLWR_HOME": home,
           "RAY_TMPDIR": home,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    p = subprocess.run([sys.executable, __file__, "--one", side, model, str(n), str(rounds)], env=env,
                       capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{side} {model} {n}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cnn", type=int, nargs="*", default=[10, 100, 500, 1000])
    ap.add_argument("--resnet18", type=int, nargs="*", default=[10, 50, 100])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="", help="also write every measurement to this file")
    ap.add_argument("--profile", action="store_true",
                    help="instead: the library side under tracemalloc at each size, the Python heap by "
                         "package at its largest and the growth from the smallest size to the largest "
                         "(BENCH_PROFILE_FRAMES=N: N frames per allocation, default 1)")
    ap.add_argument("--one", nargs=4, metavar=("SIDE", "MODEL", "N", "ROUNDS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        one(args.one[0], args.one[1], int(args.one[2]), int(args.one[3]))
        return 0
    if args.profile:
        return print_profile(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as home:
        for model, sizes in (("cnn", args.cnn), ("resnet18", args.resnet18)):
            for n in sizes:
                got = {side: measure(side, model, n, args.rounds, home) for side in ("library", "flower")}
                rows.append((model, n, got))
                lib, fl = got["library"], got["flower"]
                ls = sum(lib["round_seconds"][1:]) / max(len(lib["round_seconds"]) - 1, 1)
                fs = sum(fl["round_seconds"][1:]) / max(len(fl["round_seconds"]) - 1, 1)
                print(f"{model:9s} {n:5d} clients | library {ls:7.2f} s/round {lib['peak_mb']:7.0f} MB | "
                      f"Flower FedAvg {fs:7.2f} s/round {fl['peak_mb']:7.0f} MB | time ratio {ls / fs:5.2f} | "
                      f"memory ratio {lib['peak_mb'] / fl['peak_mb']:5.2f}", flush=True)
    for model in ("cnn", "resnet18"):
        mine = [(n, g) for m, n, g in rows if m == model]
        if len(mine) >= 2:
            (n0, g0), (n1, g1) = mine[0], mine[-1]
            print(f"{model}: peak memory at {n1} clients / at {n0}: library "
                  f"{g1['library']['peak_mb'] / g0['library']['peak_mb']:.2f}x, Flower FedAvg "
                  f"{g1['flower']['peak_mb'] / g0['flower']['peak_mb']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps([{"model": m, "clients": n, **g} for m, n, g in rows], indent=1))
    return 0


def print_profile(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as home:
        for model, sizes in (("cnn", args.cnn), ("resnet18", args.resnet18)):
            got = [measure("profile", model, n, args.rounds, home) for n in sizes]
            for g in got:
                print(f"{model} {g['clients']:5d} clients: RSS {g['rss_mb']:7.0f} MB, Python heap "
                      f"{g['traced_mb']:6.1f} MB (at its largest)", flush=True)
                for where, mb, count in g["top_lines"][:6]:
                    print(f"    {mb:7.2f} MB {count:8d} blocks  {where}")
                t = g["top_site"]
                print(f"    the largest site, {t['mb']:.2f} MB in {t['blocks']} blocks; its frames (innermost last):")
                for f in t["frames"]:
                    print(f"      {f}")
            if len(got) >= 2:
                a, b = got[0], got[-1]
                print(f"{model}: growth from {a['clients']} to {b['clients']} clients: RSS "
                      f"{b['rss_mb'] - a['rss_mb']:+.0f} MB, Python heap {b['traced_mb'] - a['traced_mb']:+.1f} MB")
                keys = sorted(set(a["by_package"]) | set(b["by_package"]),
                              key=lambda k: -(b["by_package"].get(k, 0) - a["by_package"].get(k, 0)))
                for k in keys[:10]:
                    print(f"    {k:24s} {a['by_package'].get(k, 0):7.1f} MB -> {b['by_package'].get(k, 0):7.1f} MB "
                          f"({b['by_package'].get(k, 0) - a['by_package'].get(k, 0):+.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
