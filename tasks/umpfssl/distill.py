"""UM-pFSSL's local training on soft pseudo-labels (the paper's Sec. 3, Algorithm 1), plain torch."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tasks.env import Env
from tasks.losses import kl_to_target
from tasks.training import batch_indices, make_sgd, seeded, to_device_batch

__all__ = ["train_distill"]


def train_distill(model, labeled, unlabeled, targets: torch.Tensor, mu: float, *, env: Env,
                  seed: int) -> dict[str, float]:
    """E epochs (``local-epochs``; one with ``local-steps``): a pass of ``mu * CE`` on labeled
    batches, then a pass of ``(1-mu) * KL(yhat||f)`` on unlabeled batches against ``targets``
    (``[|unlabeled|, C]``), weak augmentation, dropout on."""
    t = env.task
    opt = make_sgd(model.parameters(), t)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    epochs = 1 if t.local_steps > 0 else t.local_epochs
    losses, seen = [], 0
    with seeded(seed, env.device):   # augmentation and dropout draws
        for _ in range(epochs):
            for data, is_lab in ((labeled, True), (unlabeled, False)):
                n = len(data)
                if n == 0:
                    continue
                steps = t.local_steps if t.local_steps > 0 else math.ceil(n / t.batch_size)
                for idx in batch_indices(n, t.batch_size, steps, gen):
                    xb, yb = to_device_batch(data, idx, env.device)
                    logits = model(env.augmenter.weak(xb))
                    if is_lab:
                        loss = mu * F.cross_entropy(logits, yb)
                    else:
                        loss = (1.0 - mu) * kl_to_target(logits, targets[idx.to(targets.device)])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
                    seen += len(idx)
    return {"train-loss": float(np.mean(losses)) if losses else 0.0, "samples-seen": float(seen)}
