"""FedProx and FedLC (strategies/fedprox.py): each one's defining rule against a hand
computation, and a round through the real ClientApp dispatch. The conformance matrix runs both
under every condition (tests/test_conformance.py, from the registry)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tasks.losses import calibrated_ce, proximal_term


def test_fedprox_step_is_the_proximal_gradient_step_by_hand():
    """One SGD step on F(w) + mu/2 ||w - w^t||^2 is w - lr (grad F(w) + mu (w - w^t)),
    checked on a linear model whose gradient is written out by hand."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    w_t = model.weight.detach().clone()                # the global weights the round starts from
    prox = proximal_term(model, mu=0.5)
    with torch.no_grad():
        model.weight += torch.tensor([[0.2, -0.1, 0.3]])   # the client has moved away from w^t
    x, y = torch.tensor([[1.0, 2.0, -1.0]]), torch.tensor([[0.5]])
    w = model.weight.detach().clone()
    loss = 0.5 * ((model(x) - y) ** 2).sum() + prox()
    loss.backward()
    grad_f = (x @ w.T - y) * x                          # d/dw 1/2 (w.x - y)^2
    assert torch.allclose(model.weight.grad, grad_f + 0.5 * (w - w_t), atol=1e-6)
    # the term itself: mu/2 ||w - w^t||^2
    assert float(prox()) == pytest.approx(0.25 * (0.2 ** 2 + 0.1 ** 2 + 0.3 ** 2), rel=1e-5)


def test_fedlc_calibrated_logits_by_hand():
    """L = -log softmax(f - tau n^(-1/4))_y, written out for two samples and three classes
    (class counts 16, 1 and 0: the missing class is pushed down by 100 tau)."""
    logits = torch.tensor([[1.0, 0.5, 2.0], [0.0, 1.0, -1.0]])
    y = torch.tensor([0, 1])
    counts = torch.tensor([16.0, 1.0, 0.0])
    tau = 0.5
    off = [tau * 16 ** -0.25, tau * 1.0, tau * 1e-8 ** -0.25]   # 0.25, 0.5, 50
    want = 0.0
    for row, label in zip(logits.tolist(), y.tolist()):
        z = [v - o for v, o in zip(row, off)]
        want += -(z[label] - math.log(sum(math.exp(v) for v in z)))
    got = calibrated_ce(logits, y, counts, tau)
    assert float(got) == pytest.approx(want / 2, rel=1e-6)
    # tau = 0 is plain cross-entropy; a sample of a rare class costs more than under even counts
    # (its logit is pushed down more, so training must raise it further: a larger margin)
    assert float(calibrated_ce(logits, y, counts, 0.0)) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-6)
    rare = calibrated_ce(logits[1:], y[1:], torch.tensor([16.0, 1.0, 16.0]), tau)
    even = calibrated_ce(logits[1:], y[1:], torch.tensor([16.0, 16.0, 16.0]), tau)
    assert float(rare) > float(even)


@pytest.mark.parametrize("algo, key, value", [("fedprox", "fedprox.mu", 0.0), ("fedlc", "fedlc.tau", 0.0)])
def test_with_the_term_off_the_round_is_fedavgs(algo, key, value):
    """mu = 0 (tau = 0) gives FedAvg's weights exactly: the term is the only difference; with
    the default it differs (the check can fail)."""
    from tests.test_conformance import build

    def final(name, **over):
        s, grid = build(name, **over)
        s.start(grid, num_rounds=1)
        return {k: v.detach().clone() for k, v in s.model.state_dict().items()}

    ref = final("fedavg")
    off = final(algo, **{key: value})
    on = final(algo)
    assert all(torch.equal(ref[k], off[k]) for k in ref)
    assert any(not torch.allclose(ref[k].float(), on[k].float()) for k in ref)


def test_fedlc_trains_under_label_skew():
    """Nodes holding 3 of 10 classes each (their counts calibrate 7 classes out): the round
    completes with every node, and the server's model is FedAvg's mean of theirs."""
    from tests.test_conformance import build

    from strategies.core.records import ARRAYS_KEY, METRICS_KEY, record_to_numpy
    from tasks.aggregate import weighted_mean

    s, grid = build("fedlc", partition="quantity", **{"partition-classes-per-client": 3})
    replies = []
    pull = grid.pull_messages

    def keep(ids):   # the nodes' train replies, as the server pulls them
        got = list(pull(ids))
        replies.extend(r for r in got if r.metadata.message_type == "train" and not r.has_error())
        return got

    grid.pull_messages = keep
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    assert rows[0]["participants"] == len(grid.get_node_ids()) and rows[0]["dropped"] == []
    assert np.isfinite(rows[0]["train-loss"]) and 0.0 <= rows[0]["accuracy"] <= 1.0
    # the server's model is the num-examples-weighted mean of the nodes' models (FedAvg's rule)
    assert len(replies) == len(grid.get_node_ids())
    states = [record_to_numpy(r.content.array_records[ARRAYS_KEY]) for r in replies]
    ns = [float(r.content.metric_records[METRICS_KEY]["num-examples"]) for r in replies]
    want = weighted_mean(states, ns)
    got = {k: v.detach().cpu().numpy() for k, v in s.model.state_dict().items()}
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
