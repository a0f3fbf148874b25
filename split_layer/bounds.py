"""Bounds on what a node uploads, from what the run has seen (beyond :mod:`split_layer.validation`'s
shape, dtype, NaN/Inf and label range).

* :class:`StreamBounds` -- the streams a split node uploads across the cut (activations, and
  any other float stream): each payload's scale, its root mean square, is compared with the
  run's own statistics for that stream, the median of the scales accepted in the last
  :attr:`StreamBounds.WINDOW` payloads together with the current step's. A payload more than
  ``payload-bound`` times that median is refused, and its node dropped from the round: a node
  that multiplies its activations by 100 is refused from the first step it does so, the others
  train on. Before the run has history (its first step) the reference is the step's own
  median, which outvotes one node only where at least three nodes take part.
* The L2 norm of an uploaded state's difference from a reference state (``upload-norm-bound``
  on full-model uploads and on a split node's final bottom) is the core's:
  :func:`strategies.core.round_guard.update_norm`.

What this does not defend against: several colluding nodes that make up the majority of a step
(or of the history window), a node that scales its activations by less than ``payload-bound``,
activations that are wrong but of a normal scale (e.g. a flipped sign or another node's
inputs), and poisoned training of a normal scale; robust aggregation (median or trimmed-mean
rules) is not built.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

import numpy as np

__all__ = ["StreamBounds", "rms"]


def rms(x: np.ndarray) -> float:
    """Root mean square of ``x``'s values (float64; 0 for an empty array)."""
    a = np.asarray(x)
    if a.size == 0:
        return 0.0
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


class StreamBounds:
    """The run's running statistics of each uploaded float stream, and the bound they set.

    ``factor``: ``payload-bound`` (0 = off)."""

    #: payload scales kept per stream (the history whose median is the reference)
    WINDOW = 64

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)
        self._seen: dict[str, deque[float]] = {}

    def reference(self, name: str, current: list[float]) -> float:
        """The scale stream ``name``'s payloads are held to: the median of its history and ``current``."""
        return float(np.median([*self._seen.get(name, ()), *current])) if (current or name in self._seen) else 0.0

    def refuse(self, payloads: Mapping[int, Mapping[str, np.ndarray]], where: str = "") -> dict[int, str]:
        """Check one step's uploads (``node -> {stream: array}``, already shape-checked): returns
        ``node -> why`` for each node with a stream beyond the bound; the accepted nodes' scales
        join the history."""
        if self.factor <= 0 or not payloads:
            return {}
        scales: dict[str, dict[int, float]] = {}
        for node, streams in payloads.items():
            for name, x in streams.items():
                if np.issubdtype(np.asarray(x).dtype, np.floating):
                    scales.setdefault(name, {})[node] = rms(x)
        refused: dict[int, str] = {}
        for name, by_node in scales.items():
            ref = self.reference(name, list(by_node.values()))
            if ref <= 0:
                continue
            for node, s in by_node.items():
                if s > self.factor * ref and node not in refused:
                    at = f" ({where})" if where else ""
                    refused[node] = (f"stream '{name}'{at}: scale (RMS) {s:.4g} is more than payload-bound="
                                     f"{self.factor:g} x the run's median {ref:.4g}; refused, not applied")
        for name, by_node in scales.items():
            hist = self._seen.setdefault(name, deque(maxlen=self.WINDOW))
            hist.extend(s for node, s in by_node.items() if node not in refused)
        return refused
