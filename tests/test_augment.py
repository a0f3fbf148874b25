"""Weak/strong augmentation: shapes, determinism, flips, the RandAugmentMC policy's
strengths and draws, Cutout, errors."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tasks.augment import STRONG_OPS, Augmenter, _apply_op, op_parameter

SHAPES = [(1, 28), (3, 32)]


def _batch(c, s, b=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, c, s, s), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("shape", SHAPES, ids=["1x28", "3x32"])
def test_shapes_dtypes_and_normalisation(shape):
    c, s = shape
    aug = Augmenter(c, s, flip=True)
    x = _batch(c, s)
    for fn in (aug.test, aug.weak, aug.strong):
        y = fn(x)
        assert y.shape == x.shape and y.dtype == torch.float32 and y.device == x.device
        assert y.min() >= -1.0 - 1e-6 and y.max() <= 1.0 + 1e-6  # mean = std = 0.5
    assert torch.allclose(aug.test(x), x.float() / 127.5 - 1.0)
    w, st = aug.weak_strong(x)
    assert w.shape == st.shape == x.shape
    for fn in (aug.weak_uint8, aug.strong_uint8):
        assert fn(x).dtype == torch.uint8
    custom = Augmenter(c, s, flip=False, mean=[0.1] * c, std=[0.2] * c)
    assert torch.allclose(custom.test(x), (x.float() / 255 - 0.1) / 0.2)
    assert aug.crop_padding == (3 if s == 28 else 4)


@pytest.mark.parametrize("shape", SHAPES, ids=["1x28", "3x32"])
def test_determinism_under_manual_seed(shape):
    c, s = shape
    aug = Augmenter(c, s, flip=True)
    x = _batch(c, s, b=16)
    for fn in (aug.weak, aug.strong):
        torch.manual_seed(7)
        a = fn(x)
        torch.manual_seed(7)
        b = fn(x)
        assert torch.equal(a, b)
        torch.manual_seed(8)
        assert not torch.equal(fn(x), a)
    # the draw depends only on the global RNG, not on a fresh Augmenter
    torch.manual_seed(7)
    a = aug.strong(x)
    torch.manual_seed(7)
    assert torch.equal(Augmenter(c, s, flip=True).strong(x), a)


def test_strong_differs_from_weak_and_is_per_sample():
    x = _batch(3, 32, b=16)
    aug = Augmenter(3, 32, flip=True)
    torch.manual_seed(0)
    w = aug.weak(x)
    torch.manual_seed(0)
    st = aug.strong(x)
    assert not torch.equal(w, st)
    # identical inputs get different policy draws per sample
    same = x[:1].repeat(16, 1, 1, 1)
    no_geo = Augmenter(3, 32, flip=False, crop_padding=0, cutout=False)
    torch.manual_seed(1)
    out = no_geo.strong_uint8(same)
    assert len({bytes(out[i].flatten().tolist()) for i in range(16)}) > 4
    torch.manual_seed(1)
    d = no_geo._draw_policy(16)
    assert len({tuple(r) for r in torch.cat([d["ops"], d["levels"]], 1).tolist()}) > 8
    # an empty batch draws nothing
    torch.manual_seed(2)
    r = torch.rand(())
    torch.manual_seed(2)
    assert Augmenter(3, 32, flip=True).strong(x[:0]).shape == (0, 3, 32, 32)
    assert torch.equal(torch.rand(()), r)


@pytest.mark.parametrize("shape", SHAPES, ids=["1x28", "3x32"])
def test_every_op_runs_on_uint8(shape):
    # each op of the pool forced (always applied) on 1- and 3-channel uint8 batches
    c, s = shape
    x = _batch(c, s, b=32)
    changed = {}
    for op in STRONG_OPS:
        aug = Augmenter(c, s, flip=False, crop_padding=0, cutout=False, num_ops=1, apply_prob=1.0)
        aug._ops = (op,)
        torch.manual_seed(0)
        y = aug.strong_uint8(x)
        assert y.shape == x.shape and y.dtype == torch.uint8, op
        changed[op] = not torch.equal(y, x)
    assert not changed["Identity"]
    assert changed["Color"] == (c == 3)  # saturation: identity on gray images
    for op in set(STRONG_OPS) - {"Identity", "Color", "AutoContrast"}:  # random images span 0..255
        assert changed[op], op
    # and the full pool, many draws
    aug = Augmenter(c, s, flip=True)
    torch.manual_seed(0)
    for _ in range(3):
        y = aug.strong_uint8(x)
        assert y.shape == x.shape and y.dtype == torch.uint8


def test_op_parameters_match_fixmatch():
    levels = range(1, 10)
    for sign in (1, -1):
        for v in levels:
            for op in ("Brightness", "Color", "Contrast", "Sharpness"):
                assert op_parameter(op, v, sign, 28) == pytest.approx(0.05 + 0.09 * v)
            assert op_parameter("Posterize", v, sign, 28) == 4 + int(0.4 * v)
            assert op_parameter("Solarize", v, sign, 28) == 256 - int(25.6 * v)
            assert op_parameter("Rotate", v, sign, 28) == pytest.approx(sign * 3.0 * v)
            for op in ("ShearX", "ShearY"):
                assert op_parameter(op, v, sign, 28) == pytest.approx(sign * 0.03 * v)
            for op in ("TranslateX", "TranslateY"):
                for size in (28, 32, 96):
                    assert op_parameter(op, v, sign, size) == sign * int(0.03 * v * size + 1e-9)
            for op in ("AutoContrast", "Equalize", "Identity"):
                assert op_parameter(op, v, sign, 28) is None
    # strengths at the top level (9 of m = 10)
    assert op_parameter("TranslateX", 9, 1, 28) == 7 == int(0.27 * 28)
    assert op_parameter("TranslateY", 9, -1, 32) == -8
    assert max(abs(op_parameter("Rotate", v, s, 28)) for v in levels for s in (1, -1)) == pytest.approx(27.0)
    assert max(abs(op_parameter("ShearX", v, s, 28)) for v in levels for s in (1, -1)) == pytest.approx(0.27)
    assert {op_parameter("Posterize", v, 1, 28) for v in levels} == {4, 5, 6, 7}
    assert op_parameter("Solarize", 9, 1, 28) == 26 and op_parameter("Solarize", 1, 1, 28) == 231
    # other m: magnitude = level / m of the maximum
    assert op_parameter("Rotate", 4, 1, 28, magnitude_levels=5) == pytest.approx(24.0)
    with pytest.raises(ValueError, match="level"):
        op_parameter("Rotate", 10, 1, 28)
    with pytest.raises(ValueError, match="level"):
        op_parameter("Rotate", 0, 1, 28)
    with pytest.raises(ValueError, match="op"):
        op_parameter("Invert", 1, 1, 28)


def _line_image(s, b, axis):
    x = torch.zeros(b, 1, s, s, dtype=torch.uint8)
    if axis == "x":
        x[:, :, :, s // 2] = 255  # a vertical line
    else:
        x[:, :, s // 2, :] = 255  # a horizontal line
    return x


@pytest.mark.parametrize("s,bound", [(28, 7), (32, 8)])
@pytest.mark.parametrize("op", ["TranslateX", "TranslateY"])
def test_translation_is_at_most_027_of_the_size(op, s, bound):
    axis = "x" if op == "TranslateX" else "y"
    x = _line_image(s, 600, axis)
    aug = Augmenter(1, s, flip=False, crop_padding=0, cutout=False, num_ops=1, apply_prob=1.0)
    aug._ops = (op,)
    torch.manual_seed(0)
    y = aug.strong_uint8(x)[:, 0]
    prof = y.amax(dim=1) if axis == "x" else y.amax(dim=2)  # [B, s]: where the line is
    assert (prof.sum(1) == 255).all()  # the line moved, never left the image
    shift = prof.argmax(1) - s // 2
    assert shift.abs().max() == bound  # level 9 is drawn among 600 samples
    assert (shift > 0).any() and (shift < 0).any()


def test_shear_and_rotate_bounds():
    s, b = 28, 400
    x = _line_image(s, b, "x")
    aug = Augmenter(1, s, flip=False, crop_padding=0, cutout=False, num_ops=1, apply_prob=1.0)
    aug._ops = ("ShearX",)
    torch.manual_seed(0)
    y = aug.strong_uint8(x)[:, 0]
    # shear about the corner [0, 0]: row 0 stays, row r moves by s_x * r <= 0.27 * 27 px
    assert (y[:, 0].argmax(1) == s // 2).all()
    shift = (y[:, -1].argmax(1) - s // 2).abs()
    assert shift.max() <= 8 and shift.max() >= 7
    # rotation by at most 27 degrees: the line's angle from rows 4 and 23 (nearest: +-1 px each)
    aug._ops = ("Rotate",)
    torch.manual_seed(0)
    y = aug.strong_uint8(x)[:, 0]
    assert (y[:, 4].amax(1) == 255).all() and (y[:, 23].amax(1) == 255).all()
    dx = (y[:, 4].argmax(1) - y[:, 23].argmax(1)).float()
    angle = torch.rad2deg(torch.atan(dx.abs() / 19))
    assert angle.max() <= 27 + 6 and angle.max() >= 27 - 6
    assert (dx > 0).any() and (dx < 0).any()


def test_apply_probability_is_one_half():
    # Solarize at any level inverts an all-255 image: identity detection per sample
    n = 4000
    x = torch.full((n, 1, 28, 28), 255, dtype=torch.uint8)
    aug = Augmenter(1, 28, flip=False, crop_padding=0, cutout=False, num_ops=1)
    aug._ops = ("Solarize",)
    torch.manual_seed(0)
    y = aug.strong_uint8(x)
    kept = (y == 255).flatten(1).all(1)
    inverted = (y == 0).flatten(1).all(1)
    assert (kept | inverted).all()
    assert abs(kept.float().mean().item() - 0.5) < 0.04  # 5 sigma = 0.04
    # two independent coins: untouched with probability 1/4 (a solarized 0 stays 0)
    aug2 = Augmenter(1, 28, flip=False, crop_padding=0, cutout=False, num_ops=2)
    aug2._ops = ("Solarize",)
    torch.manual_seed(1)
    assert abs(((aug2.strong_uint8(x) == 255).flatten(1).all(1)).float().mean().item() - 0.25) < 0.035
    for p, want in ((0.0, True), (1.0, False)):
        aug_p = Augmenter(1, 28, flip=False, crop_padding=0, cutout=False, num_ops=1, apply_prob=p)
        aug_p._ops = ("Solarize",)
        assert bool((aug_p.strong_uint8(x[:64]) == 255).all()) is want
    # the full pool with apply_prob=0 is the weak view (+ Cutout)
    aug0 = Augmenter(1, 28, flip=True, apply_prob=0.0, cutout=False)
    xb = _batch(1, 28, b=16)
    torch.manual_seed(2)
    w = aug0.weak_uint8(xb)
    torch.manual_seed(2)
    assert torch.equal(aug0.strong_uint8(xb), w)


def test_levels_ops_and_signs_are_uniform():
    aug = Augmenter(3, 32, flip=False)
    torch.manual_seed(0)
    d = aug._draw_policy(20000)
    assert d["ops"].shape == d["levels"].shape == d["applied"].shape == d["signs"].shape == (20000, 2)
    assert set(d["ops"].unique().tolist()) == set(range(14))
    assert set(d["levels"].unique().tolist()) == set(range(1, 10))  # 1..m-1
    assert set(d["signs"].unique().tolist()) == {-1, 1}
    assert abs(d["applied"].float().mean().item() - 0.5) < 0.02
    counts = torch.bincount(d["ops"].flatten(), minlength=14).float() / 40000
    assert (counts - 1 / 14).abs().max() < 0.01


def test_draw_order_is_documented():
    aug = Augmenter(3, 32, flip=True)
    b = 6
    torch.manual_seed(11)
    _ = torch.randint(0, 9, (b,)), torch.randint(0, 9, (b,)), torch.rand(b)  # crop oy, ox, flips
    ops, levels = torch.randint(0, 14, (b, 2)), torch.randint(1, 10, (b, 2))
    applied, signs = torch.rand(b, 2) < 0.5, torch.randint(0, 2, (b, 2)) * 2 - 1
    cy, cx = torch.randint(0, 32, (b,)), torch.randint(0, 32, (b,))
    after = torch.rand(())
    torch.manual_seed(11)
    aug.weak_uint8(_batch(3, 32, b=b))
    d = aug._draw_policy(b)
    assert torch.equal(d["ops"], ops) and torch.equal(d["levels"], levels)
    assert torch.equal(d["applied"], applied) and torch.equal(d["signs"], signs)
    assert torch.equal(torch.randint(0, 32, (b,)), cy) and torch.equal(torch.randint(0, 32, (b,)), cx)
    # a whole strong call consumes exactly these draws
    torch.manual_seed(11)
    aug.strong_uint8(_batch(3, 32, b=b))
    assert torch.equal(torch.rand(()), after)


@pytest.mark.parametrize("shape", SHAPES, ids=["1x28", "3x32"])
def test_grouped_application_equals_per_sample(shape):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    c, s = shape
    b = 96  # many samples share (op, parameter) at a step
    x = _batch(c, s, b=b)
    aug = Augmenter(c, s, flip=False, crop_padding=0, cutout=False)
    torch.manual_seed(5)
    out = aug.strong_uint8(x)
    torch.manual_seed(5)
    d = aug._draw_policy(b)
    ref = x.clone()
    for i in range(b):
        img = ref[i]
        for j in range(2):
            if d["applied"][i, j]:
                op = STRONG_OPS[int(d["ops"][i, j])]
                param = op_parameter(op, int(d["levels"][i, j]), int(d["signs"][i, j]), s)
                img = _apply_op(F, InterpolationMode.NEAREST, img, op, param)
        ref[i] = img
    assert torch.equal(out, ref)


def test_torchvision_is_imported_lazily():
    code = ("import sys, torch; from tasks.augment import Augmenter; a = Augmenter(1, 28, flip=False); "
            "x = torch.zeros(2, 1, 28, 28, dtype=torch.uint8); a.weak(x); a.test(x); "
            "assert 'torchvision' not in sys.modules; a.strong(x); assert 'torchvision' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_flip_false_never_flips():
    s = 28
    # asymmetric image: left half bright, right half dark, plus a unique ramp
    img = torch.zeros(1, 1, s, s, dtype=torch.uint8)
    img[..., : s // 2] = 200
    img[0, 0, 0, :] = torch.arange(s, dtype=torch.uint8)
    x = img.repeat(32, 1, 1, 1)
    no_flip = Augmenter(1, s, flip=False, crop_padding=0)
    for seed in range(5):
        torch.manual_seed(seed)
        assert torch.equal(no_flip.weak_uint8(x), x)
        assert torch.equal(no_flip.weak(x), no_flip.test(x))
    flip = Augmenter(1, s, flip=True, crop_padding=0)
    torch.manual_seed(0)
    y = flip.weak_uint8(x)
    flipped = torch.tensor([torch.equal(y[i], x[i].flip(-1)) for i in range(32)])
    kept = torch.tensor([torch.equal(y[i], x[i]) for i in range(32)])
    assert (flipped | kept).all() and flipped.any() and kept.any()


@pytest.mark.parametrize("mode", ["reflect", "zeros"])
def test_crop_is_a_translation(mode):
    s, p = 32, 4
    x = _batch(3, s, b=16)
    aug = Augmenter(3, s, flip=False, crop_padding=p, padding_mode=mode)
    torch.manual_seed(3)
    y = aug.weak_uint8(x)
    pad = torch.nn.functional.pad(x.float(), (p, p, p, p), mode="reflect" if mode == "reflect" else "constant")
    for i in range(16):
        found = any(torch.equal(y[i].float(), pad[i, :, dy:dy + s, dx:dx + s])
                    for dy in range(2 * p + 1) for dx in range(2 * p + 1))
        assert found, i


@pytest.mark.parametrize("shape,side", [((1, 28), 14), ((3, 32), 16)], ids=["1x28", "3x32"])
def test_cutout_gray_square(shape, side):
    c, s = shape
    x = torch.zeros(200, c, s, s, dtype=torch.uint8)
    aug = Augmenter(c, s, flip=False, crop_padding=0, num_ops=0, cutout=True)
    assert aug.cutout_size == side == int(0.5 * s)  # FixMatch-pytorch: CutoutAbs(img, int(32 * 0.5))
    torch.manual_seed(0)
    y = aug.strong_uint8(x)
    sizes = []
    for i in range(len(y)):
        m = y[i, 0] == 127
        assert torch.equal(m, y[i, -1] == 127)
        rows, cols = m.any(1).nonzero().flatten(), m.any(0).nonzero().flatten()
        assert 0 < len(rows) <= side and 0 < len(cols) <= side  # clipped at the border
        assert int(m.sum()) == len(rows) * len(cols)  # a rectangle
        sizes.append(int(m.sum()))
    assert max(sizes) == side * side and min(sizes) < side * side
    assert Augmenter(c, s, flip=False, cutout_fraction=0.25).cutout_size == s // 4
    assert Augmenter(c, s, flip=False, cutout_fraction=0.25, cutout_size=5).cutout_size == 5  # pixels win


def test_errors_name_the_key():
    with pytest.raises(ValueError, match="in_channels"):
        Augmenter(2, 32, flip=True)
    with pytest.raises(ValueError, match="mean"):
        Augmenter(3, 32, flip=True, mean=[0.5, 0.5])
    with pytest.raises(ValueError, match="std"):
        Augmenter(1, 28, flip=True, std=[0.0])
    with pytest.raises(ValueError, match="crop_padding"):
        Augmenter(1, 28, flip=True, crop_padding=-1)
    with pytest.raises(ValueError, match="padding_mode"):
        Augmenter(1, 28, flip=True, padding_mode="edge")
    for key, bad in (("cutout_size", 29), ("cutout_size", -1), ("cutout_size", 2.5), ("cutout_fraction", 1.5),
                     ("cutout_fraction", -0.1), ("cutout_fraction", True), ("num_ops", -1),
                     ("apply_prob", 1.1), ("apply_prob", "0.5"), ("magnitude_levels", 1),
                     ("magnitude_levels", 10.0)):
        with pytest.raises(ValueError, match=key):
            Augmenter(1, 28, flip=True, **{key: bad})
    with pytest.raises(TypeError, match="random_magnitude"):
        Augmenter(1, 28, flip=True, random_magnitude=True)  # removed with the old policy
    aug = Augmenter(1, 28, flip=True)
    with pytest.raises(ValueError, match="uint8"):
        aug.weak(torch.zeros(2, 1, 28, 28))
    with pytest.raises(ValueError, match="in_channels, image_size"):
        aug.strong(torch.zeros(2, 3, 28, 28, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_matches_cpu():
    """The same seed draws the same augmentation on CUDA as on the CPU (every draw is made on the
    CPU): the weak view (integer crop offsets and flips) and Cutout are equal to the pixel; the
    strong view's RandAugment kernels (bilinear/nearest resampling, blends) run on the device and
    agree up to rounding, a level or two of 255 on a few pixels, not a different draw (which
    changes most pixels)."""
    aug = Augmenter(3, 32, flip=True)
    x = _batch(3, 32, b=64)
    torch.manual_seed(4)
    a = aug.weak_uint8(x)
    torch.manual_seed(4)
    b = aug.weak_uint8(x.cuda())
    assert b.device.type == "cuda" and torch.equal(a, b.cpu())
    no_ops = Augmenter(3, 32, flip=True, num_ops=0)
    torch.manual_seed(5)
    a = no_ops.strong_uint8(x)
    torch.manual_seed(5)
    assert torch.equal(a, no_ops.strong_uint8(x.cuda()).cpu())
    torch.manual_seed(4)
    a = aug.strong_uint8(x).int()
    torch.manual_seed(4)
    b = aug.strong_uint8(x.cuda()).cpu().int()
    off = (a - b).abs()
    print(f"strong view, CUDA vs CPU: {float((off > 0).float().mean()):.4%} of pixels differ, "
          f"{float((off > 2).float().mean()):.4%} by more than 2 levels, at most {int(off.max())}")
    assert float((off > 2).float().mean()) < 0.01
    torch.manual_seed(4)
    c = aug.strong(x)
    torch.manual_seed(4)
    d = aug.strong(x.cuda()).cpu()
    assert d.dtype == c.dtype and float((c - d).abs().mean()) < 0.01


def test_run_config_cutout_sets_the_square_side():
    """``cutout`` (run config): -1 = the Augmenter's half-image default, 0 = none, else pixels; a side
    larger than the images is a ConfigError naming the key."""
    from tasks.config import ConfigError, TaskConfig
    from tasks.env import task_augmenter

    assert task_augmenter(1, 28, flip=False, task=TaskConfig()).cutout_size == 14
    assert task_augmenter(1, 28, flip=False, task=TaskConfig(cutout=7)).cutout_size == 7
    assert task_augmenter(1, 28, flip=False, task=TaskConfig(cutout=0)).cutout_size == 0
    with pytest.raises(ConfigError, match="cutout=40 is larger than the 28x28 images"):
        task_augmenter(1, 28, flip=False, task=TaskConfig(cutout=40))
    # the grey square really is 7 px: an all-white batch through the strong view without ops
    aug = task_augmenter(1, 28, flip=False, task=TaskConfig(cutout=7))
    aug.num_ops = 0
    x = torch.full((8, 1, 28, 28), 255, dtype=torch.uint8)
    torch.manual_seed(0)
    out = aug.strong_uint8(x)
    grey = (out == 127).flatten(1).sum(1)
    assert int(grey.max()) == 49 and int(grey.min()) > 0
