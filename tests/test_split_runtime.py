"""The split runtime: byte accounting, faults, validation, protocol (in-process LocalGrid + one e2e)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from split_layer.cut import bottom_state
from strategies.core.round_policy import RoundPolicy
from strategies.split_base import SplitStrategy
from split_layer.transport import TENSORS_KEY
from split_layer.validation import (
    SplitValidationError,
    TensorSpec,
    check_streams,
    check_tensor,
)
from tasks.training import batch_at, batch_indices, seeded_perms
from tests.faulty_grid import RecordingGrid
from tests.split_faults import fail_at
from strategies.scala.scala import ScalaStrategy

I = 2


def _parsed(extra="", algo="scala"):
    return parse_run_config(fused_run_config([
        f"algo='{algo}' model='cnn' norm='bn' scala.local-iterations={I} scala.total-batch=30 seed=5 {extra}"]))


def _run(extra="", min_nodes=2, handler=dispatch, rounds=1, strategy_cls=None, algo="scala", transport="message",
         fraction=1.0):
    p = _parsed(extra, algo)
    grid = RecordingGrid(3, handler, threaded=transport == "stream")   # the stream needs every node at once
    s = (strategy_cls or p.spec.strategy_cls)(p.task, p.algo, p.spec.name, RoundPolicy(
        min_nodes=min_nodes, round_timeout=30, fraction_train=fraction), split_transport=transport)
    rows = []
    s.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    grid.join()
    return s, grid, rows


def analytic_bytes(s, batch_sizes: list[int], iters: int) -> dict[str, int]:
    """SCALA's Algorithm 1 (Sec. 3.2.2): activations x I + bottom model per participating client (+ labels, gradients)."""
    act = int(np.prod(s.act_shape)) * 4
    bottom = sum(v.numel() * v.element_size() for v in bottom_state(s.model, s.cut).values())
    n = len(batch_sizes)
    return {"bytes.activations.up": iters * sum(batch_sizes) * act, "bytes.gradients.down": iters * sum(batch_sizes) * act,
            "bytes.labels.up": iters * sum(batch_sizes) * 8, "bytes.weights.down": n * bottom,
            "bytes.weights.up": n * bottom}


def test_bytes_equal_analytic_count():
    s, grid, rows = _run()
    r = rows[0]
    assert r["participants"] == 3 and sum(r["batch-sizes"]) == 30
    want = analytic_bytes(s, r["batch-sizes"], I)
    assert {k: r[k] for k in want} == want
    assert r["bytes.histogram.up"] == 3 * 10 * 8       # one-time label histograms
    assert r["bytes.total"] == sum(want.values()) + r["bytes.histogram.up"]
    assert grid.pushed == 3 + 3 * (I + 1)              # info + (I + 1) fused exchanges per node


class _Groups(ScalaStrategy):
    """Records the nodes of every ``server_iteration`` call."""

    def setup_split(self):
        super().setup_split()
        self.calls = []

    def server_iteration(self, step, payloads):
        self.calls.append((step, sorted(payloads)))
        return super().server_iteration(step, payloads)


def test_default_visit_groups_is_one_barrier_group():
    s, grid, rows = _run(strategy_cls=_Groups)
    nodes = sorted(grid.contexts)
    assert SplitStrategy.visit_groups(s, 1, nodes) == [nodes]
    assert s.calls == [(step, nodes) for step in range(1, I + 1)]   # every step: all nodes at once
    assert rows[0]["split-exchanges"] == I + 1 and rows[0]["split-inner-exchanges"] == I - 1


def test_groups_in_turn_cost_the_same_bytes_and_messages():
    """SplitFedV2 (each node its own group): the barrier's bytes and message count, the
    exchanges (and their timing) summed over the groups."""
    s, grid, rows = _run(algo="splitfed-v2", strategy_cls=_Groups)
    r = rows[0]
    assert r["participants"] == 3 and sum(r["batch-sizes"]) == 30
    want = analytic_bytes(s, r["batch-sizes"], I)
    assert {k: r[k] for k in want} == want
    assert r["bytes.total"] == sum(want.values()) + r["bytes.histogram.up"]
    assert grid.pushed == 3 + 3 * (I + 1)
    assert r["split-exchanges"] == 3 * (I + 1) and r["split-inner-exchanges"] == 3 * (I - 1)
    assert all(len(nodes) == 1 for _, nodes in s.calls) and len(s.calls) == 3 * I


class _BadGroups(ScalaStrategy):
    def visit_groups(self, server_round, nodes):
        return [nodes[:1], nodes[:2]]


def test_visit_groups_must_split_the_nodes():
    with pytest.raises(ValueError, match="visit_groups"):
        _run(strategy_cls=_BadGroups)


@pytest.mark.parametrize("transport", ["message", "stream"])
@pytest.mark.parametrize("step", [2, I + 1])
def test_one_of_three_fails_mid_round_and_round_finishes(monkeypatch, transport, step):
    """Partition 1 raises at split step 2 (mid-round) or I + 1 (its final reply): it is dropped,
    the round finishes with the other two, whose bottoms are aggregated (the model moved)."""
    s, grid, rows = _run(handler=fail_at(monkeypatch, 1, step), transport=transport, rounds=2)
    failed = [n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 1]
    for r in rows:
        assert r["dropped"] == failed and r["participants"] == 2 and "skipped" not in r, r
        assert len(r["batch-sizes"]) == 2 and np.isfinite(r["accuracy"])
    fresh = s.env.build_model().state_dict()
    assert max(float((fresh[k].float() - v.float()).abs().max()) for k, v in bottom_state(s.model, s.cut).items()) > 0
    said = [m for m in grid.sent if m.metadata.message_type == "query.split" and m.metadata.dst_node_id in failed]
    if transport == "message":   # it got messages 1..step, no more, in each round
        assert [int(m.content.config_records["config"]["split-step"]) for m in said] == [*range(1, step + 1)] * 2


def test_too_few_left_skips_cleanly_and_restores_server_part(monkeypatch):
    s, grid, rows = _run(min_nodes=3, handler=fail_at(monkeypatch, 1, 2))
    assert rows[0]["skipped"] == 1 and rows[0]["participants"] == 2 and len(rows[0]["dropped"]) == 1
    fresh = s.env.build_model().state_dict()     # same seeded init: nothing was applied
    assert all(torch.equal(fresh[k], v) for k, v in s.model.state_dict().items())


class _NaNGradients(ScalaStrategy):
    def server_iteration(self, step, payloads):
        out = super().server_iteration(step, payloads)
        if step != 1:
            return out
        first = self.order(payloads)[0]
        out[first]["act"] = out[first]["act"].clone()
        out[first]["act"][0, 0] = float("nan")
        return out


def test_client_rejects_nan_gradient_and_server_drops_it():
    s, grid, rows = _run(strategy_cls=_NaNGradients)
    p0 = [n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 0]
    assert rows[0]["dropped"] == p0 and rows[0]["participants"] == 2


def test_server_rejects_bad_activations():
    def corrupting(msg, ctx):
        r = dispatch(msg, ctx)
        if ctx.node_config["partition-id"] == 2 and TENSORS_KEY in r.content.array_records:
            rec = r.content.array_records[TENSORS_KEY]
            act = rec["act"].numpy().copy()
            act[0] = np.inf
            r.content[TENSORS_KEY] = ArrayRecord({"act": Array(act), "labels": Array(rec["labels"].numpy())})
        return r

    s, grid, rows = _run(handler=corrupting)
    p2 = [n for n, c in grid.contexts.items() if c.node_config["partition-id"] == 2]
    assert rows[0]["dropped"] == p2 and rows[0]["participants"] == 2


def test_validation_messages():
    spec = TensorSpec((2, 3), "float32")
    check_tensor("act", np.zeros((2, 3), np.float32), spec)
    for bad, needle in ((np.zeros((2, 4), np.float32), "shape"), (np.zeros((2, 3), np.float64), "dtype"),
                        (np.full((2, 3), np.nan, np.float32), "NaN/Inf")):
        with pytest.raises(SplitValidationError, match=needle):
            check_tensor("act", bad, spec, "node 7")
    with pytest.raises(SplitValidationError, match="outside"):
        check_tensor("labels", np.array([0, 10]), TensorSpec((2,), "int64", 0, 10))
    with pytest.raises(SplitValidationError, match="missing streams"):
        check_streams({"act": np.zeros((2, 3), np.float32)}, {"act": spec, "labels": TensorSpec((2,), "int64")})


def test_split_batch_cursor():
    """The split worker's batches: fixed size across epochs, each sample once per epoch, any
    step recomputable from (seed, step) alone."""
    def step_batch(s):
        return batch_at(10, 4, s, seeded_perms(10, 123), fixed=True)

    b = [step_batch(s) for s in range(5)]
    assert torch.equal(b[3], step_batch(3))                                # recomputable, in any order
    first_epoch = torch.cat(b)[:10]
    assert sorted(first_epoch.tolist()) == list(range(10))                 # each sample once per epoch
    assert all(len(x) == 4 for x in b)
    assert torch.cat(b)[10:20].tolist() != first_epoch.tolist()            # a new permutation per epoch


def test_local_batches_are_the_epoch_cut_of_the_same_cursor():
    """``batch_indices`` (local training) iterates ``batch_at``: epochs cut by batch_bounds (no
    batch of 1: 10 = 4 + 4 + 2 and 9 = 4 + 5), permutations drawn from the generator in turn."""
    got = list(batch_indices(10, 4, 7, torch.Generator().manual_seed(1)))
    assert [len(x) for x in got] == [4, 4, 2, 4, 4, 2, 4]
    gen = torch.Generator().manual_seed(1)
    perms = [torch.randperm(10, generator=gen) for _ in range(3)]
    assert torch.equal(torch.cat(got[:3]), perms[0]) and torch.equal(torch.cat(got[3:6]), perms[1])
    assert [len(x) for x in batch_indices(9, 4, 2, torch.Generator())] == [4, 5]
    assert [len(x) for x in batch_indices(1, 4, 2, torch.Generator())] == [2, 2]   # one sample: twice


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["message"])
def test_fault_through_simulation_engine(tmp_path, monkeypatch, transport):
    """One of three SuperNodes raises mid-round in Flower's simulation engine; the run finishes.

    The failing node is the library's ClientApp under :class:`tests.split_faults.FailAt`
    (pickled to the engine's Ray workers, which install it there). Over the stream the same
    drop is proven on a real gRPC endpoint (``tests/test_split_stream.py``: failing, broken and
    silent nodes) and the stream through the engine by ``test_equivalence_simulation[stream]``
    (one Ray start saved)."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from flower_apps.server_app import run
    from strategies.client import register_actions
    from strategies.registry import query_actions
    from tests.flower_harness import ROOT, hermetic_env, read_metrics
    from tests.split_faults import FailAt

    for k, v in hermetic_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cfg = {**fused_run_config(None), "results-dir": str(tmp_path / "results"), "run-name": "fault",
           "round-timeout": 300.0, "algo": "scala", "num-rounds": 2, "scala.local-iterations": 2,
           "scala.total-batch": 30, "seed": 2, "split-transport": transport}
    out = {}
    server = ServerApp()

    @server.main()
    def _main(grid, context):
        out["folder"] = run(grid, cfg)

    client = register_actions(ClientApp(), ["train", "evaluate", *query_actions()], FailAt(1, 2))
    run_simulation(server_app=server, client_app=client, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1.0 if transport == "message" else 0.5,
                                                        "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR"}})
    rows = read_metrics(out["folder"])
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert r["participants"] == 2 and len(r["dropped"]) == 1 and not r.get("skipped")
        assert len(r["batch-sizes"]) == 2 and r["bytes.weights.up"] > 0


@pytest.mark.e2e
def test_stream_with_too_few_concurrent_clientapps_fails_with_the_setting(tmp_path, monkeypatch):
    """3 nodes, but half the machine's CPUs per ClientApp = 2 at once: a clear error, no hang."""
    from split_layer.stream import StreamConfigError
    from tests.flower_harness import ROOT, hermetic_env, run_simulation_inprocess

    for k, v in hermetic_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cfg = {"algo": "scala", "num-rounds": 1, "scala.local-iterations": 1, "split-transport": "stream"}
    with pytest.raises(StreamConfigError, match=r"all 3 sampled clients.*at most 2 ClientApps.*"
                                                r"init-args-num-cpus=3 client-resources-num-cpus=1"):
        run_simulation_inprocess(cfg, tmp_path / "results", 3, "too-few", client_cpus=(os.cpu_count() or 2) / 2)


def test_a_batch_larger_than_a_nodes_data_is_one_full_batch_with_a_warning(caplog):
    """batch-size=10,000,000 (a node must not allocate for that batch: Ray would kill it for
    its memory): every node trains on all of its samples, logged once per node."""
    import logging

    from tests.test_conformance import build, run
    s, grid = build("semisfl", **{"batch-size": 10_000_000})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        res, rows = run(s, grid, rounds=2)   # (two rounds: the warning is once per node, not per round)
    assert all(r["dropped"] == [] and not r.get("skipped") for r in rows), rows
    sizes = {n: s.directory[n]["n"] for n in s.directory}
    assert s.round_batch == {n: sizes[n] for n in s.round_batch} and max(sizes.values()) < 10_000
    said = [r.getMessage() for r in caplog.records if "batch-size=10000000 is larger" in r.getMessage()]
    assert len(said) == len(sizes), said   # once per node, not once per round
