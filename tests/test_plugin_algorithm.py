"""An algorithm from a module outside the library registers itself.

The test writes a new module into a temporary folder (not the library, no library file
edited): FedAvg with a server learning rate, a subclass with one override and a config
dataclass of one knob, registered by ``ALGORITHMS = bind({...})``. Imported, it is in the
registry; the run config accepts it and its namespace; the library's ClientApp answers
its messages, importing it from ``algo-modules`` where it was not imported; and it passes
every condition of the conformance matrix.
"""
from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies import registry
from tests import test_conformance as matrix

NAME = "toy-server-lr"
MODULE = "toy_server_lr_algorithm"
SOURCE = textwrap.dedent('''
    """FedAvg with a server learning rate: w <- w + eta (avg - w) (a toy, outside the library)."""
    from dataclasses import dataclass

    import numpy as np

    from strategies.fedavg import FedAvgStrategy, client_train
    from strategies.registry import AlgorithmSpec, bind
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


    ALGORITHMS = bind({
        "toy-server-lr": AlgorithmSpec(name="toy-server-lr", paper="a test's toy", strategy_cls=ServerLRStrategy,
                                       config_cls=ServerLRConfig, namespace="toy", client={"train": client_train}),
    })
''')


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert NAME not in registry.algorithm_names()
    mod = importlib.import_module(MODULE)
    try:
        yield mod
    finally:
        registry.unregister(NAME)
        sys.modules.pop(MODULE, None)


def test_an_imported_module_registers_its_algorithm(toy):
    assert NAME in registry.algorithm_names() and registry.module_of(NAME) == MODULE
    spec = registry.get_algorithm(NAME)
    assert spec.strategy_cls is toy.ServerLRStrategy and toy.ServerLRStrategy.specs == {NAME: spec}
    p = parse_run_config({**matrix.config(NAME), "toy.server-lr": 0.25})
    assert p.spec is spec and p.algo.server_lr == 0.25
    with pytest.raises(Exception, match="toy.server-lr"):
        parse_run_config({**matrix.config(NAME), "toy.server-lr": 2.0})
    s = toy.ServerLRStrategy(server_lr=0.1)   # the keyword API too
    assert s.cfg.server_lr == 0.1


def test_the_library_clientapp_imports_it_from_algo_modules(toy):
    """A node's ClientApp process that has not imported the module: the run config names it."""
    s, grid = matrix.build(NAME)
    registry.unregister(NAME)
    sys.modules.pop(MODULE, None)
    assert NAME not in registry.algorithm_names()
    for ctx in grid.contexts.values():
        ctx.run_config["algo-modules"] = MODULE
    importlib.import_module(MODULE)   # the server side imported it (its strategy is s's class)
    registry.unregister(NAME)         # ... but this "node" has not: dispatch imports it
    sys.modules.pop(MODULE, None)
    msgs = []

    def spy(msg, context):
        msgs.append(msg.metadata.message_type)
        return dispatch(msg, context)

    grid.handler = spy
    res, rows = matrix.run(s, grid, rounds=1)
    assert rows[0]["participants"] == matrix.NODES and rows[0]["dropped"] == [] and "train" in msgs
    assert NAME in registry.algorithm_names()


def test_an_unknown_algorithm_names_algo_modules():
    with pytest.raises(Exception, match="algo-modules"):
        registry.get_algorithm("not-an-algorithm")
    with pytest.raises(Exception, match="algo-modules: cannot import 'no_such_module_here'"):
        parse_run_config({**matrix.config("fedavg"), "algo-modules": "no_such_module_here"})


def test_it_passes_the_conformance_matrix(toy, tmp_path, monkeypatch, caplog):
    """Every condition of tests/test_conformance.py, run for the new name."""
    matrix.task_env.plan_cached.cache_clear()
    matrix.test_conformance_all_nodes_result(NAME, monkeypatch)
    matrix.test_conformance_partial_participation(NAME)
    matrix.test_conformance_batchnorm_sets_of_batch_plus_one(NAME)
    matrix.test_conformance_initial_arrays(NAME)
    matrix.test_conformance_flower_parameters(NAME)
    with caplog.at_level(logging.WARNING):
        matrix.test_conformance_node_fails_mid_round(NAME, caplog)
    matrix.test_conformance_resume_equals_uninterrupted(NAME, tmp_path)
    matrix.test_conformance_accelerator_placement(NAME, monkeypatch)


def test_every_library_module_is_read_without_importing_it():
    names, actions = registry.library_index()
    for name, module in names.items():
        assert registry.get_algorithm(name).name == name and registry.module_of(name) == module
    assert set(actions) == {"warmup", "select", "label-histogram"}   # UM-pFSSL's; Fed-CBS's and FedConcat's
    assert registry.query_actions()[:3] == ("node-info", "split", "split-info")


def test_a_handler_for_an_undeclared_query_is_refused_at_import():
    from strategies.fedavg import FedAvgStrategy, client_train
    with pytest.raises(ValueError, match="QUERY_ACTIONS"):
        registry.AlgorithmSpec(name="x", paper="", strategy_cls=FedAvgStrategy,
                               client={"train": client_train, "gossip": client_train})
