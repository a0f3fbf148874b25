import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Never phone home, never write to the real ~/.flwr or /tmp/ray from tests.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
# decoded datasets are cached in a folder of this test session, not in ~/.cache (tasks/data.py)
if "FLOWER_SSL_DATA_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["FLOWER_SSL_DATA_CACHE"] = tempfile.mkdtemp(prefix="flower-ssl-data-cache-")
    atexit.register(shutil.rmtree, os.environ["FLOWER_SSL_DATA_CACHE"], True)


@pytest.fixture()
def sim_env(tmp_path, monkeypatch):
    """A private FLWR_HOME / RAY_TMPDIR for a test that starts Flower's simulation engine,
    with this checkout importable by the Ray workers."""
    from tests.flower_harness import hermetic_env

    for k, v in hermetic_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


@pytest.fixture
def refusals():
    """Warnings of the ``flwr`` logger (where the split stream logs each refusal and its reason)."""
    import logging

    got: list[str] = []

    class H(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    h = H(logging.WARNING)
    logging.getLogger("flwr").addHandler(h)
    try:
        yield got
    finally:
        logging.getLogger("flwr").removeHandler(h)


# ----------------------------------------------------------------------------- side by side
# The README's test command runs the suite on pytest-xdist workers (pyproject addopts:
# ``-n 3 --dist loadgroup``). Much of an end-to-end test's time is waiting on Flower's polls
# (SuperNodes, ServerApp and SuperExec poll every 1-3 s), so the unit tests run while it waits.
# Tests that start Flower run one at a time within their group: "ray" for everything that starts
# Ray (the simulation engine, `flwr run` on a local simulation federation), "deploy" for the real
# SuperLink/SuperNode deployments (module-scoped, no Ray). Two Ray instances never run at once.
DEPLOY_FIXTURES = frozenset({"dep", "deployment"})
if os.environ.get("PYTEST_XDIST_WORKER"):
    # several workers share the cores: one intra-op thread each (tiny models; Ray and
    # Flower's subprocesses inherit it, as tests/deploy_harness.py already asks)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def flower_group(item: pytest.Item) -> str | None:
    """The xdist group of a test that starts Flower (None for a test that does not)."""
    names = set(getattr(item, "fixturenames", ()))
    if names & DEPLOY_FIXTURES:
        return "deploy"
    if item.get_closest_marker("ray_cluster") is not None:
        # its own Ray cluster: free ports, a private RAY_TMPDIR (where Ray's drivers look for a
        # cluster to join) and an explicit RAY_ADDRESS, so it runs beside the "ray" group
        return "ray-cluster"
    if "sim_env" in names or item.get_closest_marker("e2e") is not None:
        return "ray"
    return None


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = flower_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
