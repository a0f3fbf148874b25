"""Aggregation as a fold: a round's train replies are added one by one as they arrive and let
go (:class:`TrainFold`; FedAvg is its default, the ``num-examples``-weighted mean), and
:func:`fold_train_round`, the FedAvg-shaped round (configure, exchange into the fold, finish)."""
from __future__ import annotations

import math
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from tasks.aggregate import RunningWeightedMean

from .records import ARRAYS_KEY, METRICS_KEY, record_to_numpy

__all__ = ["TrainFold", "fold_train_round"]


class TrainFold:
    """One round's train replies folded in as they arrive (the strategy's ``train_fold``): the
    weighted mean of the uploaded states (``ARRAYS_KEY``) and of the strategy's
    ``reply_metrics``, kept as running float64 sums (:class:`tasks.aggregate.RunningWeightedMean`),
    so the server holds one model's worth of sums however many nodes reply. Weights: each
    reply's ``num-examples`` (FedAvg), or 1 (``uniform=True``). :meth:`finish` loads the mean
    into the global model (``strategy.load_aggregate``) and returns Flower's ``(arrays,
    metrics)``; fewer than ``min-nodes`` replies, or no weight: ``(None, None)``."""

    def __init__(self, strategy: Any, uniform: bool = False) -> None:
        self.strategy, self.uniform = strategy, uniform
        self.mean = RunningWeightedMean()
        self.values = {k: [0.0, 0.0] for k in strategy.reply_metrics}   # sum w v, sum w
        self.count = 0

    def weight(self, metrics: MetricRecord) -> float:
        return 1.0 if self.uniform else float(metrics["num-examples"])

    def add(self, reply: Message) -> None:
        met = reply.content.metric_records[METRICS_KEY]
        w = self.weight(met)
        self.mean.add(record_to_numpy(reply.content.array_records[ARRAYS_KEY]), w)
        for k, acc in self.values.items():
            acc[0] += w * float(met.get(k, float("nan")))
            acc[1] += w
        self.count += 1

    def finish(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        s = self.strategy
        if self.count < s.policy.min_nodes or self.mean.total <= 0:
            return None, None
        s.load_aggregate(self.mean.result())
        return s.global_arrays(), MetricRecord({k: a / b if b > 0 else math.nan for k, (a, b) in self.values.items()})


def fold_train_round(strategy: Any, server_round: int, grid: Grid, base: type) -> dict[str, Any]:
    """One FedAvg-shaped round of ``strategy``: Flower's ``configure_train``, the replies folded
    into its ``train_fold`` as they arrive, ``finish``; returns the round's metrics. A strategy
    that overrides ``aggregate_train`` without a ``train_fold`` of its own (a user's Flower-style
    strategy; ``base``: the class whose two methods are the defaults) gets every reply as a list."""
    s = strategy
    msgs = list(s.configure_train(server_round, s.global_arrays(), ConfigRecord(), grid))
    cls = type(s)
    if cls.aggregate_train is not base.aggregate_train and cls.train_fold is base.train_fold:
        replies = s.exchange(grid, msgs)
        folded = len(replies)
        arrays, metrics = s.aggregate_train(server_round, replies)
    else:
        fold = s.train_fold(server_round)
        folded = s.exchange_fold(grid, msgs, fold.add)
        arrays, metrics = fold.finish()
    out: dict[str, Any] = {"participants": folded}
    if arrays is None:
        out["skipped"] = 1
        log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round,
            folded, s.policy.min_nodes)
    if metrics is not None:
        out.update(dict(metrics))
    return out
