"""Semi-SFL: semi-supervised split federated learning with clustering regularization
and an adaptive global updating frequency K_s.

Paper: Z. Sun, Y. Xu, H. Xu, Z. Wang, Y. Liao, "Efficient Semi-Supervised Federated
Learning for Heterogeneous Participants" (Semi-SFL): system design Sec. III, Eqs. 1-8, the K_s
rule Sec. IV-B (Eq. 9, Algorithm 1). Choices marked "ours" are the library's where the paper is
silent; ``docs/semisfl.md`` ("Deviations from the paper") lists them.

Setting
-------
The parameter server (PS) holds a small labeled set D_l (``server-labels``); the clients
hold only unlabeled data. The model w = (w_c bottom, w_s top) is cut at ``cut``; a
projection head w_p (Linear(F, F_h) -> ReLU -> Linear(F_h, d_z) on the flattened bottom
output) sits next to w_s on the PS. The EMA teacher w~ = (w~_c, w~_s, w~_p) has the same
architecture. The result is the **global teacher** (w~_c, w~_s) (``eval_model``).

Round h (server side, :class:`tasks.semisfl.server_core.SemiSFLServer`)
-----------------------------------------------------------------
A. K_s^h supervised steps on the PS, each on a labeled batch (x, y) of
   ``labeled-batch-size`` on the ``labeled-view`` (strong, ours: Sec. III says strong augmentation
   helps supervised training, the setup names only weak augmentation):
   e = w_c(x), l_s = H_s + T with H_s = CE(w_s(e), y) and the supervised contrastive loss
   T_j = -(1/|P(j)|) sum_{p in P(j)} log[exp(z_j.z_p/kappa) / sum_{a in A(j)} exp(z_j.z_a/kappa)],
   z = normalize(w_p(e)); references A(j) = batch minus j plus the queue Q (ours); P(j) = same
   label (``supcon-queue-positives``: by default only confident queue entries, c > tau,
   level 1 always; ``all`` = the literal Eq. 3, which lets the unconfident level-2 entries
   be positives); one SGD step on (w_c, w_s, w_p); then the whole teacher
   w~ <- gamma w~ + (1-gamma) w; then, whenever a loss reads the queue (C on, or T with
   queue references), the teacher projections of a weak view of the batch, with the true
   labels, go into queue level 1 (confidence 1).
B. The PS sends w_c and w~_c to every sampled client.
C. K_u fused cross-entity iterations. Client i sends the student features
   e_i = w_{c,i}(a_s(x)) and the teacher features e~_i = w~_{c,i}(a_w(x)) (no grad) of the
   same unlabeled batch. At the barrier the PS computes for every client the teacher path
   q~ = softmax(w~_s(e~_i)), yhat = argmax q~, c = max q~, z~ = w~_p(e~_i) and pushes
   (z~, yhat, c) into queue level 2 (before the losses, ours: a sample's own teacher view
   can then be a positive); then per client
   l_u = H_u + C with
   H_u = (1/d_i) sum_j 1[c_j > tau] CE(w_s(e_j), yhat_j)                        (Eq. 1)
   C_j = -(1/|P^(j)|) sum_{p in P^(j)} log[exp(z_j.z~_p/kappa) / sum_{a in Q} exp(z_j.z~_a/kappa)]
   with P^(j) = {p in Q: c_p > tau, yhat_p = yhat_j}, z_j = w_p(e_j), over ALL samples j;
   C = (1/d_i) sum_j C_j, those with empty P^(j) contributing 0 (ours).        (Eq. 5)
   Gradient routing: H_u reaches w_s and e_i, C reaches w_p and e_i, so C never updates
   w_s. Client i gets de_i = d l_u / d e_i (its own, unscaled). The PS then takes ONE step
   on (w_s, w_p) with the gradients averaged over the clients of the barrier (Eq. 7) and
   EMA-updates w~_s, w~_p (ours: Eq. 8 EMA-updates only the bottom, which would leave the
   teacher's top fixed during stage C).
   Client i backpropagates de_i through w_{c,i}, steps, and updates its teacher bottom
   w~_{c,i} <- gamma w~_{c,i} + (1-gamma) w_{c,i} (Eq. 8).
D. Clients return w_{c,i}; w_c <- (1/N_h) sum_i w_{c,i} (uniform over the replies; the paper's
   1/N runs over "all" clients, but only the active ones upload).
   Client teacher bottoms are discarded; the PS keeps w~_c from stage A.
E. K_s controller (:class:`tasks.semisfl.server_core.KsController`, Eq. 9): lhat <- m lhat + (1-m) mean(l_s over the
   round); Delta = mean of the last ``window`` lhat values minus the mean of the ``window``
   before; at milestone rounds K_s halves if |Delta| < rho1 and doubles if |Delta| > rho2,
   rounded and clamped to [1, ks-max-factor * K_s^1].

Switch-variants (``ALGORITHMS``): ``semisfl-no-cluster`` is the FedSwitch-SL-style
ablation of the paper's Sec. V-B (l_u = H_u, l_s = H_s, fixed K_s), ``semisfl-fixed-ks`` the
controller ablation.

Client contract (:mod:`split_layer.worker`, ``query`` messages with ``config.op``)
-------------------------------------------------------------------------------
``split-info`` -> reply config ``partition-id``, ``num-examples`` (|D_{u,i}|) and an all-zero
``split-tensors["histogram"]`` (clients have no labels). ``split`` step 1 carries
``split-arrays.bottom`` (w_c), ``split-arrays.teacher`` (w~_c) and config ``split-batch``
(d_i = ``batch-size``), ``split-iters`` (K_u), ``semisfl-lr`` (this round's lr). Replies of
steps 1..K_u carry ``split-tensors`` ``student`` and ``teacher`` (float32 [d_i, *F]) and,
steps 2..K_u+1 carry ``split-tensors["student"]`` = d l_u / d e_i of the previous step
(and, with ``hidden-label-metrics``, ``pseudo-labels`` int16 [d_i] and ``pseudo-mask`` uint8
[d_i] of that step); the reply of step K_u+1 carries ``split-arrays.bottom`` and
``metrics["num-examples"]`` (plus the counts below, if the node consents). The client's teacher bottom
lives in ``context.state["split.x.teacher"]`` during the round and is discarded after it.

Metrics (hidden labels, the node's consent)
-------------------------------------------
Pseudo-label impurity (error rate of the confident pseudo-labels) needs the true labels of
the "unlabeled" samples, which only a node has (in a simulation, or where a node's data is
in fact labeled). No label ever leaves a node: with ``semisfl.hidden-label-metrics = true``
(default) the PS returns each batch's pseudo-labels and confidence mask with its gradient
(``bytes.metrics.down``, 3 bytes per sample), and a node **that consents** -- node config
``share-label-metrics = true``, or ``FLOWER_SSL_SHARE_LABEL_METRICS=1`` in the environment
of its ClientApp (a simulation gives nodes no node config); off by default -- compares them
with its own labels and reports four counts per round in its final reply (``pl-samples``,
``pl-wrong``, ``pl-confident``, ``pl-wrong-confident``); the PS sums them into ``impurity`` and
``pseudo-label-accuracy`` (and ``label-metrics-nodes``: how many nodes reported). A node
that does not consent reports nothing and is treated like any other. The mask rate needs
no labels and is always reported. (The core, :meth:`tasks.semisfl.server_core.SemiSFLServer.cross_iteration`, still
accepts a ``hidden-labels`` payload for in-process use; the strategy never asks for one.)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from flwr.app import ConfigRecord

from split_layer.cut import bottom_state, feature_shape, load_bottom_state, resolve_cut, split_model
from strategies.core.records import algo_config, label_consent, model_to_record, numpy_to_record
from split_layer.transport import Envelope
from split_layer.validation import TensorSpec
from split_layer.worker import SplitClientHooks, Worker, make_split_handlers
from tasks.aggregate import weighted_mean
from tasks.config import ConfigError, knob
from tasks.data import ArrayDataset
from tasks.ema import ema_update
from tasks.semisfl.server_core import (  # the PS's plain-torch core; names re-exported for the tests and users
    HIDDEN_LABELS,
    STUDENT,
    TEACHER,
    KsController,
    ProjectionHead,
    SemiSFLServer,
    milestone_period,
)
from tasks.training import derive_seed, make_sgd

from ..split_base import SplitStrategy
from ..client import AlgorithmClient
from ..registry import AlgorithmSpec, register

__all__ = ["SemiSFLConfig", "SemiSFLStrategy", "SemiSFLClientHooks", "SemiSFLClient", "semisfl_server",
           "KsController", "ProjectionHead", "SemiSFLServer", "milestone_period", "STUDENT", "TEACHER",
           "HIDDEN_LABELS", "PSEUDO_LABELS", "PSEUDO_MASK", "PL_COUNTS", "ALGORITHMS"]

NAMESPACE = "semisfl"
PSEUDO_LABELS, PSEUDO_MASK = "pseudo-labels", "pseudo-mask"   # sent down with the gradients (metrics)
PL_COUNTS = ("pl-samples", "pl-wrong", "pl-confident", "pl-wrong-confident")


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SemiSFLConfig:
    """Run-config keys ``semisfl.<key>``; defaults are the paper's (Sec. V-C) where it gives them,
    otherwise the library's (``docs/semisfl.md``)."""

    k_s: int = knob(50, lo=1, help="initial K_s: server supervised steps per round")
    k_u: int = knob(50, lo=1, help="K_u: cross-entity iterations per round")
    labeled_batch_size: int = knob(64, lo=1, help="B_l, labeled batch size on the PS")
    tau: float = knob(0.95, lo=0.0, hi=1.0, help="confidence threshold (c > tau)")
    kappa: float = knob(0.07, lo=0.0, lo_open=True, help="contrastive temperature")
    ema_decay: float = knob(0.99, lo=0.0, hi=1.0, help="EMA gamma (0.999 at full scale)")
    proj_dim: int = knob(128, lo=1, help="d_z, projection dimension")
    proj_hidden: int = knob(0, lo=0, help="projection hidden width (0 = input width F)")
    queue_labeled: int = knob(1024, lo=0, help="queue level 1 capacity (labeled)")
    queue_unlabeled: int = knob(4096, lo=0, help="queue level 2 capacity (unlabeled)")
    queue_labeled_every: int = knob(1, lo=1, help="level 1 takes every n-th labeled batch")
    clustering: bool = knob(True, help="add the clustering regularization C to l_u")
    supcon: bool = knob(True, help="add the supervised contrastive loss T to l_s")
    supcon_references: str = knob("batch+queue", choices=("batch+queue", "batch"),
                                  help="references A(j) of T")
    supcon_queue_positives: str = knob("confident", choices=("confident", "all"),
                                       help="queue entries that may be positives of T: confident (c > tau; "
                                            "level 1 always) or all (the literal Eq. 3)")
    labeled_view: str = knob("strong", choices=("strong", "weak"), help="view for H_s and T")
    enqueue_before_loss: bool = knob(True, help="enqueue the barrier's teacher features before C")
    ema_top_in_cross: bool = knob(True, help="EMA w~_s, w~_p after every cross-entity step")
    adaptive_ks: bool = knob(True, help="adapt K_s at milestones (Eq. 9); false = fixed K_s")
    rho1: float = knob(0.01, lo=0.0, help="halve K_s if |Delta l_s| < rho1")
    rho2: float = knob(0.05, lo=0.0, help="double K_s if |Delta l_s| > rho2")
    loss_momentum: float = knob(0.9, lo=0.0, hi=1.0, hi_open=True,
                                help="lhat <- m*lhat + (1-m)*mean l_s")
    window: int = knob(10, lo=1, help="rounds per moving-average window of Delta l_s")
    milestone_every: int = knob(0, lo=0, help="milestone period in rounds (0 = 10% of num-rounds)")
    ks_max_factor: float = knob(4.0, lo=1.0, help="K_s is clamped to [1, factor*K_s^1]")
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"),
                            help="per-round lr: cosine decay over num-rounds, or constant")
    hidden_label_metrics: bool = knob(True, help="return pseudo-labels with the gradients; nodes with node "
                                                 "config share-label-metrics=true report impurity counts "
                                                 "(no label leaves a node)")

    def validate(self) -> None:
        if self.rho1 > self.rho2:
            raise ConfigError(f"semisfl.rho1={self.rho1} must be <= semisfl.rho2={self.rho2}")


# --------------------------------------------------------------------------- server core
def semisfl_server(model: nn.Module, cfg: SemiSFLConfig, *, cut: str | None, labeled: ArrayDataset,
                   augmenter, device: torch.device, **kw: Any) -> SemiSFLServer:
    """The PS core (:class:`tasks.semisfl.server_core.SemiSFLServer`) on ``model`` cut after ``cut``
    (:func:`split_layer.cut.split_model`); F measured on one image of ``labeled`` (or of the
    augmenter's shape). ``kw``: ``lr``, ``momentum``, ``weight_decay``, ``seed``, ``num_rounds``."""
    cut = resolve_cut(model, cut)
    x0 = labeled.x[:1] if len(labeled) else None
    c, s = (x0.shape[1], x0.shape[2]) if x0 is not None else (augmenter.in_channels, augmenter.image_size)
    shape = feature_shape(split_model(model, cut)[0], (c, s, s), device)
    return SemiSFLServer(model, cfg, split=lambda m: split_model(m, cut), feature_shape=shape, labeled=labeled,
                         augmenter=augmenter, device=device, **kw)


# --------------------------------------------------------------------------- strategy (PS)
class SemiSFLStrategy(SplitStrategy):
    """Semi-SFL over the split runtime (:mod:`split_layer.runtime`); math in the module docstring.

    Runtime hooks used: ``begin_round`` runs stage A (and sets the round's lr),
    ``begin_extras`` adds the teacher bottom, ``server_iteration`` is one stage-C barrier,
    ``aggregate`` is stage D (uniform mean) + E (controller).
    """

    label_mode = "server"
    server_trains_first = True   # stage A (K_s steps on the labels) opens every round

    def setup_split(self) -> None:
        if len(self.env.server_labeled()) == 0:
            raise ConfigError("semisfl needs the labeled set D_l on the server: labeled_data=(x, y)"
                              if self.user is not None else
                              "semisfl needs server-labels > 0 (the labeled set D_l on the server)")
        t = self.task
        self.core = semisfl_server(self.model, self.cfg, cut=self.cut, labeled=self.env.server_labeled(),
                                   augmenter=self.env.augmenter, device=self.env.device, lr=t.lr,
                                   momentum=t.momentum, weight_decay=t.weight_decay,
                                   seed=derive_seed(t.seed, "semisfl-server"),
                                   num_rounds=self.num_rounds or 100)
        self._teacher_np: dict[str, np.ndarray] = {}
        self._round_metrics: dict[str, Any] = {}
        self._lr = t.lr

    def begin_run(self) -> None:
        self.core.num_rounds = self.num_rounds
        self.core.controller.milestone_every = milestone_period(self.cfg, self.num_rounds)

    # ------------------------------------------------------------------ hooks
    def local_iterations(self) -> int:
        return self.cfg.k_u

    def begin_round(self, server_round: int, nodes: list[int]) -> None:
        super().begin_round(server_round, nodes)
        self._lr = self.core.lr_for_round(server_round)
        self.core.set_lr(self._lr)
        self.core.pop_cross_metrics()
        self._round_metrics = {**self.core.supervised_stage(server_round), "lr": self._lr}
        self._teacher_np = {k: v.detach().cpu().numpy().copy()
                            for k, v in bottom_state(self.core.teacher, self.cut).items()}

    def begin_config(self, node: int) -> dict[str, Any]:
        return {**super().begin_config(node), "semisfl-lr": float(self._lr)}

    def begin_extras(self, node: int) -> dict[str, dict[str, np.ndarray]]:
        return {TEACHER: self._teacher_np}

    def extra_kind(self, name: str) -> str:
        return "teacher-weights" if name == TEACHER else "weights"

    def stream_kind(self, name: str, direction: str) -> str:
        if name in (PSEUDO_LABELS, PSEUDO_MASK):
            return "metrics"  # for the nodes' own impurity counts, not part of the protocol's cost
        return "activations" if direction == "up" else "gradients"

    def stream_specs(self, node: int) -> dict[str, TensorSpec]:
        b = int(self.round_batch[node])  # features only: no label is ever asked of a node
        return {STUDENT: TensorSpec((b, *self.act_shape), "float32"),
                TEACHER: TensorSpec((b, *self.act_shape), "float32")}

    def server_iteration(self, step: int, payloads: dict[int, dict[str, torch.Tensor]]
                         ) -> dict[int, dict[str, torch.Tensor]]:
        nodes = self.order(payloads)
        out = self.core.cross_iteration({n: payloads[n] for n in nodes})
        if self.cfg.hidden_label_metrics:  # the nodes count their own pseudo-label errors (if they consent)
            for n in nodes:
                yhat, mask = self.core.last_pseudo[n]
                small = torch.int16 if self.env.num_classes <= 2 ** 15 else torch.int64
                out[n] = {**out[n], PSEUDO_LABELS: yhat.to(small), PSEUDO_MASK: (mask > 0).to(torch.uint8)}
        return out

    @staticmethod
    def label_metrics(finals: dict[int, Envelope]) -> dict[str, float]:
        """``impurity``/``pseudo-label-accuracy`` from the counts of the nodes that consented."""
        got = [f.metrics for f in finals.values() if all(k in f.metrics for k in PL_COUNTS)]
        if not got:
            return {}
        tot = {k: float(sum(float(m[k]) for m in got)) for k in PL_COUNTS}
        out = {"label-metrics-nodes": float(len(got))}
        if tot["pl-confident"]:
            out["impurity"] = tot["pl-wrong-confident"] / tot["pl-confident"]
        if tot["pl-samples"]:
            out["pseudo-label-accuracy"] = 1.0 - tot["pl-wrong"] / tot["pl-samples"]
        return out

    def aggregate(self, server_round: int, finals: dict[int, Envelope]) -> dict[str, Any]:
        nodes = self.order(finals)  # stage D: uniform mean over the replies
        new = weighted_mean([finals[n].arrays["bottom"] for n in nodes], [1.0] * len(nodes))
        load_bottom_state(self.model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()},
                          self.cut)
        out = {**self._round_metrics, **self.core.pop_cross_metrics(), **self.label_metrics(finals),
               **self.core.end_round(server_round)}
        out["queue-size"] = float(len(self.core.queue))
        return out

    def server_snapshot(self) -> Any:
        return super().server_snapshot(), copy.deepcopy(self.core.state_dict())

    def server_restore(self, snap: Any) -> None:
        super().server_restore(snap[0])
        self.core.load_state_dict(snap[1])
        self.core.pop_cross_metrics()
        self.core._sup_losses = []

    # ------------------------------------------------------------------ evaluation
    eval_name = "teacher"

    def eval_model(self) -> torch.nn.Module:
        return self.core.teacher  # the global teacher (w~_c, w~_s), as the paper tests

    def also_evaluated(self) -> dict[str, torch.nn.Module]:
        return {"student": self.model}

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "semisfl": self.core.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        if "semisfl" in state:
            self.core.load_state_dict(state["semisfl"])


# --------------------------------------------------------------------------- client (worker hooks)
STATE_TEACHER = "split.x.teacher"   # the client's teacher bottom (cleared by the worker each round)
STATE_LR = "split.x.semisfl-lr"
STATE_PL = "split.x.pl-counts"      # a consenting node's pseudo-label error counts of the round


class SemiSFLClientHooks(SplitClientHooks):
    """Client side of stage C on the generic split worker.

    Contract: step 1 carries ``split-arrays.bottom`` (w_c), ``split-arrays.teacher`` (w~_c)
    and config ``split-batch`` (d_i), ``split-iters`` (K_u), ``semisfl-lr``. Replies of steps
    1..K_u carry ``split-tensors`` ``student`` = w_c(a_s(u)) and ``teacher`` = w~_c(a_w(u))
    (float32 [d_i, *F], the teacher without a graph) of the same unlabeled batch u, plus
    never a label. Steps 2..K_u+1 carry ``split-tensors["student"]`` = d l_u / d e_i of the
    previous step (and the pseudo-labels/mask of it, see the module's "Metrics");
    the client backpropagates it, takes an SGD step and sets
    w~_c <- gamma w~_c + (1-gamma) w_c. The reply of step K_u+1 carries the bottom only.
    """

    label_mode = "server"

    def data(self, w: Worker) -> ArrayDataset:
        return w.env.unlabeled()

    def label_histogram(self, w: Worker, data: ArrayDataset) -> np.ndarray:
        return np.zeros(w.env.num_classes, dtype=np.int64)  # clients have no labels to report

    def make_optimizer(self, w: Worker) -> torch.optim.Optimizer:
        lr = w.config.get("semisfl-lr")
        if lr is None and STATE_LR in w.state:
            lr = w.state[STATE_LR]["lr"]
        return make_sgd(w.bottom.parameters(), w.env.task, lr=None if lr is None else float(lr))

    def begin(self, w: Worker, env: Envelope) -> None:
        if TEACHER not in env.arrays:
            raise ValueError("semisfl split-step 1 carries no 'teacher' bottom")
        w.state[STATE_TEACHER] = numpy_to_record(env.arrays[TEACHER])
        w.state[STATE_LR] = ConfigRecord({"lr": float(w.config.get("semisfl-lr", w.env.task.lr))})

    def _teacher(self, w: Worker) -> nn.Module:
        """The teacher bottom w~_c: built from the node state once per worker, then kept."""
        t = w.cache.get(TEACHER)
        if t is None:
            t = copy.deepcopy(w.bottom)
            rec = w.state[STATE_TEACHER]
            t.load_state_dict({k: torch.from_numpy(rec[k].numpy().copy()) for k in rec.keys()})
            w.cache[TEACHER] = t
        return t

    def forward(self, w: Worker, xb: torch.Tensor, yb: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        aug = w.env.augmenter
        out = {STUDENT: w.bottom(aug.strong(xb))}   # drawn first: identical in the recomputed pass
        if w.recomputing:
            return out  # the recomputation for the backward pass needs the student stream only
        teacher = self._teacher(w).eval()
        with torch.no_grad():
            out[TEACHER] = teacher(aug.weak(xb))
        return out  # features only: the true labels ``yb`` never leave the node

    def feedback(self, w: Worker, step: int, tensors: dict[str, np.ndarray], labels: np.ndarray
                 ) -> dict[str, np.ndarray]:
        """Take the server's pseudo-labels/mask of ``step`` out of the gradients; a consenting
        node adds up how many were wrong (its labels stay here, only counts are reported)."""
        yhat, mask = tensors.pop(PSEUDO_LABELS, None), tensors.pop(PSEUDO_MASK, None)
        if yhat is None or mask is None or not label_consent(w.node_config):
            return tensors
        y = np.asarray(labels).reshape(-1).astype(np.int64)
        yhat, mask = np.asarray(yhat).reshape(-1).astype(np.int64), np.asarray(mask).reshape(-1) > 0
        if yhat.shape != y.shape or mask.shape != y.shape or (y < 0).any():
            return tensors  # not this batch's, or the node has no labels to compare with: no counts
        wrong = yhat != y
        old = w.state[STATE_PL] if STATE_PL in w.state else {k: 0.0 for k in PL_COUNTS}
        add = {"pl-samples": len(y), "pl-wrong": int(wrong.sum()), "pl-confident": int(mask.sum()),
               "pl-wrong-confident": int((wrong & mask).sum())}
        w.state[STATE_PL] = ConfigRecord({k: float(old[k]) + float(add[k]) for k in PL_COUNTS})
        return tensors

    def end(self, w: Worker) -> Envelope:
        if STATE_PL in w.state and label_consent(w.node_config):
            return Envelope(metrics={k: float(w.state[STATE_PL][k]) for k in PL_COUNTS})
        return Envelope()

    def after_step(self, w: Worker, step: int) -> None:
        teacher = self._teacher(w)
        ema_update(teacher, w.bottom, algo_config(w.algo, SemiSFLConfig).ema_decay)
        if not w.streaming:  # the next message's worker rebuilds the teacher from the node state
            w.state[STATE_TEACHER] = model_to_record(teacher)


_CLIENT = make_split_handlers(SemiSFLClientHooks())

ALGORITHMS = register({
    "semisfl": AlgorithmSpec(
        name="semisfl", paper="Sun et al., Semi-SFL (clustering regularization + adaptive K_s)",
        strategy_cls=SemiSFLStrategy, config_cls=SemiSFLConfig, namespace=NAMESPACE, client=_CLIENT,
        label_metrics=PL_COUNTS,
        description="split FL, labels on the server only: H_s+T, H_u+C, EMA teacher, adaptive K_s"),
    "semisfl-no-cluster": AlgorithmSpec(
        name="semisfl-no-cluster", paper="Semi-SFL ablation (FedSwitch-SL style: no clustering regularization, fixed K_s)",
        strategy_cls=SemiSFLStrategy, config_cls=SemiSFLConfig, namespace=NAMESPACE, client=_CLIENT,
        label_metrics=PL_COUNTS, overrides={"clustering": False, "supcon": False, "adaptive_ks": False},
        description="l_u = H_u, l_s = H_s, fixed K_s"),
    "semisfl-fixed-ks": AlgorithmSpec(
        name="semisfl-fixed-ks", paper="Semi-SFL ablation (w/o K_s adaptation)",
        strategy_cls=SemiSFLStrategy, config_cls=SemiSFLConfig, namespace=NAMESPACE, client=_CLIENT,
        label_metrics=PL_COUNTS, overrides={"adaptive_ks": False}, description="Semi-SFL with a constant K_s"),
})


class SemiSFLClient(AlgorithmClient):
    """Semi-SFL's client (and its ablations) with a user's split model and the node's
    unlabeled data (``unlabeled``). The node runs the bottom w_c and its EMA teacher: each
    ``query.split`` step sends the student features of the strong view and the teacher
    features of the weak view (never a label), backpropagates the returned gradients and
    updates the teacher (``ema_decay``)."""

    module = __name__
    needs = ('unlabeled',)
