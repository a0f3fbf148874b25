"""Weak/strong image augmentation on uint8 batches (FixMatch style), pure torch.

:class:`Augmenter` maps a uint8 batch ``[B, C, H, W]`` (C = 1 or 3) to a normalised
float32 batch on the same device:

* :meth:`Augmenter.test` - normalisation only, ``(x / 255 - mean) / std``.
* :meth:`Augmenter.weak` - random translation (pad ``crop_padding`` and crop back to
  ``image_size``; reflect padding as in FixMatch, or zeros) and, if ``flip``, a
  horizontal flip with probability 1/2. Vectorised over the batch: one gather.
* :meth:`Augmenter.strong` - an independent weak draw, then per sample
  ``torchvision.transforms.v2.RandAugment`` with ``num_ops`` (2) operations, each with
  its own magnitude drawn uniformly from bins 1..30 of 31 (FixMatch's "RA with random
  magnitude" variant; torchvision's fixed magnitude 9 is used with
  ``random_magnitude=False``), then Cutout (FixMatch: one square of side
  ``image_size // 2`` at a uniform centre, clipped at the border, filled with gray 127).
* :meth:`Augmenter.weak_strong` - ``(weak(x), strong(x))``, two independent draws.

``weak_uint8`` / ``strong_uint8`` return the augmented uint8 images before
normalisation.

Randomness
----------
Every random number is drawn on the CPU from the torch **global** generator
(``torch.randint`` / ``torch.rand`` without a generator; torchvision's RandAugment does
the same), whatever the device of the data. Hence ``torch.manual_seed(s)`` before a
call reproduces the same augmentation exactly, on CPU and CUDA alike, which split
learning relies on to re-run a forward pass. Draw order: crop offsets, flips, then
per sample (op, sign) pairs and magnitudes, then Cutout centres.

Defaults where the papers are silent
------------------------------------
* ``crop_padding=None`` means ``int(0.125 * image_size)``: 4 for 32x32 (FixMatch), 3
  for 28x28. ``0`` disables the translation.
* ``mean``/``std`` default to 0.5 per channel; one value or one per channel.
* Geometric RandAugment ops fill with 0 (torchvision default); nearest interpolation.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Augmenter"]

_PADDING_MODES = ("reflect", "zeros")


def _per_channel(key: str, value: Sequence[float] | float | None, channels: int) -> torch.Tensor:
    if value is None:
        value = [0.5] * channels
    elif isinstance(value, (int, float)):
        value = [float(value)] * channels
    value = [float(v) for v in value]
    if len(value) == 1:
        value = value * channels
    if len(value) != channels:
        raise ValueError(f"{key}={value!r} must have 1 or {channels} values (in_channels={channels})")
    if key == "std" and any(v <= 0 for v in value):
        raise ValueError(f"std={value!r} must be positive")
    return torch.tensor(value, dtype=torch.float32).view(1, channels, 1, 1)


class Augmenter:
    """Weak/strong/test transforms for uint8 image batches.

    Args:
        in_channels: 1 (grayscale) or 3 (RGB).
        image_size: height = width of the images.
        flip: random horizontal flips in weak/strong (False for digits, e.g. SVHN).
        mean, std: normalisation (default 0.5 per channel).
        crop_padding: translation range in pixels; ``None`` -> ``int(0.125*image_size)``.
        padding_mode: ``"reflect"`` (FixMatch) or ``"zeros"``.
        cutout: apply Cutout in :meth:`strong`.
        cutout_size: side of the Cutout square; ``None`` -> ``image_size // 2``.
        num_ops: RandAugment operations per image.
        random_magnitude: FixMatch-style random magnitude per op (else torchvision's 9).
    """

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        *,
        flip: bool,
        mean: Sequence[float] | float | None = None,
        std: Sequence[float] | float | None = None,
        crop_padding: int | None = None,
        padding_mode: str = "reflect",
        cutout: bool = True,
        cutout_size: int | None = None,
        num_ops: int = 2,
        random_magnitude: bool = True,
    ) -> None:
        if in_channels not in (1, 3):
            raise ValueError(f"in_channels={in_channels!r} must be 1 or 3")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 2:
            raise ValueError(f"image_size={image_size!r} must be an integer >= 2")
        if crop_padding is None:
            crop_padding = int(0.125 * image_size)
        if isinstance(crop_padding, bool) or not isinstance(crop_padding, int) or not 0 <= crop_padding < image_size:
            raise ValueError(f"crop_padding={crop_padding!r} must be an integer in [0, image_size)")
        if padding_mode not in _PADDING_MODES:
            raise ValueError(f"padding_mode={padding_mode!r} is not one of {', '.join(_PADDING_MODES)}")
        if cutout_size is None:
            cutout_size = image_size // 2
        if isinstance(cutout_size, bool) or not isinstance(cutout_size, int) or not 0 <= cutout_size <= image_size:
            raise ValueError(f"cutout_size={cutout_size!r} must be an integer in [0, image_size]")
        if isinstance(num_ops, bool) or not isinstance(num_ops, int) or num_ops < 0:
            raise ValueError(f"num_ops={num_ops!r} must be a non-negative integer")
        self.in_channels = in_channels
        self.image_size = image_size
        self.flip = bool(flip)
        self.crop_padding = crop_padding
        self.padding_mode = padding_mode
        self.cutout = bool(cutout)
        self.cutout_size = cutout_size
        self.num_ops = num_ops
        self.random_magnitude = bool(random_magnitude)
        self._mean = _per_channel("mean", mean, in_channels)
        self._std = _per_channel("std", std, in_channels)
        # One op per call; the magnitude is set before each call when random. Built on first
        # use: importing torchvision costs ~1.5 s, paid by every ClientApp process in a
        # deployment, and only the strong view needs it.
        self._ra_op = None

    @property
    def _ra(self):
        if self._ra_op is None:
            from torchvision.transforms import v2

            self._ra_op = v2.RandAugment(num_ops=1)
        return self._ra_op

    @property
    def _num_bins(self) -> int:
        return self._ra.num_magnitude_bins

    def __repr__(self) -> str:
        return (f"Augmenter(in_channels={self.in_channels}, image_size={self.image_size}, flip={self.flip}, "
                f"crop_padding={self.crop_padding}, padding_mode={self.padding_mode!r}, cutout={self.cutout}, "
                f"cutout_size={self.cutout_size}, num_ops={self.num_ops}, "
                f"random_magnitude={self.random_magnitude})")

    # -- checks -------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 4:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a uint8 tensor [B, C, H, W], got {got}")
        _, c, h, w = x.shape
        if c != self.in_channels or h != self.image_size or w != self.image_size:
            raise ValueError(f"x has shape {tuple(x.shape)}, expected [B, {self.in_channels}, "
                             f"{self.image_size}, {self.image_size}] (in_channels, image_size)")

    # -- public transforms ----------------------------------------------------
    def normalize(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 -> float32 ``(x / 255 - mean) / std`` on ``x``'s device."""
        mean = self._mean.to(x_uint8.device)
        std = self._std.to(x_uint8.device)
        return (x_uint8.to(torch.float32).div_(255.0).sub_(mean)).div_(std)

    def test(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Normalisation only."""
        self._check(x_uint8)
        return self.normalize(x_uint8)

    def weak(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Random crop (+ horizontal flip if ``flip``), normalised."""
        return self.normalize(self.weak_uint8(x_uint8))

    def strong(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Weak + per-sample RandAugment + Cutout, normalised."""
        return self.normalize(self.strong_uint8(x_uint8))

    def weak_strong(self, x_uint8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weak(x), strong(x))`` from independent draws (weak first)."""
        return self.weak(x_uint8), self.strong(x_uint8)

    def __call__(self, x_uint8: torch.Tensor, kind: str = "weak") -> torch.Tensor:
        if kind == "weak":
            return self.weak(x_uint8)
        if kind == "strong":
            return self.strong(x_uint8)
        if kind == "test":
            return self.test(x_uint8)
        raise ValueError(f"kind={kind!r} is not one of weak, strong, test")

    # -- uint8 stages ---------------------------------------------------------
    def weak_uint8(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Random translation and flip of a uint8 batch (vectorised; returns uint8)."""
        self._check(x_uint8)
        x = x_uint8
        b, c, h, w = x.shape
        p = self.crop_padding
        if b == 0 or (p == 0 and not self.flip):
            return x.clone()
        # Draws on the CPU global generator (device independent).
        if p > 0:
            oy = torch.randint(0, 2 * p + 1, (b,))
            ox = torch.randint(0, 2 * p + 1, (b,))
        else:
            oy = ox = torch.zeros(b, dtype=torch.long)
        rows = oy[:, None] - p + torch.arange(h)[None, :]  # [B, H] source row in the unpadded image
        cols_base = torch.arange(w)[None, :]
        if self.flip:
            flipped = torch.rand(b) < 0.5
            cols_base = torch.where(flipped[:, None], (w - 1 - torch.arange(w))[None, :], cols_base)
        cols = ox[:, None] - p + cols_base  # [B, W]
        valid = None
        if self.padding_mode == "reflect":
            rows = torch.where(rows < 0, -rows, rows)
            rows = torch.where(rows > h - 1, 2 * (h - 1) - rows, rows)
            cols = torch.where(cols < 0, -cols, cols)
            cols = torch.where(cols > w - 1, 2 * (w - 1) - cols, cols)
        else:
            valid = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
            rows = rows.clamp(0, h - 1)
            cols = cols.clamp(0, w - 1)
        dev = x.device
        rows = rows.to(dev)
        cols = cols.to(dev)
        out = x.gather(2, rows[:, None, :, None].expand(b, c, h, w))
        out = out.gather(3, cols[:, None, None, :].expand(b, c, h, w))
        if valid is not None:
            out = out * valid[:, None].to(dev)
        return out

    def strong_uint8(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Weak, then per-sample RandAugment, then Cutout (returns uint8)."""
        x = self.weak_uint8(x_uint8)
        b = x.shape[0]
        if self.num_ops > 0:
            out = torch.empty_like(x)
            for i in range(b):
                img = x[i]
                for _ in range(self.num_ops):
                    if self.random_magnitude:
                        self._ra.magnitude = int(torch.randint(1, self._num_bins, ()))
                    else:
                        self._ra.magnitude = 9
                    img = self._ra(img)
                out[i] = img
            x = out
        if self.cutout and self.cutout_size > 0 and b > 0:
            x = self._cutout(x)
        return x

    def _cutout(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        s = self.cutout_size
        cy = torch.randint(0, h, (b,))
        cx = torch.randint(0, w, (b,))
        y0 = (cy - s // 2).clamp(0, h)
        x0 = (cx - s // 2).clamp(0, w)
        y1 = (cy - s // 2 + s).clamp(0, h)
        x1 = (cx - s // 2 + s).clamp(0, w)
        r = torch.arange(h)[None, :]
        q = torch.arange(w)[None, :]
        in_r = (r >= y0[:, None]) & (r < y1[:, None])
        in_c = (q >= x0[:, None]) & (q < x1[:, None])
        mask = (in_r[:, :, None] & in_c[:, None, :])[:, None].to(x.device)  # [B, 1, H, W]
        return torch.where(mask, torch.full((), 127, dtype=x.dtype, device=x.device), x)
