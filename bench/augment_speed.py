"""Weak vs strong augmentation cost per batch of 64 (ms), side by side in one run.

    python bench/augment_speed.py

Prints the mean over repeats for 1x28x28 and 3x32x32 uint8 batches, and the
strong/weak ratio (the crop/flip is vectorised; the strong policy, FixMatch's
RandAugmentMC, runs torchvision kernels once per distinct (op, parameter) per step).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from tasks.augment import Augmenter  # noqa: E402


def main(repeats: int = 10) -> None:
    torch.manual_seed(0)
    for c, s in ((1, 28), (3, 32)):
        aug = Augmenter(c, s, flip=True)
        x = torch.randint(0, 256, (64, c, s, s), dtype=torch.uint8)
        aug.weak(x)  # warm-up
        aug.strong(x)  # warm-up (imports torchvision)
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
