"""Node-side state across SuperNode restarts and resumed runs (strategies/node_state.py)."""
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from strategies import node_state

KEYS = ("algo.vec", "algo.info")
KEY = "0123456789abcdef"


def ctx(tmp_path, **nc):
    return Context(run_id=1, node_id=7, node_config={"partition-id": 3, "num-partitions": 5,
                                                      "state-dir": str(tmp_path), **nc},
                   state=RecordDict(), run_config={})


def msg(rnd, session="s1", key=KEY):
    from flwr.supercore.task_identity import TaskIdentity  # noqa: F401 - Message needs a run context
    m = Message(RecordDict({"config": ConfigRecord({"server-round": rnd, "state-key": key,
                                                     "state-session": session})}),
                dst_node_id=7, message_type="train")
    return m


def counting_handler(seen):
    """Adds 1 to a vector kept in context.state; records what it found."""
    def h(m, c):
        vec = c.state.array_records["algo.vec"]["v"].numpy() if "algo.vec" in c.state else np.zeros(2)
        seen.append(vec.copy())
        c.state["algo.vec"] = ArrayRecord({"v": Array(vec + 1)})
        c.state["algo.info"] = ConfigRecord({"round": int(m.content.config_records["config"]["server-round"])})
        return m
    return h


@pytest.fixture(autouse=True)
def _task_identity():
    from flwr.supercore.task_identity import TaskIdentity
    for attr in ("run_id", "node_id", "task_id"):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:
            setattr(TaskIdentity, attr, 1)


def test_restarted_node_continues_from_its_saved_state(tmp_path):
    seen = []
    c = ctx(tmp_path)
    for r in (1, 2):
        node_state.handle(counting_handler(seen), msg(r), c, KEYS)
    c2 = ctx(tmp_path)  # the SuperNode restarted: a fresh context, the same server session
    node_state.handle(counting_handler(seen), msg(3), c2, KEYS)
    assert [v.tolist() for v in seen] == [[0, 0], [1, 1], [2, 2]]
    files = sorted(p.name for p in (tmp_path / KEY / "partition-3").iterdir())
    assert files == ["round-2.npz", "round-3.npz"]  # two rounds kept


def test_resumed_server_gets_the_state_before_the_redone_round(tmp_path):
    """The server checkpointed round 1, the node went on into round 2, the server died and
    resumes at round 2 (new session): the node must use its state after round 1, not 2."""
    seen = []
    c = ctx(tmp_path)
    node_state.handle(counting_handler(seen), msg(1), c, KEYS)
    node_state.handle(counting_handler(seen), msg(2), c, KEYS)        # round 2, then the server dies
    node_state.handle(counting_handler(seen), msg(2, session="s2"), c, KEYS)  # resumed: round 2 again
    assert [v.tolist() for v in seen] == [[0, 0], [1, 1], [1, 1]]


def test_same_round_messages_keep_in_memory_state(tmp_path):
    seen = []
    c = ctx(tmp_path)
    node_state.handle(counting_handler(seen), msg(1), c, KEYS)   # e.g. UM-pFSSL 'select'
    node_state.handle(counting_handler(seen), msg(1), c, KEYS)   # then 'train' of the same round
    assert [v.tolist() for v in seen] == [[0, 0], [1, 1]]


def test_corrupt_state_is_a_logged_fresh_start(tmp_path, caplog):
    seen = []
    c = ctx(tmp_path)
    node_state.handle(counting_handler(seen), msg(1), c, KEYS)
    (tmp_path / KEY / "partition-3" / "round-1.npz").write_bytes(b"not a zip file")
    with caplog.at_level(logging.WARNING):
        node_state.handle(counting_handler(seen), msg(2), ctx(tmp_path), KEYS)
    assert seen[-1].tolist() == [0, 0] and "unreadable" in caplog.text


def test_missing_state_is_a_fresh_start_and_pickles_are_refused(tmp_path):
    seen = []
    node_state.handle(counting_handler(seen), msg(5), ctx(tmp_path), KEYS)  # nothing saved: fresh
    assert seen[-1].tolist() == [0, 0]
    folder = tmp_path / KEY / "partition-3"
    np.save(folder / "x.npy", np.array([object()], dtype=object), allow_pickle=True)
    (folder / "x.npy").rename(folder / "round-5.npz")  # not an npz: refused, no code runs
    node_state.handle(counting_handler(seen), msg(6, session="s9"), ctx(tmp_path), KEYS)
    assert seen[-1].tolist() == [0, 0]


def test_a_state_key_is_never_a_path(tmp_path, caplog):
    seen = []
    with caplog.at_level(logging.WARNING):
        node_state.handle(counting_handler(seen), msg(1, key="../../etc"), ctx(tmp_path), KEYS)
    assert "not a hex id" in caplog.text and not any(tmp_path.iterdir())


def test_without_state_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(node_state.STATE_DIR_ENV, raising=False)
    seen = []
    c = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                state=RecordDict(), run_config={})
    node_state.handle(counting_handler(seen), msg(1), c, KEYS)
    node_state.handle(counting_handler(seen), msg(2), c, KEYS)
    assert [v.tolist() for v in seen] == [[0, 0], [1, 1]]  # context.state alone, as before
