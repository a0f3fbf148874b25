"""Loss functions shared by the five algorithms.

Each loss that more than one algorithm uses is written here once. The docstrings give the
formula and the paper (section, equation) it comes from. Tags: [S] the paper says it, [C] the
authors' code, [D] derived (reconstructed) by us, [ours] the library's choice where the
paper is silent (the algorithm's page in ``docs/`` lists these choices).

Everything is plain PyTorch and device agnostic: new tensors are created on the
device and with the dtype of the inputs, so CUDA tensors work as well. This
module does not import ``flwr``. The other shared building blocks have a module each:
:mod:`tasks.queue` (Semi-SFL's feature queue), :mod:`tasks.ema` (EMA teacher),
:mod:`tasks.mc_dropout`, :mod:`tasks.schedules`.

Conventions
-----------
* ``logits`` are ``[N, C]`` raw scores and ``probs`` are ``[N, C]`` rows on the
  simplex. "Batch mean" means the sum over samples divided by ``N``.
* Pseudo-labels and soft targets are constants: every loss here detaches its
  target argument.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "entropy",
    "masked_pseudo_label_ce",
    "soft_ce",
    "kl_to_target",
    "sharpen",
    "closed_form_soft_label",
    "kl_to_uniform",
    "logit_adjusted_ce",
    "supcon_loss",
    "supervised_contrastive",
    "clustering_regularization",
    "proximal_term",
]


def proximal_term(model: torch.nn.Module, mu: float):
    """FedProx's proximal term (Li et al., MLSys 2020, Eq. 2): a function that returns
    ``mu/2 * ||w - w_start||^2`` over ``model``'s parameters, ``w_start`` being the
    parameters when this is called (the global model the round starts from). A client adds
    it to its local loss (``regularizer=`` of :func:`tasks.training.train_supervised` and
    :func:`tasks.training.train_fixmatch`); its gradient is ``mu (w - w_start)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]

    def term() -> Tensor:
        return 0.5 * float(mu) * sum(((p - s) ** 2).sum() for p, s in zip(params, start))
    return term


def calibrated_ce(logits: Tensor, y: Tensor, counts: Tensor, tau: float = 1.0) -> Tensor:
    """FedLC's calibrated cross-entropy (Zhang et al., ICML 2022, Eq. 8): the softmax
    cross-entropy of ``f_c(x) - tau * n_c^(-1/4)``, ``n_c`` being this client's count of class
    ``c`` (``counts``, clamped at 1e-8 so that a class the client lacks gets an offset of
    ``-100 tau`` and drops out). The paper's denominator leaves ``y`` out; like FL-bench (which
    found that variant collapse) the denominator here includes it, a standard softmax over the
    calibrated logits (FL-bench ``src/client/fedlc.py``; ``docs/baselines.md`` B2). Rare classes are pushed down
    more during training, which enforces a larger margin for them; inference uses raw logits."""
    offset = float(tau) * counts.to(logits.device, logits.dtype).clamp_min(1e-8).pow(-0.25)
    return F.cross_entropy(logits - offset, y)


def _reduce(values: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    if reduction == "none":
        return values
    raise ValueError(f"unknown reduction {reduction!r} (use 'mean', 'sum' or 'none')")


# ---------------------------------------------------------------------------
# Entropy
# ---------------------------------------------------------------------------
def entropy(probs: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy in nats, ``H(p) = -sum_c p_c log p_c``, with ``0 log 0 = 0``.

    Used for the MC-dropout predictive entropy (UM-pFSSL Sec. 4.1, Eq. 10). Returns
    one value per row (``dim`` is reduced).
    """
    return -torch.special.xlogy(probs, probs).sum(dim=dim)


# ---------------------------------------------------------------------------
# Confidence-thresholded hard pseudo-labels
# ---------------------------------------------------------------------------
def masked_pseudo_label_ce(
    logits_strong: Tensor, probs_weak: Tensor, tau: float, *, strict: bool = False
) -> tuple[Tensor, Tensor]:
    """FixMatch-style thresholded pseudo-label loss.

    ``L = (1/N) * sum_i 1[max_c p_ic >= tau] * CE(argmax_c p_ic, logits_strong_i)``

    * SSFL CRL, Eq. 4 (the SSFL paper's Sec. 3.3): ``p`` is the same model's softmax
      on the weak view and ``tau = 0.95``. Self-training (Eq. 3) is the same
      call with the weak-view logits in place of ``logits_strong``.
    * Semi-SFL H_u, Eq. 1 (the Semi-SFL paper's Sec. III): ``p`` is the EMA teacher's softmax on
      the weak view. The paper writes ``c_j > tau``; pass ``strict=True``.
      The two differ only when a confidence equals ``tau`` exactly.
    * The Fed-Pseudo baseline (Fed-SHVR's Sec. V: pseudo-labelling with FedAvg) has no
      threshold: use ``tau=0``.

    The denominator is the FULL batch size ``N``: masked samples count as zeros
    [C], so the loss scale follows the mask rate. ``probs_weak`` is detached.

    Returns ``(loss, mask)``. ``mask`` is a float ``[N]`` tensor of 0/1 values,
    so ``mask.mean()`` is the mask rate.
    """
    if logits_strong.ndim != 2 or probs_weak.shape != logits_strong.shape:
        raise ValueError(
            f"expected [N, C] logits and probs of the same shape, got "
            f"{tuple(logits_strong.shape)} and {tuple(probs_weak.shape)}"
        )
    probs_weak = probs_weak.detach()
    conf, pseudo = probs_weak.max(dim=1)
    keep = conf > tau if strict else conf >= tau
    mask = keep.to(logits_strong.dtype)
    n = logits_strong.shape[0]
    if n == 0:
        return logits_strong.sum() * 0.0, mask
    per_sample = F.cross_entropy(logits_strong, pseudo, reduction="none")
    loss = (per_sample * mask).sum() / n
    return loss, mask


# ---------------------------------------------------------------------------
# Soft targets
# ---------------------------------------------------------------------------
def soft_ce(logits: Tensor, target_probs: Tensor, reduction: str = "mean") -> Tensor:
    """Soft-target cross-entropy ``CE(v, f) = -sum_c v_c log softmax(s)_c``.

    Fed-SHVR's ``alpha0 * CE(v, f(u))`` term (its problem (5), Sec. II-III) uses it
    with the closed-form soft label ``v``. The target is detached. The default
    reduction is the batch mean.
    """
    target = target_probs.detach()
    values = -(target * F.log_softmax(logits, dim=-1)).sum(dim=-1)
    return _reduce(values, reduction)


def kl_to_target(logits: Tensor, target_probs: Tensor, reduction: str = "mean") -> Tensor:
    """``KL(t || softmax(s)) = sum_c t_c (log t_c - log softmax(s)_c)``.

    UM-pFSSL L^u (its Sec. 3, Eq. 5): distillation towards the soft MC-mean
    pseudo-label of the least uncertain helper. The target is the first (our choice: the
    paper writes KL(f, yhat) but calls it distillation, which takes the target first)
    argument of the KL, so this equals :func:`soft_ce` minus the target's
    entropy (a constant), and the gradients are identical. The target is
    detached and ``0 log 0 = 0``. The default reduction is the batch mean
    (PyTorch's ``"batchmean"``).
    """
    target = target_probs.detach()
    values = (
        torch.special.xlogy(target, target) - target * F.log_softmax(logits, dim=-1)
    ).sum(dim=-1)
    return _reduce(values, reduction)


def sharpen(
    probs: Tensor, temperature: float, *, dim: int = -1, from_logits: bool = False
) -> Tensor:
    """MixMatch sharpening ``v_c = p_c^(1/T) / sum_s p_s^(1/T)``, computed in log space.

    ``log v = log p / T - logsumexp(log p / T)``. Pass ``from_logits=True`` to
    give logits ``s`` instead; then ``log p = log_softmax(s)``, which is exact
    even where ``softmax(s)`` underflows.

    Limits:
    * ``T -> 0`` (``temperature == 0``): one-hot of the argmax. Ties go to the
      first maximum, as in ``argmax``.
    * ``T -> inf`` (``temperature == math.inf``): uniform.
    * ``T = 1`` returns ``p`` (renormalised).

    A class with ``p_c = 0`` stays at zero for every finite ``T``.
    The result is detached: sharpened labels are targets.
    """
    if temperature < 0 or math.isnan(temperature):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    probs = probs.detach()
    log_p = F.log_softmax(probs, dim=dim) if from_logits else torch.log(probs)
    if temperature == 0:
        idx = log_p.argmax(dim=dim, keepdim=True)
        return torch.zeros_like(log_p).scatter_(dim, idx, 1.0)
    if math.isinf(temperature):
        return torch.full_like(log_p, 1.0 / log_p.shape[dim])
    return torch.softmax(log_p / temperature, dim=dim)


def closed_form_soft_label(
    p: Tensor, alpha0: float, alpha1: float, *, from_logits: bool = False
) -> Tensor:
    """Fed-SHVR Lemma 1 (its Sec. III, Eq. 8; reconstructed, [D]): the minimiser over the simplex of

    ``alpha0 * CE(v, p) + alpha1 * KL(v || u)``,  ``u = (1/C, ..., 1/C)``,

    which is ``v_j = p_j^(alpha0/alpha1) / sum_s p_s^(alpha0/alpha1)``, i.e.
    :func:`sharpen` at ``T = alpha1/alpha0``.

    Limits (the objective is linear, respectively strictly convex, in v):
    * ``alpha0 == 0`` (the start of the alpha0 ramp): only the KL term is
      left, so ``v = u`` (uniform), whatever ``alpha1 > 0`` is.
    * ``alpha1 == 0`` (Fed-Pseudo, the centralised block coordinate descent
      step of Fed-SHVR's Sec. II): ``v`` is one-hot at ``argmax p``.
    * both zero: undefined; we return the one-hot (the plain pseudo-label).

    The tests check this against a numerical minimisation over the simplex.
    """
    if alpha0 < 0 or alpha1 < 0:
        raise ValueError(f"alpha0 and alpha1 must be >= 0, got {alpha0}, {alpha1}")
    if alpha1 == 0:
        return sharpen(p, 0.0, from_logits=from_logits)
    if alpha0 == 0:
        return sharpen(p, math.inf, from_logits=from_logits)
    return sharpen(p, alpha1 / alpha0, from_logits=from_logits)


def kl_to_uniform(logits: Tensor, reduction: str = "mean") -> Tensor:
    """``KL(softmax(s) || u) = sum_c p_c log(C p_c) = log C - H(p)``.

    Fed-SHVR r2 (its Sec. II, the confidence penalty; the form [D]), added with ``+alpha2`` on the unlabeled
    inputs: the confidence penalty ``-H(p)`` plus the constant ``log C``.
    Computed from ``log_softmax`` so that it is stable for large logits.
    The default reduction is the batch mean.
    """
    log_p = F.log_softmax(logits, dim=-1)
    values = (log_p.exp() * log_p).sum(dim=-1) + math.log(logits.shape[-1])
    return _reduce(values, reduction)


# ---------------------------------------------------------------------------
# Logit adjustment
# ---------------------------------------------------------------------------
def logit_adjusted_ce(
    logits: Tensor,
    y: Tensor,
    prior,
    reduction: str = "mean",
    *,
    min_prior: float = 1e-8,
) -> Tensor:
    """SCALA's ``g_bal(y, s; P) = CE(s + log P, y)`` (its Sec. 3.3, Eqs. 12-13).

    ``-log[ exp(s_y + log P_y) / sum_y' exp(s_y' + log P_y') ]``; its gradient
    with respect to ``s`` is ``softmax(s + log P) - onehot(y)``.

    ``prior`` is ``[C]`` (one prior for the whole batch, e.g. P_s on the server)
    or ``[N, C]`` (one prior per row, e.g. row n of a concatenated batch uses the
    P_k of the client that sent it; with ``reduction="none"`` the per-client
    means of Eq. 13 follow by summing rows). It may be a tensor, numpy array or
    sequence, and need not be normalised: a constant factor cancels in the
    softmax. ``P`` is clamped to ``>= min_prior`` (1e-8) before the log, so
    an absent class drops out of the softmax. Predict with the raw logits.
    """
    prior_t = torch.as_tensor(prior, dtype=logits.dtype, device=logits.device)
    if prior_t.shape not in (logits.shape[-1:], logits.shape):
        raise ValueError(
            f"prior must have shape [C] or [N, C] matching logits {tuple(logits.shape)}, "
            f"got {tuple(prior_t.shape)}"
        )
    adjusted = logits + torch.log(prior_t.clamp_min(min_prior))
    return F.cross_entropy(adjusted, y, reduction=reduction)


# ---------------------------------------------------------------------------
# Supervised contrastive loss with a memory queue (Semi-SFL T and C)
# ---------------------------------------------------------------------------
def supcon_loss(
    z_anchor: Tensor,
    y_anchor: Tensor,
    z_ref: Optional[Tensor] = None,
    y_ref: Optional[Tensor] = None,
    ref_positive_mask: Optional[Tensor] = None,
    *,
    kappa: float = 0.07,
    batch_as_reference: bool = True,
    normalize: bool = True,
    return_mask: bool = False,
    reduction: str = "positives",
):
    """Supervised contrastive loss with a constant reference memory.

    For every anchor j (Semi-SFL Sec. III, Eqs. 3 and 5)::

        L_j = -(1/|P(j)|) * sum_{p in P(j)} log[ exp(z_j.z_p/kappa) / sum_{a in A(j)} exp(z_j.z_a/kappa) ]

    The reference set is made of
    * the current batch ``z_anchor`` itself if ``batch_as_reference`` (every
      anchor except j: "A(j) is every reference except j"). These references
      carry gradients, as in SupCon. They are always eligible as positives;
    * the memory entries ``z_ref`` (a queue). They are detached constants.
      ``ref_positive_mask`` (bool ``[Q]``) says which of them may be positives,
      e.g. ``conf > tau`` for the clustering loss C; ``None`` means all may.

    ``A(j)`` is the whole reference set minus j itself (the denominator always
    includes every memory entry, eligible or not), and
    ``P(j) = {p in A(j): y_p = y_j and p eligible}``.

    Anchors with an empty ``P(j)`` are skipped (their term is undefined). ``reduction`` says what the sum of
    the kept ``L_j`` is divided by: ``"positives"`` (default; SupCon, Semi-SFL's T) the
    number of anchors that have at least one positive, ``"batch"`` (Semi-SFL's C: anchors
    without a positive skipped, the mean over the batch) all ``N`` anchors. The
    loss is zero (still attached to the graph, with zero gradient) when no anchor has a
    positive.

    Normalisation: with ``normalize=True`` (default) anchors and references are
    L2-normalised here, so callers may pass raw projections; doing it twice is
    harmless. Pass ``normalize=False`` only for inputs that are normalised
    already.

    Semi-SFL uses two instances (see the wrappers):
    * T (labeled batch): :func:`supervised_contrastive`, references = batch + queue.
    * C (unlabeled batch): :func:`clustering_regularization`, references = queue
      only, positives = confident queue entries with the same pseudo-label.

    Returns the scalar loss, or ``(loss, has_positive)`` when ``return_mask``.
    """
    if z_anchor.ndim != 2:
        raise ValueError(f"z_anchor must be [N, d], got {tuple(z_anchor.shape)}")
    if reduction not in ("positives", "batch"):
        raise ValueError(f"reduction={reduction!r} is not one of: positives, batch")
    if kappa <= 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    device = z_anchor.device
    n = z_anchor.shape[0]
    y_anchor = y_anchor.to(device=device, dtype=torch.long).reshape(-1)
    anchors = F.normalize(z_anchor, dim=1) if normalize else z_anchor

    refs: list[Tensor] = []
    ref_labels: list[Tensor] = []
    ref_eligible: list[Tensor] = []
    self_mask_cols = 0
    if batch_as_reference:
        refs.append(anchors)
        ref_labels.append(y_anchor)
        ref_eligible.append(torch.ones(n, dtype=torch.bool, device=device))
        self_mask_cols = n
    if z_ref is not None and z_ref.shape[0] > 0:
        if y_ref is None:
            raise ValueError("y_ref is required with z_ref")
        zq = z_ref.detach().to(device=device, dtype=anchors.dtype)
        if normalize:
            zq = F.normalize(zq, dim=1)
        refs.append(zq)
        ref_labels.append(y_ref.to(device=device, dtype=torch.long).reshape(-1))
        if ref_positive_mask is None:
            ref_eligible.append(torch.ones(zq.shape[0], dtype=torch.bool, device=device))
        else:
            ref_eligible.append(ref_positive_mask.to(device=device, dtype=torch.bool).reshape(-1))

    has_positive_none = torch.zeros(n, dtype=torch.bool, device=device)
    if not refs or n == 0:
        loss = anchors.sum() * 0.0
        return (loss, has_positive_none) if return_mask else loss

    ref_z = torch.cat(refs, dim=0)
    ref_y = torch.cat(ref_labels, dim=0)
    eligible = torch.cat(ref_eligible, dim=0)

    positive = (y_anchor[:, None] == ref_y[None, :]) & eligible[None, :]
    if self_mask_cols:
        idx = torch.arange(n, device=device)
        positive[idx, idx] = False
    n_pos = positive.sum(dim=1)
    has_positive = n_pos > 0
    if not bool(has_positive.any()):
        loss = anchors.sum() * 0.0
        return (loss, has_positive) if return_mask else loss

    # Only anchors with positives are evaluated; their denominators are never
    # empty, so the log-softmax has no -inf rows (no NaN gradients).
    rows = has_positive.nonzero().squeeze(1)
    sim = anchors[rows] @ ref_z.T / kappa  # [N', R]
    if self_mask_cols:
        is_self = torch.zeros_like(sim, dtype=torch.bool)
        is_self[torch.arange(rows.numel(), device=device), rows] = True
        sim = sim.masked_fill(is_self, float("-inf"))
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    pos = positive[rows]
    pos_log_prob = torch.where(pos, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
    per_anchor = -pos_log_prob / n_pos[rows].to(log_prob.dtype)
    loss = per_anchor.mean() if reduction == "positives" else per_anchor.sum() / n
    return (loss, has_positive) if return_mask else loss


def supervised_contrastive(
    z: Tensor,
    y: Tensor,
    queue_z: Optional[Tensor] = None,
    queue_y: Optional[Tensor] = None,
    queue_conf: Optional[Tensor] = None,
    *,
    tau: Optional[float] = None,
    kappa: float = 0.07,
    normalize: bool = True,
) -> Tensor:
    """Semi-SFL T (Sec. III, Eq. 3) on a labeled batch.

    References: the current batch (minus the anchor) plus the queue [ours].
    Positives: every reference with the same label. The literal P(j) puts no
    confidence filter on queue entries; pass ``tau`` (with ``queue_conf``) to let
    only queue entries with ``conf > tau`` be positives (the ground-truth level 1
    entries have conf 1 and always qualify). Gradients reach ``z`` only.
    """
    mask = None
    if tau is not None and queue_conf is not None:
        mask = queue_conf > tau
    return supcon_loss(
        z, y, queue_z, queue_y, mask, kappa=kappa, batch_as_reference=True, normalize=normalize
    )


def clustering_regularization(
    z: Tensor,
    yhat: Tensor,
    queue_z: Tensor,
    queue_y: Tensor,
    queue_conf: Tensor,
    *,
    tau: float,
    kappa: float = 0.07,
    normalize: bool = True,
    reduction: str = "batch",
) -> Tensor:
    """Semi-SFL clustering regularisation C (Sec. III, Eq. 5).

    For every unlabeled sample j (all of them, confident or not), with student
    projection ``z_j`` and teacher pseudo-label ``yhat_j``::

        P^(j) = {p in Q: conf_p > tau and yhat_p = yhat_j}
        C_j = -(1/|P^(j)|) sum_{p in P^(j)} log[ exp(z_j.z~_p/kappa) / sum_{a in Q} exp(z_j.z~_a/kappa) ]

    The denominator runs over the whole queue Q; the current batch is not a
    reference. Samples with empty P^(j) contribute nothing and the sum is
    divided by the batch size ``N`` (``reduction="batch"``: the 1/d_i of H_u applied to C
    as well, [ours]); ``reduction="positives"`` divides by
    the number of anchors with a positive instead (64/13 = 4.9x the batch
    scale when 13 of 64 anchors have a positive).
    Gradients reach ``z`` only (the queue is constant).
    """
    return supcon_loss(
        z,
        yhat,
        queue_z,
        queue_y,
        queue_conf > tau,
        kappa=kappa,
        batch_as_reference=False,
        normalize=normalize,
        reduction=reduction,
    )
