"""When a node's reply is due: counted from when its instruction was sent, with a start-up
allowance for a node's first instruction of the run.

An exchange keeps at most ``max-in-flight`` instructions out at once
(:meth:`strategies.core.exchange_window.ExchangeWindow.in_flight`); an instruction still waiting for a free slot
is not late, so each instruction's clock starts when it is pushed, not when the exchange
began. A node's first instruction of the run also starts its ClientApp (a process or a Ray
actor that imports PyTorch and loads its data): it is due ``round-timeout +
startup-timeout`` seconds after it was sent, so a warm round's timeout does not end a cold
one. Every later instruction is due ``round-timeout`` seconds after it was sent. A node is
warm once any reply of it (also an error reply) came back.

Waiting goes through a :class:`WallClock` (``now``/``sleep``), which tests replace with a
clock they drive, so that no verdict depends on the machine's speed.
"""
from __future__ import annotations

import time
from logging import INFO
from typing import Protocol

from flwr.common import log

__all__ = ["Clock", "WallClock", "ReplyDeadlines"]


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    """The machine's monotonic clock and ``time.sleep``."""

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)


class ReplyDeadlines:
    """The deadline of each instruction out (message id -> node, due time) for one exchange.

    ``warm``: the nodes that answered before in this run (shared across exchanges and updated
    by :meth:`answered`)."""

    def __init__(self, timeout: float, startup: float, warm: set[int], clock: Clock) -> None:
        self.timeout, self.startup, self.warm, self.clock = float(timeout), float(startup), warm, clock
        self._out: dict[str, tuple[int, float, float]] = {}   # message id -> (node, sent at, due)
        self._cold_logged = False

    def limit(self, node: int) -> float:
        """Seconds ``node``'s instruction may take: ``round-timeout``, plus ``startup-timeout`` for
        its first one of the run."""
        return self.timeout + (0.0 if node in self.warm else self.startup)

    def sent(self, mid: str, node: int) -> None:
        now = self.clock.now()
        self._out[mid] = (node, now, now + self.limit(node))
        if node not in self.warm and self.startup > 0 and not self._cold_logged:
            self._cold_logged = True
            log(INFO, "first instruction of the run to node(s) such as %s: each may take round-timeout + "
                      "startup-timeout = %.0f + %.0f s (a cold ClientApp start)", node, self.timeout, self.startup)

    def answered(self, mid: str) -> int:
        """The reply to ``mid`` came: its node, now warm (a first reply later than
        ``round-timeout`` is logged: it used the start-up allowance)."""
        node, sent_at, _ = self._out.pop(mid)
        took = self.clock.now() - sent_at
        if node not in self.warm and took > self.timeout:
            log(INFO, "node %s answered its first instruction of the run after %.1f s: more than round-timeout="
                      "%.0f s, within its start-up allowance (startup-timeout=%.0f s)", node, took, self.timeout,
                self.startup)
        self.warm.add(node)
        return node

    def __contains__(self, mid: str) -> bool:
        return mid in self._out

    def __len__(self) -> int:
        return len(self._out)

    def ids(self) -> list[str]:
        return list(self._out)

    def expired(self) -> list[tuple[int, float]]:
        """The instructions past their due time, removed: ``(node, seconds it was allowed)``."""
        now = self.clock.now()
        late = [mid for mid, (_, _, due) in self._out.items() if due <= now]
        out = []
        for mid in late:
            node, sent_at, due = self._out.pop(mid)
            out.append((node, due - sent_at))
        return out
