"""Semi-SFL server core against the paper's formulas (Sec. III Eqs. 1-8, Sec. IV-B Eq. 9), on tiny tensors."""
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from strategies.semisfl.semisfl import SemiSFLConfig, semisfl_server
from tasks.semisfl.server_core import HIDDEN_LABELS, STUDENT, TEACHER, KsController, milestone_period
from tasks.config import ConfigError, parse_dataclass
from tasks.data import ArrayDataset
from tasks.models import build_model

C_CLASSES = 3


class IdentityAug:
    """Weak = strong = test = x/255 (makes the labeled step reproducible in a test)."""

    in_channels, image_size = 1, 4

    def test(self, x):
        return x.float() / 255.0

    weak = strong = test


def make_server(**over):
    torch.manual_seed(0)
    model = build_model("mlp", in_channels=1, num_classes=C_CLASSES, image_size=4, norm="none", hidden=(8,))
    rng = np.random.default_rng(0)
    labeled = ArrayDataset(rng.integers(0, 256, (6, 1, 4, 4), dtype=np.uint8), np.array([0, 1, 2, 0, 1, 2]))
    cfg = dataclasses.replace(SemiSFLConfig(), proj_dim=4, proj_hidden=5, queue_labeled=8, queue_unlabeled=16,
                              tau=0.6, kappa=0.5, **over)
    return semisfl_server(model, cfg, cut="fc1", labeled=labeled, augmenter=IdentityAug(), device=torch.device("cpu"),
                          lr=0.1, momentum=0.0, weight_decay=0.0, seed=0, num_rounds=10)


# ----------------------------------------------------------------------------- direct formulas
def direct_h_u(logits, q, tau):
    conf, yhat = q.max(1)
    terms = [F.cross_entropy(logits[j:j + 1], yhat[j:j + 1]) if conf[j] > tau else logits.sum() * 0
             for j in range(len(q))]
    return sum(terms) / len(q)


def direct_c(z, yhat, qz, qy, qc, tau, kappa):
    """Eq. 5 with an explicit double loop: P^(j) = {p in Q: c_p > tau, yhat_p = yhat_j}."""
    z = F.normalize(z, dim=1)
    qz = F.normalize(qz, dim=1)
    losses = []
    for j in range(len(z)):
        pos = [p for p in range(len(qz)) if qc[p] > tau and qy[p] == yhat[j]]
        if not pos:
            continue  # skipped (its term is undefined)
        denom = sum(torch.exp(z[j] @ qz[a] / kappa) for a in range(len(qz)))
        losses.append(-sum(torch.log(torch.exp(z[j] @ qz[p] / kappa) / denom) for p in pos) / len(pos))
    return sum(losses) / len(z) if losses else z.sum() * 0  # the batch mean


def direct_t(z, y, qz, qy, kappa, qc=None, tau=None):
    """Eq. 3 with references = batch minus j plus queue, P(j) = same label (queue entries
    only with c > tau when ``tau`` is given: ``supcon-queue-positives='confident'``)."""
    z = F.normalize(z, dim=1)
    ok = [True] * len(qz) if tau is None else [bool(qc[i] > tau) for i in range(len(qz))]
    refs = [(z[i], int(y[i]), i, True) for i in range(len(z))] + [
        (F.normalize(qz[i], dim=0), int(qy[i]), None, ok[i]) for i in range(len(qz))]
    losses = []
    for j in range(len(z)):
        a_set = [(r, ly, e) for r, ly, i, e in refs if i != j]
        pos = [r for r, ly, e in a_set if ly == int(y[j]) and e]
        if not pos:
            continue
        denom = sum(torch.exp(z[j] @ r / kappa) for r, _, _ in a_set)
        losses.append(-sum(torch.log(torch.exp(z[j] @ p / kappa) / denom) for p in pos) / len(pos))
    return sum(losses) / len(losses)


def payloads(seed=1, sizes=(5, 4), hidden=False):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for node, d in enumerate(sizes):
        out[10 + node] = {STUDENT: torch.randn(d, 8, generator=g), TEACHER: torch.randn(d, 8, generator=g) * 3}
        if hidden:
            out[10 + node][HIDDEN_LABELS] = torch.randint(0, C_CLASSES, (d,), generator=g)
    return out


def prefill_queue(s, n=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    s.queue.enqueue_labeled(torch.randn(4, 4, generator=g), torch.tensor([0, 1, 2, 0]))
    s.queue.enqueue_unlabeled(torch.randn(n, 4, generator=g), torch.randint(0, C_CLASSES, (n,), generator=g),
                              torch.rand(n, generator=g))


# ----------------------------------------------------------------------------- stage C
def test_cross_iteration_matches_formulas_and_routes_gradients():
    s = make_server()
    prefill_queue(s)
    pl = payloads(hidden=True)
    top0 = [p.detach().clone() for p in s.top.parameters()]
    proj0 = [p.detach().clone() for p in s.proj.parameters()]
    # expected, computed directly on copies of the parameters
    with torch.no_grad():
        teach = {n: torch.softmax(s.t_top(pl[n][TEACHER]), 1) for n in pl}
        tz = {n: s.t_proj(pl[n][TEACHER]) for n in pl}
    qz, qy, qc = s.queue.tensors()
    for n in pl:  # the barrier's teacher features are enqueued before C (strategies/semisfl/semisfl.py)
        conf, yhat = teach[n].max(1)
        qz, qy, qc = torch.cat([qz, tz[n]]), torch.cat([qy, yhat]), torch.cat([qc, conf])
    exp_grad_e, top_g, proj_g, masks = {}, [torch.zeros_like(p) for p in top0], [torch.zeros_like(p) for p in proj0], []
    for n in pl:
        e = pl[n][STUDENT].clone().requires_grad_(True)
        yhat = teach[n].argmax(1)
        h = direct_h_u(s.top(e), teach[n], 0.6)
        c = direct_c(s.proj(e), yhat, qz, qy, qc, 0.6, 0.5)
        assert float(c.detach()) > 0  # the test exercises C
        g = torch.autograd.grad(h + c, [e, *s.top.parameters(), *s.proj.parameters()], allow_unused=True)
        exp_grad_e[n] = g[0]
        # C never reaches w_s, H_u never reaches w_p
        gh_proj = torch.autograd.grad(h, list(s.proj.parameters()), allow_unused=True)
        gc_top = torch.autograd.grad(c, list(s.top.parameters()), allow_unused=True)
        assert all(x is None for x in gh_proj) and all(x is None for x in gc_top)
        for acc, gi in zip(top_g + proj_g, g[1:]):
            acc += gi
        masks.append(teach[n].max(1).values > 0.6)
    grads = s.cross_iteration(pl)
    for n in pl:
        assert torch.allclose(grads[n][STUDENT], exp_grad_e[n], atol=1e-6)  # per client, unscaled
    for p, p0, g in zip(s.top.parameters(), top0, top_g):
        assert torch.allclose(p, p0 - 0.1 * g / 2, atol=1e-6)  # one step, gradient averaged over 2 clients
    for p, p0, g in zip(s.proj.parameters(), proj0, proj_g):
        assert torch.allclose(p, p0 - 0.1 * g / 2, atol=1e-6)
    m = s.pop_cross_metrics()
    mask = torch.cat(masks).float()
    assert m["mask-rate"] == pytest.approx(float(mask.mean()))
    assert 0 < m["mask-rate"] < 1 and "impurity" in m and 0 <= m["impurity"] <= 1
    assert s.queue.level_sizes() == (4, 6 + 9)  # capacity 16: nothing dropped


def test_no_cluster_leaves_proj_and_gives_h_u_gradient_only():
    s = make_server(clustering=False, supcon=False)
    prefill_queue(s)
    pl = payloads()
    proj0 = [p.detach().clone() for p in s.proj.parameters()]
    with torch.no_grad():
        teach = {n: torch.softmax(s.t_top(pl[n][TEACHER]), 1) for n in pl}
    exp = {}
    for n in pl:
        e = pl[n][STUDENT].clone().requires_grad_(True)
        exp[n] = torch.autograd.grad(direct_h_u(s.top(e), teach[n], 0.6), e)[0]
    grads = s.cross_iteration(pl)
    for n in pl:
        assert torch.allclose(grads[n][STUDENT], exp[n], atol=1e-6)
    assert all(torch.equal(p, p0) for p, p0 in zip(s.proj.parameters(), proj0))
    assert s.queue.level_sizes() == (4, 6)  # no-cluster: the queue is not used
    assert "impurity" not in s.pop_cross_metrics()  # no hidden labels sent


def test_teacher_top_is_ema_of_student_top_after_cross_step():
    s = make_server()
    t0 = [p.detach().clone() for p in s.t_top.parameters()]
    s.cross_iteration(payloads())
    for t, t_old, p in zip(s.t_top.parameters(), t0, s.top.parameters()):
        assert torch.allclose(t, 0.99 * t_old + 0.01 * p, atol=1e-7)


# ----------------------------------------------------------------------------- stage A
def test_supervised_step_loss_is_ce_plus_T_with_queue_and_fills_level1():
    s = make_server(labeled_batch_size=6)
    prefill_queue(s)
    qz, qy, qc = s.queue.tensors()
    assert (qc <= 0.6).any()  # unconfident level-2 entries exist: they must not be positives of T
    x = torch.from_numpy(s.labeled.x).float() / 255
    y = torch.from_numpy(s.labeled.y)
    with torch.no_grad():
        e = s.bottom(x)
        expected = F.cross_entropy(s.top(e), y) + direct_t(s.proj(e), y, qz, qy, 0.5, qc, 0.6)
        literal = F.cross_entropy(s.top(e), y) + direct_t(s.proj(e), y, qz, qy, 0.5)
    assert float(expected) != pytest.approx(float(literal), rel=1e-4)  # the two rules differ here
    t0 = [p.detach().clone() for p in s.teacher.parameters()]
    m = s.supervised_stage(1, steps=1)
    assert m["sup-loss"] == pytest.approx(float(expected), rel=1e-5)
    for t, t_old, p in zip(s.teacher.parameters(), t0, s.model.parameters()):
        assert torch.allclose(t, 0.99 * t_old + 0.01 * p, atol=1e-7)  # EMA of the whole teacher per step
    assert s.queue.level_sizes()[0] == 8  # 4 + 6 labeled rows, capacity 8
    s_all = make_server(labeled_batch_size=6, supcon_queue_positives="all")
    prefill_queue(s_all)
    assert s_all.supervised_stage(1, steps=1)["sup-loss"] == pytest.approx(float(literal), rel=1e-5)
    # without T, level 1 still fills for C (its confident positives include level 1) ...
    s2 = make_server(labeled_batch_size=6, supcon=False)
    with torch.no_grad():
        ce = F.cross_entropy(s2.model(x), y)
    assert s2.supervised_stage(1, steps=1)["sup-loss"] == pytest.approx(float(ce), rel=1e-5)
    assert s2.queue.level_sizes() == (6, 0)
    # ... and stays empty when no loss reads the queue
    s3 = make_server(labeled_batch_size=6, supcon=False, clustering=False)
    s3.supervised_stage(1, steps=1)
    assert s3.queue.level_sizes() == (0, 0)


# ----------------------------------------------------------------------------- K_s rule
def test_ks_controller_scripted_sequence():
    c = KsController(8, rho1=0.01, rho2=0.05, momentum=0.0, window=2, milestone_every=4, max_factor=4)
    ks = [c.update(h, l) for h, l in enumerate([3.0, 2.0, 1.0, 0.5], start=1)]
    # milestone h=4: windows [3,2] vs [1,0.5]: |Delta| = 1.75 > rho2 -> double
    assert ks == [8, 8, 8, 16] and c.last_delta == pytest.approx(-1.75)
    ks = [c.update(h, l) for h, l in enumerate([0.5, 0.5, 0.5, 0.5], start=5)]
    # h=8: windows [0.5,0.5] vs [0.5,0.5]: |Delta| = 0 < rho1 -> halve
    assert ks == [16, 16, 16, 8]
    ks = [c.update(h, l) for h, l in enumerate([0.5, 0.5, 0.48, 0.48], start=9)]
    # h=12: |Delta| = 0.02 in [rho1, rho2] -> unchanged
    assert ks == [8, 8, 8, 8]
    for h, l in enumerate([5, 9, 20, 40, 80, 160, 320, 640], start=13):
        k = c.update(h, float(l))
    assert k == 32  # doubled at 16 and 20, clamped at 4 * K_s^1
    c2 = KsController(3, momentum=0.0, window=1, milestone_every=1)
    assert [c2.update(h, 1.0) for h in range(1, 5)] == [3, 2, 1, 1]  # 3/2 = 1.5 -> 2 (half up); floor at 1


def test_ks_controller_moving_average_and_fixed():
    c = KsController(4, momentum=0.9, window=10, milestone_every=100, adaptive=False)
    c.update(1, 2.0)
    c.update(2, 1.0)
    assert c.lhat == pytest.approx(0.9 * 2.0 + 0.1 * 1.0)
    for h in range(3, 201):
        assert c.update(h, 100.0 / h) == 4  # fixed K_s ignores any Delta
    assert milestone_period(SemiSFLConfig(), 1000) == 100 and milestone_period(SemiSFLConfig(), 30) == 3
    assert milestone_period(SemiSFLConfig(milestone_every=7), 30) == 7


def test_server_controller_gets_mean_supervised_loss():
    s = make_server(labeled_batch_size=3, k_s=2, milestone_every=1, window=1, rho1=10.0, rho2=20.0)
    s.supervised_stage(1)
    m = s.end_round(1)
    assert m["ks-next"] == 2  # only one lhat value: no Delta yet
    s.supervised_stage(2)
    assert s.end_round(2)["ks-next"] == 1  # |Delta| < rho1 = 10 -> halved


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("key, value, needle", [
    ("semisfl.tau", 1.5, "semisfl.tau=1.5 is out of range"),
    ("semisfl.k-s", 0, "semisfl.k-s=0 is out of range"),
    ("semisfl.supcon-references", "queue", "semisfl.supcon-references='queue' is not one of"),
    ("semisfl.rho1", 0.2, "semisfl.rho1=0.2 must be <= semisfl.rho2"),
    ("semisfl.kapa", 0.1, "unknown run-config key 'semisfl.kapa'"),
])
def test_config_errors_name_the_key(key, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_dataclass(SemiSFLConfig, {key: value}, "semisfl")


def test_checkpoint_roundtrip():
    s = make_server()
    prefill_queue(s)
    s.supervised_stage(1, steps=1)
    s.cross_iteration(payloads())
    s.end_round(1)
    st = s.state_dict()
    s2 = make_server()
    s2.load_state_dict(st)
    assert s2.k_s == s.k_s and s2.queue.level_sizes() == s.queue.level_sizes()
    assert all(torch.equal(a, b) for a, b in zip(s.teacher.parameters(), s2.teacher.parameters()))
    assert math.isfinite(s2.controller.lhat)
