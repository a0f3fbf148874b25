"""What a round needs that the split layer shares with the strategies above it.

* :class:`RoundPolicy`: sampling, waiting and the minimum to aggregate (run-config keys
  ``fraction-train``, ``min-nodes``, ``round-timeout``, ``split-transport``).
* :class:`ByteMeter`: bytes by kind and direction (``bytes.<kind>.<up|down>``), counted by
  :func:`array_bytes`, the one byte count (records, arrays, state dicts, payloads).
* :class:`NodeDirectory`: who each node is (partition id; a split node's data statistics).
* :func:`describe_error`: the real exception of a ClientApp's error reply.
* :class:`RoundHost`: the small interface the split layer needs from the strategy that runs
  its rounds (exchange messages, drop a node, the byte meter, the message content); the base
  strategy, :class:`strategies.base.BaseStrategy`, provides it.
"""
from __future__ import annotations

import copy
import re
from logging import WARNING
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from tasks.config import ConfigError, TaskConfig, knob
from tasks.env import Env

from .transport import TRANSPORT_CHOICES


@dataclass
class RoundPolicy:
    """How rounds are run: sampling, waiting and the minimum to aggregate. The run config's
    keys of the same names (``flower_apps.config.AppConfig``) take these knobs."""

    fraction_train: float = knob(1.0, lo=0.0, hi=1.0, lo_open=True, help="share of nodes sampled per round")
    min_nodes: int = knob(2, lo=1, help="fewest nodes a round needs; fewer usable replies skip the round")
    round_timeout: float = knob(600.0, lo=0.0, lo_open=True,
                                help="seconds to wait for a node's reply, counted from when its instruction was sent")
    startup_timeout: float = knob(120.0, lo=0.0, help="extra seconds a node's first instruction of the run may take "
                                                      "beyond round-timeout (a cold ClientApp start: process or Ray "
                                                      "actor, imports, data); logged when used")
    wait_for_nodes: float = knob(300.0, lo=0.0, help="seconds to wait at the start for the run's SuperNodes to "
                                                     "connect: min-nodes of them, and in a simulation every one "
                                                     "(the num-partitions the nodes state)")
    payload_bound: float = knob(10.0, lo=0.0, help="split algorithms: a float stream a node uploads (activations) "
                                                   "whose RMS is more than this many times the run's running median "
                                                   "for that stream is refused and the node dropped from the round "
                                                   "(0 = off); see docs/deployment.md")
    upload_norm_bound: float = knob(0.0, lo=0.0, help="largest L2 distance of an uploaded model (or a split node's "
                                                      "final bottom) from the model the server holds; a larger upload "
                                                      "is refused and its node dropped from the round (0 = off)")
    loss_bound: float = knob(10000.0, lo=0.0, help="a round whose model's test loss is NaN or infinite, whose train-loss is infinite, "
                                                   "or either more than this many times max(ln(classes), its median over "
                                                   "the run's earlier rounds), is not applied (the strategy's state is "
                                                   "rolled back) and is reported as diverged (0 = refuse non-finite "
                                                   "losses only); a divergence detector, not a quality filter")
    max_in_flight: int = knob(0, lo=0, help="most instructions of a round out at once, refilled as replies come "
                                            "back and each reply folded into the aggregate as it arrives (0 = auto: "
                                            "in the simulation engine, where the ClientApps share this machine's CPUs, "
                                            "twice its CPUs or a quarter second of replies, whichever is more; every "
                                            "sampled node at once in a deployment)")
    split_transport: str = knob("auto", choices=TRANSPORT_CHOICES,
                                help="split algorithms: per-iteration exchanges over Flower messages, or over a gRPC "
                                     "stream the ServerApp hosts (one Flower message starts a node's session, which "
                                     "spans the run or one round: split-stream-session); auto = the stream in Flower's "
                                     "simulation engine when it runs a round's sampled ClientApps at once and no "
                                     "system is set, else messages (a deployment); see docs/split.md")
    stream: Any = None                 # split_layer.stream.StreamOptions for "stream" (None = defaults)
    system: str = knob("none", help="the simulated system whose clock times every round (sim-seconds in the "
                                    "metrics): none, a preset (semisfl, scala) or the path of a .toml file; "
                                    "see docs/config.md")

    def validate(self) -> None:
        from tasks.system import load_system

        if load_system(self.system) is not None and self.split_transport == "stream":
            raise ConfigError(f"system={self.system!r} times the exchanges of split-transport='message' only "
                              "(over the stream a node's work is not reported per exchange): set "
                              "split-transport='message', or system='none'")


class ByteMeter:
    """Counts message payload bytes by (kind, direction) for the current round."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, kind: str, direction: str, nbytes: int) -> None:
        self.counts[f"bytes.{kind}.{direction}"] += int(nbytes)

    def add_record(self, kind: str, direction: str, rec: ArrayRecord) -> None:
        self.add(kind, direction, array_bytes(rec))

    def flush(self) -> dict[str, int]:
        out = dict(self.counts)
        out["bytes.total"] = sum(self.counts.values())
        self.counts.clear()
        return out


def array_bytes(x: Any) -> int:
    """The library's one byte count: raw tensor bytes, elements x item size, without the
    per-array serialisation header and record framing (so the count is analytic: weights x 4
    bytes). ``x``: an ``ArrayRecord``, a Flower ``Array``, a numpy array or torch tensor, or a
    dict of any of these (a state dict ``{name: array}``, a payload ``{name: state dict}``)."""
    if isinstance(x, Array):
        return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    if isinstance(x, Mapping):   # (an ArrayRecord too)
        return int(sum(array_bytes(v) for v in x.values()))
    return int(np.asarray(x).nbytes)


class NodeDirectory(Mapping[int, dict[str, Any]]):
    """Who each node is: node id -> ``{"partition": <partition id>, ...}``, plus, for a split
    node, its data statistics (``n``: ``|D_k|``, ``hist``: label counts, ``sim-actors``,
    ``sim-threads``), and ``num_partitions`` (what the nodes said). The one writer is
    :meth:`note`: the ``node-info`` reply (:meth:`strategies.base.BaseStrategy.learn_partitions`),
    the split runtime's ``split-info`` reply, which carries the partition id with the
    statistics (:meth:`split_layer.runtime.SplitRuntime.fetch_info`), and a checkpoint."""

    def __init__(self) -> None:
        self._entries: dict[int, dict[str, Any]] = {}
        self._stated: dict[int, int] = {}   # node id -> the num-partitions it stated
        self.num_partitions = 0

    def note(self, node: int, partition_id: Any, num_partitions: Any = 0, **stats: Any) -> None:
        """Record what ``node`` said of itself (its partition id, and any statistics). The first
        ``num-partitions`` stated is the directory's; a node stating another one is logged
        (at the start of a run, :mod:`strategies.partition_count` refuses it)."""
        self._entries[int(node)] = {**self._entries.get(int(node), {}), "partition": int(partition_id), **stats}
        count = int(num_partitions or 0)
        if count > 0:
            self._stated[int(node)] = count
            if self.num_partitions and count != self.num_partitions:
                log(WARNING, "node %s states num-partitions=%d, the run's is %d: its data is not the run's "
                             "partition; check its --node-config", node, count, self.num_partitions)
            else:
                self.num_partitions = count

    def stated_counts(self) -> dict[int, int]:
        """node id -> the ``num-partitions`` it stated (nodes that stated one)."""
        return dict(self._stated)

    def partitions(self) -> dict[int, int]:
        """node id -> partition id of every node known."""
        return {n: e["partition"] for n, e in self._entries.items()}

    def has_stats(self, node: int) -> bool:
        """Whether ``node`` told its data statistics (a split node's ``split-info``)."""
        return "n" in self._entries.get(node, {})

    def __getitem__(self, node: int) -> dict[str, Any]:
        return self._entries[node]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def state(self) -> dict[int, dict[str, Any]]:
        """A copy of every entry (checkpoints)."""
        return copy.deepcopy(self._entries)

    def load(self, state: Mapping[int, Mapping[str, Any]]) -> None:
        """Note every entry of :meth:`state` (a checkpoint)."""
        for node, entry in state.items():
            self.note(node, entry["partition"], **{k: v for k, v in entry.items() if k != "partition"})


class RoundHost(Protocol):
    """What :mod:`split_layer` needs from the strategy whose rounds it runs (the transports and
    the split runtime, :class:`split_layer.runtime.SplitRuntime`); :class:`strategies.base.BaseStrategy`
    provides it. The split layer imports nothing above it."""

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

    clock: Any                  # the simulated system's clock (tasks.system.RoundClock) or None

    def clock_stage(self) -> Any: ...   # a context: one stage of the clock (an exchange)

    def node_key(self, node: int) -> int: ...   # the node's stable key for the system's draws


_EXC_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)): ?(.*)$")


def describe_error(reason: str, limit: int = 800) -> str:
    """The real exception of a ClientApp error reply, as ``Type: message``.

    Flower words a reply as ``<class 'T'>:<'message'>``; in the simulation engine ``T`` is
    ``ClientAppException`` and the message is Ray's traceback, whose last ``Type: message``
    line is the exception the ClientApp raised. That line (and what follows it, the rest
    of a multi-line message) is returned, cut to ``limit`` characters; otherwise the end
    of the reason.
    """
    text = reason.strip()
    m = re.match(r"^<class '([\w.]+)'>:<'(.*)'>$", text, re.S)
    if m:
        text = m.group(2).strip() if m.group(1).endswith("ClientAppException") else f"{m.group(1)}: {m.group(2)}"
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        hit = _EXC_LINE.match(lines[i])
        if hit and not hit.group(1).endswith("ClientAppException"):
            out = "\n".join([hit.group(1).rsplit(".", 1)[-1] + ": " + hit.group(2), *lines[i + 1:]]).strip()
            return out if len(out) <= limit else out[:limit] + " ..."
    return text if len(text) <= limit else "... " + text[-limit:]


def _metric_safe(d: dict[str, Any]) -> dict[str, Any]:
    """Keep what a MetricRecord accepts (numbers and lists of numbers)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, bool):
            out[k] = int(v)
        elif isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            out[k] = [float(x) for x in v] if any(isinstance(x, float) for x in v) else list(v)
    return out
