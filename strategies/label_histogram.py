"""The ``label-histogram`` query: a node's class counts, asked once per node by the algorithms
that choose or group clients by their label distribution (Fed-CBS's sampling in
:mod:`strategies.scala.fedcbs`, FedConcat's clustering in :mod:`strategies.scala.fedconcat`).
A split algorithm that needs the histograms (``asks_histogram``: SCALA's priors, CS-SFL's
selection) gets the same counts in its one ``split-info`` reply instead
(:mod:`split_layer.split_info`), which saves the query; both are computed by
:func:`tasks.data.label_counts`.

**It discloses each node's label histogram to the server.** Fed-CBS's paper protects the
inner products with homomorphic encryption and FedConcat's offers Laplace noise; here the
counts are plain unless the algorithm asks for noise (``label-noise-eps`` in the query's
config: each node adds Laplace(0, n/eps) to each count, i.e. Laplace(0, 1/eps) to its label
distribution, as FedConcat's ``--eps``). The histogram is the algorithm's input, not a metric,
so it is sent whatever the node's ``share-label-metrics`` consent says; the algorithms that ask
for it say so in their docstrings.

Node side (:func:`client_label_histogram`, an algorithm's client handler under
``"label-histogram"``): the reply carries ``config`` with ``partition-id``,
``num-partitions`` and ``num-examples`` (n, the node's labeled samples) and the array record
``label-histogram`` with ``counts`` (float64 ``[M]``; byte kind ``histogram``).

Server side (:class:`LabelHistograms`, mixed into a strategy): :meth:`learn_histograms` asks
each node once through :meth:`BaseStrategy.exchange` (timeouts, error replies and byte
accounting as for any message: a node that fails the query is in the round's ``dropped``),
checks every reply and keeps the usable ones by partition id
(:attr:`histograms`, :attr:`label_sizes`); a node that gives none is logged and not asked again.
"""
from __future__ import annotations

from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from strategies.core.records import CONFIG_KEY, client_env, node_info, numpy_to_record, query
from tasks.data import label_counts
from tasks.training import derive_seed

HISTOGRAM = "label-histogram"   # the query action, and the array record of its reply
NOISE_KEY = "label-noise-eps"   # the query config's noise level (0 = exact counts)


def client_label_histogram(msg: Message, context: Context) -> Message:
    """The ``label-histogram`` query: this node's partition, its labeled-sample count n and its
    class counts ``[M]`` (plus Laplace(0, n/eps) noise per class when the query asks for it,
    seeded by the run seed and the partition)."""
    env = client_env(msg, context, label_mode="all")
    y = env.labeled().y
    m = int(env.num_classes)
    counts = label_counts(y, m, "label-histogram").astype(np.float64)
    eps = float(msg.content.config_records[CONFIG_KEY].get(NOISE_KEY, 0.0))
    if eps > 0:
        rng = np.random.default_rng(derive_seed(env.task.seed, "label-histogram-noise", env.partition_id))
        counts = counts + rng.laplace(0.0, max(len(y), 1) / eps, size=m)
    info = dict(node_info(msg, context).content.config_records[CONFIG_KEY])
    info["num-examples"] = int(len(y))
    return Message(RecordDict({CONFIG_KEY: ConfigRecord(info), HISTOGRAM: numpy_to_record({"counts": counts})}),
                   reply_to=msg)


class LabelHistograms:
    """The server side of the ``label-histogram`` query, mixed into a :class:`BaseStrategy`
    subclass (``class X(LabelHistograms, FedAvgStrategy)``)."""

    #: Laplace noise the nodes add (0 = exact counts); an algorithm with a noise knob overrides
    label_noise_eps: float = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.histograms: dict[int, np.ndarray] = {}   # partition id -> class counts [M] (as sent)
        self.label_sizes: dict[int, int] = {}          # partition id -> n (labeled samples)
        self.hist_asked: set[int] = set()              # node ids asked (once each)
        super().__init__(*args, **kwargs)

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        return "histogram" if key == HISTOGRAM else super().record_kind(key, msg, direction)

    def histogram_of(self, node: int) -> np.ndarray | None:
        """The class counts node ``node`` sent (``None``: none, or not usable)."""
        pid = self.partition_of.get(node)
        return None if pid is None else self.histograms.get(pid)

    def label_distribution(self, pid: int) -> np.ndarray:
        """Partition ``pid``'s label distribution counts / n (noised as the node noised them)."""
        return self.histograms[pid] / max(self.label_sizes.get(pid, 0), 1)

    def learn_histograms(self, grid: Grid, nodes: list[int], server_round: int) -> None:
        """Ask every node of ``nodes`` not asked before for its label histogram (one query each,
        at most ``min(round-timeout, 120 s)``), and keep the usable replies."""
        todo = [n for n in nodes if n not in self.hist_asked and self.histogram_of(n) is None]
        if not todo:
            return
        self.hist_asked.update(todo)
        msgs = [query(self.base_content(server_round, action=HISTOGRAM, **{NOISE_KEY: float(self.label_noise_eps)}),
                      n, HISTOGRAM, str(server_round)) for n in todo]
        answered = set()
        for r in self.exchange(grid, msgs, timeout=min(self.policy.round_timeout, 120.0)):
            answered.add(r.metadata.src_node_id)
            self.note_histogram(r.metadata.src_node_id, r)
        for n in sorted(set(todo) - answered):
            log(WARNING, "%s: node %s gave no label histogram; it is not asked again", self.algo, n)

    def note_histogram(self, node: int, reply: Message) -> None:
        """Check a ``label-histogram`` reply; keep it (by partition id) if usable, else log why."""
        try:
            info = reply.content.config_records[CONFIG_KEY]
            counts = reply.content.array_records[HISTOGRAM]["counts"].numpy().astype(np.float64)
            pid, num, n = int(info["partition-id"]), int(info.get("num-partitions", 0)), int(info["num-examples"])
        except (KeyError, TypeError, ValueError) as e:
            log(WARNING, "%s: node %s sent a malformed label-histogram reply (%s)", self.algo, node, e)
            return
        self.note_partition(node, pid, num)
        m = self.env.num_classes
        exact = self.label_noise_eps == 0
        if (counts.shape != (m,) or not np.isfinite(counts).all() or n <= 0
                or (exact and ((counts < 0).any() or counts.sum() <= 0))):
            log(WARNING, "%s: node %s sent an unusable label histogram (shape %s, n = %s; needed: %d finite "
                "counts, non-negative and not all 0 without noise)", self.algo, node, counts.shape, n, m)
            return
        self.histograms[pid], self.label_sizes[pid] = counts, n

    def histogram_state(self) -> dict[str, Any]:
        pids = sorted(self.histograms)
        return {"hist-pids": pids, "hist": [self.histograms[p] for p in pids],
                "hist-n": [self.label_sizes[p] for p in pids]}

    def load_histogram_state(self, state: dict[str, Any]) -> None:
        pids = [int(p) for p in state.get("hist-pids", [])]
        self.histograms = {p: np.asarray(h, dtype=np.float64) for p, h in zip(pids, state.get("hist", []))}
        self.label_sizes = {p: int(n) for p, n in zip(pids, state.get("hist-n", []))}
