"""Constants, parameter defaults and argument checks shared by the partitioners."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from tasks.config import TaskConfig

SCHEMES: tuple[str, ...] = TaskConfig.__dataclass_fields__["partition"].metadata["choices"]  # the run config's
LABEL_MODES = ("all", "none", "server", "dir2", "mismatch")

#: PartitionConfig field -> run-config key named in error messages (the kebab-case keys
#: of ``tasks.config.TaskConfig``; ``PartitionConfig.from_run_config`` reads them).
CONFIG_KEYS: dict[str, str] = {
    "scheme": "partition",
    "alpha": "partition-alpha",
    "classes_per_client": "partition-classes-per-client",
    "r": "partition-r",
    "server_labels": "server-labels",
    "labeled_alpha": "partition-labeled-alpha",
    "mismatch_ratio": "partition-mismatch-ratio",
    "labeled_per_client": "partition-labeled-per-client",
    "labeled_classes_per_client": "partition-labeled-classes",
    "min_size": "partition-min-size",
    "seed": "seed",
}

#: Every parameter's default, stated once: the run config's (``tasks.config.TaskConfig``), except
#: ``server_labels``: a plan keeps no labels on the server unless asked.
DEFAULTS: dict[str, Any] = {
    name: (0 if name == "server_labels" else TaskConfig.__dataclass_fields__[key.replace("-", "_")].default)
    for name, key in CONFIG_KEYS.items()}

# Independent random streams of one plan: default_rng([seed, stage]).
_STAGE_SERVER, _STAGE_DIR2, _STAGE_MISMATCH, _STAGE_TEST = 101, 102, 103, 104


def _check_labels(labels: Any, what: str = "labels") -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of class ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.mod(arr, 1) == 0):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{what} must hold integer class ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{what} must be non-negative class ids 0..C-1, found {arr.min()}")
    return arr


def _check_int(value: Any, key: str, low: int, high: int | None = None, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{key}={value!r} must be an integer{' (' + what + ')' if what else ''}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{key}={value} must be {rng}{' (' + what + ')' if what else ''}")
    return value


def _check_real(
    value: Any, key: str, low: float, high: float | None = None, *, low_open: bool = False, what: str = ""
) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} must be a finite number{' (' + what + ')' if what else ''}")
    value = float(value)
    bad = value <= low if low_open else value < low
    if high is not None:
        bad = bad or value > high
    if bad:
        lo = f"> {low}" if low_open else f">= {low}"
        rng = lo if high is None else f"in {'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{key}={value} must be {rng}{' (' + what + ')' if what else ''}")
    return value


def _num_classes(labels: np.ndarray, num_classes: int | None, *extra: np.ndarray) -> int:
    observed = max([int(a.max()) + 1 if a.size else 0 for a in (labels, *extra)])
    if num_classes is None:
        return observed
    num_classes = _check_int(num_classes, "num_classes", 1)
    if observed > num_classes:
        raise ValueError(f"labels contain class {observed - 1} but num_classes={num_classes}")
    return num_classes


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer counts ``n_k`` with ``sum_k n_k = total`` and ``n_k ~ total * w_k / sum w``.

    Hamilton / largest-remainder rounding: take ``floor(total * w_k)`` and give the
    remaining units to the largest fractional parts (ties broken by index, so the
    result is deterministic). Zero weights always get zero.
    """
    weights = np.asarray(weights, dtype=np.float64)
    s = weights.sum()
    if total == 0 or s <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    exact = total * (weights / s)
    counts = np.floor(exact).astype(np.int64)
    rem = int(total - counts.sum())
    if rem > 0:
        order = np.argsort(-(exact - counts), kind="stable")
        counts[order[:rem]] += 1
    return counts


def _class_pools(labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, that class's sample indices in a random order."""
    order = np.argsort(labels, kind="stable")
    bounds = np.cumsum(np.bincount(labels, minlength=num_classes))[:-1]
    return [rng.permutation(idx) for idx in np.split(order, bounds)]


def _parts_from_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """``owner[i]`` = client of sample i (-1 = nobody) -> sorted index array per client."""
    order = np.argsort(owner, kind="stable")  # stable: indices stay ascending per client
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    start = int(np.count_nonzero(owner < 0))
    bounds = start + np.cumsum(counts)[:-1]
    return [p.astype(np.int64) for p in np.split(order[start:], bounds - start)]


def _assign_counts(
    pools: list[np.ndarray], counts: np.ndarray, n: int
) -> np.ndarray:
    """Give client k the next ``counts[k, c]`` samples of class pool c; returns owner array."""
    owner = np.full(n, -1, dtype=np.int64)
    num_clients = counts.shape[0]
    for c, pool in enumerate(pools):
        col = counts[:, c]
        used = int(col.sum())
        if used > len(pool):  # internal invariant
            raise AssertionError(f"class {c}: {used} samples requested, {len(pool)} available")
        owner[pool[:used]] = np.repeat(np.arange(num_clients), col)
    return owner


def _check_num_clients(num_clients: Any, n: int, min_size: int = 1) -> int:
    k = _check_int(num_clients, "num_clients", 1, what="number of clients / SuperNodes")
    if k * max(min_size, 1) > n:
        raise ValueError(
            f"cannot split {n} samples over num_clients={k} with at least "
            f"{max(min_size, 1)} sample(s) each ({CONFIG_KEYS['min_size']}={min_size})"
        )
    return k
