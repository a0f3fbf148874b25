"""Bytes by kind and direction: :class:`ByteMeter` (``bytes.<kind>.<up|down>`` of a round),
counted by :func:`array_bytes`, the library's one byte count (records, arrays, state dicts,
payloads)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message

__all__ = ["ByteMeter", "array_bytes"]


class ByteMeter:
    """Counts message payload bytes by (kind, direction) for the current round."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, kind: str, direction: str, nbytes: int) -> None:
        self.counts[f"bytes.{kind}.{direction}"] += int(nbytes)

    def add_record(self, kind: str, direction: str, rec: ArrayRecord) -> None:
        self.add(kind, direction, array_bytes(rec))

    def count_message(self, msg: Message, direction: str, kind_of: Callable[[str, Message, str], str | None]
                      ) -> int:
        """A message's array records, each counted under ``kind_of(key, msg, direction)`` (``None``:
        not counted); returns the bytes counted."""
        total = 0
        for key, rec in msg.content.array_records.items():
            kind = kind_of(key, msg, direction)
            if kind is not None:
                n = array_bytes(rec)
                self.add(kind, direction, n)
                total += n
        return total

    def flush(self) -> dict[str, int]:
        out = dict(self.counts)
        out["bytes.total"] = sum(self.counts.values())
        self.counts.clear()
        return out


def array_bytes(x: Any) -> int:
    """The library's one byte count: raw tensor bytes, elements x item size, without the
    per-array serialisation header and record framing (so the count is analytic: weights x 4
    bytes). ``x``: an ``ArrayRecord``, a Flower ``Array``, a numpy array or torch tensor, or a
    dict of any of these (a state dict ``{name: array}``, a payload ``{name: state dict}``)."""
    if isinstance(x, Array):
        return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    if isinstance(x, Mapping):   # (an ArrayRecord too)
        return int(sum(array_bytes(v) for v in x.values()))
    return int(np.asarray(x).nbytes)
