"""Class-imbalance-aware client sampling (Fed-CBS): the QCID measure and the sequential sampling
probabilities, as pure numpy functions of the clients' label histograms, and the one client choice
built on them (:func:`choose_balanced`: ``strategies/scala/fedcbs.py`` and SCALA's CS-SFL in
``strategies/scala/scala.py`` sample with it; ``docs/baselines.md`` B3).

Notation: ``counts[n]`` is client n's label histogram (``n_n * alpha_n``: M non-negative
counts), ``S`` a set of clients.

* QCID (quadratic class-imbalance degree) of a set: the squared distance of the pooled label
  distribution from the uniform one,
  ``QCID(S) = sum_b (sum_{n in S} n_n alpha_{n,b} / sum_{n in S} n_n - 1/M)^2``
  (:func:`qcid`), equivalently ``sum_{n,m in S} n_n n_m <alpha_n, alpha_m> / (sum n_n)^2 - 1/M``
  (:func:`qcid_inner`: only inner products of the alphas, what the paper computes under
  homomorphic encryption).
* The m clients of a round are drawn one after another (:func:`cbs_step_probabilities`),
  already chosen clients excluded (our choice; the third-party code does not exclude them):

  1. ``P_1(n) ~ 1/QCID({n}) + lambda sqrt(3 ln(t+1) / (2 T_n))`` (UCB exploration; ``T_n`` is
     1 + the times n was selected before, ``t`` the 0-based round index);
  2. ``P_2(n) ~ QCID({c_1, n})^-2 / P_1(n)``;
  3. ``P_k(n) ~ QCID(S_{k-1})^(k-1) / QCID(S_{k-1} + {n})^k`` for k >= 3 (beta_k = k).

  The product of the steps telescopes to about ``QCID(S)^-m``: balanced sets are likely.
  QCID is floored at :data:`QCID_FLOOR` (a perfectly balanced set has QCID 0), and the powers
  are taken in log space (``QCID^-k`` of a large round would overflow).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

#: the least QCID used in the probabilities (a balanced set has QCID 0); the [T] code's bound
QCID_FLOOR = 1e-20


def _counts(counts: np.ndarray) -> np.ndarray:
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2 or c.shape[1] == 0:
        raise ValueError(f"counts must be [clients, classes], got shape {c.shape}")
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    return c


def qcid(counts: np.ndarray, members: Sequence[int] | None = None) -> float:
    """QCID of the set ``members`` (default: all rows) from the label histograms ``counts``
    ``[N, M]``: ``sum_b (pooled share of class b - 1/M)^2``. A set without examples is a
    ``ValueError``."""
    c = _counts(counts)
    pooled = c[list(members)].sum(0) if members is not None else c.sum(0)
    total = pooled.sum()
    if total <= 0:
        raise ValueError("QCID of a set without examples is undefined")
    return float(((pooled / total - 1.0 / c.shape[1]) ** 2).sum())


def qcid_inner(sizes: Sequence[float], alphas: np.ndarray) -> float:
    """QCID from sizes ``n_n`` and class proportions ``alpha_n`` ``[S, M]`` by the inner-product
    form ``sum_{n,m} n_n n_m <alpha_n, alpha_m> / (sum n_n)^2 - 1/M``."""
    n = np.asarray(sizes, dtype=np.float64)
    a = np.asarray(alphas, dtype=np.float64)
    return float(n @ (a @ a.T) @ n / n.sum() ** 2 - 1.0 / a.shape[1])


def _log_q_with_each(c: np.ndarray, members: list[int]) -> np.ndarray:
    """``log max(QCID(members + {n}), floor)`` for every client n at once ``[N]`` (pooled counts)."""
    pooled = c[members].sum(0) + c
    q = ((pooled / pooled.sum(1, keepdims=True) - 1.0 / c.shape[1]) ** 2).sum(1)
    return np.log(np.maximum(q, QCID_FLOOR))


def first_scores(counts: np.ndarray, t: int, selections: Sequence[float], lam: float) -> np.ndarray:
    """Step 1's unnormalised scores ``1/QCID({n}) + lam sqrt(3 ln(t+1) / (2 T_n))``."""
    c = _counts(counts)
    T = np.asarray(selections, dtype=np.float64)
    if T.shape != (len(c),) or (T < 1).any():
        raise ValueError("selections T_n: one value >= 1 per client")
    return np.exp(-_log_q_with_each(c, [])) + lam * np.sqrt(3.0 * np.log(t + 1.0) / (2.0 * T))


def _normalised(log_scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    out = np.zeros(len(log_scores))
    z = log_scores[allowed]
    w = np.exp(z - z.max())
    out[allowed] = w / w.sum()
    return out


def cbs_step_probabilities(counts: np.ndarray, chosen: Sequence[int], t: int, selections: Sequence[float],
                           lam: float) -> np.ndarray:
    """The probability of each client ``[N]`` to be the next one, given the clients ``chosen``
    so far (step ``len(chosen) + 1``; zero for the chosen ones). Every client needs examples
    (a non-zero histogram). ``t``: 0-based round index; ``selections``: ``T_n >= 1``."""
    c = _counts(counts)
    chosen = [int(i) for i in chosen]
    N = len(c)
    if len(chosen) >= N:
        raise ValueError(f"all {N} clients are chosen already")
    if (c.sum(1) <= 0).any():
        raise ValueError("every client needs examples (a non-zero histogram)")
    allowed = np.ones(N, dtype=bool)
    allowed[chosen] = False
    k = len(chosen) + 1
    if k == 1:
        return _normalised(np.log(first_scores(c, t, selections, lam)), allowed)
    if k == 2:
        log_s = -2.0 * _log_q_with_each(c, chosen) - np.log(first_scores(c, t, selections, lam))
    else:
        old = (k - 1) * np.log(max(qcid(c, chosen), QCID_FLOOR))
        log_s = old - k * _log_q_with_each(c, chosen)
    return _normalised(log_s, allowed)


def cbs_sample(counts: np.ndarray, m: int, t: int, selections: Sequence[float], lam: float,
               rng: np.random.Generator) -> list[int]:
    """``m`` distinct clients (row indices of ``counts``, in the order drawn) by the sequential
    Fed-CBS probabilities, drawn with ``rng``."""
    c = _counts(counts)
    if not 0 <= m <= len(c):
        raise ValueError(f"cannot choose {m} of {len(c)} clients")
    chosen: list[int] = []
    for _ in range(m):
        p = cbs_step_probabilities(c, chosen, t, selections, lam)
        chosen.append(int(rng.choice(len(c), p=p)))
    return chosen


def balanced_sample(counts: np.ndarray, m: int, t: int, selections: Sequence[float], lam: float,
                    rng: np.random.Generator, rule: str = "cbs") -> list[int]:
    """``m`` distinct clients (row indices of ``counts``, in the order chosen): ``cbs`` draws them
    by the sequential Fed-CBS probabilities (:func:`cbs_sample`); ``greedy`` takes the first
    pick's most probable client (its UCB score) and then each time the client that minimises the
    QCID of the set so far plus it (ties: row order)."""
    if rule == "cbs":
        return cbs_sample(counts, m, t, selections, lam, rng)
    if rule != "greedy":
        raise ValueError(f"rule must be 'cbs' or 'greedy', got {rule!r}")
    c = _counts(counts)
    idx: list[int] = []
    for _ in range(m):
        if idx:
            free = [i for i in range(len(c)) if i not in idx]
            idx.append(min(free, key=lambda i: (qcid(c, idx + [i]), i)))
        else:
            idx.append(int(np.argmax(cbs_step_probabilities(c, [], t, selections, lam))))
    return idx


def choose_balanced(pool: Sequence[Any], rest: Sequence[Any], k: int, counts_of: Callable[[Any], np.ndarray],
                    t: int, selections: Sequence[float], lam: float, rng: np.random.Generator,
                    rule: str = "cbs") -> tuple[list[Any], float | None]:
    """The one Fed-CBS client choice of the library (Fed-CBS's sampling, SCALA's CS-SFL): ``k``
    of ``pool`` (the clients with a label histogram ``counts_of(client)``, in partition order;
    ``selections``: their ``T_n``) by :func:`balanced_sample`. Fewer than ``k`` in ``pool``: all
    of them and the rest uniformly from ``rest`` (seeded by ``rng``). Returns the chosen clients
    and the QCID of their pooled histograms (``None`` when ``pool`` was short)."""
    if len(pool) < k:
        extra = rng.choice(len(rest), size=k - len(pool), replace=False)
        return list(pool) + [rest[i] for i in sorted(extra)], None
    counts = np.stack([np.asarray(counts_of(n), dtype=np.float64) for n in pool])
    idx = balanced_sample(counts, k, t, selections, lam, rng, rule)
    return [pool[i] for i in idx], qcid(counts, idx)


def count_selections(selections: dict[int, int], chosen: Sequence[int], partition_of: dict[int, int]) -> None:
    """Add one to ``selections[partition]`` (a client's past selections, ``T_n - 1``) for every
    chosen node with a known partition."""
    for n in chosen:
        if n in partition_of:
            selections[partition_of[n]] = selections.get(partition_of[n], 0) + 1
