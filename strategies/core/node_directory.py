"""Who the nodes are and which of them a round samples.

* :class:`NodeDirectory`: node id -> partition id (and any statistics a node told of its data),
  and the ``num-partitions`` the nodes stated.
* :class:`NodeSampler`: the connected nodes (waiting ``wait-for-nodes`` for ``min-nodes``), the
  one ``node-info`` query that tells a node's partition, and the seeded draw of
  ``fraction-train`` of them in partition order.
"""
from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Mapping
from logging import WARNING
from typing import Any

from flwr.app import Message
from flwr.common import log
from flwr.serverapp import Grid

from tasks.training import derive_seed

from .records import CONFIG_KEY, NODE_INFO, query

__all__ = ["NodeDirectory", "NodeSampler"]


class NodeDirectory(Mapping[int, dict[str, Any]]):
    """Who each node is: node id -> ``{"partition": <partition id>, ...}``, plus any statistics a
    node told of its data (``n``: ``|D_k|``, ``hist``: label counts, ...), and ``num_partitions``
    (what the nodes said). The one writer is :meth:`note`: a node's answer to the strategy's
    partition query (``node-info``, :meth:`NodeSampler.ask_node_info`, or an algorithm's own query
    that carries the partition id), and a checkpoint."""

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

    def key_of(self, node: int) -> int:
        """The node's stable key (e.g. for the simulated system's draws): its partition id where
        known (simulated node ids are random), else its node id."""
        entry = self._entries.get(node)
        return int(entry["partition"]) if entry is not None else int(node)

    def has_stats(self, node: int) -> bool:
        """Whether ``node`` told its data statistics (``n``)."""
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


class NodeSampler:
    """The connected nodes, their partitions and each round's sample, for ``strategy`` (its
    ``policy``, ``task.seed``, ``timer``, ``directory``, ``clock``, and its ``learn_partitions``
    hook: a strategy may learn partitions through a query of its own)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.asked: set[int] = set()   # nodes asked node-info (each once)

    def sample(self, grid: Grid, server_round: int) -> list[int]:
        """``fraction-train`` of the nodes, drawn by a seeded RNG over the nodes in partition order.

        Simulated SuperNodes get random ids (partition ids in creation order), so drawing over
        sorted node ids would pick other partitions in every run; the partition ids are asked
        once per node (``node-info``) when not all nodes are sampled. Nodes that do not answer
        it (e.g. a ClientApp without that handler) come last, in node-id order.
        """
        s = self.strategy
        nodes = self.connected(grid)
        k = self.sample_size(len(nodes))
        if k == len(nodes):
            if s.clock.active:   # the system's draws are keyed by partition id (tasks.system)
                s.learn_partitions(grid, nodes, server_round=server_round)
            return nodes
        s.learn_partitions(grid, nodes, server_round=server_round)
        part = s.directory.partitions()
        ordered = sorted(nodes, key=lambda n: (part.get(n, 1 << 62), n))
        rng = random.Random(derive_seed(s.task.seed, "sample", server_round))
        return sorted(rng.sample(ordered, k))

    def connected(self, grid: Grid) -> list[int]:
        """The connected nodes, sorted; fewer than ``min-nodes``: wait for them (``wait-for-nodes``
        seconds, else a ``ConfigError``)."""
        from .partition_count import wait_for

        s = self.strategy
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= s.policy.min_nodes:
            return nodes
        return wait_for(s, grid, s.policy.min_nodes, s.timer.now() + s.policy.wait_for_nodes,
                        f"min-nodes={s.policy.min_nodes} asks for")

    def sample_size(self, num_nodes: int) -> int:
        """How many of ``num_nodes`` nodes a round samples: ``fraction-train`` of them, at least
        ``min-nodes``, at most all."""
        p = self.strategy.policy
        return min(max(p.min_nodes, int(round(p.fraction_train * num_nodes))), num_nodes)

    def ask_node_info(self, grid: Grid, nodes: list[int], poll: float = 0.01) -> list[int]:
        """How the server learns which partition a node holds: nodes not asked before get one
        ``node-info`` query each (every ClientApp of this library answers it in
        ``flower_apps.client_app.dispatch``), noted in the node directory (the partition id, the
        nodes' ``num-partitions``). Returns the nodes of ``nodes`` whose partition is known (a
        node that does not answer is asked once, never again)."""
        s = self.strategy
        todo = [n for n in nodes if n not in self.asked and n not in s.directory]
        if not todo:
            return [n for n in nodes if n in s.directory]
        self.asked.update(todo)
        msgs = [query(s.base_content(0, action=NODE_INFO), n, NODE_INFO) for n in todo]

        def note(r: Message) -> None:
            if CONFIG_KEY in r.content.config_records:   # (else sampled after the nodes that answered)
                info = r.content.config_records[CONFIG_KEY]
                s.directory.note(r.metadata.src_node_id, info["partition-id"], info["num-partitions"])

        s.window.send(grid, msgs, note, min(s.policy.round_timeout, 120.0), poll, optional=True)
        return [n for n in nodes if n in s.directory]
