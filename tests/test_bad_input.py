"""Bad input, tried as a new user would; each case must fail with a clear error before
any training starts. Every row of docs/bad-input.md is backed by a test here (the row
id is in the test name or parameter id).

* every run-config key with a wrong type, and every key that has a range or a choice
  list with a value outside it (generated from the config dataclasses, so new keys are
  covered automatically);
* unknown names: key, namespaced key, namespace, algorithm, choice value;
* a dataset that cannot be loaded offline, a cut point the model does not have, more
  SuperNodes than samples, a CUDA device on a CPU box, a run-name with a '/', resume
  mistakes, a SuperNode without node config;
* through the entry points a user touches: ``python -m flower_apps.simulate`` (exit 2,
  one ``error:`` line, Ray never started) and the ServerApp (``ConfigError`` raised and
  logged before any message is sent; ``flwr run`` itself is in tests/test_deploy.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any, get_type_hints

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from torch import nn

from flower_apps.config import AppConfig, check_partition, parse_run_config, preflight
from strategies.registry import algorithm_names, get_algorithm
from tasks.config import ConfigError, TaskConfig
from tests.test_config import pyproject_config

DEFAULTS = pyproject_config()


# ----------------------------------------------------------------------------- all keys
def key_table() -> dict[str, tuple[type, dict]]:
    """run-config key -> (type, knob metadata) for every key the app accepts."""
    out: dict[str, tuple[type, dict]] = {}
    classes = [(AppConfig, ""), (TaskConfig, "")]
    for name in algorithm_names():
        spec = get_algorithm(name)
        if spec.config_cls is not None:
            classes.append((spec.config_cls, spec.namespace))
    for cls, ns in classes:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            k = f.name.replace("_", "-")
            out[f"{ns}.{k}" if ns else k] = (hints[f.name], dict(f.metadata))
    return out


KEYS = key_table()


def test_key_table_covers_pyproject():
    assert set(KEYS) == set(DEFAULTS)


def wrong_type(typ: type) -> Any:
    return {bool: "maybe", int: 2.5, float: "fast", str: 7}[typ]


def out_of_range(typ: type, meta: dict) -> Any | None:
    if meta.get("choices"):
        return "no-such-choice" if typ is str else -12345
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None:
        v = lo if meta.get("lo_open") else lo - 1
    elif hi is not None:
        v = hi if meta.get("hi_open") else hi + 1
    else:
        return None
    return int(v) if typ is int else float(v)


def parse_with(key: str, value: Any) -> None:
    parse_run_config({**DEFAULTS, key: value})


@pytest.mark.parametrize("key", sorted(KEYS))
def test_wrong_type_names_the_key(key):
    typ, _ = KEYS[key]
    with pytest.raises(ConfigError) as e:
        parse_with(key, wrong_type(typ))
    msg = str(e.value)
    assert msg.startswith(f"{key}=") and "must be" in msg, msg


RANGED = sorted(k for k, (t, m) in KEYS.items() if out_of_range(t, m) is not None)


@pytest.mark.parametrize("key", RANGED)
def test_out_of_range_names_the_key_and_what_is_allowed(key):
    typ, meta = KEYS[key]
    with pytest.raises(ConfigError) as e:
        parse_with(key, out_of_range(typ, meta))
    msg = str(e.value)
    assert msg.startswith(f"{key}=") and ("is out of range; allowed" in msg or "is not one of:" in msg), msg


@pytest.mark.parametrize("override, needle", [
    pytest.param({"num-round": 2}, "unknown run-config key 'num-round' (did you mean num-rounds?)", id="unknown-key"),
    pytest.param({"scala.local-iteration": 2}, "unknown run-config key 'scala.local-iteration'", id="unknown-ns-key"),
    pytest.param({"scalaa.x": 2}, "unknown run-config namespace in 'scalaa.x'", id="unknown-namespace"),
    pytest.param({"algo": "fixmatch"}, "algo='fixmatch' is not one of:", id="unknown-algo"),
    pytest.param({"model": "resnet50"}, "model='resnet50' is not one of:", id="unknown-model"),
    pytest.param({"device": "tpu"}, "device='tpu' is not one of: auto, cpu, cuda", id="unknown-device"),
    pytest.param({"run-name": "a/b"}, "run-name='a/b' must be a plain folder name", id="run-name-slash"),
    pytest.param({"resume": True, "run-name": ""}, "resume=true needs run-name", id="resume-no-name"),
    pytest.param({"local-epochs": 0, "local-steps": 0}, "local-epochs and local-steps are both 0", id="no-local-work"),
])
def test_unknown_names_and_combinations(override, needle):
    with pytest.raises(ConfigError) as e:
        parse_run_config({**DEFAULTS, **override})
    assert needle in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- preflight
def parsed(**override):
    return parse_run_config({**DEFAULTS, **override})


def test_dataset_that_cannot_be_loaded_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on an offline node; avoids minutes of retries
    import datasets
    import huggingface_hub

    # the libraries read the variable when first imported (maybe earlier in this process)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as e:
        preflight(parsed(dataset="no-such-org/no-such-dataset"))
    msg = str(e.value)
    assert "dataset='no-such-org/no-such-dataset'" in msg and "could not be loaded" in msg, msg
    assert "dataset='mnist5k'" in msg  # tells the user what works offline


def test_dataset_local_path_that_does_not_exist():
    with pytest.raises(ConfigError, match=r"dataset='/nonexistent/data' .*could not be loaded"):
        preflight(parsed(dataset="/nonexistent/data"))


@pytest.mark.parametrize("key", ["dataset-split", "image-key", "label-key"])
def test_hf_only_keys_with_the_embedded_dataset(key):
    with pytest.raises(ConfigError, match=f"{key}='x' does not apply to the embedded dataset='mnist5k'"):
        preflight(parsed(**{key: "x"}))


@pytest.mark.parametrize("algo", ["scala", "fedavg"])   # (renamed: the test fails, never runs nothing)
def test_cut_point_that_does_not_exist(algo):
    with pytest.raises(ConfigError) as e:
        preflight(parsed(algo=algo, model="cnn", cut="conv9"))
    msg = str(e.value)
    assert msg.startswith("cut='conv9' is not a cut point of model='cnn'; allowed:"), msg


def test_valid_cut_points_pass():
    from tasks.models import build_model

    m = build_model("cnn", in_channels=1, num_classes=10, image_size=28)
    for cut in m.cut_points:
        preflight(parsed(cut=cut))


def test_cuda_device_on_a_cpu_box():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this box has CUDA")
    with pytest.raises(ConfigError, match="device='cuda' but CUDA is not available here"):
        preflight(parsed(device="cuda"))


def test_more_clients_than_samples():
    with pytest.raises(ConfigError) as e:
        check_partition(parsed(), 5000)  # MNIST-5k keeps 4000 training samples
    msg = str(e.value)
    assert "cannot be partitioned over 5000 SuperNode(s)" in msg and "cannot split 4000 samples" in msg, msg


def test_min_partition_size_too_large_for_the_nodes():
    with pytest.raises(ConfigError, match="partition-min-size=2000"):
        check_partition(parsed(**{"partition-min-size": 2000}), 3)


# ----------------------------------------------------------------------------- entry points
def test_simulate_cli_reports_and_exits_2(capsys):
    """``python -m flower_apps.simulate``: one error line, exit status 2, no Ray."""
    from flower_apps import simulate

    cases = {
        "num-round=2": "Key 'num-round' is not present in the main dictionary",
        "num-rounds=0": "num-rounds=0 is out of range; allowed [1, inf]",
        "cut='conv9'": "cut='conv9' is not a cut point of model='cnn'",
    }
    for arg, needle in cases.items():
        assert simulate.main(["--num-supernodes", "3", "-c", arg]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err, (arg, err)
    assert simulate.main(["--num-supernodes", "5000", "-c", "num-rounds=1"]) == 2
    assert "cannot be partitioned over 5000 SuperNode(s)" in capsys.readouterr().err


class CountingGrid:
    """A Grid stand-in with ``n`` connected nodes that answer the one query a run asks before it
    trains (``node-info``, or a split node's ``split-info``: their partition and
    ``num-partitions``, strategies.core.partition_count) and
    count every other message pushed (none may be: training would have started)."""

    def __init__(self, n: int) -> None:
        from split_layer.transport import LocalGrid

        self.n, self.pushed = n, 0
        self.nodes = LocalGrid(n, _node_info_only)

    def get_node_ids(self):
        return self.nodes.get_node_ids()

    def push_messages(self, msgs):
        msgs = list(msgs)
        if any(m.metadata.message_type not in ("query.node_info", "query.split_info") for m in msgs):
            self.pushed += len(msgs)
            raise AssertionError("a message was sent: training started")
        return self.nodes.push_messages(msgs)

    def pull_messages(self, ids):
        return self.nodes.pull_messages(ids)


def _node_info_only(msg, context):
    from flower_apps.client_app import dispatch
    from strategies.core.records import action_of

    if action_of(msg) not in ("node-info", "split-info"):
        raise AssertionError(f"only the partition query is answered, not {action_of(msg)}")
    return dispatch(msg, context)


@pytest.mark.parametrize("override, nodes, needle", [
    pytest.param({"num-rounds": 0}, 3, "num-rounds=0 is out of range", id="serverapp-range"),
    pytest.param({"cut": "conv9"}, 3, "cut='conv9' is not a cut point", id="serverapp-cut"),
    pytest.param({}, 5000, "cannot split 4000 samples over num_clients=5000", id="serverapp-too-many-nodes"),
])
def test_serverapp_fails_before_sending_anything(tmp_path, override, nodes, needle):
    from flower_apps.server_app import run

    grid = CountingGrid(nodes)
    cfg = {**DEFAULTS, "results-dir": str(tmp_path), "run-name": "bad", "num-rounds": 1, **override}
    with pytest.raises(ConfigError) as e:
        run(grid, cfg)
    assert needle in str(e.value), str(e.value)
    assert grid.pushed == 0
    assert not (tmp_path / "bad").exists()  # no run folder for a run that never started


def test_resume_mistakes(tmp_path):
    from flower_apps.results import RunFolder

    f = RunFolder(tmp_path / "r")
    with pytest.raises(FileNotFoundError, match="resume=true but .*config.json does not exist"):
        f.start({"lr": 0.1}, resume=True)
    f.start({"lr": 0.1, "num-rounds": 2}, resume=False)
    f.append_metrics(1, {"accuracy": 0.5})
    with pytest.raises(ValueError, match="run config differs from .* in: lr"):
        f.start({"lr": 0.2, "num-rounds": 3}, resume=True)
    with pytest.raises(FileExistsError, match="already holds a run; choose another run-name"):
        f.start({"lr": 0.1, "num-rounds": 2}, resume=False)
    assert f.start({"lr": 0.1, "num-rounds": 3}, resume=True) == 0  # num-rounds may grow
    # a knob the library gained after the run started: fine at its default, a difference otherwise
    d = {"lr": 0.05, "cutout": -1}
    with pytest.raises(ValueError, match="differs from .* in: cutout"):
        f.start({"lr": 0.1, "num-rounds": 3, "cutout": -1}, resume=True)          # default unknown
    with pytest.raises(ValueError, match="differs from .* in: cutout"):
        f.start({"lr": 0.1, "num-rounds": 3, "cutout": 7}, resume=True, defaults=d)
    assert f.start({"lr": 0.1, "num-rounds": 3, "cutout": -1}, resume=True, defaults=d) == 0
    # the folder's config then says what runs (the report groups it with runs that had the knob)
    assert json.loads((tmp_path / "r" / "config.json").read_text()) == {"lr": 0.1, "num-rounds": 2, "cutout": -1}


def test_supernode_without_node_config():
    """A SuperNode started without --node-config: its reply is an error naming the flag."""
    from flwr.app import ConfigRecord, Message
    from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: F401  (TaskIdentity set below)
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.core.records import TASK_KEY, client_env, task_record

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    msg = Message(RecordDict({TASK_KEY: task_record(TaskConfig()), "config": ConfigRecord({"algo": "fedavg"})}),
                  dst_node_id=5, message_type="train")
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ConfigError, match='--node-config "partition-id=<i> num-partitions=<n>"'):
        client_env(msg, ctx, "all")
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 3, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    with pytest.raises(ConfigError, match=r"partition-id=3 is outside \[0, num-partitions=3\)"):
        client_env(msg, ctx, "all")


def test_node_data_path_overrides_the_dataset_location(tmp_path):
    """node config ``data-path``: the node reads its copy of the run's dataset from there."""
    import dataclasses

    import numpy as np

    datasets = pytest.importorskip("datasets")
    from flwr.app import ConfigRecord, Message
    from flwr.supercore.task_identity import TaskIdentity

    from strategies.core.records import TASK_KEY, client_env, task_record
    from tasks.env import load_bundle

    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 255, size=(40, 8, 8), dtype=np.uint8)
    ds = datasets.Dataset.from_dict({"image": [i.tolist() for i in imgs], "label": [i % 2 for i in range(40)]})
    ds.save_to_disk(str(tmp_path / "copy"))
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    task = TaskConfig(dataset="some-org/tiny-digits")  # the id the server knows; not loadable here
    msg = Message(RecordDict({TASK_KEY: task_record(task), "config": ConfigRecord({"algo": "fedavg"})}),
                  dst_node_id=5, message_type="train")
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 1, "num-partitions": 2,
                                                    "data-path": str(tmp_path / "copy")},
                  state=RecordDict(), run_config={})
    env = client_env(msg, ctx, "all")
    assert env.augmenter.image_size == 8 and not env.augmenter.flip  # the run's name: digits, no flip
    assert len(env.labeled()) + len(client_env(msg, Context(
        run_id=1, node_id=6, node_config={"partition-id": 0, "num-partitions": 2,
                                          "data-path": str(tmp_path / "copy")},
        state=RecordDict(), run_config={}), "all").labeled()) == len(
        load_bundle(dataclasses.replace(task, dataset=str(tmp_path / "copy"))).train)


def test_drop_warning_names_the_real_exception_of_a_simulated_clientapp():
    """Flower's simulation engine wraps a ClientApp's exception in ClientAppException around
    Ray's traceback; the drop warning shows the exception the ClientApp raised, in full."""
    from strategies.core.records import describe_error

    frames = "".join(f'  File "/site-packages/mod{i}.py", line {i}, in f{i}\n    call_{i}()\n' for i in range(30))
    reason = ("<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException ClientAppException "
              "occurred. Message: ray::ClientAppActor.run() (pid=4242, ip=127.0.0.1, "
              "actor_id=abc, repr=<flwr.simulation.ray_transport.ray_actor.ClientAppActor object>)\n"
              f"Traceback (most recent call last):\n{frames}"
              "ValueError: Expected more than 1 value per channel when training, got input size "
              "torch.Size([1, 500])'>")
    assert len(reason) > 500
    assert describe_error(reason) == ("ValueError: Expected more than 1 value per channel when training, "
                                      "got input size torch.Size([1, 500])")
    # a deployment reply: "<class 'T'>:<'message'>"
    assert describe_error("<class 'ZeroDivisionError'>:<'division by zero'>") == "ZeroDivisionError: division by zero"
    assert describe_error("something else entirely") == "something else entirely"


# ----------------------------------------------------------------------------- variant switches
def _conflicts() -> list:
    """(algo, run-config key, a value other than the one the variant fixes) for every fixed
    switch of every registered variant."""
    from tasks.config import key_of

    out = []
    for name in algorithm_names():
        spec = get_algorithm(name)
        for field_name, fixed in sorted(spec.overrides.items()):
            key = key_of(field_name, spec.namespace)
            _, meta = KEYS[key]
            if isinstance(fixed, bool):
                other = not fixed
            elif isinstance(fixed, str):
                other = next(c for c in meta["choices"] if c != fixed)
            else:
                other = fixed + 0.5 if isinstance(fixed, float) else fixed + 1
            out.append(pytest.param(name, key, fixed, other, id=f"{name}-{key}"))
    return out


@pytest.mark.parametrize("algo, key, fixed, other", _conflicts())
def test_variant_switch_contradicted_by_a_user_key_names_both(algo, key, fixed, other):
    """A key the user set that contradicts a variant's fixed switch is an error naming the key,
    the algo and the fixed value, also when the user's value is the key's default (the
    override keys tell what the user set); the variant's own value is accepted."""
    cfg = {**DEFAULTS, "algo": algo, key: other}
    with pytest.raises(ConfigError) as e:
        parse_run_config(cfg, explicit={"algo", key})
    msg = str(e.value)
    assert key in msg and f"algo={algo!r}" in msg and "contradicts" in msg, msg
    parse_run_config({**DEFAULTS, "algo": algo, key: fixed}, explicit={"algo", key})  # agreeing: fine
    parse_run_config({**DEFAULTS, "algo": algo}, explicit={"algo"})  # not set: the variant's value


def test_variant_conflict_reported_by_the_serverapp_from_the_runs_override_keys(tmp_path):
    """``algo='fed-pseudo' fedshvr.correction=true``: true is the key's default, so only the
    run's override config (``grid.run.override_config``) shows the user set it."""
    from types import SimpleNamespace

    from flower_apps.server_app import run

    grid = CountingGrid(3)
    grid.run = SimpleNamespace(override_config={"algo": "fed-pseudo", "fedshvr.correction": True})
    cfg = {**DEFAULTS, "algo": "fed-pseudo", "results-dir": str(tmp_path), "run-name": "bad"}
    assert cfg["fedshvr.correction"] is True  # the default
    with pytest.raises(ConfigError, match=r"fedshvr.correction=true contradicts algo='fed-pseudo', which fixes "
                                          r"fedshvr.correction=false .*choose algo 'fedshvr'"):
        run(grid, cfg)
    assert grid.pushed == 0
    grid.run = SimpleNamespace(override_config={"algo": "fed-pseudo"})
    with pytest.raises(Exception) as e:  # no conflict: the run gets past the config (to this fake grid)
        run(grid, {**cfg, "run-name": "ok"})
    assert not isinstance(e.value, ConfigError), e.value

# ----------------------------------------------------------------------------- a user's own Client classes
class _Whole(nn.Module):
    """A whole, uncut model with 10 outputs (8x8 grey images)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc = nn.Flatten(), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.body(x))


def _shard(labels) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.int64)
    return np.random.default_rng(0).integers(0, 256, (len(y), 1, 8, 8), dtype=np.uint8), y


def _node(labels=range(10)) -> dict:
    x, y = _shard(labels)
    return {"labeled": (x, y), "unlabeled": x, "test": (x, y)}


def client_classes() -> dict[str, type]:
    """Every algorithm's Client class (the library's AlgorithmClient subclasses), by name."""
    from strategies.client import AlgorithmClient

    algorithm_names()   # (imports every algorithm module)
    out, todo = {}, [AlgorithmClient]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.module and sub.__module__.startswith("strategies."):
                out[sub.__name__] = sub
    return out


def _split(cls) -> bool:
    return any(getattr(s.strategy_cls, "staged", False) for s in importlib.import_module(cls.module).ALGORITHMS.values())


CLIENTS = client_classes()
SPLIT_CLIENTS = sorted(n for n, c in CLIENTS.items() if _split(c))


def test_the_split_clients_are_found():
    assert {"ScalaClient", "SemiSFLClient", "ScalaPEClient"} <= set(SPLIT_CLIENTS) and "FedAvgClient" not in SPLIT_CLIENTS


@pytest.mark.parametrize("name", SPLIT_CLIENTS)
def test_a_split_client_refuses_an_uncut_model_at_construction(name):
    """``ScalaClient(<a whole model>, ...)`` is refused by the constructor, naming the argument
    and what is allowed (before: it built, and every node was dropped at every round)."""
    cls = CLIENTS[name]
    with pytest.raises(ConfigError, match=rf"^{name}: model: a split algorithm needs a StagedModel, a \(bottom, top\) "
                                          r"pair or an nn.Sequential with a cut; got _Whole$"):
        cls(_Whole(), _node())
    cls((nn.Flatten(), nn.Linear(64, 10)), _node())                 # a (bottom, top) pair
    cls(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), _node())    # cut where the server's cut says


@pytest.mark.parametrize("name", sorted(set(CLIENTS) - set(SPLIT_CLIENTS)))
def test_a_full_model_client_takes_a_whole_model(name):
    CLIENTS[name](_Whole(), _node())


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_labels_outside_the_models_classes_are_refused_at_construction(name):
    """Labels 1..10 with a 10-class model: refused by the constructor with what was found (before:
    ``IndexError: Target 10 is out of bounds`` at the first evaluation)."""
    model = (nn.Flatten(), nn.Linear(64, 10)) if name in SPLIT_CLIENTS else _Whole()
    with pytest.raises(ConfigError, match=rf"^{name}: labeled set's labels: found 1 \.\. 10 \(10 distinct values\); "
                                          r"the model has 10 outputs, so labels must be 0 \.\. 9"):
        CLIENTS[name](model, _node(range(1, 11)))


def test_labels_are_checked_against_the_classes_inferred_one_way():
    """Without ``num_classes`` the number of classes is the model's outputs (not the largest label
    + 1, which made labels 1..10 eleven classes); the check uses the same number; a given
    ``num_classes`` above the model's outputs does not widen what the model can predict."""
    from strategies.fedavg import FedAvgClient, FedAvgStrategy
    from tasks.env import NodeData, user_num_classes

    assert user_num_classes(_Whole(), NodeData.of(labeled=_shard(range(9)))) == 10
    assert user_num_classes(_Whole, NodeData.of(labeled=_shard(range(9)))) == 9     # a factory: from the labels
    assert user_num_classes(_Whole(), NodeData.of(labeled=_shard(range(9))), num_classes=12) == 12
    with pytest.raises(ConfigError, match=r"test set's labels: found 0 \.\. 10 \(11 distinct values\); the model has "
                                          r"10 outputs and num_classes=11, so labels must be 0 \.\. 9"):
        FedAvgClient(_Whole(), {"labeled": _shard(range(10)), "test": _shard(range(11))}, num_classes=11)
    # the strategies refuse the same data with the same check (tasks.env.user_num_classes)
    with pytest.raises(ConfigError, match=r"^test set's labels: found 1 \.\. 10 \(10 distinct values\); the model "
                                          r"has 10 outputs, so labels must be 0 \.\. 9"):
        FedAvgStrategy(model=_Whole(), test_data=_shard(range(1, 11)))


def test_a_client_checks_its_data_as_the_strategies_do():
    """The sets the algorithm needs and the images are checked by the client's constructor when
    the data are given (a function of the node's Context is called at its first message)."""
    from strategies.fedavg import FedAvgClient, FedAvgStrategy
    from strategies.ssfl.ssfl import SSFLClient

    x, y = _shard(range(10))
    with pytest.raises(ConfigError, match="^FedAvgClient: this node has no labeled data; it needs: labeled$"):
        FedAvgClient(_Whole(), {"unlabeled": x})
    with pytest.raises(ConfigError, match="^SSFLClient: this node has no unlabeled data"):
        SSFLClient(_Whole(), {"labeled": (x, y)})
    flat = (np.zeros((4, 1, 8, 6), np.uint8), np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match=r"^FedAvgClient: images must be square \[C, H, H\]; got \[C, H, W\] = \[1, 8, 6\]"):
        FedAvgClient(nn.Sequential(nn.Flatten(), nn.Linear(48, 10)), {"labeled": flat})
    with pytest.raises(ConfigError, match=r"^images must be square \[C, H, H\]; got \[C, H, W\] = \[1, 8, 6\]"):
        FedAvgStrategy(model=nn.Sequential(nn.Flatten(), nn.Linear(48, 10)), test_data=flat)
    FedAvgClient(_Whole(), lambda context: {"unlabeled": x})   # a function: checked when a message comes
