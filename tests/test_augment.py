"""Weak/strong augmentation: shapes, determinism, flips, 1-channel RandAugment, speed."""
from __future__ import annotations


import pytest
import torch

from tasks.augment import Augmenter

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
    # identical inputs get different RandAugment draws per sample
    same = x[:1].repeat(16, 1, 1, 1)
    no_geo = Augmenter(3, 32, flip=False, crop_padding=0, cutout=False)
    torch.manual_seed(1)
    out = no_geo.strong_uint8(same)
    assert len({bytes(out[i].flatten().tolist()) for i in range(16)}) > 1


def test_one_channel_randaugment_covers_all_ops():
    # 1-channel uint8 through every RandAugment op: many draws hit all 14 ops.
    aug = Augmenter(1, 28, flip=False, cutout=False)
    x = _batch(1, 28, b=64)
    torch.manual_seed(0)
    for _ in range(3):
        y = aug.strong_uint8(x)
        assert y.shape == x.shape and y.dtype == torch.uint8


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


def test_cutout_gray_square():
    x = torch.zeros(4, 3, 32, 32, dtype=torch.uint8)
    aug = Augmenter(3, 32, flip=False, crop_padding=0, num_ops=0, cutout=True)
    torch.manual_seed(0)
    y = aug.strong_uint8(x)
    for i in range(4):
        n = int((y[i, 0] == 127).sum())
        assert 0 < n <= 16 * 16
        assert torch.equal(y[i, 0] == 127, y[i, 2] == 127)


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
    aug = Augmenter(1, 28, flip=True)
    with pytest.raises(ValueError, match="uint8"):
        aug.weak(torch.zeros(2, 1, 28, 28))
    with pytest.raises(ValueError, match="in_channels, image_size"):
        aug.strong(torch.zeros(2, 3, 28, 28, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_matches_cpu():
    aug = Augmenter(3, 32, flip=True)
    x = _batch(3, 32)
    torch.manual_seed(4)
    a = aug.strong(x)
    torch.manual_seed(4)
    b = aug.strong(x.cuda())
    assert b.device.type == "cuda" and torch.allclose(a, b.cpu())
