"""The public API for a user's own model and data (README "Use an algorithm in your own Flower app").

* The library's app is one user of it: each paper's algorithm, given the library's own model,
  data and partition through the public API (``model=``, ``labeled_data=``, ``test_data=``
  and an ``AlgorithmClient`` per node), ends with the same weights as through the run config.
* Keyword constructors: the paper's defaults, checked values, variants by ``algo=``.
* A user's data in the forms a PyTorch user has it; bad data and bad models are clear errors.
"""
import importlib

import numpy as np
import pytest
import torch
from torch import nn

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from strategies.client import AlgorithmClient, client_app
from tasks.config import ConfigError
from tasks.data import DatasetError, as_dataset
from tasks.env import NodeData, library_env
from tests.test_conformance import NODES, config, state_of

# the client class of each algorithm (one class serves every algorithm of its module)
MAIN = {"fedavg": "FedAvg", "ssfl": "SSFL", "semisfl": "SemiSFL", "scala": "Scala", "fedshvr": "FedSHVR",
        "umpfssl": "UMPFSSL", "fedprox": "FedProx", "fedlc": "FedProx",
        # the baselines: Semi-SFL's, SCALA's, the SSFL benchmark's
        "semifl": "SemiFL", "fedmatch": "FedMatch", "fedswitch": "FedSwitch", "fedcbs": "FedCBS",
        "fedconcat": "FedConcat", "datasharing": "DataSharing", "easgd": "EASGD", "overlapsgd": "EASGD",
        # UM-pFSSL's Table 1
        "fedavg-sl": "FedAvgSL", "fedprox-sl": "FedAvgSL", "fedbn-sl": "FedAvgSL", "fixbn": "FixBN",
        "lg-fedavg-fix": "LGFedAvg", "pfedme-fix": "PFedMe",
        # SCALA's split baselines
        "sfl-local-loss": "Scala", "cs-sfl": "Scala", "minibatch-sfl": "Scala", "scala-pe": "ScalaPE"}
MODULE = {"fedlc": "fedprox", "easgd": "elastic", "overlapsgd": "elastic", "fedavg-sl": "supervised_refs",
          "fedprox-sl": "supervised_refs", "fedbn-sl": "supervised_refs", "fixbn": "fedbn",
          "lg-fedavg-fix": "lgfedavg", "pfedme-fix": "pfedme", "sfl-local-loss": "scala", "cs-sfl": "scala",
          "minibatch-sfl": "scala", "scala-pe": "scala_pe"}   # (a module named after another)


def _client_cls(algo: str) -> type[AlgorithmClient]:
    from strategies.registry import module_of

    module = importlib.import_module(module_of(algo))
    assert module.__name__.rsplit(".", 1)[-1] == MODULE.get(algo, algo)
    return getattr(module, f"{MAIN[algo]}Client")


@pytest.mark.parametrize("algo", list(MAIN))
def test_the_library_app_is_one_user_of_the_public_api(algo):
    cfg = config(algo)
    p = parse_run_config(cfg)
    cls = p.spec.strategy_cls
    policy = RoundPolicy(min_nodes=2, round_timeout=60)

    lib = cls(p.task, p.algo, p.spec.name, policy)
    res_lib = lib.start(LocalGrid(NODES, dispatch, run_config=cfg), num_rounds=2)

    server = library_env(p.task, NODES, cls.label_mode, cls.with_client_test)

    def node_data(context) -> NodeData:
        env = library_env(p.task, NODES, cls.label_mode, cls.with_client_test,
                          int(context.node_config["partition-id"]))
        return env.data

    client = _client_cls(algo)(server.build_model(), node_data)
    user = cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2, round_timeout=60),
               model=server.build_model(), test_data=server.test,
               labeled_data=server.server_labeled() if len(server.server_labeled()) else None)
    res_user = user.start(LocalGrid(NODES, client.handle), num_rounds=2)

    # the same computation; float32 reductions split over threads may round differently in the
    # last bit (the data arrays of the two runs sit at other addresses), hence a tolerance far
    # below any change of the algorithm (a flipped augmentation moves 93 % of the weights)
    a, b = state_of(res_lib.arrays), state_of(res_user.arrays)
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=f"{algo}: {k}")
    acc_lib, acc_user = (r.evaluate_metrics_serverapp[2]["accuracy"] for r in (res_lib, res_user))
    assert acc_lib == pytest.approx(acc_user, abs=0.002)


def test_keyword_constructors():
    from strategies.fedavg import FedAvgStrategy
    from strategies.fedshvr.fedshvr import FedSHVRStrategy
    from strategies.scala.scala import ScalaStrategy

    s = FedAvgStrategy()                      # every argument has a default
    assert s.algo == "fedavg" and s.task.lr == 0.05
    s = FedAvgStrategy(lr=0.1, local_steps=3, fraction_train=0.5, min_nodes=3)
    assert (s.task.lr, s.task.local_steps, s.policy.fraction_train, s.policy.min_nodes) == (0.1, 3, 0.5, 3)
    assert ScalaStrategy(local_iterations=4).cfg.local_iterations == 4
    v = FedSHVRStrategy(algo="fed-pseudo")    # a variant sets its fixed switches
    assert (v.algo, v.cfg.correction, v.cfg.alpha1) == ("fed-pseudo", False, 0.0)
    with pytest.raises(ConfigError, match="correction=True contradicts algo='fed-pseudo'"):
        FedSHVRStrategy(algo="fed-pseudo", correction=True)
    with pytest.raises(ConfigError, match="algo='ssfl' is not run by FedSHVRStrategy; it runs: fedshvr, fed-pseudo.*; "
                                          "algo='ssfl' is run by SSFLStrategy"):
        FedSHVRStrategy(algo="ssfl")
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus; options of algo='scala': .*local_iterations"):
        ScalaStrategy(bogus=1)
    with pytest.raises(ConfigError, match=r"lr=-1.0 is out of range"):
        FedAvgStrategy(lr=-1)
    with pytest.raises(ConfigError, match=r"fraction_train=1.5 is out of range; allowed \(0.0, 1.0\]"):
        FedAvgStrategy(fraction_train=1.5)
    from strategies.ssfl.ssfl import SSFLStrategy
    with pytest.raises(ConfigError, match="tau=2.0 is out of range"):
        SSFLStrategy(tau=2.0)
    with pytest.raises(ConfigError, match="pass your model too"):
        FedAvgStrategy(test_data=(np.zeros((2, 1, 8, 8), np.uint8), np.zeros(2, np.int64)))


def test_user_data_in_the_forms_a_torch_user_has_it():
    x = np.random.default_rng(0).random((6, 8, 8)).astype(np.float32)     # [N, H, W] float in [0, 1]
    d = as_dataset((x, np.arange(6) % 3))
    assert d.x.shape == (6, 1, 8, 8) and d.x.dtype == np.uint8 and d.x.max() <= 255
    t = as_dataset(torch.utils.data.TensorDataset(torch.from_numpy(x[:, None]), torch.arange(6)))
    np.testing.assert_array_equal(t.x, d.x)
    u = as_dataset(torch.from_numpy(d.x))                                 # images only: labels unknown
    assert (u.y == -1).all()
    with pytest.raises(DatasetError, match="labeled: labels are needed"):
        as_dataset(d.x, "labeled", need_labels=True)
    with pytest.raises(DatasetError, match=r"float images must lie in \[0, 1\]"):
        as_dataset((x * 255, np.zeros(6, np.int64)))
    with pytest.raises(DatasetError, match="labels must be integers"):
        as_dataset((d.x, np.zeros(6)))
    with pytest.raises(DatasetError, match=r"images must be \[N, C, H, W\]"):
        as_dataset((np.zeros((6, 8), np.uint8), np.zeros(6, np.int64)))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        return self.fc(self.body(x))


def _sets(seed: int, n: int = 24):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, 3, n)


def test_a_node_without_the_data_its_algorithm_needs_is_dropped_with_the_reason(caplog):
    from strategies.fedavg import FedAvgClient, FedAvgStrategy

    good = FedAvgClient(_Tiny(), lambda ctx: {"labeled": _sets(int(ctx.node_config["partition-id"]))})
    bad = FedAvgClient(_Tiny(), lambda ctx: {"unlabeled": _sets(0)[0]})

    def handler(msg, ctx):
        return (bad if int(ctx.node_config["partition-id"]) == 2 else good).handle(msg, ctx)

    s = FedAvgStrategy(model=_Tiny(), test_data=_sets(9), local_steps=2, batch_size=8, min_nodes=2)
    rows = []
    s.start(LocalGrid(3, handler), num_rounds=1, on_round_end=lambda r, m: rows.append(m))
    assert len(rows[0]["dropped"]) == 1 and rows[0]["participants"] == 2
    assert "FedAvgClient: this node has no labeled data; it needs: labeled" in caplog.text


def test_a_model_split_learning_cannot_cut_is_refused_by_the_constructor():
    from strategies.scala.scala import ScalaStrategy

    with pytest.raises(ConfigError, match="model: a split algorithm needs a StagedModel, a \\(bottom, top\\) pair"):
        ScalaStrategy(model=_Tiny(), test_data=_sets(9))
    with pytest.raises(ConfigError, match="cut='9': an nn.Sequential is cut after one of its children; allowed: 0, 1, 2"):
        ScalaStrategy(model=nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3)), cut="9",
                      test_data=_sets(9))


def test_one_clientapp_for_several_algorithms_routes_by_flower_message_type():
    from strategies.fedavg import FedAvgClient
    from strategies.scala.scala import ScalaClient

    data = {"labeled": _sets(0)}
    split = (nn.Sequential(nn.Flatten(), nn.Linear(64, 8)), nn.Linear(8, 3))
    app = client_app(FedAvgClient(_Tiny(), data), ScalaClient(split, data))
    assert sorted(app._registered_funcs) == ["query.node_info", "query.split", "query.split_info", "train.default"]
    with pytest.raises(ValueError, match="two clients serve algo='fedavg'"):
        client_app(FedAvgClient(_Tiny(), data), FedAvgClient(_Tiny(), data))


@pytest.mark.parametrize("build, match", [
    (lambda: __import__("strategies.ssfl.ssfl", fromlist=["x"]).SSFLStrategy(
        model=_Tiny(), labeled_data=_sets(1), local_steps=0, local_epochs=1),
     "ssfl with your own data: set local_steps=K"),
    (lambda: __import__("strategies.ssfl.ssfl", fromlist=["x"]).SSFLStrategy(model=_Tiny(), test_data=_sets(1), local_steps=2),
     r"ssfl needs labeled data on the server: labeled_data=\(x, y\)"),
    (lambda: __import__("strategies.semisfl.semisfl", fromlist=["x"]).SemiSFLStrategy(
        model=(nn.Sequential(nn.Flatten(), nn.Linear(64, 8)), nn.Linear(8, 3)), test_data=_sets(1)),
     r"semisfl needs the labeled set D_l on the server: labeled_data=\(x, y\)"),
    (lambda: __import__("strategies.fedavg", fromlist=["x"]).SupervisedOnlyStrategy(model=_Tiny(), test_data=_sets(1)),
     r"supervised-only needs labeled data on the server: labeled_data=\(x, y\)"),
    (lambda: __import__("strategies.umpfssl.umpfssl", fromlist=["x"]).UMPFSSLStrategy(model=_Tiny(), num_classes=3),
     "needs a model with dropout > 0 for MC-dropout .*model= needs an nn.Dropout layer"),
    (lambda: __import__("strategies.fedavg", fromlist=["x"]).FedAvgStrategy(
        model=_Tiny(), test_data=(np.zeros((4, 1, 8, 6), np.float32), np.zeros(4, np.int64))),
     r"images must be square"),
], ids=["ssfl-local-steps", "ssfl-labeled-data", "semisfl-labeled-data", "supervised-only-labeled-data",
        "umpfssl-dropout", "non-square-images"])
def test_what_a_users_setup_lacks_is_raised_by_the_constructor(build, match, monkeypatch):
    """Each error a user's model and data can cause is raised by the strategy's constructor,
    naming the keyword, before any Flower call."""
    import flwr.serverapp
    monkeypatch.setattr(flwr.serverapp.Grid, "push_messages", lambda *a, **k: pytest.fail("a Flower call"))
    with pytest.raises(ConfigError, match=match):
        build()


def test_nodes_without_a_partition_id_take_part_and_are_sampled():
    """A deployment of your own need not give SuperNodes ``partition-id``: each node's id stands
    in (seeds, sampling order); ``fraction_train`` < 1 still samples them."""
    from strategies.fedavg import FedAvgClient, FedAvgStrategy

    client = FedAvgClient(_Tiny(), lambda ctx: {"labeled": _sets(int(ctx.node_id))})
    grid = LocalGrid(4, client.handle)
    for ctx in grid.contexts.values():
        ctx.node_config.clear()
    s = FedAvgStrategy(model=_Tiny(), test_data=_sets(9), local_steps=2, batch_size=8, min_nodes=2,
                       fraction_train=0.5)
    rows = []
    s.start(grid, num_rounds=2, on_round_end=lambda r, m: rows.append(m))
    assert [r["participants"] for r in rows] == [2, 2] and all(r["dropped"] == [] for r in rows)
    assert sorted(s.partition_of) == sorted(grid.contexts)   # every node answered node-info
    assert all(s.partition_of[n] == n % (1 << 31) for n in grid.contexts)


def test_metrics_against_hidden_labels_are_not_reported_for_images_without_labels():
    """A user's unlabeled images carry y = -1: no pseudo-label accuracy computed against them."""
    from strategies.ssfl.ssfl import SSFLClient, SSFLStrategy

    client = SSFLClient(_Tiny(), lambda ctx: {"unlabeled": _sets(int(ctx.node_config["partition-id"]))[0]})
    s = SSFLStrategy(model=_Tiny(), labeled_data=_sets(8), test_data=_sets(9), local_steps=2, batch_size=8, tau=0.0)
    rows = []
    s.start(LocalGrid(2, client.handle), num_rounds=1, on_round_end=lambda r, m: rows.append(m))
    assert rows[0]["participants"] == 2 and rows[0]["mask-rate"] > 0
    assert "impurity" not in rows[0]                       # was 1.0: every y = -1 counted as wrong
    d = as_dataset((np.zeros((3, 1, 4, 4), np.uint8), torch.arange(3)))
    assert d.labels_known and not as_dataset(np.zeros((3, 1, 4, 4), np.uint8)).labels_known
    t = as_dataset(torch.utils.data.TensorDataset(torch.zeros(3, 1, 4, 4), torch.arange(3)))
    assert t.x.shape == (3, 1, 4, 4) and t.y.tolist() == [0, 1, 2]


def test_an_app_that_embeds_a_strategy_logs_one_progress_line_per_round(caplog):
    import logging

    from strategies.fedavg import FedAvgClient, FedAvgStrategy
    client = FedAvgClient(_Tiny(), lambda ctx: {"labeled": _sets(int(ctx.node_config["partition-id"]))})
    s = FedAvgStrategy(model=_Tiny(), test_data=_sets(9), local_steps=1, batch_size=8)
    with caplog.at_level(logging.INFO, logger="flwr"):
        s.start(LocalGrid(2, client.handle), num_rounds=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert [line.split(" | ")[0] for line in lines] == ["round 1/2", "round 2/2"], lines
    assert all(" | acc 0." in line and " | loss " in line for line in lines)


def test_the_progress_line_names_the_loss_it_has_and_never_prints_a_missing_one_as_nan():
    from strategies.core.round_loop import progress_line
    assert " | loss 0.5000 | " in progress_line(1, 2, {"accuracy": 0.9, "loss": 0.5}, 1.0, 1)
    line = progress_line(1, 2, {"accuracy": 0.4, "train-loss": 1.25}, 1.0, 1)   # a personalised row
    assert " | train-loss 1.2500 | " in line and "nan" not in line, line
    line = progress_line(1, 2, {"accuracy": 0.4}, 1.0, 1)
    assert "loss" not in line and "nan" not in line, line


@pytest.mark.parametrize("form", ["uint8", "float"])
def test_the_readmes_evaluate_fn_with_test_transform_measures_what_the_library_measures(form):
    """README "Use an algorithm in your own Flower app": an evaluate_fn that feeds the model
    ``strategy.test_transform(x)`` gets the library's own accuracy (to one sample), whether the
    user's test images are uint8 or floats in [0, 1]."""
    from flwr.app import MetricRecord

    from strategies.fedavg import FedAvgClient, FedAvgStrategy
    x, y = _sets(9, n=90)
    if form == "float":
        x = (x.astype(np.float32) + np.float32(0.3)) / np.float32(256.0)   # in [0, 1], off the 1/255 grid
    client = FedAvgClient(_Tiny(), lambda ctx: {"labeled": _sets(int(ctx.node_config["partition-id"]))})
    strategy = FedAvgStrategy(model=_Tiny(), test_data=(x, y), local_steps=2, batch_size=8)
    seen = {}

    def evaluate_fn(server_round, arrays):
        net = _Tiny()
        net.load_state_dict(arrays.to_torch_state_dict())
        net.eval()
        with torch.no_grad():
            pred = net(strategy.test_transform(x)).argmax(1).numpy()
        seen[server_round] = float((pred == y).mean())
        return MetricRecord({"my-accuracy": seen[server_round]})

    result = strategy.start(LocalGrid(2, client.handle), num_rounds=2, evaluate_fn=evaluate_fn)
    for rnd in (0, 1, 2):
        ev = result.evaluate_metrics_serverapp[rnd]
        assert abs(ev["my-accuracy"] - ev["accuracy"]) <= 1 / len(y) + 1e-9, (rnd, dict(ev))


class _UserNet(nn.Module):
    """A user's own model, nothing of the library's: conv, BatchNorm, dropout, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.2))
        self.classifier = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.classifier(self.features(x))


def test_an_embedded_strategy_times_its_rounds_on_a_simulated_system(tmp_path):
    """``system=`` on a user's strategy: the user's clients count their work (``XClient`` does it),
    the progress line and every round's metrics show the simulated time."""
    import logging

    from strategies.fedavg import FedAvgClient, FedAvgStrategy

    fleet = tmp_path / "fleet.toml"
    fleet.write_text("[compute]\nrate = 1e9\n[link]\nup-mbps = 1\ndown-mbps = 10\n")
    client = FedAvgClient(_Tiny(), lambda ctx: {"labeled": _sets(int(ctx.node_config["partition-id"]))})
    s = FedAvgStrategy(model=_Tiny(), test_data=_sets(9), local_steps=2, batch_size=8, system=str(fleet))
    rows: list[dict] = []
    logger = logging.getLogger("flwr")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logger.addHandler(handler)
    try:
        res = s.start(LocalGrid(2, client.handle), num_rounds=2, on_round_end=lambda r, m: rows.append(m))
    finally:
        logger.removeHandler(handler)
    assert all(r["sim-client-flops"] > 0 and r["sim-seconds"] > 0 for r in rows)
    assert rows[1]["sim-seconds-total"] == pytest.approx(rows[0]["sim-seconds"] + rows[1]["sim-seconds"])
    assert res.train_metrics_clientapp[2]["sim-seconds-total"] == pytest.approx(rows[1]["sim-seconds-total"])
    assert any(" | sim " in line for line in seen if line.startswith("round 2/2"))


def _full_model_algorithms() -> list[str]:
    from strategies.registry import algorithm_names, get_algorithm

    return [a for a in algorithm_names() if not get_algorithm(a).strategy_cls.staged]


@pytest.mark.parametrize("algo", _full_model_algorithms())
def test_every_full_model_algorithm_trains_a_users_own_model_on_the_users_data(algo):
    """Every registered full-model algorithm (each baseline included, found in the registry, no
    list kept by hand) through the embedding API: the algorithm's own ``XClient`` with a user's
    model and per-node sets, its strategy with the same model class and the server's sets; two
    rounds, every node trains, the returned weights are the user's model's and have moved."""
    from strategies.registry import get_algorithm

    spec = get_algorithm(algo)
    module = importlib.import_module(spec.strategy_cls.__module__)
    (client_cls,) = {c for c in vars(module).values()
                     if isinstance(c, type) and issubclass(c, AlgorithmClient) and c.module == module.__name__}

    def node_data(context) -> dict:
        pid = int(context.node_config["partition-id"])
        x, y = _sets(100 + pid, 48)
        return {"labeled": (x[:24], y[:24]), "unlabeled": (x[24:40], y[24:40]), "test": (x[40:], y[40:])}

    cls = spec.strategy_cls
    server_labeled = _sets(7, 32) if cls.label_mode == "server" else None
    kw = dict(model=_UserNet(), test_data=None if cls.with_client_test else _sets(9), labeled_data=server_labeled,
              local_steps=2, batch_size=8, min_nodes=3, num_classes=3)
    strategy = cls(algo=algo, **kw)
    before = {k: v.detach().clone() for k, v in strategy.model.state_dict().items()}
    rows = []
    res = strategy.start(LocalGrid(3, client_cls(_UserNet(), node_data).handle), num_rounds=2,
                         on_round_end=lambda r, m: rows.append(m))
    assert [r.get("dropped") for r in rows] == [[], []], rows
    assert all(r.get("participants", 3) >= 1 and not r.get("skipped") for r in rows), rows
    arrays = state_of(res.arrays)
    if getattr(strategy, "returns_model", True):
        # the user's model's entries, possibly per client or per cluster ("<pid>/<key>",
        # "encoders.<c>.<key>"): some floating-point entry has moved from the initial model
        assert arrays, "no weights returned"
        moved = [k for k in arrays for b in before if (k == b or k.endswith("/" + b) or k.endswith("." + b))
                 and before[b].dtype.is_floating_point and not np.allclose(arrays[k], before[b].cpu().numpy())]
        assert moved, f"{algo}: no weight of the user's model changed in two rounds"
    acc = rows[-1].get("accuracy")
    assert acc is not None and 0.0 <= acc <= 1.0


# ----------------------------------------------------------------------- what help() and the docs say
def test_a_wrong_algo_names_the_class_that_runs_it():
    from strategies.fedprox import FedProxStrategy
    from strategies.scala.scala import CSSFLStrategy

    with pytest.raises(ConfigError, match=r"algo='fedlc' is not run by FedProxStrategy; it runs: fedprox; "
                                          r"algo='fedlc' is run by FedLCStrategy \(from strategies\.\S+ import "
                                          r"FedLCStrategy\)"):
        FedProxStrategy(algo="fedlc")
    with pytest.raises(ConfigError, match="algo='scala' is not run by CSSFLStrategy; it runs: cs-sfl; "
                                          "algo='scala' is run by ScalaStrategy"):
        CSSFLStrategy(algo="scala")
    with pytest.raises(ConfigError, match="algo='no-such' is not run by FedProxStrategy; it runs: fedprox; "
                                          "the algorithms are: .*fedavg"):
        FedProxStrategy(algo="no-such")


def _runs_with(spec) -> dict:
    """The algorithm config values ``spec`` runs with by default: its dataclass's defaults,
    its fixed switches applied."""
    import dataclasses

    if spec.config_cls is None:
        return {}
    return {f.name: spec.overrides.get(f.name, getattr(spec.config_cls(), f.name))
            for f in dataclasses.fields(spec.config_cls) if f.init}


def test_each_strategy_class_signature_shows_the_defaults_it_runs_with():
    """``help(Cls)`` and ``inspect.signature(Cls)``: ``algo`` defaults to the class's first
    algorithm, and each option of that algorithm's config to the value that algorithm uses
    (CS-SFL's ``server_mode='per-client'``, ``balanced_selection=True``, not SCALA's)."""
    import inspect
    import pydoc

    from strategies.registry import algorithm_names, get_algorithm
    from strategies.scala.scala import CSSFLStrategy, ScalaStrategy

    classes = {get_algorithm(n).strategy_cls for n in algorithm_names()}
    for cls in classes:
        first = next(iter(cls.specs.values()))
        params = inspect.signature(cls).parameters
        assert params["algo"].default == first.name, cls
        for name, value in _runs_with(first).items():
            assert params[name].default == value, (cls.__name__, name)
        assert "options" in params   # (the task config's and the round policy's keywords)
    text = pydoc.render_doc(CSSFLStrategy, renderer=pydoc.plaintext)
    mode = "server_mode: 'str, one of concat, per-client, sequential, local-loss' = "
    assert "algo: 'str | None' = 'cs-sfl'" in text
    assert mode + "'per-client'" in text and "balanced_selection: 'bool' = True" in text, text[:2000]
    assert mode + "'concat'" not in text and "balanced_selection: 'bool' = False" not in text
    scala = pydoc.render_doc(ScalaStrategy, renderer=pydoc.plaintext)
    assert mode + "'concat'" in scala and "balanced_selection: 'bool' = False" in scala


def _client_names(algo: str) -> set[str]:
    """The public names, in the library's modules, of the client classes that serve ``algo``
    (an ``AlgorithmClient`` subclass bound in the module whose algorithms it serves)."""
    import sys

    names = set()
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("strategies.") or mod is None:
            continue
        for name, obj in vars(mod).items():
            if (isinstance(obj, type) and issubclass(obj, AlgorithmClient) and not name.startswith("_")
                    and obj.module == mod_name and algo in importlib.import_module(obj.module).ALGORITHMS):
                names.add(name)
    return names


def test_docs_api_lists_every_algorithms_strategy_and_client_class():
    from pathlib import Path

    from strategies.registry import algorithm_names, get_algorithm

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    missing = []
    for algo in algorithm_names():
        spec = get_algorithm(algo)
        clients = _client_names(algo)
        if spec.client:
            assert clients, f"{algo}: no client class serves it"
        for name in {spec.strategy_cls.__name__, *clients}:
            if f"`{name}`" not in text:
                missing.append(f"{algo}: {name}")
    assert missing == [], missing
