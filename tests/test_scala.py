"""SCALA's formulas (scala.md Sections 2, 3, 8.1-8.2) against the implementation."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from strategies.base import RoundPolicy
from strategies.registry import get_algorithm
from strategies.scala import ScalaStrategy, batch_shares
from tasks.config import ConfigError
from tasks.losses import logit_adjusted_ce


# --------------------------------------------------------------------------- Eq. 3
@pytest.mark.parametrize("sizes,B", [([100, 200, 300], 320), ([1, 1, 5000], 32), ([7, 7, 7], 10),
                                     ([3, 1000, 1000, 1000, 2], 16), ([5], 1), (list(range(1, 51)), 50)])
def test_batch_shares_sum_and_floor(sizes, B):
    b = batch_shares(sizes, B)
    assert sum(b) == B and min(b) >= 1 and len(b) == len(sizes)
    q = np.asarray(sizes) * B / sum(sizes)
    if (q >= 1).all():  # no client needed the B_k >= 1 bump: plain largest remainder
        assert all(np.floor(qi) <= bi <= np.ceil(qi) for qi, bi in zip(q, b))


def test_batch_shares_largest_remainder_and_errors():
    assert batch_shares([1, 1, 1], 4) == [2, 1, 1]                 # ties -> first index
    assert batch_shares([10, 25, 65], 10) == [1, 3, 6]             # 1.0, 2.5, 6.5 -> remainders to 2.5 / 6.5
    assert batch_shares([1, 1000], 4) == [1, 3]                    # B_k >= 1 taken from the largest
    with pytest.raises(ConfigError, match="scala.total-batch"):
        batch_shares([5, 5, 5], 2)


def test_batch_shares_never_one_with_batchnorm():
    """A tiny client would get B_k = 1, which a BatchNorm bottom cannot train on."""
    assert batch_shares([1, 1000], 4) == [1, 3]
    assert batch_shares([1, 1000], 4, min_share=2) == [2, 2]
    assert min(batch_shares([1, 1, 5000], 32, min_share=2)) == 2
    with pytest.raises(ConfigError, match="BatchNorm"):
        batch_shares([5, 5, 5], 5, min_share=2)


# --------------------------------------------------------------------------- Section 3
def test_g_bal_uniform_prior_is_ce_and_gradient_formula():
    torch.manual_seed(0)
    s, y = torch.randn(16, 10, requires_grad=True), torch.randint(0, 10, (16,))
    assert torch.allclose(logit_adjusted_ce(s, y, torch.full((10,), 0.1)), F.cross_entropy(s, y), atol=1e-6)
    p = torch.rand(10) + 0.01
    loss = logit_adjusted_ce(s, y, p, reduction="sum")
    (g,) = torch.autograd.grad(loss, s)
    expect = torch.softmax(s + torch.log(p), 1) - F.one_hot(y, 10).float()
    assert torch.allclose(g, expect, atol=1e-6)


def _strategy(algo="scala", extra=""):
    raw = fused_run_config([f"algo='{algo}' model='cnn' norm='bn' dropout=0.0 momentum=0.0 lr=0.1 "
                            f"scala.total-batch=12 {extra}"])
    p = parse_run_config(raw)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=1))
    s.setup(None)
    return s


def _fake_round(s, hists):
    nodes = list(range(101, 101 + len(hists)))
    for i, (n, h) in enumerate(zip(nodes, hists)):
        h = np.asarray(h, dtype=np.int64)
        s.info[n] = {"partition": i, "n": int(h.sum()), "hist": h}
    s.begin_round(1, nodes)
    return nodes


def test_priors_from_histograms():
    s = _strategy()
    hists = [[30, 10, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 20, 20, 0, 0, 0, 0, 0, 0], [0] * 9 + [40]]
    nodes = _fake_round(s, hists)
    p_s, p_k = s.priors(nodes, [])
    h = np.asarray(hists, dtype=np.float64)
    assert np.allclose(p_s.numpy(), h.sum(0) / h.sum())                # P_s = sum n_k / sum |D_k|
    for pk, hk in zip(p_k, h):
        assert np.allclose(pk.numpy(), hk / hk.sum())                    # P_k = n_k / |D_k|
    assert s.round_batch == dict(zip(nodes, batch_shares([40, 40, 40], 12)))


def _losses(top, acts, ys, p_s, p_ks, sizes):
    logits = top(acts)
    l_srv = logit_adjusted_ce(logits, ys, p_s)
    out, s = [], 0
    for pk, b in zip(p_ks, sizes):
        out.append(logit_adjusted_ce(logits[s:s + b], ys[s:s + b], pk))
        s += b
    return l_srv, out


def test_client_gradient_finite_difference_and_server_step():
    """G_k = dL_k/dA_k (Eq. 13, mean over B_k, w_s before the step); w_s steps on L_srv (Eqs. 5, 12)."""
    s = _strategy()
    hists = [[30, 10, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 20, 20, 0, 0, 0, 0, 0, 0], [5] * 8 + [0, 0]]
    nodes = _fake_round(s, hists)
    torch.manual_seed(1)
    sizes = [s.round_batch[n] for n in nodes]
    payloads = {n: {"act": torch.randn(b, *s.act_shape),
                    "labels": torch.from_numpy(np.random.default_rng(i).choice(
                        np.flatnonzero(np.asarray(hists[i])), b)).long()}
                for i, (n, b) in enumerate(zip(nodes, sizes))}
    top0 = copy.deepcopy(s.top).double()
    grads = s.server_iteration(1, payloads)
    acts = torch.cat([payloads[n]["act"] for n in nodes]).double()
    ys = torch.cat([payloads[n]["labels"] for n in nodes])
    p_s, p_ks = s.priors(nodes, [])
    p_s, p_ks = p_s.double(), [p.double() for p in p_ks]
    eps, rng = 1e-5, np.random.default_rng(0)
    start = 0
    for k, (n, b) in enumerate(zip(nodes, sizes)):
        g = grads[n]["act"].double()
        assert g.shape == payloads[n]["act"].shape
        for _ in range(6):
            j = tuple(int(rng.integers(0, d)) for d in g.shape)
            plus, minus = acts.clone(), acts.clone()
            plus[(start + j[0],) + j[1:]] += eps
            minus[(start + j[0],) + j[1:]] -= eps
            fd = (_losses(top0, plus, ys, p_s, p_ks, sizes)[1][k] - _losses(top0, minus, ys, p_s, p_ks, sizes)[1][k]) / (2 * eps)
            assert abs(float(fd) - float(g[j])) <= 1e-4 * max(1.0, abs(float(fd))), (k, j, float(fd), float(g[j]))
        start += b
    # server step: w_s^{i+1} = w_s^i - lr * grad L_srv (momentum 0)
    acts_r = acts.clone()
    l_srv, _ = _losses(top0, acts_r, ys, p_s, p_ks, sizes)
    g_top = torch.autograd.grad(l_srv, list(top0.parameters()))
    for (name, p_new), p_old, gp in zip(s.top.named_parameters(), top0.parameters(), g_top):
        assert torch.allclose(p_new.double(), p_old - 0.1 * gp, atol=1e-6), name


def test_ca_sfl_is_plain_ce_and_variants_switch():
    specs = {n: get_algorithm(n) for n in ("scala", "ca-sfl", "lla-sfl", "splitfed-v1", "splitfed-v2")}
    assert {n: (s.overrides["server_mode"], s.overrides["logit_adjust"]) for n, s in specs.items()} == {
        "scala": ("concat", True), "ca-sfl": ("concat", False), "lla-sfl": ("per-client", True),
        "splitfed-v1": ("per-client", False), "splitfed-v2": ("sequential", False)}
    assert all(s.strategy_cls is ScalaStrategy for s in specs.values())
    s = _strategy("ca-sfl")
    nodes = _fake_round(s, [[10] * 10, [10] * 10])
    torch.manual_seed(2)
    payloads = {n: {"act": torch.randn(s.round_batch[n], *s.act_shape),
                    "labels": torch.randint(0, 10, (s.round_batch[n],))} for n in nodes}
    top0 = copy.deepcopy(s.top)
    grads = s.server_iteration(1, payloads)
    for n in nodes:  # CA-SFL: G_k from the client's own mean CE
        a = payloads[n]["act"].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(top0(a), payloads[n]["labels"]), a)
        assert torch.allclose(g, grads[n]["act"], atol=1e-6)


def test_bad_config_values_name_the_key():
    for override, needle in (("scala.server-mode='ring'", "scala.server-mode"),
                             ("scala.local-iterations=0", "scala.local-iterations"),
                             ("scala.prior='x'", "scala.prior")):
        with pytest.raises(ConfigError, match=needle):
            parse_run_config(fused_run_config([f"algo='scala' {override}"]))
