"""Which transport a split run's exchanges take, and its lifetime: :class:`TransportChoice`."""
from __future__ import annotations

import dataclasses
from logging import INFO
from typing import Any

from flwr.common import log
from flwr.serverapp import Grid

from .transport import TRANSPORT_CHOICES, FlowerTransport, Transport

__all__ = ["TransportChoice"]


class TransportChoice:
    """The run's transport for ``strategy`` (a split strategy: its ``split`` policy, ``policy``,
    node directory and sampler): made at the first round, kept across rounds (a stream
    transport keeps its sessions), closed when the run ends or fails."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.current: Transport | None = None

    def for_round(self, grid: Grid) -> Transport:
        """The run's transport over ``grid`` (made now where there is none, or another grid)."""
        if self.current is None or getattr(self.current, "grid", grid) is not grid:
            self.close()
            self.current = self.make(grid)
        return self.current

    def for_info(self, grid: Grid) -> Transport:
        """The transport a ``split-info`` query takes: the run's, else Flower messages."""
        return self.current if self.current is not None else FlowerTransport(self.strategy, grid)

    def close(self) -> None:
        """End the transport's sessions (the run ended, or failed)."""
        tr, self.current = self.current, None
        if tr is not None:
            tr.close()

    def make(self, grid: Grid) -> Transport:
        """``split-transport``: Flower messages, the gRPC stream, or ``auto`` (:meth:`chosen`)."""
        s = self.strategy
        if self.chosen(grid) == "stream":
            from .stream import StreamOptions, StreamTransport

            opts = dataclasses.replace(s.split.stream or StreamOptions(), timeout=s.policy.round_timeout)
            return StreamTransport(s, grid, opts)
        return FlowerTransport(s, grid)

    def chosen(self, grid: Grid) -> str:
        """The transport ``split-transport`` names; for ``auto``, the stream where the nodes fit it:
        in Flower's simulation engine (every node on this machine), when every node reports (in its
        ``split-info`` reply, asked here over Flower messages) that the simulation runs at least a
        round's sampled ClientApps at once, and no simulated system times the exchanges; Flower
        messages otherwise (a deployment, whose nodes may not reach the ServerApp's port; too few
        concurrent ClientApps). Both transports give the same weights."""
        s = self.strategy
        choice = s.split.split_transport
        if choice not in TRANSPORT_CHOICES:
            raise ValueError(f"split-transport={choice!r} is not one of: {', '.join(TRANSPORT_CHOICES)}")
        if choice != "auto":
            return choice
        from tasks.system import load_system

        if load_system(s.policy.system) is not None:
            return "message"
        nodes = s.nodes.connected(grid)
        s.learn_partitions(grid, nodes)
        info = [s.directory.get(n, {}) for n in nodes]
        fit = min((min(int(i.get("sim-actors", 0)), int(i.get("sim-threads", 0))) for i in info), default=0)
        k = s.nodes.sample_size(len(nodes))
        choice = "stream" if fit >= k > 0 else "message"
        log(INFO, "split-transport='auto': %s (%s)", choice,
            f"a simulation running {fit} ClientApps at once for {k} sampled nodes"
            if fit else "not a simulation: the nodes may not reach the ServerApp's port")
        return choice
