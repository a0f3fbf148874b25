"""K-means for a few dozen points (plain numpy, seeded): FedConcat's clustering of the clients'
label distributions (:mod:`strategies.scala.fedconcat`; Diao, Li, He, AAAI 2024).

* :func:`kmeans` -- Lloyd's algorithm from k-means++ seeds, ``restarts`` times (each restart
  seeded by :func:`tasks.training.derive_seed` from ``seed`` and its index), the run of least
  inertia ``sum_i ||x_i - c_{l(i)}||^2`` kept (ties: the first). With ``size_max`` it is
  *constrained* K-means: no cluster holds more than ``size_max`` points. The assignment step
  then goes through every (point, centre) pair in order of distance and gives a point the first
  centre with room (a greedy assignment [ours]; the authors' ``kmeanslimited.py`` moves the
  farthest points of a full cluster to their nearest cluster with room, and
  ``k-means-constrained``'s min-cost flow is exact; all three agree on well separated groups).
* :func:`nearest` -- the centre closest to a point (a client that joins after the clustering).

Empty clusters: a centre left without points is moved to the point farthest from its own
centre (deterministic); a cluster still empty at the end (duplicate points) is dropped, and the
labels are renumbered ``0..k'-1`` in order of each cluster's first point.
"""
from __future__ import annotations

import numpy as np

from tasks.training import derive_seed

__all__ = ["kmeans", "nearest", "size_cap"]


def size_cap(n: int, k: int, factor: float) -> int:
    """The most points a cluster may hold: ``floor(factor * n / k)`` (the authors'
    ``int(1.2 * n_parties / K)``), raised to ``ceil(n / k)`` where that is smaller, so that ``k``
    clusters can always hold the ``n`` points [ours]."""
    if n < 1 or k < 1:
        raise ValueError(f"need n >= 1 and k >= 1, got n={n}, k={k}")
    return max(-(-n // k), int(factor * n / k))


def _sq_dist(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    return ((x[:, None, :] - c[None, :, :]) ** 2).sum(-1)


def _plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeds: the first uniformly, each next with probability proportional to the
    squared distance to the nearest seed so far (uniformly among unchosen points if all are 0)."""
    n = len(x)
    chosen = [int(rng.integers(n))]
    for _ in range(1, k):
        d = _sq_dist(x, x[chosen]).min(1)
        total = d.sum()
        if total > 0:
            chosen.append(int(rng.choice(n, p=d / total)))
        else:
            rest = [i for i in range(n) if i not in chosen]
            chosen.append(int(rest[int(rng.integers(len(rest)))]))
    return x[chosen].copy()


def _assign(x: np.ndarray, c: np.ndarray, size_max: int | None) -> np.ndarray:
    d = _sq_dist(x, c)
    if size_max is None:
        return d.argmin(1)
    n, k = d.shape
    labels = np.full(n, -1)
    room = np.full(k, size_max)
    for flat in np.argsort(d, axis=None, kind="stable"):
        i, j = divmod(int(flat), k)
        if labels[i] < 0 and room[j] > 0:
            labels[i] = j
            room[j] -= 1
    return labels


def _update(x: np.ndarray, labels: np.ndarray, c: np.ndarray) -> np.ndarray:
    new = c.copy()
    for j in range(len(c)):
        members = labels == j
        if members.any():
            new[j] = x[members].mean(0)
    empty = [j for j in range(len(c)) if not (labels == j).any()]
    if empty:
        far = ((x - new[labels]) ** 2).sum(1)
        for j in empty:
            i = int(far.argmax())
            if far[i] <= 0:
                break
            new[j] = x[i]
            far[i] = 0.0
    return new


def kmeans(points, k: int, seed: int, *, restarts: int = 10, iters: int = 100,
           size_max: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Cluster ``points`` ``[N, D]`` into at most ``min(k, N)`` clusters; returns ``(labels [N],
    centres [k', D])`` with ``labels`` in ``0..k'-1`` (module docstring)."""
    x = np.asarray(points, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"points must be a non-empty [N, D] array, got shape {x.shape}")
    n = len(x)
    k = min(int(k), n)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if size_max is not None and size_max * k < n:
        raise ValueError(f"size_max={size_max} x k={k} clusters cannot hold {n} points")
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for r in range(max(1, restarts)):
        rng = np.random.default_rng(derive_seed(seed, "kmeans", r))
        c = _plus_plus(x, k, rng)
        labels = _assign(x, c, size_max)
        for _ in range(iters):
            c = _update(x, labels, c)
            new = _assign(x, c, size_max)
            if np.array_equal(new, labels):
                break
            labels = new
        c = _update(x, labels, c)   # the means of the final clusters
        inertia = float(((x - c[labels]) ** 2).sum())
        if best is None or inertia < best[0] - 1e-12:
            best = (inertia, labels.copy(), c.copy())
    _, labels, c = best
    order = list(dict.fromkeys(int(v) for v in labels))   # clusters in order of their first point
    remap = {old: new for new, old in enumerate(order)}
    centres = np.stack([x[labels == old].mean(0) for old in order])
    return np.array([remap[int(v)] for v in labels]), centres


def nearest(centres: np.ndarray, point) -> int:
    """Index of the centre nearest to ``point`` (squared Euclidean distance; ties: the first)."""
    p = np.asarray(point, dtype=np.float64)[None, :]
    return int(_sq_dist(p, np.asarray(centres, dtype=np.float64))[0].argmin())
