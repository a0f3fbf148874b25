"""Local training loops, evaluation and their helpers: plain torch, no Flower.

Every algorithm's client and server code trains through these: the one seeded mini-batch
cursor (:func:`batch_at`; :func:`batch_indices` iterates it), SGD from the task config
(:func:`make_sgd`), the supervised and FixMatch local loops and the accuracy/loss/per-class evaluation. ``load_numpy_state`` is
the one state-dict <- numpy conversion (checked keys, shapes and finiteness); its Flower
counterparts (``ArrayRecord``) live in :mod:`strategies.core.records`.
"""
from __future__ import annotations

import hashlib
import math
import os
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from tasks.augment import Augmenter
from tasks.config import ConfigError, TaskConfig
from tasks.data import ArrayDataset


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any parts (run seed, round, node, step, purpose...)."""
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


@contextmanager
def seeded(seed: int, device: torch.device | None = None):
    """The library's one way to seed torch's global RNG: run a block under ``seed`` (augmentation
    draws, dropout masks, initialisation) and restore the RNG state afterwards, so nothing
    outside the block (the user's code, another algorithm in the same process) is disturbed.
    Mini-batch order uses explicit ``torch.Generator`` objects seeded from :func:`derive_seed`."""
    devices = [device.index or 0] if (device is not None and device.type == "cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def resolve_device(name: str, deterministic: bool = True) -> torch.device:
    """The torch device of the run config's ``device`` (``auto``: CUDA where available).

    On CUDA, ``deterministic`` (the run config's ``deterministic``) sets PyTorch's
    deterministic mode for this process: ``torch.use_deterministic_algorithms(True,
    warn_only=True)`` (an op without a deterministic kernel warns instead of failing),
    cuDNN's deterministic kernels and no cuDNN autotuning, and ``CUBLAS_WORKSPACE_CONFIG``
    (``:4096:8``, where not set) as cuBLAS needs it. Without it the same seed gives weights
    that differ run to run on a GPU (cuDNN's convolution backward sums in a varying order),
    which a paired comparison, a resume and the equivalence tests cannot tell from a real
    difference. ``False`` turns the mode off again (faster kernels). On the CPU nothing is
    changed: its kernels are deterministic already."""
    if name == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={name!r} but CUDA is not available here; use device='auto' or 'cpu'")
    if dev.type == "cuda":
        set_cuda_determinism(deterministic)
    return dev


def set_cuda_determinism(on: bool) -> None:
    """PyTorch's deterministic mode for CUDA on (see :func:`resolve_device`) or off."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(bool(on), warn_only=True)
    torch.backends.cudnn.deterministic = bool(on)
    torch.backends.cudnn.benchmark = not on


def load_numpy_state(model: torch.nn.Module, state: dict[str, np.ndarray], strict: bool = True) -> None:
    own = model.state_dict()
    if strict and set(own) != set(state):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"model state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    for k, v in state.items():
        if k not in own:
            continue
        if tuple(own[k].shape) != tuple(v.shape) and np.size(v) == own[k].numel() == 1:
            v = np.reshape(v, tuple(own[k].shape))  # a 0-d buffer that travelled as shape (1,)
        if tuple(own[k].shape) != tuple(v.shape):
            raise ValueError(f"model state '{k}' has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
        if np.issubdtype(v.dtype, np.floating) and not np.all(np.isfinite(v)):
            raise ValueError(f"model state '{k}' contains NaN or Inf")
        own[k].copy_(torch.from_numpy(np.asarray(v)).to(own[k].dtype))


def trainable_keys(model: torch.nn.Module) -> list[str]:
    return [k for k, _ in model.named_parameters()]


def make_sgd(params, task: TaskConfig, lr: float | None = None, nesterov: bool = False) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=task.lr if lr is None else lr, momentum=task.momentum,
                           weight_decay=task.weight_decay, nesterov=nesterov and task.momentum > 0)


def num_local_steps(task: TaskConfig, n: int) -> int:
    """``local-steps`` if set, else ``local-epochs`` passes over ``n`` samples."""
    if task.local_steps > 0:
        return task.local_steps
    return task.local_epochs * max(1, math.ceil(n / task.batch_size))


def batch_bounds(n: int, batch_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the batches of one epoch over ``n`` samples: a last batch of 1
    joins the batch before it (``B + 1``; BatchNorm cannot train on a batch of 1). With
    ``batch_size == 1`` batches of 1 are what was asked for."""
    bounds = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)]
    if batch_size > 1 and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def batch_at(n: int, batch_size: int, step: int, perm: Callable[[int], torch.Tensor], *,
             fixed: bool = False) -> torch.Tensor:
    """The library's one mini-batch rule: indices of local step ``step`` (0-based) of a cursor
    over reshuffled epochs, ``perm(e)`` being the permutation of ``range(n)`` of epoch ``e``.

    * ``fixed=False`` (local training, :func:`batch_indices`): each epoch is cut by
      :func:`batch_bounds`, so batches never cross an epoch, the last one is kept short and
      is never of size 1 when ``batch_size > 1`` (a data set of one sample is a batch of that
      sample twice, which leaves cross-entropy unchanged);
    * ``fixed=True`` (split learning, whose streams have a fixed shape): positions
      ``[step*b, (step+1)*b)`` of ``perm(0) ++ perm(1) ++ ...``: every batch has exactly
      ``batch_size`` samples, every sample is seen once per epoch.

    Stateless: with ``perm`` from :func:`seeded_perms` any step's batch is recomputed from
    ``(seed, step)`` alone (the split worker's two forward passes of one step)."""
    if n <= 0 or batch_size <= 0:
        raise ValueError(f"cannot draw a batch of {batch_size} from {n} samples")
    if not fixed:
        bounds = batch_bounds(n, batch_size)
        e, j = divmod(step, len(bounds))
        s, t = bounds[j]
        idx = perm(e)[s:t]
        return idx if (t - s > 1 or batch_size == 1) else idx.repeat(2)
    start, stop = step * batch_size, (step + 1) * batch_size
    out = []
    for e in range(start // n, (stop - 1) // n + 1):
        lo, hi = max(start - e * n, 0), min(stop - e * n, n)
        out.append(perm(e)[lo:hi])
    return torch.cat(out)


def seeded_perms(n: int, seed: int) -> Callable[[int], torch.Tensor]:
    """``perm(e)`` for :func:`batch_at`: epoch ``e``'s permutation seeded by ``derive_seed(seed, e)``
    (random access: no generator state to carry from one message to the next)."""
    return lambda e: torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, e)))


def batch_indices(n: int, batch_size: int, steps: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """``steps`` mini-batches of :func:`batch_at` (epochs cut by :func:`batch_bounds`), the
    epochs' permutations drawn from ``gen`` one after another as the cursor reaches them."""
    if n == 0:
        return
    current: dict[int, torch.Tensor] = {}   # the epoch the cursor is in -> its permutation

    def perm(e: int) -> torch.Tensor:
        if e not in current:   # (the cursor only moves forward, one epoch at a time)
            current.clear()
            current[e] = torch.randperm(n, generator=gen)
        return current[e]

    for i in range(steps):
        yield batch_at(n, batch_size, i, perm)


def paired_batches(n_labeled: int, n_unlabeled: int, batch_size: int, unlabeled_batch_size: int, steps: int,
                   seed: int) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The batch indices of at most ``steps`` local steps on a labeled and an unlabeled set, the
    loop of the semi-supervised local training (:func:`train_fixmatch`, pFedMe's): independent
    :func:`batch_indices` cursors seeded by ``seed`` and ``seed + 1``, ``None`` for a set with
    no batch; it stops early when neither has one."""
    lab = iter(batch_indices(n_labeled, batch_size, steps, torch.Generator().manual_seed(seed)))
    unl = iter(batch_indices(n_unlabeled, unlabeled_batch_size, steps, torch.Generator().manual_seed(seed + 1)))
    for _ in range(steps):
        il, iu = next(lab, None), next(unl, None)
        if il is None and iu is None:
            return
        yield il, iu


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def to_device_batch(data: ArrayDataset, idx: torch.Tensor, device: torch.device):
    i = idx.numpy()
    return torch.from_numpy(data.x[i]).to(device), torch.from_numpy(data.y[i]).to(device)


def train_supervised(model: torch.nn.Module, data: ArrayDataset, *, aug: Augmenter, steps: int,
                     batch_size: int, optimizer: torch.optim.Optimizer, device: torch.device,
                     seed: int, view: str = "weak",
                     lr_fn: Callable[[int], float] | None = None,
                     regularizer: Callable[[], torch.Tensor] | None = None,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                     ) -> dict[str, float]:
    """``steps`` SGD steps of cross-entropy on ``data`` (weak view by default), plus
    ``regularizer()`` if given (e.g. FedProx's :func:`tasks.losses.proximal_term`).

    ``loss_fn(logits, y)``, if given, replaces the cross-entropy (e.g. FedLC's
    :func:`tasks.losses.calibrated_ce`). ``lr_fn(i)``, if given, sets the learning rate of every
    param group before local step ``i`` (0-based), e.g. a cosine schedule over global
    iterations. ``train-loss`` is that loss alone (without the regularizer).
    """
    loss_fn = F.cross_entropy if loss_fn is None else loss_fn
    model.train()
    gen = torch.Generator().manual_seed(seed)
    transform = getattr(aug, view)
    total, seen = 0.0, 0
    with seeded(seed, device):   # augmentation and dropout draws
        for i, idx in enumerate(batch_indices(len(data), batch_size, steps, gen)):
            if lr_fn is not None:
                set_lr(optimizer, lr_fn(i))
            xb, yb = to_device_batch(data, idx, device)
            loss = loss_fn(model(transform(xb)), yb)
            optimizer.zero_grad(set_to_none=True)
            (loss + regularizer() if regularizer is not None else loss).backward()
            optimizer.step()
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
    return {"train-loss": total / max(seen, 1), "num-examples": float(seen)}


def fixmatch_loss(model: torch.nn.Module, x_weak: torch.Tensor | None, y: torch.Tensor | None,
                  unlabeled_views: tuple[torch.Tensor, torch.Tensor] | Callable[[], tuple[torch.Tensor, torch.Tensor]]
                  | None, *, tau: float, lambda_u: float
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """FixMatch's loss on one step's batch (Sohn et al. 2020), the one FixMatch step of the library:
    ``CE(f(x_weak), y) + lambda_u L_u``, ``L_u`` =
    :func:`tasks.losses.masked_pseudo_label_ce` of ``f(u_strong)`` against the confident hard
    pseudo-labels of the same model's softmax on ``u_weak`` (no gradient), over the whole unlabeled
    batch; a term without data is left out. ``unlabeled_views`` is ``(u_weak, u_strong)``, or a
    function returning them, called after the labeled forward pass (the order of
    :func:`train_fixmatch`'s augmentation and dropout draws), or ``None``. Returns
    ``(loss, mask, p_weak)`` (``mask`` and ``p_weak``: ``None`` without unlabeled data)."""
    from tasks.losses import masked_pseudo_label_ce

    loss = mask = pw = None
    if x_weak is not None and len(x_weak):
        loss = F.cross_entropy(model(x_weak), y)
    views = unlabeled_views() if callable(unlabeled_views) else unlabeled_views
    if views is not None and len(views[0]):
        u_weak, u_strong = views
        with torch.no_grad():
            pw = torch.softmax(model(u_weak), dim=1)
        lu, mask = masked_pseudo_label_ce(model(u_strong), pw, tau)
        loss = lambda_u * lu if loss is None else loss + lambda_u * lu
    if loss is None:
        raise ValueError("fixmatch_loss needs a labeled or an unlabeled batch")
    return loss, mask, pw


def train_fixmatch(model: torch.nn.Module, labeled: ArrayDataset, unlabeled: ArrayDataset, *,
                   aug: Augmenter, steps: int, batch_size: int, unlabeled_batch_size: int,
                   optimizer: torch.optim.Optimizer, device: torch.device, seed: int,
                   tau: float = 0.95, lambda_u: float = 1.0,
                   regularizer: Callable[[], torch.Tensor] | None = None) -> dict[str, float]:
    """``steps`` local FixMatch steps (Sohn et al. 2020), shared by the FixMatch baselines.

    Each step (:func:`fixmatch_loss`): ``L = CE(f(weak(x_l)), y_l) + lambda_u * L_u (+ regularizer())`` with
    ``L_u = tasks.losses.masked_pseudo_label_ce(f(strong(u)), softmax(f(weak(u))), tau)``
    (hard pseudo-label of the same model's weak view, kept where its confidence is >= tau,
    normalised by the full unlabeled batch). Labeled and unlabeled batches are drawn by
    independent reshuffled-epoch cursors (``batch_size`` and ``unlabeled_batch_size``);
    a term whose data set is empty is skipped. ``regularizer`` adds e.g. FedProx's
    ``mu/2 ||w - w_global||^2``. Returns ``train-loss``, ``num-examples`` (labeled +
    unlabeled samples seen), ``mask-rate`` and ``pseudo-label-accuracy`` (of the kept
    pseudo-labels, against the hidden labels of ``unlabeled``; NaN if none kept).
    """
    model.train()
    total = kept = correct = seen_u = seen = 0.0
    with seeded(seed, device):   # augmentation and dropout draws
        for il, iu in paired_batches(len(labeled), len(unlabeled), batch_size, unlabeled_batch_size, steps, seed):
            xw = yb = yu = None
            if il is not None:
                xb, yb = to_device_batch(labeled, il, device)
                xw = aug.weak(xb)
                seen += len(il)
            if iu is not None:
                xu, yu = to_device_batch(unlabeled, iu, device)
            loss, mask, pw = fixmatch_loss(model, xw, yb, (lambda: aug.weak_strong(xu)) if iu is not None else None,
                                           tau=tau, lambda_u=lambda_u)
            if iu is not None:
                kept += float(mask.sum())
                correct += float(((pw.argmax(1) == yu).float() * mask).sum())
                seen_u += len(iu)
                seen += len(iu)
            if regularizer is not None:
                loss = loss + regularizer()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
    n_steps = max(steps, 1)
    return {"train-loss": total / n_steps, "num-examples": float(seen),
            "mask-rate": kept / seen_u if seen_u else 0.0,
            "pseudo-label-accuracy": correct / kept if kept and unlabeled.labels_known else float("nan")}


def eval_batch_size(device: torch.device) -> int:
    """The batch of an evaluation pass (:func:`evaluate`) on ``device``: 500 on a GPU, 64 on the CPU.

    On the CPU a large batch's activations leave the cache, so the larger models evaluate faster
    in batches of 64; the small ones do not care (``bench/eval_batch.py``; docs/benchmarks.md,
    "Evaluation batch size")."""
    return 500 if device.type == "cuda" else 64


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ArrayDataset, *, aug: Augmenter, device: torch.device,
             num_classes: int, batch_size: int | None = None) -> dict[str, float | list[float]]:
    """Accuracy, mean loss and per-class accuracy of ``model`` on ``data`` (eval mode, no
    autograd graph: a large model's activations are not kept), in batches of ``batch_size``
    (``None``: :func:`eval_batch_size` of ``device``)."""
    batch_size = eval_batch_size(torch.device(device)) if batch_size is None else int(batch_size)
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    correct = torch.zeros(num_classes, dtype=torch.long)
    count = torch.zeros(num_classes, dtype=torch.long)
    loss_sum = 0.0
    for s in range(0, len(data), batch_size):
        xb = torch.from_numpy(data.x[s:s + batch_size]).to(device)
        yb = torch.from_numpy(data.y[s:s + batch_size]).to(device)
        logits = model(aug.test(xb))
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
        pred = logits.argmax(1)
        yc = yb.cpu()
        count += torch.bincount(yc, minlength=num_classes)
        correct += torch.bincount(yc[pred.cpu() == yc], minlength=num_classes)
    model.train(was_training)
    n = max(int(count.sum()), 1)
    per_class = [float(c) / float(k) if k > 0 else float("nan") for c, k in zip(correct, count)]
    return {"accuracy": float(correct.sum()) / n, "loss": loss_sum / n,
            "per-class-accuracy": [0.0 if math.isnan(p) else p for p in per_class]}
