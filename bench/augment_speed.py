"""Weak vs strong augmentation cost per batch of 64 (ms), side by side in one run.

    python bench/augment_speed.py

Prints the mean over repeats for 1x28x28 and 3x32x32 uint8 batches, and the
strong/weak ratio (RandAugment runs per sample, the crop/flip is vectorised).
"""
from __future__ import annotations

import time

import torch

from tasks.augment import Augmenter


def main(repeats: int = 10) -> None:
    torch.manual_seed(0)
    for c, s in ((1, 28), (3, 32)):
        aug = Augmenter(c, s, flip=True)
        x = torch.randint(0, 256, (64, c, s, s), dtype=torch.uint8)
        aug.strong(x)  # warm-up
        ms = {}
        for name in ("weak", "strong"):
            fn = getattr(aug, name)
            t = time.perf_counter()
            for _ in range(repeats):
                fn(x)
            ms[name] = (time.perf_counter() - t) / repeats * 1000
        print(f"{c}x{s}x{s} batch 64: weak {ms['weak']:.2f} ms, strong {ms['strong']:.2f} ms, "
              f"strong/weak {ms['strong'] / ms['weak']:.1f}x")


if __name__ == "__main__":
    main()
