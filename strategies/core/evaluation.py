"""Federated evaluation through Flower's evaluate hooks: :func:`federated_evaluation`."""
from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid

from .records import model_to_record

__all__ = ["federated_evaluation", "evaluates_on_nodes"]


def evaluates_on_nodes(strategy: Any) -> bool:
    """Whether ``strategy`` has a federated evaluation (it overrides ``configure_evaluate``)."""
    from .round_loop import RoundLoopStrategy

    return type(strategy).configure_evaluate is not RoundLoopStrategy.configure_evaluate


def federated_evaluation(strategy: Any, server_round: int, grid: Grid) -> dict[str, Any]:
    """Round ``server_round``'s federated evaluation: the messages of the strategy's
    ``configure_evaluate`` (Flower's hook; with the global model and ``evaluate_config``)
    exchanged, their replies to its ``aggregate_evaluate``; its metrics (``{}``: none). Not asked
    of a strategy without one (:func:`evaluates_on_nodes`) nor in a round it does not evaluate
    (``evaluates_round``): no global arrays are built for nothing."""
    s = strategy
    if not evaluates_on_nodes(s) or not s.evaluates_round(server_round):
        return {}
    msgs = list(s.configure_evaluate(server_round, model_to_record(s.model), ConfigRecord(s.evaluate_config), grid))
    if not msgs:
        return {}
    agg = s.aggregate_evaluate(server_round, s.exchange(grid, msgs))
    return dict(agg) if agg is not None else {}
