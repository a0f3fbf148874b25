"""The windowed exchange of a round's messages: :class:`ExchangeWindow`.

At most :meth:`ExchangeWindow.in_flight` instructions are out at once (refilled as replies
come back), each good reply is handed to a fold as it arrives and let go, and the wait for
replies backs off (:meth:`ExchangeWindow.poll_interval`). An error reply, and a node that has
not replied ``round-timeout`` seconds after its instruction was sent (plus ``startup-timeout``
for its first of the run: :mod:`strategies.core.deadlines`), drop their node from the round.
The errors of the round are kept (:attr:`ExchangeWindow.errors`), so that the loop can stop a
run whose every node failed the same way.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

from flwr.app import Message
from flwr.serverapp import Grid

from .deadlines import ReplyDeadlines
from .records import describe_error
from .simulation import simulated

__all__ = ["ExchangeWindow"]


class ExchangeWindow:
    """Sends ``strategy``'s messages and folds their replies (its ``policy``, ``timer``,
    ``warm_nodes``, ``guard``, ``clock``, ``meter``, and its ``drop`` and ``record_kind``)."""

    #: seconds of replies kept in flight by the auto window in a simulation. Flower's simulation
    #: engine takes new instructions in by scanning its LinkState for every node, then waiting
    #: 0.1 s; each scan walks every stored instruction once per node (``get_message_ins``), under
    #: the ServerApp process's GIL. So the window must cover one such period (else the ClientApps
    #: wait for work) and no more: each instruction more out makes every scan longer. A quarter
    #: second covers the engine's 0.1 s wait plus its scan; a window of one wait starves the
    #: workers, and every instruction at once (Flower's strategies) makes every scan long
    #: (``bench/scale.py``; its figures in docs/benchmarks.md, "Thousands of clients per round").
    IN_FLIGHT_SECONDS = 0.25

    #: how an exchange waits for replies: it pulls every ``poll`` seconds (0.01) for the first
    #: ``POLL_FAST_SECONDS`` after a reply or the push, then less often the longer nothing came
    #: (``POLL_BACKOFF`` x the time since the last reply), at most every ``POLL_MAX_SECONDS``
    #: (Flower's own in-memory grid pulls every 0.1 s). A reply that comes within 0.4 s (a split
    #: exchange, a small model's round) is noticed within ``poll``, as with a fixed poll; a later
    #: one at most 0.1 s late (at most 25%). A round of large models does not wake this thread
    #: 100 times a second for seconds on end: each wake-up takes the GIL from the threads that hand
    #: messages to the ClientApps (seen with ``py-spy`` on ``bench/scale.py``'s library side).
    #: ``bench/split_overhead.py --poll-variants`` measures the policies
    #: side by side on split rounds.
    POLL_FAST_SECONDS = 0.4
    POLL_BACKOFF = 0.25
    POLL_MAX_SECONDS = 0.1

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.sent: set[int] = set()          # nodes sent an instruction this round (not optional)
        self.errors: dict[int, str] = {}     # node -> its error reply of this round

    def begin_round(self) -> None:
        self.sent, self.errors = set(), {}

    def common_failure(self) -> str | None:
        """The error every node sent an instruction this round answered, where they all answered
        the same one and there were at least ``min-nodes`` of them (``None``: a node succeeded,
        was late or failed differently, or the round stopped asking nodes before ``min-nodes``
        had been asked, as SplitFed V2's sequential visits do after one failure)."""
        if (not self.sent or len(self.sent) < self.strategy.policy.min_nodes
                or not self.sent <= set(self.errors)):
            return None
        reasons = {self.errors[n] for n in self.sent}
        return reasons.pop() if len(reasons) == 1 else None

    def poll_interval(self, waited: float, poll: float) -> float:
        """Seconds to sleep before the next pull, ``waited`` seconds after the last reply."""
        if waited < self.POLL_FAST_SECONDS:
            return poll
        return min(max(poll, self.POLL_BACKOFF * waited), max(poll, self.POLL_MAX_SECONDS))

    def in_flight(self, grid: Grid, num_messages: int, replies_per_second: float = 0.0) -> int:
        """How many of a round's ``num_messages`` instructions are out at once (run-config
        ``max-in-flight``; 0 = auto). Auto, where the nodes are simulated on this machine
        (:func:`strategies.core.simulation.simulated`) and share its CPUs: twice its CPU count,
        or the replies of :attr:`IN_FLIGHT_SECONDS` at the rate they came so far in this
        exchange if that is more, so that the workers never wait for the next instruction while
        the server holds that many instructions and replies, not one per sampled node (nor
        ``min-nodes``: the window only bounds what is out at once, the round still waits for
        every reply). Auto in a deployment: every node runs on its own machine, so all are sent
        at once (the SuperLink holds them; each reply is still folded in as it arrives)."""
        policy = self.strategy.policy
        if policy.max_in_flight > 0:
            return policy.max_in_flight
        if simulated(grid):
            return max(2 * (os.cpu_count() or 1), math.ceil(replies_per_second * self.IN_FLIGHT_SECONDS))
        return max(num_messages, 1)

    def send(self, grid: Grid, messages: list[Message], fold: Callable[[Message], None], timeout: float,
             poll: float, optional: bool = False) -> int:
        """Send ``messages`` through the window, hand each good reply to ``fold``; returns how many
        were folded. ``optional``: a query whose answer a node may not give (a node that fails it
        is not dropped). Bytes are counted as a message leaves and as its reply arrives."""
        s = self.strategy
        window = self.in_flight(grid, len(messages))
        queue = iter(messages)
        unsent = len(messages)
        out = ReplyDeadlines(timeout, s.policy.startup_timeout, s.warm_nodes, s.timer)
        folded = answered = 0
        start = last = s.timer.now()
        s.guard.begin_exchange()
        while len(out) or unsent:
            for node, allowed in out.expired():   # each instruction's own clock (strategies.core.deadlines)
                if optional:
                    continue
                first = " (its first: round-timeout + startup-timeout)" if allowed > timeout else ""
                s.drop(node, f"no reply within {allowed:.0f} s of its instruction{first}")
                s.clock.missing(node)
            if unsent and answered:
                window = self.in_flight(grid, len(messages), answered / max(s.timer.now() - start, 1e-6))
            if unsent and len(out) < window:
                batch = [m for _, m in zip(range(min(window - len(out), unsent)), queue)]
                unsent -= len(batch)
                for mid, m in zip(grid.push_messages(batch), batch):
                    node = m.metadata.dst_node_id
                    out.sent(mid, node)
                    if not optional:
                        self.sent.add(node)
                    s.clock.add_bytes(node, "down", s.meter.count_message(m, "down", s.record_kind))
            arrived = False
            for r in grid.pull_messages(out.ids()):
                rid = r.metadata.reply_to_message_id
                if rid not in out:
                    continue
                arrived = True
                answered += 1
                node = out.answered(rid)
                if r.has_error():
                    if not optional:
                        why = describe_error(r.error.reason or "")
                        self.errors[node] = why
                        s.drop(node, f"error {r.error.code}: {why}")
                    continue
                s.clock.add_bytes(node, "up", s.meter.count_message(r, "up", s.record_kind))
                s.clock.add_work(r)
                refused = s.guard.refused_upload(r)
                if refused is not None:
                    s.drop(node, refused)
                    continue
                fold(r)
                folded += 1
            now = s.timer.now()
            if arrived:
                last = now
            elif len(out) or unsent:
                s.timer.sleep(self.poll_interval(now - last, poll))
        return folded
