"""Learning-rate schedules (cosine, with optional warm-up). Plain Python."""
from __future__ import annotations

import math

__all__ = ["cosine_lr", "cosine_decay"]


def cosine_lr(
    step: float,
    total_steps: float,
    base_lr: float,
    warmup_steps: float = 0,
    floor: float = 0.0,
    c: float = 7.0 / 16.0,
) -> float:
    """SSFL/FixMatch cosine schedule with linear warmup (the SSFL paper's Appendix A.3, Eq. 10).

    * ``step < warmup_steps``: ``base_lr * step / warmup_steps`` (linear from 0 [C]).
    * otherwise ``base_lr * max(cos(pi * c * (step - w) / (total_steps - w)), floor)``
      with ``w = warmup_steps``.

    ``floor`` is the paper's eps and is RELATIVE to ``base_lr``
    (``gamma_t = gamma * max{cos(.), eps}``), e.g. 1e-4.

    ``total_steps`` is the schedule horizon, which need not be the training
    length: [C] CIFAR-10/SVHN use E_sched = 1024 epochs (1024 * 1024 steps) with
    c = 2.3, EMNIST uses E_sched = E with c = 7/16. Progress is clamped to
    [0, 1], and once the cosine first reaches the floor (``c * progress >= 1/2``)
    the rate stays at the floor. The literal formula would oscillate back up for
    c > 1/2 (Appendix A.3's formula with E = 300 and c = 2.3); inside the horizon used by the
    authors' code the two agree.
    """
    if total_steps <= warmup_steps:
        raise ValueError("total_steps must exceed warmup_steps")
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * max(step, 0) / warmup_steps
    progress = min(max((step - warmup_steps) / (total_steps - warmup_steps), 0.0), 1.0)
    phase = c * progress
    factor = floor if phase >= 0.5 else max(math.cos(math.pi * phase), floor)
    return base_lr * factor


def cosine_decay(step: float, total_steps: float, base_lr: float, min_lr: float = 0.0) -> float:
    """Plain half-period cosine decay (Semi-SFL, Sec. V-C: lr 0.02, cosine decay).

    ``min_lr + (base_lr - min_lr) * (1 + cos(pi * t / total_steps)) / 2``, with
    ``t`` clamped to ``[0, total_steps]``: ``base_lr`` at 0, ``min_lr`` at the end.
    Semi-SFL does not say what a step is; callers use rounds (one rate per
    round) or iterations.
    """
    if total_steps <= 0:
        raise ValueError("total_steps must be > 0")
    t = min(max(step, 0), total_steps)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t / total_steps))
