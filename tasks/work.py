"""Measured work: the FLOPs and optimizer steps a block of code executes (torch's own
``FlopCounterMode``), as the simulated clock (:mod:`tasks.system`) bills them.

* :func:`count_work` counts one node's work while it answers a message;
* :func:`recomputation` marks work run again only to rebuild what a process could not keep
  (reported apart, not billed);
* :func:`not_billed` runs data preparation (the augmentations of :mod:`tasks.augment`) outside
  every count: the papers' cost models bill the model's passes, not the input pipeline, and
  under torch's counter every small augmentation op pays a Python dispatch (a strong view of 64
  Fashion-MNIST images took 5x as long counted: ``python bench/clock_overhead.py``).

Plain torch, nothing else.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["Work", "count_work", "recomputation", "not_billed", "flop_counter"]


@dataclass
class Work:
    """What one block of code executed: FLOPs (torch's ``FlopCounterMode``: matmuls and
    convolutions, forward and backward, 2 FLOPs per multiply-add) and optimizer steps."""

    flops: float = 0.0
    steps: int = 0
    recompute_flops: float = 0.0   # of ``flops``: passes run again only to rebuild a graph (:func:`recomputation`)


class _GlobalOnly:
    """A stand-in for ``FlopCounterMode``'s module tracker: every FLOP counts under "Global" only.
    (The tracker's backward hooks make ``torch.autograd.grad`` fail on leaf tensors, which is
    how a split server takes the gradient of a node's activations.)"""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_OURS = "_flower_ssl_clock"


def flop_counter() -> Any:
    """torch's ``FlopCounterMode`` (not displayed), counting the total only."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalOnly()
    setattr(counter, _OURS, True)   # :func:`not_billed` suspends only these
    return counter


_STEPS = threading.local()   # .active: this thread's open Work counts; .counters: their FLOP counters
_HOOK: Any = None
_HOOK_LOCK = threading.Lock()


def _step_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    for w in getattr(_STEPS, "active", ()):
        w.steps += 1


@contextlib.contextmanager
def count_work() -> Iterator[Work]:
    """Count the FLOPs and optimizer steps this thread executes inside the block."""
    global _HOOK
    from torch.optim.optimizer import register_optimizer_step_post_hook

    with _HOOK_LOCK:
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_step_hook)
    work = Work()
    active = getattr(_STEPS, "active", None)
    if active is None:
        active = _STEPS.active = []
    counters = getattr(_STEPS, "counters", None)
    if counters is None:
        counters = _STEPS.counters = []
    counter = flop_counter()
    active.append(work)
    counters.append(counter)
    try:
        with counter:
            yield work
    finally:
        active.remove(work)
        counters.remove(counter)
        work.flops = float(counter.get_total_flops())


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    """A block that runs again work already counted, only to rebuild what a process could not
    keep (e.g. a split node's forward pass recomputed with a graph when its gradient arrives,
    because a ClientApp process does not outlive a message): its FLOPs are added to every open
    :func:`count_work`'s ``recompute_flops`` as well as its ``flops``, so the clock can leave
    them out of the algorithm's compute and report them apart. A no-op outside a count."""
    counters = list(getattr(_STEPS, "counters", ()))
    works = list(getattr(_STEPS, "active", ()))
    before = [float(c.get_total_flops()) for c in counters]
    try:
        yield
    finally:
        for w, c, b in zip(works, counters, before):
            w.recompute_flops += float(c.get_total_flops()) - b


@contextlib.contextmanager
def not_billed() -> Iterator[None]:
    """A block of data preparation (augmentation) that no count bills: while only this
    module's FLOP counters are active (a node's :func:`count_work`, the server's count), they
    are suspended for the block, so its ops run at full speed and add no FLOPs or steps. Any
    other dispatch mode on the stack (a user's own profiler) stays, and then the block is
    counted as before. Usable as a decorator."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    stack = _get_current_dispatch_mode_stack()
    ours = bool(stack) and all(getattr(getattr(m, "counter", None), _OURS, False) for m in stack)
    if not ours:
        yield
        return
    with _disable_current_modes():
        yield
