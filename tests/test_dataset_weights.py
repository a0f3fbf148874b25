"""FedAvg-family servers weight an upload by the node's training-set size |D_k| (McMahan et al.
2017's n_k; FedProx's and FedConcat's code), not by the samples its local steps processed.

With ``local-steps`` set every node processes about the same number of samples whatever its data,
so the two weightings differ most under a skewed split: the nodes here hold a Dirichlet(0.1)
split of very different sizes. Each test runs one real round through the in-process grid and the
real ClientApp dispatch (``tests/test_conformance.py``'s ``build``) and checks the server's model
against the weighted mean of the uploads it received; a node that fails is left out and the
weights renormalise over the others. ``upload-weight=processed-examples`` (the round policy)
restores the processed-samples weighting."""
from __future__ import annotations

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies.core.folds import TrainFold
from strategies.core.records import ARRAYS_KEY, METRICS_KEY, numpy_to_record, record_to_numpy
from strategies.core.round_policy import RoundPolicy
from tasks.config import ConfigError
from tasks.env import library_env
from tests.faulty_grid import RecordingGrid, inject_failures
from tests.test_conformance import config

NODES = 6
PROCESSED_KEY = "processed-examples"   # (strategies.core.folds.PROCESSED_KEY)
SKEW = {"partition": "dirichlet", "partition-alpha": 0.1}   # sizes 1375, 48, 461, 148, 1537, 431
FULL_MODEL = ["fedavg", "fedprox", "fedlc", "fedcbs"]
FRACTION = {"fedcbs": 5 / 6}   # (Fed-CBS chooses among the nodes only when not every one is sampled)
DROPPED_PID = 4                # the largest node: its loss moves the weights most


def _build(algo: str, *, upload_weight: str = "dataset-size", drop: bool = False, **over):
    cfg = config(algo, **SKEW, **over)
    p = parse_run_config(cfg)
    grid = RecordingGrid(NODES, dispatch, run_config=cfg)
    chosen = {} if upload_weight == "dataset-size" else {"upload_weight": upload_weight}   # (the default)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name,
                            RoundPolicy(fraction_train=FRACTION.get(algo, 1.0), min_nodes=2, round_timeout=60,
                                        **chosen))
    replies = []   # (node, train reply) of every train message answered
    inner = grid.handler

    def handler(msg, ctx):
        rep = inner(msg, ctx)
        if msg.metadata.message_type == "train" and not rep.has_error():
            replies.append((msg.metadata.dst_node_id, rep))
        return rep

    grid.handler = handler
    if drop:
        inject_failures(grid, lambda msg, ctx: msg.metadata.message_type == "train"
                        and ctx.node_config["partition-id"] == DROPPED_PID)
    return s, grid, replies


def _sizes(s, grid) -> dict[int, int]:
    """node -> |D_k|, its training set as the partition gives it (not what it reports)."""
    return {n: len(library_env(s.task, NODES, "all", False, int(ctx.node_config["partition-id"])).labeled())
            for n, ctx in grid.contexts.items()}


def _mean(states: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    return {k: sum(wi * st[k].astype(np.float64) for wi, st in zip(w, states)) for k in states[0]
            if np.issubdtype(states[0][k].dtype, np.floating)}


def _assert_model_is(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert want
    for k, v in want.items():
        np.testing.assert_allclose(got[k].astype(np.float64), v, rtol=1e-6, atol=1e-7, err_msg=k)


def _far(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return any(not np.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)


def _uploads(replies):
    return [record_to_numpy(r.content.array_records[ARRAYS_KEY]) for _, r in replies]


@pytest.mark.parametrize("drop", [False, True], ids=["all-reply", "node-dropped"])
@pytest.mark.parametrize("algo", FULL_MODEL)
def test_server_model_is_the_dataset_size_weighted_mean(algo, drop):
    """After one round with ``local-steps`` set, the server's model is the |D_k|-weighted mean of
    the uploads it received (|D_k| from the partition, and what the reply's ``num-examples``
    says), not the processed-samples-weighted one; a failing node adds nothing and the weights
    renormalise over the others."""
    s, grid, replies = _build(algo, drop=drop)
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    sizes = _sizes(s, grid)
    nodes = [n for n, _ in replies]
    assert len(nodes) == rows[0]["participants"] >= 4
    assert len({sizes[n] for n in nodes}) == len(nodes)   # every node a different size
    pid = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    assert (DROPPED_PID not in {pid[n] for n in nodes}) == drop
    if drop:
        assert [pid[n] for n in rows[0]["dropped"]] == [DROPPED_PID]
    states = _uploads(replies)
    want = _mean(states, [sizes[n] for n in nodes])
    got = {k: v.detach().cpu().numpy() for k, v in s.model.state_dict().items()}
    _assert_model_is(got, want)
    # the replies say both: num-examples = |D_k|, processed-examples = local-steps 2 of batch 8
    # whatever |D_k| (every node holds >= 16 samples)
    for n, r in replies:
        assert float(r.content.metric_records[METRICS_KEY]["num-examples"]) == sizes[n]
        assert float(r.content.metric_records[METRICS_KEY][PROCESSED_KEY]) == 2 * 8
    assert _far(want, _mean(states, [2 * 8] * len(states)))   # (the two weightings differ here)


@pytest.mark.parametrize("drop", [False, True], ids=["all-reply", "node-dropped"])
def test_fedconcat_encoder_stage_is_the_dataset_size_weighted_mean_per_cluster(drop):
    """FedConcat's encoder stage: each cluster's model is the |D_k|-weighted mean of the uploads
    of its members that replied (the authors' ``experiments.py``: ``len(net_dataidx_map[r]) /
    total_data_points``)."""
    s, grid, replies = _build("fedconcat", drop=drop, **{"fedconcat.clusters": 2})
    s.start(grid, num_rounds=1)
    sizes = _sizes(s, grid)
    pid = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    assert (DROPPED_PID not in {pid[n] for n, _ in replies}) == drop
    discriminating = 0
    for c, got in enumerate(s.cluster_states):
        members = [(n, r) for n, r in replies if s.assign[pid[n]] == c]
        if not members:
            continue
        states = _uploads(members)
        want = _mean(states, [sizes[n] for n, _ in members])
        _assert_model_is(got, want)
        for n, r in members:
            assert float(r.content.metric_records[METRICS_KEY]["num-examples"]) == sizes[n]
        processed = [float(r.content.metric_records[METRICS_KEY][PROCESSED_KEY]) for _, r in members]
        discriminating += _far(want, _mean(states, processed))
    assert discriminating   # some cluster where the two weightings differ


@pytest.mark.parametrize("algo", FULL_MODEL + ["fedconcat"])
def test_processed_examples_option_weights_by_samples_processed(algo):
    """``upload-weight=processed-examples``: the server's model (FedConcat: each cluster's) is the
    mean weighted by each reply's ``processed-examples``, the samples its local steps processed."""
    s, grid, replies = _build(algo, upload_weight="processed-examples", **{"fedconcat.clusters": 2})
    s.start(grid, num_rounds=1)
    sizes = _sizes(s, grid)
    pid = {n: int(c.node_config["partition-id"]) for n, c in grid.contexts.items()}
    if algo == "fedconcat":
        groups = [([(n, r) for n, r in replies if s.assign[pid[n]] == c], got) for c, got in enumerate(s.cluster_states)]
    else:
        groups = [(replies, {k: v.detach().cpu().numpy() for k, v in s.model.state_dict().items()})]
    discriminating = 0
    for members, got in groups:
        if not members:
            continue
        states = _uploads(members)
        processed = [float(r.content.metric_records[METRICS_KEY][PROCESSED_KEY]) for _, r in members]
        want = _mean(states, processed)
        _assert_model_is(got, want)
        discriminating += _far(want, _mean(states, [sizes[n] for n, _ in members]))
    assert discriminating


def test_upload_weight_run_config_key():
    """``upload-weight`` is a run-config key of the round policy: its value reaches the policy;
    another value is refused naming the key and the allowed ones."""
    p = parse_run_config(config("fedavg", **{"upload-weight": "processed-examples"}))
    assert p.app.policy().upload_weight == "processed-examples"
    assert parse_run_config(config("fedavg")).app.policy().upload_weight == "dataset-size"
    with pytest.raises(ConfigError, match="upload-weight.*dataset-size.*processed-examples"):
        parse_run_config(config("fedavg", **{"upload-weight": "steps"}))


def test_processed_option_without_the_metric_is_a_clear_error():
    """A reply that carries no ``processed-examples`` under ``upload-weight=processed-examples``
    (an algorithm whose client does not report it) is a ConfigError naming the key."""
    policy = RoundPolicy(upload_weight="processed-examples")
    fold = TrainFold(type("S", (), {"policy": policy, "reply_metrics": ()})())
    reply = type("R", (), {"content": RecordDict({ARRAYS_KEY: numpy_to_record({"w": np.ones(2, np.float32)}),
                                                  METRICS_KEY: MetricRecord({"num-examples": 5.0})})})()
    with pytest.raises(ConfigError, match="upload-weight=processed-examples.*processed-examples"):
        fold.add(reply)


@pytest.mark.parametrize("algo", ["fixavg", "pfedme-fix"])
@pytest.mark.parametrize("upload_weight", ["dataset-size", "processed-examples"])
def test_fixmatch_rows_weight_by_labeled_plus_unlabeled_or_processed(upload_weight, algo):
    """The FixMatch rows of UM-pFSSL's Table 1 (``fixavg``; ``pfedme-fix`` at its default beta = 1,
    where w is the weighted mean of the w_k) keep n_k = |D_k^s| + |D_k^u| (the node's labeled and
    unlabeled data, their documented weight) and report the samples processed as
    ``processed-examples``, so ``upload-weight=processed-examples`` works for them too."""
    s, grid, replies = _build(algo, upload_weight=upload_weight)
    s.start(grid, num_rounds=1)
    envs = {n: library_env(s.task, NODES, "dir2", True, int(c.node_config["partition-id"]))
            for n, c in grid.contexts.items()}
    sizes = [len(envs[n].labeled()) + len(envs[n].unlabeled()) for n, _ in replies]
    mets = [r.content.metric_records[METRICS_KEY] for _, r in replies]
    assert [float(m["num-examples"]) for m in mets] == sizes
    processed = [float(m[PROCESSED_KEY]) for m in mets]
    states = _uploads(replies)
    by_size, by_processed = _mean(states, sizes), _mean(states, processed)
    assert _far(by_size, by_processed)
    got = {k: v.detach().cpu().numpy() for k, v in s.model.state_dict().items()}
    _assert_model_is(got, by_size if upload_weight == "dataset-size" else by_processed)


@pytest.mark.parametrize("upload_weight", ["dataset-size", "processed-examples"])
def test_datasharing_weights_by_its_merged_data_or_processed(upload_weight):
    """DataSharing (SSFL's D1) keeps n_k = |D_k| + |G_k|, the node's data merged with its share of
    the shared set (the reply's num-examples), and reports the samples processed as
    ``processed-examples``: the server's model is the mean weighted by the one ``upload-weight``
    names."""
    s, grid, replies = _build("datasharing", upload_weight=upload_weight)
    s.start(grid, num_rounds=1)
    mets = [r.content.metric_records[METRICS_KEY] for _, r in replies]
    merged = [float(m["num-examples"]) for m in mets]
    assert len(set(merged)) == len(merged) and all(n > 16 for n in merged)
    processed = [float(m[PROCESSED_KEY]) for m in mets]
    assert processed == [2 * 8] * len(mets)
    states = _uploads(replies)
    by_size, by_processed = _mean(states, merged), _mean(states, processed)
    assert _far(by_size, by_processed)
    got = {k: v.detach().cpu().numpy() for k, v in s.model.state_dict().items()}
    _assert_model_is(got, by_size if upload_weight == "dataset-size" else by_processed)
