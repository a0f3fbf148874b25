"""The split round's one byte count where payloads cross: :class:`PayloadMeter`."""
from __future__ import annotations

from typing import Any

from strategies.core.byte_meter import array_bytes

from .actions import SPLIT_INFO
from .transport import Envelope, Transport

__all__ = ["PayloadMeter"]


class PayloadMeter:
    """Exchanges envelopes over a transport for ``strategy`` and counts every payload that
    crosses, by kind and direction, on either transport (messages or the stream), whether or
    not the server keeps it afterwards (a reply that fails validation was still sent). Kinds:
    ``bottom``: ``weights``, other state dicts: the strategy's ``extra_kind``, tensors: its
    ``stream_kind`` (``split-info``'s label histogram: ``histogram``); with a simulated clock,
    also each node's bytes of the stage."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def exchange(self, transport: Transport, server_round: int, op: str,
                 out: dict[int, Envelope]) -> dict[int, Envelope]:
        """``transport.exchange``, one stage of the simulated clock, with every payload counted."""
        with self.strategy.clock.stage():
            for node, env in out.items():
                self.count(op, env, "down", node)
            replies = transport.exchange(server_round, op, out)
            for node, env in replies.items():
                self.count(op, env, "up", node)
        return replies

    def count(self, op: str, env: Envelope, direction: str, node: int | None = None) -> None:
        """Bytes of one envelope (see the class docstring)."""
        s = self.strategy
        total = 0
        for name, sd in env.arrays.items():
            n = array_bytes(sd)
            s.meter.add("weights" if name == "bottom" else s.extra_kind(name), direction, n)
            total += n
        for name, t in env.tensors.items():
            kind = "histogram" if op == SPLIT_INFO else s.stream_kind(name, direction)
            n = array_bytes(t)
            s.meter.add(kind, direction, n)
            total += n
        if node is not None:
            s.clock.add_bytes(node, direction, total)
