"""Tests for tasks/losses.py against direct implementations of the papers' formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.optimize import minimize

from tasks.ema import ema_update
from tasks.losses import (
    closed_form_soft_label,
    clustering_regularization,
    entropy,
    kl_to_target,
    kl_to_uniform,
    logit_adjusted_ce,
    masked_pseudo_label_ce,
    sharpen,
    soft_ce,
    supcon_loss,
    supervised_contrastive,
)
from tasks.mc_dropout import mc_dropout_predict
from tasks.queue import FeatureQueue
from tasks.schedules import cosine_decay, cosine_lr

DT = torch.float64


# ---------------------------------------------------------------------------
# masked pseudo-label CE
# ---------------------------------------------------------------------------
def test_masked_pseudo_label_ce_matches_hand_loop():
    torch.manual_seed(0)
    probs = torch.tensor(
        [
            [0.97, 0.02, 0.01],  # kept (class 0)
            [0.50, 0.30, 0.20],  # masked
            [0.01, 0.96, 0.03],  # kept (class 1)
            [0.94, 0.05, 0.01],  # masked, just under tau
            [0.00, 0.00, 1.00],  # kept (class 2)
        ],
        dtype=DT,
    )
    logits = torch.randn(5, 3, dtype=DT, requires_grad=True)
    loss, mask = masked_pseudo_label_ce(logits, probs, 0.95)
    assert mask.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    expected = 0.0
    for i in range(5):
        conf = float(probs[i].max())
        if conf >= 0.95:
            c = int(probs[i].argmax())
            expected += -float(torch.log_softmax(logits.detach()[i], 0)[c])
    expected /= 5  # full batch, masked samples count as zeros
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # The unnormalised-by-mask value would differ: guards the denominator.
    assert loss.item() != pytest.approx(expected * 5 / 3)
    loss.backward()
    assert torch.all(logits.grad[1] == 0) and torch.all(logits.grad[3] == 0)


def test_masked_pseudo_label_ce_threshold_edge_and_detach():
    probs = torch.tensor([[0.5, 0.5], [0.75, 0.25]], requires_grad=True)
    logits = torch.zeros(2, 2, requires_grad=True)
    _, mask_ge = masked_pseudo_label_ce(logits, probs, 0.75)
    _, mask_gt = masked_pseudo_label_ce(logits, probs, 0.75, strict=True)
    assert mask_ge.tolist() == [0.0, 1.0]
    assert mask_gt.tolist() == [0.0, 0.0]
    loss, mask = masked_pseudo_label_ce(logits, probs, 0.0)  # Fed-Pseudo: no threshold
    assert mask.tolist() == [1.0, 1.0]
    loss.backward()
    assert probs.grad is None  # the pseudo-label side is a constant
    assert loss.item() == pytest.approx(math.log(2))


# ---------------------------------------------------------------------------
# soft targets, sharpening, closed form
# ---------------------------------------------------------------------------
def test_soft_ce_and_kl_to_target():
    torch.manual_seed(1)
    logits = torch.randn(4, 5, dtype=DT, requires_grad=True)
    t = torch.softmax(torch.randn(4, 5, dtype=DT), 1)
    t[0] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0], dtype=DT)  # 0 log 0 = 0
    q = torch.softmax(logits, 1)
    ce_ref = np.mean([-(t[i] * torch.log(q[i])).sum().item() for i in range(4)])
    kl_ref = np.mean(
        [sum(t[i, c].item() * (math.log(t[i, c].item()) - math.log(q[i, c].item()))
             for c in range(5) if t[i, c] > 0) for i in range(4)]
    )
    assert soft_ce(logits, t).item() == pytest.approx(ce_ref, rel=1e-12)
    kl = kl_to_target(logits, t)
    assert kl.item() == pytest.approx(kl_ref, rel=1e-10)
    # KL(t||q) = CE(t, q) - H(t): same gradient as soft CE
    assert kl.item() == pytest.approx(soft_ce(logits, t).item() - entropy(t).mean().item(), rel=1e-10)
    g1 = torch.autograd.grad(kl, logits)[0]
    g2 = torch.autograd.grad(soft_ce(logits, t), logits)[0]
    assert torch.allclose(g1, g2, atol=1e-12)
    assert kl_to_target(logits, torch.softmax(logits, 1)).item() == pytest.approx(0.0, abs=1e-12)


def _numerical_soft_label(p: np.ndarray, a0: float, a1: float) -> np.ndarray:
    """argmin over the simplex of a0*CE(v,p) + a1*KL(v||u), via a softmax parametrisation."""
    C = p.shape[0]
    logp = np.log(p)

    def obj(w):
        w = w - w.max()
        v = np.exp(w) / np.exp(w).sum()
        f = -a0 * np.sum(v * logp) + a1 * np.sum(v * np.log(C * v))
        g_v = -a0 * logp + a1 * (np.log(C * v) + 1.0)
        g_w = v * (g_v - np.sum(v * g_v))  # softmax Jacobian
        return f, g_w

    res = minimize(obj, np.zeros(C), jac=True, method="BFGS", options={"gtol": 1e-12, "maxiter": 10000})
    w = res.x - res.x.max()
    return np.exp(w) / np.exp(w).sum()


@pytest.mark.parametrize("a0,a1", [(1.0, 0.75), (0.3, 0.75), (2.0, 0.5), (1.0, 1.0)])
def test_closed_form_soft_label_is_the_simplex_minimiser(a0, a1):
    rng = np.random.default_rng(0)
    for _ in range(3):
        p = rng.dirichlet(np.ones(6))
        v_num = _numerical_soft_label(p, a0, a1)
        v = closed_form_soft_label(torch.tensor(p[None], dtype=DT), a0, a1)[0].numpy()
        np.testing.assert_allclose(v, v_num, atol=1e-6)
        # and it is the MixMatch sharpening at T = a1/a0
        np.testing.assert_allclose(v, p ** (a0 / a1) / np.sum(p ** (a0 / a1)), rtol=1e-10)


def test_closed_form_limits_and_log_space():
    p = torch.tensor([[0.1, 0.6, 0.3]], dtype=DT)
    assert torch.allclose(closed_form_soft_label(p, 0.0, 0.75), torch.full((1, 3), 1 / 3, dtype=DT))
    assert closed_form_soft_label(p, 1.0, 0.0).tolist() == [[0.0, 1.0, 0.0]]
    assert torch.allclose(sharpen(p, 1.0), p)
    # tiny T tends to the one-hot
    assert torch.allclose(sharpen(p, 1e-3), torch.tensor([[0.0, 1.0, 0.0]], dtype=DT), atol=1e-12)
    # from logits, extreme values: no NaN/inf thanks to log space
    s = torch.tensor([[-1000.0, 0.0, 1000.0], [3.0, 1.0, 2.0]])
    v = sharpen(s, 0.5, from_logits=True)
    assert torch.isfinite(v).all()
    assert torch.allclose(v[1], sharpen(torch.softmax(s[1:], 1), 0.5)[0], atol=1e-6)
    assert torch.allclose(v[0], torch.tensor([0.0, 0.0, 1.0]))


def test_kl_to_uniform_is_logC_minus_entropy():
    torch.manual_seed(2)
    logits = torch.randn(7, 4, dtype=DT) * 3
    p = torch.softmax(logits, 1)
    direct = (p * torch.log(p / 0.25)).sum(1).mean()
    via_h = math.log(4) - entropy(p).mean()
    assert kl_to_uniform(logits).item() == pytest.approx(direct.item(), rel=1e-12)
    assert kl_to_uniform(logits).item() == pytest.approx(via_h.item(), rel=1e-12)
    assert kl_to_uniform(torch.zeros(3, 4)).item() == pytest.approx(0.0, abs=1e-7)


def test_entropy_zero_entries():
    p = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    assert entropy(p).tolist() == pytest.approx([0.0, math.log(2)])


# ---------------------------------------------------------------------------
# logit-adjusted CE
# ---------------------------------------------------------------------------
def test_logit_adjusted_ce_uniform_prior_and_gradient():
    torch.manual_seed(3)
    s = torch.randn(6, 4, dtype=DT, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 1, 0])
    uni = torch.full((4,), 0.25, dtype=DT)
    assert logit_adjusted_ce(s, y, uni).item() == pytest.approx(F.cross_entropy(s, y).item(), rel=1e-12)

    prior = torch.tensor([0.6, 0.3, 0.1, 0.0], dtype=DT)  # class 3 absent -> clamped to 1e-8
    loss = logit_adjusted_ce(s, y, prior, reduction="sum")
    (g,) = torch.autograd.grad(loss, s)
    adj = s.detach() + torch.log(prior.clamp_min(1e-8))
    analytic = torch.softmax(adj, 1) - F.one_hot(y, 4).to(DT)
    assert torch.allclose(g, analytic, atol=1e-12)

    # central finite differences
    eps = 1e-6
    s0 = s.detach().clone()
    fd = torch.zeros_like(s0)
    for i in range(s0.shape[0]):
        for c in range(s0.shape[1]):
            sp, sm = s0.clone(), s0.clone()
            sp[i, c] += eps
            sm[i, c] -= eps
            fd[i, c] = (logit_adjusted_ce(sp, y, prior, "sum") - logit_adjusted_ce(sm, y, prior, "sum")) / (2 * eps)
    assert torch.allclose(fd, g, atol=1e-6)
    # an absent class (P = 0) effectively drops out of the softmax for present labels
    mask_y = y != 3
    assert torch.all(analytic[mask_y, 3].abs() < 1e-6)


def test_logit_adjusted_ce_per_row_prior():
    torch.manual_seed(4)
    s = torch.randn(4, 3)
    y = torch.tensor([0, 1, 2, 0])
    p1 = torch.tensor([0.7, 0.2, 0.1])
    p2 = torch.tensor([0.1, 0.1, 0.8])
    rows = torch.stack([p1, p1, p2, p2])
    got = logit_adjusted_ce(s, y, rows, reduction="none")
    exp = torch.cat([logit_adjusted_ce(s[:2], y[:2], p1, "none"), logit_adjusted_ce(s[2:], y[2:], p2, "none")])
    assert torch.allclose(got, exp)
    assert torch.allclose(logit_adjusted_ce(s, y, np.array([7.0, 2.0, 1.0])), logit_adjusted_ce(s, y, p1))


# ---------------------------------------------------------------------------
# supervised contrastive loss
# ---------------------------------------------------------------------------
def _supcon_double_loop(za, ya, zq, yq, elig_q, kappa, batch_ref, over_batch=False):
    """Direct transcription of Semi-SFL's Eq. 3 / Eq. 5 (Sec. III) with explicit loops
    (``over_batch``: the sum of the kept L_j divided by the batch size, Eq. 5's C)."""
    za = F.normalize(za, dim=1)
    zq = F.normalize(zq.detach(), dim=1) if zq is not None else None
    refs = []  # (vector, label, eligible, batch index or None)
    if batch_ref:
        for i in range(za.shape[0]):
            refs.append((za[i], int(ya[i]), True, i))
    if zq is not None:
        for i in range(zq.shape[0]):
            refs.append((zq[i], int(yq[i]), bool(elig_q[i]), None))
    losses = []
    for j in range(za.shape[0]):
        A = [r for r in refs if r[3] != j]
        P = [r for r in A if r[1] == int(ya[j]) and r[2]]
        if not P:
            continue  # skip anchors without positives
        denom = sum(torch.exp(za[j] @ a[0] / kappa) for a in A)
        lj = -sum(torch.log(torch.exp(za[j] @ p[0] / kappa) / denom) for p in P) / len(P)
        losses.append(lj)
    if not losses:
        return za.sum() * 0
    return sum(losses) / (za.shape[0] if over_batch else len(losses))


def test_supcon_T_matches_double_loop_including_gradients():
    torch.manual_seed(5)
    za = torch.randn(6, 4, dtype=DT, requires_grad=True)
    ya = torch.tensor([0, 1, 0, 2, 3, 1])  # label 3 appears once in the batch
    zq = torch.randn(5, 4, dtype=DT, requires_grad=True)
    yq = torch.tensor([0, 2, 2, 1, 4])
    conf = torch.tensor([1.0, 0.99, 0.5, 0.97, 1.0], dtype=DT)
    for kappa in (0.07, 0.5):
        # literal T: every queue entry with the same label is a positive
        got, has_pos = supcon_loss(za, ya, zq, yq, kappa=kappa, return_mask=True)
        ref = _supcon_double_loop(za, ya, zq, yq, torch.ones(5, dtype=torch.bool), kappa, True)
        assert got.item() == pytest.approx(ref.item(), rel=1e-10)
        assert has_pos.tolist() == [True, True, True, True, False, True]  # label 3: no positive -> skipped
        g_got = torch.autograd.grad(got, za)[0]
        g_ref = torch.autograd.grad(ref, za)[0]
        assert torch.allclose(g_got, g_ref, atol=1e-10)
        # wrapper with a confidence filter on queue positives
        got_w = supervised_contrastive(za, ya, zq, yq, conf, tau=0.95, kappa=kappa)
        ref_w = _supcon_double_loop(za, ya, zq, yq, conf > 0.95, kappa, True)
        assert got_w.item() == pytest.approx(ref_w.item(), rel=1e-10)
    # queue entries are constants
    loss = supcon_loss(za, ya, zq, yq)
    loss.backward()
    assert zq.grad is None


def test_clustering_regularization_matches_double_loop():
    torch.manual_seed(6)
    za = torch.randn(5, 3, dtype=DT, requires_grad=True)
    yhat = torch.tensor([0, 1, 2, 0, 1])
    zq = torch.randn(8, 3, dtype=DT)
    yq = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    conf = torch.tensor([0.99, 0.5, 0.96, 0.2, 0.3, 0.94, 1.0, 0.951], dtype=DT)
    tau = 0.95
    # class 2 has only unconfident queue entries -> anchor 2 skipped;
    # the unconfident entries still sit in the denominator.
    got, has_pos = supcon_loss(za, yhat, zq, yq, conf > tau, batch_as_reference=False, return_mask=True)
    ref = _supcon_double_loop(za, yhat, zq, yq, conf > tau, 0.07, False)
    assert has_pos.tolist() == [True, True, False, True, True]
    assert got.item() == pytest.approx(ref.item(), rel=1e-10)
    # C is divided by the batch (anchors without a positive skipped, the mean over the batch)
    ref_c = _supcon_double_loop(za, yhat, zq, yq, conf > tau, 0.07, False, over_batch=True)
    wrap = clustering_regularization(za, yhat, zq, yq, conf, tau=tau)
    assert wrap.item() == pytest.approx(ref_c.item(), rel=1e-10)
    assert wrap.item() == pytest.approx(ref.item() * 4 / 5, rel=1e-10)  # 4 of 5 anchors have a positive
    old = clustering_regularization(za, yhat, zq, yq, conf, tau=tau, reduction="positives")
    assert old.item() == pytest.approx(ref.item(), rel=1e-10)
    g1 = torch.autograd.grad(wrap, za)[0]
    g2 = torch.autograd.grad(ref_c, za)[0]
    assert torch.allclose(g1, g2, atol=1e-10)
    assert torch.all(g1[2] == 0)
    # dropping the denominator-only entries changes the value (they do count)
    no_unconf = clustering_regularization(za, yhat, zq[conf > tau], yq[conf > tau], conf[conf > tau], tau=tau)
    assert abs(no_unconf.item() - wrap.item()) > 1e-6


def test_supcon_no_positive_anywhere_is_zero_with_grad():
    za = torch.randn(3, 4, requires_grad=True)
    loss = clustering_regularization(za, torch.tensor([0, 1, 2]), torch.randn(4, 4),
                                     torch.tensor([0, 1, 2, 0]), torch.zeros(4), tau=0.95)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(za.grad == 0)
    # a single anchor with an empty queue: no NaN
    z1 = torch.randn(1, 4, requires_grad=True)
    l1 = supcon_loss(z1, torch.tensor([0]))
    l1.backward()
    assert l1.item() == 0.0 and torch.isfinite(z1.grad).all()


def test_supcon_normalisation_is_internal():
    torch.manual_seed(7)
    za = torch.randn(4, 3)
    ya = torch.tensor([0, 0, 1, 1])
    a = supcon_loss(za * 5.0, ya)
    b = supcon_loss(F.normalize(za, dim=1), ya, normalize=False)
    assert a.item() == pytest.approx(b.item(), rel=1e-5)


# ---------------------------------------------------------------------------
# two-level queue
# ---------------------------------------------------------------------------
def test_feature_queue_fifo_levels_and_checkpoint():
    q = FeatureQueue(dim=2, labeled_size=3, unlabeled_size=4, labeled_every=2)
    z = lambda vals: torch.tensor([[v, -v] for v in vals], dtype=torch.float32)  # noqa: E731
    assert len(q) == 0
    assert q.enqueue_labeled(z([1, 2]), torch.tensor([1, 2])) is True
    assert q.enqueue_labeled(z([99]), torch.tensor([9])) is False  # skipped: lower frequency
    assert q.enqueue_labeled(z([3, 4]), torch.tensor([3, 4])) is True  # overwrites oldest (1)
    q.enqueue_unlabeled(z([10, 11, 12]), torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.9, 0.99]))
    q.enqueue_unlabeled(z([13, 14]), torch.tensor([3, 4]), torch.tensor([0.1, 0.2]))  # evicts 10
    zz, yy, cc = q.tensors()
    assert q.level_sizes() == (3, 4)
    assert zz[:, 0].tolist() == [2, 3, 4, 11, 12, 13, 14]  # level 1 then level 2, oldest first
    assert yy.tolist() == [2, 3, 4, 1, 2, 3, 4]
    assert cc.tolist() == pytest.approx([1, 1, 1, 0.9, 0.99, 0.1, 0.2])
    # batch larger than capacity keeps its last rows
    q.enqueue_unlabeled(z([20, 21, 22, 23, 24, 25]), torch.arange(6), torch.ones(6))
    assert q.tensors()[0][3:, 0].tolist() == [22, 23, 24, 25]

    state = q.state_dict()
    q2 = FeatureQueue(dim=2, labeled_size=3, unlabeled_size=4, labeled_every=2)
    q2.load_state_dict(state)
    for a, b in zip(q.tensors(), q2.tensors()):
        assert torch.equal(a, b)
    # the skip counter is restored too: next labeled call (call #3) is skipped in both
    assert q.enqueue_labeled(z([7]), torch.tensor([7])) == q2.enqueue_labeled(z([7]), torch.tensor([7]))
    with pytest.raises(ValueError):
        FeatureQueue(dim=3, labeled_size=3, unlabeled_size=4).load_state_dict(state)


def test_feature_queue_detaches_inputs():
    q = FeatureQueue(dim=2, labeled_size=2, unlabeled_size=2)
    z = torch.randn(2, 2, requires_grad=True)
    q.enqueue_unlabeled(z, torch.tensor([0, 1]), torch.tensor([0.9, 0.8]))
    assert not q.tensors()[0].requires_grad


# ---------------------------------------------------------------------------
# EMA and MC-dropout
# ---------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.top = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2))

    def forward(self, x):
        return self.top(torch.relu(self.bottom(x)))


def test_ema_update_on_part_of_a_model():
    torch.manual_seed(8)
    teacher, student = _Net(), _Net()
    student.train()
    student(torch.randn(16, 3))  # moves BN running stats
    t0 = {k: v.clone() for k, v in teacher.state_dict().items()}
    s0 = {k: v.clone() for k, v in student.state_dict().items()}
    g = 0.9
    ema_update(teacher, student, g, keys=["bottom"])
    t1 = teacher.state_dict()
    for k in ("bottom.0.weight", "bottom.0.bias", "bottom.1.weight", "bottom.1.bias"):
        assert torch.allclose(t1[k], g * t0[k] + (1 - g) * s0[k])
    for k in ("bottom.1.running_mean", "bottom.1.running_var", "bottom.1.num_batches_tracked"):
        assert torch.equal(t1[k], s0[k])  # buffers copied by default
    for k in ("top.1.weight", "top.1.bias"):
        assert torch.equal(t1[k], t0[k])  # untouched part

    # submodule form + EMA'd buffers
    teacher2 = _Net()
    tb0 = {k: v.clone() for k, v in teacher2.state_dict().items()}
    ema_update(teacher2.top, student.top, 0.5, buffers="ema")
    assert torch.allclose(teacher2.state_dict()["top.1.weight"], 0.5 * tb0["top.1.weight"] + 0.5 * s0["top.1.weight"])
    ema_update(teacher2.bottom, student.bottom, 0.5, buffers="ema")
    rm = teacher2.state_dict()["bottom.1.running_mean"]
    assert torch.allclose(rm, 0.5 * tb0["bottom.1.running_mean"] + 0.5 * s0["bottom.1.running_mean"])

    # params_only leaves buffers alone; unknown keys raise
    teacher3 = _Net()
    rv = teacher3.bottom[1].running_var.clone()
    ema_update(teacher3, student, 0.9, params_only=True)
    assert torch.equal(teacher3.bottom[1].running_var, rv)
    with pytest.raises(KeyError):
        ema_update(teacher3, student, 0.9, keys=["nope"])


def test_mc_dropout_predict_restores_modes_and_entropy():
    torch.manual_seed(9)
    net = _Net()
    net.train()
    net.bottom.eval()  # mixed modes must come back exactly
    modes = {n: m.training for n, m in net.named_modules()}
    bn_stats = net.bottom[1].running_mean.clone()
    x = torch.randn(10, 3)

    torch.manual_seed(123)
    mean, ent = mc_dropout_predict(net, x, T=5)
    assert {n: m.training for n, m in net.named_modules()} == modes
    assert torch.equal(net.bottom[1].running_mean, bn_stats)  # BN in eval mode: stats untouched
    # manual reference: BN eval, dropout train, same RNG stream
    net.eval()
    net.top[0].train()
    torch.manual_seed(123)
    with torch.no_grad():
        ref = sum(torch.softmax(net(x), 1) for _ in range(5)) / 5
    assert torch.allclose(mean, ref, atol=1e-6)
    assert torch.allclose(ent, -(ref * ref.log()).sum(1), atol=1e-6)
    assert torch.allclose(mean.sum(1), torch.ones(10), atol=1e-6)
    # dropout really is active: passes differ
    net.train()
    a = mc_dropout_predict(net, x, T=1)[0]
    b = mc_dropout_predict(net, x, T=1)[0]
    assert not torch.allclose(a, b)
    # chunking gives the same mean under the same RNG draws only per chunk; check shapes
    m2, e2 = mc_dropout_predict(net, x, T=3, batch_size=4)
    assert m2.shape == (10, 2) and e2.shape == (10,)


# ---------------------------------------------------------------------------
# schedules
# ---------------------------------------------------------------------------
def test_cosine_lr_values():
    base, T, w = 0.146, 1000, 100
    assert cosine_lr(0, T, base, warmup_steps=w) == 0.0
    assert cosine_lr(50, T, base, warmup_steps=w) == pytest.approx(base / 2)
    assert cosine_lr(w, T, base, warmup_steps=w) == pytest.approx(base)  # start of decay
    # FixMatch c = 7/16 at the end: cos(7 pi / 16)
    assert cosine_lr(T, T, base, warmup_steps=w) == pytest.approx(base * math.cos(7 * math.pi / 16))
    mid = w + (T - w) / 2
    assert cosine_lr(mid, T, base, warmup_steps=w, c=7 / 16) == pytest.approx(base * math.cos(7 * math.pi / 32))
    # floor is relative: eps * gamma once the cosine would go below eps
    assert cosine_lr(T, T, base, c=0.5, floor=1e-4) == pytest.approx(base * 1e-4)
    # c = 2.3 (CIFAR-10/SVHN): floor reached at progress 1/(2c) and kept (no oscillation back up)
    p_zero = 1 / (2 * 2.3)
    assert cosine_lr(0.9 * T, T, base, c=2.3, floor=1e-4) == pytest.approx(base * 1e-4)
    assert cosine_lr(0.99 * p_zero * T, T, base, c=2.3, floor=1e-4) > base * 1e-4
    # epoch ~228 with horizon 1024 epochs and 5 warmup epochs (the SSFL authors' code, Appendix A.3)
    ipe = 1024
    assert cosine_lr(220 * ipe, 1024 * ipe, base, 5 * ipe, 1e-4, 2.3) > base * 1e-3
    assert cosine_lr(230 * ipe, 1024 * ipe, base, 5 * ipe, 1e-4, 2.3) == pytest.approx(base * 1e-4)
    # monotone non-increasing after warmup
    vals = [cosine_lr(t, T, base, warmup_steps=w, c=2.3, floor=1e-4) for t in range(w, T + 1, 7)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_cosine_decay_values():
    assert cosine_decay(0, 100, 0.02) == pytest.approx(0.02)
    assert cosine_decay(50, 100, 0.02) == pytest.approx(0.01)
    assert cosine_decay(100, 100, 0.02) == pytest.approx(0.0)
    assert cosine_decay(200, 100, 0.02, min_lr=1e-3) == pytest.approx(1e-3)
    assert cosine_decay(25, 100, 0.02) == pytest.approx(0.01 * (1 + math.cos(math.pi / 4)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_smoke():
    dev = torch.device("cuda")
    logits = torch.randn(8, 4, device=dev, requires_grad=True)
    probs = torch.softmax(torch.randn(8, 4, device=dev), 1)
    y = torch.randint(0, 4, (8,), device=dev)
    loss = masked_pseudo_label_ce(logits, probs, 0.3)[0] + soft_ce(logits, probs) + kl_to_target(logits, probs)
    loss = loss + kl_to_uniform(logits) + logit_adjusted_ce(logits, y, np.full(4, 0.25))
    q = FeatureQueue(4, 4, 8, device=dev)
    q.enqueue_labeled(torch.randn(3, 4), torch.tensor([0, 1, 2]))  # CPU input, CUDA queue
    q.enqueue_unlabeled(torch.randn(5, 4, device=dev), y[:5], probs.max(1).values[:5])
    zq, yq, cq = q.tensors()
    loss = loss + supervised_contrastive(logits, y, zq, yq, cq) + clustering_regularization(logits, y, zq, yq, cq, tau=0.2)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert sharpen(probs, 0.5).device.type == "cuda"
    net = _Net().to(dev)
    mean, ent = mc_dropout_predict(net, torch.randn(4, 3, device=dev), T=2)
    ema_update(_Net().to(dev), net, 0.9)
    assert mean.device.type == "cuda" and ent.device.type == "cuda"


def test_proximal_term_and_its_gradient_match_a_hand_computation():
    """FedProx (Li et al. 2020, Eq. 2): mu/2 ||w - w_start||^2, gradient mu (w - w_start)."""
    from tasks.losses import proximal_term
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    term = proximal_term(model, mu=0.3)
    assert float(term()) == 0.0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    value = term()
    value.backward()
    want = 0.15 * sum(float(((p - s) ** 2).sum()) for p, s in zip(model.parameters(), start))
    assert float(value) == pytest.approx(want, rel=1e-6)
    for p, s in zip(model.parameters(), start):
        torch.testing.assert_close(p.grad, 0.3 * (p.detach() - s))
