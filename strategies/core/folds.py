"""Aggregation as a fold: a round's train replies are added one by one as they arrive and let
go (:class:`TrainFold`; FedAvg is its default, the mean weighted by each node's training-set size
``num-examples``), and :func:`fold_train_round`, the FedAvg-shaped round (configure, exchange
into the fold, finish).

The weights follow Flower's convention: a train reply's ``num-examples`` is the node's
training-set size |D_k| (McMahan et al. 2017, Algorithm 1: ``w <- sum_k n_k/n w_k``, n_k the
client's number of examples), and the samples its local steps processed go out as
``processed-examples`` (:func:`sized_metrics`). The round policy's ``upload-weight``
(:func:`upload_weight`) chooses between them; with ``local-steps`` set every node that holds a
full batch processes the same number of samples, so ``processed-examples`` weighs those nodes
alike whatever their data."""
from __future__ import annotations

import math
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from tasks.aggregate import RunningWeightedMean

from tasks.config import ConfigError

from .records import ARRAYS_KEY, METRICS_KEY, record_to_numpy

__all__ = ["TrainFold", "fold_train_round", "sized_metrics", "upload_weight", "PROCESSED_KEY"]

#: a train reply's metric: the samples the node's local steps processed this round
PROCESSED_KEY = "processed-examples"


def sized_metrics(metrics: dict[str, Any], dataset_size: int) -> dict[str, Any]:
    """A train reply's metrics in Flower's convention: ``num-examples`` = ``dataset_size`` (the
    node's training set |D_k|, FedAvg's weight), and the samples the local training processed
    (the trainers' ``num-examples``, :func:`tasks.training.train_supervised`) as
    :data:`PROCESSED_KEY`."""
    return {**metrics, PROCESSED_KEY: float(metrics["num-examples"]), "num-examples": float(dataset_size)}


def upload_weight(policy: Any, metrics: Any) -> float:
    """The weight of one train reply in a FedAvg-style mean, as the round policy's
    ``upload-weight`` says: the node's training-set size (``num-examples``, the default) or
    the samples it processed (:data:`PROCESSED_KEY`)."""
    how = getattr(policy, "upload_weight", "dataset-size")
    if how == "dataset-size":
        return float(metrics["num-examples"])
    if how != "processed-examples":
        raise ConfigError(f"upload-weight={how!r} is not one of: dataset-size, processed-examples")
    if PROCESSED_KEY not in metrics:
        raise ConfigError(f"upload-weight=processed-examples, but a train reply carries no '{PROCESSED_KEY}' "
                          f"metric (this algorithm's client does not report it): use upload-weight=dataset-size")
    return float(metrics[PROCESSED_KEY])


class TrainFold:
    """One round's train replies folded in as they arrive (the strategy's ``train_fold``): the
    weighted mean of the uploaded states (``ARRAYS_KEY``) and of the strategy's
    ``reply_metrics``, kept as running float64 sums (:class:`tasks.aggregate.RunningWeightedMean`),
    so the server holds one model's worth of sums however many nodes reply. Weights: each
    reply's :func:`upload_weight` (FedAvg's n_k = |D_k|, the reply's ``num-examples``; or its
    ``processed-examples`` with ``upload-weight=processed-examples``), or 1 (``uniform=True``).
    A node that does not reply adds nothing: the weights renormalise over those that did
    (``sum_k n_k`` runs over the replies). :meth:`finish` loads the mean
    into the global model (``strategy.load_aggregate``) and returns Flower's ``(arrays,
    metrics)``; fewer than ``min-nodes`` replies, or no weight: ``(None, None)``."""

    def __init__(self, strategy: Any, uniform: bool = False) -> None:
        self.strategy, self.uniform = strategy, uniform
        self.mean = RunningWeightedMean()
        self.values = {k: [0.0, 0.0] for k in strategy.reply_metrics}   # sum w v, sum w
        self.count = 0

    def weight(self, metrics: MetricRecord) -> float:
        return 1.0 if self.uniform else upload_weight(self.strategy.policy, metrics)

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
