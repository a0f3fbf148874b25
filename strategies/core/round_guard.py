"""What the base strategy refuses beyond a message's form (:class:`RoundGuard`).

* A full-model upload further than ``upload-norm-bound`` (L2, over the float entries) from the
  model the server holds when the reply arrives is refused and its node dropped from the round
  (off by default: algorithms whose nodes train far from the global model, e.g. personalised
  ones, need a bound of their own scale).
* A round whose global model's test loss (``loss``, where the server evaluates) is NaN or
  infinite, whose ``train-loss`` is infinite (a NaN one is taken as not measured: no reply
  reported one), or either more than ``loss-bound`` times ``max(ln C, that loss's median
  over the run's earlier applied rounds)`` (``ln C``: the cross-entropy of a uniform guess over
  ``C`` classes; a ``train-loss``, whose scale is the algorithm's own, only once the run has
  one), diverged: the strategy's state is
  rolled back to the start of the round (its :meth:`~strategies.core.round_loop.RoundLoopStrategy.state_dict`,
  the state a checkpoint holds), the round is reported as ``diverged`` and ``skipped`` with a
  logged warning, and the result the run saves is the model from before it. State a node keeps
  itself (e.g. a personalised model on the node) is not rolled back. A full-model algorithm's
  ``train-loss`` is what the nodes report: a node that reports a huge loss has its round
  rolled back (a denial of that round, not a poisoning of the model).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.common import log

from .records import ARRAYS_KEY, record_to_numpy

__all__ = ["RoundGuard", "update_norm"]


def update_norm(upload: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> float:
    """L2 norm of ``upload - reference`` over the float entries both hold with the same shape."""
    total = 0.0
    for k, v in upload.items():
        ref = reference.get(k)
        a = np.asarray(v)
        if ref is None or not np.issubdtype(a.dtype, np.floating) or a.shape != np.shape(ref):
            continue
        d = a.astype(np.float64) - np.asarray(ref, dtype=np.float64)
        total += float(np.sum(d * d))
    return float(np.sqrt(total))


class RoundGuard:
    """The upload bound and the divergence check of one strategy's run."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.losses: dict[str, list[float]] = {}   # metric -> its values in the applied rounds
        self.diverged: list[int] = []     # rounds rolled back
        self._reference: dict[str, np.ndarray] | None = None

    # ------------------------------------------------------------------ uploads
    def begin_exchange(self) -> None:
        self._reference = None

    def refused_upload(self, reply: Message) -> str | None:
        """Why a train reply's model is refused (``upload-norm-bound``), or ``None``."""
        limit = self.strategy.policy.upload_norm_bound
        if limit <= 0 or ARRAYS_KEY not in reply.content.array_records or self.strategy.model is None:
            return None
        if self._reference is None:
            self._reference = {k: v.detach().cpu().numpy() for k, v in self.strategy.model.state_dict().items()}
        d = update_norm(record_to_numpy(reply.content.array_records[ARRAYS_KEY]), self._reference)
        if d > limit:
            return (f"uploaded model: its distance from the server's model, {d:.4g}, is more than "
                    f"upload-norm-bound={limit:g}; refused, not applied")
        return None

    # ------------------------------------------------------------------ divergence
    def snapshot(self) -> dict[str, Any]:
        """The strategy's state at a round's start (its ``state_dict``, the algorithm's extra state
        copied, so that a round that changes it in place cannot change the snapshot)."""
        state = self.strategy.state_dict()
        state["extra"] = copy.deepcopy(state.get("extra", {}))
        return state

    def bound(self, key: str) -> float:
        """The largest value of metric ``key`` a round may report (``inf`` with ``loss-bound=0``).
        The test loss is a cross-entropy, held to ``ln C`` from the first round; an algorithm's
        ``train-loss`` may have a scale of its own (regularisers, several terms), so it has no
        bound before the run's first applied round. A divergence detector, not a quality filter:
        an honest round's test loss was measured up to 71 ln C (FedMatch, a user's small model,
        ``tests/test_api.py``), hence the default ``loss-bound`` of 10,000."""
        factor = self.strategy.policy.loss_bound
        seen = self.losses.get(key, [])
        if factor <= 0 or (key != "loss" and not seen):
            return math.inf
        chance = math.log(max(int(getattr(self.strategy.env, "num_classes", 2) or 2), 2))
        return factor * max(chance, float(np.median(seen)) if seen else 0.0)

    def check(self, server_round: int, metrics: dict[str, Any], before: dict[str, Any], key: str) -> bool:
        """After round ``server_round``: whether its loss ``metrics[key]`` diverged, in which case
        the strategy is rolled back to ``before`` (the round start's ``state_dict``) and the
        round marked ``diverged``; else the loss joins the run's history."""
        if key not in metrics or metrics.get("skipped") or server_round in self.diverged:
            return False
        loss = float(metrics[key])
        if math.isnan(loss) and key == "train-loss":   # not measured (no reply reported one); a model
            return False                               # gone NaN shows in the test loss
        limit = self.bound(key)
        if math.isfinite(loss) and loss <= limit:
            self.losses.setdefault(key, []).append(loss)
            return False
        s = self.strategy
        sim = s.clock.total if s.clock is not None else None
        s.load_state_dict(before)
        if sim is not None:   # (the round's simulated time was spent all the same)
            s.clock.total = sim
        self.diverged.append(server_round)
        metrics.update({"diverged": 1, "skipped": 1})
        log(WARNING, "round %s diverged (%s %.4g, bound %.4g: loss-bound=%g x max(ln classes, the median of earlier "
                     "rounds)); it is not applied: the model is the one from before it", server_round, key, loss,
            limit, s.policy.loss_bound)
        return True
