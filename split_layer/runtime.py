"""The ServerApp side of split learning: :class:`SplitRuntime`, an algorithm-free round.

One round (``run_round``), for ``I = local_iterations()``:

1. sample nodes (seeded, ``fraction-train``); nodes never seen before answer a one-time
   ``split-info`` query (partition id, ``num-partitions``, ``|D_k|``, label histogram ``n_k``),
   noted in the strategy's node directory (``self.directory``,
   :class:`strategies.core.node_directory.NodeDirectory`; in checkpoints too); the label
   histogram only where the algorithm asks for it (:mod:`split_layer.split_info`). It is the only query a split
   node answers: the nodes connected at the start are asked it then (their ``num-partitions``
   fixes the run's partition count, :mod:`strategies.core.partition_count`), later ones in their
   first round, and it stands in for ``node-info`` (:meth:`SplitRuntime.learn_partitions`);
2. ``begin_round(rnd, nodes)`` (algorithm: batch shares, priors, server copies...);
3. ``visit_groups(rnd, nodes)`` splits the nodes into groups that visit the server part
   **one group after another** (default: one group of all nodes, the barrier; SplitFedV2:
   each node alone, in a seeded random order). Each group runs steps 3a-3b on its own, and
   every group starts from the same bottom, the global one of the round's start:

   a. message 1 per node of the group: the ``bottom`` weights + ``begin_extras(node)``
      arrays + ``begin_config(node)`` (e.g. ``split-batch``); the reply carries the
      streams of step 1;
   b. for ``i = 1..I``: validate every survivor's streams against ``stream_specs(node)``
      (a bad payload drops that node, nothing is applied), call
      ``server_iteration(i, {node: streams})`` **once with all of the group's survivors**
      (a barrier within the group) and send each node its gradients in the message that
      also asks for step ``i+1`` (the last one asks for the final weights instead):
      ``I + 1`` exchanges per group. The payloads reach ``server_iteration`` on the
      server's device (``env.device``: moved here, once, for every algorithm), and the
      gradients it returns may live on any device;
4. ``aggregate(rnd, {node: final envelope})`` once, over the finals of all groups
   (default: ``|D_k|``-weighted mean of the bottoms, BatchNorm buffers included).

Faults: a node whose reply is an error, is missing at the timeout (``round-timeout`` after
each instruction was sent, :mod:`strategies.core.deadlines`), whose payload fails validation, or
whose streams are beyond the run's statistics (``payload-bound``, :mod:`split_layer.bounds`) is
dropped from the rest of the round with a logged warning and listed in the round's ``dropped``
metric; the others
continue (a group whose nodes all failed ends early; the next group still runs). If fewer
than ``min-nodes`` nodes can still finish (finished ones + survivors of the current group +
nodes of the groups not yet started), the round is skipped cleanly: the server part is
restored to its state at the start of the round and nothing is aggregated.

Byte accounting (raw tensor bytes, ``numel * itemsize``; no framing): ``bytes.weights.down``
/ ``.up`` for the bottoms, ``bytes.<extra_kind(name)>.<dir>`` for extras, and per stream
``bytes.<stream_kind(name, dir)>.<dir>`` -- by default ``labels`` for a stream named
``labels``, ``activations`` for other uploads and ``gradients`` for downloads;
``bytes.histogram.up`` for the one-time label histograms (where asked;
:class:`split_layer.payload_meter.PayloadMeter`). Timing: ``split-exchanges`` and
``split-exchange-seconds`` (wall time spent in the fused exchanges, client compute included),
and ``split-inner-exchanges``/``-seconds`` for steps 2..I only (neither a group's first
exchange, which carries the bottom, nor its last, which returns it); all summed over the
groups. Bytes do not depend on the grouping (each node gets the bottom once and sends it
back once).

The transport is :class:`split_layer.transport.FlowerTransport`, or
:class:`split_layer.stream.StreamTransport` with ``split-transport='stream'``
(:class:`split_layer.transport_choice.TransportChoice`): algorithms never touch the grid. Over the stream,
each group has its own stream session (its message 1 starts one, its final replies end it).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.serverapp import Grid

from strategies.core.records import INFO_ACTIONS
from tasks.aggregate import weighted_mean

from .actions import SPLIT_INFO
from .cut import bottom_state, feature_shape, load_bottom_state, resolve_cut, split_model
from .payload_meter import PayloadMeter
from .split_info import SplitInfoQuery
from .split_policy import SplitPolicy
from .split_round import SplitRound, node_batch
from .transport import Envelope
from .transport_choice import TransportChoice
from .validation import TensorSpec

__all__ = ["SplitRuntime"]


class SplitRuntime:
    """Algorithm-free split-learning round over a transport (see module docstring): the hooks
    an algorithm overrides, over parts with one job each that the strategy holds
    (:meth:`compose`): ``transports`` (which transport, and its lifetime), ``info_query``
    (``split-info``), ``payloads`` (the byte count where payloads cross) and ``rounds`` (one
    round's session).

    It runs inside a strategy that provides :class:`split_layer.host.RoundHost` (exchange,
    drop, the byte meter, the message content, the round loop whose ``run_round`` it
    overrides); :class:`strategies.split_base.SplitStrategy` is it with the base strategy.
    Subclasses override the hooks: ``local_iterations``, ``begin_round``, ``visit_groups``,
    ``begin_config``, ``begin_extras``, ``stream_specs``, ``server_iteration``, ``aggregate``,
    and for the server part's rollback ``server_snapshot``/``server_restore``.
    """

    staged = True  # a user's model is cut as tasks.models.as_staged says
    #: the algorithm uses the nodes' label histograms (``split-info`` then asks for them)
    asks_histogram: bool = False
    #: ``split-info`` asks a node about itself, as the core's ``node-info`` (no user config)
    info_actions = (*INFO_ACTIONS, SPLIT_INFO)

    def compose(self, split: SplitPolicy) -> None:
        """The split run's options (``split``) and parts; called before the base's constructor."""
        self.split = split
        self.transports = TransportChoice(self)
        self.info_query = SplitInfoQuery(self)
        self.payloads = PayloadMeter(self)
        self.rounds = SplitRound(self)

    def setup_algorithm(self) -> None:
        self.cut = resolve_cut(self.model, self.task.cut)
        self.bottom, self.top = split_model(self.model, self.cut)
        self.act_shape = feature_shape(self.bottom, self.env.input_shape, self.env.device)
        self.setup_split()

    def setup_split(self) -> None:
        """Hook: server optimizer, extra models."""

    # ------------------------------------------------------------------ hooks
    def local_iterations(self) -> int:
        raise NotImplementedError

    def begin_round(self, server_round: int, nodes: list[int]) -> None:
        self.round_batch = {n: node_batch(self, n) for n in nodes}

    def visit_groups(self, server_round: int, nodes: list[int]) -> list[list[int]]:
        """The groups in which ``nodes`` visit the server part, one group after another.

        Each group gets its own message 1 (the round's starting bottom), steps ``1..I + 1``
        and final replies; ``server_iteration`` sees one group's survivors per call. Must
        split ``nodes`` into disjoint groups (every node exactly once). Default: one group
        of all nodes (every step is a barrier over all of them).
        """
        return [list(nodes)]

    def begin_config(self, node: int) -> dict[str, Any]:
        return {"split-batch": int(self.round_batch[node])}

    def begin_extras(self, node: int) -> dict[str, dict[str, np.ndarray]]:
        return {}

    def extra_kind(self, name: str) -> str:
        return "weights"

    def stream_kind(self, name: str, direction: str) -> str:
        if name == "labels":
            return "labels"
        return "activations" if direction == "up" else "gradients"

    def stream_specs(self, node: int) -> dict[str, TensorSpec]:
        b = int(self.round_batch[node])
        return {"act": TensorSpec((b, *self.act_shape), "float32"),
                "labels": TensorSpec((b,), "int64", 0, self.env.num_classes)}

    def server_iteration(self, step: int, payloads: dict[int, dict[str, torch.Tensor]]
                         ) -> dict[int, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def aggregate(self, server_round: int, finals: dict[int, Envelope]) -> dict[str, Any]:
        self.aggregate_bottoms(finals)
        return {}

    def server_snapshot(self) -> Any:
        """State of the server part to restore if the round is skipped."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def server_restore(self, snap: Any) -> None:
        self.model.load_state_dict(snap)

    def max_batch(self, node: int) -> int:
        """The largest ``split-batch`` ``begin_round`` can give ``node`` (default: the task's batch
        size, at most the node's samples)."""
        return node_batch(self, node)

    # ------------------------------------------------------------------ helpers
    def order(self, nodes) -> list[int]:
        """Nodes in partition order (the concatenation / sequential order)."""
        return sorted(nodes, key=lambda n: (self.directory[n]["partition"], n))

    def bottom_numpy(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in bottom_state(self.model, self.cut).items()}

    def aggregate_bottoms(self, finals: dict[int, Envelope]) -> None:
        """The ``|D_k|``-weighted mean of the final bottoms, in partition order. A split round
        holds its participants' finals until it ends rather than folding each as it arrives:
        its iterations already need every participant at once (SCALA and CA-SFL
        concatenate all their activations in each server step; the sequential variants order the
        nodes), and a bottom is the few layers below the cut, not the model."""
        nodes = self.order(finals)
        new = weighted_mean([finals[n].arrays["bottom"] for n in nodes],
                            [float(self.directory[n]["n"]) for n in nodes])
        load_bottom_state(self.model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()},
                          self.cut)

    def largest_stream_specs(self, node: int) -> dict[str, TensorSpec]:
        """``stream_specs(node)`` at the largest batch the node can be given in any round
        (``max_batch``): bounds the frames of a stream session that spans rounds."""
        old = self.round_batch.get(node)   # (begin_round has set round_batch)
        self.round_batch[node] = self.max_batch(node)
        try:
            return self.stream_specs(node)
        finally:
            if old is None:
                self.round_batch.pop(node, None)
            else:
                self.round_batch[node] = old

    # ------------------------------------------------------------------ the round
    def learn_partitions(self, grid: Grid, nodes: list[int], poll: float = 0.01, server_round: int = 0) -> list[int]:
        """Sampling needs the partitions of all nodes (:meth:`strategies.core.node_directory.NodeSampler.sample`):
        a split node learns them from its ``split-info`` reply, asked once (the node is not asked
        ``node-info`` as well, nor ``split-info`` again when it is sampled in that round)."""
        self.info_query.fetch(self.transports.for_info(grid), server_round,
                              [n for n in nodes if n not in self.info_query.asked])
        return [n for n in nodes if n in self.directory]

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        """One round over the run's transport (made at the first round; a stream transport
        keeps its sessions across rounds, see :class:`split_layer.stream.StreamTransport`)."""
        transport = self.transports.for_round(grid)
        try:
            out = self.rounds.run(server_round, grid, transport)
        except BaseException:
            self.transports.close()
            raise
        transport.end_round()
        return out

    def start(self, grid: Grid, *args: Any, **kwargs: Any):
        """Flower's ``Strategy.start`` (see :meth:`strategies.core.round_loop.RoundLoopStrategy.start`);
        the transport's sessions end with it, also when it fails."""
        try:
            return super().start(grid, *args, **kwargs)
        finally:
            self.transports.close()

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        """The node directory (with the split nodes' statistics) and the algorithm's own state
        (an algorithm adds to ``super().extra_state()``)."""
        return {"info": self.directory.state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.directory.load(state.get("info", {}))
