"""Client partitions (who holds which samples): IID, per-class Dirichlet, quantity skew, SSFL main class."""
from __future__ import annotations

import numpy as np

from ._common import (
    CONFIG_KEYS,
    DEFAULTS,
    _assign_counts,
    _check_int,
    _check_labels,
    _check_num_clients,
    _check_real,
    _class_pools,
    _largest_remainder,
    _num_classes,
    _parts_from_owner,
)


def iid_partition(labels: np.ndarray, num_clients: int, *, seed: int = 0) -> list[np.ndarray]:
    """IID split: a seeded permutation cut into K parts whose sizes differ by at most 1.

    (the SSFL paper's IID case, Appendix A.2). flwr-datasets' ``IidPartitioner`` shards
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
    alpha: float = DEFAULTS["alpha"],
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
    times, then a ValueError is raised (the Dirichlet label skew of Semi-SFL Sec. V-D, UM-pFSSL
    Sec. 6.1 and SCALA Sec. 5.1, read as one ``q_y ~ Dir_K(beta)`` per class).

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
    classes_per_client: int = DEFAULTS["classes_per_client"],
    *,
    seed: int = 0,
) -> list[np.ndarray]:
    """Quantity-based label skew: every client holds at most k classes (SCALA Sec. 5.1).

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

    The SSFL paper's Appendix A.2: with n_j samples of class j, q_j = n_j / sum n
    and m_j users whose *main class* is j, a user with main class j receives

    * ``n_j R / m_j`` samples of class j (step a; the paper's ``n_i R / m_i`` is a typo), and
    * ``(1 - R) n_i q_j / m_j`` samples of every class i (step b),

    so ``P_j[i] = R 1[i=j] + (1-R) q_i`` and ``||P_j - P_k||_1 = 2R`` for different
    main classes. ``m_j = K / d`` when K is a multiple of d (the paper does not say how to choose
    m_j); otherwise
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
    r: float = DEFAULTS["r"],
    *,
    seed: int = 0,
    return_targets: bool = False,
) -> list[np.ndarray] | tuple[list[np.ndarray], np.ndarray]:
    """SSFL main-class partition for a target non-IID level R (the SSFL paper's Appendix A.2).

    Builds the expected counts ``A`` of :func:`main_class_targets` and rounds each
    class column with largest-remainder rounding (class counts are conserved).
    With K = d the realised R equals the target up to rounding; with
    ``m_j = m = K/d`` users per main class it is ``R (1 - d m (m-1) / (K (K-1)))``
    because users sharing a main class are at distance 0. Report the
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
