"""The fixed cost of one Flower message to a ClientApp in a deployment (a benchmark, not a test).

In a deployment every message runs in a fresh ``flwr-clientapp`` process: it imports
torch and this library, loads its dataset and builds its partition and model before the
handler computes anything. This measures, side by side in one run:

* the library's part of that, in fresh Python processes (as a ClientApp process pays it):
  importing the ClientApp module, loading the dataset with the on-disk cache cold (the
  first process on a node) and warm (every later one), the partition plan and the model;
* with ``--deployment``: ``fedavg`` rounds (one message per node per round) in Flower's
  simulation engine and in a local SuperLink + 3 SuperNodes, medians over rounds 2..R, with
  the dataset cache off and on (the deployment's ClientApps decode the data per message,
  or read the cache).

    python bench/fixed_cost.py
    python bench/fixed_cost.py --deployment --rounds 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import flower_apps.client_app
t2 = time.perf_counter()
from tasks.env import library_env, load_bundle, plan_cached
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
task = parse_run_config({**fused_run_config(None), "algo": "fedavg"}).task
t3 = time.perf_counter()
b = load_bundle(task)
t4 = time.perf_counter()
plan = plan_cached(task, 3, "all", False)
t5 = time.perf_counter()
library_env(task, 3, "all", partition_id=0).build_model()   # (bundle and plan cached above)
t6 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "app": t2 - t1, "data": t4 - t3, "plan": t5 - t4, "model": t6 - t5}))
"""


def probe(cache: str, reps: int) -> dict[str, float]:
    """Median seconds of each step over ``reps`` fresh processes."""
    env = {**os.environ, "FLOWER_SSL_DATA_CACHE": cache, "PYTHONPATH": str(ROOT)}
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                             cwd=ROOT)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def fedavg_rounds(rows: list[dict]) -> dict[str, float]:
    later = [r["round-seconds"] for r in rows[1:]] or [rows[0]["round-seconds"]]
    return {"round_s": statistics.median(later), "first_round_s": rows[0]["round-seconds"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per probe")
    ap.add_argument("--deployment", action="store_true", help="also time fedavg rounds in a local deployment")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="fixed-cost-"))
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    cache = str(out / "data-cache")
    cold = []
    for i in range(args.reps):   # a cold cache each time: a fresh folder per process
        cold.append(probe(str(out / f"cold-{i}"), 1))
    cold_p = {k: statistics.median(c[k] for c in cold) for k in cold[0]}
    probe(cache, 1)                                      # fill it
    warm_p = probe(cache, args.reps)
    off_p = probe("off", args.reps)
    print(f"\nA fresh ClientApp process's own work (medians over {args.reps} processes, seconds):")
    print(f"{'':22s} {'import torch':>12s} {'import app':>10s} {'dataset':>8s} {'plan':>6s} {'model':>6s} {'total':>6s}")
    for name, p in (("cache off", off_p), ("cache cold (1st)", cold_p), ("cache warm", warm_p)):
        print(f"{name:22s} {p['torch']:12.3f} {p['app']:10.3f} {p['data']:8.3f} {p['plan']:6.3f} {p['model']:6.3f} "
              f"{sum(p.values()):6.3f}")
    print(f"dataset load, warm cache vs off: {warm_p['data'] / off_p['data']:.3f}x "
          f"({(off_p['data'] - warm_p['data']) * 1000:.0f} ms saved per message)")
    result = {"off": off_p, "cold": cold_p, "warm": warm_p}

    if args.deployment:
        os.environ.setdefault("FLWR_HOME", str(out / "flwr-home"))
        os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
        from flower_apps.simulate import fused_run_config, run_simulation_inprocess
        from tests.deploy_harness import Deployment

        cfg = {"algo": "fedavg", "num-rounds": args.rounds, "local-steps": 3, "seed": 0, "round-timeout": 300.0}

        def rows_of(folder):
            return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]

        sim = fedavg_rounds(rows_of(run_simulation_inprocess(
            {**fused_run_config(None), "results-dir": str(out / "sim"), "run-name": "fedavg", **cfg}, 3,
            client_cpus=2 / 3)))
        dep_rows = {}
        for mode in ("off", "on"):
            os.environ["FLOWER_SSL_DATA_CACHE"] = "off" if mode == "off" else cache
            with Deployment(out / f"deploy-{mode}", num_nodes=3, poll_interval=0.05) as dep:
                res = dep.run(cfg, f"fedavg-cache-{mode}", timeout=1800)
                if res.proc.returncode:
                    raise RuntimeError(res.output[-3000:])
                dep_rows[mode] = fedavg_rounds(res.metrics())
        print(f"\nfedavg, 3 nodes, {args.rounds} rounds, local-steps=3 (medians over rounds 2..R):")
        print(f"  simulation:                     {sim['round_s']:6.2f} s/round")
        for mode in ("off", "on"):
            r = dep_rows[mode]
            print(f"  deployment, data cache {mode:3s}:     {r['round_s']:6.2f} s/round "
                  f"({r['round_s'] / sim['round_s']:.1f}x simulation)")
        result.update({"fedavg-simulation": sim, "fedavg-deployment": dep_rows})
    (out / "fixed_cost.json").write_text(json.dumps(result, indent=1))
    print(f"\nbench wall time {time.time() - t_start:.0f} s; raw numbers: {out / 'fixed_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
