"""What the split layer needs from the strategy that runs its rounds: :class:`RoundHost`
(exchange messages, drop a node, the byte meter, the message content, the clock); the base
strategy, :class:`strategies.base.BaseStrategy`, provides it."""
from __future__ import annotations

from typing import Any, Protocol

import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from strategies.core.byte_meter import ByteMeter
from strategies.core.clock import SimClock
from strategies.core.node_directory import NodeDirectory
from strategies.core.round_policy import RoundPolicy
from tasks.config import TaskConfig
from tasks.env import Env

__all__ = ["RoundHost"]


class RoundHost(Protocol):
    """What :mod:`split_layer` needs from the strategy whose rounds it runs (the transports and
    the split runtime, :class:`split_layer.runtime.SplitRuntime`); :class:`strategies.base.BaseStrategy`
    provides it. The split layer imports nothing above the core (:mod:`strategies.core`)."""

    task: TaskConfig
    policy: RoundPolicy
    meter: ByteMeter
    env: Env | None
    model: torch.nn.Module | None
    directory: NodeDirectory    # who each node is (partition id, a split node's data statistics)

    def exchange(self, grid: Grid, messages: list[Message], timeout: float | None = None,
                 poll: float = 0.01) -> list[Message]: ...

    def drop(self, node: int, why: str) -> None: ...

    def base_content(self, server_round: int, action: str = "train", **config: Any) -> RecordDict: ...

    clock: SimClock             # the simulated system's clock (a no-op without a system)
