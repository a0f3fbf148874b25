"""The in-process grid (split_layer.transport.LocalGrid) and its test-only faults (tests/faulty_grid.py)."""
from __future__ import annotations

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode

from split_layer.records import query
from split_layer.rounds import describe_error
from split_layer.transport import LocalGrid
from tests.faulty_grid import INJECTED, FaultyGrid, inject_failures


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
