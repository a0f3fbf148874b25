"""The options of a split run beside the core's round policy: :class:`SplitPolicy` (run-config
``split-transport`` and the stream's options, ``split-stream-*``). A split strategy takes them
as keyword options (``split_transport=...``, ``stream=StreamOptions(...)``) or as ``split=SplitPolicy(...)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks.config import ConfigError, knob

from .transport import TRANSPORT_CHOICES

__all__ = ["SplitPolicy"]


@dataclass
class SplitPolicy:
    """How a split round's per-iteration exchanges travel."""

    split_transport: str = knob("auto", choices=TRANSPORT_CHOICES,
                                help="split algorithms: per-iteration exchanges over Flower messages, or over a gRPC "
                                     "stream the ServerApp hosts (one Flower message starts a node's session, which "
                                     "spans the run or one round: split-stream-session); auto = the stream in Flower's "
                                     "simulation engine when it runs a round's sampled ClientApps at once and no "
                                     "system is set, else messages (a deployment); see docs/split.md")
    stream: Any = None                 # split_layer.stream.StreamOptions for "stream" (None = defaults)

    def check_with(self, system: str) -> None:
        """A ``ConfigError`` where the transport cannot go with the simulated ``system``."""
        from tasks.system import load_system

        if load_system(system) is not None and self.split_transport == "stream":
            raise ConfigError(f"system={system!r} times the exchanges of split-transport='message' only "
                              "(over the stream a node's work is not reported per exchange): set "
                              "split-transport='message', or system='none'")
