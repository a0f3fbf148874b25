"""An algorithm from outside the library registers itself by an ordinary import of its module.

The test writes a new module into a temporary folder (not the library, no library file
edited): FedAvg with a server learning rate, a subclass with one override, a config
dataclass of one knob and a query action of its own, registered by
``ALGORITHMS = register({...})``. It reaches the registry the two ways a module from outside
the library does:

* **an installed package**: beside the module, a ``<name>.dist-info`` with ``METADATA`` and
  ``entry_points.txt`` declaring it under the entry-point group ``flower_ssl.algorithms``
  (what ``pip install`` writes for a ``[project.entry-points."flower_ssl.algorithms"]`` table).
  The registry imports it from the entry point: the run config accepts it and its
  namespace, a fresh ClientApp process routes its query action, and it passes every condition
  of the conformance matrix;
* **a module that is not installed**: the run config's ``algo-modules`` names it, and the
  library's ClientApp imports it from there.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies import registry
from tests import test_conformance as matrix

ROOT = Path(__file__).resolve().parents[1]
NAME = "toy-server-lr"
MODULE = "toy_server_lr_algorithm"
SOURCE = textwrap.dedent('''
    """FedAvg with a server learning rate: w <- w + eta (avg - w) (a toy, outside the library)."""
    from dataclasses import dataclass

    import numpy as np
    from flwr.app import Message, MetricRecord, RecordDict

    from strategies.fedavg import FedAvgStrategy, client_train
    from strategies.registry import AlgorithmSpec, register
    from tasks.config import knob


    @dataclass
    class ServerLRConfig:
        server_lr: float = knob(0.5, lo=0.0, hi=1.0, help="server step towards the clients' average")


    class ServerLRStrategy(FedAvgStrategy):
        def load_aggregate(self, state):
            old = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
            eta = self.cfg.server_lr
            super().load_aggregate({k: old[k] + eta * (v - old[k]) if np.issubdtype(v.dtype, np.floating) else v
                                    for k, v in state.items()})


    def client_ping(msg, context):
        return Message(RecordDict({"metrics": MetricRecord({"pong": 1})}), reply_to=msg)


    ALGORITHMS = register({
        "toy-server-lr": AlgorithmSpec(name="toy-server-lr", paper="a test's toy", strategy_cls=ServerLRStrategy,
                                       config_cls=ServerLRConfig, namespace="toy",
                                       client={"train": client_train, "toy-ping": client_ping}),
    })
''')
ENTRY_POINTS = f"[{registry.ENTRY_POINT_GROUP}]\n{NAME} = {MODULE}\n"
METADATA = "Metadata-Version: 2.1\nName: toy-server-lr\nVersion: 0.1\n"


def _forget() -> None:
    registry.unregister(NAME)
    sys.modules.pop(MODULE, None)


def write_package(site: Path, entry_points: str = ENTRY_POINTS, source: str = SOURCE) -> Path:
    """The toy as ``pip install`` leaves a package in site-packages: its module, and a
    ``.dist-info`` folder whose ``entry_points.txt`` declares it."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{MODULE}.py").write_text(source)
    info = site / "toy_server_lr-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(METADATA)
    (info / "entry_points.txt").write_text(entry_points)
    return site


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The toy package installed (on ``sys.path``, importlib's metadata caches refreshed); the
    module is not imported: the registry imports it from the entry point."""
    assert NAME not in registry.algorithm_names()
    site = write_package(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        _forget()
        monkeypatch.undo()
        importlib.invalidate_caches()


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    """The toy as a plain module on the path (no package metadata), not imported."""
    assert NAME not in registry.algorithm_names()
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield tmp_path
    finally:
        _forget()


def test_an_installed_package_registers_its_algorithm_through_its_entry_point(installed):
    assert MODULE not in sys.modules
    assert NAME in registry.load_entry_points()          # imported from the entry point: registered
    assert MODULE in sys.modules and NAME in registry.algorithm_names()
    toy = sys.modules[MODULE]
    spec = registry.get_algorithm(NAME)
    assert spec.strategy_cls is toy.ServerLRStrategy and toy.ServerLRStrategy.specs == {NAME: spec}
    assert registry.module_of(NAME) == MODULE
    p = parse_run_config({**matrix.config(NAME), "toy.server-lr": 0.25})
    assert p.spec is spec and p.algo.server_lr == 0.25
    with pytest.raises(Exception, match="toy.server-lr"):
        parse_run_config({**matrix.config(NAME), "toy.server-lr": 2.0})
    s = toy.ServerLRStrategy(server_lr=0.1)   # the keyword API too; help() shows its default
    assert s.cfg.server_lr == 0.1
    assert inspect.signature(toy.ServerLRStrategy).parameters["server_lr"].default == 0.5


def test_a_process_started_after_the_install_finds_it_without_any_config(installed):
    """A deployment's ClientApp process: the library's ClientApp, imported in a new process,
    routes the plugin's own query action (Flower's ``query.toy_ping``) and looks its name up,
    with no ``algo-modules`` in any config."""
    code = ("import flower_apps.client_app as c, sys; from strategies import registry; "
            "print(sorted(c.app._registered_funcs)); print(registry.get_algorithm(sys.argv[1]).strategy_cls.__module__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code, NAME], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    routes, module = out.stdout.strip().splitlines()[-2:]
    assert "'query.toy_ping'" in routes and "'query.node_info'" in routes and "'train.default'" in routes
    assert module == MODULE


def test_an_entry_point_that_cannot_be_imported_is_a_config_error_naming_it(tmp_path, monkeypatch):
    site = write_package(tmp_path / "site", entry_points=f"[{registry.ENTRY_POINT_GROUP}]\n{NAME} = no_such_toy\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    try:
        with pytest.raises(Exception, match=rf"entry point {NAME} = 'no_such_toy' \(group flower_ssl.algorithms\) "
                                            r"of package toy-server-lr 0.1: cannot import it"):
            registry.load_entry_points()
    finally:
        monkeypatch.undo()
        importlib.invalidate_caches()


def test_it_passes_the_conformance_matrix(installed, tmp_path, monkeypatch, caplog):
    """Every condition of tests/test_conformance.py (each ``test_conformance_*`` there, so a
    condition added later is covered too), run for the plugin's name, which the registry
    finds from the entry point alone."""
    assert MODULE not in sys.modules
    registry.load_entry_points()   # (what a process started after the install does first)
    conditions = [f for n, f in vars(matrix).items() if n.startswith("test_conformance_") and callable(f)]
    assert len(conditions) >= 9
    fixtures = {"monkeypatch": monkeypatch, "tmp_path": tmp_path, "caplog": caplog}
    for condition in conditions:
        matrix.task_env.plan_cached.cache_clear()
        kw = {n: fixtures[n] for n in inspect.signature(condition).parameters if n != "algo"}
        with caplog.at_level(logging.WARNING):
            condition(NAME, **kw)
        assert MODULE in sys.modules   # (imported by the registry from the entry point)


def test_the_library_clientapp_imports_a_module_named_in_algo_modules(toy_module):
    """A module that is not an installed package: a node's ClientApp process that has not
    imported it imports it from the run config's ``algo-modules``."""
    s, grid = matrix.build(NAME, **{"algo-modules": MODULE})   # the server side imports it
    assert registry.module_of(NAME) == MODULE
    _forget()                                                  # ... but this "node" has not
    assert NAME not in registry.algorithm_names()
    for ctx in grid.contexts.values():
        assert ctx.run_config["algo-modules"] == MODULE
    msgs = []

    def spy(msg, context):
        msgs.append(msg.metadata.message_type)
        return dispatch(msg, context)

    grid.handler = spy
    res, rows = matrix.run(s, grid, rounds=1)
    assert rows[0]["participants"] == matrix.NODES and rows[0]["dropped"] == [] and "train" in msgs
    assert NAME in registry.algorithm_names()


def test_an_unknown_algorithm_names_both_ways_to_add_one():
    with pytest.raises(Exception, match="entry-point group 'flower_ssl.algorithms', or name its module in "
                                        "algo-modules"):
        registry.get_algorithm("not-an-algorithm")
    with pytest.raises(Exception, match="algo-modules: cannot import 'no_such_module_here'"):
        parse_run_config({**matrix.config("fedavg"), "algo-modules": "no_such_module_here"})


def test_every_library_algorithm_registers_when_its_module_is_imported():
    names = registry.algorithm_names()
    assert len(names) >= 45
    for name in names:
        spec = registry.get_algorithm(name)
        assert spec.name == name and name in spec.strategy_cls.specs
        module = sys.modules[registry.module_of(name)]
        assert module.__name__.startswith("strategies.")
    # every query action of a library algorithm's handlers is routed by the library's ClientApp
    assert registry.query_actions() == ("node-info", "label-histogram", "select", "split", "split-info", "warmup")
    from flower_apps.client_app import app
    assert {f"query.{a.replace('-', '_')}" for a in registry.query_actions()} <= set(app._registered_funcs)


def test_the_library_neither_parses_source_nor_inspects_frames_to_register():
    pattern = re.compile(r"_getframe|ast\.parse")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("strategies", "split_layer", "tasks", "flower_apps")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_a_handler_under_an_invalid_action_name_is_refused_when_registered():
    from strategies.fedavg import FedAvgStrategy, client_train
    with pytest.raises(ValueError, match="algorithm 'x': client action 'gossip!' is not a name Flower can route"):
        registry.AlgorithmSpec(name="x", paper="", strategy_cls=FedAvgStrategy,
                               client={"train": client_train, "gossip!": client_train})


def test_a_name_registered_by_another_module_is_refused():
    from strategies.fedavg import client_train
    from strategies.fedprox import FedProxStrategy

    class Other(FedProxStrategy):
        pass

    Other.__module__ = "someone_elses_module"
    with pytest.raises(ValueError, match="algo='fedavg' is registered by strategies.fedavg already; "
                                         "someone_elses_module registers it again"):
        registry.register({"fedavg": registry.AlgorithmSpec(name="fedavg", paper="", strategy_cls=Other,
                                                            client={"train": client_train})})
    assert registry.get_algorithm("fedavg").strategy_cls.__name__ == "FedAvgStrategy"
