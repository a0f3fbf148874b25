"""SemiFL's building blocks (Diao, Ding, Tarokh, NeurIPS 2022; ``docs/baselines.md`` A1):
the fix + mix loss, the pseudo-labelling pass, static batch normalisation (sBN), the server's
global-momentum update and SGD with gradient-norm clipping. Plain torch/numpy, no Flower; the
algorithm is :mod:`strategies.semisfl.semifl` (not :mod:`strategies.semisfl.semisfl`, which is Semi-SFL).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tasks.data import ArrayDataset
from tasks.training import batch_bounds, seeded

__all__ = ["fix_mix_loss", "pseudo_labels", "fix_set", "static_bn", "has_running_bn", "global_momentum_step",
           "ClippedSGD"]


def fix_mix_loss(logits_strong: Tensor, y_fix: Tensor, logits_mix: Tensor, y_partner: Tensor,
                 lam: float) -> tuple[Tensor, Tensor, Tensor]:
    """SemiFL's client loss on one fix batch (authors' ``loss_mode='fix-mix'``)::

        L = mean CE(f(strong(x)), yhat) + lam mean CE(f(x_mix), yhat) + (1 - lam) mean CE(f(x_mix), yhat')

    ``logits_strong`` = f(strong(x)) and ``logits_mix`` = f(lam weak(x) + (1 - lam) weak(x')) for
    the fix batch x (pseudo-labels ``y_fix``, all confident) and its mix partners x' (pseudo-labels
    ``y_partner``); every mean runs over the fix batch. Returns ``(L, fix term, mix term)``."""
    fix = F.cross_entropy(logits_strong, y_fix.detach())
    mix = lam * F.cross_entropy(logits_mix, y_fix.detach()) + (1.0 - lam) * F.cross_entropy(logits_mix,
                                                                                           y_partner.detach())
    return fix + mix, fix, mix


@torch.no_grad()
def pseudo_labels(model: nn.Module, data: ArrayDataset, view: Callable[[Tensor], Tensor], device: torch.device,
                  seed: int, batch_size: int = 500) -> tuple[Tensor, Tensor]:
    """``(yhat, confidence)`` of every sample of ``data``: ``q = softmax(f(view(x)))`` in eval mode
    (the received model's BN statistics), ``yhat = argmax q``, ``confidence = max q`` (on
    ``device``). The view's random draws run under ``seed``; the model's mode is restored."""
    was = model.training
    model.eval()
    ys, cs = [], []
    try:
        with seeded(seed, device):
            for s in range(0, len(data), batch_size):
                xb = torch.from_numpy(data.x[s:s + batch_size]).to(device)
                q = torch.softmax(model(view(xb)), dim=1)
                c, y = q.max(dim=1)
                ys.append(y)
                cs.append(c)
    finally:
        model.train(was)
    if not ys:
        return (torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, device=device))
    return torch.cat(ys), torch.cat(cs)


def fix_set(confidence: Tensor, tau: float) -> np.ndarray:
    """Indices of SemiFL's fix set, ``{i : max q_i >= tau}`` (authors' ``max_p.ge(threshold)``:
    a confidence equal to ``tau`` is kept), as a CPU int64 array."""
    return torch.nonzero(confidence.detach().cpu() >= tau).flatten().numpy().astype(np.int64)


def _running_bn(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats and m.running_mean is not None]


def has_running_bn(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm layers that keep running statistics (what sBN recomputes)."""
    return bool(_running_bn(model))


@torch.no_grad()
def static_bn(model: nn.Module, data: ArrayDataset, view: Callable[[Tensor], Tensor], batch_size: int,
              device: torch.device, seed: int) -> int:
    """Static batch normalisation (SemiFL's sBN, authors' ``make_batchnorm_stats``): every BatchNorm
    layer's running statistics recomputed from scratch over ``data`` (in order, no shuffling),
    the model in train mode without gradients, as a cumulative average over the batches
    (``momentum=None``: running mean = the mean of the batch means, running var = the mean of the
    batches' unbiased variances). Batches follow :func:`tasks.training.batch_bounds` (no batch of
    1). Parameters are untouched; momentum and mode are restored. Returns the number of BN layers
    recomputed (0: the model has none with running statistics, nothing to do)."""
    layers = _running_bn(model)
    if not layers or len(data) == 0:
        return 0
    was = model.training
    momenta = [m.momentum for m in layers]
    for m in layers:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        with seeded(seed, device):   # (dropout draws, where the model has dropout)
            for s, t in batch_bounds(len(data), batch_size):
                model(view(torch.from_numpy(data.x[s:t]).to(device)))
    finally:
        for m, mom in zip(layers, momenta):
            m.momentum = mom
        model.train(was)
    return len(layers)


def global_momentum_step(w: dict[str, np.ndarray], wbar: dict[str, np.ndarray], v: dict[str, np.ndarray] | None,
                         beta: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """SemiFL's server update (authors' ``Server.update``: SGD with lr 1 and momentum ``beta`` on
    the pseudo-gradient ``w - wbar``)::

        v <- beta v + (w - wbar)      (v = 0 before the first update)
        w <- w - v

    over the keys of ``wbar`` (the uniform mean of the uploads). Returns ``(new w, new v)``;
    ``beta = 0`` is plain averaging (w = wbar)."""
    new_w, new_v = {}, {}
    for k, mean in wbar.items():
        g = np.asarray(w[k], dtype=np.float64) - np.asarray(mean, dtype=np.float64)
        vk = g if v is None or k not in v else beta * np.asarray(v[k], dtype=np.float64) + g
        new_v[k] = vk.astype(np.asarray(w[k]).dtype)
        new_w[k] = (np.asarray(w[k], dtype=np.float64) - vk).astype(np.asarray(w[k]).dtype)
    return new_w, new_v


class ClippedSGD(torch.optim.SGD):
    """SGD whose every step first clips the gradients' global norm to ``clip_norm`` (authors' code:
    ``clip_grad_norm_(model.parameters(), 1)`` before each local and server step; 0 = no clip).
    Its ``state_dict`` is SGD's."""

    def __init__(self, params, *, clip_norm: float = 1.0, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.clip_norm = float(clip_norm)

    def step(self, closure=None):  # type: ignore[override]
        if self.clip_norm > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if params:
                torch.nn.utils.clip_grad_norm_(params, self.clip_norm)
        return super().step(closure)
