"""Test-only additions to the in-process grid (:class:`split_layer.transport.LocalGrid`).

The public ``LocalGrid`` runs handlers, words their exceptions as a Flower SuperNode does and
holds only the replies not yet pulled. What only tests need lives here:

* :class:`RecordingGrid` -- a ``LocalGrid`` that keeps every message pushed (``sent``) and
  counts them (``pushed``), to inspect what the server sent;
* :func:`inject_failures` -- make chosen messages' handlers raise (a node that crashed), and
  word the error replies as Flower's simulation engine does (:func:`simulation_error_reply`),
  the wording the drop warning must see through to name the real exception;
* :class:`FaultyGrid` -- a ``RecordingGrid`` built with those faults, plus ``fail_nodes``: nodes
  that never answer (to test timeouts).
"""
from __future__ import annotations

import traceback
from typing import Callable, Iterable

from flwr.app import Context, Error, Message

from split_layer.transport import LocalGrid

__all__ = ["RecordingGrid", "FaultyGrid", "inject_failures", "simulation_error_reply", "INJECTED"]

INJECTED = "injected failure"


def simulation_error_reply(msg: Message, exc: BaseException) -> Message:
    """An error reply worded as Flower's simulation engine words one: ``ClientAppException``
    around Ray's traceback (``ray::ClientAppActor.run()``), the exception the ClientApp raised
    on its last lines."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Message(Error(code=0, reason="<class 'flwr.clientapp.client_app.ClientAppException'>:<'\n"
                                        "Exception ClientAppException occurred. Message: "
                                        f"ray::ClientAppActor.run() (pid=1)\n{tb}'>"), reply_to=msg)


def inject_failures(grid: LocalGrid, fail_if: Callable[[Message, Context], bool] | None,
                    simulation_wording: bool = True) -> LocalGrid:
    """``grid`` with a handler that raises ``RuntimeError('injected failure')`` for each message
    where ``fail_if(msg, context)`` is true (its reply becomes an error: a node that crashed);
    ``simulation_wording``: error replies worded as in Flower's simulation engine. Returns ``grid``."""
    if fail_if is not None:
        inner = grid.handler

        def handler(msg: Message, context: Context) -> Message:
            if fail_if(msg, context):
                raise RuntimeError(f"{INJECTED} (tests.faulty_grid.inject_failures)")
            return inner(msg, context)

        grid.handler = handler
    if simulation_wording:
        grid.error_reply = simulation_error_reply   # (an instance attribute: this grid only)
    return grid


class RecordingGrid(LocalGrid):
    """A :class:`LocalGrid` that keeps every pushed message, as pushed (``sent``), and their
    count (``pushed``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[Message] = []
        self.pushed = 0

    def push_messages(self, messages) -> list[str]:
        messages = list(messages)
        self.sent.extend(messages)
        self.pushed += len(messages)
        return super().push_messages(messages)


class FaultyGrid(RecordingGrid):
    """A :class:`RecordingGrid` with test-only faults: ``fail_if`` (see :func:`inject_failures`;
    errors worded as in Flower's simulation engine) and ``fail_nodes``, nodes whose messages
    are never answered (to test timeouts)."""

    def __init__(self, *args, fail_if: Callable[[Message, Context], bool] | None = None,
                 fail_nodes: Iterable[int] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_nodes: set[int] = set(fail_nodes)
        inject_failures(self, fail_if, simulation_wording=False)   # (error_reply below words them)

    def error_reply(self, msg: Message, exc: Exception) -> Message:
        return simulation_error_reply(msg, exc)

    def _handle(self, mid: str, m: Message, node: int) -> None:
        if node in self.fail_nodes:
            return  # never answered
        super()._handle(mid, m, node)
