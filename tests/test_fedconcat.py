"""FedConcat (strategies/scala/fedconcat.py, tasks/scala/fedconcat_model.py, tasks/scala/kmeans.py): the concatenated
model and its head initialisation against hand computations, K-means (and its size cap) on a
hand-checkable example, the stage switch, each stage's aggregation rule, resume across the stage
boundary, and a user's own model. The conformance matrix runs it under every condition
(tests/test_conformance.py, from the registry)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from tasks.config import ConfigError
from tasks.scala.fedconcat_model import ConcatModel, check_split, concat_heads, head_keys, strip_head
from tasks.scala.kmeans import kmeans, nearest, size_cap


def _mlp(seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float64)


# ------------------------------------------------------------------------- the concatenated model
def test_concat_model_is_the_head_on_the_concatenated_encoder_outputs_by_hand():
    """ConcatModel(x) = W [relu(A_1 x + a_1); relu(A_2 x + a_2)] + b, written out in numpy from the
    parts; the encoders get no gradient and stay in eval mode when the model trains."""
    f1, f2 = _mlp(1), _mlp(2)
    parts = [(_np(f[0].weight), _np(f[0].bias)) for f in (f1, f2)]
    e1, _ = strip_head(f1)
    e2, _ = strip_head(f2)
    head = nn.Linear(4, 4)
    with torch.no_grad():
        head.weight.copy_(torch.arange(16.0).reshape(4, 4) / 10 - 0.7)
        head.bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    model = ConcatModel([e1, e2], head)
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    phi = np.concatenate([np.maximum(_np(x) @ a.T + c, 0.0) for a, c in parts], axis=1)
    want = phi @ _np(head.weight).T + _np(head.bias)
    np.testing.assert_allclose(_np(model(x)), want, rtol=1e-5, atol=1e-6)
    assert set(model.state_dict()) == {"encoders.0.0.weight", "encoders.0.0.bias", "encoders.1.0.weight",
                                       "encoders.1.0.bias", "head.weight", "head.bias"}
    model.train()
    assert model.head.training and not any(e.training for e in model.encoders)
    model(x).sum().backward()
    assert all(p.grad is None for p in model.encoders.parameters()) and model.head.weight.grad is not None


def test_head_initialised_from_the_cluster_heads_sums_the_cluster_models_logits():
    """W' = [W_1 W_2], b' = b_1 + b_2 gives W' phi(x) + b' = f_1(x) + f_2(x), and the numbers are
    the concatenation and the sum (checked entry by entry)."""
    f1, f2 = _mlp(3), _mlp(4)
    x = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.7], [0.0, 0.0, 1.0]])
    want = _np(f1(x)) + _np(f2(x))
    heads = [{"weight": f[2].weight.detach().cpu().numpy(), "bias": f[2].bias.detach().cpu().numpy()} for f in (f1, f2)]
    init = concat_heads(heads)
    assert init["weight"].shape == (4, 4)
    np.testing.assert_array_equal(init["weight"][:, :2], heads[0]["weight"])
    np.testing.assert_array_equal(init["weight"][:, 2:], heads[1]["weight"])
    np.testing.assert_allclose(init["bias"], heads[0]["bias"] + heads[1]["bias"], rtol=1e-6)
    head = nn.Linear(4, 4)
    head.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    model = ConcatModel([strip_head(copy.deepcopy(f))[0] for f in (f1, f2)], head)
    np.testing.assert_allclose(_np(model(x)), want, rtol=1e-5, atol=1e-5)
    # (not the mean: with K = 2 the logits are twice the average model's)
    assert not np.allclose(_np(model(x)), want / 2)


class _SoftmaxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 5), nn.ReLU())
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        return torch.softmax(self.fc(self.body(x)), dim=1)   # something after the last linear layer


class _Net(nn.Module):
    """A user's model: not a StagedModel, its head an attribute ``fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(self.body(x))


def _sets(seed: int, n: int = 24, classes=(0, 1, 2)):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.choice(np.array(classes), n)


def test_a_model_whose_output_is_not_its_last_linear_is_a_clear_config_error():
    from strategies.scala.fedconcat import FedConcatStrategy

    x = torch.zeros(2, 1, 8, 8)
    assert check_split(_Net(), x) == (256, 3)
    assert head_keys(_Net()) == ["fc.weight", "fc.bias"]
    with pytest.raises(ConfigError, match="output is not its last nn.Linear 'fc'"):
        check_split(_SoftmaxNet(), x)
    with pytest.raises(ConfigError, match="has no nn.Linear layer"):
        head_keys(nn.Sequential(nn.Conv2d(1, 3, 8), nn.Flatten()))
    with pytest.raises(ConfigError, match="the model is a single nn.Linear"):
        head_keys(nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"has shape \[2, 1, 8, 8\]; it must be a \[batch, features\] matrix"):
        check_split(nn.Sequential(nn.Identity(), nn.Linear(8, 3)), x)
    with pytest.raises(ConfigError, match="output is not its last nn.Linear"):   # raised by the constructor
        FedConcatStrategy(model=_SoftmaxNet(), test_data=_sets(0))


# ------------------------------------------------------------------------- K-means
def test_kmeans_on_label_distributions_by_hand():
    """Two clients mostly of class 0, two mostly of class 2: two clusters whose centres are the
    members' means; a third cluster asked for splits the tightest pair last."""
    p = np.array([[0.9, 0.1, 0.0], [0.7, 0.3, 0.0], [0.0, 0.2, 0.8], [0.0, 0.0, 1.0]])
    labels, centres = kmeans(p, 2, seed=0)
    assert labels.tolist() == [0, 0, 1, 1]   # numbered in order of their first client
    np.testing.assert_allclose(centres, [[0.8, 0.2, 0.0], [0.0, 0.1, 0.9]])
    labels3, _ = kmeans(p, 3, seed=0)
    # three clusters: |p0 - p1|^2 = |p2 - p3|^2 = 0.08, so either pair may be split; one stays together
    assert sorted(np.bincount(labels3).tolist()) == [1, 1, 2]
    # K capped by the number of clients; identical distributions make a single cluster
    assert len(kmeans(p, 9, seed=1)[1]) == 4
    same, c = kmeans(np.tile([0.5, 0.5, 0.0], (4, 1)), 3, seed=0)
    assert same.tolist() == [0, 0, 0, 0] and c.shape == (1, 3)
    assert nearest(centres, [0.6, 0.4, 0.0]) == 0 and nearest(centres, [0.1, 0.1, 0.8]) == 1
    # seeded: the same seed, the same clustering
    x = np.random.default_rng(3).dirichlet(np.ones(5), 30)
    a, b = kmeans(x, 4, seed=7), kmeans(x, 4, seed=7)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_constrained_kmeans_caps_the_cluster_size():
    """Four clients near class 0 and two at class 1, K = 2: plain K-means makes clusters of 4 and
    2; with the cap 3 (= max(ceil(6/2), floor(1.2*6/2))) the client of the first group nearest to
    the second, (0.8, 0.2), moves over, and the centres are the new groups' means."""
    assert size_cap(6, 2, 1.2) == 3 and size_cap(40, 5, 1.2) == 9 and size_cap(4, 3, 1.2) == 2
    p = np.array([[1.0, 0.0], [1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0], [0.0, 1.0]])
    plain, _ = kmeans(p, 2, seed=0)
    assert plain.tolist() == [0, 0, 0, 0, 1, 1]
    capped, centres = kmeans(p, 2, seed=0, size_max=3)
    assert capped.tolist() == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(centres, [[2.9 / 3, 0.1 / 3], [0.8 / 3, 2.2 / 3]])
    with pytest.raises(ValueError, match="cannot hold 6 points"):
        kmeans(p, 2, seed=0, size_max=2)


# ------------------------------------------------------------------------- rounds
def _build(**over):
    from tests.test_conformance import build

    return build("fedconcat", **over)


def _capture(grid):
    from flower_apps.client_app import dispatch

    replies = []
    grid.handler = lambda msg, ctx: replies.append((msg, dispatch(msg, ctx))) or replies[-1][1]
    return replies


def test_stage_switch_and_each_stages_aggregation_rule():
    """encoder-rounds = 2 of 3: rounds 1-2 send each node its cluster's model and average the
    replies within each cluster weighted by n_k = |D_k|, the node's training-set size (from the
    partition, not the samples its local steps processed; each reply's ``num-examples`` says
    |D_k|, its ``processed-examples`` the samples processed); round 3 sends the frozen encoders
    and the head and sets the head to the plain mean of the replies' heads; the encoders do not
    move."""
    from strategies.core.records import action_of, record_to_numpy

    s, grid = _build(partition="quantity", **{"partition-classes-per-client": 3, "fedconcat.clusters": 2,
                                               "fedconcat.encoder-rounds": 2})
    replies = _capture(grid)
    snapshots = {}
    rows = []

    def on_end(rnd, metrics):
        rows.append(dict(metrics))
        snapshots[rnd] = ([{k: v.copy() for k, v in st.items()} for st in s.cluster_states],
                          None if s.head_state is None else {k: v.copy() for k, v in s.head_state.items()})

    s.start(grid, num_rounds=3, on_round_end=on_end)
    assert [r["fedconcat-stage"] for r in rows] == [0, 0, 1] and all(r["clusters"] == 2 for r in rows)
    assert sorted(set(s.assign.values())) == [0, 1]
    by_round = {}
    for msg, rep in replies:
        if action_of(msg) == "train":
            by_round.setdefault(int(msg.content.config_records["config"]["server-round"]), []).append((msg, rep))
    node_pid = s.partition_of
    # round 2: per cluster, the |D_k|-weighted mean of its members' replies
    from tasks.env import library_env

    for c in (0, 1):
        members = [(m, r) for m, r in by_round[2] if s.assign[node_pid[m.metadata.dst_node_id]] == c]
        assert members, "every cluster has members in a full-participation round"
        n = np.array([float(len(library_env(s.task, len(grid.contexts), "all", False,
                                            node_pid[m.metadata.dst_node_id]).labeled())) for m, _ in members])
        for (_, r), n_k in zip(members, n):
            met = r.content.metric_records["metrics"]
            assert float(met["num-examples"]) == n_k and float(met["processed-examples"]) < n_k
        for key, got in snapshots[2][0][c].items():
            if not np.issubdtype(got.dtype, np.floating):
                continue
            vals = [record_to_numpy(r.content.array_records["arrays"])[key].astype(np.float64) for _, r in members]
            np.testing.assert_allclose(got, sum(w * v for w, v in zip(n / n.sum(), vals)), rtol=1e-5, atol=1e-6)
        # the cluster's model is what its members received in round 2 (the round-1 average)
        for m, _ in members:
            sent = record_to_numpy(m.content.array_records["arrays"])
            for key, v in snapshots[1][0][c].items():
                np.testing.assert_array_equal(sent[key], v)
    # round 3: encoders = the cluster models without the head, head = plain mean of the replies
    keys = set(s.head_keys)
    for m, _ in by_round[3]:
        assert "arrays" not in m.content.array_records
        for c in (0, 1):
            enc = record_to_numpy(m.content.array_records[f"encoder.{c}"])
            assert set(enc) == set(snapshots[2][0][c]) - keys
        head0 = record_to_numpy(m.content.array_records["head"])
        want0 = concat_heads([{k.rsplit(".", 1)[1]: st[k] for k in s.head_keys} for st in snapshots[2][0]])
        for k in want0:
            np.testing.assert_array_equal(head0[k], want0[k])
    heads = [record_to_numpy(r.content.array_records["head"]) for _, r in by_round[3]]
    for k in ("weight", "bias"):
        np.testing.assert_allclose(s.head_state[k], np.mean([h[k].astype(np.float64) for h in heads], axis=0),
                                   rtol=1e-5, atol=1e-7)
        assert not np.allclose(s.head_state[k], want0[k])   # the head did train
    for c in (0, 1):
        for key in snapshots[2][0][c]:
            np.testing.assert_array_equal(snapshots[3][0][c][key], snapshots[2][0][c][key])
    # bytes: cluster models in the encoder stage; encoders (first download) and head after
    assert rows[1]["bytes.cluster-weights.down"] > 0 and "bytes.head.down" not in rows[1]
    assert rows[2]["bytes.encoders.down"] > 0 and rows[2]["bytes.head.up"] > 0
    assert "bytes.cluster-weights.down" not in rows[2] and "bytes.encoders-resent.down" not in rows[2]
    # the evaluated and returned model is the concatenation: 2 encoders and the trained head
    final = s.eval_model()
    assert isinstance(final, ConcatModel) and len(final.encoders) == 2
    np.testing.assert_array_equal(final.head.weight.detach().cpu().numpy(), s.head_state["weight"])


def test_default_stage_switch_is_half_the_run_and_histograms_are_the_nodes_label_distributions():
    from tasks.env import library_env

    s, grid = _build(partition="quantity", **{"partition-classes-per-client": 3})
    rows = []
    s.start(grid, num_rounds=3, on_round_end=lambda r, m: rows.append(m))
    assert s.encoder_rounds() == 2 and [r["fedconcat-stage"] for r in rows] == [0, 0, 1]
    assert rows[2]["bytes.encoders.down"] > 0
    for pid in s.histograms:
        y = library_env(s.task, 4, "all", False, pid).labeled().y
        np.testing.assert_allclose(s.histograms[pid], np.bincount(y, minlength=10))
        np.testing.assert_allclose(s.label_distribution(pid), np.bincount(y, minlength=10) / len(y))
        assert np.count_nonzero(s.histograms[pid]) <= 3
    assert len(s.cluster_states) == 4   # K = 5 capped by the 4 nodes
    assert rows[0]["cluster-sizes"] == [1, 1, 1, 1] and "cluster-sizes" not in rows[1]
    s.num_rounds = 30
    assert s.encoder_rounds() == 15
    s.num_rounds = 1
    assert s.encoder_rounds() == 1


def test_laplace_noise_on_the_label_distribution_is_seeded_and_off_by_default():
    from strategies.core.records import CONFIG_KEY, query

    def ask(eps: float):
        s, grid = _build(**{"fedconcat.label-noise-eps": eps})
        s.setup(grid)
        node = sorted(grid.get_node_ids())[0]
        assert s.label_noise_eps == eps
        (reply,) = s.exchange(grid, [query(s.base_content(1, action="label-histogram", **{"label-noise-eps": eps}),
                                           node, "label-histogram")])
        n = reply.content.config_records[CONFIG_KEY]["num-examples"]
        return reply.content.array_records["label-histogram"]["counts"].numpy() / n

    clean, noisy, again = ask(0.0), ask(1.0), ask(1.0)
    assert clean.sum() == pytest.approx(1.0) and (clean >= 0).all()
    assert not np.allclose(noisy, clean) and np.array_equal(noisy, again)


def test_resume_across_the_stage_boundary_from_a_safe_checkpoint(tmp_path):
    """Rounds 1-2 (encoder stage), a checkpoint written and read back as the app does
    (weights_only), a new server and restarted nodes, round 3 (classifier stage): the same model
    as three uninterrupted rounds (clusters, cluster models and the stage come from the checkpoint)."""
    from flower_apps.results import load_safely, to_safe
    from tests.test_conformance import state_of

    over = {"fedconcat.encoder-rounds": 2, "fedconcat.clusters": 2, "partition": "quantity",
            "partition-classes-per-client": 3}
    s, grid = _build(**over)
    full = s.start(grid, num_rounds=3)

    s1, g1 = _build(**over)
    s1.start(g1, num_rounds=2)
    torch.save(to_safe({"state": s1.state_dict()}), tmp_path / "ck.pt")
    s2, g2 = _build(**over)
    s2.setup(g2)
    s2.load_state_dict(load_safely(tmp_path / "ck.pt")["state"])
    resumed = s2.start(g2, num_rounds=3, start_round=3)
    a, b = state_of(full.arrays), state_of(resumed.arrays)
    assert set(a) == set(b) and any(k.startswith("encoders.1.") for k in a)
    for k in a:
        # (the conformance matrix's tolerance: float32 kernels may round the last bit differently)
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-6, err_msg=k)
    assert resumed.evaluate_metrics_serverapp[3]["accuracy"] == full.evaluate_metrics_serverapp[3]["accuracy"]


def test_a_users_own_model_and_data():
    """FedConcatStrategy / FedConcatClient with a model of the user's (head ``fc``, BatchNorm in
    the encoder) and nodes holding different classes: two clusters, a concatenated model out."""
    from split_layer.transport import LocalGrid
    from strategies.scala.fedconcat import FedConcatClient, FedConcatStrategy

    classes = {0: (0, 1), 1: (0, 1), 2: (2,), 3: (2,)}
    client = FedConcatClient(_Net(), lambda ctx: {
        "labeled": _sets(int(ctx.node_config["partition-id"]), classes=classes[int(ctx.node_config["partition-id"])])})
    s = FedConcatStrategy(model=_Net(), test_data=_sets(9), num_classes=3, clusters=2, local_steps=2,
                          batch_size=8, min_nodes=2)
    rows = []
    res = s.start(LocalGrid(4, client.handle), num_rounds=2, on_round_end=lambda r, m: rows.append(m))
    assert [r["fedconcat-stage"] for r in rows] == [0, 1] and all(r["dropped"] == [] for r in rows)
    assert s.assign[0] == s.assign[1] != s.assign[2] == s.assign[3]
    keys = set(res.arrays.keys())
    assert {"head.weight", "head.bias", "encoders.0.body.1.running_mean", "encoders.1.body.0.weight"} <= keys
    assert res.arrays["head.weight"].numpy().shape == (3, 2 * 256)
