"""MC-dropout prediction: T stochastic passes with dropout on, BatchNorm in eval mode. Plain torch."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from tasks.losses import entropy

__all__ = ["mc_dropout_predict"]


@torch.no_grad()
def mc_dropout_predict(
    model: nn.Module, x: Tensor, T: int = 10, *, batch_size: Optional[int] = None
) -> tuple[Tensor, Tensor]:
    """MC-dropout predictive mean and entropy (umpfssl.md §3, Eqs. 9-10).

    ``P(y|x) = (1/T) sum_t softmax(f_{w_t}(x))`` over ``T`` dropout masks, and
    ``H(x) = -sum_c P_c log P_c`` (nats). [R] Every dropout layer
    (``nn.Dropout*``, ``nn.AlphaDropout`` ...) is in train mode and everything
    else, BatchNorm included, in eval mode. The training flag of every module
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
