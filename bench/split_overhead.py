"""Per-exchange overhead of split learning over Flower messages and over the gRPC stream
transport (a benchmark, not a test).

The same SCALA rounds (same config, same seeds, same math) are run

* in one process: ``split_layer.transport.LocalGrid`` calls the ClientApp handler directly
  (same ``Message`` objects, same ``context.state`` round trip, no Flower runtime);
* through Flower's simulation engine (``run_simulation``, Ray actors), and optionally
* through a local deployment: a ``flower-superlink`` and N ``flower-supernode`` processes on
  127.0.0.1 (insecure, private ``FLWR_HOME``, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` small),
  driven by ``flwr run``; every process is killed by PID at the end
  (``tests/deploy_harness.Deployment``).

Each Flower runtime is run twice, with ``split-transport='message'`` (every exchange a Flower
message) and ``split-transport='stream'`` (Flower messages start and end a client's round,
the exchanges in between go over a gRPC stream hosted by the ServerApp).

Per-exchange overhead = median wall time of one *inner* exchange (steps 2..I: neither the
first, which carries the bottom, nor the last, which returns it) minus the same in one
process (``split-inner-exchange-seconds / split-inner-exchanges``; client compute is inside
both). Round 1 is excluded (Ray/actor start, one-time split-info). The round time compares
whole rounds (Flower start/end messages included). Both simulations give each client
``CPUs / nodes`` (the stream transport needs all clients at once; the message transport gets
the same resources), so their clients compute in parallel while the in-process run computes
them one after the other (with the same intra-op thread count as one actor).

``stream echo`` isolates the channel: the real StreamTransport and StreamClient in one
process, clients that echo a frame of the activations' size back without computing; its
per-exchange time is pure transport overhead (framing, gRPC, threads) for all nodes.

It also reports the largest weight difference between each Flower run and the in-process run
(the in-process run uses as many intra-op threads as the simulation's single ClientApp actor).

    python bench/split_overhead.py                       # simulation + in-process
    python bench/split_overhead.py --deployment          # + local SuperLink/SuperNodes
    python bench/split_overhead.py --iters 5 --rounds 4 --nodes 3
    python bench/split_overhead.py --poll-variants 2     # how the round loop waits, side by side
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


def config(args, transport: str = "message", session: str = "auto") -> dict:
    cfg = {"algo": "scala", "split-transport": transport, "round-timeout": 300.0, "num-rounds": args.rounds,
           "scala.local-iterations": args.iters, "scala.total-batch": args.batch, "model": args.model, "seed": 0,
           "min-nodes": 2, "fraction-train": 1.0, "partition": "quantity", "partition-classes-per-client": 4}
    if transport == "stream":
        cfg["split-stream-session"] = session
    return cfg


MODES = [("message", "auto", "message"), ("stream", "round", "stream, 1-round sessions"),
         ("stream", "run", "stream, run-long sessions")]


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def summarize(name: str, rows: list[dict], iters: int, seconds: float) -> dict:
    ok = [r for r in rows if r.get("split-exchanges") and not r.get("skipped") and not r.get("dropped")]
    if not ok:
        raise RuntimeError(f"{name}: no complete round (all skipped or with dropped nodes); see the log")
    later = [r for r in ok if r["round"] > 1] or ok
    per_ex = [r["split-exchange-seconds"] / r["split-exchanges"] for r in later]
    inner = [r["split-inner-exchange-seconds"] / r["split-inner-exchanges"] for r in later
             if r.get("split-inner-exchanges")]
    # everything of a round but its inner exchanges: the start and end exchanges (Flower round
    # trips, or stream frames for a session that spans rounds), aggregation, evaluation
    fixed = [r["round-seconds"] - r.get("split-inner-exchange-seconds", 0.0) for r in later]
    return {"name": name, "round_s": statistics.median(r["round-seconds"] for r in later),
            "exchange_s": statistics.median(per_ex), "inner_s": statistics.median(inner) if inner else float("nan"),
            "fixed_s": statistics.median(fixed), "first_round_s": rows[0]["round-seconds"],
            "wall_s": seconds, "exchanges_per_round": iters + 1, "rounds": len(rows),
            "bytes_per_round": rows[-1]["bytes.total"], "accuracy": rows[-1]["accuracy"]}


def run_local(cfg: dict, nodes: int, out: Path):
    """The same app logic (ServerApp ``run``) on a LocalGrid."""
    import torch

    from flower_apps.client_app import dispatch
    from flower_apps.server_app import run
    from flower_apps.simulate import fused_run_config
    from split_layer.transport import LocalGrid

    # the simulations below give each ClientApp actor cpus/nodes CPUs, and Ray sets its
    # intra-op threads to max(1, int(that)); use the same here, or float sums differ in the
    # last bits and training amplifies them
    torch.set_num_threads(max(1, int((os.cpu_count() or 1) / nodes)))
    full = {**fused_run_config(None), "results-dir": str(out), "run-name": "local", **cfg}
    t0 = time.time()
    grid = LocalGrid(nodes, dispatch, full, threaded=full.get("split-transport") == "stream")
    folder = run(grid, full)
    grid.join()
    return folder, time.time() - t0


def run_sim(cfg: dict, nodes: int, out: Path, name: str):
    from flower_apps.simulate import fused_run_config, run_simulation_inprocess

    full = {**fused_run_config(None), "results-dir": str(out), "run-name": name, **cfg}
    # every client of a round can run at once (the stream transport needs it; the message
    # transport gets the same resources so that the two are compared like for like)
    client_cpus = float(os.cpu_count() or 1) / nodes
    t0 = time.time()
    folder = run_simulation_inprocess(full, nodes, client_cpus=client_cpus)
    return folder, time.time() - t0


def run_deploy(dep, cfg: dict, name: str):
    t0 = time.time()
    res = dep.run(cfg, name, timeout=3600)
    if res.proc.returncode != 0 or not (res.folder / "metrics.jsonl").exists():
        raise RuntimeError("deployment run failed:\n" + res.output[-3000:])
    return res.folder, time.time() - t0


def _echo_client(address, token, node, cert, shape, reps) -> None:
    import numpy as np

    from split_layer.stream import StreamClient

    c = StreamClient(address, token, node, cert, 60.0)
    c.send({"step": 1}, {"act": np.zeros(shape, np.float32)})
    for step in range(2, reps + 3):
        h, t = c.recv()
        if step <= reps + 1:
            c.send({"step": step}, {"act": t["g"]})
    c.close()


def stream_echo(nodes: int, shape: tuple[int, ...], reps: int) -> float:
    """Median seconds of one exchange (a frame of ``shape`` float32 to every node and back) over
    the real StreamTransport (this process) and StreamClients (one process each) that echo
    without computing."""
    import numpy as np

    from split_layer.stream import STREAM_KEYS, StreamOptions, StreamTransport
    from split_layer.transport import Envelope, LocalGrid, reply

    class Owner:  # the few strategy methods the transport uses
        info: dict = {}
        dropped: list = []

        def base_content(self, server_round, **config):
            from flwr.app import ConfigRecord, RecordDict
            return RecordDict({"config": ConfigRecord(config)})

        def _drop(self, node, why):
            raise RuntimeError(f"echo bench: node {node} dropped: {why}")

    def echo(msg, context):  # the ClientApp side runs in its own process, as in any Flower runtime
        import multiprocessing as mp

        cfg = dict(msg.content.config_records["config"])
        p = mp.get_context("spawn").Process(target=_echo_client, args=(
            cfg[STREAM_KEYS["address"]], cfg[STREAM_KEYS["token"]], int(cfg[STREAM_KEYS["node"]]),
            cfg[STREAM_KEYS["cert"]], shape, reps))
        p.start()
        p.join(120)
        return reply(msg, Envelope(arrays={"bottom": {}}))

    grid = LocalGrid(nodes, echo, threaded=True)
    tr = StreamTransport(Owner(), grid, StreamOptions(timeout=60.0, session="round"))
    ids = grid.get_node_ids()
    g = {"g": np.ones(shape, np.float32)}
    tr.exchange(1, "split", {n: Envelope(config={"split-step": 1, "split-iters": reps + 1}) for n in ids})
    times = []
    for step in range(2, reps + 2):
        t0 = time.perf_counter()
        got = tr.exchange(1, "split", {n: Envelope(tensors=g, config={"split-step": step, "split-iters": reps + 1})
                                       for n in ids})
        times.append(time.perf_counter() - t0)
        assert len(got) == nodes
    tr.exchange(1, "split", {n: Envelope(tensors=g, config={"split-step": reps + 2, "split-iters": reps + 1})
                             for n in ids})
    tr.close()
    grid.join()
    return statistics.median(times)


def max_weight_diff(a: Path, b: Path) -> float:
    import torch

    x, y = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in x if x[k].numel())


def semisfl_config(rounds: int) -> dict:
    """Semi-SFL at its defaults (K_u = 50, K_s = 50 adaptive) over the stream, sessions 'auto'."""
    return {"algo": "semisfl", "split-transport": "stream", "split-stream-session": "auto", "round-timeout": 300.0,
            "num-rounds": rounds, "seed": 0, "min-nodes": 2}


#: the ways an exchange can wait for replies (``ExchangeWindow.poll_interval``): every 10 ms
#: throughout, backing off from the first pull, every 10 ms for the first 0.1 s after a reply
#: then backing off, and the same with 0.4 s (the library's default)
POLL_VARIANTS = {"fixed 10 ms": float("inf"), "backoff from the push": 0.0, "10 ms for 0.1 s, then backoff": 0.1,
                 "10 ms for 0.4 s, then backoff": 0.4}


def poll_variants(args, out: Path, measure, results: list) -> int:
    """The message transport's split rounds in simulation under each :data:`POLL_VARIANTS`,
    interleaved ``args.poll_variants`` times (the ServerApp runs in this process, so the class
    attribute applies to it); medians per variant, and each over the fixed poll's."""
    from strategies.core.exchange_window import ExchangeWindow

    local_folder, t = run_local(config(args), args.nodes, out)
    local = measure("in-process (LocalGrid)", local_folder, t, None, args.iters)
    saved = ExchangeWindow.POLL_FAST_SECONDS
    by = {name: [] for name in POLL_VARIANTS}
    try:
        for rep in range(args.poll_variants):
            for i, (name, fast) in enumerate(POLL_VARIANTS.items()):
                ExchangeWindow.POLL_FAST_SECONDS = fast
                folder, t = run_sim(config(args), args.nodes, out / f"poll-{rep}-{i}", f"poll-{rep}-{i}")
                by[name].append(measure(f"simulation, message, {name}, #{rep + 1}", folder, t, local_folder,
                                        args.iters))
    finally:
        ExchangeWindow.POLL_FAST_SECONDS = saved
    print(f"\nsplit rounds over Flower messages in simulation (scala, {args.nodes} nodes, model={args.model}, "
          f"B={args.batch}, I={args.iters}, {args.rounds} rounds), by how the exchange waits for replies; "
          f"medians over rounds 2..R, then over {args.poll_variants} interleaved runs:")
    print(f"{'waiting':32s} {'round s':>8s} {'s/inner exch':>12s} {'inner vs fixed':>14s} {'|dw| local':>10s}")
    base = statistics.median(r["inner_s"] for r in by["fixed 10 ms"])
    print(f"{'(in one process)':32s} {local['round_s']:8.2f} {local['inner_s']:12.4f}")
    for name, rs in by.items():
        inner = statistics.median(r["inner_s"] for r in rs)
        print(f"{name:32s} {statistics.median(r['round_s'] for r in rs):8.2f} {inner:12.4f} {inner / base:14.2f} "
              f"{max(r['max_weight_diff_vs_local'] for r in rs):10.2e}")
    (out / "split_overhead.json").write_text(json.dumps(results, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--deployment", action="store_true", help="also run a local SuperLink + SuperNodes")
    ap.add_argument("--deploy-rounds", type=int, default=4, help="rounds of the stream runs in the deployment part")
    ap.add_argument("--deploy-message-rounds", type=int, default=2,
                    help="rounds of the message-transport runs in the deployment part (each costs minutes)")
    ap.add_argument("--deploy-iters", type=int, default=4)
    ap.add_argument("--semisfl-rounds", type=int, default=20,
                    help="with --deployment: a Semi-SFL run (K_u = 50) of this many rounds in one process, in "
                         "simulation and in the deployment, end to end (0 = skip)")
    ap.add_argument("--poll", type=float, default=0.05, help="FLWR_SUPEREXEC_TASK_POLL_INTERVAL (deployment)")
    ap.add_argument("--out", default="", help="work folder (default: a temp dir)")
    ap.add_argument("--poll-variants", type=int, default=0, metavar="REPEATS",
                    help="instead of the above: the message transport in simulation under each way of "
                         "waiting for replies (ExchangeWindow.POLL_FAST_SECONDS), interleaved REPEATS times")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="split-bench-"))
    os.environ.setdefault("FLWR_HOME", str(out / "flwr-home"))
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    t_start = time.time()
    results, pairs = [], []

    def measure(name, folder, seconds, base_folder, iters):
        r = summarize(name, rows_of(folder), iters, seconds)
        if base_folder is not None:
            r["max_weight_diff_vs_local"] = max_weight_diff(folder, base_folder)
        results.append(r)
        return r

    if args.poll_variants:
        return poll_variants(args, out, measure, results)
    # ---- simulation vs one process
    local_folder, t = run_local(config(args), args.nodes, out)
    local = measure("in-process (LocalGrid)", local_folder, t, None, args.iters)
    folders = {}
    for tr, sess, label in MODES:
        folders[label], t = run_sim(config(args, tr, sess), args.nodes, out, f"simulation-{tr}-{sess}")
        pairs.append((local, measure(f"simulation, {label}", folders[label], t, local_folder, args.iters), args.iters))
    semisfl = []
    if args.deployment:
        from tests.deploy_harness import Deployment

        drounds = {"message": args.deploy_message_rounds, "stream": args.deploy_rounds}
        dlocal, dlocal_folder, dsim = {}, {}, {}
        for tr, rounds in drounds.items():
            dcfg = {"num-rounds": rounds, "scala.local-iterations": args.deploy_iters}
            dlocal_folder[tr], t = run_local({**config(args), **dcfg}, args.nodes, out / f"dlocal-{tr}")
            dlocal[tr] = measure(f"in-process, deployment config, {rounds} rounds", dlocal_folder[tr], t, None,
                                 args.deploy_iters)
        for tr, sess, label in MODES:
            dcfg = {"num-rounds": drounds[tr], "scala.local-iterations": args.deploy_iters}
            folder, t = run_sim({**config(args, tr, sess), **dcfg}, args.nodes, out / "dsim", f"dsim-{tr}-{sess}")
            dsim[label] = measure(f"simulation, {label}, depl. config", folder, t, dlocal_folder[tr],
                                  args.deploy_iters)
        with Deployment(out / "deploy", num_nodes=args.nodes, poll_interval=args.poll) as dep:
            dfolders = {}
            for tr, sess, label in MODES:
                dcfg = {"num-rounds": drounds[tr], "scala.local-iterations": args.deploy_iters}
                dfolders[label], t = run_deploy(dep, {**config(args, tr, sess), **dcfg}, f"deployment-{tr}-{sess}")
                r = measure(f"deployment, {label}", dfolders[label], t, dlocal_folder[tr], args.deploy_iters)
                r["round_vs_simulation"] = r["round_s"] / dsim[label]["round_s"]
                pairs.append((dlocal[tr], r, args.deploy_iters))
            if args.semisfl_rounds:
                scfg = semisfl_config(args.semisfl_rounds)
                f_local, t_local = run_local(scfg, args.nodes, out / "semisfl-local")
                f_sim, t_sim = run_sim(scfg, args.nodes, out / "semisfl-sim", "semisfl-sim")
                f_dep, t_dep = run_deploy(dep, scfg, "semisfl-deployment")
                for name, f, t in (("in-process", f_local, t_local), ("simulation", f_sim, t_sim),
                                   ("deployment", f_dep, t_dep)):
                    rows = rows_of(f)
                    semisfl.append({"name": f"semisfl {name}", "wall_s": t, "rounds": len(rows),
                                    "round_s": statistics.median(r["round-seconds"] for r in rows[1:] or rows),
                                    "first_round_s": rows[0]["round-seconds"], "accuracy": rows[-1]["accuracy"],
                                    "max_weight_diff_vs_local": max_weight_diff(f, f_local)})
                results.extend(semisfl)
    act = (args.batch // args.nodes, 32, 14, 14) if args.model == "cnn" else (args.batch // args.nodes, 128)
    echo_s = stream_echo(args.nodes, act, 20)
    tiny_s = stream_echo(args.nodes, (1, 10), 20)

    print(f"\nsplit overhead: scala, {args.nodes} nodes, model={args.model}, B={args.batch}; medians over "
          f"rounds 2..R (round 1 has startup). An exchange = gradients to every node and their next "
          f"activations back, client compute included; 'inner' = steps 2..I only; 'fixed' = a round's time "
          f"outside its inner exchanges (start and end of the round, aggregation, evaluation).")
    print(f"{'runtime, transport':48s} {'I':>3s} {'R':>3s} {'round s':>8s} {'fixed s':>8s} {'s/inner exch':>12s} "
          f"{'overhead ms':>12s} {'ratio':>6s} {'round/sim':>9s} {'|dw| local':>10s}")
    shown = set()
    for base, r, iters in pairs:
        if base["name"] not in shown:
            shown.add(base["name"])
            print(f"{base['name']:48s} {iters:3d} {base['rounds']:3d} {base['round_s']:8.2f} {base['fixed_s']:8.2f} "
                  f"{base['inner_s']:12.4f}")
        over = (r["inner_s"] - base["inner_s"]) * 1000
        ratio = r["inner_s"] / base["inner_s"]
        rs = f"{r['round_vs_simulation']:9.2f}" if "round_vs_simulation" in r else f"{'':9s}"
        print(f"{r['name']:48s} {iters:3d} {r['rounds']:3d} {r['round_s']:8.2f} {r['fixed_s']:8.2f} "
              f"{r['inner_s']:12.4f} {over:12.1f} {ratio:6.2f} {rs} {r['max_weight_diff_vs_local']:10.2e}")
    for label, r in dsim.items() if args.deployment else ():
        print(f"  (simulation, {label}, depl. config: {r['round_s']:.2f} s/round, fixed {r['fixed_s']:.2f} s, "
              f"|dw| local {r['max_weight_diff_vs_local']:.2e})")
    print(f"stream echo (no compute), {args.nodes} nodes, float32{list(act)} each way: "
          f"{echo_s * 1000:.2f} ms per exchange; tiny frames: {tiny_s * 1000:.2f} ms")
    if semisfl:
        sim_wall = next(r["wall_s"] for r in semisfl if r["name"] == "semisfl simulation")
        print(f"\nSemi-SFL end to end ({args.semisfl_rounds} rounds, K_u = 50, stream, sessions 'auto'); wall = "
              f"the whole run (simulation: run_simulation with Ray start; deployment: `flwr run --stream` against "
              f"the running SuperLink and SuperNodes):")
        for r in semisfl:
            print(f"  {r['name']:24s} wall {r['wall_s']:8.1f} s ({r['wall_s'] / sim_wall:5.2f}x simulation)  "
                  f"round 1 {r['first_round_s']:6.2f} s, median round {r['round_s']:6.2f} s  acc {r['accuracy']:.4f}  "
                  f"|dw| local {r['max_weight_diff_vs_local']:.2e}")
    print("|dw| local: largest weight difference to the in-process run of the same config.")
    results.append({"name": "stream echo", "exchange_s": echo_s, "shape": list(act), "tiny_exchange_s": tiny_s})
    (out / "split_overhead.json").write_text(json.dumps(results, indent=1))
    print(f"\nbench wall time {time.time() - t_start:.0f} s; raw numbers: {out / 'split_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
