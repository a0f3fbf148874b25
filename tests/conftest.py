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
