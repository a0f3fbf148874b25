"""Aggregation rules on model states, in pure numpy.

A *state* is a ``dict[str, np.ndarray]`` (e.g. a PyTorch ``state_dict``
converted with ``{k: v.cpu().numpy()}``) or a list/tuple of arrays, as in
Flower's ``ArrayRecord``/``Parameters`` lists. All states given to one call
must have the same keys (or the same length) and matching shapes. A list comes
back as a list and a dict as a dict.

Arithmetic is done in float64 and cast back to each array's dtype. Integer and
bool arrays (BatchNorm's ``num_batches_tracked``) are averaged the same way and
then rounded to the nearest integer, so a counter stays a counter.

Which keys to average (SSFL Sec. 3.3 "Normalization" leaves BN statistics out; Fed-SHVR's BN
statistics are averaged with the weights) is the caller's choice, through ``keys``. Unless a docstring says otherwise,
keys outside ``keys`` are left out of the result of :func:`weighted_mean`, and
copied from the reference state (server or previous global model) by the rules
that have one.

Paper references: Semi-SFL uniform FedAvg of the bottoms (Sec. III, step (5)), SSFL Eqs. 5-7
(Sec. 3.3, 4.2), SCALA size-weighted FedAvg (Eq. 8, Algorithm 1), Fed-SHVR FedNova plus
correction (Sec. III, Algorithm 1, Eqs. 15-16), UM-pFSSL personalised weighting (Sec. 3
"Model Aggregation", Algorithm 1). This module does not import ``flwr`` or torch.
"""
from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

State = Union[Mapping[str, np.ndarray], Sequence[np.ndarray]]

__all__ = [
    "weighted_mean",
    "RunningWeightedMean",
    "RunningFedNova",
    "mean_including_server",
    "grouped_average",
    "contiguous_groups",
    "state_delta",
    "weight_diversity",
    "fednova_aggregate",
    "vr_correction_update",
    "personalized_weighted",
]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _as_dict(state: State) -> dict:
    if isinstance(state, Mapping):
        return {k: np.asarray(v) for k, v in state.items()}
    return {i: np.asarray(v) for i, v in enumerate(state)}


def _like(template: State, values: dict):
    """Return ``values`` in the container type of ``template``."""
    if isinstance(template, Mapping):
        return values
    return [values[i] for i in sorted(values)]


def _select_keys(ref: dict, keys: Optional[Iterable[Hashable]]) -> list:
    if keys is None:
        return list(ref.keys())
    keys = list(keys)
    missing = [k for k in keys if k not in ref]
    if missing:
        raise KeyError(f"keys not in state: {missing[:5]}")
    return keys


def _cast(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Cast a float64 result back to ``like``'s dtype (integers are rounded)."""
    if np.issubdtype(like.dtype, np.floating) or np.issubdtype(like.dtype, np.complexfloating):
        return value.astype(like.dtype, copy=False)
    return np.rint(value).astype(like.dtype)


def _normalise_weights(weights, n: int, name: str = "weights") -> np.ndarray:
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape[0] != n:
        raise ValueError(f"{name}: expected {n} values, got {w.shape[0]}")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"{name} must be finite and >= 0, got {w}")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"{name} must not all be zero")
    return w / total


def _check_shapes(dicts: Sequence[dict], keys: Sequence) -> None:
    for k in keys:
        shape = dicts[0][k].shape
        for d in dicts[1:]:
            if k not in d:
                raise KeyError(f"key {k!r} missing from a state")
            if d[k].shape != shape:
                raise ValueError(f"shape mismatch for {k!r}: {d[k].shape} vs {shape}")


# ---------------------------------------------------------------------------
# FedAvg family
# ---------------------------------------------------------------------------
def weighted_mean(states: Sequence[State], weights=None, keys=None):
    """``w = sum_k a_k w_k / sum_k a_k`` over ``keys`` (default: every key).

    * Semi-SFL bottoms: ``weights=None`` (uniform over the uploading clients: the paper's 1/N
      runs over "all" clients, but only the active ones upload).
    * SCALA client-side models: ``weights = |D_k|`` (SCALA Eq. 8).
    * Parameters only (SSFL with BN, its Sec. 3.3): pass the trainable
      parameter names as ``keys``; BN buffers then stay out.

    ``weights`` must be >= 0 and not all zero. The result holds only the
    selected keys (a dict, or a list in the order of ``keys`` when the states
    are lists). Integer arrays are rounded after averaging. The arithmetic is
    :class:`RunningWeightedMean`'s (float64 sums of ``a_k w_k``, divided by
    ``sum_k a_k`` at the end), so a server that folds each state in as it
    arrives gets the same bits as one that stacks them all.
    """
    if len(states) == 0:
        raise ValueError("need at least one state")
    _normalise_weights(weights, len(states))   # (the checks: count, >= 0, finite, not all 0)
    raw = [1.0] * len(states) if weights is None else [float(x) for x in np.asarray(weights, np.float64).reshape(-1)]
    acc = RunningWeightedMean(keys)
    for state, a in zip(states, raw):
        acc.add(state, a)
    return acc.result()


class RunningWeightedMean:
    """:func:`weighted_mean` folded one state at a time: ``add(state, a_k)`` as each state
    arrives (then the state can be let go), ``result()`` at the end. Holds one float64 sum per
    key, whatever the number of states (a server aggregating thousands of replies holds one
    model's worth, not thousands). ``keys``: which keys (default: every key of the first
    state); every later state must have them, in the same shapes."""

    def __init__(self, keys=None) -> None:
        self.keys = None if keys is None else list(keys)
        self.total = 0.0          # sum_k a_k
        self.count = 0            # states added
        self._sums: dict | None = None
        self._dtypes: dict = {}
        self._mapping = True

    def add(self, state: State, weight: float = 1.0) -> None:
        a = float(weight)
        if not np.isfinite(a) or a < 0:
            raise ValueError(f"weights must be finite and >= 0, got {weight}")
        d = _as_dict(state)
        if self._sums is None:
            self._mapping = isinstance(state, Mapping)
            sel = _select_keys(d, self.keys)
            self.keys = sel
            self._sums = {k: np.zeros(d[k].shape, dtype=np.float64) for k in sel}
            self._dtypes = {k: d[k].dtype for k in sel}
        for k in self.keys:
            if k not in d:
                raise KeyError(f"key {k!r} missing from a state")
            if d[k].shape != self._sums[k].shape:
                raise ValueError(f"shape mismatch for {k!r}: {d[k].shape} vs {self._sums[k].shape}")
        if a != 0.0:
            for k in self.keys:
                self._sums[k] += a * d[k].astype(np.float64, copy=False)
        self.total += a
        self.count += 1

    def result(self):
        """The weighted mean of the states added (a dict, or a list for list states)."""
        if self.count == 0:
            raise ValueError("need at least one state")
        if self.total <= 0:
            raise ValueError("weights must not all be zero")
        out = {k: _cast(self._sums[k] / self.total, np.empty(0, self._dtypes[k])) for k in self.keys}
        return out if self._mapping else [out[k] for k in self.keys]


def personalized_weighted(states: Sequence[State], corr_weights, keys=None):
    """UM-pFSSL personalised aggregation (Sec. 3 "Model Aggregation", Algorithm 1 line 14):

    ``w_k <- sum_{j in H_k} Corr(k|j) w_j / sum_{j in H_k} Corr(k|j)``

    ``states`` are the helper models, self included with its current weights,
    and ``corr_weights`` the matching Corr(k|j) values. Corr is positive by
    construction (Eq. 13: the 1/Hbar term with Hbar clamped >= 1e-3
    plus a non-negative accuracy term). Same output convention as
    :func:`weighted_mean`.
    """
    return weighted_mean(states, corr_weights, keys=keys)


def mean_including_server(server_state: State, client_states: Sequence[State], keys=None):
    """SSFL FedAvg that counts the server as one member (the SSFL paper's Eq. 5):

    ``w_avg = (w_s + sum_{k in C_k} w_k) / (|C_k| + 1)``

    Returns a full state shaped like ``server_state``: the selected ``keys``
    (default: all) are averaged and every other key keeps the server's value
    (e.g. BN statistics from labeled data only, the SSFL paper's Sec. 3.3 "Normalization"). Clients
    should load only ``keys`` from the result.
    """
    server = _as_dict(server_state)
    avg = weighted_mean(
        [server] + [_as_dict(c) for c in client_states], None, keys=_select_keys(server, keys)
    )
    out = {k: v.copy() for k, v in server.items()}
    out.update(avg)
    return _like(server_state, out)


def contiguous_groups(client_ids: Iterable[Hashable], S: int) -> list[list]:
    """Fixed contiguous groups by index (the SSFL paper does not say how groups form; the authors'
    code fixes them by index).

    Sorts ``client_ids`` and cuts them into ``S`` consecutive, nearly equal
    groups (sizes differ by at most one, larger groups first, as
    ``np.array_split``). Call it ONCE with all K user ids and keep the groups
    for the whole run; with partial participation (C_k < K) intersect each
    group with the participants of the period before :func:`grouped_average`.
    If ``S`` exceeds the number of ids, the trailing groups are empty.
    """
    if S < 1:
        raise ValueError(f"S must be >= 1, got {S}")
    ids = sorted(client_ids)
    n = len(ids)
    base, extra = divmod(n, S)
    groups, start = [], 0
    for i in range(S):
        size = base + (1 if i < extra else 0)
        groups.append(ids[start : start + size])
        start += size
    return groups


def grouped_average(server_state: State, client_states, groups: Sequence[Sequence[Hashable]], keys=None):
    """SSFL grouping-based averaging (the SSFL paper's Eq. 6):

    ``w_avg,i = (w_s + sum_{k in G_i} w_k) / (|G_i| + 1)`` and
    ``w_avg = (1/S) sum_i w_avg,i``.

    ``client_states`` is a sequence (then ``groups`` hold positions) or a
    mapping from client id to state (then ``groups`` hold ids, e.g. from
    :func:`contiguous_groups` filtered to the participants). Group G_i receives
    ``w_avg,i`` and the server continues from ``w_avg``.

    An empty group has ``w_avg,i = w_s`` and still counts in the mean over the
    S groups; this matches the authors' code, which keeps one server replica
    per group. Returns ``(server_avg, [w_avg,1, ..., w_avg,S])``, each a full
    state like ``server_state`` where keys outside ``keys`` keep the server's
    value.
    """
    if len(groups) == 0:
        raise ValueError("need at least one group")
    server = _as_dict(server_state)
    sel = _select_keys(server, keys)
    per_group = []
    for g in groups:
        members = [server] + [_as_dict(client_states[k]) for k in g]
        per_group.append(weighted_mean(members, None, keys=sel))
    return combine_groups(server_state, per_group, keys=sel)


def combine_groups(server_state: State, per_group: Sequence[dict], keys=None):
    """The last step of :func:`grouped_average` (Eq. 6), from the group means ``w_avg,i`` (each
    already including the server, e.g. folded reply by reply with
    :class:`RunningWeightedMean`): ``w_avg = (1/S) sum_i w_avg,i`` in float64, cast back, and
    each group's full state. Returns ``(server_avg, [w_avg,1, ..., w_avg,S])``."""
    server = _as_dict(server_state)
    sel = _select_keys(server, keys)
    # Mean of the group averages, done in float64 before casting back.
    server_avg = {k: v.copy() for k, v in server.items()}
    for k in sel:
        acc = np.zeros(server[k].shape, dtype=np.float64)
        for gavg in per_group:
            acc += gavg[k].astype(np.float64, copy=False)
        server_avg[k] = _cast(acc / len(per_group), server[k])
    group_states = []
    for gavg in per_group:
        full = {k: v.copy() for k, v in server.items()}
        full.update(gavg)
        group_states.append(_like(server_state, full))
    return _like(server_state, server_avg), group_states


# ---------------------------------------------------------------------------
# Weight diversity
# ---------------------------------------------------------------------------
def state_delta(new_state: State, old_state: State, keys=None):
    """``new - old`` over ``keys`` (float64), e.g. the update ``u_i = w_i^t - w_avg^{t-T}``."""
    new, old = _as_dict(new_state), _as_dict(old_state)
    sel = _select_keys(new, keys)
    out = {k: new[k].astype(np.float64) - old[k].astype(np.float64) for k in sel}
    if isinstance(new_state, Mapping):
        return out
    return [out[k] for k in sel]


def weight_diversity(updates: Sequence[State], keys=None, *, times_k: bool = False) -> float:
    """SSFL weight diversity (the SSFL paper's Eq. 7, Sec. 4.2):

    ``Delta = sum_i ||u_i||^2 / ||sum_i u_i||^2``

    with update vectors ``u_i = w_i^t - w_avg^{t-T}`` (see :func:`state_delta`),
    flattened over ``keys`` (the paper uses the classifier layer of ResNet-18).
    Identical updates give 1/K; orthogonal updates of equal norm give 1.

    The literal Eq. 7 subtracts the current average, which makes the
    denominator zero; the authors' diversity script uses update vectors and
    reports K times this ratio. Pass ``times_k=True`` for that convention
    (identical updates -> 1, orthogonal equal-norm -> K). Returns ``inf`` when
    the updates cancel exactly and ``nan`` when all are zero.
    """
    if len(updates) == 0:
        raise ValueError("need at least one update")
    dicts = [_as_dict(u) for u in updates]
    _check_shapes(dicts, _select_keys(dicts[0], keys))
    div = RunningDiversity(keys)
    for d in dicts:
        div.add(d)
    return div.result(times_k=times_k)


class RunningDiversity:
    """:func:`weight_diversity` folded one update at a time: ``sum_i ||u_i||^2`` and the running
    ``sum_i u_i`` in float64 (one model's worth, however many updates)."""

    def __init__(self, keys=None) -> None:
        self.keys = None if keys is None else list(keys)
        self.num = 0.0
        self.total: dict | None = None
        self.count = 0

    def add(self, update: State) -> None:
        d = _as_dict(update)
        if self.total is None:
            self.keys = _select_keys(d, self.keys)
            self.total = {k: np.zeros(d[k].shape, dtype=np.float64) for k in self.keys}
        for k in self.keys:
            if d[k].shape != self.total[k].shape:
                raise ValueError(f"shape mismatch for {k!r}: {d[k].shape} vs {self.total[k].shape}")
            v = d[k].astype(np.float64, copy=False)
            self.num += float(np.sum(v * v))
            self.total[k] += v
        self.count += 1

    def result(self, times_k: bool = False) -> float:
        if self.count == 0:
            raise ValueError("need at least one update")
        den = float(sum(np.sum(v * v) for v in self.total.values()))
        if den == 0.0:
            return float("nan") if self.num == 0.0 else float("inf")
        ratio = self.num / den
        return ratio * self.count if times_k else ratio


# ---------------------------------------------------------------------------
# Fed-SHVR: FedNova plus the variance-reduction correction
# ---------------------------------------------------------------------------
def fednova_aggregate(
    global_prev: State,
    client_states: Sequence[State],
    taus,
    omegas,
    keys=None,
    mean_keys=None,
):
    """FedNova normalised averaging (Fed-SHVR Algorithm 1, server step; reconstructed, [D]):

    ``theta^t = theta^{t-1} - tau * sum_k omega_k (theta^{t-1} - theta_k) / tau_k``,
    with ``tau = sum_k omega_k tau_k``.

    ``omegas`` are normalised to sum to one here (callers pass them proportional to
    N_k + M_k, FedNova's default). The same normalised omegas must be used in
    :func:`vr_correction_update` for ``sum_k omega_k d_k = 0`` to hold.
    With equal ``tau_k`` this is the omega-weighted FedAvg.

    Keys:
    * ``keys`` (default: every floating array not in ``mean_keys``) follow the
      FedNova rule.
    * ``mean_keys`` (default: every integer array) get the plain
      omega-weighted mean. Put BN running statistics here
      (average them with the weights); they are not moved by
      SGD steps, so dividing their change by tau_k has no meaning.
    * Any other key keeps ``global_prev``'s value.

    Returns the new global state, shaped like ``global_prev``.
    """
    n = len(client_states)
    if n == 0:
        raise ValueError("need at least one client state")
    t = np.asarray(taus, dtype=np.float64).reshape(-1)
    if t.shape[0] != n or np.any(t <= 0):
        raise ValueError(f"taus must be {n} positive numbers, got {taus}")
    _normalise_weights(omegas, n, "omegas")   # (the checks: count, >= 0, finite, not all 0)
    raw = np.ones(n) if omegas is None else np.asarray(omegas, dtype=np.float64).reshape(-1)
    acc = RunningFedNova(global_prev, keys=keys, mean_keys=mean_keys)
    for state, tau_k, omega_k in zip(client_states, t, raw):
        acc.add(state, float(tau_k), float(omega_k))
    return acc.result()[0]


class RunningFedNova:
    """:func:`fednova_aggregate` folded one client state at a time: ``add(state, tau_k, omega_k)``
    as each arrives, ``result() -> (theta^t, tau)``. Holds float64 sums of
    ``omega_k (theta^{t-1} - theta_k) / tau_k`` (FedNova keys) and ``omega_k theta_k`` (mean keys),
    ``sum omega_k`` and ``sum omega_k tau_k``: with normalised omegas ``w_k`` this is
    ``theta^{t-1} - tau sum_k w_k (theta^{t-1} - theta_k) / tau_k``, ``tau = sum_k w_k tau_k``."""

    def __init__(self, global_prev: State, keys=None, mean_keys=None) -> None:
        self._template = global_prev
        self.prev = _as_dict(global_prev)
        if mean_keys is None:
            self.mean_sel = [k for k, v in self.prev.items() if not np.issubdtype(v.dtype, np.floating)]
        else:
            self.mean_sel = _select_keys(self.prev, mean_keys)
        if keys is None:
            self.nova_sel = [k for k in self.prev if k not in set(self.mean_sel)]
        else:
            self.nova_sel = _select_keys(self.prev, keys)
            overlap = set(self.nova_sel) & set(self.mean_sel)
            if overlap:
                raise ValueError(f"keys and mean_keys overlap: {sorted(overlap)[:5]}")
        self._p = {k: self.prev[k].astype(np.float64) for k in self.nova_sel}
        self._steps = {k: np.zeros_like(self._p[k]) for k in self.nova_sel}
        self._mean = RunningWeightedMean(self.mean_sel) if self.mean_sel else None
        self.omega = 0.0      # sum_k omega_k
        self.tau_sum = 0.0    # sum_k omega_k tau_k
        self.count = 0

    def add(self, state: State, tau: float, omega: float = 1.0) -> None:
        tau, omega = float(tau), float(omega)
        if not tau > 0:
            raise ValueError(f"taus must be positive numbers, got {tau}")
        if not np.isfinite(omega) or omega < 0:
            raise ValueError(f"omegas must be finite and >= 0, got {omega}")
        d = _as_dict(state)
        _check_shapes([self.prev, d], self.nova_sel + list(self.mean_sel))
        c = omega / tau
        for k in self.nova_sel:
            self._steps[k] += c * (self._p[k] - d[k].astype(np.float64, copy=False))
        if self._mean is not None:
            self._mean.add(d, omega)
        self.omega += omega
        self.tau_sum += omega * tau
        self.count += 1

    def result(self):
        """``(theta^t, tau)``, shaped like ``global_prev``; keys outside both sets keep its values."""
        if self.count == 0:
            raise ValueError("need at least one client state")
        if self.omega <= 0:
            raise ValueError("omegas must not all be zero")
        tau = self.tau_sum / self.omega
        out = {k: v.copy() for k, v in self.prev.items()}
        for k in self.nova_sel:
            out[k] = _cast(self._p[k] - tau * (self._steps[k] / self.omega), self.prev[k])
        if self._mean is not None:
            out.update(self._mean.result())
        return _like(self._template, out), tau


def vr_correction_update(
    d_prev: Optional[State],
    global_prev: State,
    client_final: State,
    global_new: State,
    tau_k: float,
    tau: float,
    lr: float,
    keys=None,
):
    """Fed-SHVR client correction (Eq. 15, reconstructed, [D]; VRL-SGD/SCAFFOLD style):

    ``d_k^t = d_k^{t-1} + (1/eta) [ (theta^{t-1} - theta_k^{t-1,tau_k}) / tau_k
                                   - (theta^{t-1} - theta^t) / tau ]``

    * ``global_prev`` = theta^{t-1}, ``client_final`` = this client's upload of
      the previous round, ``global_new`` = theta^t, ``tau`` = sum_k omega_k tau_k
      (as broadcast by the server), ``lr`` = eta.
    * ``d_prev=None`` means d_k^{t-1} = 0 (initialisation, Algorithm 1's input).
    * The local step is then ``theta <- theta - eta (g - d_k)``.

    With the server rule of :func:`fednova_aggregate` (same normalised omegas
    and same keys), ``sum_k omega_k d_k^t = 0`` holds to float precision
    (checked in the tests). ``keys`` defaults to the keys of ``d_prev``, or to every floating
    array of ``global_prev`` when ``d_prev`` is None (pass the FedNova keys to
    leave BN buffers out). Returns float64 arrays, in the container type of
    ``global_prev``.
    """
    if tau_k <= 0 or tau <= 0 or lr <= 0:
        raise ValueError("tau_k, tau and lr must be > 0")
    prev, fin, new = _as_dict(global_prev), _as_dict(client_final), _as_dict(global_new)
    dp = _as_dict(d_prev) if d_prev is not None else None
    if keys is not None:
        sel = list(keys)
    elif dp is not None:
        sel = list(dp.keys())
    else:
        sel = [k for k, v in prev.items() if np.issubdtype(v.dtype, np.floating)]
    out = {}
    for k in sel:
        p = prev[k].astype(np.float64)
        corr = ((p - fin[k].astype(np.float64)) / tau_k - (p - new[k].astype(np.float64)) / tau) / lr
        base = dp[k].astype(np.float64) if dp is not None else 0.0
        out[k] = base + corr
    if isinstance(global_prev, Mapping):
        return out
    return [out[k] for k in sel]
