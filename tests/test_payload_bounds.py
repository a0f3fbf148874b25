"""What a node uploads is held to what the run has seen (split_layer.bounds, strategies.core.round_guard):
one authenticated node with well-formed but scaled payloads is dropped, the others train, and a
round whose loss diverges is not applied."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from split_layer.bounds import StreamBounds, rms
from strategies.core.round_guard import update_norm
from strategies.core.records import METRICS_KEY
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from tests.split_faults import ScaleUploads
from tests.test_conformance import _fresh_plan_cache  # noqa: F401 (autouse: each test plans afresh)
from tests.test_conformance import config

NODES = 4


def _run(algo: str, handler, rounds: int = 2, **policy):
    cfg = config(algo)
    p = parse_run_config(cfg)
    grid = LocalGrid(NODES, handler, run_config=cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name,
                            RoundPolicy(**{"min_nodes": 2, "round_timeout": 60, **policy}))
    rows: list[dict] = []
    s.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    return s, grid, rows


def _largest_weight(s) -> float:
    return max(float(v.abs().max()) for v in s.model.state_dict().values() if v.is_floating_point() and v.numel())


def test_a_scala_node_sending_activations_x100_is_dropped_with_a_log_line_while_the_others_train(caplog):
    clean, _, clean_rows = _run("scala", dispatch)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s, grid, rows = _run("scala", ScaleUploads(partition=1, factor=100.0))
    bad = grid.get_node_ids()[1]
    assert [r["dropped"] for r in rows] == [[bad], [bad]]
    assert [r["participants"] for r in rows] == [NODES - 1] * 2 and not any(r.get("skipped") for r in rows)
    assert f"node {bad} dropped from round: node {bad}: stream 'act' (step 1)" in caplog.text
    assert "payload-bound=10" in caplog.text
    # the model stays in the range of the clean run's (the x100 node accepted: weights grow far beyond it)
    assert _largest_weight(s) <= 1.5 * _largest_weight(clean)
    assert all(math.isfinite(r["train-loss"]) and r["train-loss"] < 10 * clean_rows[-1]["train-loss"] for r in rows)


def test_with_payload_bound_0_the_x100_node_is_accepted():
    """The bound is what refuses it: off, the same node is applied (as before the bound)."""
    _, _, rows = _run("scala", ScaleUploads(partition=1, factor=100.0), rounds=1, payload_bound=0.0)
    assert rows[0]["dropped"] == [] and rows[0]["participants"] == NODES


def test_stream_bounds_from_the_run_statistics():
    rng = np.random.default_rng(0)
    act = {n: {"act": rng.normal(size=(8, 16)).astype(np.float32), "labels": np.arange(8)} for n in range(3)}
    b = StreamBounds(10.0)
    first = {**act, 2: {"act": act[2]["act"] * 100, "labels": act[2]["labels"]}}
    refused = b.refuse(first, "step 1")
    assert list(refused) == [2] and "payload-bound=10" in refused[2] and "step 1" in refused[2]
    # with history, even two nodes (one scaled) are judged against the run's median
    two = {0: {"act": act[0]["act"]}, 1: {"act": act[1]["act"] * 50}}
    assert list(b.refuse(two)) == [1]
    assert b.refuse({0: {"act": act[0]["act"] * 5}}) == {}          # within the bound
    assert StreamBounds(0.0).refuse(first) == {}                      # off
    assert rms(np.full((2, 2), 3.0)) == pytest.approx(3.0) and rms(np.zeros(0)) == 0.0
    assert update_norm({"w": np.ones(4), "n": np.array(3)}, {"w": np.zeros(4), "n": np.array(1)}) == 2.0


def test_a_full_model_upload_beyond_the_norm_bound_is_dropped():
    s, grid, rows = _run("fedavg", ScaleUploads(partition=2, factor=100.0, record="arrays"), rounds=1,
                         upload_norm_bound=50.0)
    bad = grid.get_node_ids()[2]
    assert rows[0]["dropped"] == [bad] and rows[0]["participants"] == NODES - 1
    assert _largest_weight(s) < 10.0
    _, _, off = _run("fedavg", ScaleUploads(partition=2, factor=100.0, record="arrays"), rounds=1)
    assert off[0]["dropped"] == []        # off by default


class _ReportsLoss:
    """The library's node, except that the node of partition 0 reports ``loss`` as its train-loss
    from round ``since`` on."""

    def __init__(self, loss: float, since: int) -> None:
        self.loss, self.since = loss, since

    def __call__(self, msg, context):
        out = dispatch(msg, context)
        rnd = int(msg.content.config_records["config"]["server-round"])
        if msg.metadata.message_type == "train" and context.node_config["partition-id"] == 0 and rnd >= self.since:
            out.content.metric_records[METRICS_KEY]["train-loss"] = self.loss
        return out


@pytest.mark.parametrize("loss, since", [(float("inf"), 1), (1e13, 2)])
def test_a_round_whose_loss_diverges_is_not_applied_and_is_reported(loss, since, caplog):
    """A non-finite train-loss from round 1; a finite one beyond loss-bound x the run's median
    once the run has one (round 2): the round is rolled back to the model of its start."""
    cfg = config("fedavg")
    p = parse_run_config(cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2, round_timeout=60))
    grid = LocalGrid(NODES, _ReportsLoss(loss, since), run_config=cfg)
    starts: list[dict] = []
    rows: list[dict] = []

    def on_end(r, m):
        rows.append(dict(m))
        starts.append({k: v.clone() for k, v in s.model.state_dict().items()})

    s.setup(grid)
    starts.append({k: v.clone() for k, v in s.model.state_dict().items()})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.start(grid, num_rounds=since, on_round_end=on_end)
    last = rows[-1]
    assert last["diverged"] == 1 and last["skipped"] == 1 and s.guard.diverged == [since]
    assert all(not r.get("diverged") for r in rows[:-1])
    assert all(np.array_equal(starts[-2][k].numpy(), v.numpy()) for k, v in s.model.state_dict().items())
    assert f"round {since} diverged (train-loss" in caplog.text and "not applied" in caplog.text


def test_a_diverged_test_loss_is_rolled_back_too():
    """The server's own evaluation of the aggregate (its test loss) is checked as well: an
    aggregate made of an upload x1000 is not kept."""
    s, _, rows = _run("fedavg", ScaleUploads(partition=0, factor=1000.0, record="arrays"), rounds=1)
    assert rows[0].get("diverged") == 1 and math.isfinite(rows[0]["loss"]) and rows[0]["loss"] < 10
    assert _largest_weight(s) < 10.0
