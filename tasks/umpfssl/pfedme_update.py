"""pFedMe's local update (Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau
Envelopes", NeurIPS 2020; code CharlieDinh/pFedMe: ``userpFedMe.py``, ``fedoptimizer.py``):
plain torch, no Flower.

One local step of client k on one mini-batch:

1. ``theta`` approximates ``argmin_theta f_k(theta) + lambda/2 ||theta - w_k||^2`` by ``K``
   gradient steps ``theta <- theta - plr (grad f_k(theta) + lambda (theta - w_k) + wd theta)``
   from the current theta (``pFedMeOptimizer.step``; ``wd`` is its ``mu``);
2. ``w_k <- w_k - eta lambda (w_k - theta)``.

Both act on the trainable parameters; ``theta``'s buffers (BatchNorm statistics) are updated
by its forward passes. The loss f_k of the baseline ``pfedme-fix`` is FixMatch's
(:func:`tasks.training.fixmatch_loss`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def moreau_inner_steps(theta: torch.nn.Module, anchor: Sequence[Tensor], loss_fn: Callable[[], Tensor], *,
                       lam: float, steps: int, lr: float, weight_decay: float = 0.0) -> float:
    """``steps`` gradient steps on ``loss_fn() + lam/2 ||theta - anchor||^2`` (+ ``weight_decay/2
    ||theta||^2``) in place; ``anchor`` lists the anchor tensors in the order of theta's
    trainable parameters. Returns the last ``loss_fn()`` value (before its step)."""
    params = [p for p in theta.parameters() if p.requires_grad]
    if len(params) != len(anchor):
        raise ValueError(f"anchor has {len(anchor)} tensors, theta {len(params)} trainable parameters")
    last = float("nan")
    for _ in range(steps):
        loss = loss_fn()
        grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else [None] * len(params)
        with torch.no_grad():
            for p, g, w in zip(params, grads, anchor):
                step = lam * (p - w) + weight_decay * p
                if g is not None:
                    step = step + g
                p.sub_(lr * step)
        last = float(loss.detach())
    return last


@torch.no_grad()
def moreau_outer_step(anchor: Sequence[Tensor], theta: torch.nn.Module, *, lam: float, eta: float) -> None:
    """``w_k <- w_k - eta lam (w_k - theta)`` in place on ``anchor`` (w_k's parameters)."""
    params = [p for p in theta.parameters() if p.requires_grad]
    for w, p in zip(anchor, params):
        w.sub_(eta * lam * (w - p))

