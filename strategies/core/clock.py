"""The run's simulated clock: :class:`SimClock`, the one place the round loop and its parts
drive :class:`tasks.system.RoundClock` (run-config ``system``). Without a system every call is a
no-op, so the round path does no extra work."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

from flwr.app import Message

from tasks.system import RoundClock, load_system

from .records import WORK_KEY

__all__ = ["SimClock"]


class SimClock:
    """Simulated seconds of a run's rounds, keyed by each node's stable key (``key_of(node)``:
    its partition id where known; simulated node ids are random)."""

    def __init__(self, key_of: Callable[[int], int]) -> None:
        self.key_of = key_of
        self.clock: RoundClock | None = None
        self._total = 0.0   # simulated seconds of the rounds before a resume (no system: kept as is)

    def start(self, system: str, seed: int, timeout: float) -> None:
        """A run starts: the clock of ``system`` (``none``: no clock), from the total so far."""
        model = load_system(system)
        self.clock = None if model is None else RoundClock(model, seed, timeout)
        if self.clock is not None:
            self.clock.total = self._total

    @property
    def active(self) -> bool:
        """Whether a simulated system times the rounds."""
        return self.clock is not None

    @property
    def total(self) -> float:
        return self.clock.total if self.clock is not None else self._total

    @total.setter
    def total(self, value: float) -> None:
        self._total = float(value)
        if self.clock is not None:
            self.clock.total = self._total

    def stage(self) -> ContextManager[None]:
        """One stage of the clock (an exchange); a no-op context without one."""
        return self.clock.stage() if self.clock is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def round(self, rnd: int) -> Iterator[dict[str, Any]]:
        """Round ``rnd``: the server's work inside the block is timed; the dict it yields holds
        the round's clock metrics once the block ends (empty without a clock)."""
        ended: dict[str, Any] = {}
        if self.clock is None:
            yield ended
            return
        self.clock.begin_round(rnd)
        with self.clock.server_work():
            yield ended
        ended.update(self.clock.end_round())

    def add_bytes(self, node: int, direction: str, nbytes: int) -> None:
        if self.clock is not None:
            self.clock.add_bytes(self.key_of(node), direction, nbytes)

    def add_work(self, reply: Message) -> None:
        """A reply's share: the work its node counted (``work`` record: ``flops`` of which
        ``recompute-flops`` were run again only to rebuild a graph, billed apart)."""
        if self.clock is None or WORK_KEY not in reply.content.metric_records:
            return
        w = reply.content.metric_records[WORK_KEY]
        flops, again = float(w.get("flops", 0.0)), float(w.get("recompute-flops", 0.0))
        self.clock.add_work(self.key_of(reply.metadata.src_node_id), flops - again,
                            float(w.get("steps", 0.0)), again)

    def missing(self, node: int) -> None:
        """``node`` never replied: it costs the stage the timeout."""
        if self.clock is not None:
            self.clock.missing(self.key_of(node))
