"""One place per concept in the core (issue "one place per concept"): the node directory and the
queries of a split node's first round, the byte count, the cut check, the bottom's feature
shape, the algorithm lookup of a message, and checkpoints without an RNG state."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from split_layer.cut import feature_shape, resolve_cut, split_model
from strategies.core.records import CONFIG_KEY, action_of, query
from strategies.core.byte_meter import ByteMeter, array_bytes
from strategies.core.node_directory import NodeDirectory
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from strategies.registry import algorithm_for
from tasks.config import ConfigError
from tasks.models import StagedModel, as_staged, build_model
from tests.faulty_grid import RecordingGrid

I = 2


def _split_run(fraction: float, node_ids: list[int], rounds: int = 2, transport: str = "message"):
    cfg = {**fused_run_config(None), "algo": "scala", "model": "mlp", "scala.local-iterations": I,
           "scala.total-batch": 16, "batch-size": 8, "seed": 4}
    p = parse_run_config(cfg)
    grid = RecordingGrid(len(node_ids), dispatch, node_ids=node_ids, threaded=transport == "stream")
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(
        fraction_train=fraction, min_nodes=2, round_timeout=60), split_transport=transport)
    rows = []
    s.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    grid.join()
    return s, grid, rows


def _pushed(grid) -> list[tuple[int, int, str]]:
    """(round, node, action) of every message the server pushed, in order."""
    return [(int(m.content.config_records[CONFIG_KEY]["server-round"]), m.metadata.dst_node_id, action_of(m))
            for m in grid.sent]


@pytest.mark.parametrize("transport", ["message", "stream"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_split_node_answers_one_query_in_its_first_round(fraction, transport):
    """Every node of a split algorithm is asked exactly one query, ``split-info``, at the start
    of the run (its reply states the node's ``num-partitions``, which the server's partition
    follows: strategies.core.partition_count), before any ``split`` message, and never ``node-info``
    (its ``split-info`` reply carries the partition id); the rounds ask nothing more."""
    ids = random.Random(7).sample(range(1, 1 << 40), 6)   # random node ids, as in Flower's simulation
    s, grid, rows = _split_run(fraction, ids, transport=transport)
    assert all(r["dropped"] == [] and not r.get("skipped") for r in rows), rows
    pushed = _pushed(grid)
    per_action = Counter(a for _, _, a in pushed)
    assert per_action["node-info"] == 0
    assert per_action["split-info"] == len(ids)                               # one per node, once in the run
    info = [(r, n) for r, n, a in pushed if a == "split-info"]
    assert sorted(n for _, n in info) == sorted(ids) and {r for r, _ in info} == {0}
    first_split = next(i for i, (_, _, a) in enumerate(pushed) if a == "split")
    assert all(i < first_split for i, (_, _, a) in enumerate(pushed) if a == "split-info")
    k = round(fraction * len(ids))
    assert [r["participants"] for r in rows] == [k, k]
    assert len({n for r, n, a in pushed if r == 1 and a == "split"}) == k   # (the stream: sessions start)
    if transport == "message":   # each sampled node: I + 1 split messages a round
        for rnd in (1, 2):
            per_node = Counter(n for r, n, a in pushed if r == rnd and a == "split")
            assert len(per_node) == k and set(per_node.values()) == {I + 1}
    # the one directory: partition ids and the data statistics, from the split-info replies
    part = {n: grid.contexts[n].node_config["partition-id"] for n in ids}
    assert s.partition_of == part and s.directory.partitions() == part and s.partition_count == len(ids)
    assert all(s.directory.has_stats(n) and s.directory[n]["n"] > 0 for n in ids)
    assert not hasattr(s, "info")   # one name for the node directory


def test_split_sampling_follows_partitions_whatever_the_node_ids():
    """The split runtime learns partition ids from ``split-info``: the same partitions are
    sampled whatever the (random) node ids, as with ``node-info`` for the other algorithms."""
    picked = []
    for seed in (1, 2):
        ids = random.Random(seed).sample(range(1, 1 << 40), 6)
        s, grid, rows = _split_run(0.5, ids, rounds=2)
        part = {n: c.node_config["partition-id"] for n, c in grid.contexts.items()}
        picked.append([sorted(part[n] for n in {n for r, n, a in _pushed(grid) if r == rnd and a == "split"})
                       for rnd in (1, 2)])
    assert picked[0] == picked[1] and picked[0][0] != picked[0][1]


def test_node_directory_has_one_writer_and_round_trips_through_a_checkpoint():
    d = NodeDirectory()
    d.note(5, 1, 4)
    d.note(6, 0, n=10, hist=np.array([3, 7]))
    d.note(5, 1, n=4, hist=np.array([4, 0]))       # split-info after node-info: the entry grows
    assert d.partitions() == {5: 1, 6: 0} and d.num_partitions == 4
    assert d.has_stats(5) and d[5]["n"] == 4 and not NodeDirectory().has_stats(5)
    with pytest.raises(TypeError):
        d[7] = {"partition": 2}                      # read-only: note() is the one writer
    again = NodeDirectory()
    again.load(d.state())
    assert again.partitions() == d.partitions() and again[6]["hist"].tolist() == [3, 7]


def test_checkpoint_has_no_rng_and_an_older_one_with_rng_still_loads():
    """``BaseStrategy.rng`` was never used: it is gone from the state; a checkpoint written
    before (with an ``"rng"`` entry) still loads."""
    cfg = {**fused_run_config(None), "algo": "scala", "model": "mlp"}
    p = parse_run_config(cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2))
    s.setup(None)
    s.directory.note(11, 0, 2, n=5, hist=np.zeros(10, np.int64))
    state = s.state_dict()
    assert "rng" not in state and not hasattr(s, "rng")
    old = {**state, "rng": random.Random(3).getstate()}
    t = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2))
    t.setup(None)
    t.load_state_dict(old)
    assert t.directory.partitions() == {11: 0} and t.directory[11]["n"] == 5
    assert all(torch.equal(v, t.model.state_dict()[k]) for k, v in s.model.state_dict().items())


def test_one_byte_count_for_records_state_dicts_and_payloads():
    sd = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float64), "n": np.zeros((), np.int64)}
    want = 3 * 4 * 4 + 4 * 8 + 8
    rec = ArrayRecord({k: Array(v) for k, v in sd.items()})
    assert array_bytes(rec) == array_bytes(sd) == array_bytes({"bottom": sd}) - 0 == want
    assert array_bytes({"bottom": sd, "teacher": sd}) == 2 * want
    assert array_bytes(torch.zeros(2, 3)) == 24 and array_bytes({}) == 0
    m = ByteMeter()
    m.add_record("weights", "down", rec)
    assert m.flush() == {"bytes.weights.down": want, "bytes.total": want}


def test_one_cut_check_everywhere():
    model = build_model("cnn", in_channels=1, num_classes=10, image_size=28)
    seq = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"cut='x' is not a cut point of model 'cnn'; allowed: conv1, conv2, fc1$"):
        resolve_cut(model, "x")
    with pytest.raises(ValueError, match=r"an nn.Sequential is cut after one of its children; allowed: 0, 1$"):
        as_staged(seq, "2")                         # the last child (the head) is no cut point
    with pytest.raises(ValueError, match=r"default_cut='b' is not a cut point; allowed: a$"):
        StagedModel("m", [("a", nn.Linear(2, 2)), ("b", nn.Linear(2, 2))], default_cut="b")
    assert resolve_cut(as_staged(seq, "1"), "") == "1"


def test_feature_shape_is_measured_without_touching_the_model():
    model = build_model("cnn", in_channels=1, num_classes=10, image_size=28, norm="bn")
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bottom, _ = split_model(model, "conv2")
    shape = feature_shape(bottom, (1, 28, 28))
    assert shape == tuple(bottom(torch.zeros(2, 1, 28, 28)).shape[1:])
    assert bottom.training and model.training
    model.load_state_dict(before)
    bottom.eval()
    feature_shape(bottom, (1, 28, 28))
    assert not bottom.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # no BN statistics moved


def test_split_runtime_measures_the_same_feature_shape():
    cfg = {**fused_run_config(None), "algo": "scala", "model": "cnn"}
    p = parse_run_config(cfg)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2))
    s.setup(None)
    assert s.act_shape == feature_shape(s.bottom, s.env.input_shape) == (64, 4, 4)


def _msg(algo: str | None):
    grid = LocalGrid(1, dispatch)   # (sets Flower's task identity a Message needs)
    cfg = {} if algo is None else {"algo": algo}
    return query(RecordDict({CONFIG_KEY: ConfigRecord(cfg)}), grid.get_node_ids()[0], "split-info")


def test_one_algorithm_lookup_for_every_clientapp():
    from strategies.client import client_app
    from strategies.fedavg import FedAvgClient
    from strategies.registry import get_algorithm

    assert algorithm_for(_msg("scala")) is get_algorithm("scala")
    with pytest.raises(ValueError, match="malformed message: no 'config' record with an 'algo' entry"):
        algorithm_for(_msg(None))
    with pytest.raises(ConfigError, match="algo='nope' is not one of:"):
        algorithm_for(_msg("nope"))
    client = FedAvgClient(nn.Linear(2, 2), {"labeled": (np.zeros((2, 1, 2, 2), np.uint8), np.zeros(2, np.int64))})
    assert algorithm_for(_msg("fedavg"), client.specs, "FedAvgClient") is client.specs["fedavg"]
    with pytest.raises(ValueError, match=r"FedAvgClient serves algo .*fedavg.*; the message asks for algo='scala'"):
        client.handle(_msg("scala"), None)
    with pytest.raises(ValueError, match=r"this ClientApp serves algo .*; the message asks for algo='scala'"):
        algorithm_for(_msg("scala"), {n: client for n in client.specs})

    # one ClientApp for several clients: Flower routes by message type, the app by the algorithm
    # the message names, to the client that serves it (FedProxClient serves fedprox and fedlc)
    from flwr.app import Message

    from strategies.fedprox import FedProxClient

    data = {"labeled": (np.zeros((2, 1, 2, 2), np.uint8), np.zeros(2, np.int64))}
    prox = FedProxClient(nn.Linear(2, 2), data)
    answered = []
    for c in (client, prox):
        c.handle = (lambda name: lambda msg, ctx: answered.append(
            (name, msg.content.config_records[CONFIG_KEY]["algo"])) or msg)(type(c).__name__)
    app = client_app(client, prox)
    grid = LocalGrid(1, dispatch)
    node = grid.get_node_ids()[0]

    def train(algo: str) -> Message:
        return Message(RecordDict({CONFIG_KEY: ConfigRecord({"algo": algo})}), dst_node_id=node, message_type="train")

    for algo in ("fedprox", "fedavg", "fedlc"):
        app(train(algo), grid.contexts[node])
    assert answered == [("FedProxClient", "fedprox"), ("FedAvgClient", "fedavg"), ("FedProxClient", "fedlc")]
    with pytest.raises(ValueError, match=r"this ClientApp serves algo .*; the message asks for algo='scala'"):
        app(train("scala"), grid.contexts[node])
    with pytest.raises(ValueError, match="two clients serve algo='fedavg'"):
        client_app(client, FedAvgClient(nn.Linear(2, 2), data))



@pytest.mark.parametrize("algo", __import__("strategies.registry", fromlist=["x"]).algorithm_names())
def test_the_bytes_counted_are_the_bytes_on_the_wire(algo):
    """Bytes are counted once, where messages cross (``BaseStrategy.exchange`` for model
    weights, ``split_layer.payload_meter.PayloadMeter`` for split payloads): for every registered
    algorithm, the rounds' ``bytes.<kind>.<direction>`` add up to the array bytes of every
    message the server pushed and every good reply it pulled."""
    from tests.test_conformance import build

    wire = {"down": 0, "up": 0}
    s, grid = build(algo)
    push, pull = grid.push_messages, grid.pull_messages

    def push_spy(messages):
        messages = list(messages)
        wire["down"] += sum(array_bytes(m.content.array_records) for m in messages)
        return push(messages)

    def pull_spy(message_ids):
        replies = list(pull(message_ids))
        wire["up"] += sum(array_bytes(r.content.array_records) for r in replies if not r.has_error())
        return replies

    grid.push_messages, grid.pull_messages = push_spy, pull_spy
    rows: list[dict] = []
    s.start(grid, num_rounds=2, on_round_end=lambda r, m: rows.append(dict(m)))
    counted = {d: sum(v for r in rows for k, v in r.items() if k.startswith("bytes.") and k.endswith("." + d))
               for d in ("down", "up")}
    assert counted == wire, (counted, wire)
    if algo not in ("local-only", "supervised-only"):   # (the two baselines that send no model)
        assert wire["down"] > 0 and wire["up"] > 0, wire
