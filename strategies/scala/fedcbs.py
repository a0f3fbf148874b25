"""Fed-CBS: FedAvg whose server samples a class-balanced set of clients (SCALA's full-model
baseline: the SCALA paper's Sec. 5.1, Table III; ``docs/baselines.md`` B3).

J. Zhang, A. Li, M. Tang, J. Sun, X. Chen, F. Zhang, C. Chen, Y. Chen, H. Li, "Fed-CBS: A
Heterogeneity-Aware Client Sampling Mechanism for Federated Learning via Class-Imbalance
Reduction", ICML 2023 (PMLR 202:41354-41381, arXiv:2209.15245). No official code; the sampling
rule follows a public client-sampling comparison (``util/cspolicy.py``
``client_sample_CBS``, ``util/misc.py`` ``QCID``: [T]).

**Sampling** (:mod:`tasks.client_sampling`). With ``counts[n] = n_n alpha_n`` node n's label
histogram, the quadratic class-imbalance degree of a set S is
``QCID(S) = sum_b (sum_{n in S} n_n alpha_{n,b} / sum_{n in S} n_n - 1/M)^2``. The round's m
clients (``fraction-train`` and ``min-nodes``, as for every algorithm) are drawn one after
another, already chosen ones excluded [ours: [T] does not exclude them]:

1. ``P_1(n) ~ 1/QCID({n}) + lambda sqrt(3 ln(t+1) / (2 T_n))``, ``T_n`` = 1 + the times n was
   sampled before (so it starts at 1, as [T]'s ``client_cnt + 1``), ``t`` the 0-based round index (round 1: t = 0, no
   exploration bonus, as in [T] where t counts from 0);
2. ``P_2(n) ~ QCID({c_1, n})^-2 / P_1(n)``;
3. ``P_k(n) ~ QCID(S_{k-1})^(k-1) / QCID(S_{k-1} + {n})^k`` (beta_k = k [T]) for k >= 3,

so a set S is drawn with probability about ``QCID(S)^-m``: sets whose pooled labels are close
to uniform are preferred. ``lambda = 10`` ([T]). QCID is floored at 1e-20 ([T]) and the
powers are taken in log space [ours]. The draw is seeded by ``derive_seed(seed, "fedcbs-sample",
round)`` over the nodes in partition order, so a run repeats whatever Flower's node ids are.

**Training** is FedAvg's (:mod:`strategies.fedavg`): each sampled client runs local SGD on
cross-entropy from the global weights, the server sets ``w = sum_k n_k w_k / sum_k n_k`` over
the clients that replied, n_k = |D_k| the client's training-set size (the reply's
``num-examples``) ([T] averages uniformly; we keep FedAvg's n_k weights, as the other SCALA
rows [ours]); ``upload-weight=processed-examples`` (the round policy) weights by the samples
each client processed instead.

**What travels.** Once per node, in the first round in which not every node is sampled: the
``label-histogram`` query (no arrays) and its reply, the node's partition id and its label
histogram ``n_n alpha_n`` (M counts, ``bytes.histogram.up``; :mod:`strategies.label_histogram`). Then FedAvg's: the global
weights down, the local weights up. When every node is sampled (``fraction-train = 1``) there is
nothing to choose: no query is sent and the run is FedAvg's.

**Privacy.** The histogram query discloses each node's label histogram to the server, in
the clear. The paper protects the inner products ``<alpha_n, alpha_m>`` with homomorphic
encryption; here the histograms are plain (our choice: a simulation of the sampling rule). The
histogram is the algorithm's input, not a metric: it is sent whatever the node's
``share-label-metrics`` consent says (an algorithm that needs it cannot run without it), and a
node that must not disclose it should not serve ``fedcbs``.

**Nodes without a histogram** [ours]. A node is asked once; a node that does not answer (an
error, no reply within ``min(round-timeout, 120 s)``, a malformed or empty histogram) is logged
and never asked again. Fed-CBS chooses among the nodes with a histogram; a node without one is
sampled only in a round where fewer than m nodes have one: then all of those are taken and the
remaining places are drawn uniformly (seeded) from the others, with a logged warning.

**State** (resume): ``T_n`` by partition id (``extra_state``); the histograms are asked again
after a restart (node ids change), which changes no draw.

Round metric ``sampled-qcid``: the QCID of the chosen set (from the histograms the nodes sent).

Client contract: FedAvg's ``train`` (:mod:`strategies.fedavg`), plus the ``label-histogram``
query (:mod:`strategies.label_histogram`): it carries ``task``, ``algo`` and ``config``
records; the reply carries ``config`` (``partition-id``, ``num-partitions``, ``num-examples``)
and the array record ``label-histogram`` with ``counts`` (float64 ``[M]``, the node's label
counts over the server's M classes).
"""
from __future__ import annotations

from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import log
from flwr.serverapp import Grid

from tasks.client_sampling import choose_balanced, count_selections
from tasks.config import knob
from tasks.training import derive_seed

from ..client import AlgorithmClient
from ..fedavg import FedAvgStrategy
from ..fedavg import client_train as fedavg_train
from ..label_histogram import HISTOGRAM, LabelHistograms, client_label_histogram
from ..registry import AlgorithmSpec, register


@dataclass(frozen=True)
class FedCBSConfig:
    """Fed-CBS knobs (namespace ``fedcbs``)."""

    ucb_lambda: float = knob(10.0, lo=0.0, help="lambda: weight of the first pick's UCB exploration term "
                                                 "lambda sqrt(3 ln(t+1) / (2 T_n)) (0 = none)")


class FedCBSStrategy(LabelHistograms, FedAvgStrategy):
    """FedAvg whose server samples the round's clients by the class-imbalance measure QCID."""

    def setup_algorithm(self) -> None:
        super().setup_algorithm()
        self.selections: dict[int, int] = {}   # partition id -> times sampled (T_n - 1)
        self.round_qcid: float | None = None

    # ------------------------------------------------------------------ sampling
    def sample_nodes(self, grid: Grid, server_round: int) -> list[int]:
        """The round's nodes: as many as :meth:`BaseStrategy.sample_nodes` takes, chosen by Fed-CBS
        (module docstring) once each node's histogram is known (:meth:`learn_histograms`)."""
        nodes = self.connected_nodes(grid)
        k = self.sample_size(len(nodes))
        self.round_qcid = None
        if k == len(nodes):
            chosen = nodes   # every node: nothing to choose (FedAvg's round, no query)
        else:
            self.learn_histograms(grid, nodes, server_round)
            chosen = self.choose(nodes, k, server_round)
        count_selections(self.selections, chosen, self.partition_of)
        return sorted(chosen)

    def choose(self, nodes: list[int], k: int, server_round: int) -> list[int]:
        """``k`` of ``nodes`` by Fed-CBS over those with a histogram, in partition order; fewer
        than ``k`` of them: all of them and the rest uniformly from the others [ours]."""
        part = self.partition_of
        pool = sorted((n for n in nodes if self.histogram_of(n) is not None), key=lambda n: (part[n], n))
        rest = sorted((n for n in nodes if self.histogram_of(n) is None), key=lambda n: (part.get(n, 1 << 62), n))
        rng = np.random.default_rng(derive_seed(self.task.seed, "fedcbs-sample", server_round))
        if len(pool) < k:
            log(WARNING, "fedcbs round %s: only %d of %d nodes gave a label histogram, %d are needed; the "
                "other %d places are drawn uniformly from the nodes without one", server_round, len(pool),
                len(nodes), k, k - len(pool))
        t_n = [1 + self.selections.get(part[n], 0) for n in pool]
        chosen, self.round_qcid = choose_balanced(pool, rest, k, self.histogram_of, server_round - 1, t_n,
                                                  self.cfg.ucb_lambda, rng)
        return chosen

    # ------------------------------------------------------------------ round, state
    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        out = super().run_round(server_round, grid)
        if self.round_qcid is not None:
            out["sampled-qcid"] = self.round_qcid
        return out

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "selections": {int(p): int(c) for p, c in self.selections.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        self.selections = {int(p): int(c) for p, c in state.get("selections", {}).items()}


ALGORITHMS = register({
    "fedcbs": AlgorithmSpec(
        name="fedcbs", paper="Zhang et al. 2023 (ICML); SCALA baseline", strategy_cls=FedCBSStrategy,
        config_cls=FedCBSConfig, namespace="fedcbs",
        client={"train": fedavg_train, HISTOGRAM: client_label_histogram},
        description="FedAvg with class-balanced client sampling (QCID), all client data labeled; "
                    "discloses each node's label histogram to the server"),
})


class FedCBSClient(AlgorithmClient):
    """Fed-CBS's client with a user's model and the node's own labeled data (``labeled``):
    FedAvg's local SGD, and the node's label histogram once (``label-histogram``, disclosed to
    the server in the clear: the sampling's input)."""

    module = __name__
    needs = ("labeled",)
