"""How many partitions a run's data is split into: what the run was given, not who connected first.

Every SuperNode states its partition in its node config (``partition-id``, ``num-partitions``):
Flower's simulation sets them on each simulated node (``num-partitions`` = the configured
number of SuperNodes), a deployment's SuperNodes are started with ``--node-config
"partition-id=<i> num-partitions=<n>"``, and each node partitions its data by its own
``num-partitions``. The server learns that count from the nodes connected at the start (the
strategy's one-time partition query: ``node-info``, or a strategy's own query that carries it) and
partitions its own copy of the plan over the same count:

* the nodes asked must state one count; two counts are a ``ConfigError`` naming
  ``num-partitions`` (a later node stating another count is logged, and the run's count kept:
  :class:`strategies.core.node_directory.NodeDirectory`);
* in a simulation (Flower's simulation engine, or the in-process ``LocalGrid``:
  :func:`strategies.core.simulation.simulated`) the
  server then waits for every one of those SuperNodes (``wait-for-nodes`` seconds from the
  start, else a ``ConfigError`` naming it): simulated nodes may register after the ServerApp's
  first look;
* in a deployment the run starts once ``min-nodes`` nodes are connected; the nodes not
  connected yet join later rounds with their own partition;
* nodes that state no count (a ClientApp without the library's partition query, a user's
  node with its own data) leave the old rule: the nodes connected at the start, with a warning.
"""
from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

from flwr.common import log

from tasks.config import ConfigError

from .simulation import simulated

__all__ = ["settle_partitions", "wait_for"]


def wait_for(strategy: Any, grid: Any, count: int, deadline: float, why: str) -> list[int]:
    """The connected nodes (sorted) once there are ``count`` of them; past ``deadline`` (on
    ``strategy.timer``): a ``ConfigError`` that says ``why`` ``count`` are needed."""
    timer = strategy.timer
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if timer.now() > deadline:
            raise ConfigError(
                f"only {len(nodes)} of the {count} SuperNode(s) {why} connected within wait-for-nodes="
                f"{strategy.policy.wait_for_nodes:g} s: start them, raise wait-for-nodes, or check their "
                f"--node-config")
        timer.sleep(0.2)


def settle_partitions(strategy: Any, grid: Any) -> int:
    """Wait for the run's SuperNodes and return the number of partitions (see module docstring).
    ``strategy``: a :class:`strategies.core.round_loop.RoundLoopStrategy` (its ``policy``, ``timer``,
    ``learn_partitions`` and node ``directory``)."""
    policy = strategy.policy
    deadline = strategy.timer.now() + policy.wait_for_nodes
    nodes = wait_for(strategy, grid, policy.min_nodes, deadline, f"min-nodes={policy.min_nodes} asks for")
    strategy.learn_partitions(grid, nodes)
    stated = strategy.directory.stated_counts()
    counts = sorted(set(stated.values()))
    if len(counts) > 1:
        by = ", ".join(f"node {n}: {c}" for n, c in sorted(stated.items()))
        raise ConfigError(f"the SuperNodes state different num-partitions ({by}): start every SuperNode with "
                          f"the same --node-config \"partition-id=<i> num-partitions=<n>\"")
    if not counts:
        log(WARNING, "no node stated its num-partitions (node config): the data is partitioned over the %d "
                     "node(s) connected at the start", len(nodes))
        return len(nodes)
    num = counts[0]
    if simulated(grid):
        nodes = wait_for(strategy, grid, num, deadline, f"the nodes state (num-partitions={num})")
    log(INFO, "the data is partitioned over num-partitions=%d, as the nodes state; %d node(s) connected",
        num, len(nodes))
    return num
