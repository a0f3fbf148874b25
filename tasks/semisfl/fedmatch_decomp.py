"""FedMatch's parameter decomposition and its local rules, plain torch (no Flower).

W. Jeong, J. Yoon, E. Yang, S. J. Hwang, "Federated Semi-Supervised Learning with Inter-Client
Consistency & Disjoint Learning", ICLR 2021; authors' code github.com/wyjeong/FedMatch (TF2).
The Flower side (messages, aggregation, helper choice over the run) is :mod:`strategies.semisfl.fedmatch`.

* **Decomposition** (:func:`kernel_names`, :func:`decompose`, :func:`decomposed_forward`):
  every kernel (the ``weight`` of an ``nn.Conv*`` / ``nn.Linear``, found by module type, so a
  user's own model works) is ``theta = sigma + psi``. ``sigma`` lives in the model's own
  parameters (with the biases and normalisation parameters, which are not decomposed);
  ``psi`` is a dict of tensors by parameter name. The forward pass substitutes ``sigma + psi``
  for each kernel with :func:`torch.func.functional_call`, so gradients reach whichever of
  the two is trainable and the other stays bit-identical.
* **Server step** (:func:`server_steps`): ``lambda_s CE(y, p_{sigma+psi}(weak(x)))``, SGD on
  sigma only (psi constant).
* **Client step** (:func:`client_steps`, :func:`unsupervised_loss`): psi only (sigma frozen),
  on the confident samples C = {i: max p_i >= tau} of ``p = softmax(f_{sigma+psi}(weak(u)))``::

      L = lambda_i (1/H) sum_j mean_{i in C} KL(p*_j,i || p_i)
        + lambda_a mean_{i in C} CE(yhat_i, f_{sigma+psi}(strong(u_i)))
        + lambda_l1 ||psi||_1 + lambda_l2 ||sigma - psi||_2^2

  ``p*_j`` = helper j's prediction (``sigma + psi_j``), ``yhat`` the agreement vote
  (:func:`agreement_labels`). With no helpers the KL term is off and ``yhat = argmax p``.
* **Upload** (:func:`encode_upload` / :func:`decode_upload`): the authors' ``cal_c2s``.
* **Helpers** (:func:`probe_image`, :func:`embed`, :func:`nearest_helpers`): a client's model
  embedding is its prediction on one fixed truncated-Gaussian image; its H nearest other clients
  (Euclidean) are its helpers (the authors' KD-tree query, as a plain nearest-neighbour search).
"""
from __future__ import annotations

import copy
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from tasks.config import ConfigError
from tasks.data import ArrayDataset
from tasks.training import batch_indices, seeded, to_device_batch

__all__ = [
    "KERNEL_TYPES",
    "NORM_TYPES",
    "Decomposed",
    "agreement_labels",
    "client_steps",
    "compose_model",
    "compose_overrides",
    "decode_upload",
    "decompose",
    "decomposed_forward",
    "embed",
    "encode_upload",
    "kernel_names",
    "kl_consistency",
    "nearest_helpers",
    "norm_param_names",
    "probe_image",
    "psi_regularizer",
    "server_steps",
    "sparsify",
    "unsupervised_loss",
]

#: the layers whose kernel is decomposed (the authors' DecomposedConv / DecomposedDense)
KERNEL_TYPES = (nn.modules.conv._ConvNd, nn.Linear)
#: normalisation layers (their affine parameters are sigma's, or frozen: ``norm-affine``)
NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)

Psi = dict[str, Tensor]


# --------------------------------------------------------------------------- decomposition
def kernel_names(model: nn.Module) -> list[str]:
    """Parameter names of the kernels of every ``nn.Conv*`` and ``nn.Linear`` of ``model`` (module
    order; a shared module once). A model without one is a :class:`ConfigError`."""
    params = dict(model.named_parameters())
    names: list[str] = []
    for mname, m in model.named_modules():
        if isinstance(m, KERNEL_TYPES) and isinstance(getattr(m, "weight", None), nn.Parameter):
            name = f"{mname}.weight" if mname else "weight"
            if name in params and name not in names:
                names.append(name)
    if not names:
        raise ConfigError("fedmatch decomposes the kernels of the model's nn.Conv*/nn.Linear layers "
                          "(theta = sigma + psi): model= has no such layer with a weight parameter")
    return names


def norm_param_names(model: nn.Module) -> list[str]:
    """Parameter names of the normalisation layers' affine parameters (BN/GN/LN/IN)."""
    out: list[str] = []
    for mname, m in model.named_modules():
        if isinstance(m, NORM_TYPES):
            out += [f"{mname}.{p}" if mname else p for p, _ in m.named_parameters(recurse=False)]
    return out


def decompose(theta: Tensor, psi_factor: float) -> tuple[Tensor, Tensor]:
    """``(sigma, psi)`` with ``sigma = theta / (1 + psi_factor)`` and ``psi = theta - sigma``
    (= ``psi_factor * sigma`` up to rounding: the authors' ``psi = 0.2 sigma``). For
    ``psi_factor`` in [0, 1], ``theta / sigma`` lies in [1, 2], so ``theta - sigma`` is exact
    (Sterbenz) and ``sigma + psi == theta`` bit for bit: the model a run starts from is the one
    it was given."""
    sigma = theta / (1.0 + float(psi_factor))
    return sigma, theta - sigma


def compose_overrides(model: nn.Module, psi: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: sigma + psi}`` for every decomposed kernel (sigma: the model's parameter)."""
    params = dict(model.named_parameters())
    return {k: params[k] + v for k, v in psi.items()}


def decomposed_forward(model: nn.Module, psi: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """``f_{sigma+psi}(x)``: the model with each kernel replaced by ``sigma + psi`` (its own
    buffers, e.g. BN running statistics, are used and updated as in a plain forward)."""
    return functional_call(model, compose_overrides(model, psi), (x,))


class Decomposed(nn.Module):
    """``model`` whose forward is :func:`decomposed_forward` with ``psi``; its parameters are the
    model's (sigma): pass it to a training loop to train sigma with psi fixed."""

    def __init__(self, model: nn.Module, psi: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.model = model
        self.psi = dict(psi)

    def forward(self, x: Tensor) -> Tensor:
        return decomposed_forward(self.model, self.psi, x)


@torch.no_grad()
def compose_model(model: nn.Module, psi: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``model`` whose kernels are ``sigma + psi`` (the model FedMatch evaluates)."""
    out = copy.deepcopy(model)
    params = dict(out.named_parameters())
    for k, v in psi.items():
        params[k].add_(v.to(params[k].device, params[k].dtype))
    return out


# --------------------------------------------------------------------------- the client's loss
def agreement_labels(probs: Tensor, helper_probs: Sequence[Tensor]) -> Tensor:
    """The agreement vote ``yhat = argmax(onehot(argmax p) + sum_j onehot(argmax p*_j))``; a tie
    goes to the lowest class index (numpy's argmax in the authors' code; torch's argmax returns
    the first maximum too). Without helpers, ``argmax p``."""
    m = probs.shape[1]
    votes = F.one_hot(probs.argmax(1), m)
    for q in helper_probs:
        votes = votes + F.one_hot(q.argmax(1), m)
    return votes.argmax(1)


def kl_consistency(helper_probs: Sequence[Tensor], log_p: Tensor) -> Tensor:
    """``(1/H) sum_j mean_i KL(p*_j,i || p_i)`` with ``KL(q || p) = sum_c q_c (log q_c - log p_c)``
    (``0 log 0 = 0``); ``log_p``: the client's log-probabilities (gradient flows through them),
    the helpers' ``p*_j`` are constants. ``0`` without helpers or rows."""
    if not helper_probs or log_p.shape[0] == 0:
        return log_p.sum() * 0.0
    total = log_p.new_zeros(())
    for q in helper_probs:
        q = q.detach()
        total = total + (torch.special.xlogy(q, q) - q * log_p).sum(1).mean()
    return total / len(helper_probs)


def unsupervised_loss(logits_weak: Tensor, logits_strong: Tensor, helper_probs: Sequence[Tensor], *,
                      tau: float, lambda_i: float, lambda_a: float) -> tuple[Tensor, Tensor, Tensor]:
    """The inter-client consistency and agreement terms on one batch (module docstring), means
    over the confident samples C (the authors' Keras losses on ``x[conf]``). ``helper_probs``:
    the helpers' softmax on the same weak batch (all rows). Returns ``(loss, mask, yhat)``; an
    empty C gives a zero loss (the regularisers are added by the caller)."""
    log_p = F.log_softmax(logits_weak, dim=1)
    probs = log_p.detach().exp()
    mask = probs.max(1).values >= tau
    yhat = agreement_labels(probs, [q.detach() for q in helper_probs])
    if not bool(mask.any()):
        return logits_weak.sum() * 0.0, mask, yhat
    hq = [q.detach()[mask] for q in helper_probs]
    loss = lambda_i * kl_consistency(hq, log_p[mask]) if hq else logits_weak.new_zeros(())
    loss = loss + lambda_a * F.cross_entropy(logits_strong[mask], yhat[mask])
    return loss, mask, yhat


def psi_regularizer(model: nn.Module, psi: Mapping[str, Tensor], lambda_l1: float, lambda_l2: float) -> Tensor:
    """``lambda_l1 sum |psi| + lambda_l2 sum (sigma - psi)^2`` over every decomposed kernel
    (sums over entries, as the authors' ``reduce_sum``, models/fedmatch/client.py lines 98-102 at
    commit 4947aa2; sigma is a constant here). Its minimum is psi = sigma (shifted by
    lambda_l1/(2 lambda_l2)): without a data term psi converges onto sigma (``docs/baselines.md`` A2)."""
    params = dict(model.named_parameters())
    total = next(iter(psi.values())).new_zeros(())
    for k, v in psi.items():
        total = total + lambda_l1 * v.abs().sum() + lambda_l2 * ((params[k].detach() - v) ** 2).sum()
    return total


# --------------------------------------------------------------------------- local loops
def server_steps(model: nn.Module, psi: Mapping[str, Tensor], data: ArrayDataset, *, aug, steps: int,
                 batch_size: int, optimizer: torch.optim.Optimizer, device: torch.device, seed: int,
                 lambda_s: float) -> dict[str, float]:
    """``steps`` SGD steps of ``lambda_s CE(y, f_{sigma+psi}(weak(x)))`` on the labeled ``data``;
    ``optimizer`` holds sigma's parameters (psi is a constant). Returns ``server-loss`` (mean
    CE, without lambda_s) and ``server-steps``."""
    net = Decomposed(model, {k: v.detach() for k, v in psi.items()})
    net.train()
    gen = torch.Generator().manual_seed(seed)
    total, n = 0.0, 0
    with seeded(seed, device):   # augmentation and dropout draws
        for idx in batch_indices(len(data), batch_size, steps, gen):
            x, y = to_device_batch(data, idx, device)
            ce = F.cross_entropy(net(aug.weak(x)), y)
            optimizer.zero_grad(set_to_none=True)
            (lambda_s * ce).backward()
            optimizer.step()
            total += float(ce.detach())
            n += 1
    return {"server-loss": total / max(n, 1), "server-steps": float(n)}


def client_steps(model: nn.Module, psi: Psi, helpers: Sequence[Mapping[str, Tensor]], data: ArrayDataset, *,
                 aug, steps: int, batch_size: int, optimizer: torch.optim.Optimizer, device: torch.device,
                 seed: int, tau: float, lambda_i: float, lambda_a: float, lambda_l1: float,
                 lambda_l2: float) -> dict[str, float]:
    """``steps`` SGD steps of the client loss (module docstring) on unlabeled ``data``.

    ``psi``: leaf tensors with ``requires_grad`` (``optimizer`` holds them); the model's
    parameters (sigma) are never stepped. ``helpers``: each a ``{name: psi_j}`` (helper j is
    ``sigma + psi_j``); they predict the same weak batch as the client, without gradient, in the
    same (train) mode. Returns ``train-loss`` (mean total loss), ``num-examples``,
    ``mask-rate``, ``pseudo-kept`` and, where ``data``'s labels are known, ``pseudo-correct``
    (confident agreement labels equal to the hidden label; metrics only)."""
    model.train()
    gen = torch.Generator().manual_seed(seed)
    total = kept = correct = 0.0
    seen = n = 0
    with seeded(seed, device):   # augmentation and dropout draws
        for idx in batch_indices(len(data), batch_size, steps, gen):
            xb, yb = to_device_batch(data, idx, device)
            xw, xs = aug.weak(xb), aug.strong(xb)
            logits_w = decomposed_forward(model, psi, xw)
            with torch.no_grad():
                hp = [torch.softmax(decomposed_forward(model, h, xw), dim=1) for h in helpers]
            logits_s = decomposed_forward(model, psi, xs)
            loss, mask, yhat = unsupervised_loss(logits_w, logits_s, hp, tau=tau, lambda_i=lambda_i,
                                                 lambda_a=lambda_a)
            loss = loss + psi_regularizer(model, psi, lambda_l1, lambda_l2)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            kept += float(mask.sum())
            correct += float(((yhat == yb) & mask).sum())
            seen += len(idx)
            n += 1
    out = {"train-loss": total / max(n, 1), "num-examples": float(seen), "mask-rate": kept / max(seen, 1),
           "pseudo-kept": kept}
    if data.labels_known:
        out["pseudo-correct"] = correct
    return out


# --------------------------------------------------------------------------- the upload
def sparsify(x: np.ndarray, thres: float) -> np.ndarray:
    """The authors' hard threshold: ``x`` where ``|x| > thres``, else 0."""
    return np.where(np.abs(x) > thres, x, np.zeros_like(x))


def encode_upload(psi_new: Mapping[str, np.ndarray], psi_sent: Mapping[str, np.ndarray], l1_thres: float,
                  delta_thres: float) -> tuple[dict[str, np.ndarray], int, int]:
    """The client's psi upload, the authors' ``cal_c2s``: psi is sparsified (entries with
    ``|psi| > l1_thres``, others 0) and only the entries that changed by more than
    ``delta_thres`` from the psi the server sent travel; the rest keep the server's value.

    Per kernel the smaller of two encodings is sent: ``<name>/idx`` (flat indices, int32) with
    ``<name>/val`` (float32 values), or ``<name>/dense`` (the whole new tensor) when that is
    fewer bytes. Returns ``(arrays, entries changed, entries in all kernels)``."""
    out: dict[str, np.ndarray] = {}
    changed_total = numel = 0
    for k, sent in psi_sent.items():
        sp = sparsify(np.asarray(psi_new[k], dtype=np.float32), l1_thres)
        changed = np.abs(sp - sent) > delta_thres
        idx = np.flatnonzero(changed)
        changed_total += int(idx.size)
        numel += int(sent.size)
        itype = np.int32 if sent.size < 2 ** 31 else np.int64
        if idx.size * (np.dtype(itype).itemsize + 4) < sent.size * 4:
            out[f"{k}/idx"] = idx.astype(itype)
            out[f"{k}/val"] = sp.reshape(-1)[idx].astype(np.float32)
        else:
            out[f"{k}/dense"] = np.where(changed, sp, sent).astype(np.float32)
    return out, changed_total, numel


def decode_upload(arrays: Mapping[str, np.ndarray], psi_sent: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The server's side of :func:`encode_upload`: the client's psi, from the psi it was sent."""
    out: dict[str, np.ndarray] = {}
    for k, sent in psi_sent.items():
        if f"{k}/dense" in arrays:
            v = np.asarray(arrays[f"{k}/dense"], dtype=np.float32)
            if v.shape != sent.shape:
                raise ValueError(f"fedmatch upload: '{k}/dense' has shape {v.shape}, expected {sent.shape}")
            out[k] = v
            continue
        if f"{k}/idx" not in arrays or f"{k}/val" not in arrays:
            raise ValueError(f"fedmatch upload: no entry for kernel '{k}' (neither '{k}/dense' nor '{k}/idx')")
        idx, val = np.asarray(arrays[f"{k}/idx"]).astype(np.int64), np.asarray(arrays[f"{k}/val"], np.float32)
        if idx.shape != val.shape or (idx.size and (idx.min() < 0 or idx.max() >= sent.size)):
            raise ValueError(f"fedmatch upload: '{k}' has bad indices or values")
        flat = np.array(sent, dtype=np.float32).reshape(-1)
        flat[idx] = val
        out[k] = flat.reshape(sent.shape)
    return out


# --------------------------------------------------------------------------- helpers
def probe_image(shape: tuple[int, int, int], seed: int) -> Tensor:
    """The fixed input of the model embeddings: one uint8 image ``[1, C, H, W]`` of a Gaussian with
    mean 125 and std 125 truncated to [0, 255] (pixel scale; the authors' ``truncnorm``), rounded
    to pixel values as the library stores images [ours], seeded. Feed it through the test view."""
    g = torch.empty(1, *shape)
    torch.nn.init.trunc_normal_(g, mean=125.0, std=125.0, a=0.0, b=255.0,
                                generator=torch.Generator().manual_seed(seed))
    return g.round().clamp(0, 255).to(torch.uint8)


@torch.no_grad()
def embed(model: nn.Module, psi: Mapping[str, Tensor], probe: Tensor) -> np.ndarray:
    """A client's model embedding: ``softmax(f_{sigma+psi_k}(probe))`` in eval mode (the authors'
    model ends in a softmax), as a flat numpy vector."""
    was = model.training
    model.eval()
    try:
        out = torch.softmax(decomposed_forward(model, psi, probe), dim=1)
    finally:
        model.train(was)
    return out.reshape(-1).detach().cpu().numpy().astype(np.float64)


def nearest_helpers(vectors: Mapping[Hashable, np.ndarray], key: Hashable, h: int) -> list:
    """The ``h`` clients whose embeddings are nearest (Euclidean) to ``key``'s, ``key`` excluded,
    nearest first; ties by key order. Fewer if fewer are known; none if ``key`` has no embedding."""
    if key not in vectors or h <= 0:
        return []
    others = sorted(k for k in vectors if k != key)
    if not others:
        return []
    d = np.array([np.linalg.norm(np.asarray(vectors[k]) - np.asarray(vectors[key])) for k in others])
    return [others[i] for i in np.argsort(d, kind="stable")[:h]]
