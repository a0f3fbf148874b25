"""Per-exchange overhead of split learning over Flower messages (a benchmark, not a test).

The same SCALA rounds (same config, same seeds, same math) are run

* in one process: ``split_layer.transport.LocalGrid`` calls the ClientApp handler directly
  (same ``Message`` objects, same ``context.state`` round trip, no Flower runtime);
* through Flower's simulation engine (``run_simulation``, Ray actors), and optionally
* through a local deployment: a ``flower-superlink`` and N ``flower-supernode`` processes on
  127.0.0.1 (insecure, private ``FLWR_HOME``, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` small),
  driven by ``flwr run``; every process is killed by PID at the end
  (``tests/deploy_harness.Deployment``).

Per-exchange overhead = median wall time of one fused exchange via Flower minus the same in
one process (``split-exchange-seconds / split-exchanges`` of the round metrics; client compute
is inside both). Round 1 is excluded (Ray/actor start, one-time split-info). The simulation
gets one ClientApp actor so that clients run one after the other, as in-process.
It also reports the largest weight difference between the Flower run and the in-process run
(the in-process run uses as many intra-op threads as the simulation's single ClientApp actor).

    python bench/split_overhead.py                       # simulation + in-process
    python bench/split_overhead.py --deployment          # + local SuperLink/SuperNodes
    python bench/split_overhead.py --iters 5 --rounds 4 --nodes 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def config(args) -> dict:
    return {"algo": "scala", "num-rounds": args.rounds, "scala.local-iterations": args.iters,
            "scala.total-batch": args.batch, "model": args.model, "seed": 0, "min-nodes": 2,
            "fraction-train": 1.0, "partition": "quantity", "partition-classes-per-client": 4}


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def summarize(name: str, rows: list[dict], iters: int, seconds: float) -> dict:
    ok = [r for r in rows if r.get("split-exchanges") and not r.get("skipped") and not r.get("dropped")]
    if not ok:
        raise RuntimeError(f"{name}: no complete round (all skipped or with dropped nodes); see the log")
    later = [r for r in ok if r["round"] > 1] or ok
    per_ex = [r["split-exchange-seconds"] / r["split-exchanges"] for r in later]
    return {"name": name, "round_s": statistics.median(r["round-seconds"] for r in later),
            "exchange_s": statistics.median(per_ex), "first_round_s": rows[0]["round-seconds"],
            "wall_s": seconds, "exchanges_per_round": iters + 1,
            "bytes_per_round": rows[-1]["bytes.total"], "accuracy": rows[-1]["accuracy"]}


def run_local(cfg: dict, nodes: int, out: Path):
    """The same app logic (ServerApp ``run``) on a LocalGrid."""
    import torch

    from flower_apps.client_app import dispatch
    from flower_apps.server_app import run
    from flower_apps.simulate import fused_run_config
    from split_layer.transport import LocalGrid

    # the simulation below gives its single ClientApp actor all CPUs (Ray then sets
    # OMP_NUM_THREADS to that count); use the same intra-op thread count here, or float sums
    # differ in the last bits and the weights drift apart over steps
    torch.set_num_threads(int(os.cpu_count() or 1))
    full = {**fused_run_config(None), "results-dir": str(out), "run-name": "local", **cfg}
    t0 = time.time()
    folder = run(LocalGrid(nodes, dispatch, full), full)
    return folder, time.time() - t0


def run_sim(cfg: dict, nodes: int, out: Path):
    from flower_apps.simulate import fused_run_config, run_simulation_inprocess

    full = {**fused_run_config(None), "results-dir": str(out), "run-name": "simulation", **cfg}
    t0 = time.time()
    # one ClientApp actor (all CPUs to it): clients run one after the other, as in-process
    folder = run_simulation_inprocess(full, nodes, client_cpus=float(os.cpu_count() or 1))
    return folder, time.time() - t0


def run_deploy(cfg: dict, nodes: int, out: Path, poll: float):
    from tests.deploy_harness import Deployment

    with Deployment(out / "deploy", num_nodes=nodes, poll_interval=poll) as dep:
        t0 = time.time()
        res = dep.run(cfg, "deployment", timeout=3600)
        if res.proc.returncode != 0 or not (res.folder / "metrics.jsonl").exists():
            raise RuntimeError("deployment run failed:\n" + res.output[-3000:])
        return res.folder, time.time() - t0


def max_weight_diff(a: Path, b: Path) -> float:
    import torch

    x, y = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x if x[k].numel())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--deployment", action="store_true", help="also run a local SuperLink + SuperNodes")
    ap.add_argument("--deploy-rounds", type=int, default=2)
    ap.add_argument("--deploy-iters", type=int, default=2)
    ap.add_argument("--poll", type=float, default=0.05, help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (deployment)")
    ap.add_argument("--out", default="", help="work folder (default: a temp dir)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="split-bench-"))
    os.environ.setdefault("FLWR_HOME", str(out / "flwr-home"))
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    cfg = config(args)

    results = []
    local_folder, t = run_local(cfg, args.nodes, out)
    local = summarize("in-process (LocalGrid)", rows_of(local_folder), args.iters, t)
    results.append(local)
    sim_folder, t = run_sim(cfg, args.nodes, out)
    sim = summarize("Flower simulation (Ray)", rows_of(sim_folder), args.iters, t)
    sim["max_weight_diff_vs_local"] = max_weight_diff(sim_folder, local_folder)
    results.append(sim)
    if args.deployment:
        dcfg = {**cfg, "num-rounds": args.deploy_rounds, "scala.local-iterations": args.deploy_iters}
        dlocal_folder, t = run_local(dcfg, args.nodes, out / "dlocal")
        dlocal = summarize("in-process, deployment config", rows_of(dlocal_folder), args.deploy_iters, t)
        dep_folder, t = run_deploy(dcfg, args.nodes, out, args.poll)
        dep = summarize("Flower deployment (loopback)", rows_of(dep_folder), args.deploy_iters, t)
        dep["max_weight_diff_vs_local"] = max_weight_diff(dep_folder, dlocal_folder)
        results += [dlocal, dep]

    print(f"\nsplit overhead: scala, {args.nodes} nodes, model={args.model}, B={args.batch}; medians over "
          f"rounds 2..R (round 1 has startup); an exchange = one fused message to every node and back, "
          f"client compute included; clients run one at a time in every runtime but deployment")
    print(f"{'runtime':32s} {'I':>3s} {'round s':>8s} {'exch/rnd':>8s} {'s/exch':>8s} {'overhead ms/exch':>17s} "
          f"{'ratio':>6s} {'max |dw|':>9s}")
    pairs = [(local, sim, args.iters)]
    if args.deployment:
        pairs.append((results[2], results[3], args.deploy_iters))
    for base, r, iters in pairs:
        over = (r["exchange_s"] - base["exchange_s"]) * 1000
        ratio = r["exchange_s"] / base["exchange_s"]
        print(f"{base['name']:32s} {iters:3d} {base['round_s']:8.2f} {base['exchanges_per_round']:8d} "
              f"{base['exchange_s']:8.3f}")
        print(f"{r['name']:32s} {iters:3d} {r['round_s']:8.2f} {r['exchanges_per_round']:8d} {r['exchange_s']:8.3f} "
              f"{over:17.1f} {ratio:6.1f} {r['max_weight_diff_vs_local']:9.2e}")
    (out / "split_overhead.json").write_text(json.dumps(results, indent=1))
    print(f"\nraw numbers: {out / 'split_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
