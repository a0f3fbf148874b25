"""This app's own model, dataset and partition: nothing here comes from flower-ssl.

The dataset is "bars": 16x16 grayscale images of one of four patterns (a horizontal bar, a
vertical bar, a diagonal, a hollow box) at a random place, with random brightness and noise,
generated from a seed. A node's shard is every ``num_partitions``-th image of a shuffled
pool, skewed: node ``i`` drops half of its images of class ``i % 4``.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

NUM_CLASSES = 4
SIZE = 16


class SmallCNN(nn.Module):
    """Two conv blocks and a linear classifier, with dropout (UM-pFSSL's MC-dropout needs it)."""

    def __init__(self, dropout: float = 0.25) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(16 * 4 * 4, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def split_pair() -> tuple[nn.Module, nn.Module]:
    """The same network as a (bottom, top) pair, for split learning (the cut after the first block)."""
    m = SmallCNN()
    bottom = nn.Sequential(*list(m.features)[:4])
    top = nn.Sequential(*list(m.features)[4:], m.head)
    return bottom, top


def bars(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images uint8 [n, 1, 16, 16] and their labels 0..3."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, n)
    x = rng.normal(0.1, 0.05, (n, SIZE, SIZE))
    for i, c in enumerate(y):
        a, b = rng.integers(2, SIZE - 6, 2)
        v = rng.uniform(0.6, 1.0)
        if c == 0:
            x[i, a:a + 2, 1:SIZE - 1] += v
        elif c == 1:
            x[i, 1:SIZE - 1, b:b + 2] += v
        elif c == 2:
            d = np.arange(SIZE - 4) + 2
            x[i, d, d] += v
            x[i, d[:-1], d[1:]] += v
        else:
            x[i, a:a + 6, b] += v
            x[i, a:a + 6, b + 5] += v
            x[i, a, b:b + 6] += v
            x[i, a + 5, b:b + 6] += v
    x = np.clip(x, 0.0, 1.0)
    return (x[:, None] * 255).round().astype(np.uint8), y.astype(np.int64)


def node_shard(partition_id: int, num_partitions: int, size: int = 1200, seed: int = 7
               ) -> tuple[np.ndarray, np.ndarray]:
    """This app's own partition: every ``num_partitions``-th image, half of class ``i % 4`` dropped."""
    x, y = bars(size, seed)
    idx = np.arange(partition_id, size, num_partitions)
    own = y[idx] == partition_id % NUM_CLASSES
    keep = ~own | (np.cumsum(own) % 2 == 0)
    idx = idx[keep]
    return x[idx], y[idx]


def test_set(n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    return bars(n, seed=12345)


def server_labeled(n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    return bars(n, seed=999)
