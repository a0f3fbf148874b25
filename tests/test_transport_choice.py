"""``split-transport='auto'`` (the default): the stream where the nodes fit it (Flower's simulation
engine running a round's sampled ClientApps at once, no simulated system), Flower messages
otherwise; the run's weights are the same either way."""
from __future__ import annotations

import pytest
import torch

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from split_layer import worker
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid


def _strategy(transport: str, system: str = "none", fraction: float = 1.0):
    cfg = {**fused_run_config(None), "algo": "scala", "model": "mlp", "scala.local-iterations": 2,
           "scala.total-batch": 16, "batch-size": 8, "seed": 4}
    p = parse_run_config(cfg)
    return p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(
        fraction_train=fraction, min_nodes=2, round_timeout=60, system=system), split_transport=transport)


@pytest.mark.parametrize("concurrent, fraction, system, expected", [
    ((0, 0), 1.0, "none", "message"),       # not a simulation: a deployment's nodes may not reach the port
    ((2, 6), 1.0, "none", "message"),       # 2 ClientApps at once, 3 nodes sampled
    ((3, 6), 1.0, "none", "stream"),        # every sampled node's ClientApp at once
    ((2, 6), 0.6, "none", "stream"),        # 2 of the 3 nodes sampled
    ((8, 2), 1.0, "none", "message"),       # Flower's worker threads bound it too
    ((3, 6), 1.0, "semisfl", "message"),    # a simulated system times message exchanges only
])
def test_auto_takes_the_stream_only_where_the_nodes_fit_it(monkeypatch, concurrent, fraction, system, expected):
    monkeypatch.setattr(worker, "simulation_concurrency", lambda: concurrent)
    s = _strategy("auto", system, fraction)
    grid = LocalGrid(3, dispatch)
    s.setup(grid)
    assert s.transports.chosen(grid) == expected


@pytest.mark.parametrize("transport", ["message", "stream"])
def test_a_named_transport_is_taken_as_named(monkeypatch, transport):
    monkeypatch.setattr(worker, "simulation_concurrency", lambda: (0, 0))
    s = _strategy(transport)
    grid = LocalGrid(3, dispatch)
    s.setup(grid)
    assert s.transports.chosen(grid) == transport


def test_auto_over_the_stream_gives_the_weights_of_the_message_transport(monkeypatch):
    """A simulation that fits every node: auto runs the stream, and its weights equal those of a
    run over Flower messages, bit for bit."""
    monkeypatch.setattr(worker, "simulation_concurrency", lambda: (3, 6))
    weights = {}
    for transport in ("auto", "message"):
        s = _strategy(transport)
        grid = LocalGrid(3, dispatch, threaded=True)
        s.start(grid, num_rounds=2)
        grid.join()
        assert s.transports.chosen(grid) == ("stream" if transport == "auto" else "message")
        weights[transport] = {k: v.clone() for k, v in s.model.state_dict().items()}
    assert all(torch.equal(weights["auto"][k], weights["message"][k]) for k in weights["message"])
