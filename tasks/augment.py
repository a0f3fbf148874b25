"""Weak/strong image augmentation on uint8 batches (FixMatch style), pure torch.

:class:`Augmenter` maps a uint8 batch ``[B, C, H, W]`` (C = 1 or 3) to a normalised
float32 batch on the same device:

* :meth:`Augmenter.test` - normalisation only, ``(x / 255 - mean) / std``.
* :meth:`Augmenter.weak` - random translation (pad ``crop_padding`` and crop back to
  ``image_size``; reflect padding as in FixMatch, or zeros) and, if ``flip``, a
  horizontal flip with probability 1/2. Vectorised over the batch: one gather.
* :meth:`Augmenter.strong` - an independent weak draw, then FixMatch's RandAugment
  (``RandAugmentMC(n=2, m=10)`` with ``fixmatch_augment_pool`` in the authors' PyTorch
  code, kekmodel/FixMatch-pytorch), then Cutout.
* :meth:`Augmenter.weak_strong` - ``(weak(x), strong(x))``, two independent draws.

``weak_uint8`` / ``strong_uint8`` return the augmented uint8 images before
normalisation. Every transform is data preparation: the simulated clock bills none of it
(:func:`tasks.work.not_billed`).

Strong policy (RandAugmentMC)
-----------------------------
Per sample, ``num_ops`` (n = 2) operations are drawn uniformly, with replacement, from
the 14 ops of :data:`STRONG_OPS`. Each is applied with probability ``apply_prob`` (1/2)
at a level ``v`` drawn uniformly from ``1 .. m-1`` (``m = magnitude_levels`` = 10, so
1..9); the op's magnitude is ``v/m`` of its maximum (:func:`op_parameter`):

==============================================  ==========================================
AutoContrast, Equalize, Identity                no parameter
Brightness, Color, Contrast, Sharpness          factor ``0.05 + 0.9 v/m`` (0.14 .. 0.86)
Posterize                                       bits ``4 + int(4 v/m)`` (4 .. 7)
Rotate                                          ``±30 v/m`` degrees (±3 .. ±27)
ShearX, ShearY                                  ``±0.3 v/m`` (±0.03 .. ±0.27)
Solarize                                        threshold ``256 - int(256 v/m)`` (231 .. 26)
TranslateX, TranslateY                          ``±int(0.3 v/m * image_size)`` pixels
==============================================  ==========================================

The sign of Rotate/Shear/Translate is random (1/2). Color is the saturation and is the
identity on 1-channel images. Translation is proportional to the image size (at most
7 px on 28x28, 8 px on 32x32); integer amounts are computed exactly in integers. Shear
is an affine map with shear angle ``degrees(atan(s))`` about the corner ``[0, 0]`` (as
torchvision's RandAugment does, i.e. PIL's ``(1, s, 0, 0, 1, 0)`` transform). Geometric
ops use nearest interpolation and fill with 0. The ops are torchvision's
``transforms.v2.functional`` kernels on uint8 tensors (deterministic), applied to the
samples that drew the same (op, parameter) at the same step together.

Then Cutout: one square of side ``cutout_size`` pixels (default
``int(cutout_fraction * image_size)``, ``cutout_fraction`` = 0.5: 14 px on 28x28, 16 px
on 32x32, a quarter of the image's area) at a uniform centre, clipped at the border,
filled with gray 127. This is the authors' code: FixMatch-pytorch's ``RandAugmentMC``
ends with ``CutoutAbs(img, int(32 * 0.5))``, 16 px on its 32x32 images.

torchvision's ``v2.RandAugment`` with magnitudes up to its maximum (bins 1..30 of 31:
translation up to 0.45 of the width, rotation up to 30 degrees..., each op always applied,
then the same half-size Cutout) is too strong for 28x28 digits: ``bench/augment_strength.py``
measures how much accuracy each view costs a model trained on clean images
(docs/benchmarks.md, "Augmentation strength").

Randomness
----------
Every random number is drawn on the CPU from the torch **global** generator
(``torch.randint`` / ``torch.rand`` without a generator), whatever the device of the
data; only deterministic torchvision kernels run on the data. Hence
``torch.manual_seed(s)`` before a call reproduces the same augmentation exactly, on CPU
and CUDA alike, which split learning relies on to re-run a forward pass. A strong call
draws, each for the whole batch at once and in this order: crop offsets ``oy [B]``,
``ox [B]`` and flips ``[B]`` (the weak draw; offsets only if ``crop_padding > 0``, flips
only if ``flip``), then, if ``num_ops > 0``, op ids ``[B, n]``, levels ``[B, n]``, apply
flags ``[B, n]`` (``torch.rand < apply_prob``) and signs ``[B, n]``, then, if Cutout is
on, centres ``cy [B]``, ``cx [B]``. Nothing is drawn for an empty batch.

Defaults where the papers are silent
------------------------------------
* ``crop_padding=None`` means ``int(0.125 * image_size)``: 4 for 32x32 (FixMatch), 3
  for 28x28. ``0`` disables the translation.
* ``mean``/``std`` default to 0.5 per channel; one value or one per channel.
* ``cutout_fraction=0.5`` (the authors' PyTorch code cuts 16 px on 32x32; FixMatch's
  paper draws the side in [0, 0.5] of the width; 0.25 is a milder choice).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch

from tasks.work import not_billed

__all__ = ["Augmenter", "STRONG_OPS", "op_parameter"]

_PADDING_MODES = ("reflect", "zeros")

#: FixMatch's RandAugment pool (``fixmatch_augment_pool``), in the authors' order; the op
#: id drawn per sample indexes this tuple.
STRONG_OPS = ("AutoContrast", "Brightness", "Color", "Contrast", "Equalize", "Identity", "Posterize",
              "Rotate", "Sharpness", "ShearX", "ShearY", "Solarize", "TranslateX", "TranslateY")
_FACTOR_OPS = ("Brightness", "Color", "Contrast", "Sharpness")
_NO_PARAM_OPS = ("AutoContrast", "Equalize", "Identity")


def op_parameter(op: str, level: int, sign: int, image_size: int, magnitude_levels: int = 10):
    """The parameter of ``op`` at ``level`` (1 .. magnitude_levels-1) and ``sign`` (+1/-1).

    Factor (float) for Brightness/Color/Contrast/Sharpness, bits (int) for Posterize,
    degrees for Rotate, shear coefficient for ShearX/Y, threshold (int) for Solarize,
    pixels (int) for TranslateX/Y, ``None`` for AutoContrast/Equalize/Identity. ``sign``
    only matters for Rotate, Shear and Translate.
    """
    m = magnitude_levels
    if not 1 <= level < m:
        raise ValueError(f"level={level!r} must be in [1, magnitude_levels) = [1, {m})")
    if sign not in (1, -1):
        raise ValueError(f"sign={sign!r} must be 1 or -1")
    if op in _FACTOR_OPS:
        return 0.05 + 0.9 * level / m
    if op == "Posterize":
        return 4 + (4 * level) // m
    if op == "Rotate":
        return sign * 30.0 * level / m
    if op in ("ShearX", "ShearY"):
        return sign * 0.3 * level / m
    if op == "Solarize":
        return 256 - (256 * level) // m
    if op in ("TranslateX", "TranslateY"):
        return sign * ((3 * level * image_size) // (10 * m))  # int(0.3 * level/m * size), exactly
    if op in _NO_PARAM_OPS:
        return None
    raise ValueError(f"op={op!r} is not one of {', '.join(STRONG_OPS)}")


def _apply_op(F, nearest, img: torch.Tensor, op: str, param) -> torch.Tensor:
    """``op`` with its parameter on uint8 ``[..., C, H, W]`` (torchvision v2 functional)."""
    if op == "Identity":
        return img
    if op == "AutoContrast":
        return F.autocontrast(img)
    if op == "Equalize":
        return F.equalize(img)
    if op == "Brightness":
        return F.adjust_brightness(img, param)
    if op == "Color":
        return img if img.shape[-3] == 1 else F.adjust_saturation(img, param)
    if op == "Contrast":
        return F.adjust_contrast(img, param)
    if op == "Sharpness":
        return F.adjust_sharpness(img, param)
    if op == "Posterize":
        return F.posterize(img, param)
    if op == "Solarize":
        return F.solarize(img, param)
    if op == "Rotate":
        return F.rotate(img, param, interpolation=nearest, fill=None)
    if op in ("ShearX", "ShearY"):
        deg = math.degrees(math.atan(param))
        shear = [deg, 0.0] if op == "ShearX" else [0.0, deg]
        return F.affine(img, angle=0.0, translate=[0, 0], scale=1.0, shear=shear,
                        interpolation=nearest, fill=None, center=[0, 0])
    if op in ("TranslateX", "TranslateY"):
        translate = [param, 0] if op == "TranslateX" else [0, param]
        return F.affine(img, angle=0.0, translate=translate, scale=1.0, shear=[0.0, 0.0],
                        interpolation=nearest, fill=None)
    raise ValueError(f"op={op!r} is not one of {', '.join(STRONG_OPS)}")


def _is_fraction(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0


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
        cutout_fraction: side of the Cutout square as a fraction of ``image_size`` (in
            [0, 1]; the side is ``int(cutout_fraction * image_size)``).
        cutout_size: side of the Cutout square in pixels; overrides ``cutout_fraction``
            when given.
        num_ops: RandAugment operations per image (n).
        apply_prob: probability of applying each drawn op (FixMatch: 0.5).
        magnitude_levels: m; levels are drawn from 1..m-1, magnitude = level/m of the
            op's maximum (FixMatch: 10).
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
        cutout_fraction: float = 0.5,
        cutout_size: int | None = None,
        num_ops: int = 2,
        apply_prob: float = 0.5,
        magnitude_levels: int = 10,
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
        if not _is_fraction(cutout_fraction):
            raise ValueError(f"cutout_fraction={cutout_fraction!r} must be a number in [0, 1]")
        if cutout_size is None:
            cutout_size = int(float(cutout_fraction) * image_size)
        elif isinstance(cutout_size, bool) or not isinstance(cutout_size, int) or not 0 <= cutout_size <= image_size:
            raise ValueError(f"cutout_size={cutout_size!r} must be an integer in [0, image_size] (pixels)")
        if isinstance(num_ops, bool) or not isinstance(num_ops, int) or num_ops < 0:
            raise ValueError(f"num_ops={num_ops!r} must be a non-negative integer")
        if not _is_fraction(apply_prob):
            raise ValueError(f"apply_prob={apply_prob!r} must be a number in [0, 1]")
        if isinstance(magnitude_levels, bool) or not isinstance(magnitude_levels, int) or magnitude_levels < 2:
            raise ValueError(f"magnitude_levels={magnitude_levels!r} must be an integer >= 2")
        self.in_channels = in_channels
        self.image_size = image_size
        self.flip = bool(flip)
        self.crop_padding = crop_padding
        self.padding_mode = padding_mode
        self.cutout = bool(cutout)
        self.cutout_fraction = float(cutout_fraction)
        self.cutout_size = cutout_size
        self.num_ops = num_ops
        self.apply_prob = float(apply_prob)
        self.magnitude_levels = magnitude_levels
        self._mean = _per_channel("mean", mean, in_channels)
        self._std = _per_channel("std", std, in_channels)
        # The op pool the op ids index (tests may narrow it to one op).
        self._ops: tuple[str, ...] = STRONG_OPS
        # torchvision's functional module, imported on the first strong call: importing
        # torchvision is slow, paid by every ClientApp process in a deployment, and
        # only the strong view needs it.
        self._tv = None

    def _functional(self):
        if self._tv is None:
            from torchvision.transforms import InterpolationMode
            from torchvision.transforms.v2 import functional

            self._tv = (functional, InterpolationMode.NEAREST)
        return self._tv

    def __repr__(self) -> str:
        return (f"Augmenter(in_channels={self.in_channels}, image_size={self.image_size}, flip={self.flip}, "
                f"crop_padding={self.crop_padding}, padding_mode={self.padding_mode!r}, cutout={self.cutout}, "
                f"cutout_size={self.cutout_size}, num_ops={self.num_ops}, apply_prob={self.apply_prob}, "
                f"magnitude_levels={self.magnitude_levels})")

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
    @not_billed()
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
        """Weak + per-sample RandAugmentMC + Cutout, normalised."""
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
    @not_billed()
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

    @not_billed()
    def strong_uint8(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Weak, then per-sample RandAugmentMC, then Cutout (returns uint8)."""
        x = self.weak_uint8(x_uint8)  # a new tensor: written in place below
        b = x.shape[0]
        if b == 0:
            return x
        if self.num_ops > 0:
            x = self._apply_policy(x, self._draw_policy(b))
        if self.cutout and self.cutout_size > 0:
            x = self._cutout(x)
        return x

    def _draw_policy(self, b: int) -> dict[str, torch.Tensor]:
        """The policy's draws for ``b`` samples, in the documented order (CPU, global RNG)."""
        n = self.num_ops
        ops = torch.randint(0, len(self._ops), (b, n))
        levels = torch.randint(1, self.magnitude_levels, (b, n))
        applied = torch.rand(b, n) < self.apply_prob
        signs = torch.randint(0, 2, (b, n)) * 2 - 1
        return {"ops": ops, "levels": levels, "applied": applied, "signs": signs}

    def _apply_policy(self, x: torch.Tensor, draws: dict[str, torch.Tensor]) -> torch.Tensor:
        """Apply the drawn ops step by step; samples sharing (op, parameter) at a step go together."""
        F, nearest = self._functional()
        ops, levels = draws["ops"].tolist(), draws["levels"].tolist()
        applied, signs = draws["applied"].tolist(), draws["signs"].tolist()
        gray = x.shape[1] == 1
        for j in range(len(ops[0]) if ops else 0):
            groups: dict[tuple, list[int]] = {}
            for i in range(len(ops)):
                op = self._ops[ops[i][j]]
                if not applied[i][j] or op == "Identity" or (gray and op == "Color"):
                    continue
                key = (op, op_parameter(op, levels[i][j], signs[i][j], self.image_size, self.magnitude_levels))
                groups.setdefault(key, []).append(i)
            for (op, param), idx in groups.items():
                if len(idx) == 1:
                    i = idx[0]
                    x[i:i + 1] = _apply_op(F, nearest, x[i:i + 1], op, param)
                else:
                    sel = torch.tensor(idx, device=x.device)
                    x[sel] = _apply_op(F, nearest, x[sel], op, param)
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
