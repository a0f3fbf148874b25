"""Semi-SFL: semi-supervised split federated learning with clustering regularization
and an adaptive global updating frequency K_s.

Paper: Z. Sun, Y. Xu, H. Xu, Z. Wang, Y. Liao, "Efficient Semi-Supervised Federated
Learning for Heterogeneous Participants" (Semi-SFL). Recipe: ``specs/semisfl.md``.

Setting
-------
The parameter server (PS) holds a small labeled set D_l (``server-labels``); the clients
hold only unlabeled data. The model w = (w_c bottom, w_s top) is cut at ``cut``; a
projection head w_p (Linear(F, F_h) -> ReLU -> Linear(F_h, d_z) on the flattened bottom
output) sits next to w_s on the PS. The EMA teacher w~ = (w~_c, w~_s, w~_p) has the same
architecture. The result is the **global teacher** (w~_c, w~_s) (``eval_model``).

Round h (server side, :class:`SemiSFLServer`)
---------------------------------------------
A. K_s^h supervised steps on the PS, each on a labeled batch (x, y) of
   ``labeled-batch-size`` on the ``labeled-view`` (strong [R]):
   e = w_c(x), l_s = H_s + T with H_s = CE(w_s(e), y) and the supervised contrastive loss
   T_j = -(1/|P(j)|) sum_{p in P(j)} log[exp(z_j.z_p/kappa) / sum_{a in A(j)} exp(z_j.z_a/kappa)],
   z = normalize(w_p(e)); references A(j) = batch minus j plus the queue Q [R]; P(j) = same
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
   (z~, yhat, c) into queue level 2 (before the losses [R], §9.3); then per client
   l_u = H_u + C with
   H_u = (1/d_i) sum_j 1[c_j > tau] CE(w_s(e_j), yhat_j)                        (Eq. 1)
   C_j = -(1/|P^(j)|) sum_{p in P^(j)} log[exp(z_j.z~_p/kappa) / sum_{a in Q} exp(z_j.z~_a/kappa)]
   with P^(j) = {p in Q: c_p > tau, yhat_p = yhat_j}, z_j = w_p(e_j), over ALL samples j;
   C = (1/d_i) sum_j C_j, those with empty P^(j) contributing 0 [R].             (Eq. 5)
   Gradient routing: H_u reaches w_s and e_i, C reaches w_p and e_i, so C never updates
   w_s. Client i gets de_i = d l_u / d e_i (its own, unscaled). The PS then takes ONE step
   on (w_s, w_p) with the gradients averaged over the clients of the barrier (Eq. 7) and
   EMA-updates w~_s, w~_p [R] (§9.4).
   Client i backpropagates de_i through w_{c,i}, steps, and updates its teacher bottom
   w~_{c,i} <- gamma w~_{c,i} + (1-gamma) w_{c,i} (Eq. 8).
D. Clients return w_{c,i}; w_c <- (1/N_h) sum_i w_{c,i} (uniform over the replies [R]).
   Client teacher bottoms are discarded; the PS keeps w~_c from stage A.
E. K_s controller (:class:`KsController`, Eq. 9): lhat <- m lhat + (1-m) mean(l_s over the
   round); Delta = mean of the last ``window`` lhat values minus the mean of the ``window``
   before; at milestone rounds K_s halves if |Delta| < rho1 and doubles if |Delta| > rho2,
   rounded and clamped to [1, ks-max-factor * K_s^1].

Switch-variants (``ALGORITHMS``): ``semisfl-no-cluster`` is the FedSwitch-SL-style
ablation of spec §7 (l_u = H_u, l_s = H_s, fixed K_s), ``semisfl-fixed-ks`` the
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
no labels and is always reported. (The core, :meth:`SemiSFLServer.cross_iteration`, still
accepts a ``hidden-labels`` payload for in-process use; the strategy never asks for one.)
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from flwr.app import ConfigRecord

from split_layer.cut import bottom_state, load_bottom_state, resolve_cut, split_model
from split_layer.records import algo_config, label_consent, model_to_record, numpy_to_record
from .base import SplitStrategy
from split_layer.transport import Envelope
from split_layer.validation import TensorSpec
from split_layer.worker import SplitClientHooks, Worker, make_split_handlers
from tasks.aggregate import weighted_mean
from tasks.config import ConfigError, knob
from tasks.data import ArrayDataset
from tasks.ema import ema_update
from tasks.losses import (
    clustering_regularization,
    masked_pseudo_label_ce,
    supervised_contrastive,
)
from tasks.queue import FeatureQueue
from tasks.schedules import cosine_decay
from tasks.training import (
    batch_indices,
    derive_seed,
    evaluate,
    make_sgd,
    to_device_batch,
)

from .client import AlgorithmClient
from .registry import AlgorithmSpec, bind

NAMESPACE = "semisfl"
STUDENT, TEACHER, HIDDEN_LABELS = "student", "teacher", "hidden-labels"  # payload stream names
PSEUDO_LABELS, PSEUDO_MASK = "pseudo-labels", "pseudo-mask"   # sent down with the gradients (metrics)
PL_COUNTS = ("pl-samples", "pl-wrong", "pl-confident", "pl-wrong-confident")


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class SemiSFLConfig:
    """Run-config keys ``semisfl.<key>``; defaults are the spec's [P]/[R] values."""

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


# --------------------------------------------------------------------------- K_s controller
class KsController:
    """The global-updating-frequency rule of Eq. 9 (spec §4).

    ``update(h, mean_ls)`` is called after round h with the mean supervised loss of the
    round and returns K_s^{h+1}:

    * lhat <- m*lhat + (1-m)*mean_ls (the first value initialises lhat [R]);
    * at milestone rounds (h % milestone_every == 0) with at least two lhat values,
      Delta = mean(last w values) - mean(the w values before), w = min(window, n // 2)
      (shorter windows early in short runs [R]);
    * K_s halves if |Delta| < rho1, doubles if |Delta| > rho2, else stays; the result is
      rounded half up and clamped to [1, max_factor * K_s^1].

    With ``adaptive=False`` K_s never changes (lhat is still tracked and reported).
    """

    def __init__(self, k_init: int, *, rho1: float = 0.01, rho2: float = 0.05, adaptive: bool = True,
                 momentum: float = 0.9, window: int = 10, milestone_every: int = 100,
                 max_factor: float = 4.0) -> None:
        if k_init < 1 or milestone_every < 1 or window < 1:
            raise ValueError("k_init, milestone_every and window must be >= 1")
        self.k_init, self.k = int(k_init), int(k_init)
        self.rho1, self.rho2, self.adaptive = float(rho1), float(rho2), bool(adaptive)
        self.momentum, self.window, self.milestone_every = float(momentum), int(window), int(milestone_every)
        self.k_max = max(1, int(math.floor(max_factor * k_init + 0.5)))
        self.lhat: float | None = None
        self.history: list[float] = []
        self.last_delta: float = float("nan")

    def delta(self) -> float | None:
        n = len(self.history)
        w = min(self.window, n // 2)
        if w < 1:
            return None
        recent = self.history[-w:]
        before = self.history[-2 * w:-w]
        return float(np.mean(recent) - np.mean(before))

    def update(self, rnd: int, mean_ls: float) -> int:
        if math.isfinite(mean_ls):
            self.lhat = mean_ls if self.lhat is None else self.momentum * self.lhat + (1 - self.momentum) * mean_ls
        if self.lhat is not None:
            self.history.append(self.lhat)
        self.last_delta = float("nan")
        if rnd % self.milestone_every == 0:
            d = self.delta()
            if d is not None:
                self.last_delta = d
                if self.adaptive:
                    k = self.k
                    if abs(d) < self.rho1:
                        k = self.k / 2
                    elif abs(d) > self.rho2:
                        k = self.k * 2
                    self.k = int(min(max(math.floor(k + 0.5), 1), self.k_max))
        return self.k

    def state_dict(self) -> dict[str, Any]:
        return {"k": self.k, "lhat": self.lhat, "history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.k, self.lhat, self.history = int(state["k"]), state["lhat"], list(state["history"])


def milestone_period(cfg: SemiSFLConfig, num_rounds: int) -> int:
    """``milestone-every``, or 10% of the run (100 rounds at the paper's H = 1000)."""
    return cfg.milestone_every if cfg.milestone_every > 0 else max(1, int(round(0.1 * num_rounds)))


# --------------------------------------------------------------------------- models
class ProjectionHead(nn.Module):
    """w_p: flatten -> Linear(F, F_h) -> ReLU -> Linear(F_h, d_z) (spec §5 [R])."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_dim, hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, out_dim))

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.net(e)


def bottom_output_shape(bottom: nn.Module, in_channels: int, image_size: int,
                        device: torch.device) -> tuple[int, ...]:
    """The split-layer feature shape F (without the batch dimension)."""
    was = bottom.training
    bottom.eval()
    with torch.no_grad():
        out = bottom(torch.zeros(1, in_channels, image_size, image_size, device=device))
    bottom.train(was)
    return tuple(out.shape[1:])


def _params(*modules: nn.Module) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


# --------------------------------------------------------------------------- server core
class SemiSFLServer:
    """Everything Semi-SFL computes on the PS, independent of any transport.

    Holds the student w = (w_c, w_s) as one :class:`tasks.models.StagedModel` (``model``,
    cut into ``bottom``/``top`` sharing its parameters), the projection head ``proj``, the
    teacher (``teacher`` cut into ``t_bottom``/``t_top``, and ``t_proj``), the queue, the
    two optimizers of spec §9.7 (``opt_sup`` on w_c, w_s, w_p for stage A; ``opt_cross``
    on w_s, w_p for stage C) and the K_s controller.
    """

    def __init__(self, model: nn.Module, cfg: SemiSFLConfig, *, cut: str | None, labeled: ArrayDataset,
                 augmenter, device: torch.device, lr: float, momentum: float, weight_decay: float,
                 seed: int, num_rounds: int = 100) -> None:
        self.cfg, self.device, self.seed, self.aug = cfg, device, seed, augmenter
        self.labeled = labeled
        self.model = model
        self.cut = resolve_cut(model, cut)
        self.bottom, self.top = split_model(model, self.cut)
        self.teacher = copy.deepcopy(model)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.t_bottom, self.t_top = split_model(self.teacher, self.cut)
        x0 = labeled.x[:1] if len(labeled) else None
        c, s = (x0.shape[1], x0.shape[2]) if x0 is not None else (augmenter.in_channels, augmenter.image_size)
        self.feature_shape = bottom_output_shape(self.bottom, c, s, device)
        in_dim = int(np.prod(self.feature_shape))
        self.proj = ProjectionHead(in_dim, cfg.proj_hidden or in_dim, cfg.proj_dim).to(device)
        self.t_proj = copy.deepcopy(self.proj)
        for p in self.t_proj.parameters():
            p.requires_grad_(False)
        self.queue = FeatureQueue(cfg.proj_dim, cfg.queue_labeled, cfg.queue_unlabeled,
                                  labeled_every=cfg.queue_labeled_every, device=device)
        self.base_lr = lr
        sgd = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.opt_sup = torch.optim.SGD(_params(self.model, self.proj), **sgd)
        self.opt_cross = torch.optim.SGD(_params(self.top, self.proj), **sgd)
        self.num_rounds = num_rounds
        self.controller = KsController(cfg.k_s, rho1=cfg.rho1, rho2=cfg.rho2, adaptive=cfg.adaptive_ks,
                                       momentum=cfg.loss_momentum, window=cfg.window,
                                       milestone_every=milestone_period(cfg, num_rounds),
                                       max_factor=cfg.ks_max_factor)
        self._cross: dict[str, float] = {}
        self.last_pseudo: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}  # node -> (yhat, mask), last barrier
        self._sup_losses: list[float] = []

    # ------------------------------------------------------------------ schedule
    def lr_for_round(self, rnd: int) -> float:
        if self.cfg.lr_schedule == "constant":
            return self.base_lr
        return cosine_decay(rnd - 1, max(self.num_rounds, 1), self.base_lr)

    def set_lr(self, lr: float) -> None:
        for opt in (self.opt_sup, self.opt_cross):
            for g in opt.param_groups:
                g["lr"] = lr

    @property
    def k_s(self) -> int:
        return self.controller.k

    # ------------------------------------------------------------------ teacher helpers
    def _ema_all(self) -> None:
        ema_update(self.teacher, self.model, self.cfg.ema_decay)
        ema_update(self.t_proj, self.proj, self.cfg.ema_decay)

    def _ema_top(self) -> None:
        ema_update(self.t_top, self.top, self.cfg.ema_decay)
        ema_update(self.t_proj, self.proj, self.cfg.ema_decay)

    @torch.no_grad()
    def teacher_features_of_images(self, x_norm: torch.Tensor) -> torch.Tensor:
        self.teacher.eval()
        return self.t_bottom(x_norm)

    @property
    def fills_level1(self) -> bool:
        """Queue level 1 (labeled teacher projections) is filled whenever a loss reads the
        queue: C (its confident positives include level 1) or T with queue references."""
        cfg = self.cfg
        return cfg.clustering or (cfg.supcon and cfg.supcon_references == "batch+queue")

    # ------------------------------------------------------------------ stage A
    def supervised_stage(self, rnd: int, steps: int | None = None) -> dict[str, float]:
        """K_s steps of l_s = H_s (+ T) on the labeled set; EMA teacher and queue level 1 per step."""
        cfg = self.cfg
        steps = self.k_s if steps is None else steps
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "semisfl-sup", rnd))
        torch.manual_seed(derive_seed(self.seed, "semisfl-sup-aug", rnd))
        view = getattr(self.aug, cfg.labeled_view)
        self.model.train()
        self.proj.train()
        sums = {"ls": 0.0, "ce": 0.0, "supcon": 0.0}
        n = 0
        for idx in batch_indices(len(self.labeled), cfg.labeled_batch_size, steps, gen):
            x, y = to_device_batch(self.labeled, idx, self.device)
            e = self.bottom(view(x))
            ce = F.cross_entropy(self.top(e), y)
            loss = ce
            t = ce.new_zeros(())
            if cfg.supcon:
                qz = qy = qc = None
                if cfg.supcon_references == "batch+queue" and len(self.queue) > 0:
                    qz, qy, qc = self.queue.tensors()
                tau = cfg.tau if cfg.supcon_queue_positives == "confident" else None
                t = supervised_contrastive(self.proj(e), y, qz, qy, qc, tau=tau, kappa=cfg.kappa)
                loss = ce + t
            self.opt_sup.zero_grad(set_to_none=True)
            loss.backward()
            self.opt_sup.step()
            self._ema_all()
            if self.fills_level1:
                with torch.no_grad():
                    self.t_proj.eval()
                    zt = self.t_proj(self.teacher_features_of_images(self.aug.weak(x)))
                    self.queue.enqueue_labeled(zt, y)
            sums["ls"] += float(loss.detach())
            sums["ce"] += float(ce.detach())
            sums["supcon"] += float(t.detach())
            n += 1
        self._sup_losses.append(sums["ls"] / max(n, 1))
        return {"sup-loss": sums["ls"] / max(n, 1), "sup-ce": sums["ce"] / max(n, 1),
                "sup-supcon": sums["supcon"] / max(n, 1), "ks": float(steps)}

    # ------------------------------------------------------------------ stage C
    @torch.no_grad()
    def teacher_path(self, e_teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q~, yhat, conf, z~)`` of teacher features (z~ is None-free: zeros if C is off)."""
        self.teacher.eval()
        self.t_proj.eval()
        q = torch.softmax(self.t_top(e_teacher), dim=1)
        conf, yhat = q.max(dim=1)
        z = self.t_proj(e_teacher) if self.cfg.clustering else q.new_zeros(len(q), self.cfg.proj_dim)
        return q, yhat, conf, z

    def unlabeled_loss(self, e: torch.Tensor, q: torch.Tensor, yhat: torch.Tensor,
                       queue: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """l_u = H_u + C for one client's student features ``e``; returns (l_u, H_u, C, mask)."""
        cfg = self.cfg
        h_u, mask = masked_pseudo_label_ce(self.top(e), q, cfg.tau, strict=True)
        c = h_u.new_zeros(())
        if cfg.clustering and queue is not None and queue[0].shape[0] > 0:
            qz, qy, qc = queue
            c = clustering_regularization(self.proj(e), yhat, qz, qy, qc, tau=cfg.tau, kappa=cfg.kappa)
        return h_u + c, h_u, c, mask

    def cross_iteration(self, payloads: Mapping[Any, Mapping[str, torch.Tensor]]
                        ) -> dict[Any, dict[str, torch.Tensor]]:
        """One barrier of stage C: per-client feature gradients, one averaged top/proj step.

        ``payloads[node]`` holds ``"student"`` (e_i, [d_i, *F]) and ``"teacher"`` (e~_i)
        and optionally ``"hidden-labels"`` (metrics only). Returns
        ``{node: {"student": d l_u / d e_i}}``. Statistics accumulate until
        :meth:`pop_cross_metrics`.
        """
        cfg = self.cfg
        nodes = list(payloads)
        if not nodes:
            return {}
        teach = {}
        for n in nodes:
            e_t = payloads[n][TEACHER].to(self.device, torch.float32)
            teach[n] = self.teacher_path(e_t)
        if cfg.clustering and cfg.enqueue_before_loss:
            for n in nodes:
                _, yhat, conf, z = teach[n]
                self.queue.enqueue_unlabeled(z, yhat, conf)
        queue = self.queue.tensors() if cfg.clustering else None
        self.top.train()
        self.proj.train()
        params = _params(self.top, self.proj)
        acc = [torch.zeros_like(p) for p in params]
        out: dict[Any, dict[str, torch.Tensor]] = {}
        for n in nodes:
            q, yhat, conf, _ = teach[n]
            e = payloads[n][STUDENT].to(self.device, torch.float32).detach().requires_grad_(True)
            loss, h_u, c, mask = self.unlabeled_loss(e, q, yhat, queue)
            grads = torch.autograd.grad(loss, [e, *params], allow_unused=True)
            out[n] = {STUDENT: grads[0].detach()}
            for a, g in zip(acc, grads[1:]):
                if g is not None:
                    a.add_(g)
            self._record_cross(loss, h_u, c, mask, conf, yhat, payloads[n].get(HIDDEN_LABELS))
            self.last_pseudo[n] = (yhat.detach(), mask.detach())
        for p, a in zip(params, acc):
            p.grad = a / len(nodes)
        self.opt_cross.step()
        self.opt_cross.zero_grad(set_to_none=True)
        if cfg.ema_top_in_cross:
            self._ema_top()
        if cfg.clustering and not cfg.enqueue_before_loss:
            for n in nodes:
                _, yhat, conf, z = teach[n]
                self.queue.enqueue_unlabeled(z, yhat, conf)
        self._cross["iterations"] = self._cross.get("iterations", 0.0) + 1
        return out

    def _record_cross(self, loss, h_u, c, mask, conf, yhat, hidden) -> None:
        s = self._cross
        k = float(len(mask))
        s["lu"] = s.get("lu", 0.0) + float(loss.detach())
        s["hu"] = s.get("hu", 0.0) + float(h_u.detach())
        s["c"] = s.get("c", 0.0) + float(c.detach())
        s["terms"] = s.get("terms", 0.0) + 1
        s["samples"] = s.get("samples", 0.0) + k
        s["confident"] = s.get("confident", 0.0) + float(mask.sum())
        s["conf-sum"] = s.get("conf-sum", 0.0) + float(conf.sum())
        if hidden is not None:
            stats = self.pseudo_label_stats(yhat, mask, hidden)
            s["labeled-samples"] = s.get("labeled-samples", 0.0) + k
            s["wrong-confident"] = s.get("wrong-confident", 0.0) + stats["wrong-confident"]
            s["wrong-all"] = s.get("wrong-all", 0.0) + stats["wrong-all"]
            s["confident-with-labels"] = s.get("confident-with-labels", 0.0) + float(mask.sum())

    @staticmethod
    @torch.no_grad()
    def pseudo_label_stats(yhat: torch.Tensor, mask: torch.Tensor, hidden_labels: torch.Tensor) -> dict[str, float]:
        """METRICS ONLY: compares pseudo-labels with the simulation's hidden labels."""
        y = hidden_labels.reshape(-1).to(yhat.device, torch.long)
        wrong = (yhat != y)
        return {"wrong-confident": float((wrong & (mask > 0)).sum()), "wrong-all": float(wrong.sum())}

    def pop_cross_metrics(self) -> dict[str, float]:
        s, self._cross = self._cross, {}
        terms, samples = s.get("terms", 0.0), s.get("samples", 0.0)
        nan = float("nan")
        out = {"unsup-loss": s["lu"] / terms if terms else nan,
               "unsup-hu": s["hu"] / terms if terms else nan,
               "unsup-cluster": s["c"] / terms if terms else nan,
               "mask-rate": s["confident"] / samples if samples else nan,
               "mean-confidence": s["conf-sum"] / samples if samples else nan,
               "cross-iterations": s.get("iterations", 0.0)}
        if s.get("labeled-samples"):
            cl = s["confident-with-labels"]
            out["impurity"] = s["wrong-confident"] / cl if cl else nan
            out["pseudo-label-accuracy"] = 1.0 - s["wrong-all"] / s["labeled-samples"]
        return out

    # ------------------------------------------------------------------ stage E
    def end_round(self, rnd: int) -> dict[str, float]:
        """Feed the round's mean supervised loss to the controller; K_s for the next round."""
        ls = float(np.mean(self._sup_losses)) if self._sup_losses else float("nan")
        self._sup_losses = []
        k_next = self.controller.update(rnd, ls)
        return {"ks-next": float(k_next), "ls-hat": float(self.controller.lhat or float("nan")),
                "ls-delta": self.controller.last_delta}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        def cpu(m):
            return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
        return {"teacher": cpu(self.teacher), "proj": cpu(self.proj), "t_proj": cpu(self.t_proj),
                "queue": self.queue.state_dict(), "opt_sup": self.opt_sup.state_dict(),
                "opt_cross": self.opt_cross.state_dict(), "controller": self.controller.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.teacher.load_state_dict(state["teacher"])
        self.proj.load_state_dict(state["proj"])
        self.t_proj.load_state_dict(state["t_proj"])
        self.queue.load_state_dict(state["queue"])
        self.opt_sup.load_state_dict(state["opt_sup"])
        self.opt_cross.load_state_dict(state["opt_cross"])
        self.controller.load_state_dict(state["controller"])


# --------------------------------------------------------------------------- strategy (PS)
class SemiSFLStrategy(SplitStrategy):
    """Semi-SFL over the split runtime (:mod:`split_layer.runtime`); math in the module docstring.

    Runtime hooks used: ``begin_round`` runs stage A (and sets the round's lr),
    ``begin_extras`` adds the teacher bottom, ``server_iteration`` is one stage-C barrier,
    ``aggregate`` is stage D (uniform mean) + E (controller).
    """

    label_mode = "server"

    def setup_split(self) -> None:
        if len(self.env.server_labeled()) == 0:
            raise ConfigError("semisfl needs the labeled set D_l on the server: labeled_data=(x, y)"
                              if self.user is not None else
                              "semisfl needs server-labels > 0 (the labeled set D_l on the server)")
        t = self.task
        self.core = SemiSFLServer(self.model, self.cfg, cut=self.cut, labeled=self.env.server_labeled(),
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
        nodes = self.order(finals)  # stage D: uniform mean over the replies [R]
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
    def eval_model(self) -> torch.nn.Module:
        return self.core.teacher  # the global teacher (w~_c, w~_s) [P]

    def evaluate_global(self) -> dict[str, Any]:
        out = super().evaluate_global()
        if not out:
            return out  # no server test set: start(evaluate_fn=...) evaluates
        student = evaluate(self.model, self.env.test, aug=self.env.augmenter, device=self.env.device,
                           num_classes=self.env.num_classes)
        out["teacher-accuracy"] = out["accuracy"]
        out["student-accuracy"] = student["accuracy"]
        return out

    # ------------------------------------------------------------------ checkpoints
    def split_extra_state(self) -> dict[str, Any]:
        return {"semisfl": self.core.state_dict()}

    def load_split_extra_state(self, state: dict[str, Any]) -> None:
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

ALGORITHMS = bind({
    "semisfl": AlgorithmSpec(
        name="semisfl", paper="Sun et al., Semi-SFL (clustering regularization + adaptive K_s)",
        strategy_cls=SemiSFLStrategy, config_cls=SemiSFLConfig, namespace=NAMESPACE, client=_CLIENT,
        label_metrics=PL_COUNTS,
        description="split FL, labels on the server only: H_s+T, H_u+C, EMA teacher, adaptive K_s"),
    "semisfl-no-cluster": AlgorithmSpec(
        name="semisfl-no-cluster", paper="Semi-SFL ablation (FedSwitch-SL style, spec §7)",
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
