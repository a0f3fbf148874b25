"""One split round's session over a transport: :class:`SplitRound` (sample, ``split-info``,
begin, the groups' fused exchanges with validation and the payload bounds, aggregate; a round
that cannot reach ``min-nodes`` is skipped with the server part restored). The round's steps
are described in :mod:`split_layer.runtime`; the algorithm's hooks are the strategy's."""
from __future__ import annotations

import time
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.common import log
from flwr.serverapp import Grid

from strategies.core.round_guard import update_norm

from .bounds import StreamBounds
from .transport import Envelope, Transport
from .validation import SplitValidationError, TensorSpec, check_streams

__all__ = ["SplitRound", "node_batch"]


class SplitRound:
    """Runs ``strategy``'s split rounds (a :class:`split_layer.runtime.SplitRuntime`: its hooks,
    node directory, ``info_query`` and ``payloads``); keeps the run's payload statistics."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.bounds: StreamBounds | None = None   # the run's payload statistics (payload-bound)

    def run(self, server_round: int, grid: Grid, transport: Transport) -> dict[str, Any]:
        """One round over ``transport`` (see :mod:`split_layer.runtime`); returns its metrics."""
        s = self.strategy
        sampled = s.sample_nodes(grid, server_round)
        s.info_query.fetch(transport, server_round, sampled)
        alive = s.order([n for n in sampled if s.directory.has_stats(n)])
        out: dict[str, Any] = {"sampled": len(sampled)}
        if len(alive) < s.policy.min_nodes:
            return self.skip(server_round, out, alive, None)
        snap = s.server_snapshot()
        s.begin_round(server_round, alive)
        iters = s.local_iterations()
        bottom = s.bottom_numpy()  # every group starts from the round's global bottom
        groups = [list(g) for g in s.visit_groups(server_round, list(alive))]
        flat = [n for g in groups for n in g]
        if len(flat) != len(set(flat)) or set(flat) != set(alive):
            raise ValueError(f"visit_groups must split the round's nodes {alive} into disjoint groups, "
                             f"got {groups}")
        finals: dict[int, Envelope] = {}
        for gi, group in enumerate(groups):
            later = [n for g in groups[gi + 1:] for n in g]
            got, usable = self.group(server_round, transport, group, bottom, iters, out, list(finals) + later)
            if got is None:
                return self.skip(server_round, out, usable, snap)
            finals.update(got)
        out["participants"] = len(finals)
        ex = [float(f.metrics.get("num-examples", 0.0)) for f in finals.values()]
        out["num-examples"] = float(sum(ex))
        out.update(s.aggregate(server_round, finals))
        return out

    def group(self, server_round: int, transport: Transport, group: list[int],
              bottom: dict[str, np.ndarray], iters: int, out: dict[str, Any], others: list[int]
              ) -> tuple[dict[int, Envelope] | None, list[int]]:
        """One group's visit: message 1, steps ``1..I``, the final replies.

        Returns ``(finals of the group, [])``, or ``(None, usable nodes)`` when the group's
        survivors plus ``others`` (nodes finished in earlier groups or waiting in later ones)
        are fewer than ``min-nodes``: the round must be skipped.
        """
        s = self.strategy
        alive = list(group)
        if not alive:
            return {}, []
        msgs: dict[int, Envelope] = {}
        for n in alive:
            extras = s.begin_extras(n)
            msgs[n] = Envelope(arrays={"bottom": bottom, **extras},
                               config={"split-step": 1, "split-iters": iters, **s.begin_config(n)})
        for step in range(1, iters + 2):
            t0 = time.perf_counter()
            replies = s.payloads.exchange(transport, server_round, "split", msgs)
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
                        check_streams(env.tensors, s.stream_specs(n), f"node {n}, step {step}")
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
                    s.drop(n, str(e))
                    continue
                good[n] = env
            for n, why in self.refused(step, iters, good, bottom).items():
                s.drop(n, f"node {n}: {why}")
                del good[n]
            alive = [n for n in alive if n in good]
            if len(alive) + len(others) < s.policy.min_nodes:
                return None, alive + list(others)
            if step > iters:
                return good, []
            if not alive:
                return {}, []  # every node of the group failed: the group ends early
            payloads = {}
            dev = s.env.device  # the server part's device: the one place payloads are moved there
            for n in alive:
                payloads[n] = {k: torch.from_numpy(np.array(v)).to(dev) for k, v in good[n].tensors.items()}
            grads = s.server_iteration(step, payloads)
            msgs = {}
            for n in alive:
                g = {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in grads[n].items()}
                msgs[n] = Envelope(tensors=g, config={"split-step": step + 1, "split-iters": iters})
        return {}, []  # not reached: the loop returns at step I + 1

    def refused(self, step: int, iters: int, replies: dict[int, Envelope],
                         bottom: dict[str, np.ndarray]) -> dict[int, str]:
        """The well-formed replies of one exchange that are still refused, ``node -> why``: at steps
        ``1..I`` streams beyond the run's statistics (``payload-bound``, :class:`split_layer.bounds.StreamBounds`),
        at the final reply a bottom further than ``upload-norm-bound`` from the round's ``bottom``."""
        if step <= iters:
            if self.bounds is None:
                self.bounds = StreamBounds(self.strategy.policy.payload_bound)
            return self.bounds.refuse({n: env.tensors for n, env in replies.items()}, f"step {step}")
        limit = self.strategy.policy.upload_norm_bound
        if limit <= 0:
            return {}
        norms = {n: update_norm(env.arrays["bottom"], bottom) for n, env in replies.items()}
        return {n: f"final bottom: its distance from the round's bottom, {d:.4g}, is more than upload-norm-bound="
                   f"{limit:g}; refused, not applied" for n, d in norms.items() if d > limit}

    def skip(self, server_round: int, out: dict[str, Any], alive: list[int], snap: Any) -> dict[str, Any]:
        if snap is not None:
            self.strategy.server_restore(snap)
        log(WARNING, "round %s skipped: %s usable node(s) < min-nodes=%s; server part restored", server_round,
            len(alive), self.strategy.policy.min_nodes)
        out.update({"participants": len(alive), "skipped": 1})
        return out


def node_batch(strategy: Any, node: int) -> int:
    """The task's batch size, or all of ``node``'s samples where it has fewer (a batch larger
    than a node's data is one full batch, logged once per node, never an allocation of
    the asked size)."""
    b, n = int(strategy.task.batch_size), int(strategy.directory.get(node, {}).get("n", 0))
    if 0 < n < b:
        warned = strategy.__dict__.setdefault("_batch_warned", set())
        if node not in warned:
            warned.add(node)
            log(WARNING, "batch-size=%d is larger than node %s's %d samples: it trains on batches of %d",
                b, node, n, n)
        return n
    return b
