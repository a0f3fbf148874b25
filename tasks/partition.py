"""Partitioning of a labelled training set over federated clients.

Everything here works on the integer label array of the training set
(``labels: np.ndarray[int64]``, classes ``0..C-1``) and returns **index arrays**
into it, so the same code serves numpy arrays, torch datasets and Hugging Face
datasets. Every function is deterministic given ``seed`` (``np.random.default_rng``).

Layers
------
1. *Client partitions* (who holds which samples):

   * :func:`iid_partition` -- shuffle and cut into K near-equal parts.
   * :func:`dirichlet_partition` -- per-class Dirichlet over clients,
     ``q_c ~ Dir_K(alpha)`` (Yurochkin et al.; semisfl.md §6, umpfssl.md §6,
     scala.md §5 "beta").
   * :func:`quantity_skew_partition` -- at most k classes per client
     (scala.md §5 "alpha").
   * :func:`main_class_partition` -- the SSFL main-class construction for a target
     non-IID level R (ssfl_benchmark.md §4, §10.2), with the metric :func:`r_metric`.

   Each has a :class:`flwr_datasets.partitioner.Partitioner` wrapper
   (:class:`IidSplitPartitioner`, :class:`ClassDirichletPartitioner`,
   :class:`QuantitySkewPartitioner`, :class:`MainClassPartitioner`) that calls the
   function on the dataset's label column. They are created on first attribute access,
   so importing this module for :func:`make_plan` does not import flwr-datasets.

2. *Labeled / unlabeled constructions*, composed with the above:

   * :func:`server_labeled_split` -- N_s class-balanced labels kept on the server
     (ssfl_benchmark.md §1, §10.1; semisfl.md §6).
   * :func:`dir2_labeled_split` -- per-client labeled ratio ``(p_s, p_u) ~ Dir_2(beta)``
     (umpfssl.md §6).
   * :func:`mismatch_partition` -- Fed-SHVR class-distribution mismatch (fedshvr.md §7,
     §10.6).
   * :func:`matched_test_split` -- a per-client test split with the client's own label
     distribution (umpfssl.md §6).

3. The single entry point :func:`make_plan` (+ :class:`PartitionConfig`,
   :class:`PartitionPlan`, :func:`plan_summary`) used by the whole library. Every
   Flower client process recomputes the plan from the seed, so it is pure numpy and
   fast (a few ms for 60k labels and 100 clients).

Conventions: returned index arrays are ``int64`` and sorted ascending; client index
lists of one partition are pairwise disjoint. Errors are :class:`ValueError` whose
message names the run-config key (see :data:`CONFIG_KEYS`) and the allowed values.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset

__all__ = [
    "CONFIG_KEYS",
    "LABEL_MODES",
    "SCHEMES",
    "ClassDirichletPartitioner",
    "ClientSplit",
    "IidSplitPartitioner",
    "MainClassPartitioner",
    "MismatchSplit",
    "PartitionConfig",
    "PartitionPlan",
    "QuantitySkewPartitioner",
    "class_histograms",
    "dir2_labeled_split",
    "dirichlet_partition",
    "iid_partition",
    "main_class_partition",
    "main_class_targets",
    "make_plan",
    "matched_test_split",
    "mismatch_partition",
    "plan_summary",
    "quantity_skew_partition",
    "r_metric",
    "scheme_partition",
    "server_labeled_split",
    "skew_report",
]

SCHEMES = ("iid", "dirichlet", "quantity", "ssfl-r")
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

# Independent random streams of one plan: default_rng([seed, stage]).
_STAGE_SERVER, _STAGE_DIR2, _STAGE_MISMATCH, _STAGE_TEST = 101, 102, 103, 104


# =============================================================================== helpers
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


# =============================================================================== metrics
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
    """Non-IID level R of SSFL (ssfl_benchmark.md §4, Definition 1).

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


# =============================================================================== client partitions
def iid_partition(labels: np.ndarray, num_clients: int, *, seed: int = 0) -> list[np.ndarray]:
    """IID split: a seeded permutation cut into K parts whose sizes differ by at most 1.

    (ssfl_benchmark.md §4 "IID split"). flwr-datasets' ``IidPartitioner`` shards
    contiguously without shuffling, so it is not reused.
    """
    labels = _check_labels(labels)
    k = _check_num_clients(num_clients, len(labels))
    perm = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, k)]


def _dirichlet_counts(
    class_counts: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int, max_retries: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Draw q_c ~ Dir_K(alpha) per class and round to counts; retry until sizes >= min_size."""
    c_num = len(class_counts)
    for attempt in range(1, max_retries + 1):
        q = rng.dirichlet(np.full(num_clients, alpha), size=c_num)  # [C, K]
        counts = np.stack([_largest_remainder(int(n), q[c]) for c, n in enumerate(class_counts)], axis=1)
        if counts.sum(axis=1).min() >= min_size:
            return counts, q, attempt
    raise ValueError(
        f"per-class Dirichlet with partition-alpha={alpha} gave some client fewer than "
        f"{CONFIG_KEYS['min_size']}={min_size} samples in {max_retries} draws; increase "
        f"partition-alpha, lower {CONFIG_KEYS['min_size']} or use fewer clients"
    )


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float = 0.5,
    *,
    min_size: int = 1,
    max_retries: int = 100,
    num_classes: int | None = None,
    seed: int = 0,
    return_proportions: bool = False,
) -> list[np.ndarray] | tuple[list[np.ndarray], np.ndarray]:
    """Per-class Dirichlet label skew (Yurochkin et al. 2019).

    For every class c draw ``q_c ~ Dir_K(alpha)`` and give client k the share
    ``q_{c,k}`` of the n_c samples of class c: ``n_{k,c} = round(n_c q_{c,k})`` with
    largest-remainder rounding, so ``sum_k n_{k,c} = n_c`` exactly (every sample is
    assigned once). Smaller alpha -> more skew (larger R). If some client gets fewer
    than ``min_size`` samples the whole matrix q is redrawn, up to ``max_retries``
    times, then a ValueError is raised (semisfl.md §6, umpfssl.md §6, scala.md §5
    [R] "per-class q_y ~ Dir_K(beta)").

    flwr-datasets' ``DirichletPartitioner`` uses self-balancing / rejection rules and
    does not expose q, which :func:`matched_test_split` needs, so it is not reused.

    Returns the sorted index array per client, and with ``return_proportions`` also
    the drawn ``q`` as a ``[C, K]`` array.
    """
    labels = _check_labels(labels)
    alpha = _check_real(alpha, CONFIG_KEYS["alpha"], 0.0, low_open=True, what="Dirichlet concentration")
    min_size = _check_int(min_size, CONFIG_KEYS["min_size"], 0)
    max_retries = _check_int(max_retries, "max_retries", 1)
    k = _check_num_clients(num_clients, len(labels), min_size)
    c_num = _num_classes(labels, num_classes)
    rng = np.random.default_rng(seed)
    class_counts = np.bincount(labels, minlength=c_num)
    counts, q, _ = _dirichlet_counts(class_counts, k, alpha, rng, min_size, max_retries)
    pools = _class_pools(labels, c_num, rng)
    parts = _parts_from_owner(_assign_counts(pools, counts, len(labels)), k)
    return (parts, q) if return_proportions else parts


def _quantity_assignment(
    present: np.ndarray, num_clients: int, k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random client->class-set assignment for quantity skew.

    Each client gets exactly k distinct classes; class c is held by ``s_c`` clients with
    ``s_c = K k / C`` when divisible, else ``floor`` or ``ceil`` of it (the extra
    ``K k mod C`` slots go to randomly chosen classes). Clients are processed in a
    random order and pick k distinct classes with probability proportional to the
    remaining slots, always including classes whose remaining slots equal the number
    of clients left. For a K-by-C bipartite graph with all left degrees k, Gale-Ryser
    reduces to ``max_c s_c <= #clients left``, which this rule keeps true, so the
    construction never dead-ends.
    """
    c_num = len(present)
    total = num_clients * k
    base, extra = divmod(total, c_num)
    slots = np.full(c_num, base, dtype=np.int64)
    slots[rng.choice(c_num, size=extra, replace=False)] += 1
    shards = slots.copy()
    member = np.zeros((num_clients, c_num), dtype=bool)
    left = num_clients
    for client in rng.permutation(num_clients):
        forced = np.flatnonzero(slots == left)
        free = np.flatnonzero((slots > 0) & (slots < left))
        need = k - len(forced)
        chosen = forced
        if need > 0:
            p = slots[free] / slots[free].sum()
            chosen = np.concatenate([forced, rng.choice(free, size=need, replace=False, p=p)])
        member[client, chosen] = True
        slots[chosen] -= 1
        left -= 1
    return member, shards


def quantity_skew_partition(
    labels: np.ndarray,
    num_clients: int,
    classes_per_client: int = 2,
    *,
    seed: int = 0,
) -> list[np.ndarray]:
    """Quantity-based label skew: every client holds at most k classes (scala.md §5).

    Let C be the number of classes present. Each class c is cut into ``s_c`` equal
    shards (sizes differ by at most one) and each client receives k shards of k
    *distinct* classes. With ``K k / C`` an integer every class goes to exactly
    ``s_c = K k / C`` clients (the paper's rule). Otherwise (documented choice) the
    ``K k mod C`` surplus shards go to randomly chosen classes, so ``s_c`` is
    ``floor(K k / C)`` or ``ceil(K k / C)``; clients holding a class cut into fewer
    shards get larger shards of it. The class-to-client assignment is random (see
    :func:`_quantity_assignment`). Requires ``1 <= k <= C`` and ``K k >= C`` (every
    sample is assigned) and at least ``s_c`` samples per class.
    """
    labels = _check_labels(labels)
    key = CONFIG_KEYS["classes_per_client"]
    n_clients = _check_num_clients(num_clients, len(labels))
    class_counts = np.bincount(labels) if labels.size else np.zeros(0, dtype=np.int64)
    present = np.flatnonzero(class_counts)
    c_num = len(present)
    k = _check_int(classes_per_client, key, 1, c_num, what=f"classes per client; {c_num} classes present")
    if n_clients * k < c_num:
        raise ValueError(
            f"{key}={k} with {n_clients} clients covers only {n_clients * k} class slots but "
            f"{c_num} classes must be placed; need {key} * num_clients >= {c_num}"
        )
    rng = np.random.default_rng(seed)
    member, shards = _quantity_assignment(present, n_clients, k, rng)
    short = np.flatnonzero(class_counts[present] < shards)
    if len(short):
        c = int(present[short[0]])
        raise ValueError(
            f"class {c} has {class_counts[c]} samples but must be cut into {shards[short[0]]} shards "
            f"({key}={k}, {n_clients} clients); use fewer clients or a smaller {key}"
        )
    pools = _class_pools(labels, int(present.max()) + 1, rng)
    owner = np.full(len(labels), -1, dtype=np.int64)
    for j, c in enumerate(present):
        holders = np.flatnonzero(member[:, j])
        for holder, piece in zip(holders, np.array_split(pools[c], len(holders))):
            owner[piece] = holder
    return _parts_from_owner(owner, n_clients)


def main_class_targets(
    class_counts: np.ndarray, num_clients: int, r: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Expected (real-valued) class counts ``A[k, i]`` of the SSFL construction.

    ssfl_benchmark.md §4 (Appendix A.2): with n_j samples of class j, q_j = n_j / sum n
    and m_j users whose *main class* is j, a user with main class j receives

    * ``n_j R / m_j`` samples of class j (step a, typo fixed per §10.3), and
    * ``(1 - R) n_i q_j / m_j`` samples of every class i (step b),

    so ``P_j[i] = R 1[i=j] + (1-R) q_i`` and ``||P_j - P_k||_1 = 2R`` for different
    main classes. [R] ``m_j = K / d`` when K is a multiple of d; otherwise
    (documented choice) the main classes are spread as evenly as possible:
    ``m_j = floor(K/d)`` plus one for ``K mod d`` randomly chosen classes. When K < d
    some classes are nobody's main class; their samples are spread entirely as
    background, i.e. with the users' step-(b) weights ``w_k = q_{main(k)} / m_{main(k)}``
    renormalised over the classes that do have users (identical to the paper when all
    ``m_j > 0``). Users are assigned to main classes in a random order.

    Returns ``(A [K, C], main [K])``; column sums of A equal ``class_counts``.
    """
    class_counts = np.asarray(class_counts, dtype=np.float64)
    present = np.flatnonzero(class_counts > 0)
    d = len(present)
    base, extra = divmod(num_clients, d)
    m = np.zeros(len(class_counts), dtype=np.int64)
    m[present] = base
    m[present[rng.choice(d, size=extra, replace=False)]] += 1
    main = rng.permutation(np.repeat(np.arange(len(class_counts)), m))
    q = class_counts / class_counts.sum()
    w = q[main] / m[main]
    w = w / w.sum()
    has_main = m > 0
    background = np.where(has_main, (1.0 - r) * class_counts, class_counts)  # [C]
    a = w[:, None] * background[None, :]
    a[np.arange(num_clients), main] += r * class_counts[main] / m[main]
    return a, main


def main_class_partition(
    labels: np.ndarray,
    num_clients: int,
    r: float = 0.4,
    *,
    seed: int = 0,
    return_targets: bool = False,
) -> list[np.ndarray] | tuple[list[np.ndarray], np.ndarray]:
    """SSFL main-class partition for a target non-IID level R (ssfl_benchmark.md §4).

    Builds the expected counts ``A`` of :func:`main_class_targets` and rounds each
    class column with largest-remainder rounding (class counts are conserved).
    With K = d the realised R equals the target up to rounding; with
    ``m_j = m = K/d`` users per main class it is ``R (1 - d m (m-1) / (K (K-1)))``
    because users sharing a main class are at distance 0 (§10.2). Report the
    realised value (``r_metric`` of the histograms, see :func:`skew_report`).
    ``return_targets`` also returns A (whose R is the rounding-free expectation).
    """
    labels = _check_labels(labels)
    r = _check_real(r, CONFIG_KEYS["r"], 0.0, 1.0, what="SSFL target non-IID level R")
    k = _check_num_clients(num_clients, len(labels))
    rng = np.random.default_rng(seed)
    class_counts = np.bincount(labels) if labels.size else np.zeros(1, dtype=np.int64)
    a, _ = main_class_targets(class_counts, k, r, rng)
    counts = np.stack([_largest_remainder(int(n), a[:, c]) for c, n in enumerate(class_counts)], axis=1)
    if counts.sum(axis=1).min() < 1:
        raise ValueError(f"{CONFIG_KEYS['r']}={r}: some client would receive no samples; use fewer clients")
    pools = _class_pools(labels, len(class_counts), rng)
    parts = _parts_from_owner(_assign_counts(pools, counts, len(labels)), k)
    return (parts, a) if return_targets else parts


# =============================================================================== labeled / unlabeled
def server_labeled_split(
    labels: np.ndarray, num_server: int, *, num_classes: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Class-balanced server-labeled set: ``N_s / C`` samples of every class.

    ssfl_benchmark.md §1 and §10.1 ("N_s samples" means N_s/d per class), semisfl.md §6.
    Returns ``(server_idx, rest_idx)``; the rest is what gets partitioned over the
    clients as unlabeled data. ``N_s`` must be a multiple of C and no class may run out.
    """
    labels = _check_labels(labels)
    key = CONFIG_KEYS["server_labels"]
    c_num = _num_classes(labels, num_classes)
    n_s = _check_int(num_server, key, 0, what="server-side labeled samples")
    if n_s % c_num:
        raise ValueError(f"{key}={n_s} must be a multiple of the number of classes ({c_num}) for a class-balanced set")
    per_class = n_s // c_num
    counts = np.bincount(labels, minlength=c_num)
    if per_class > counts.min():
        c = int(counts.argmin())
        raise ValueError(
            f"{key}={n_s} needs {per_class} samples per class but class {c} has only {counts[c]} "
            f"(at most {int(counts.min()) * c_num} are possible)"
        )
    pools = _class_pools(labels, c_num, np.random.default_rng(seed))
    server = np.sort(np.concatenate([p[:per_class] for p in pools])).astype(np.int64)
    mask = np.ones(len(labels), dtype=bool)
    mask[server] = False
    return server, np.flatnonzero(mask).astype(np.int64)


def dir2_labeled_split(
    parts: Sequence[np.ndarray], beta: float = 0.5, *, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Per-client labeled ratio from ``(p_s, p_u) ~ Dir_2(beta)`` (umpfssl.md §6).

    Client k draws ``p_s ~ Beta(beta, beta)`` (the first coordinate of Dir_2(beta)) and a
    uniformly random ``round(p_s n_k)`` of its samples become labeled, the rest
    unlabeled. Returns ``(labeled, unlabeled, p_s)``.
    """
    beta = _check_real(beta, CONFIG_KEYS["labeled_alpha"], 0.0, low_open=True, what="Dir_2 concentration")
    rng = np.random.default_rng(seed)
    p_s = rng.dirichlet([beta, beta], size=len(parts))[:, 0]
    labeled, unlabeled = [], []
    for p, ps in zip(parts, p_s):
        p = np.asarray(p, dtype=np.int64)
        perm = rng.permutation(p)
        n_l = int(round(ps * len(p)))
        labeled.append(np.sort(perm[:n_l]))
        unlabeled.append(np.sort(perm[n_l:]))
    return labeled, unlabeled, p_s


@dataclass
class MismatchSplit:
    """Result of :func:`mismatch_partition`."""

    labeled: list[np.ndarray]
    unlabeled: list[np.ndarray]
    labeled_classes: list[list[int]]
    target_sizes: np.ndarray      # requested unlabeled size per client
    realised_mismatch: np.ndarray  # fraction of unlabeled samples from absent classes
    unassigned: int                # pool samples no client could take (supply limits)


def _mismatch_counts(
    supply: np.ndarray, member: np.ndarray, sizes: np.ndarray, r: float, iters: int = 200
) -> np.ndarray:
    """Real-valued unlabeled counts X[k, c] with an exact mismatch ratio per client.

    Iteratively fills each client's remaining need ``M_k - sum_c X[k, c]``: a share
    ``1 - r`` over its labeled classes and ``r`` over the absent ones, within a group
    proportional to the classes' remaining supply; columns are capped at the remaining
    supply and then, per client, the larger group of the increment is shrunk so that
    ``absent / total = r`` holds exactly. All steps only shrink the increment, so
    ``sum_k X[k, c] <= supply_c`` always. Stops when needs are met or supply is spent.
    """
    avail = supply.astype(np.float64).copy()
    x = np.zeros(member.shape, dtype=np.float64)
    absent = ~member
    share = {True: 1.0 - r, False: r}
    for _ in range(iters):
        need = np.maximum(sizes - x.sum(axis=1), 0.0)
        if need.sum() < 0.5:
            break
        y = np.zeros_like(x)
        for grp_mask, frac in ((member, share[True]), (absent, share[False])):
            if frac == 0.0:
                continue
            w = grp_mask * avail[None, :]
            ws = w.sum(axis=1, keepdims=True)
            y += np.divide(frac * need[:, None] * w, ws, out=np.zeros_like(w), where=ws > 0)
        col = y.sum(axis=0)
        y *= np.minimum(1.0, np.divide(avail, col, out=np.ones_like(col), where=col > 0))[None, :]
        if 0.0 < r < 1.0:
            a = (y * absent).sum(axis=1)
            s = (y * member).sum(axis=1)
            too_absent = a * (1 - r) > r * s
            scale_a = np.divide(r * s, (1 - r) * a, out=np.zeros_like(a), where=a > 0)
            scale_s = np.divide((1 - r) * a, r * s, out=np.zeros_like(s), where=s > 0)
            y *= np.where(absent, np.where(too_absent, scale_a, 1.0)[:, None], np.where(too_absent, 1.0, scale_s)[:, None])
        if y.sum() < 1e-6:
            break
        x += y
        avail = np.maximum(avail - y.sum(axis=0), 0.0)
    return x


def _round_mismatch(x: np.ndarray, member: np.ndarray, supply: np.ndarray) -> np.ndarray:
    """Integer counts from X: per client and group round the group total, share it by
    largest remainder, never exceeding a class's supply."""
    counts = np.floor(x + 1e-9).astype(np.int64)
    left = supply - counts.sum(axis=0)
    for k in range(x.shape[0]):
        for grp in (member[k], ~member[k]):
            deficit = int(round(x[k, grp].sum())) - int(counts[k, grp].sum())
            if deficit <= 0:
                continue
            cls = np.flatnonzero(grp)
            frac = (x[k, cls] - counts[k, cls])
            for c in cls[np.argsort(-frac, kind="stable")]:
                if deficit == 0:
                    break
                if left[c] > 0:
                    counts[k, c] += 1
                    left[c] -= 1
                    deficit -= 1
    return counts


def mismatch_partition(
    labels: np.ndarray,
    num_clients: int,
    *,
    mismatch_ratio: float = 0.0,
    labeled_per_client: int = 60,
    labeled_classes_per_client: int = 2,
    size_alpha: float | None = 0.5,
    size_floor_fraction: float = 0.4,
    min_size: int = 1,
    unlabeled_total: int | None = None,
    num_classes: int | None = None,
    seed: int = 0,
) -> MismatchSplit:
    """Fed-SHVR labeled/unlabeled class-distribution mismatch (fedshvr.md §7, §10.6).

    * **Labeled.** Client k gets ``labeled_per_client`` samples from the L =
      ``labeled_classes_per_client`` classes ``{k, k+1, ..., k+L-1} mod C`` ([R] of §7),
      balanced (``labeled_per_client / L`` each; a remainder goes to the first classes).
    * **Unlabeled sizes.** ``M_k = f + (M - K f) w_k`` with ``w ~ Dir_K(size_alpha)``
      and a floor ``f = max(min_size, floor(size_floor_fraction * M / K))`` (§10.6);
      ``size_alpha=None`` gives equal sizes. M is the whole remaining pool unless
      ``unlabeled_total`` is given.
    * **Mismatch.** A fraction r of client k's unlabeled data comes from classes
      absent from its labeled set and ``1 - r`` from its labeled classes (§7). Within
      each group, classes are used in proportion to their remaining supply. Because
      class supply is finite, a client whose classes run out gets fewer than M_k
      samples (the ratio is kept); pool samples nobody can take stay unassigned and are
      counted in ``unassigned``. The realised ratio is exact up to integer rounding.
    """
    labels = _check_labels(labels)
    c_num = _num_classes(labels, num_classes)
    k_num = _check_num_clients(num_clients, len(labels))
    r = _check_real(mismatch_ratio, CONFIG_KEYS["mismatch_ratio"], 0.0, 1.0, what="share of unlabeled data from classes absent from the labeled set")
    l_cls = _check_int(labeled_classes_per_client, CONFIG_KEYS["labeled_classes_per_client"], 1, c_num, what=f"{c_num} classes")
    lpc = _check_int(labeled_per_client, CONFIG_KEYS["labeled_per_client"], l_cls, what=f"at least one per labeled class ({l_cls})")
    min_size = _check_int(min_size, CONFIG_KEYS["min_size"], 0)
    if r > 0 and l_cls == c_num:
        raise ValueError(
            f"{CONFIG_KEYS['mismatch_ratio']}={r} needs classes absent from each labeled set, but "
            f"{CONFIG_KEYS['labeled_classes_per_client']}={l_cls} equals the number of classes"
        )
    if size_alpha is not None:
        size_alpha = _check_real(size_alpha, CONFIG_KEYS["alpha"], 0.0, low_open=True, what="Dirichlet concentration of the unlabeled sizes")
    rng = np.random.default_rng(seed)

    # labeled sets
    classes = [[(k + j) % c_num for j in range(l_cls)] for k in range(k_num)]
    per = np.full(l_cls, lpc // l_cls, dtype=np.int64)
    per[: lpc % l_cls] += 1
    lab_counts = np.zeros((k_num, c_num), dtype=np.int64)
    for k, cls in enumerate(classes):
        lab_counts[k, cls] = per
    class_counts = np.bincount(labels, minlength=c_num)
    need = lab_counts.sum(axis=0)
    if np.any(need > class_counts):
        c = int(np.argmax(need - class_counts))
        raise ValueError(
            f"{CONFIG_KEYS['labeled_per_client']}={lpc}: class {c} would need {need[c]} labeled samples "
            f"but has {class_counts[c]}"
        )
    pools = _class_pools(labels, c_num, rng)
    lab_owner = _assign_counts(pools, lab_counts, len(labels))
    labeled = _parts_from_owner(lab_owner, k_num)
    rest_pools = [p[int(n):] for p, n in zip(pools, need)]
    supply = np.array([len(p) for p in rest_pools], dtype=np.int64)

    # unlabeled sizes
    m_total = int(supply.sum()) if unlabeled_total is None else _check_int(unlabeled_total, "unlabeled_total", 0, int(supply.sum()))
    floor = max(min_size, int(size_floor_fraction * m_total / k_num))
    if floor * k_num > m_total:
        raise ValueError(
            f"cannot give {k_num} clients at least {floor} unlabeled samples from {m_total} "
            f"({CONFIG_KEYS['min_size']}={min_size})"
        )
    weights = np.ones(k_num) if size_alpha is None else rng.dirichlet(np.full(k_num, size_alpha))
    sizes = floor + _largest_remainder(m_total - floor * k_num, weights)

    member = lab_counts > 0
    x = _mismatch_counts(supply, member, sizes.astype(np.float64), r)
    counts = _round_mismatch(x, member, supply)
    owner = np.full(len(labels), -1, dtype=np.int64)
    for c, pool in enumerate(rest_pools):
        col = counts[:, c]
        owner[pool[: int(col.sum())]] = np.repeat(np.arange(k_num), col)
    unlabeled = _parts_from_owner(owner, k_num)
    got = counts.sum(axis=1)
    if got.min() < max(min_size, 1):
        k = int(got.argmin())
        raise ValueError(
            f"client {k} receives only {got[k]} unlabeled samples under {CONFIG_KEYS['mismatch_ratio']}={r} "
            f"(class supply exhausted); lower {CONFIG_KEYS['labeled_per_client']} or change the ratio"
        )
    realised = np.divide((counts * ~member).sum(axis=1), got, out=np.zeros(k_num), where=got > 0)
    return MismatchSplit(
        labeled=labeled,
        unlabeled=unlabeled,
        labeled_classes=classes,
        target_sizes=sizes,
        realised_mismatch=realised,
        unassigned=int(supply.sum() - counts.sum()),
    )


def matched_test_split(
    test_labels: np.ndarray, proportions: np.ndarray, *, seed: int = 0
) -> list[np.ndarray]:
    """Per-client test split sharing each client's label distribution (umpfssl.md §6).

    ``proportions`` is ``[C, K]``: ``proportions[c, k]`` is the share of class c that
    client k holds (the Dirichlet ``q_c``, or the realised shares
    ``n_{k,c} / sum_k n_{k,c}`` of any partition). The ``n_c^test`` test samples of
    class c are divided by largest remainder with those shares, so client k's test
    histogram is proportional to its training histogram up to rounding. A class no
    client holds (all-zero row) is spread uniformly. Every test sample goes to exactly
    one client.
    """
    test_labels = _check_labels(test_labels, "test_labels")
    prop = np.asarray(proportions, dtype=np.float64)
    if prop.ndim != 2:
        raise ValueError(f"proportions must be [C, K], got shape {prop.shape}")
    c_num = max(prop.shape[0], int(test_labels.max()) + 1 if test_labels.size else 0)
    k_num = prop.shape[1]
    rng = np.random.default_rng(seed)
    counts = np.zeros((k_num, c_num), dtype=np.int64)
    n_test = np.bincount(test_labels, minlength=c_num)
    for c in range(c_num):
        row = prop[c] if c < prop.shape[0] else np.zeros(k_num)
        if row.sum() <= 0:
            row = np.ones(k_num)
        counts[:, c] = _largest_remainder(int(n_test[c]), row)
    pools = _class_pools(test_labels, c_num, rng)
    return _parts_from_owner(_assign_counts(pools, counts, len(test_labels)), k_num)


# =============================================================================== make_plan
@dataclass
class PartitionConfig:
    """Partitioning options; field -> run-config key in :data:`CONFIG_KEYS`."""

    scheme: str = "iid"            # "iid" | "dirichlet" | "quantity" | "ssfl-r"
    alpha: float = 0.5             # Dirichlet concentration
    classes_per_client: int = 2    # quantity skew k
    r: float = 0.4                 # SSFL target R
    server_labels: int = 0         # N_s (label_mode "server")
    labeled_alpha: float = 0.5     # Dir_2 concentration (label_mode "dir2")
    mismatch_ratio: float = 0.0    # label_mode "mismatch"
    labeled_per_client: int = 60
    labeled_classes_per_client: int = 2
    min_size: int = 1
    seed: int = 0

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], **overrides: Any) -> "PartitionConfig":
        """Build from a Flower run config (keys of :data:`CONFIG_KEYS`; missing keys keep defaults)."""
        kwargs = {f: run_config[key] for f, key in CONFIG_KEYS.items() if key in run_config}
        kwargs.update(overrides)
        return cls(**kwargs)

    def validate(self) -> "PartitionConfig":
        """Check types and ranges; raise ValueError naming the run-config key."""
        if self.scheme not in SCHEMES:
            raise ValueError(f"{CONFIG_KEYS['scheme']}={self.scheme!r} is not one of {', '.join(SCHEMES)}")
        _check_real(self.alpha, CONFIG_KEYS["alpha"], 0.0, low_open=True, what="Dirichlet concentration")
        _check_int(self.classes_per_client, CONFIG_KEYS["classes_per_client"], 1, what="quantity skew k")
        _check_real(self.r, CONFIG_KEYS["r"], 0.0, 1.0, what="SSFL target non-IID level R")
        _check_int(self.server_labels, CONFIG_KEYS["server_labels"], 0)
        _check_real(self.labeled_alpha, CONFIG_KEYS["labeled_alpha"], 0.0, low_open=True, what="Dir_2 concentration")
        _check_real(self.mismatch_ratio, CONFIG_KEYS["mismatch_ratio"], 0.0, 1.0)
        _check_int(self.labeled_per_client, CONFIG_KEYS["labeled_per_client"], 1)
        _check_int(self.labeled_classes_per_client, CONFIG_KEYS["labeled_classes_per_client"], 1)
        _check_int(self.min_size, CONFIG_KEYS["min_size"], 0)
        _check_int(self.seed, CONFIG_KEYS["seed"], 0)
        return self


@dataclass
class ClientSplit:
    """One client's data: indices into the train set, and optionally into the test set."""

    labeled: np.ndarray      # int64 indices into the train set
    unlabeled: np.ndarray
    test: np.ndarray | None  # indices into the test set (only when test labels given)

    @property
    def all(self) -> np.ndarray:
        """Labeled and unlabeled indices together (sorted)."""
        return np.sort(np.concatenate([self.labeled, self.unlabeled]))


@dataclass
class PartitionPlan:
    """Output of :func:`make_plan`."""

    server_labeled: np.ndarray      # empty unless label_mode == "server"
    clients: list[ClientSplit]
    report: dict = field(default_factory=dict)  # JSON-serialisable realised skew


def scheme_partition(labels: np.ndarray, num_clients: int, cfg: PartitionConfig) -> list[np.ndarray]:
    """Client partition of ``labels`` by ``cfg.scheme`` (the numpy function of the scheme)."""
    _check_num_clients(num_clients, len(labels), cfg.min_size)
    if cfg.scheme == "iid":
        return iid_partition(labels, num_clients, seed=cfg.seed)
    if cfg.scheme == "dirichlet":
        return dirichlet_partition(labels, num_clients, cfg.alpha, min_size=cfg.min_size, seed=cfg.seed)
    if cfg.scheme == "quantity":
        return quantity_skew_partition(labels, num_clients, cfg.classes_per_client, seed=cfg.seed)
    return main_class_partition(labels, num_clients, cfg.r, seed=cfg.seed)


def _scheme_desc(cfg: PartitionConfig) -> str:
    return {
        "iid": "iid",
        "dirichlet": f"dirichlet(alpha={cfg.alpha:g})",
        "quantity": f"quantity(k={cfg.classes_per_client})",
        "ssfl-r": f"ssfl-r(R={cfg.r:g})",
    }[cfg.scheme]


def make_plan(
    train_labels: np.ndarray,
    num_clients: int,
    cfg: PartitionConfig,
    label_mode: str = "all",
    test_labels: np.ndarray | None = None,
) -> PartitionPlan:
    """Partition the training set over ``num_clients`` clients, labeled and unlabeled.

    label_mode
        * ``"all"``: the ``cfg.scheme`` partition, every client sample labeled
          (SCALA, supervised baselines). Identical to the scheme function's output.
        * ``"none"``: the same partition, every client sample unlabeled.
        * ``"server"``: :func:`server_labeled_split` of ``cfg.server_labels`` first; the
          rest is partitioned by the scheme as unlabeled client data (SSFL, Semi-SFL).
        * ``"dir2"``: scheme partition, then :func:`dir2_labeled_split` with
          ``cfg.labeled_alpha`` (UM-pFSSL).
        * ``"mismatch"``: :func:`mismatch_partition` (Fed-SHVR). ``partition`` selects the
          unlabeled sizes: ``iid`` = equal sizes, ``dirichlet`` = ``Dir_K(partition-alpha)``
          weights with a floor; ``quantity`` / ``ssfl-r`` are rejected.

    test_labels
        When given, :func:`matched_test_split` gives each client a test split with its
        own label distribution (shares taken from the client's labeled + unlabeled
        histogram; for ``"dirichlet"`` these equal the drawn ``q_c`` up to rounding).

    Random streams: the scheme partition uses ``cfg.seed`` directly (so it equals the
    scheme function / Partitioner with that seed); the server split, Dir_2 split,
    mismatch construction and test split use ``default_rng([seed, stage])``.
    A non-zero ``server-labels`` outside label_mode ``"server"`` is ignored with a warning.
    """
    cfg.validate()
    if label_mode not in LABEL_MODES:
        raise ValueError(f"label_mode={label_mode!r} is not one of {', '.join(LABEL_MODES)}")
    labels = _check_labels(train_labels, "train_labels")
    test = None if test_labels is None else _check_labels(test_labels, "test_labels")
    c_num = _num_classes(labels, None, *(() if test is None else (test,)))
    k_num = _check_num_clients(num_clients, len(labels), cfg.min_size)
    if cfg.server_labels and label_mode != "server":
        warnings.warn(
            f"{CONFIG_KEYS['server_labels']}={cfg.server_labels} is ignored with label_mode={label_mode!r}",
            stacklevel=2,
        )
    seed = cfg.seed
    server = np.zeros(0, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    report: dict[str, Any] = {
        "scheme": cfg.scheme,
        "label_mode": label_mode,
        "num_clients": k_num,
        "num_classes": c_num,
        "num_train": int(len(labels)),
        "config": asdict(cfg),
    }
    extra: dict[str, Any] = {}

    if label_mode == "mismatch":
        if cfg.scheme not in ("iid", "dirichlet"):
            raise ValueError(
                f"{CONFIG_KEYS['scheme']}={cfg.scheme!r} is not supported with label_mode='mismatch'; "
                f"use iid (equal unlabeled sizes) or dirichlet (Dir_K(partition-alpha) sizes)"
            )
        ms = mismatch_partition(
            labels,
            k_num,
            mismatch_ratio=cfg.mismatch_ratio,
            labeled_per_client=cfg.labeled_per_client,
            labeled_classes_per_client=cfg.labeled_classes_per_client,
            size_alpha=cfg.alpha if cfg.scheme == "dirichlet" else None,
            min_size=cfg.min_size,
            num_classes=c_num,
            seed=int(np.random.default_rng([seed, _STAGE_MISMATCH]).integers(2**63)),
        )
        lab, unl = ms.labeled, ms.unlabeled
        extra["mismatch"] = {
            "target": float(cfg.mismatch_ratio),
            "per_client": [float(v) for v in ms.realised_mismatch],
            "mean": float(ms.realised_mismatch.mean()),
            "max_abs_error": float(np.abs(ms.realised_mismatch - cfg.mismatch_ratio).max()),
            "labeled_classes": ms.labeled_classes,
            "target_unlabeled_sizes": ms.target_sizes.tolist(),
        }
        extra["unassigned"] = ms.unassigned
    else:
        pool = np.arange(len(labels), dtype=np.int64)
        if label_mode == "server":
            key = CONFIG_KEYS["server_labels"]
            if cfg.server_labels <= 0:
                raise ValueError(f"{key}={cfg.server_labels} must be > 0 with label_mode='server'")
            server, pool = server_labeled_split(
                labels, cfg.server_labels, num_classes=c_num,
                seed=int(np.random.default_rng([seed, _STAGE_SERVER]).integers(2**63)),
            )
            if len(pool) < k_num * max(cfg.min_size, 1):
                raise ValueError(
                    f"{key}={cfg.server_labels} leaves {len(pool)} samples for {k_num} clients; lower {key}"
                )
        parts = [pool[p] for p in scheme_partition(labels[pool], k_num, cfg)]
        if label_mode == "all":
            lab, unl = parts, [empty] * k_num
        elif label_mode in ("none", "server"):
            lab, unl = [empty] * k_num, parts
        else:  # dir2
            lab, unl, p_s = dir2_labeled_split(
                parts, cfg.labeled_alpha,
                seed=int(np.random.default_rng([seed, _STAGE_DIR2]).integers(2**63)),
            )
            extra["drawn_labeled_ratio"] = [float(v) for v in p_s]
        if cfg.scheme == "ssfl-r":
            _, a = main_class_partition(labels[pool], k_num, cfg.r, seed=seed, return_targets=True)
            extra["target_r"] = float(cfg.r)
            extra["expected_r"] = r_metric(a)
        extra["unassigned"] = 0

    lab = [np.asarray(p, dtype=np.int64) for p in lab]
    unl = [np.asarray(p, dtype=np.int64) for p in unl]
    full = [np.sort(np.concatenate([a, b])) for a, b in zip(lab, unl)]
    sizes = np.array([len(f) for f in full])
    if sizes.min() == 0:
        raise ValueError(f"client {int(sizes.argmin())} received no samples; use fewer clients or a larger partition-alpha")

    hist_l = class_histograms(labels, lab, c_num)
    hist_u = class_histograms(labels, unl, c_num)
    hist = hist_l + hist_u
    tests: list[np.ndarray | None] = [None] * k_num
    if test is not None:
        col = hist.sum(axis=0, keepdims=True)
        shares = np.divide(hist, col, out=np.zeros(hist.shape), where=col > 0).T  # [C, K]
        tests = matched_test_split(
            test, shares, seed=int(np.random.default_rng([seed, _STAGE_TEST]).integers(2**63))
        )
        hist_t = class_histograms(test, tests, c_num)
        p_train = hist / hist.sum(axis=1, keepdims=True)
        tsum = hist_t.sum(axis=1, keepdims=True)
        p_test = np.divide(hist_t, tsum, out=np.zeros(hist_t.shape), where=tsum > 0)
        extra["test_sizes"] = hist_t.sum(axis=1).tolist()
        extra["test_class_counts"] = hist_t.tolist()
        extra["test_tv"] = (0.5 * np.abs(p_train - p_test).sum(axis=1)).tolist()

    report.update(
        {
            "realised_r": r_metric(hist),
            "sizes": sizes.tolist(),
            "labeled_sizes": hist_l.sum(axis=1).tolist(),
            "unlabeled_sizes": hist_u.sum(axis=1).tolist(),
            "labeled_ratio": (hist_l.sum(axis=1) / sizes).tolist(),
            "labeled_class_counts": hist_l.tolist(),
            "unlabeled_class_counts": hist_u.tolist(),
            "classes_per_client": (hist > 0).sum(axis=1).tolist(),
            "server_labeled": {
                "size": int(len(server)),
                "class_counts": np.bincount(labels[server], minlength=c_num).tolist(),
            },
        }
    )
    report.update(extra)
    clients = [ClientSplit(labeled=a, unlabeled=b, test=t) for a, b, t in zip(lab, unl, tests)]
    return PartitionPlan(server_labeled=server, clients=clients, report=report)


def plan_summary(plan: PartitionPlan) -> str:
    """One log line: scheme, label mode, sizes, labeled share, realised R (and mismatch)."""
    rep = plan.report
    cfg = PartitionConfig(**rep["config"]) if "config" in rep else None
    sizes = np.asarray(rep["sizes"])
    lab = int(np.sum(rep["labeled_sizes"]))
    unl = int(np.sum(rep["unlabeled_sizes"]))
    parts = [
        f"partition={_scheme_desc(cfg) if cfg else rep.get('scheme')}",
        f"label_mode={rep['label_mode']}",
        f"K={rep['num_clients']} C={rep['num_classes']}",
        f"size min/med/max={sizes.min()}/{int(np.median(sizes))}/{sizes.max()}",
        f"labeled={lab} unlabeled={unl}",
    ]
    if rep["server_labeled"]["size"]:
        parts.append(f"server_labels={rep['server_labeled']['size']}")
    parts.append(f"R={rep['realised_r']:.3f}")
    if "target_r" in rep:
        parts.append(f"(target {rep['target_r']:.3f}, expected {rep['expected_r']:.3f})")
    if "mismatch" in rep:
        parts.append(f"mismatch={rep['mismatch']['mean']:.3f} (target {rep['mismatch']['target']:.3f})")
    if rep.get("unassigned"):
        parts.append(f"unassigned={rep['unassigned']}")
    if "test_sizes" in rep:
        parts.append(f"test={int(np.sum(rep['test_sizes']))} (mean TV {np.mean(rep['test_tv']):.3f})")
    return " ".join(parts)


# =============================================================================== flwr-datasets
# The Partitioner classes are built on first access (PEP 562 module __getattr__):
# importing flwr_datasets pulls in `datasets` and plotting code (~3 s), which Flower
# client processes that only call make_plan() should not pay for.
_PARTITIONER_NAMES = (
    "IidSplitPartitioner",
    "ClassDirichletPartitioner",
    "QuantitySkewPartitioner",
    "MainClassPartitioner",
)


def _build_partitioners() -> dict[str, type]:
    from flwr_datasets.partitioner import Partitioner

    class _IndexPartitioner(Partitioner):
        """Base for partitioners that compute index lists from the label column once.

        ``partition_indices`` is computed lazily on first use from
        ``self.dataset[partition_by]`` by the matching numpy function; ``load_partition``
        returns ``self.dataset.select(indices)``.
        """

        def __init__(self, num_partitions: int, partition_by: str = "label", seed: int = 0) -> None:
            super().__init__()
            self._num_partitions = _check_int(num_partitions, "num_partitions", 1)
            self._partition_by = partition_by
            self._seed = seed
            self._indices: list[np.ndarray] | None = None

        @property
        def num_partitions(self) -> int:
            return self._num_partitions

        def _labels(self) -> np.ndarray:
            ds = self.dataset
            if self._partition_by not in ds.column_names:
                raise ValueError(f"partition_by={self._partition_by!r} is not a column; columns are {ds.column_names}")
            col = ds.with_format("numpy", columns=[self._partition_by])[:][self._partition_by]
            return _check_labels(np.asarray(col), f"column {self._partition_by!r}")

        def _num_classes(self) -> int | None:
            feat = self.dataset.features.get(self._partition_by)
            return getattr(feat, "num_classes", None)

        def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
            raise NotImplementedError

        @property
        def partition_indices(self) -> list[np.ndarray]:
            """Sorted int64 row indices of every partition."""
            if self._indices is None:
                self._indices = self._compute(self._labels())
            return self._indices

        def load_partition(self, partition_id: int) -> Dataset:
            if not 0 <= partition_id < self._num_partitions:
                raise ValueError(f"partition_id={partition_id} is not in [0, {self._num_partitions - 1}]")
            return self.dataset.select(self.partition_indices[partition_id])

        def report(self) -> dict:
            """Realised skew (sizes, class histograms, R, classes per partition)."""
            return skew_report(self._labels(), self.partition_indices, self._num_classes())


    class IidSplitPartitioner(_IndexPartitioner):
        """IID: a seeded shuffle cut into near-equal parts (:func:`iid_partition`)."""

        def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
            return iid_partition(labels, self._num_partitions, seed=self._seed)


    class ClassDirichletPartitioner(_IndexPartitioner):
        """Per-class Dirichlet ``q_c ~ Dir_K(alpha)``, count-conserving (:func:`dirichlet_partition`)."""

        def __init__(
            self, num_partitions: int, partition_by: str = "label", alpha: float = 0.5,
            min_size: int = 1, max_retries: int = 100, seed: int = 0,
        ) -> None:
            super().__init__(num_partitions, partition_by, seed)
            self._alpha = _check_real(alpha, CONFIG_KEYS["alpha"], 0.0, low_open=True, what="Dirichlet concentration")
            self._min_size = min_size
            self._max_retries = max_retries

        def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
            return dirichlet_partition(
                labels, self._num_partitions, self._alpha, min_size=self._min_size,
                max_retries=self._max_retries, seed=self._seed,
            )


    class QuantitySkewPartitioner(_IndexPartitioner):
        """At most k classes per partition, shard-based (:func:`quantity_skew_partition`)."""

        def __init__(self, num_partitions: int, partition_by: str = "label", classes_per_partition: int = 2, seed: int = 0) -> None:
            super().__init__(num_partitions, partition_by, seed)
            self._k = _check_int(classes_per_partition, CONFIG_KEYS["classes_per_client"], 1)

        def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
            return quantity_skew_partition(labels, self._num_partitions, self._k, seed=self._seed)


    class MainClassPartitioner(_IndexPartitioner):
        """SSFL main-class construction for a target non-IID level R (:func:`main_class_partition`)."""

        def __init__(self, num_partitions: int, partition_by: str = "label", r: float = 0.4, seed: int = 0) -> None:
            super().__init__(num_partitions, partition_by, seed)
            self._r = _check_real(r, CONFIG_KEYS["r"], 0.0, 1.0, what="SSFL target non-IID level R")

        def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
            return main_class_partition(labels, self._num_partitions, self._r, seed=self._seed)

    classes = (_IndexPartitioner, IidSplitPartitioner, ClassDirichletPartitioner,
               QuantitySkewPartitioner, MainClassPartitioner)
    for cls in classes:  # module-level names, so instances pickle like normal classes
        cls.__qualname__ = cls.__name__
    return {cls.__name__: cls for cls in classes}


def __getattr__(name: str) -> Any:
    if name in _PARTITIONER_NAMES or name == "_IndexPartitioner":
        globals().update(_build_partitioners())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
