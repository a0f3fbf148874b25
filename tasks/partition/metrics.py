"""Realised skew: class histograms per client, the non-IID metric R, a JSON report."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ._common import _check_labels, _num_classes


def class_histograms(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int | None = None) -> np.ndarray:
    """Class counts per client, ``H[k, c] = |{i in parts[k] : labels[i] = c}|`` (int64 [K, C])."""
    labels = _check_labels(labels)
    c = _num_classes(labels, num_classes)
    out = np.zeros((len(parts), c), dtype=np.int64)
    for k, p in enumerate(parts):
        if len(p):
            out[k] = np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=c)
    return out


def r_metric(class_dists: np.ndarray) -> float:
    """Non-IID level R of SSFL (the SSFL paper's Sec. 3.2, Definition 1).

    ``R = 1/(K(K-1)) * sum_{1<=k<m<=K} ||P_k - P_m||_1``, i.e. the mean pairwise
    total-variation distance. ``R = 0`` iff all clients share one distribution;
    ``R = 1`` iff all supports are disjoint (e.g. K = C, one class each).

    ``class_dists`` is ``[K, C]``; rows that do not sum to 1 (class *counts*) are
    normalised first, all-zero rows are kept as zero vectors. ``K < 2`` gives 0.
    """
    p = np.asarray(class_dists, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"class_dists must be [K, C], got shape {p.shape}")
    k = p.shape[0]
    if k < 2:
        return 0.0
    s = p.sum(axis=1, keepdims=True)
    p = np.divide(p, s, out=np.zeros_like(p), where=s > 0)
    total = 0.0
    for i in range(k - 1):  # K x C per step: O(K^2 C) time, O(K C) memory
        total += np.abs(p[i + 1 :] - p[i]).sum()
    return float(total / (k * (k - 1)))


def skew_report(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int | None = None) -> dict:
    """Realised skew of a partition: sizes, class histograms, R, classes per client."""
    hist = class_histograms(labels, parts, num_classes)
    present = hist > 0
    return {
        "num_clients": len(parts),
        "num_classes": int(hist.shape[1]),
        "sizes": hist.sum(axis=1).tolist(),
        "class_counts": hist.tolist(),
        "r": r_metric(hist),
        "classes_per_client": present.sum(axis=1).tolist(),
        "clients_per_class": present.sum(axis=0).tolist(),
    }
