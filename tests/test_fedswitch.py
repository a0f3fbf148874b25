"""FedSwitch (strategies/semisfl/fedswitch.py, tasks/semisfl/fedswitch_rule.py): the switch (which source for
given logits, the tie, the iid flag), one client step with local teacher adaptation, the
server's EMA steps and the aggregation's EMA, each against a hand computation; the client
keeps nothing between rounds; the teacher travels and is counted. The conformance matrix runs
``fedswitch`` under every condition (tests/test_conformance.py, from the registry)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord, RecordDict
from torch import nn

from strategies.core.records import ARRAYS_KEY, METRICS_KEY, numpy_to_record
from tasks.config import ConfigError
from tasks.data import ArrayDataset
from tasks.semisfl.fedswitch_rule import choose_source, fedswitch_step, mean_confidence, server_steps


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# --------------------------------------------------------------------------- the switch
def test_switch_picks_the_more_confident_source_by_hand():
    teacher = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    student = np.array([[0.0, 3.0, 0.0], [1.0, 0.0, 0.0]])
    # mean max-softmax: teacher (e^2/(e^2+2) + 1/3)/2 = 0.5347; student (e^3/(e^3+2) + e/(e+2))/2 = 0.7485
    conf_t = _softmax(teacher).max(1).mean()
    conf_s = _softmax(student).max(1).mean()
    assert conf_t == pytest.approx((np.e ** 2 / (np.e ** 2 + 2) + 1 / 3) / 2)
    assert conf_s > conf_t
    assert mean_confidence(torch.tensor(student)) == pytest.approx(conf_s)
    chosen_teacher, q = choose_source(torch.tensor(teacher), torch.tensor(student), iid=False)
    assert chosen_teacher is False
    np.testing.assert_allclose(q.numpy(), _softmax(student), rtol=1e-6)
    assert q.argmax(1).tolist() == [1, 0]          # the student's pseudo-labels, not the teacher's [0, 0]
    # the other way round: the teacher is the more confident one
    chosen_teacher, q = choose_source(torch.tensor(student), torch.tensor(teacher), iid=False)
    assert chosen_teacher is True
    np.testing.assert_allclose(q.numpy(), _softmax(student), rtol=1e-6)


def test_switch_tie_goes_to_the_teacher_and_the_iid_flag_always_picks_it():
    # the same confidences in another order: an exact tie with different pseudo-labels
    teacher = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    student = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    assert mean_confidence(teacher) == mean_confidence(student)
    chosen_teacher, q = choose_source(teacher, student, iid=False)
    assert chosen_teacher is True and q.argmax(1).tolist() == [0, 0]
    # iid: the teacher although the student is far more confident (and without its logits)
    confident = torch.tensor([[9.0, 0.0], [0.0, 9.0]])
    assert choose_source(teacher, confident, iid=False)[0] is False
    chosen_teacher, q = choose_source(teacher, confident, iid=True)
    assert chosen_teacher is True
    np.testing.assert_allclose(q.numpy(), _softmax(teacher.numpy()), rtol=1e-6)
    assert choose_source(teacher, None, iid=True)[0] is True
    with pytest.raises(ValueError, match="student's logits"):
        choose_source(teacher, None, iid=False)


# --------------------------------------------------------------------------- one client step
def _linear(w: np.ndarray) -> nn.Linear:
    m = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(w, dtype=torch.float32))
    return m


@pytest.mark.parametrize("student_more_confident", [True, False])
def test_client_step_and_local_teacher_adaptation_by_hand(student_more_confident):
    """Pseudo-labels from the chosen source, the masked CE over the full batch, one plain SGD
    step on the student, then t <- g_l t + (1 - g_l) w (numpy, independently)."""
    W = np.array([[1.0, -0.5], [0.2, 0.3], [-0.4, 0.6]])      # student, 3 classes x 2 inputs
    T = np.array([[0.3, 0.1], [-0.2, 0.4], [0.1, -0.3]])      # teacher
    if not student_more_confident:
        W, T = T, W
    xw = np.array([[2.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    xs = np.array([[1.5, -0.5], [0.3, 0.8], [-1.0, 1.0]])
    lr, g_l, tau = 0.1, 0.9, 0.4
    student, teacher = _linear(W), _linear(T)
    opt = torch.optim.SGD(student.parameters(), lr=lr)
    out = fedswitch_step(student, teacher, torch.tensor(xw, dtype=torch.float32),
                         torch.tensor(xs, dtype=torch.float32), tau=tau, iid=False, optimizer=opt, local_decay=g_l)
    p_s, p_t = _softmax(xw @ W.T), _softmax(xw @ T.T)
    use_teacher = not p_s.max(1).mean() > p_t.max(1).mean()
    assert use_teacher is (not student_more_confident)
    q = p_t if use_teacher else p_s
    mask = (q.max(1) >= tau).astype(float)
    assert 0 < mask.sum() < len(mask)                         # some samples kept, some masked
    y = q.argmax(1)
    p = _softmax(xs @ W.T)
    onehot = np.eye(3)[y]
    loss = float(np.sum(mask * -np.log(p[np.arange(3), y])) / 3)
    grad = ((p - onehot) * mask[:, None]).T @ xs / 3
    W1 = W - lr * grad
    T1 = g_l * T + (1 - g_l) * W1
    assert out["teacher"] is use_teacher
    assert float(out["loss"]) == pytest.approx(loss, rel=1e-5)
    np.testing.assert_array_equal(out["mask"].numpy(), mask)
    np.testing.assert_allclose(student.weight.detach().cpu().numpy(), W1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(teacher.weight.detach().cpu().numpy(), T1, rtol=1e-5, atol=1e-6)


def test_no_local_adaptation_leaves_the_teacher_and_iid_ignores_the_student():
    W = np.array([[3.0, 0.0], [0.0, 3.0]])                     # a very confident student
    T = np.array([[0.2, 0.1], [0.1, 0.2]])
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    student, teacher = _linear(W), _linear(T)
    out = fedswitch_step(student, teacher, x, x, tau=0.0, iid=True, optimizer=torch.optim.SGD(
        student.parameters(), lr=0.1), local_decay=1.0)
    assert out["teacher"] is True
    np.testing.assert_array_equal(teacher.weight.detach().cpu().numpy(), T.astype(np.float32))
    assert out["pseudo"].tolist() == [0, 1]                    # the teacher's argmax


# --------------------------------------------------------------------------- server EMA
class _Identity:
    """An augmenter whose weak view is the image as float (for hand computations)."""

    def weak(self, x):
        return x.float()


def test_server_steps_take_an_ema_after_every_step_by_hand():
    W0 = np.array([[0.5, -0.2], [0.1, 0.4]])
    T0 = np.array([[0.0, 0.0], [0.3, -0.3]])
    x = np.array([[2, 1], [0, 3], [1, 1], [3, 0]], dtype=np.uint8)
    y = np.array([0, 1, 1, 0])
    lr, g = 0.05, 0.8
    student, teacher = nn.Sequential(nn.Flatten(), _linear(W0)), nn.Sequential(nn.Flatten(), _linear(T0))
    data = ArrayDataset(x.reshape(4, 1, 1, 2), y)          # images of 1 x 2 pixels
    res = server_steps(student, teacher, data, aug=_Identity(), steps=2, batch_size=4,
                       optimizer=torch.optim.SGD(student.parameters(), lr=lr), device=torch.device("cpu"),
                       seed=0, decay=g)
    xf = x.astype(float)
    W, T, losses = W0, T0, []
    for _ in range(2):                                        # a full batch: the order does not matter
        p = _softmax(xf @ W.T)
        losses.append(float(-np.log(p[np.arange(4), y]).mean()))
        W = W - lr * (p - np.eye(2)[y]).T @ xf / 4
        T = g * T + (1 - g) * W
    assert res["server-steps"] == 2 and res["server-loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    np.testing.assert_allclose(student[1].weight.detach().cpu().numpy(), W, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(teacher[1].weight.detach().cpu().numpy(), T, rtol=1e-5, atol=1e-6)
    # not the EMA of the final student alone: the per-step EMA is what the teacher holds
    assert not np.allclose(teacher[1].weight.detach().cpu().numpy(), g * T0 + (1 - g) * W, atol=1e-4)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(2 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(self.body(x))


def _sets(seed: int, n: int = 12):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, n)


def test_aggregation_is_the_uniform_mean_then_one_ema_step_by_hand():
    from strategies.semisfl.fedswitch import FedSwitchStrategy

    s = FedSwitchStrategy(model=_Tiny(), labeled_data=_sets(0), test_data=_sets(1), ema_decay=0.75)
    t0 = {k: v.detach().cpu().numpy().copy() for k, v in s.teacher.state_dict().items()}
    rng = np.random.default_rng(2)
    states = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in t0.items()} for _ in range(2)]

    def reply(state, n):   # what aggregate_clients reads of a reply
        return types.SimpleNamespace(content=RecordDict({
            ARRAYS_KEY: numpy_to_record(state),
            METRICS_KEY: MetricRecord({"num-examples": float(n), "train-loss": 1.0, "mask-rate": 0.5,
                                       "teacher-share": float(n == 10), "pseudo-kept": 3.0})}))

    out = s.aggregate_clients([reply(states[0], 10), reply(states[1], 30)])
    for k, v in s.model.state_dict().items():
        mean = (states[0][k] + states[1][k]) / 2                 # uniform, not 10:30
        np.testing.assert_allclose(v.cpu().numpy(), mean, rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(s.teacher.state_dict()[k].cpu().numpy(), 0.75 * t0[k] + 0.25 * mean,
                                   rtol=1e-5, atol=1e-6, err_msg=k)
    assert out["teacher-share"] == pytest.approx(0.25)          # reply metrics: by samples seen
    assert out["label-metrics-nodes"] == 0 and "impurity" not in out


# --------------------------------------------------------------------------- the protocol
def test_the_client_keeps_nothing_and_its_reply_depends_on_the_message_alone():
    from flower_apps.client_app import dispatch
    from strategies.registry import get_algorithm
    from tests.test_conformance import build

    assert get_algorithm("fedswitch").node_state == ()
    s, grid = build("fedswitch")
    train_msgs, replies = [], []

    def spy(msg, ctx):
        r = dispatch(msg, ctx)
        if msg.metadata.message_type == "train":
            train_msgs.append((msg, ctx))
            replies.append(r)
        return r

    grid.handler = spy
    rows = []
    s.start(grid, num_rounds=2, on_round_end=lambda r, m: rows.append(dict(m)))
    for ctx in grid.contexts.values():
        assert len(ctx.state.array_records) == 0 and len(ctx.state.config_records) == 0
        assert len(ctx.state.metric_records) == 0
    # a round-2 message answered by the same node again, with its context as round 2 left it:
    # the same reply (nothing from earlier rounds enters)
    msg, ctx = train_msgs[-1]
    again = dispatch(msg, ctx)
    a, b = replies[-1].content.array_records[ARRAYS_KEY], again.content.array_records[ARRAYS_KEY]
    for k in a.keys():
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy(), err_msg=k)
    # the teacher travels down (counted as its own kind), never up; the student both ways
    for row in rows:
        assert row["bytes.teacher-weights.down"] == row["bytes.weights.down"] > 0
        assert "bytes.teacher-weights.up" not in row and row["bytes.weights.up"] > 0
        assert 0.0 <= row["teacher-share"] <= 1.0
    # the result is the global teacher, which differs from the student
    assert s.eval_model() is s.teacher
    assert any(not torch.equal(a, b) for a, b in zip(s.teacher.state_dict().values(),
                                                       s.model.state_dict().values()))


def test_iid_flag_gives_a_teacher_share_of_one():
    from tests.test_conformance import build

    s, grid = build("fedswitch", **{"fedswitch.iid": True})
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    assert rows[0]["teacher-share"] == 1.0


def test_bad_input_names_the_key():
    from strategies.semisfl.fedswitch import FedSwitchStrategy

    with pytest.raises(ConfigError, match="tau=2.0 is out of range"):
        FedSwitchStrategy(tau=2.0)
    with pytest.raises(ConfigError, match="lr_schedule"):
        FedSwitchStrategy(lr_schedule="linear")
    with pytest.raises(ConfigError, match="labeled_data"):
        FedSwitchStrategy(model=_Tiny(), test_data=_sets(1))
