"""SCALA rounds over the split stream without a flood, with a token-less flood from one address,
and with one from 64 addresses, side by side in one run.

The same rounds (same config and seeds, 3 in-process nodes on real gRPC streams from
127.0.0.1 on a fixed port; one-round sessions by default, so every node opens a new connection
from 127.0.0.1 every round, during the flooder's ban) are timed three times: alone; while an
attacker process (``tests/stream_attacker.py --flood``) makes token-less calls, each on a new
connection, as fast as its threads can, from 127.0.0.1 (the genuine nodes' own address); and
while it makes them from 64 addresses in turn (127.0.0.1-127.0.0.64, none of which alone is
refused often enough to be banned on its own). Every call is refused before a frame is read
and its connection closed (``split_layer.stream_guard``: the one address is banned, and the 64
together are); a flooded run lasts longer than the guard's ban (``--rounds``; the duration of
each is printed), so the flood is seen before, during and after a ban. The run is pinned to
CPU 0 and the attacker to CPU 1 (where there are two), so the ratios measure what the flood
costs the ServerApp, not the attacker's own CPU use on a shared core.

    python bench/stream_flood.py [--rounds 60] [--iters 10] [--callers 4] [--session round|run]

Prints seconds per round (mean and median of rounds 2..N) without and with each flood, the
ratios (flood / no flood) side by side, and the attacker's call rates. Every round must keep
all 3 nodes (an assertion): a flood that cut a genuine node's connection would fail the bench.
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
        stream=StreamOptions(session=args.session, port=port, timeout=60)))
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


def flooded(args, sources: int) -> tuple[list[float], dict]:
    """The rounds while the attacker floods from ``sources`` addresses; its report."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "tests" / "stream_attacker.py"), "127.0.0.1", str(port), "--flood",
           "--callers", str(args.callers), "--sources", str(sources), "--seconds", "600"]
    attacker = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        if len(mine) == 1 and os.cpu_count() and os.cpu_count() >= 2:
            os.sched_setaffinity(attacker.pid, set(range(os.cpu_count())) - mine)
        attacker.stdout.readline()
        took = rounds(args, port)
    finally:
        out, _ = attacker.communicate("", timeout=60)
    return took, json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--callers", type=int, default=4)
    ap.add_argument("--session", choices=("round", "run"), default="round",
                    help="round: every node opens a new connection from 127.0.0.1 every round (through the "
                         "flooder's ban); run: one connection per node for the run")
    args = ap.parse_args()
    two = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
    if two:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from split_layer.stream_guard import BAN_S

    runs = {"without flood": (rounds(args, free_port()), None),
            "flood, 1 address": flooded(args, 1),
            "flood, 64 addresses": flooded(args, 64)}
    base = statistics.mean(runs["without flood"][0][1:])
    print(f"SCALA, 3 nodes, {args.iters} iterations/round, {args.rounds} rounds, stream sessions of one "
          f"{args.session}; "
          f"{'run on CPU 0, attacker on CPU 1' if two else 'one CPU shared'}; the guard bans for {BAN_S:.0f} s")
    for name, (took, report) in runs.items():
        mean, med = statistics.mean(took[1:]), statistics.median(took[1:])
        line = (f"  {name + ':':21s} {mean:.3f} s/round mean, {med:.3f} median (rounds 2..{args.rounds}, "
                f"{sum(took):.0f} s in all)")
        if report is not None:
            rate = report["calls"] / max(report["seconds"], 1e-9)
            line += (f"; attacker: {report['calls']} token-less calls in {report['seconds']:.0f} s ({rate:.0f}/s), "
                     f"{report['codes']}")
        print(line)
    ratios = {name: statistics.mean(took[1:]) / base for name, (took, _) in runs.items() if name != "without flood"}
    print("  ratio flood / no flood (mean s/round): " + ", ".join(f"{n} {r:.2f}" for n, r in ratios.items()))
    short = [n for n, (took, _) in runs.items() if n != "without flood" and sum(took) <= BAN_S]
    if short:
        print(f"  (shorter than the {BAN_S:.0f} s ban: {', '.join(short)}; use more --rounds)")


if __name__ == "__main__":
    main()
