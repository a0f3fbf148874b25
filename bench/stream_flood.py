"""SCALA rounds over the split stream with and without a token-less flood, side by side in one run.

The same rounds (same config and seeds, 3 in-process nodes on real gRPC streams, sessions
that span the run on a fixed port) are timed twice: once alone, once while an attacker
process (``tests/stream_attacker.py --flood``) makes token-less calls to the stream port as
fast as its threads can. Every call is refused before a frame is read and its connection
closed (``split_layer.stream_guard``), so each one costs the attacker a new connection.
The run is pinned to CPU 0 and the attacker to CPU 1 (where there are two), so the ratio
measures what the flood costs the ServerApp, not the attacker's own CPU use on a shared core.

    python bench/stream_flood.py [--rounds 6] [--iters 10] [--callers 4]

Prints seconds per round (median of rounds 2..N) with and without the flood, their ratio,
and the attacker's call rate.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.flower_harness import free_port  # noqa: E402

BASE = ("algo='scala' model='cnn' norm='bn' partition='quantity' partition-classes-per-client=4 seed=3 "
        "scala.total-batch=64 lr=0.05 momentum=0.9 min-nodes=2")


def rounds(args, port: int) -> list[float]:
    from flower_apps.client_app import dispatch
    from flower_apps.config import parse_run_config
    from flower_apps.simulate import fused_run_config
    from split_layer.rounds import RoundPolicy
    from split_layer.stream import StreamOptions
    from split_layer.transport import LocalGrid

    p = parse_run_config(fused_run_config([f"{BASE} scala.local-iterations={args.iters}"]))
    grid = LocalGrid(3, dispatch, threaded=True)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(
        min_nodes=3, round_timeout=60, split_transport="stream",
        stream=StreamOptions(session="run", port=port, timeout=60)))
    took: list[float] = []
    t = [time.monotonic()]

    def end(r, m):
        now = time.monotonic()
        took.append(now - t[0])
        t[0] = now
        assert m["participants"] == 3 and not m["dropped"], m

    s.start(grid, num_rounds=args.rounds, on_round_end=end)
    grid.join(30)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--callers", type=int, default=4)
    args = ap.parse_args()
    two = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
    if two:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)

    quiet = rounds(args, free_port())
    port = free_port()
    cmd = [sys.executable, str(ROOT / "tests" / "stream_attacker.py"), "127.0.0.1", str(port), "--flood",
           "--callers", str(args.callers), "--seconds", "600"]
    attacker = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if two:
            os.sched_setaffinity(attacker.pid, {sorted(os.sched_getaffinity(0) ^ set(range(os.cpu_count())))[0]}
                                 if os.sched_getaffinity(0) != set(range(os.cpu_count())) else {1})
        attacker.stdout.readline()
        flooded = rounds(args, port)
    finally:
        out, _ = attacker.communicate("", timeout=60)
    report = json.loads(out.strip().splitlines()[-1])
    q, f = statistics.median(quiet[1:]), statistics.median(flooded[1:])
    print(f"SCALA, 3 nodes, {args.iters} iterations/round, stream sessions spanning the run; "
          f"{'run on CPU 0, attacker on CPU 1' if two else 'one CPU shared'}")
    print(f"  without flood: {q:.3f} s/round (rounds 2..{args.rounds}: {', '.join(f'{x:.2f}' for x in quiet[1:])})")
    print(f"  with flood:    {f:.3f} s/round (rounds 2..{args.rounds}: {', '.join(f'{x:.2f}' for x in flooded[1:])})")
    rate = report["calls"] / max(report["seconds"], 1e-9)
    print(f"  attacker: {report['calls']} token-less calls in {report['seconds']:.1f} s ({rate:.0f}/s), "
          f"status codes {report['codes']}")
    print(f"  ratio flood / no flood: {f / q:.2f}")


if __name__ == "__main__":
    main()
