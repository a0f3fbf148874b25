"""The base of split algorithms: :class:`SplitStrategy`, the base strategy's round loop with
the split layer's round (:class:`split_layer.runtime.SplitRuntime`: begin, I fused exchanges,
end, aggregate) and the split run's options (:class:`split_layer.split_policy.SplitPolicy`)."""
from __future__ import annotations

from typing import Any

from split_layer.runtime import SplitRuntime
from split_layer.split_policy import SplitPolicy
from tasks.config import fields_of, replace_checked

from .base import BaseStrategy

__all__ = ["SplitStrategy"]


class SplitStrategy(SplitRuntime, BaseStrategy):
    """:class:`BaseStrategy` with the split layer's round. Takes the base strategy's arguments,
    and the split run's options: ``split=SplitPolicy(...)`` and/or its fields as keyword options
    (``split_transport='message'``, ``stream=StreamOptions(...)``)."""

    def __init__(self, *args: Any, split: SplitPolicy | None = None, **options: Any) -> None:
        names = {f.name for f, _ in fields_of(SplitPolicy)}
        own = {k: options.pop(k) for k in [k for k in options if k in names]}
        split = split or SplitPolicy()
        self.compose(replace_checked(split, **own) if own else split)
        super().__init__(*args, **options)

    def start(self, grid: Any, *args: Any, **kwargs: Any):
        """Flower's ``Strategy.start``, with the split run's options checked against the round
        policy first (a simulated ``system`` times message exchanges only)."""
        self.split.check_with(self.policy.system)
        return super().start(grid, *args, **kwargs)
