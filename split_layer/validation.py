"""Validation of tensors that cross the cut (activations up, gradients down).

A tensor from the other side is applied only after :func:`check_tensor` accepted it:
right name, shape, dtype, and (for floats) no NaN/Inf; labels also in ``[0, M)``.
Anything else raises :class:`SplitValidationError`, a ``ValueError`` whose message
names the stream, the node/step, and what was expected. The client raises it (Flower
turns it into an error reply and the server drops that node); the server catches it
and drops the node that sent the bad payload: a malformed payload is never applied.
Well-formed payloads of an abnormal scale are held to the run's own statistics by
:mod:`split_layer.bounds` (what that does and does not defend is stated there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

__all__ = ["SplitValidationError", "TensorSpec", "check_tensor", "check_streams"]


class SplitValidationError(ValueError):
    """A tensor crossing the cut has the wrong name, shape, dtype or values."""


@dataclass(frozen=True)
class TensorSpec:
    """What a stream must look like: exact shape, dtype name, optional value range (labels)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    lo: int | None = None      # integer streams: smallest allowed value
    hi: int | None = None      # integer streams: one past the largest allowed value


def _dtype_name(x: np.ndarray | torch.Tensor) -> str:
    return str(x.dtype).replace("torch.", "")


def check_tensor(name: str, x: np.ndarray | torch.Tensor, spec: TensorSpec, where: str = "") -> None:
    """Raise :class:`SplitValidationError` unless ``x`` matches ``spec``."""
    at = f" ({where})" if where else ""
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        raise SplitValidationError(f"stream '{name}'{at}: expected an array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(spec.shape):
        raise SplitValidationError(
            f"stream '{name}'{at}: shape {tuple(x.shape)} != expected {tuple(spec.shape)}")
    if _dtype_name(x) != spec.dtype:
        raise SplitValidationError(f"stream '{name}'{at}: dtype {_dtype_name(x)} != expected {spec.dtype}")
    if isinstance(x, np.ndarray):  # numpy all the way (also read-only frames decoded in place)
        floating, numel = np.issubdtype(x.dtype, np.floating), x.size
        finite = (lambda: np.isfinite(x))
    else:
        floating, numel = x.is_floating_point(), x.numel()
        finite = (lambda: torch.isfinite(x))
    if floating:
        ok = finite()
        if not bool(ok.all()):
            bad = int((~ok).sum())
            raise SplitValidationError(f"stream '{name}'{at}: {bad} NaN/Inf value(s); rejected, not applied")
    elif numel and (spec.lo is not None or spec.hi is not None):
        lo, hi = int(x.min()), int(x.max())
        if (spec.lo is not None and lo < spec.lo) or (spec.hi is not None and hi >= spec.hi):
            raise SplitValidationError(
                f"stream '{name}'{at}: values in [{lo}, {hi}] outside [{spec.lo}, {spec.hi})")


def check_streams(streams: Mapping[str, np.ndarray | torch.Tensor], specs: Mapping[str, TensorSpec],
                  where: str = "", optional: Sequence[str] = ()) -> None:
    """Check a whole payload: exactly the expected names (``optional`` may be absent), each valid."""
    at = f" ({where})" if where else ""
    extra = sorted(set(streams) - set(specs))
    missing = sorted(set(specs) - set(streams) - set(optional))
    if extra or missing:
        raise SplitValidationError(
            f"payload{at}: unexpected streams {extra}, missing streams {missing}; expected {sorted(specs)}")
    for k, x in streams.items():
        check_tensor(k, x, specs[k], where)
