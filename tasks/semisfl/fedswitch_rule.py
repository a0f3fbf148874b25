"""FedSwitch's rules, plain torch (no Flower): the adaptive teacher/student switch, one client
step with local teacher adaptation, the client's local loop and the server's K_s supervised
steps with a per-step EMA teacher. The algorithm, its sources and every reconstructed choice
are in :mod:`strategies.semisfl.fedswitch`'s docstring.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tasks.data import ArrayDataset
from tasks.ema import ema_update
from tasks.losses import masked_pseudo_label_ce
from tasks.training import batch_indices, seeded, to_device_batch

__all__ = ["mean_confidence", "choose_source", "fedswitch_step", "train_fedswitch", "server_steps"]


def mean_confidence(logits: torch.Tensor) -> float:
    """The batch mean of the max-softmax, ``(1/B) sum_b max_c softmax(logits_b)_c``."""
    return float(torch.softmax(logits.detach().float(), dim=1).max(dim=1).values.mean())


@torch.no_grad()
def choose_source(teacher_logits: torch.Tensor, student_logits: Optional[torch.Tensor], iid: bool
                  ) -> tuple[bool, torch.Tensor]:
    """The switch: which model's weak-view prediction gives this batch's pseudo-labels.

    Returns ``(teacher_chosen, q)`` with ``q`` the chosen model's softmax. With ``iid`` the
    teacher is always chosen (``student_logits`` may then be ``None``); otherwise the student
    is chosen only if its mean max-softmax is strictly higher than the teacher's (ties go to
    the teacher).
    """
    p_teacher = torch.softmax(teacher_logits.detach(), dim=1)
    if iid:
        return True, p_teacher
    if student_logits is None:
        raise ValueError("the switch needs the student's logits unless iid is set")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"teacher and student logits differ in shape: {tuple(teacher_logits.shape)} "
                         f"vs {tuple(student_logits.shape)}")
    p_student = torch.softmax(student_logits.detach(), dim=1)
    if float(p_student.max(dim=1).values.mean()) > float(p_teacher.max(dim=1).values.mean()):
        return False, p_student
    return True, p_teacher


def fedswitch_step(student: torch.nn.Module, teacher: torch.nn.Module, x_weak: torch.Tensor,
                   x_strong: torch.Tensor, *, tau: float, iid: bool, optimizer: torch.optim.Optimizer,
                   local_decay: float) -> dict[str, torch.Tensor | bool]:
    """One client step: switch, FixMatch loss on the strong view, SGD step, local teacher
    adaptation ``t <- g_l t + (1 - g_l) w``.

    Both candidates predict the weak view in eval mode without gradients (so the switch
    compares like with like: no dropout, running BN statistics); the student is trained in
    train mode on the strong view: ``L = (1/B) sum_b 1[max q_b >= tau] CE(argmax q_b, f_w(strong_b))``.
    Returns ``loss``, ``mask`` (float 0/1 per sample), ``pseudo`` (argmax q) and ``teacher``
    (whether the teacher was the source).
    """
    with torch.no_grad():
        teacher.eval()
        t_logits = teacher(x_weak)
        s_logits = None
        if not iid:
            student.eval()
            s_logits = student(x_weak)
    teacher_chosen, q = choose_source(t_logits, s_logits, iid)
    student.train()
    loss, mask = masked_pseudo_label_ce(student(x_strong), q, tau)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    ema_update(teacher, student, local_decay)
    return {"loss": loss.detach(), "mask": mask.detach(), "pseudo": q.argmax(dim=1), "teacher": teacher_chosen}


def train_fedswitch(student: torch.nn.Module, teacher: torch.nn.Module, data: ArrayDataset, *, aug,
                    steps: int, batch_size: int, optimizer: torch.optim.Optimizer, device: torch.device,
                    seed: int, tau: float, iid: bool, local_decay: float) -> dict[str, float]:
    """``steps`` :func:`fedswitch_step` s on unlabeled ``data`` (batches of the library's seeded
    cursor, augmentation draws under :func:`tasks.training.seeded`).

    Returns ``train-loss`` (mean over steps), ``num-examples`` (samples seen), ``mask-rate``,
    ``teacher-share`` (share of steps whose pseudo-labels came from the teacher),
    ``pseudo-kept`` and, when ``data`` carries hidden labels, ``pseudo-correct`` (confident
    pseudo-labels equal to the hidden label: a metric, never a loss)."""
    gen = torch.Generator().manual_seed(seed)
    total = seen = kept = correct = teacher_steps = 0.0
    n_steps = 0
    with seeded(seed, device):   # augmentation and dropout draws
        for idx in batch_indices(len(data), batch_size, steps, gen):
            xb, yb = to_device_batch(data, idx, device)
            xw, xs = aug.weak_strong(xb)
            out = fedswitch_step(student, teacher, xw, xs, tau=tau, iid=iid, optimizer=optimizer,
                                 local_decay=local_decay)
            mask = out["mask"]
            total += float(out["loss"])
            seen += len(idx)
            kept += float(mask.sum())
            correct += float(((out["pseudo"] == yb).to(mask.dtype) * mask).sum())
            teacher_steps += 1.0 if out["teacher"] else 0.0
            n_steps += 1
    metrics = {"train-loss": total / max(n_steps, 1), "num-examples": float(seen),
               "mask-rate": kept / seen if seen else 0.0, "pseudo-kept": kept,
               "teacher-share": teacher_steps / n_steps if n_steps else 1.0}
    if data.labels_known:
        metrics["pseudo-correct"] = correct
    return metrics


def server_steps(student: torch.nn.Module, teacher: torch.nn.Module, data: ArrayDataset, *, aug, steps: int,
                 batch_size: int, optimizer: torch.optim.Optimizer, device: torch.device, seed: int,
                 decay: float) -> dict[str, float]:
    """The server's K_s steps of cross-entropy on its labeled set (weak view), each followed by
    the global EMA ``w~ <- g w~ + (1 - g) w``. Returns ``server-loss`` (mean CE) and
    ``server-steps``."""
    gen = torch.Generator().manual_seed(seed)
    student.train()
    total, n = 0.0, 0
    with seeded(seed, device):
        for idx in batch_indices(len(data), batch_size, steps, gen):
            x, y = to_device_batch(data, idx, device)
            loss = F.cross_entropy(student(aug.weak(x)), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ema_update(teacher, student, decay)
            total += float(loss.detach())
            n += 1
    return {"server-loss": total / max(n, 1), "server-steps": float(n)}
