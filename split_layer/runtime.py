"""The ServerApp side of split learning: :class:`SplitRuntime`, an algorithm-free round.

One round (``run_round``), for ``I = local_iterations()``:

1. sample nodes (seeded, ``fraction-train``); nodes never seen before answer a one-time
   ``split-info`` query (partition id, ``num-partitions``, ``|D_k|``, label histogram ``n_k``),
   noted in the strategy's node directory (``self.directory``,
   :class:`split_layer.rounds.NodeDirectory`; in checkpoints too). It is the only query a split
   node answers: the nodes connected at the start are asked it then (their ``num-partitions``
   fixes the run's partition count, :mod:`strategies.partition_count`), later ones in their
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
each instruction was sent, :mod:`strategies.deadlines`), whose payload fails validation, or
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
``bytes.histogram.up`` for the one-time label histograms. Timing: ``split-exchanges`` and
``split-exchange-seconds`` (wall time spent in the fused exchanges, client compute included),
and ``split-inner-exchanges``/``-seconds`` for steps 2..I only (neither a group's first
exchange, which carries the bottom, nor its last, which returns it); all summed over the
groups. Bytes do not depend on the grouping (each node gets the bottom once and sends it
back once).

The transport is :class:`split_layer.transport.FlowerTransport`, or
:class:`split_layer.stream.StreamTransport` with ``split-transport='stream'`` (or whatever an
overridden ``make_transport`` returns): algorithms never touch the grid. Over the stream,
each group has its own stream session (its message 1 starts one, its final replies end it).
"""
from __future__ import annotations

import dataclasses
import time
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.common import log
from flwr.serverapp import Grid

from tasks.aggregate import weighted_mean

from .cut import (
    bottom_state,
    feature_shape,
    load_bottom_state,
    resolve_cut,
    split_model,
)
from .bounds import StreamBounds, update_norm
from .rounds import NodeDirectory, array_bytes
from .transport import TRANSPORT_CHOICES, Envelope, FlowerTransport, Transport
from .validation import SplitValidationError, TensorSpec, check_streams

__all__ = ["SplitRuntime"]


class SplitRuntime:
    """Algorithm-free split-learning round over a :class:`Transport` (see module docstring).

    A mixin: it runs inside a strategy that provides :class:`split_layer.rounds.RoundHost`
    (exchange, drop, the byte meter, the message content, the round loop it overrides
    ``run_round`` of); ``strategies.base.SplitStrategy`` is it mixed into the base strategy.
    Subclasses override the hooks: ``local_iterations``, ``begin_round``, ``visit_groups``,
    ``begin_config``, ``begin_extras``, ``stream_specs``, ``server_iteration``, ``aggregate``,
    and for the server part's rollback ``server_snapshot``/``server_restore``.
    """

    staged = True  # a user's model is cut as tasks.models.as_staged says

    def setup_algorithm(self) -> None:
        self.cut = resolve_cut(self.model, self.task.cut)
        self.bottom, self.top = split_model(self.model, self.cut)
        self.act_shape = feature_shape(self.bottom, self.env.input_shape, self.env.device)
        self.setup_split()

    @property
    def info(self) -> NodeDirectory:
        """The strategy's node directory (``self.directory``), read-only: the split layer's older
        name for it; a split node's entry has ``partition``, ``n``, ``hist``, ``sim-actors``,
        ``sim-threads``."""
        return self.directory

    def setup_split(self) -> None:
        """Hook: server optimizer, extra models."""

    # ------------------------------------------------------------------ hooks
    def local_iterations(self) -> int:
        raise NotImplementedError

    def make_transport(self, grid: Grid) -> Transport:
        """``policy.split_transport``: Flower messages, the gRPC stream, or ``auto``
        (:meth:`chosen_transport`)."""
        if self.chosen_transport(grid) == "stream":
            from .stream import StreamOptions, StreamTransport

            opts = dataclasses.replace(self.policy.stream or StreamOptions(), timeout=self.policy.round_timeout)
            return StreamTransport(self, grid, opts)
        return FlowerTransport(self, grid)

    def chosen_transport(self, grid: Grid) -> str:
        """The transport ``split-transport`` names; for ``auto``, the stream where the nodes fit it:
        in Flower's simulation engine (every node on this machine), when every node reports (in its
        ``split-info`` reply, asked here over Flower messages) that the simulation runs at least a
        round's sampled ClientApps at once, and no simulated system times the exchanges; Flower
        messages otherwise (a deployment, whose nodes may not reach the ServerApp's port; too few
        concurrent ClientApps). Both transports give the same weights."""
        choice = self.policy.split_transport
        if choice not in TRANSPORT_CHOICES:
            raise ValueError(f"split-transport={choice!r} is not one of: {', '.join(TRANSPORT_CHOICES)}")
        if choice != "auto":
            return choice
        from tasks.system import load_system

        if load_system(self.policy.system) is not None:
            return "message"
        nodes = self.connected_nodes(grid)
        self.learn_partitions(grid, nodes)
        info = [self.directory.get(n, {}) for n in nodes]
        fit = min((min(int(i.get("sim-actors", 0)), int(i.get("sim-threads", 0))) for i in info), default=0)
        choice = "stream" if fit >= self.sample_size(len(nodes)) > 0 else "message"
        log(INFO, "split-transport='auto': %s (%s)", choice,
            f"a simulation running {fit} ClientApps at once for {self.sample_size(len(nodes))} sampled nodes"
            if fit else "not a simulation: the nodes may not reach the ServerApp's port")
        return choice

    def begin_round(self, server_round: int, nodes: list[int]) -> None:
        self.round_batch = {n: self.node_batch(n) for n in nodes}

    def node_batch(self, node: int) -> int:
        """The task's batch size, or all of ``node``'s samples where it has fewer (a batch larger
        than a node's data is one full batch, logged once per node, never an allocation of
        the asked size)."""
        b, n = int(self.task.batch_size), int(self.directory.get(node, {}).get("n", 0))
        if 0 < n < b:
            warned = self.__dict__.setdefault("_batch_warned", set())
            if node not in warned:
                warned.add(node)
                log(WARNING, "batch-size=%d is larger than node %s's %d samples: it trains on batches of %d",
                    b, node, n, n)
            return n
        return b

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

    def exchange_payloads(self, transport: Transport, server_round: int, op: str,
                          out: dict[int, Envelope]) -> dict[int, Envelope]:
        """``transport.exchange`` with the split round's one byte count: every payload that
        crosses, by kind and direction, on either transport (messages or the stream), whether
        or not the server keeps it afterwards (a reply that fails validation was still sent)."""
        with self.clock_stage():   # one stage of the simulated clock, if any (strategies.base)
            for node, env in out.items():
                self.count_payload(op, env, "down", node)
            replies = transport.exchange(server_round, op, out)
            for node, env in replies.items():
                self.count_payload(op, env, "up", node)
        return replies

    def count_payload(self, op: str, env: Envelope, direction: str, node: int | None = None) -> None:
        """Bytes of one envelope: its state dicts (``bottom``: ``weights``, other parts: their
        :meth:`extra_kind`) and its tensors (:meth:`stream_kind`; ``split-info``'s label
        histogram: ``histogram``); with a simulated clock, also ``node``'s bytes of the stage."""
        total = 0
        for name, sd in env.arrays.items():
            n = array_bytes(sd)
            self.meter.add("weights" if name == "bottom" else self.extra_kind(name), direction, n)
            total += n
        for name, t in env.tensors.items():
            kind = "histogram" if op == "split-info" else self.stream_kind(name, direction)
            n = array_bytes(t)
            self.meter.add(kind, direction, n)
            total += n
        if self.clock is not None and node is not None:
            self.clock.add_bytes(self.node_key(node), direction, total)

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

    # ------------------------------------------------------------------ helpers
    def order(self, nodes) -> list[int]:
        """Nodes in partition order (the concatenation / sequential order)."""
        return sorted(nodes, key=lambda n: (self.directory[n]["partition"], n))

    def num_examples(self, node: int) -> int:
        return int(self.directory[node]["n"])

    def histogram(self, node: int) -> np.ndarray:
        return self.directory[node]["hist"]

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
                            [float(self.num_examples(n)) for n in nodes])
        load_bottom_state(self.model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()},
                          self.cut)

    def fetch_info(self, transport: Transport, server_round: int, nodes: list[int]) -> None:
        """The one-time ``split-info`` query of the nodes of ``nodes`` not known yet (each is asked
        at most once per round): its reply, partition id and data statistics, goes into the node
        directory. A split node is never asked ``node-info`` (:meth:`learn_partitions`)."""
        asked = self.__dict__.setdefault("_info_asked", {})   # node -> the round it was last asked
        todo = [n for n in nodes if not self.directory.has_stats(n) and asked.get(n) != server_round]
        if not todo:
            return
        asked.update({n: server_round for n in todo})
        replies = self.exchange_payloads(transport, server_round, "split-info", {n: Envelope() for n in todo})
        if self.env is not None:
            classes = self.env.num_classes
        else:   # asked at the start, before the server's data is partitioned (strategies.partition_count)
            from tasks.env import load_bundle
            classes = load_bundle(self.task).num_classes
        for n, env in replies.items():
            hist = np.asarray(env.tensors.get("histogram", np.zeros(0)), dtype=np.int64)
            if hist.shape != (classes,) or (hist < 0).any():
                self.drop(n, f"bad label histogram of shape {hist.shape}")
                continue
            self.directory.note(n, env.config["partition-id"], env.config.get("num-partitions", 0),
                                n=int(env.config["num-examples"]), hist=hist,
                                **{"sim-actors": int(env.config.get("sim-actors", 0)),
                                   "sim-threads": int(env.config.get("sim-threads", 0))})

    def learn_partitions(self, grid: Grid, nodes: list[int], poll: float = 0.01, server_round: int = 0) -> list[int]:
        """Sampling needs the partitions of all nodes (:meth:`strategies.base.BaseStrategy.sample_nodes`):
        a split node learns them from its ``split-info`` reply, asked once (the node is not asked
        ``node-info`` as well, nor ``split-info`` again when it is sampled in that round)."""
        transport = self._transport if self._transport is not None else FlowerTransport(self, grid)
        asked = self.__dict__.setdefault("_info_asked", {})
        self.fetch_info(transport, server_round, [n for n in nodes if n not in asked])
        return [n for n in nodes if n in self.directory]

    # ------------------------------------------------------------------ the round
    _transport: Transport | None = None

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        """One round over the run's transport (made at the first round; a stream transport
        keeps its sessions across rounds, see :class:`split_layer.stream.StreamTransport`)."""
        if self._transport is None or getattr(self._transport, "grid", grid) is not grid:
            self.close_transport()
            self._transport = self.make_transport(grid)
        try:
            out = self._run_round(server_round, grid, self._transport)
        except BaseException:
            self.close_transport()
            raise
        self._transport.end_round()
        return out

    def close_transport(self) -> None:
        """End the transport's sessions (the run ended, or failed)."""
        tr, self._transport = self._transport, None
        if tr is not None:
            tr.close()

    def start(self, grid: Grid, *args: Any, **kwargs: Any):
        """Flower's ``Strategy.start`` (see :meth:`strategies.base.BaseStrategy.start`); the
        transport's sessions end with it, also when it fails."""
        try:
            return super().start(grid, *args, **kwargs)
        finally:
            self.close_transport()

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

    def max_batch(self, node: int) -> int:
        """The largest ``split-batch`` ``begin_round`` can give ``node`` (default: the task's batch
        size, at most the node's samples)."""
        return self.node_batch(node)

    def _run_round(self, server_round: int, grid: Grid, transport: Transport) -> dict[str, Any]:
        sampled = self.sample_nodes(grid, server_round)
        self.fetch_info(transport, server_round, sampled)
        alive = self.order([n for n in sampled if self.directory.has_stats(n)])
        out: dict[str, Any] = {"sampled": len(sampled)}
        if len(alive) < self.policy.min_nodes:
            return self._skip(server_round, out, alive, None)
        snap = self.server_snapshot()
        self.begin_round(server_round, alive)
        iters = self.local_iterations()
        bottom = self.bottom_numpy()  # every group starts from the round's global bottom
        groups = [list(g) for g in self.visit_groups(server_round, list(alive))]
        flat = [n for g in groups for n in g]
        if len(flat) != len(set(flat)) or set(flat) != set(alive):
            raise ValueError(f"visit_groups must split the round's nodes {alive} into disjoint groups, "
                             f"got {groups}")
        finals: dict[int, Envelope] = {}
        for gi, group in enumerate(groups):
            later = [n for g in groups[gi + 1:] for n in g]
            got, usable = self._run_group(server_round, transport, group, bottom, iters, out,
                                          list(finals) + later)
            if got is None:
                return self._skip(server_round, out, usable, snap)
            finals.update(got)
        out["participants"] = len(finals)
        ex = [float(f.metrics.get("num-examples", 0.0)) for f in finals.values()]
        out["num-examples"] = float(sum(ex))
        out.update(self.aggregate(server_round, finals))
        return out

    def _run_group(self, server_round: int, transport: Transport, group: list[int],
                   bottom: dict[str, np.ndarray], iters: int, out: dict[str, Any], others: list[int]
                   ) -> tuple[dict[int, Envelope] | None, list[int]]:
        """One group's visit: message 1, steps ``1..I``, the final replies.

        Returns ``(finals of the group, [])``, or ``(None, usable nodes)`` when the group's
        survivors plus ``others`` (nodes finished in earlier groups or waiting in later ones)
        are fewer than ``min-nodes``: the round must be skipped.
        """
        alive = list(group)
        if not alive:
            return {}, []
        msgs: dict[int, Envelope] = {}
        for n in alive:
            extras = self.begin_extras(n)
            msgs[n] = Envelope(arrays={"bottom": bottom, **extras},
                               config={"split-step": 1, "split-iters": iters, **self.begin_config(n)})
        for step in range(1, iters + 2):
            t0 = time.perf_counter()
            replies = self.exchange_payloads(transport, server_round, "split", msgs)
            out["split-exchanges"] = out.get("split-exchanges", 0) + 1
            dt = time.perf_counter() - t0
            out["split-exchange-seconds"] = out.get("split-exchange-seconds", 0.0) + dt
            if 1 < step <= iters:  # the exchanges inside the group's visit (no start or end)
                out["split-inner-exchanges"] = out.get("split-inner-exchanges", 0) + 1
                out["split-inner-exchange-seconds"] = out.get("split-inner-exchange-seconds", 0.0) + dt
            good: dict[int, Envelope] = {}
            for n in alive:
                if n not in replies:
                    continue  # already logged and recorded by the transport
                env = replies[n]
                try:
                    if step <= iters:
                        check_streams(env.tensors, self.stream_specs(n), f"node {n}, step {step}")
                    elif "bottom" not in env.arrays:
                        raise SplitValidationError(f"node {n}: final reply has no 'bottom' weights")
                    else:
                        ref = bottom  # 0-d buffers travel as shape (1,): restore shapes
                        env.arrays["bottom"] = {
                            k: (np.reshape(v, ref[k].shape) if k in ref and np.size(v) == np.size(ref[k]) else v)
                            for k, v in env.arrays["bottom"].items()}
                        check_streams(env.arrays["bottom"], {k: TensorSpec(v.shape, str(v.dtype))
                                                             for k, v in ref.items()}, f"node {n}, final bottom")
                except SplitValidationError as e:
                    self.drop(n, str(e))
                    continue
                good[n] = env
            for n, why in self.refused_payloads(step, iters, good, bottom).items():
                self.drop(n, f"node {n}: {why}")
                del good[n]
            alive = [n for n in alive if n in good]
            if len(alive) + len(others) < self.policy.min_nodes:
                return None, alive + list(others)
            if step > iters:
                return good, []
            if not alive:
                return {}, []  # every node of the group failed: the group ends early
            payloads = {}
            dev = self.env.device  # the server part's device: the one place payloads are moved there
            for n in alive:
                payloads[n] = {k: torch.from_numpy(np.array(v)).to(dev) for k, v in good[n].tensors.items()}
            grads = self.server_iteration(step, payloads)
            msgs = {}
            for n in alive:
                g = {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in grads[n].items()}
                msgs[n] = Envelope(tensors=g, config={"split-step": step + 1, "split-iters": iters})
        return {}, []  # not reached: the loop returns at step I + 1

    def refused_payloads(self, step: int, iters: int, replies: dict[int, Envelope],
                         bottom: dict[str, np.ndarray]) -> dict[int, str]:
        """The well-formed replies of one exchange that are still refused, ``node -> why``: at steps
        ``1..I`` streams beyond the run's statistics (``payload-bound``, :class:`split_layer.bounds.StreamBounds`),
        at the final reply a bottom further than ``upload-norm-bound`` from the round's ``bottom``."""
        if step <= iters:
            bounds = self.__dict__.setdefault("_stream_bounds", StreamBounds(self.policy.payload_bound))
            return bounds.refuse({n: env.tensors for n, env in replies.items()}, f"step {step}")
        limit = self.policy.upload_norm_bound
        if limit <= 0:
            return {}
        norms = {n: update_norm(env.arrays["bottom"], bottom) for n, env in replies.items()}
        return {n: f"final bottom: its distance from the round's bottom, {d:.4g}, is more than upload-norm-bound="
                   f"{limit:g}; refused, not applied" for n, d in norms.items() if d > limit}

    def _skip(self, server_round: int, out: dict[str, Any], alive: list[int], snap: Any) -> dict[str, Any]:
        if snap is not None:
            self.server_restore(snap)
        log(WARNING, "round %s skipped: %s usable node(s) < min-nodes=%s; server part restored", server_round,
            len(alive), self.policy.min_nodes)
        out.update({"participants": len(alive), "skipped": 1})
        return out

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"info": self.directory.state(), **self.split_extra_state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.directory.load(state.get("info", {}))
        self.load_split_extra_state(state)

    def split_extra_state(self) -> dict[str, Any]:
        return {}

    def load_split_extra_state(self, state: dict[str, Any]) -> None:
        pass
