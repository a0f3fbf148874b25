"""MC-dropout prediction (T stochastic passes with dropout on, BatchNorm in eval mode) and the
uncertainty scores UM-pFSSL builds on it: the normalised entropy, the relation score Corr and
the lowest-entropy pseudo-label. Plain torch."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from tasks.losses import entropy

__all__ = ["mc_dropout_predict", "CORR_FLOOR", "normalized_entropy", "relation_score", "select_pseudo_labels"]


@torch.no_grad()
def mc_dropout_predict(
    model: nn.Module, x: Tensor, T: int = 10, *, batch_size: Optional[int] = None
) -> tuple[Tensor, Tensor]:
    """MC-dropout predictive mean and entropy (UM-pFSSL, Sec. 4.1, Eqs. 9-10).

    ``P(y|x) = (1/T) sum_t softmax(f_{w_t}(x))`` over ``T`` dropout masks, and
    ``H(x) = -sum_c P_c log P_c`` (nats). Every dropout layer
    (``nn.Dropout*``, ``nn.AlphaDropout`` ...) is in train mode and everything
    else, BatchNorm included, in eval mode (so the T passes differ only by their dropout
    masks). The training flag of every module
    is restored afterwards. ``model(x)`` must return logits. ``batch_size``
    splits ``x`` into chunks. Returns ``(mean_probs [N, C], entropy [N])``.
    """
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T}")
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        for m in model.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.train()
        chunks = [x] if batch_size is None else list(torch.split(x, batch_size))
        means = []
        for xb in chunks:
            acc = None
            for _ in range(T):
                logits = model(xb)
                if logits.dtype in (torch.float16, torch.bfloat16):
                    logits = logits.float()  # average low-precision outputs in fp32
                p = torch.softmax(logits, dim=-1)
                acc = p if acc is None else acc + p
            means.append(acc / T)
        mean = torch.cat(means, dim=0)
    finally:
        for m, mode in modes.items():
            m.training = mode
    return mean, entropy(mean)


# ----------------------------------------------------------------------------- uncertainty scores
CORR_FLOOR = 1e-6   # the smallest relation score (weights stay defined when every term is 0)


def normalized_entropy(entropies: Tensor, num_classes: int, floor: float = 1e-3) -> float:
    """``Hbar = mean(H) / log C`` clamped ``>= floor`` (UM-pFSSL Eqs. 12 and 14, with the per-sample
    mean where Eq. 12 sums: our choice, so that Hbar lies in [0, 1] as the paper's Sec. 5 assumes)."""
    if entropies.numel() == 0:
        raise ValueError("normalized_entropy needs at least one entropy value")
    return max(float(entropies.mean()) / math.log(num_classes), floor)


def relation_score(mu: float, entropies_u: Optional[Tensor], probs_l: Optional[Tensor],
                   labels_l: Optional[Tensor], num_classes: int, floor: float = 1e-3) -> float:
    """``Corr(k|j) = (1 - mu_k) / Hbar + mu_k * Acc`` (UM-pFSSL Eq. 13), each term 0 when its data set is empty.

    ``entropies_u``: helper j's MC entropies on D_k^u (None/empty: first term 0);
    ``probs_l``/``labels_l``: its MC mean on D_k^s and the labels (None/empty: second term 0).
    Floored at ``CORR_FLOOR`` so that a list of all-zero scores still has weights.
    """
    corr = 0.0
    if entropies_u is not None and entropies_u.numel() > 0:
        corr += (1.0 - mu) / normalized_entropy(entropies_u, num_classes, floor)
    if probs_l is not None and probs_l.shape[0] > 0:
        acc = float((probs_l.argmax(1) == labels_l).float().mean())
        corr += mu * acc
    return max(corr, CORR_FLOOR)


def select_pseudo_labels(probs: Sequence[Tensor], entropies: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """UM-pFSSL Eq. 11: per sample, the MC mean of the model with the lowest MC entropy.

    ``probs[j]`` is ``[N, C]`` and ``entropies[j]`` is ``[N]`` for model j. Returns
    ``(yhat [N, C], j* [N])``; ties go to the first model.
    """
    H = torch.stack(list(entropies))            # [M, N]
    P = torch.stack(list(probs))                # [M, N, C]
    choice = H.argmin(dim=0)                    # [N]
    yhat = P[choice, torch.arange(P.shape[1])]
    return yhat, choice
