"""examples/embed_ssfl: a separate Flower app that imports strategies.ssfl, not flower_apps."""
import os
import subprocess
import sys

import pytest

from tests.flower_harness import ROOT, hermetic_env

EXAMPLE = ROOT / "examples" / "embed_ssfl"


def _pythonpath() -> str:
    return os.pathsep.join([str(EXAMPLE), str(ROOT), os.environ.get("PYTHONPATH", "")])


def test_example_does_not_import_flower_apps():
    code = ("import sys, embed_ssfl.server_app, embed_ssfl.client_app; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'flower_apps'); "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": _pythonpath()},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.e2e
def test_example_runs_in_the_simulation_engine(tmp_path, monkeypatch):
    for k, v in hermetic_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", _pythonpath())   # Ray workers import embed_ssfl.client_app
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from flwr.simulation import run_simulation

    from embed_ssfl import client_app, server_app

    monkeypatch.setitem(server_app.DEFAULTS, "num-rounds", 2)
    monkeypatch.setitem(server_app.DEFAULTS, "local-steps", 3)
    run_simulation(server_app=server_app.app, client_app=client_app.app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"logging_level": "ERROR"}})
    hist = server_app.HISTORY
    assert [h["round"] for h in hist] == [1, 2]
    assert all(h["participants"] == 3 and h["dropped"] == [] for h in hist)
    assert hist[-1]["accuracy"] > 0.15 and hist[-1]["bytes.weights.up"] > 0
