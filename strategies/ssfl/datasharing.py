"""DataSharing: FedAvg with a small globally shared class-balanced data set, the SSFL
benchmark's supervised reference of Table 3 (the SSFL paper's Sec. 4.4; ``docs/baselines.md``
D1).

Y. Zhao, M. Li, L. Lai, N. Suda, D. Civin, V. Chandra, "Federated Learning with Non-IID Data",
arXiv:1806.00582 (2018). A globally shared set G with a uniform class distribution is held
centrally; a warm-up model w^0 is trained on G; a random alpha fraction G_k of G is sent ONCE
to every client k; each client then runs FedAvg on D_k united with G_k (all client data
labeled), and the server averages ``w <- sum_k n_k w_k / sum_k n_k`` with
``n_k = |D_k| + |G_k|`` [ours]. beta = |G| / |D| (Zhao et al.'s).

In this library G is the server's labeled set (``server-labels`` N_s class-balanced samples,
label mode ``"server"`` as in :mod:`strategies.ssfl.ssfl`): we take beta = 5% of the training
pool, i.e. ``server-labels`` = 5% of the training set; the nodes hold the rest, labeled (the
library's partition of the pool without G, ``partition='ssfl-r'`` in SSFL's comparison).

* **Warm-up** (``datasharing.warmup-epochs``, 5 [ours]): ``warmup-epochs`` passes over G of SGD
  (batches of ``batch-size``, the task's optimizer) before the first broadcast, as the first
  part of round 1 (round 0's evaluation is the initial model). A run started from
  ``start(initial_arrays=...)`` takes those arrays as w^0 and skips the warm-up [ours].
* **alpha** (``datasharing.alpha``, default 0.5 [ours]: Zhao et al. vary it and give no single
  value) is the share of G each node receives; with
  ``datasharing.target-r`` > 0 alpha is chosen instead so that the non-IID level R of the
  nodes' merged data D_k + G_k equals the target [ours]: the dilution formula (derived here:
  shared data drawn from the population distribution adds no skew)
  ``R(D_k + G_k) = R_priv n_priv / (n_priv + alpha |G|)`` (n_priv the mean node size) bounds the
  reachable targets, then the share size is found by bisection on the exact realised R of the
  shares as drawn [ours] (random shares are not exactly class-balanced). This needs the
  library's partition (a user's own data: give alpha). Every round reports
  ``datasharing-alpha``, ``shared-size`` |G|, ``shared-per-node`` alpha |G| and, on the
  library's partition, ``datasharing-beta`` = |G| / (training pool), ``private-r`` (R of the
  D_k) and ``realised-r`` (R of the D_k + G_k, the library's R metric on the merged class
  counts of the plan and of the G_k the server drew: no node's labels travel for it).
* **G_k**: ``round(alpha |G|)`` samples of G drawn uniformly without replacement, seeded by
  the run seed and the node's partition id [ours]; they travel as the array record
  ``shared-data`` (``x`` uint8 images, ``y`` labels; byte kind ``shared-data``) in the node's
  first training message only and the node keeps them in ``context.state['datasharing.shared']``.
  A node that lost them (a restarted node without ``state-dir``) fails its round with a
  clear error; the server then sends G_k again with its next message (any node dropped from
  a round gets G_k again) [ours].

Client contract: a ``train`` message carries ``arrays`` (the global state dict), ``task``,
``algo`` (the config below), ``config`` (``server-round``) and, the first time,
``shared-data`` (G_k). The node trains ``local-steps`` (else ``local-epochs`` passes over
D_k + G_k) of supervised SGD on D_k + G_k from the global weights (momentum restarts each
round, Nesterov per ``datasharing.nesterov``, SSFL's optimizer) and replies ``arrays`` and
``metrics`` with ``num-examples`` = |D_k| + |G_k|, ``processed-examples`` (the samples the local
steps processed), ``train-loss``, ``shared-examples`` |G_k|.
D_k is the node's ``labeled`` set (a user's node); on the library's partition with label mode
``"server"`` the node's part of the pool (its labels are used: every client is labeled here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from strategies.core.folds import sized_metrics
from strategies.core.records import (
    ARRAYS_KEY,
    METRICS_KEY,
    algo_config,
    client_env,
    model_to_record,
    numpy_to_record,
    record_to_numpy,
)
from tasks.config import ConfigError, knob
from tasks.data import ArrayDataset
from tasks.partition.metrics import class_histograms, r_metric
from tasks.training import derive_seed, load_numpy_state, make_sgd, num_local_steps, train_supervised

from ..base import BaseStrategy
from ..client import AlgorithmClient, server_round
from ..registry import AlgorithmSpec, register

SHARED_KEY = "shared-data"           # message ArrayRecord: G_k (x, y); byte kind "shared-data"
STATE_KEY = "datasharing.shared"     # context.state: the node's G_k


@dataclass(frozen=True)
class DataSharingConfig:
    """DataSharing knobs (namespace ``datasharing``)."""

    alpha: float = knob(0.5, lo=0.0, hi=1.0,
                        help="share of the shared set G sent once to each node (ignored when target-r > 0)")
    target_r: float = knob(0.0, lo=0.0, hi=1.0,
                           help="choose alpha so that R of the nodes' D_k + G_k equals this (0 = use alpha)")
    warmup_epochs: int = knob(5, lo=0, help="passes over G to warm w^0 up before round 1 (0 = none)")
    nesterov: bool = knob(True, help="Nesterov momentum (SSFL's optimizer)")


# --------------------------------------------------------------------------- shares of G
def share_indices(num_shared: int, alpha: float, seed: int, partition_id: int) -> np.ndarray:
    """The indices into G of node ``partition_id``'s share: ``round(alpha |G|)`` drawn uniformly
    without replacement (seeded by the run seed and the partition id; sorted)."""
    m = int(round(alpha * num_shared))
    rng = np.random.default_rng(derive_seed(seed, "datasharing-share", partition_id))
    return np.sort(rng.permutation(num_shared)[:m])


def alpha_for_target(r_private: float, n_private: float, num_shared: int, target: float) -> float:
    """The dilution formula ``R = R_priv n / (n + alpha |G|)`` (module docstring) solved for alpha."""
    if target >= r_private:
        return 0.0
    return n_private * (r_private / target - 1.0) / num_shared


def merged_r(private_hist: np.ndarray, shared_labels: np.ndarray, shares: list[np.ndarray]) -> float:
    """The library's R metric on every node's merged class counts (D_k + G_k)."""
    c = private_hist.shape[1]
    extra = np.stack([np.bincount(shared_labels[s], minlength=c)[:c] for s in shares])
    return r_metric(private_hist + extra)


# --------------------------------------------------------------------------- node side
def private_data(env) -> ArrayDataset:
    """D_k: the node's labeled set; on the library's partition with label mode ``"server"``, the
    node's part of the pool (G is the server's), with its labels."""
    if len(env.labeled()):
        return env.labeled()
    data = env.unlabeled()
    if len(data) and data.labels_known:
        return data
    raise ConfigError("datasharing: this node has no labeled data (labeled=(x, y)); every node trains on its "
                      "own labels plus its share of the shared set")


def client_train(msg: Message, context: Context) -> Message:
    """Local supervised SGD on D_k + G_k from the global weights (see the module docstring)."""
    env = client_env(msg, context, label_mode="server")
    cfg = algo_config(msg, DataSharingConfig)
    rnd = server_round(msg)
    if SHARED_KEY in msg.content.array_records:       # the one download of G_k
        context.state[STATE_KEY] = numpy_to_record(record_to_numpy(msg.content.array_records[SHARED_KEY]))
    if STATE_KEY not in context.state:
        raise RuntimeError("datasharing: this node lost its share of the shared data (node state not kept: "
                           "set the node config state-dir); the server sends it again next round")
    shared = record_to_numpy(context.state[STATE_KEY])
    own = private_data(env)
    data = ArrayDataset(np.concatenate([own.x, shared["x"].astype(own.x.dtype)]),
                        np.concatenate([own.y, shared["y"].astype(own.y.dtype)]))
    task = env.task
    model = env.build_model()
    load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    metrics = train_supervised(
        model, data, aug=env.augmenter, steps=num_local_steps(task, len(data)), batch_size=task.batch_size,
        optimizer=make_sgd(model.parameters(), task, nesterov=cfg.nesterov), device=env.device,
        seed=derive_seed(task.seed, "datasharing", rnd, env.partition_id))
    metrics = sized_metrics(metrics, len(data))     # n_k = |D_k + G_k|
    metrics["shared-examples"] = float(len(shared["y"]))
    return Message(RecordDict({ARRAYS_KEY: model_to_record(model), METRICS_KEY: MetricRecord(metrics)}),
                   reply_to=msg)


# --------------------------------------------------------------------------- server side
class DataSharingStrategy(BaseStrategy):
    """FedAvg plus a shared class-balanced set G: warm-up on G, G_k sent once to each node."""

    label_mode = "server"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: set[int] = set()       # partition ids that hold their G_k
        self.warmed = False
        self.alpha = 0.0
        self.report: dict[str, float] = {}
        super().__init__(*args, **kwargs)
        if self.user is None and self.task.server_labels <= 0:
            raise ConfigError("datasharing needs server-labels > 0 (the shared class-balanced set G)")

    def setup_algorithm(self) -> None:
        shared = self.env.server_labeled()
        if len(shared) == 0:
            raise ConfigError("datasharing needs the shared set G on the server: labeled_data=(x, y)"
                              if self.user is not None else "datasharing needs server-labels > 0 (the shared set G)")
        cfg, plan = self.cfg, self.env.plan
        if cfg.target_r > 0 and plan is None:
            raise ConfigError(f"datasharing.target-r={cfg.target_r:g} needs the nodes' class distributions, which "
                              "the server of a user's own data does not know: set datasharing.target-r=0 and "
                              "give datasharing.alpha")
        self.alpha = cfg.alpha
        self.report = {"shared-size": float(len(shared))}
        if plan is not None:
            labels = self.env.bundle.train.y
            hist = class_histograms(labels, [c.all for c in plan.clients], self.env.num_classes)
            r_priv = r_metric(hist)
            if cfg.target_r > 0:
                n_priv = float(hist.sum(axis=1).mean())
                self.alpha = alpha_for_target(r_priv, n_priv, len(shared), cfg.target_r)
                lowest = r_priv * n_priv / (n_priv + len(shared))
                if self.alpha > 1.0 or cfg.target_r > r_priv + 1e-9:   # (sharing only dilutes R)
                    raise ConfigError(f"datasharing.target-r={cfg.target_r:g} is out of reach with |G|={len(shared)} "
                                      f"and R_priv={r_priv:.3f}: allowed: [{lowest:.3f}, {r_priv:.3f}] (a larger "
                                      "server-labels lowers the bound)")
                self.alpha = self.share_for_target(hist, shared.y, cfg.target_r) / len(shared)
            shares = [share_indices(len(shared), self.alpha, self.task.seed, k) for k in range(len(plan.clients))]
            self.report.update({"datasharing-beta": len(shared) / float(len(labels)), "private-r": r_priv,
                                "realised-r": merged_r(hist, shared.y, shares)})
        self.report.update({"datasharing-alpha": float(self.alpha),
                            "shared-per-node": float(int(round(self.alpha * len(shared))))})

    def share_for_target(self, hist: np.ndarray, shared_labels: np.ndarray, target: float) -> int:
        """The share size m = alpha |G| whose realised R (the library's R metric on the nodes' merged
        class counts, with the shares as drawn) is nearest ``target``: bisection over m [ours]
        (random shares are not exactly class-balanced, so the dilution formula is off by about 0.01-0.02)."""
        g = len(shared_labels)

        def realised(m: int) -> float:
            return merged_r(hist, shared_labels, [share_indices(g, m / g, self.task.seed, k) for k in range(len(hist))])

        lo, hi = 0, g
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if realised(mid) > target else (lo, mid)
        return min((lo, hi), key=lambda m: abs(realised(m) - target))

    def load_initial_arrays(self, arrays) -> None:
        super().load_initial_arrays(arrays)
        self.warmed = True    # the given arrays are w^0: no warm-up [ours]

    def warm_up(self) -> dict[str, float]:
        """w^0: ``warmup-epochs`` passes of SGD over G."""
        self.warmed = True
        shared = self.env.server_labeled()
        steps = self.cfg.warmup_epochs * max(1, math.ceil(len(shared) / self.task.batch_size))
        if steps == 0:
            return {}
        out = train_supervised(self.model, shared, aug=self.env.augmenter, steps=steps,
                               batch_size=self.task.batch_size,
                               optimizer=make_sgd(self.model.parameters(), self.task, nesterov=self.cfg.nesterov),
                               device=self.env.device, seed=derive_seed(self.task.seed, "datasharing-warmup"))
        return {"warmup-loss": out["train-loss"], "warmup-steps": float(steps)}

    def configure_train(self, server_round: int, arrays, config: ConfigRecord, grid: Grid):
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        self.learn_partitions(grid, [m.metadata.dst_node_id for m in msgs], server_round=server_round)
        shared = self.env.server_labeled()
        for m in msgs:
            pid = self.partition_of.get(m.metadata.dst_node_id)
            if pid is None:
                raise ConfigError(f"datasharing: node {m.metadata.dst_node_id} did not say its partition id")
            if pid not in self.sent:
                idx = share_indices(len(shared), self.alpha, self.task.seed, pid)
                m.content[SHARED_KEY] = numpy_to_record({"x": shared.x[idx], "y": shared.y[idx]})
        self._round_nodes = {m.metadata.dst_node_id: self.partition_of[m.metadata.dst_node_id] for m in msgs}
        return msgs

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        return "shared-data" if key == SHARED_KEY else super().record_kind(key, msg, direction)

    def drop(self, node: int, why: str) -> None:
        super().drop(node, why)
        pid = self.partition_of.get(node)
        if pid is not None:
            self.sent.discard(pid)     # it gets G_k again with its next message [ours]

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if not self.warmed:
            out.update(self.warm_up())
        self._round_nodes: dict[int, int] = {}
        msgs = list(self.configure_train(server_round, self.global_arrays(), ConfigRecord(), grid))
        self.sent.update(self._round_nodes.values())
        fold = self.train_fold(server_round)   # FedAvg's weighted mean, each reply folded as it arrives
        folded = self.exchange_fold(grid, msgs, fold.add)   # (a dropped node leaves self.sent: see drop)
        arrays, metrics = fold.finish()
        out.update({"participants": folded, **self.report})
        if arrays is None:
            out["skipped"] = 1
        if metrics is not None:
            out.update(dict(metrics))
        return out

    def extra_state(self) -> dict[str, Any]:
        return {"sent": sorted(self.sent), "warmed": self.warmed}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.sent = set(int(p) for p in state.get("sent", []))
        self.warmed = bool(state.get("warmed", True))


ALGORITHMS = register({
    "datasharing": AlgorithmSpec(
        name="datasharing", paper="Zhao et al. 2018 (arXiv:1806.00582); SSFL Table 3",
        strategy_cls=DataSharingStrategy, config_cls=DataSharingConfig, namespace="datasharing",
        client={"train": client_train}, node_state=(STATE_KEY,),
        description="FedAvg on D_k + a share of a shared class-balanced set G (server-labels), warm-up on G"),
})


class DataSharingClient(AlgorithmClient):
    """DataSharing's client with a user's model and the node's own labeled data (``labeled``):
    it keeps the share of the shared set G the server sends once, and trains FedAvg's local
    supervised SGD on its data plus that share."""

    module = __name__
    needs = ()   # D_k: ``labeled`` (checked per message, see private_data)
