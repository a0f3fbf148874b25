"""Semi-SFL's parameter server, plain torch (the paper's Sec. III and IV-B): the adaptive K_s
controller (:class:`KsController`, Eq. 9), the projection head (:class:`ProjectionHead`) and the
server core (:class:`SemiSFLServer`: stage A's supervised steps, stage C's cross-entity
barrier, stage E, checkpoints), independent of any transport. The math is in
:mod:`strategies.semisfl.semisfl`'s docstring; the Flower strategy and client hooks are there too.

The core works on a model cut into a bottom w_c and a top w_s by a ``split`` function
(:func:`split_layer.cut.split_model` at the run's cut; the parts share the model's
parameters); ``strategies.semisfl.semisfl.semisfl_server`` builds it that way.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

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
    seeded,
    to_device_batch,
)

__all__ = ["STUDENT", "TEACHER", "HIDDEN_LABELS", "KsController", "milestone_period", "ProjectionHead",
           "SemiSFLServer"]

STUDENT, TEACHER, HIDDEN_LABELS = "student", "teacher", "hidden-labels"  # payload stream names


# --------------------------------------------------------------------------- K_s controller
class KsController:
    """The global-updating-frequency rule of Eq. 9 (Sec. IV-B, Algorithm 1 line 22).

    ``update(h, mean_ls)`` is called after round h with the mean supervised loss of the
    round and returns K_s^{h+1}:

    * lhat <- m*lhat + (1-m)*mean_ls (the first value initialises lhat [ours]);
    * at milestone rounds (h % milestone_every == 0) with at least two lhat values,
      Delta = mean(last w values) - mean(the w values before), w = min(window, n // 2)
      (shorter windows early in short runs [ours]);
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


def milestone_period(cfg: Any, num_rounds: int) -> int:
    """``milestone-every`` of a :class:`strategies.semisfl.semisfl.SemiSFLConfig`, or 10% of the run
    (100 rounds at the paper's H = 1000)."""
    return cfg.milestone_every if cfg.milestone_every > 0 else max(1, int(round(0.1 * num_rounds)))


# --------------------------------------------------------------------------- models
class ProjectionHead(nn.Module):
    """w_p: flatten -> Linear(F, F_h) -> ReLU -> Linear(F_h, d_z) (our choice: the paper gives no
    architecture for the projection head)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_dim, hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, out_dim))

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.net(e)


def _params(*modules: nn.Module) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


# --------------------------------------------------------------------------- server core
class SemiSFLServer:
    """Everything Semi-SFL computes on the PS, independent of any transport.

    Holds the student w = (w_c, w_s) as one :class:`tasks.models.StagedModel` (``model``,
    cut by ``split`` into ``bottom``/``top`` sharing its parameters), the projection head
    ``proj``, the teacher (``teacher`` cut into ``t_bottom``/``t_top``, and ``t_proj``), the
    queue, two optimizers (our choice; ``opt_sup`` on w_c, w_s, w_p for stage A;
    ``opt_cross`` on w_s, w_p for stage C) and the K_s controller. ``cfg`` is a
    :class:`strategies.semisfl.semisfl.SemiSFLConfig`; ``feature_shape`` is F, the shape of the
    bottom's output without the batch dimension. The projection head's initialisation is
    seeded by ``seed``.
    """

    def __init__(self, model: nn.Module, cfg: Any, *, split: Callable[[nn.Module], tuple[nn.Module, nn.Module]],
                 feature_shape: tuple[int, ...], labeled: ArrayDataset, augmenter, device: torch.device,
                 lr: float, momentum: float, weight_decay: float, seed: int, num_rounds: int = 100) -> None:
        self.cfg, self.device, self.seed, self.aug = cfg, device, seed, augmenter
        self.labeled = labeled
        self.model = model
        self.bottom, self.top = split(model)
        self.teacher = copy.deepcopy(model)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.t_bottom, self.t_top = split(self.teacher)
        self.feature_shape = tuple(feature_shape)
        in_dim = int(np.prod(self.feature_shape))
        with seeded(derive_seed(seed, "semisfl-proj-init"), device):
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
        view = getattr(self.aug, cfg.labeled_view)
        self.model.train()
        self.proj.train()
        sums = {"ls": 0.0, "ce": 0.0, "supcon": 0.0}
        n = 0
        with seeded(derive_seed(self.seed, "semisfl-sup-aug", rnd), self.device):   # augmentation, dropout
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
