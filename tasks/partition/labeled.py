"""Labeled / unlabeled constructions: server labels, Dir_2 labeled ratios, Fed-SHVR class mismatch, matched test splits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def server_labeled_split(
    labels: np.ndarray, num_server: int, *, num_classes: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Class-balanced server-labeled set: ``N_s / C`` samples of every class.

    The SSFL paper's Sec. 3.1 ("N_s samples" read as N_s/d per class, as the authors' code) and
    Semi-SFL's Sec. V-A.
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
    parts: Sequence[np.ndarray], beta: float = DEFAULTS["labeled_alpha"], *, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Per-client labeled ratio from ``(p_s, p_u) ~ Dir_2(beta)`` (UM-pFSSL Sec. 6.1).

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
    mismatch_ratio: float = DEFAULTS["mismatch_ratio"],
    labeled_per_client: int = DEFAULTS["labeled_per_client"],
    labeled_classes_per_client: int = DEFAULTS["labeled_classes_per_client"],
    size_alpha: float | None = DEFAULTS["alpha"],
    size_floor_fraction: float = 0.4,
    min_size: int = 1,
    unlabeled_total: int | None = None,
    num_classes: int | None = None,
    seed: int = 0,
) -> MismatchSplit:
    """Fed-SHVR labeled/unlabeled class-distribution mismatch (the Fed-SHVR paper's Sec. V;
    the library's choices where it is silent: ``docs/fedshvr.md``).

    * **Labeled.** Client k gets ``labeled_per_client`` samples from the L =
      ``labeled_classes_per_client`` classes ``{k, k+1, ..., k+L-1} mod C`` (our choice: the paper
      names only how many classes),
      balanced (``labeled_per_client / L`` each; a remainder goes to the first classes).
    * **Unlabeled sizes.** ``M_k = f + (M - K f) w_k`` with ``w ~ Dir_K(size_alpha)``
      and a floor ``f = max(min_size, floor(size_floor_fraction * M / K))`` ([ours]: the paper's
      Dir(0.025) sizes would leave some clients almost empty);
      ``size_alpha=None`` gives equal sizes. M is the whole remaining pool unless
      ``unlabeled_total`` is given.
    * **Mismatch.** A fraction r of client k's unlabeled data comes from classes
      absent from its labeled set and ``1 - r`` from its labeled classes (the paper's Sec. V). Within
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
    """Per-client test split sharing each client's label distribution (UM-pFSSL Sec. 6.1).

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
