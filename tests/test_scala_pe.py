"""SCALA-PE (strategies/scala/scala_pe.py) and the VGG-11 bottleneck family (tasks/models.py):
the client objective f_k = L_k + gamma * Rq against hand computations and finite differences,
the bottleneck shapes, and scala-pe with gamma = 0 == scala to the last bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from split_layer.cut import split_model
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from strategies.scala.scala_pe import (
    SimulatedInverter,
    batch_ssim,
    client_objective,
    inversion_term,
    penalty_gradient,
    train_inverter,
)
from tasks.config import ConfigError
from tasks.models import build_model
from tests.flower_harness import max_diff


# --------------------------------------------------------------------------- the bottleneck
@pytest.mark.parametrize("name,widths", [("vgg11", (64, 128)), ("vgg11-small", (16, 32))])
@pytest.mark.parametrize("c,s", [(1, 28), (3, 32)])
def test_bottleneck_cut_has_8_channels_and_the_server_expands_back(name, widths, c, s):
    m = build_model(name, in_channels=c, num_classes=10, image_size=s)
    assert m.default_cut == "bottleneck"
    assert m.cut_points[:4] == ["conv1", "conv2", "bottleneck", "conv3"]
    bottom, top = split_model(m, "bottleneck")
    x = torch.randn(3, c, s, s)
    a = bottom(x)
    assert tuple(a.shape) == (3, 8, s // 4, s // 4)       # 8 x 7 x 7 at 28x28, 8 x 8 x 8 at 32x32
    squeeze = list(m.stages["bottleneck"])
    assert len(squeeze) == 1 and isinstance(squeeze[0], nn.Conv2d)           # no norm, no ReLU ("norelu")
    assert (squeeze[0].in_channels, squeeze[0].out_channels, squeeze[0].stride) == (widths[1], 8, (1, 1))
    expand = m.stages["conv3"][0]
    assert isinstance(expand, nn.Conv2d) and (expand.in_channels, expand.out_channels) == (8, widths[1])
    assert isinstance(m.stages["conv3"][1], nn.Conv2d)                        # no ReLU after the expansion
    assert top(a).shape == (3, 10)


def test_vgg11_without_bottleneck_is_plain_vgg11():
    m = build_model("vgg11", in_channels=3, num_classes=10, image_size=32, bottleneck=0)
    assert m.cut_points == [f"conv{i}" for i in range(1, 9)] + ["fc1", "fc2"] and m.default_cut == "conv2"
    convs = [mod for mod in m.modules() if isinstance(mod, nn.Conv2d)]
    assert [cv.out_channels for cv in convs] == [64, 128, 256, 256, 512, 512, 512, 512]


# --------------------------------------------------------------------------- Rq by hand
def test_inversion_term_by_hand():
    r = torch.tensor([[[[0.0, 0.5], [1.0, 0.25]]]])
    x = torch.tensor([[[[0.5, 0.5], [0.0, 0.25]]]])
    # -MSE = -(0.25 + 0 + 1 + 0) / 4
    assert float(inversion_term(r, x, "neg-mse")) == pytest.approx(-0.3125)
    img = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    # SSIM(x, x) = 1: Rq = 1 - s0 above the threshold, plain SSIM with s0 = 0
    assert float(inversion_term(img, img, "ssim", 0.5)) == pytest.approx(0.5, abs=1e-6)
    assert float(inversion_term(img, img, "ssim", 0.0)) == pytest.approx(1.0, abs=1e-6)
    # a reconstruction below the threshold costs nothing and has no gradient
    bad = torch.full_like(img, 0.5).requires_grad_(True)
    t = inversion_term(bad, img, "ssim", 0.9)
    assert float(t.detach()) == 0.0
    t.backward()
    assert float(bad.grad.abs().sum()) == 0.0
    with pytest.raises(ConfigError, match="scala-pe.rq"):
        inversion_term(img, img, "psnr")


def test_batch_ssim_is_the_attackers_ssim_with_same_padding():
    """The training loop's separable float32 SSIM = tasks.scala.inversion.ssim(padding='same') (pytorch_ssim's)."""
    from tasks.scala.inversion import ssim

    g = torch.Generator().manual_seed(2)
    x = torch.rand(3, 2, 14, 14, generator=g)
    y = (x + 0.2 * torch.randn(3, 2, 14, 14, generator=g)).clamp(0, 1)
    assert float(batch_ssim(x, y)) == pytest.approx(float(ssim(x, y, padding="same")), abs=1e-5)
    assert float(batch_ssim(x, x)) == pytest.approx(1.0, abs=1e-6)


def test_objective_increases_with_gamma_where_rq_is_positive():
    """Finite difference in gamma: df/dgamma = Rq, so more gamma costs more where Rq > 0."""
    g = torch.Generator().manual_seed(1)
    img = torch.rand(2, 1, 12, 12, generator=g)
    recon = (img + 0.05 * torch.randn(2, 1, 12, 12, generator=g)).clamp(0, 1)   # a good reconstruction
    ce = torch.tensor(1.7)
    rq = float(inversion_term(recon, img, "ssim", 0.5))
    assert rq > 0
    h, gamma = 1e-3, 0.3
    fd = (float(client_objective(ce, recon, img, gamma + h)) - float(client_objective(ce, recon, img, gamma))) / h
    assert fd == pytest.approx(rq, rel=1e-3) and fd > 0
    assert float(client_objective(ce, recon, img, 0.0)) == pytest.approx(1.7)


# --------------------------------------------------------------------------- the client's gradient
def _setup(seed=0):
    torch.manual_seed(seed)
    bottom = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2, padding=1)).double()
    top = nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double()
    inv = SimulatedInverter((4, 6, 6), (1, 12, 12), channels=4).double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.rand(4, 1, 12, 12, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    # w_v a little trained so that it reconstructs something (and its BN has running statistics)
    opt = torch.optim.Adam(inv.parameters(), lr=1e-2)
    for _ in range(5):
        train_inverter(inv, opt, bottom(x), x, "neg-mse")
    inv.eval()
    return bottom, top, inv, x, y


def _hook_gradient(bottom, top, inv, x, y, gamma, rq, thr):
    """What the client does: G = dCE/dA from the server, plus gamma dRq/dA, backpropagated through A."""
    a = bottom(x)
    a_srv = a.detach().requires_grad_(True)
    (g_srv,) = torch.autograd.grad(F.cross_entropy(top(a_srv), y), a_srv)
    pen, _ = penalty_gradient(inv, a.detach(), x, gamma, rq, thr)
    grads = torch.autograd.grad(a, list(bottom.parameters()), g_srv + pen)
    return [gr.detach() for gr in grads]


def _objective(bottom, top, inv, x, y, gamma, rq, thr):
    a = bottom(x)
    return client_objective(F.cross_entropy(top(a), y), inv(a), x, gamma, rq, thr)


@pytest.mark.parametrize("rq,thr", [("neg-mse", 0.5), ("ssim", 0.0)])
def test_client_gradient_is_the_objective_gradient_by_finite_difference(rq, thr):
    bottom, top, inv, x, y = _setup()
    gamma = 2.0
    grads = _hook_gradient(bottom, top, inv, x, y, gamma, rq, thr)
    params = list(bottom.parameters())
    d = [torch.randn_like(p) for p in params]
    eps = 1e-5
    with torch.no_grad():
        for p, di in zip(params, d):
            p.add_(eps * di)
        f_plus = float(_objective(bottom, top, inv, x, y, gamma, rq, thr))
        for p, di in zip(params, d):
            p.sub_(2 * eps * di)
        f_minus = float(_objective(bottom, top, inv, x, y, gamma, rq, thr))
        for p, di in zip(params, d):
            p.add_(eps * di)
    fd = (f_plus - f_minus) / (2 * eps)
    analytic = sum(float((gr * di).sum()) for gr, di in zip(grads, d))
    assert analytic == pytest.approx(fd, rel=1e-5, abs=1e-9)
    # the inversion term matters and has this sign: the CE-only gradient misses the difference
    ce_only = sum(float((gr * di).sum()) for gr, di in zip(_hook_gradient(bottom, top, inv, x, y, 0.0, rq, thr), d))
    pen_fd = fd - ce_only
    flipped = ce_only - pen_fd
    assert abs(pen_fd) > 1e-4 and abs(flipped - fd) > 1e-4


@pytest.mark.parametrize("rq,thr", [("neg-mse", 0.5), ("ssim", 0.0)])
def test_a_step_on_the_objective_lowers_the_inversion_quality(rq, thr):
    """One SGD step of w_c with gamma > 0 leaves w_v's reconstruction worse than the same step with gamma = 0."""
    quality = {}
    for gamma in (0.0, 20.0):
        bottom, top, inv, x, y = _setup()
        grads = _hook_gradient(bottom, top, inv, x, y, gamma, rq, thr)
        with torch.no_grad():
            for p, gr in zip(bottom.parameters(), grads):
                p.sub_(0.2 * gr)
            quality[gamma] = float(inversion_term(inv(bottom(x)), x, rq, thr))
    assert quality[20.0] < quality[0.0] - 1e-4, quality


# --------------------------------------------------------------------------- whole runs
K, ROUNDS = 3, 2


def _run(algo: str, extra: str = "", transport: str = "message"):
    ns = "scala-pe" if algo == "scala-pe" else "scala"
    raw = fused_run_config([f"algo='{algo}' model='vgg11-small' norm='bn' partition='quantity' "
                            f"partition-classes-per-client=4 seed=3 {ns}.local-iterations=3 {ns}.total-batch=24 "
                            f"lr=0.05 momentum=0.9 num-rounds={ROUNDS} fraction-train=1.0 min-nodes=2 {extra}"])
    p = parse_run_config(raw)
    grid = LocalGrid(K, dispatch, threaded=transport == "stream")
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2, round_timeout=60),
                            split_transport=transport)
    rows: list[dict] = []
    s.start(grid, num_rounds=ROUNDS, on_round_end=lambda r, m: rows.append(dict(m)))
    grid.join()
    return s, rows


def test_gamma_zero_is_scala_and_the_term_changes_the_weights_on_both_transports():
    scala, _ = _run("scala")
    pe0, rows0 = _run("scala-pe", "scala-pe.gamma=0.0")
    assert max_diff(scala.model.state_dict(), pe0.model.state_dict()) == 0.0
    assert all(np.isfinite(r["pe-sim-ssim"]) and r["pe-penalty"] == 0.0 for r in rows0)
    extra = "scala-pe.gamma=1.0 scala-pe.rq='neg-mse' scala-pe.inverter-interval=1"
    msg, rows_m = _run("scala-pe", extra, "message")
    stream, rows_s = _run("scala-pe", extra, "stream")
    assert max_diff(msg.model.state_dict(), stream.model.state_dict()) == 0.0
    assert [r["pe-sim-mse"] for r in rows_m] == [r["pe-sim-mse"] for r in rows_s]
    assert all(r["pe-penalty"] < 0 for r in rows_m)         # gamma * (-MSE)
    assert max_diff(msg.model.state_dict(), scala.model.state_dict()) > 1e-6   # the term reached the bottom
