"""UM-pFSSL's helper selection, plain torch (the paper's Sec. 4.2 and Algorithm 2): score models on
one client's data (MC-dropout Corr, :class:`HelperScorer`), swap candidates into the helper list
(:func:`replace_helpers`), pick the members to refresh (:func:`refresh_ids`), and the paper's
transfer count (:func:`cost2`). The Flower side (pool, messages, node state) is
:mod:`strategies.umpfssl.umpfssl`.

A member or candidate is ``(id, version, corr)``.
"""
from __future__ import annotations

from typing import Any

import torch

from tasks.env import Env
from tasks.mc_dropout import mc_dropout_predict, relation_score
from tasks.training import derive_seed, seeded

__all__ = ["HelperScorer", "replace_helpers", "refresh_ids", "cost2"]

Member = tuple[int, int, float]


def _tensors(env: Env, data) -> tuple[torch.Tensor, torch.Tensor]:
    x = env.augmenter.test(torch.from_numpy(data.x).to(env.device))
    return x, torch.from_numpy(data.y).to(env.device)


class HelperScorer:
    """MC-dropout predictions and Corr of models on one client's data (``mu`` = its labeled
    fraction): ``mc_samples`` passes, entropies clamped at ``entropy_floor``; each
    prediction's dropout masks are seeded by ``(seed, tag)``."""

    def __init__(self, env: Env, *, mc_samples: int, entropy_floor: float, seed: int) -> None:
        self.env, self.mc_samples, self.entropy_floor, self.seed = env, mc_samples, entropy_floor, seed
        lab, unl = env.labeled(), env.unlabeled()
        self.mu = len(lab) / max(len(lab) + len(unl), 1)
        self.xl, self.yl = _tensors(env, lab)
        self.xu, self.yu = _tensors(env, unl)

    def predict(self, model: torch.nn.Module, x: torch.Tensor, tag: Any):
        if x.shape[0] == 0:
            return None, None
        with seeded(derive_seed(self.seed, "mc", tag), self.env.device), torch.no_grad():   # dropout masks
            return mc_dropout_predict(model, x, self.mc_samples, batch_size=500)

    def score(self, model: torch.nn.Module, tag: Any) -> tuple[float, Any, Any]:
        """``(Corr, MC mean on D_u, MC entropies on D_u)`` of ``model``."""
        pu, hu = self.predict(model, self.xu, ("u", tag))
        pl, _ = self.predict(model, self.xl, ("l", tag))
        corr = relation_score(self.mu, hu, pl, self.yl, self.env.num_classes, self.entropy_floor)
        return corr, pu, hu


def replace_helpers(members: list[Member], candidates: list[Member], R: int) -> tuple[list[Member], int]:
    """REPLACEHELPER (Alg. 2) with a greedy matching (our choice; the paper does not say how
    candidates are paired with the members they replace): best candidate vs worst member.

    ``members``: non-self ``(id, version, corr)``; ``candidates`` likewise. Re = the R members
    with the lowest Corr; candidates sorted by Corr descending are paired with Re sorted
    ascending, and a pair swaps while the candidate's Corr is strictly higher. Returns the new
    member list (order kept, swapped-in candidates take the slot) and the number of swaps.
    """
    if R <= 0 or not candidates or not members:
        return list(members), 0
    order = sorted(range(len(members)), key=lambda i: (members[i][2], i))[:R]     # worst first
    cands = sorted(candidates, key=lambda c: (-c[2], c[0]))                      # best first
    out, swaps = list(members), 0
    for slot, cand in zip(order, cands):
        if cand[2] > out[slot][2]:
            out[slot] = cand
            swaps += 1
        else:
            break  # later candidates are worse and later members better: no further swap
    return out, swaps


def refresh_ids(members: list[Member], latest: dict[int, int], R: int) -> list[int]:
    """UPDATEHELPER (Alg. 2): ids of non-self members outside the R lowest Corr whose pool
    version is newer than the cached one (self is always current: see :mod:`strategies.umpfssl.umpfssl`)."""
    lowest = set(sorted(range(len(members)), key=lambda i: (members[i][2], i))[:R])
    return [m[0] for i, m in enumerate(members) if i not in lowest and latest.get(m[0], m[1]) > m[1]]


def cost2(M: int, n: int, nu: int, F: int, R: int, k_bar: float) -> float:
    """Eq. 27 in model transfers: ``(M n / nu + n + F R) K_bar``."""
    return (M * n / nu + n + F * R) * k_bar
