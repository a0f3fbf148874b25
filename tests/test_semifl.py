"""SemiFL (strategies/semisfl/semifl.py, tasks/semisfl/semifl_losses.py): each defining rule against a hand
computation (the fix + mix loss, the global-momentum update, the fix-set threshold, sBN), then
rounds through the real ClientApp dispatch with clients that do train (tau = 0: the conformance
matrix's tiny runs leave every fix set empty, so its conditions are rerun here with training on)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from strategies.core.records import ARRAYS_KEY, METRICS_KEY
from tasks.data import ArrayDataset
from tasks.semisfl.semifl_losses import (
    ClippedSGD,
    fix_mix_loss,
    fix_set,
    global_momentum_step,
    pseudo_labels,
    static_bn,
)

TRAIN = {"semifl.tau": 0.0}   # every sample confident: every client trains


def _ce(row, label):
    return -(row[label] - math.log(sum(math.exp(v) for v in row)))


def test_fix_mix_loss_matches_a_hand_computation():
    """L = mean CE(strong, yhat) + lam mean CE(mix, yhat) + (1 - lam) mean CE(mix, yhat'),
    written out with log-sum-exp for two samples and three classes."""
    strong = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]])
    mix = torch.tensor([[0.0, 1.0, 3.0], [1.0, -1.0, 0.5]])
    y, yp, lam = torch.tensor([0, 1]), torch.tensor([2, 0]), 0.3
    fix = (_ce([2.0, 0.0, -1.0], 0) + _ce([0.5, 1.5, 0.0], 1)) / 2
    m_a = (_ce([0.0, 1.0, 3.0], 0) + _ce([1.0, -1.0, 0.5], 1)) / 2
    m_b = (_ce([0.0, 1.0, 3.0], 2) + _ce([1.0, -1.0, 0.5], 0)) / 2
    loss, lf, lm = fix_mix_loss(strong, y, mix, yp, lam)
    assert float(lf) == pytest.approx(fix, rel=1e-6)
    assert float(lm) == pytest.approx(lam * m_a + (1 - lam) * m_b, rel=1e-6)
    assert float(loss) == pytest.approx(fix + lam * m_a + (1 - lam) * m_b, rel=1e-6)
    # lam weighs the two labels: swapping the partners' role is the mirror lam
    _, _, swapped = fix_mix_loss(strong, yp, mix, y, 1 - lam)
    assert float(swapped) == pytest.approx(float(lm), rel=1e-6)


def test_global_momentum_update_by_hand_and_as_sgd_with_lr_one():
    """v <- beta v + (w - wbar), w <- w - v, two rounds written out; the same as torch's SGD (lr 1,
    momentum beta) on the pseudo-gradient w - wbar (the authors' Server.update)."""
    w0 = {"a": np.array([1.0, 2.0], np.float32)}
    wbar1 = {"a": np.array([0.5, 3.0], np.float32)}
    w1, v1 = global_momentum_step(w0, wbar1, None, 0.5)
    np.testing.assert_allclose(v1["a"], [0.5, -1.0])      # w0 - wbar1
    np.testing.assert_allclose(w1["a"], [0.5, 3.0])       # = wbar1 in the first round
    wbar2 = {"a": np.array([0.0, 4.0], np.float32)}
    w2, v2 = global_momentum_step(w1, wbar2, v1, 0.5)
    np.testing.assert_allclose(v2["a"], [0.5 * 0.5 + 0.5, 0.5 * -1.0 + -1.0])   # [0.75, -1.5]
    np.testing.assert_allclose(w2["a"], [0.5 - 0.75, 3.0 + 1.5])                # overshoots wbar2
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD([p], lr=1.0, momentum=0.5)
    for wbar in (wbar1, wbar2):
        p.grad = p.detach() - torch.from_numpy(wbar["a"])
        sgd.step()
    np.testing.assert_allclose(p.detach().cpu().numpy(), w2["a"], rtol=1e-6)
    # beta = 0 is plain averaging
    np.testing.assert_allclose(global_momentum_step(w1, wbar2, v1, 0.0)[0]["a"], wbar2["a"])


class _Fixed(nn.Module):
    """Logits read off the input's first pixels (a model whose confidences are known)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return x.flatten(1)[:, :3]


def test_fix_set_keeps_confidence_at_or_above_tau_in_eval_mode():
    """q = softmax(f(x)) in eval mode; F = {max q >= tau}: probabilities 0.95 exactly, above and below."""
    probs = np.array([[0.95, 0.03, 0.02], [0.2, 0.7, 0.1], [0.01, 0.98, 0.01], [1 / 3, 1 / 3, 1 / 3]])
    logits = np.log(probs)
    x = np.zeros((4, 1, 1, 3), np.float32)
    x[:, 0, 0, :] = logits
    model = _Fixed().train()
    data = ArrayDataset(np.zeros((4, 1, 1, 3), np.uint8), np.zeros(4, np.int64))
    view = lambda xb: torch.from_numpy(x).to(xb.device)   # noqa: E731 - the "view" returns the logits
    yhat, conf = pseudo_labels(model, data, view, torch.device("cpu"), seed=0)
    assert model.training                                   # mode restored
    np.testing.assert_array_equal(yhat.numpy(), [0, 1, 1, 0])
    np.testing.assert_allclose(conf.numpy(), probs.max(1), rtol=1e-5)
    np.testing.assert_array_equal(fix_set(torch.tensor([0.95, 0.7, 0.98, 1 / 3]), 0.95), [0, 2])
    np.testing.assert_array_equal(fix_set(conf, 0.9), [0, 2])
    np.testing.assert_array_equal(fix_set(conf, 0.0), [0, 1, 2, 3])
    assert len(fix_set(conf, 0.99)) == 0


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(),
                        nn.Linear(2 * 4 * 4, 3), nn.BatchNorm1d(3))
    with torch.no_grad():
        net[1].weight.copy_(torch.tensor([1.5, 0.5]))
        net[1].bias.copy_(torch.tensor([0.1, -0.2]))
        for bn in (net[1], net[5]):   # stale statistics, to be replaced
            bn.running_mean.fill_(7.0)
            bn.running_var.fill_(9.0)
    return net


def test_static_bn_equals_a_from_scratch_pass_over_the_server_data():
    """Running statistics = the mean over the batches (5, 5, 3 samples: no batch of 1) of the batch
    mean and unbiased variance, computed here with plain tensor ops layer by layer (the second
    BN's inputs normalised by the first's batch statistics, as in train mode)."""
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.integers(0, 256, (13, 1, 4, 4), dtype=np.uint8), np.zeros(13, np.int64))
    view = lambda xb: xb.float() / 255.0   # noqa: E731
    net = _bn_net()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    conv, bn1, lin, bn2 = net[0], net[1], net[4], net[5]
    m1, v1, m2, v2 = [], [], [], []
    with torch.no_grad():
        for s, t in ((0, 5), (5, 10), (10, 13)):
            h = conv(view(torch.from_numpy(data.x[s:t])))
            m1.append(h.mean((0, 2, 3)))
            v1.append(h.var((0, 2, 3), unbiased=True))
            hn = (h - h.mean((0, 2, 3), keepdim=True)) / torch.sqrt(h.var((0, 2, 3), unbiased=False, keepdim=True)
                                                                    + bn1.eps)
            hn = hn * bn1.weight[None, :, None, None] + bn1.bias[None, :, None, None]
            z = lin(torch.relu(hn).flatten(1))
            m2.append(z.mean(0))
            v2.append(z.var(0, unbiased=True))
    assert static_bn(net.eval(), data, view, batch_size=5, device=torch.device("cpu"), seed=0) == 2
    for bn, m, v in ((bn1, m1, v1), (bn2, m2, v2)):
        torch.testing.assert_close(bn.running_mean, torch.stack(m).mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, torch.stack(v).mean(0), rtol=1e-5, atol=1e-6)
        assert int(bn.num_batches_tracked) == 3 and bn.momentum == 0.1   # momentum restored
    assert not net.training                                               # mode restored
    assert all(torch.equal(params[k], v) for k, v in net.named_parameters())
    # a model without running statistics: nothing to do
    assert static_bn(nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), data, view, 5, torch.device("cpu"), 0) == 0


def test_clipped_sgd_clips_the_global_norm_before_the_step():
    p = nn.Parameter(torch.zeros(2))
    opt = ClippedSGD([p], lr=1.0, clip_norm=1.0)
    p.grad = torch.tensor([3.0, 4.0])     # norm 5 -> (0.6, 0.8)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.6, -0.8]))
    q = nn.Parameter(torch.zeros(2))
    q.grad = torch.tensor([3.0, 4.0])
    ClippedSGD([q], lr=1.0, clip_norm=0.0).step()
    torch.testing.assert_close(q.detach(), torch.tensor([-3.0, -4.0]))


# ----------------------------------------------------------------------------------- rounds
def _spy(grid):
    """The replies to the run's training messages (not the partition query at the run's start)."""
    from flwr.app import MessageType

    from flower_apps.client_app import dispatch

    replies = []

    def handler(msg, ctx):
        reply = dispatch(msg, ctx)
        if msg.metadata.message_type == MessageType.TRAIN:
            replies.append(reply)
        return reply

    grid.handler = handler
    return replies


def test_server_update_is_global_momentum_over_the_uploads(monkeypatch):
    """Two rounds with the server's fine-tuning switched off: the global parameters are
    w <- w - v, v <- 0.5 v + (w - mean of the uploads), from the uploads the clients really sent."""
    from strategies.semisfl.semifl import SemiFLStrategy
    from tests.test_conformance import build, run

    monkeypatch.setattr(SemiFLStrategy, "server_stage", lambda self, rnd, lr, tag: {"train-loss": 0.0})
    s, grid = build("semifl", **TRAIN)
    replies = _spy(grid)
    s.setup(grid)
    keys = s.keys
    w = {k: v.detach().cpu().numpy().astype(np.float64).copy() for k, v in s.model.state_dict().items() if k in keys}
    res, rows = run(s, grid, rounds=2)
    assert [r["trained-clients"] for r in rows] == [4, 4]
    v = {k: np.zeros_like(a) for k, a in w.items()}
    for rnd in (1, 2):
        ups = [r.content.array_records[ARRAYS_KEY] for r in replies
               if int(r.content.metric_records[METRICS_KEY]["trained"]) and
               r.metadata.group_id == str(rnd)]
        assert len(ups) == 4
        for k in keys:
            mean = np.mean([u[k].numpy().astype(np.float64) for u in ups], axis=0)
            v[k] = 0.5 * v[k] + (w[k] - mean)
            w[k] = w[k] - v[k]
    final = s.model.state_dict()
    for k in keys:
        np.testing.assert_allclose(final[k].numpy(), w[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(np.abs(v[k]).max() > 1e-4 for k in keys)   # the update did move the model


def test_a_client_with_no_confident_sample_skips_and_sends_nothing_up():
    """tau = 1: nothing is confident, every client says so (trained = 0), no weights travel up, and
    only the server's fine-tuning moves the model."""
    from tests.test_conformance import build, run

    s, grid = build("semifl", **{"semifl.tau": 1.0})
    replies = _spy(grid)
    res, rows = run(s, grid, rounds=1)
    assert rows[0]["participants"] == 4 and rows[0]["trained-clients"] == 0 and rows[0].get("skipped", 0) == 0
    assert all(ARRAYS_KEY not in r.content.array_records for r in replies)
    assert all(r.content.metric_records[METRICS_KEY]["trained"] == 0.0 for r in replies)
    assert rows[0].get("bytes.weights.up", 0) == 0 and rows[0]["bytes.weights.down"] > 0
    assert rows[0]["fix-rate"] == 0.0 and math.isfinite(rows[0]["server-train-loss"])


def test_clients_keep_their_momentum_and_server_first_trains_before_round_one():
    """With tau = 0 every client trains and stores its SGD momentum (node state); with
    server-first the weights sent in round 1 are no longer the initial ones."""
    from strategies.semisfl.semifl import OPT_STATE_KEY
    from tests.test_conformance import build, run

    s, grid = build("semifl", **TRAIN, **{"semifl.server-first": True})
    s.setup(grid)
    init = {k: v.detach().clone() for k, v in s.model.state_dict().items()}
    res, rows = run(s, grid, rounds=1)
    assert all(OPT_STATE_KEY in ctx.state for ctx in grid.contexts.values())
    first = next(m for m in grid.sent if ARRAYS_KEY in m.content.array_records)
    sent = first.content.array_records[ARRAYS_KEY]
    assert any(not np.array_equal(sent[k].numpy(), init[k].numpy()) for k in init)
    assert "server-first-loss" in rows[0] and rows[0]["trained-clients"] == 4 and rows[0]["fix-rate"] == 1.0


@pytest.mark.parametrize("condition", ["resume", "accelerator", "initial-arrays", "all-nodes",
                                       "initial-arrays-server-first", "resume-server-first"])
def test_conformance_conditions_with_training_clients(condition, monkeypatch, tmp_path):
    """The conformance matrix's conditions for semifl, rerun with tau = 0 (the tiny runs there leave
    every fix set empty): resume gives the same weights (client momentum from the node-state
    folder, the server's velocity from the checkpoint), nothing mixes devices, the first weights
    sent are the initial arrays, and the returned model is the evaluated one."""
    import tests.test_conformance as tc

    first = {"semifl.server-first": True} if condition.endswith("-server-first") else {}
    monkeypatch.setattr(tc, "TINY", {**tc.TINY, **TRAIN, **first})
    condition = condition.removesuffix("-server-first")
    if condition == "resume":
        tc.test_conformance_resume_equals_uninterrupted("semifl", tmp_path)
    elif condition == "accelerator":
        tc.test_conformance_accelerator_placement("semifl", monkeypatch)
    elif condition == "initial-arrays":
        tc.test_conformance_initial_arrays("semifl")
    else:
        tc.test_conformance_all_nodes_result("semifl", monkeypatch)


def test_bad_knob_values_name_the_key():
    from strategies.semisfl.semifl import SemiFLStrategy
    from tasks.config import ConfigError

    with pytest.raises(ConfigError, match="tau=1.5 is out of range"):
        SemiFLStrategy(tau=1.5)
    with pytest.raises(ConfigError, match="lr_schedule='step'.*cosine, constant"):
        SemiFLStrategy(lr_schedule="step")
    with pytest.raises(ConfigError, match="global_momentum=1.0 is out of range"):
        SemiFLStrategy(global_momentum=1.0)


def test_fix_set_accuracy_only_with_the_nodes_consent(monkeypatch):
    """fix-correct (pseudo-labels against the hidden labels) leaves a node only with its consent;
    the server turns it into pseudo-label-accuracy = correct / fix-size over the consenting nodes."""
    from strategies.core.records import LABEL_CONSENT_ENV, LABEL_CONSENT_KEY
    from tests.test_conformance import build, run

    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    for consent in (False, True):
        s, grid = build("semifl", **TRAIN, grid_kw={"node_config": {LABEL_CONSENT_KEY: consent}})
        replies = _spy(grid)
        _, rows = run(s, grid, rounds=1)
        sent = [dict(r.content.metric_records[METRICS_KEY]) for r in replies]
        if not consent:
            assert all("fix-correct" not in m for m in sent) and "pseudo-label-accuracy" not in rows[0]
            assert rows[0]["label-metrics-nodes"] == 0
        else:
            assert rows[0]["label-metrics-nodes"] == 4
            want = sum(m["fix-correct"] for m in sent) / sum(m["fix-size"] for m in sent)
            assert rows[0]["pseudo-label-accuracy"] == pytest.approx(want) and 0.0 <= want <= 1.0
