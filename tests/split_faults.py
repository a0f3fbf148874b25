"""Test-side fault injection for split learning: a node that fails at split step ``k``.

The library has no run-config knob for it. :class:`FailAt` is a ClientApp handler (the
library's :func:`flower_apps.client_app.dispatch`, or any other) under which the node of one
partition raises when split message ``k`` of a round reaches it, that is when the gradients
of step ``k - 1`` arrive (:meth:`split_layer.worker.SplitWorker.apply_gradients`): over Flower
messages that is message ``k``, over the stream the frame of step ``k`` inside the session.
``k = I + 1`` fails the final reply. It works in any process (the simulation engine's Ray
workers unpickle it and install the wrapper themselves); in this process use
:func:`fail_at`, which installs it through pytest's ``monkeypatch`` so that it is undone::

    handler = fail_at(monkeypatch, partition=1, step=2)
    grid = LocalGrid(3, handler)
"""
from __future__ import annotations

import contextvars
from typing import Any, Callable

from split_layer.worker import SplitWorker

# (partition, step) of the call being handled, only inside a FailAt call (per thread/context)
_FAIL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("split_fail_at", default=None)
_ORIGINAL = SplitWorker.apply_gradients


def _failing_apply_gradients(self, w, data, outs, tensors, step, restore=None):
    fail = _FAIL.get()
    if fail is not None and fail == (w.partition, step + 1):
        raise RuntimeError(f"injected fault: partition {w.partition} fails at split-step {step + 1}")
    return _ORIGINAL(self, w, data, outs, tensors, step, restore)


def _installed() -> bool:
    return SplitWorker.apply_gradients is _failing_apply_gradients


class FailAt:
    """A ClientApp handler: ``handler`` (default: the library's dispatch), except that the node
    of ``partition`` raises when split message ``step`` (>= 2) of any round reaches it."""

    def __init__(self, partition: int, step: int, handler: Callable[..., Any] | None = None) -> None:
        if step < 2:
            raise ValueError("step must be >= 2 (the gradients of step - 1 are what fails)")
        self.partition, self.step, self.handler = int(partition), int(step), handler

    def __call__(self, msg, context):
        if not _installed():   # another process (a Ray worker): install it for good there
            SplitWorker.apply_gradients = _failing_apply_gradients
        if self.handler is None:
            from flower_apps.client_app import dispatch as handler
        else:
            handler = self.handler
        token = _FAIL.set((self.partition, self.step))
        try:
            return handler(msg, context)
        finally:
            _FAIL.reset(token)


def fail_at(monkeypatch, partition: int, step: int, handler: Callable[..., Any] | None = None) -> FailAt:
    """:class:`FailAt` for a test in this process, its wrapper installed through ``monkeypatch``."""
    monkeypatch.setattr(SplitWorker, "apply_gradients", _failing_apply_gradients)
    return FailAt(partition, step, handler)


class ScaleUploads:
    """A ClientApp handler: ``handler`` (default: the library's dispatch), except that the node of
    ``partition`` multiplies what it uploads by ``factor``: the float streams of its split replies
    (activations; record ``split-tensors``), or, with ``record='arrays'``, its full-model train
    upload. The node is authenticated and its payloads are well formed: only their values lie."""

    def __init__(self, partition: int, factor: float, handler: Callable[..., Any] | None = None,
                 record: str = "split-tensors") -> None:
        self.partition, self.factor, self.handler, self.record = int(partition), float(factor), handler, record

    def __call__(self, msg, context):
        import numpy as np

        from strategies.core.records import numpy_to_record, record_to_numpy

        if self.handler is None:
            from flower_apps.client_app import dispatch as handler
        else:
            handler = self.handler
        out = handler(msg, context)
        if int(context.node_config["partition-id"]) != self.partition or out.has_error():
            return out
        recs = out.content.array_records
        if self.record in recs and msg.metadata.message_type in ("train", "query.split"):
            arrays = record_to_numpy(recs[self.record])
            recs[self.record] = numpy_to_record(
                {k: (v * np.asarray(self.factor, v.dtype) if np.issubdtype(v.dtype, np.floating) else v)
                 for k, v in arrays.items()})
        return out
