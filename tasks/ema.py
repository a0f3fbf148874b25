"""Exponential moving average of a model, or of a part of it (the EMA teacher). Plain torch."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn

__all__ = ["ema_update"]


def _selected(name: str, keys: Optional[Sequence[str]]) -> bool:
    if keys is None:
        return True
    return any(name == k or name.startswith(k + ".") for k in keys)


@torch.no_grad()
def ema_update(
    teacher: nn.Module,
    student: nn.Module,
    decay: float,
    *,
    params_only: bool = False,
    keys: Optional[Iterable[str]] = None,
    buffers: str = "copy",
) -> None:
    """EMA teacher update ``w~ <- decay * w~ + (1 - decay) * w`` (Semi-SFL, Sec. III: the teacher model, and the bottoms' Eq. 8).

    ``teacher`` and ``student`` must have the same parameter and buffer names.
    To update only PART of a model, either pass the submodules themselves
    (``ema_update(teacher.bottom, student.bottom, g)``: Semi-SFL's client-side
    teacher bottom) or restrict with ``keys``: a name matches if it equals a key
    or starts with ``key + "."``, so ``keys=["top", "proj"]`` selects whole
    submodules and ``keys=["fc.weight"]`` a single tensor.

    Buffers (BatchNorm running statistics):
    * ``buffers="copy"`` (default): floating buffers are copied from the
      student, as in the common FixMatch/Mean-Teacher EMA implementations. The
      teacher is only run in eval mode, so it never updates its own statistics.
    * ``buffers="ema"``: floating buffers are averaged like parameters.
    * ``buffers="skip"`` or ``params_only=True``: buffers are left alone.
    Integer buffers (``num_batches_tracked``) are copied unless skipped.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    if buffers not in ("copy", "ema", "skip"):
        raise ValueError(f"buffers must be 'copy', 'ema' or 'skip', got {buffers!r}")
    keys = list(keys) if keys is not None else None
    s_params = dict(student.named_parameters())
    matched = 0
    for name, t in teacher.named_parameters():
        if not _selected(name, keys):
            continue
        if name not in s_params:
            raise KeyError(f"student has no parameter {name!r}")
        s = s_params[name].detach().to(device=t.device, dtype=t.dtype)
        t.mul_(decay).add_(s, alpha=1.0 - decay)
        matched += 1
    if not (params_only or buffers == "skip"):
        s_bufs = dict(student.named_buffers())
        for name, t in teacher.named_buffers():
            if not _selected(name, keys):
                continue
            if name not in s_bufs:
                raise KeyError(f"student has no buffer {name!r}")
            s = s_bufs[name].detach().to(device=t.device)
            if buffers == "ema" and t.is_floating_point():
                t.mul_(decay).add_(s.to(t.dtype), alpha=1.0 - decay)
            else:
                t.copy_(s)
            matched += 1
    if keys is not None and matched == 0:
        raise KeyError(f"no parameter or buffer matches keys {keys}")
