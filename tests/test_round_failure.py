"""A round whose every node fails with the same error stops the run with that error
(``strategies.core.round_loop.RoundFailedError``, raised from ``start``: ``flwr run`` and the
in-process engine then exit non-zero), instead of skipping every round and returning the
untrained model; a round in which only some nodes fail, or the nodes fail differently, is still
only skipped or run without them (drop tolerance, tests/test_faults.py)."""
import numpy as np
import pytest
from torch import nn

from split_layer.transport import LocalGrid
from strategies.core.round_loop import RoundFailedError
from tasks.models import as_staged


class _Whole(nn.Module):
    """A user's whole, uncut model: split learning cannot cut it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 8))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.body(x))


def _sets(seed: int, n: int = 24):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, n)


def _uncut_node(msg, context):
    """An outside app's ClientApp that cuts its whole model for every message (the split
    algorithm's node code): every node fails the same way."""
    as_staged(_Whole())
    raise AssertionError("not reached")


def _split_strategy(**kw):
    from strategies.scala.scala import ScalaStrategy

    split = (nn.Sequential(nn.Flatten(), nn.Linear(64, 8)), nn.Linear(8, 3))
    return ScalaStrategy(model=split, test_data=_sets(9), min_nodes=2, split_transport="message",
                         local_iterations=2, total_batch=12, **kw)


def test_every_node_failing_with_the_same_error_stops_the_run_with_it():
    s = _split_strategy()
    with pytest.raises(RoundFailedError, match=r"round 1: every node it sent an instruction failed with the same "
                                               r"error, so the run stops: ValueError: a split algorithm needs a "
                                               r"StagedModel, a \(bottom, top\) pair or an nn.Sequential"):
        s.start(LocalGrid(3, _uncut_node), num_rounds=3)


def test_a_full_model_round_whose_nodes_all_fail_the_same_way_stops_the_run_too():
    from strategies.fedavg import FedAvgStrategy

    def broken(msg, context):
        raise RuntimeError("CUDA error: no kernel image is available")

    s = FedAvgStrategy(model=_Whole(), test_data=_sets(9), local_steps=1, batch_size=8, min_nodes=2)
    rows = []
    with pytest.raises(RoundFailedError, match="RuntimeError: CUDA error: no kernel image is available"):
        s.start(LocalGrid(3, broken), num_rounds=2, on_round_end=lambda r, m: rows.append(m))
    assert rows == []   # it stopped at the first round


def test_nodes_failing_differently_or_not_all_failing_only_skip_the_round():
    from strategies.fedavg import FedAvgClient, FedAvgStrategy

    good = FedAvgClient(_Whole(), lambda ctx: {"labeled": _sets(int(ctx.node_config["partition-id"]))})

    def differently(msg, context):   # every node fails, each with its own error: a fault, not a setup error
        if msg.metadata.message_type == "train":
            raise RuntimeError(f"node {context.node_id} lost its disk")
        return good.handle(msg, context)

    def some(msg, context):          # two of three fail the same way: the round runs without them
        if msg.metadata.message_type == "train" and int(context.node_config["partition-id"]) > 0:
            raise RuntimeError("out of memory")
        return good.handle(msg, context)

    for handler, participants, min_nodes in ((differently, 0, 2), (some, 1, 1)):
        s = FedAvgStrategy(model=_Whole(), test_data=_sets(9), local_steps=1, batch_size=8, min_nodes=min_nodes)
        rows = []
        s.start(LocalGrid(3, handler), num_rounds=2, on_round_end=lambda r, m: rows.append(m))
        assert [r["participants"] for r in rows] == [participants] * 2
        assert all(len(r["dropped"]) == 3 - participants for r in rows)
        assert all(r.get("skipped", 0) == (participants < min_nodes) for r in rows)
