"""SCALA rounds over the split stream without a flood, with a token-less flood from one address,
and with one from 64 addresses, side by side in one run.

The same rounds (same config and seeds, 3 in-process nodes on real gRPC streams from
127.0.0.1 on a fixed port; one-round sessions by default, so every node opens a new connection
from 127.0.0.1 every round, during the flooder's ban) are timed four times: alone; while an
attacker process (``tests/stream_attacker.py --flood``) makes token-less calls, each on a new
connection, as fast as its threads can, from 127.0.0.1 (the genuine nodes' own address);
while it makes them from 64 addresses in turn (127.0.0.1-127.0.0.64, none of which alone is
refused often enough to be banned on its own); and alone again. Every call is refused before
a frame is read and its connection closed (``split_layer.stream_guard``: the one address is
banned, and the 64 together are). A flooded run lasts longer than the guard's ban
(``--rounds``; the duration of each run is printed), so the flood is seen before, during and
after a ban. The run is pinned to CPU 0 and the attacker to CPU 1 (where there are two), so
the ratios measure what the flood costs the ServerApp, not the attacker's own CPU use on a
shared core.

    python bench/stream_flood.py [--rounds 60] [--iters 10] [--callers 4] [--session round|run]

Prints seconds per round (wall, and CPU of this process: the ServerApp, its stream server and
the 3 nodes; means of rounds 2..N) without and with each flood, the ratios (flood / no
flood) side by side, and the attacker's call rates. The baseline is the mean of the runs
before and after the flooded ones, so that a change in the machine's load during the bench
is not taken for the flood's cost; the CPU seconds are the less sensitive to other
processes. Every round must keep all 3 nodes (an assertion): a flood that cut a genuine
node's connection would fail the bench.
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


def rounds(args, port: int) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process: the ServerApp, its stream server and the 3
    nodes) of each round."""
    from flower_apps.client_app import dispatch
    from flower_apps.config import parse_run_config
    from flower_apps.simulate import fused_run_config
    from strategies.core.round_policy import RoundPolicy
    from split_layer.stream import StreamOptions
    from split_layer.transport import LocalGrid

    p = parse_run_config(fused_run_config([f"{BASE} scala.local-iterations={args.iters}"]))
    grid = LocalGrid(3, dispatch, threaded=True)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(
        min_nodes=3, round_timeout=60), split_transport="stream",
        stream=StreamOptions(session=args.session, port=port, timeout=60))
    took: list[tuple[float, float]] = []
    t = [time.monotonic(), time.process_time()]

    def end(r, m):
        now = [time.monotonic(), time.process_time()]
        took.append((now[0] - t[0], now[1] - t[1]))
        t[:] = now
        assert m["participants"] == 3 and not m["dropped"], m

    s.start(grid, num_rounds=args.rounds, on_round_end=end)
    grid.join(30)
    return took


def flooded(args, sources: int) -> tuple[list[tuple[float, float]], dict]:
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

    runs = {"no flood (before)": (rounds(args, free_port()), None),
            "flood, 1 address": flooded(args, 1),
            "flood, 64 addresses": flooded(args, 64),
            "no flood (after)": (rounds(args, free_port()), None)}

    def per_round(took, i):   # mean of rounds 2..N: i = 0 wall seconds, 1 CPU seconds
        return statistics.mean(x[i] for x in took[1:])

    quiet = [took for took, report in runs.values() if report is None]
    base = [statistics.mean(per_round(t, i) for t in quiet) for i in (0, 1)]
    print(f"SCALA, 3 nodes, {args.iters} iterations/round, {args.rounds} rounds, stream sessions of one "
          f"{args.session}; {'run on CPU 0, attacker on CPU 1' if two else 'one CPU shared'}; the guard bans for "
          f"{BAN_S:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")
    for name, (took, report) in runs.items():
        line = (f"  {name + ':':21s} {per_round(took, 0):.3f} s/round (median "
                f"{statistics.median(x[0] for x in took[1:]):.3f}), {per_round(took, 1):.3f} CPU s/round "
                f"(rounds 2..{args.rounds}, {sum(x[0] for x in took):.0f} s in all)")
        if report is not None:
            rate = report["calls"] / max(report["seconds"], 1e-9)
            line += (f"; attacker: {report['calls']} token-less calls in {report['seconds']:.0f} s ({rate:.0f}/s), "
                     f"{report['codes']}")
        print(line)
    for i, what in ((0, "wall s/round"), (1, "CPU s/round")):
        print(f"  ratio flood / no flood ({what}, no flood: the mean of before and after): " + ", ".join(
            f"{n} {per_round(t, i) / base[i]:.2f}" for n, (t, r) in runs.items() if r is not None))
    short = [n for n, (took, r) in runs.items() if r is not None and sum(x[0] for x in took) <= BAN_S]
    if short:
        print(f"  (shorter than the {BAN_S:.0f} s ban: {', '.join(short)}; use more --rounds)")


if __name__ == "__main__":
    main()
