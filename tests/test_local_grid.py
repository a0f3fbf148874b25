"""The in-process grid (split_layer.transport.LocalGrid) and its test-only additions (tests/faulty_grid.py)."""
from __future__ import annotations

import gc
import weakref

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode

from strategies.core.records import query
from strategies.core.records import describe_error
from split_layer.transport import LocalGrid
from tests.faulty_grid import INJECTED, FaultyGrid, RecordingGrid, inject_failures


def handler(msg: Message, context) -> Message:
    if int(msg.content.config_records["config"]["x"]) < 0:
        raise ValueError("x must not be negative\n(second line)")
    return Message(RecordDict({"config": ConfigRecord({"partition": context.node_config["partition-id"]})}),
                   reply_to=msg)


def ask(grid, x: int) -> dict[int, Message]:
    msgs = [query(RecordDict({"config": ConfigRecord({"x": x})}), n, "echo", "1") for n in grid.get_node_ids()]
    ids = grid.push_messages(msgs)
    grid.join()
    return {r.metadata.src_node_id: r for r in grid.pull_messages(ids)}


def test_a_handler_exception_is_an_error_reply_worded_as_a_supernode_words_it():
    grid = LocalGrid(2, handler)
    ok = ask(grid, 1)
    assert sorted(r.content.config_records["config"]["partition"] for r in ok.values()) == [0, 1]
    bad = ask(grid, -1)
    assert len(bad) == 2 and all(r.has_error() for r in bad.values())
    r = next(iter(bad.values()))
    assert r.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert r.error.reason == "<class 'ValueError'>:<'x must not be negative\n(second line)'>"
    assert describe_error(r.error.reason) == "ValueError: x must not be negative\n(second line)"
    assert not hasattr(grid, "fail_if") and not hasattr(grid, "fail_nodes")   # test-only faults live in tests/


def test_injected_failures_are_worded_as_the_simulation_engine_words_them():
    grid = inject_failures(LocalGrid(3, handler, threaded=True),
                           lambda msg, ctx: ctx.node_config["partition-id"] == 1)
    out = ask(grid, 1)
    failed = [n for n, r in out.items() if r.has_error()]
    assert failed == [grid.get_node_ids()[1]]
    reason = out[failed[0]].error.reason
    assert "ClientAppException" in reason and "ray::ClientAppActor.run()" in reason and "Traceback" in reason
    assert describe_error(reason).startswith(f"RuntimeError: {INJECTED}")
    bad = ask(grid, -1)   # the handler's own exception, through the same wording
    assert describe_error(bad[grid.get_node_ids()[0]].error.reason) == \
        "ValueError: x must not be negative\n(second line)"


def test_faulty_grid_nodes_that_never_answer():
    grid = FaultyGrid(3, handler, fail_nodes=[1002])
    out = ask(grid, 1)
    assert sorted(out) == [1001, 1003] and not any(r.has_error() for r in out.values())
    assert len(grid.sent) == 3


def test_the_grid_holds_only_what_is_pending_and_leaves_pushed_messages_as_they_were():
    """A pushed message is neither kept nor changed (its handler gets a delivered copy with the
    id the push returned, built with Flower's public Metadata); a reply, once pulled, is gone."""
    for threaded in (False, True):
        grid = LocalGrid(2, handler, threaded=threaded)
        msgs = [query(RecordDict({"config": ConfigRecord({"x": 1})}), n, "echo", "1") for n in grid.get_node_ids()]
        refs = [weakref.ref(x) for m in msgs for x in (m, m.content)]   # nor its delivered copy (same content)
        ids = grid.push_messages(msgs)
        grid.join()
        assert all(m.metadata.message_id == "" for m in msgs)        # not written by the grid
        del msgs
        gc.collect()
        assert all(r() is None for r in refs)                        # not kept by the grid
        assert not any(isinstance(v, Message) for v in vars(grid).values() if not isinstance(v, dict))
        got = grid.pull_messages(ids)
        assert sorted(r.metadata.reply_to_message_id for r in got) == sorted(ids)
        assert [r.metadata.src_node_id for r in sorted(got, key=lambda r: ids.index(r.metadata.reply_to_message_id))] \
            == grid.get_node_ids()
        assert grid.pull_messages(ids) == [] and grid._replies == {}  # handed out once, then let go
        assert grid._threads == []                                   # finished handler threads let go


def test_the_recording_grid_keeps_what_was_sent():
    grid = RecordingGrid(3, handler)
    ask(grid, 1)
    ask(grid, 2)
    assert grid.pushed == 6 and [int(m.content.config_records["config"]["x"]) for m in grid.sent] == [1] * 3 + [2] * 3
