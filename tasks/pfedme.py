"""pFedMe's local update (Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau
Envelopes", NeurIPS 2020; code CharlieDinh/pFedMe: ``userpFedMe.py``, ``fedoptimizer.py``):
plain torch, no Flower.

One local step of client k on one mini-batch:

1. ``theta`` approximates ``argmin_theta f_k(theta) + lambda/2 ||theta - w_k||^2`` by ``K``
   gradient steps ``theta <- theta - plr (grad f_k(theta) + lambda (theta - w_k) + wd theta)``
   from the current theta (``pFedMeOptimizer.step``; ``wd`` is its ``mu``);
2. ``w_k <- w_k - eta lambda (w_k - theta)``.

Both act on the trainable parameters; ``theta``'s buffers (BatchNorm statistics) are updated
by its forward passes.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from tasks.losses import masked_pseudo_label_ce


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


def fixmatch_batch_loss(model: torch.nn.Module, x_weak: Tensor | None, y: Tensor | None,
                        u_weak: Tensor | None, u_strong: Tensor | None, *, tau: float, lambda_u: float
                        ) -> tuple[Tensor, Tensor | None]:
    """FixMatch's loss on fixed views (:func:`tasks.training.train_fixmatch`'s step):
    ``CE(f(x_weak), y) + lambda_u L_u``, ``L_u`` the confident hard pseudo-labels of the same
    model's softmax on ``u_weak`` (no gradient) against ``f(u_strong)``, over the whole unlabeled
    batch; a term without data is left out. Returns ``(loss, mask)``."""
    loss, mask = None, None
    if x_weak is not None and len(x_weak):
        loss = F.cross_entropy(model(x_weak), y)
    if u_weak is not None and len(u_weak):
        with torch.no_grad():
            pw = torch.softmax(model(u_weak), dim=1)
        lu, mask = masked_pseudo_label_ce(model(u_strong), pw, tau)
        loss = lambda_u * lu if loss is None else loss + lambda_u * lu
    if loss is None:
        raise ValueError("fixmatch_batch_loss needs a labeled or an unlabeled batch")
    return loss, mask
