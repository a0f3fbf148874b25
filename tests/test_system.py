"""The simulated system clock (tasks.system): link and compute models against hand
computations, the clock of rounds with known work, measured work, and the run-config key."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from tasks.config import ConfigError
from tasks.system import (
    PRESETS,
    CellLink,
    Compute,
    Dist,
    RangeLink,
    RoundClock,
    SystemModel,
    cell_path_loss_db,
    count_work,
    load_system,
    shannon_rate,
)


def fixed_system(flops=1e9, up_mbps=1.0, down_mbps=2.0, server=1e10, unit="flops") -> SystemModel:
    return SystemModel("t", Compute(unit, ((1.0, Dist("fixed", flops)),)),
                       RangeLink(Dist("fixed", up_mbps), Dist("fixed", down_mbps)), server_flops=server)


# --------------------------------------------------------------------------- links
def test_shannon_rate_of_scalas_cell_by_hand():
    # a node 500 m from the server, 10 MHz shared by 10 transmitters: 1 MHz each
    pl = 128.1 + 37.6 * math.log10(0.5)                 # 116.78 dB
    assert cell_path_loss_db(500.0) == pytest.approx(pl)
    n0 = 10 ** ((-174 - 30) / 10)                        # W/Hz
    snr = 0.2 * 10 ** (-pl / 10) / (n0 * 1e6)
    assert snr == pytest.approx(105.5, rel=1e-3)         # 4.20e-13 W over 3.98e-15 W
    want = 1e6 * math.log2(1 + snr)                      # about 6.73 Mbit/s
    assert want == pytest.approx(6.73e6, rel=1e-3)
    assert shannon_rate(1e6, 0.2, pl, -174.0) == pytest.approx(want)
    cell = CellLink()
    key = next(k for k in range(100) if 400 < cell.distance(0, k) < 600)
    d = cell.distance(0, key)
    up, down = cell.rates(0, key, 3, sharing=10)
    assert up == down == pytest.approx(shannon_rate(1e6, 0.2, cell_path_loss_db(d), -174.0))
    # the band is shared by the stage's transmitters: alone, a node gets all 10 MHz
    assert cell.rates(0, key, 3, sharing=1)[0] > up


def test_cell_places_nodes_uniformly_over_the_disk_once():
    cell = CellLink()
    d = np.array([cell.distance(7, k) for k in range(4000)])
    assert d.max() <= 1000.0
    assert np.mean(d < 500.0) == pytest.approx(0.25, abs=0.03)   # area, not radius
    assert cell.distance(7, 3) == cell.distance(7, 3) != cell.distance(8, 3)


def test_range_link_fluctuates_per_round_and_is_seeded():
    link = PRESETS["semisfl"].link
    ups = [link.rates(0, 5, r, 4)[0] for r in range(200)]
    assert 2e6 <= min(ups) and max(ups) <= 8e6 and len(set(ups)) == 200
    assert link.rates(0, 5, 9, 4) == link.rates(0, 5, 9, 4)
    assert all(10e6 <= link.rates(1, k, 2, 4)[1] <= 20e6 for k in range(50))


def test_scala_compute_is_fixed_per_node_and_semisfl_mixes_two_device_classes():
    scala = PRESETS["scala"].compute
    assert scala.rate(0, 4, 1) == scala.rate(0, 4, 99)
    assert all(1e9 <= scala.rate(0, k, 1) <= 5e9 for k in range(100))
    semi = PRESETS["semisfl"].compute
    classes = [semi.device_of(0, k) for k in range(400)]
    assert 0.4 < np.mean(classes) < 0.6
    assert semi.rate(0, 1, 1) != semi.rate(0, 1, 2)   # drawn per round


# --------------------------------------------------------------------------- the clock
def test_a_synchronous_round_ends_with_its_slowest_node():
    clock = RoundClock(fixed_system(flops=1e9, up_mbps=1.0, down_mbps=2.0, server=1e10), seed=0, timeout=60)
    clock.begin_round(1)
    with clock.stage():   # a full-model round: the model down, local training, the model up
        for key, flops in ((0, 2e9), (1, 5e9), (2, 1e9)):
            clock.add_bytes(key, "down", 250_000)          # 2 Mbit down at 2 Mbit/s: 1 s
            clock.add_work(key, flops, 10)
            clock.add_bytes(key, "up", 125_000)            # 1 Mbit up at 1 Mbit/s: 1 s
    clock.add_server_flops(3e10)                           # 3 s of server work
    m = clock.end_round()
    assert m["sim-seconds"] == pytest.approx(1 + 5 + 1 + 3)
    assert m["sim-server-seconds"] == pytest.approx(3)
    assert m["sim-node-compute-seconds"] == pytest.approx(5)   # the slowest node's 5e9 FLOPs
    assert m["sim-client-flops"] == pytest.approx(8e9)
    assert m["sim-seconds-total"] == pytest.approx(10)
    clock.begin_round(2)
    with clock.stage():
        clock.add_work(0, 1e9, 1)
    assert clock.end_round()["sim-seconds-total"] == pytest.approx(11)


def test_split_exchanges_are_stages_one_after_another():
    # message 1 (bottom down, forward), I = 2 fused exchanges, the final (bottom up): each stage
    # waits for its slowest node, and the server's work between stages adds up
    clock = RoundClock(fixed_system(flops=1e9, up_mbps=8.0, down_mbps=8.0, server=1e9), seed=0, timeout=60)
    clock.begin_round(1)
    per_stage = [  # (node -> (down bytes, flops, up bytes)), server flops after the stage
        ({0: (1e6, 1e9, 1e6), 1: (1e6, 2e9, 1e6)}, 1e9),    # 1 + 1 + 1 vs 1 + 2 + 1 -> 4 s, +1 s
        ({0: (1e6, 3e9, 1e6), 1: (1e6, 1e9, 1e6)}, 2e9),    # 5 s, +2 s
        ({0: (2e6, 0.0, 1e6), 1: (1e6, 0.0, 3e6)}, 0.0),    # max(3, 4) = 4 s
    ]
    for nodes, server in per_stage:
        with clock.stage():
            with clock.stage():   # nested exchanges (transport inside the runtime) are one stage
                for k, (down, flops, up) in nodes.items():
                    clock.add_bytes(k, "down", down)
                    clock.add_work(k, flops, 1)
                    clock.add_bytes(k, "up", up)
        clock.add_server_flops(server)
    m = clock.end_round()
    assert m["sim-stages"] == 3
    assert m["sim-seconds"] == pytest.approx(4 + 1 + 5 + 2 + 4)


def test_a_node_that_never_replies_holds_its_stage_until_the_timeout_and_iteration_seconds():
    clock = RoundClock(fixed_system(flops=0.5, unit="iteration-seconds"), seed=0, timeout=30.0)
    clock.begin_round(1)
    with clock.stage():
        clock.add_work(0, 1e12, 4)      # 4 iterations at 0.5 s (FLOPs do not matter in this unit)
    with clock.stage():
        clock.add_work(0, 0.0, 2)
        clock.missing(1)
    assert clock.end_round()["sim-seconds"] == pytest.approx(2.0 + 30.0)
    # outside a round (evaluation after it) nothing is counted
    with clock.stage():
        clock.add_work(0, 1e12, 100)
    clock.begin_round(2)
    assert clock.end_round()["sim-seconds"] == 0.0


def test_server_work_is_counted_between_stages_only():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    clock = RoundClock(fixed_system(server=1.0), seed=0, timeout=1)
    clock.begin_round(1)
    with clock.server_work():
        lin(x)                       # 2 * 16 * 64 * 32 FLOPs
        with clock.stage():
            lin(x)                   # a node's work in the in-process grid: not the server's
        lin(x)
    assert clock.end_round()["sim-server-flops"] == 2 * (2 * 16 * 64 * 32)


def test_count_work_counts_flops_and_optimizer_steps_of_this_thread():
    net = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    with count_work() as w:
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    fwd = 2 * 8 * (10 * 20 + 20 * 3)
    # backward: grad of weights for both layers, grad of input of the second (not the first: x needs none)
    bwd = 2 * 8 * (10 * 20 + 20 * 3) + 2 * 8 * 20 * 3
    assert w.steps == 3
    assert w.flops == 3 * (fwd + bwd)
    opt.step()                       # outside the block: not counted
    assert w.steps == 3
    # the split server's gradient of a leaf activation works under the counter
    act = torch.randn(4, 10, requires_grad=True)
    with count_work() as w2:
        g, = torch.autograd.grad(net(act).sum(), act)
    assert g.shape == act.shape and w2.flops > 0


def test_augmentation_is_data_preparation_no_count_bills_and_the_model_pass_still_counts():
    """The clock bills the model's passes: a strong view (whose RandAugment ops include
    convolutions and matmuls torch's counter would count) adds no FLOPs to a node's count or
    the server's, leaves the images the same draws give, and the model pass beside it counts
    exactly as alone; a foreign dispatch mode (a user's own FlopCounterMode) still sees it."""
    from torch.utils.flop_counter import FlopCounterMode

    from tasks.augment import Augmenter

    aug = Augmenter(1, 28, flip=False)
    x = torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8)
    lin = torch.nn.Linear(28 * 28, 10, bias=False)
    torch.manual_seed(3)
    plain = aug.strong(x)
    foreign = FlopCounterMode(display=False)
    with foreign:
        torch.manual_seed(3)
        aug.strong(x)
    assert foreign.get_total_flops() > 0         # the augmentation has counted ops of its own
    with count_work() as alone:
        lin(plain.flatten(1))
    with count_work() as w:
        torch.manual_seed(3)
        views = aug.strong(x)
        lin(views.flatten(1))
    assert torch.equal(views, plain)
    assert alone.flops == 2 * 64 * 28 * 28 * 10 and w.flops == alone.flops
    clock = RoundClock(fixed_system(server=1.0), seed=0, timeout=1)
    clock.begin_round(1)
    with clock.server_work():
        aug.weak_strong(x)
        lin(plain.flatten(1))
    assert clock.end_round()["sim-server-flops"] == alone.flops
    with FlopCounterMode(display=False) as outer, count_work() as inner:   # a foreign mode on the stack
        aug.strong(x)
    assert outer.get_total_flops() > 0 and inner.flops == outer.get_total_flops()


# --------------------------------------------------------------------------- the key
def test_system_key_accepts_presets_a_users_toml_and_names_the_key_otherwise(tmp_path):
    assert load_system("none") is None
    assert load_system("scala") is PRESETS["scala"]
    own = tmp_path / "fleet.toml"
    own.write_text("""
description = "two phones"
[compute]
unit = "flops"
[[compute.devices]]
name = "old"
share = 1
rate = {kind = "gaussian", mean = 2e9, std = 1e8, per = "round"}
[[compute.devices]]
name = "new"
share = 3
rate = [4e9, 6e9]
[link]
kind = "range"
up-mbps = [1, 3]
down-mbps = 20
[server]
flops = 5e12
""")
    s = load_system(str(own))
    assert s.compute.names == ("old", "new") and s.server_flops == 5e12
    assert s.link.down_mbps == Dist("fixed", 20.0, per="round")
    cell = tmp_path / "cell.toml"
    cell.write_text('[compute]\nrate = 1e9\n[link]\nkind = "cell"\nradius-m = 200\n')
    assert load_system(str(cell)).link == CellLink(radius_m=200.0)
    for bad, words in (("fast", "system='fast' is not one of none, semisfl, scala"),
                       (str(tmp_path / "missing.toml"), "no such file")):
        with pytest.raises(ConfigError, match=words):
            load_system(bad)
    broken = tmp_path / "broken.toml"
    broken.write_text("[compute\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_system(str(broken))
    nolink = tmp_path / "nolink.toml"
    nolink.write_text('[compute]\nrate = 1e9\n[link]\nkind = "cell"\nradius = 3\n')
    with pytest.raises(ConfigError, match="unknown cell key"):
        load_system(str(nolink))
    for body, words in (('[compute]\nrate = 1e9\n[link]\nkind = "cell"\nbandwidth-hz = 0\n', "bandwidth-hz=0.0 must be a positive"),
                        ('[compute]\nrate = 1e9\n[link]\nkind = "cell"\nshare = "no"\n', "share='no' must be true or false"),
                        ('[compute]\nrate = "fast"\n[link]\nup-mbps = 1\ndown-mbps = 1\n', "compute.rate = 'fast'"),
                        ('[compute]\nrate = nan\n[link]\nup-mbps = 1\ndown-mbps = 1\n', "must be a finite number"),
                        ('link = 3\n[compute]\nrate = 1\n', "must be a table"),
                        ('[compute]\ndevices = [1, 2]\n', "array of tables")):
        bad = tmp_path / "hostile.toml"
        bad.write_text(body)
        with pytest.raises(ConfigError, match=words):
            load_system(str(bad))
    neg = tmp_path / "neg.toml"
    neg.write_text('[compute]\nrate = [5, 1]\n[link]\nup-mbps = 1\ndown-mbps = 1\n')
    with pytest.raises(ConfigError, match="lo <= hi"):
        load_system(str(neg))


def test_run_config_checks_the_system_key_up_front():
    base = {**fused_run_config(None), "algo": "fedavg"}
    assert parse_run_config({**base, "system": "semisfl"}).app.policy().system == "semisfl"
    with pytest.raises(ConfigError, match="system='jetson'"):
        parse_run_config({**base, "system": "jetson"})
    with pytest.raises(ConfigError, match="split-transport='message' only"):
        parse_run_config({**base, "algo": "scala", "system": "scala", "split-transport": "stream"})


# --------------------------------------------------------------------------- whole runs
def _run(tmp_path, algo, system, rounds=1, **over):
    from flower_apps.papers import run_one

    cfg = {**fused_run_config(None), "algo": algo, "num-rounds": rounds, "system": system,
           "run-name": f"{algo}", "results-dir": str(tmp_path), "model": "mlp", "local-steps": 2,
           "batch-size": 16, "partition": "iid", **over}
    folder = run_one(cfg, set(cfg), 2, "inprocess")
    return [json.loads(ln) for ln in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_full_model_round_on_a_fixed_system_is_the_hand_computation(tmp_path):
    sysfile = tmp_path / "fixed.toml"
    sysfile.write_text('[compute]\nrate = 1e9\n[link]\nup-mbps = 1\ndown-mbps = 2\n[server]\nflops = 1e12\n')
    (row,) = _run(tmp_path, "fedavg", str(sysfile))
    # two equal iid nodes: each gets the model, trains 2 steps (half the client FLOPs), sends it back
    down, up = row["bytes.weights.down"] / 2, row["bytes.weights.up"] / 2
    want = down * 8 / 2e6 + row["sim-client-flops"] / 2 / 1e9 + up * 8 / 1e6
    assert row["sim-client-flops"] > 0 and row["sim-server-flops"] == 0
    assert row["sim-seconds"] == pytest.approx(want, rel=1e-9)


def test_a_split_round_on_a_fixed_system_sums_its_exchanges(tmp_path):
    sysfile = tmp_path / "fast.toml"   # compute instant: only the links count
    sysfile.write_text('[compute]\nrate = 1e30\n[link]\nup-mbps = 1\ndown-mbps = 4\n[server]\nflops = 1e30\n')
    rows = _run(tmp_path, "scala", str(sysfile), rounds=2, **{"scala.local-iterations": 3})
    r2 = rows[1]   # round 2: no split-info: message 1 + 3 exchanges + the final reply... I + 1 stages
    assert r2["sim-stages"] == 4
    down = sum(v for k, v in r2.items() if k.startswith("bytes.") and k.endswith(".down"))
    up = sum(v for k, v in r2.items() if k.startswith("bytes.") and k.endswith(".up"))
    # two equal nodes with equal batch shares: every stage's slowest node carries half the bytes
    assert r2["sim-seconds"] == pytest.approx(down / 2 * 8 / 4e6 + up / 2 * 8 / 1e6, rel=1e-9)
    # split-info is asked at the run's start, before the clock times round 1 (strategies.core.partition_count)
    assert rows[0]["sim-stages"] == 4
    assert r2["sim-seconds-total"] == pytest.approx(rows[0]["sim-seconds"] + r2["sim-seconds"])


def test_the_clock_changes_nothing_that_is_trained_and_survives_a_resume(tmp_path):
    plain = _run(tmp_path / "a", "fedavg", "none", rounds=2)
    timed = _run(tmp_path / "b", "fedavg", "semisfl", rounds=2)
    assert [r["accuracy"] for r in plain] == [r["accuracy"] for r in timed]
    assert "sim-seconds" not in plain[0] and timed[1]["sim-seconds-total"] > timed[0]["sim-seconds"] > 0
    # resume after round 1: the total continues from the checkpoint
    from flower_apps.results import RunFolder

    folder = tmp_path / "c" / "fedavg"
    _run(tmp_path / "c", "fedavg", "semisfl", rounds=1)
    rows = _run(tmp_path / "c", "fedavg", "semisfl", rounds=2, resume=True)
    assert RunFolder(folder).last_checkpoint_round() == 2
    assert rows[1]["sim-seconds-total"] == pytest.approx(timed[1]["sim-seconds-total"])


def test_scala_table5_from_the_model_matches_the_papers_columns():
    from flower_apps.cost import PAPER_TABLE5, scala_table5
    from tasks.models import build_model
    from split_layer.cut import cut_cost

    c = cut_cost(build_model("alexnet", in_channels=3, num_classes=10, image_size=32), "conv2", (3, 32, 32), 32, 1)
    assert c["activation-bytes"] == 32 * 64 * 8 * 8 * 4                  # 0.5 MiB per iteration
    assert c["bottom-forward-flops"] == 32 * 2 * (32 * 32 * 32 * 3 * 9 + 16 * 16 * 64 * 32 * 9)   # conv MACs x 2
    for iters, (mb, gflops, fl) in PAPER_TABLE5.items():
        assert (c["activation-bytes"] * iters + c["bottom-bytes"]) / 2 ** 20 == pytest.approx(mb, rel=0.003)
        assert c["bottom-forward-flops"] * iters / 1e9 == pytest.approx(gflops, rel=0.003)
        # full model: our reconstruction has 3.21M parameters against the paper's about 3.7M
        assert c["model-forward-flops"] * iters / 1e9 == pytest.approx(fl, rel=0.015)
    assert "| 10 | 5.07 | 5.08 |" in scala_table5()


def test_semisfl_round_bytes_counted_from_the_model_are_what_the_committed_runs_metered():
    """The `semisfl-round` table's cnn row against round 1 of the committed long-budget runs
    (K_u = 50, B = 64, 3 participants): the bytes each client moved, metric by metric."""
    from flower_apps.cost import semisfl_round, semisfl_round_bytes

    runs = Path(__file__).resolve().parents[1] / "docs" / "paper-results" / "runs" / "semisfl-fmnist-long"
    b = semisfl_round_bytes("cnn", "conv2", 50)

    def round1(run: str) -> dict:
        first = json.loads((runs / run / "metrics.jsonl").read_text().splitlines()[0])
        return {k: v / first["participants"] for k, v in first.items() if k.startswith("bytes.")}

    semi, full = round1("semisfl-s0"), round1("semifl-s0")
    assert semi["bytes.activations.up"] + semi["bytes.weights.up"] == pytest.approx(b["semisfl-up"], rel=1e-6)
    assert (semi["bytes.gradients.down"] + semi["bytes.metrics.down"] + semi["bytes.weights.down"]
            + semi["bytes.teacher-weights.down"]) == pytest.approx(b["semisfl-down"], rel=1e-6)
    assert full["bytes.weights.up"] == pytest.approx(b["full-up"], rel=1e-3)   # float32 + BN counters
    assert full["bytes.weights.down"] == pytest.approx(b["full-down"], rel=1e-3)
    assert "| `alexnet-semisfl` (conv5) | 145.43 | 11.01 | 1.049 |" in semisfl_round(50)


def test_the_documented_toml_example_loads(tmp_path):
    import re

    from tasks.system import SYSTEM_DOC

    (block,) = re.findall(r"```toml\n(.*?)```", SYSTEM_DOC, re.S)
    f = tmp_path / "fleet.toml"
    f.write_text(block)
    s = load_system(str(f))
    assert s.compute.names == ("old-phone", "new-phone") and s.server_flops == 5e12


def test_a_split_iteration_bills_one_forward_and_backward_and_reports_the_recompute_apart(tmp_path):
    """SCALA, one local iteration per round, two iid nodes of the MLP: each node's billed work is
    one bottom forward + backward on its batch (the algorithm's), and the forward pass it runs
    again with a graph when the gradient arrives (a ClientApp process does not outlive a
    message) is ``sim-recompute-flops``, not billed: counted by hand with ``cut_cost``."""
    from split_layer.cut import cut_cost
    from tasks.models import build_model

    sysfile = tmp_path / "fixed.toml"
    sysfile.write_text('[compute]\nrate = 1e9\n[link]\nup-mbps = 1\ndown-mbps = 2\n[server]\nflops = 1e12\n')
    rows = _run(tmp_path, "scala", str(sysfile), rounds=2, **{"scala.local-iterations": 1})
    r2 = rows[1]   # round 2: no split-info exchange
    cfg = json.loads((tmp_path / "scala" / "config.json").read_text())
    model = build_model(cfg["model"], num_classes=10, in_channels=1, image_size=28)
    batches = r2["batch-sizes"]   # B_k of SCALA's Eq. 3, as the round drew them
    assert sum(batches) == cfg["scala.total-batch"] and len(batches) == 2
    per_node = [cut_cost(model, cfg["cut"], (1, 28, 28), b, 1) for b in batches]
    assert r2["sim-client-flops"] == pytest.approx(sum(c["bottom-train-flops"] for c in per_node), rel=1e-9)
    assert r2["sim-recompute-flops"] == pytest.approx(sum(c["bottom-forward-flops"] for c in per_node), rel=1e-9)
