"""The ClientApp side of split learning: a generic worker with algorithm hooks.

:func:`make_split_handlers(hooks)` returns the ClientApp handlers ``{"split": ...,
"split-info": ...}`` that an algorithm module puts into its ``AlgorithmSpec.client``.

Protocol of one round with ``I = split-iters`` local iterations (``I + 1`` messages, each
one Flower round trip; the server runtime is :mod:`split_layer.runtime`):

====== ============================================ ============================================
step   server -> client                             client -> server
====== ============================================ ============================================
1      ``bottom`` weights, extras, ``split-batch``   streams of step 1 (e.g. ``act``, ``labels``)
2..I   gradients of step ``s-1`` (e.g. ``act``)      streams of step ``s``
I+1    gradients of step ``I``                       final ``bottom`` (+ extras), metrics
====== ============================================ ============================================

The worker keeps only this in ``context.state`` (it travels with every message):
``split.bottom`` (the bottom state dict), ``split.opt`` (SGD momentum buffers, if any),
``split.meta`` (round, next step, batch size, iterations) and whatever the hooks store.

Exactness. The activations of step ``s`` are computed without a graph when they are sent,
and recomputed with a graph when their gradient arrives (``torch.autograd.backward`` of
the named streams with the received gradients, then one optimizer step). Both passes use
the same batch (a stateless per-step cursor over seeded epoch permutations), the same
seed for the augmentation draw and the dropout masks
(``derive_seed(seed, "split-fwd", round, partition, step)``), and BatchNorm running
statistics are updated once (buffers are restored after the recomputation). So the bottom
follows exactly the trajectory of an in-process model fed the same gradients.

Stream transport (``split-stream-address`` in the step-1 config, :mod:`split_layer.stream`):
the same handler runs the whole round in the one call of step 1: steps 1..I over the gRPC
stream, each forward pass once with its graph kept until the gradients arrive, and the
final bottom returned as the Flower reply. Same batches, seeds and hooks, hence the same
weights as the message path. Hooks see ``w.recomputing`` only in the message path.

Validation: incoming gradients must name a stream that was sent with a graph and match
its shape and dtype, with no NaN/Inf; otherwise :class:`SplitValidationError` is raised
(the reply is an error; nothing is applied).

Fault injection (testing only): if the algorithm config has ``fault-partition == <this
partition-id>`` and ``fault-step == <step>`` the handler raises at that step, to test the
server's drop-and-continue path.
"""
from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from split_layer.records import ALGO_KEY, CONFIG_KEY, client_env, state_to_record
from tasks.data import ArrayDataset
from tasks.env import Env
from tasks.training import derive_seed, make_sgd, to_device_batch

from .cut import bottom_state, load_bottom_state, resolve_cut, split_model
from .stream import (
    STREAM_KEYS,
    StreamClient,
    config_from_json,
    config_to_json,
    pack_arrays,
    simulation_concurrency,
    unpack_arrays,
)
from .transport import Envelope, envelope_from_message, reply
from .validation import SplitValidationError, TensorSpec, check_tensor

__all__ = ["SplitClientHooks", "Worker", "make_split_handlers", "step_batch", "forward_seed",
           "STATE_BOTTOM", "STATE_OPT", "STATE_META", "COMPUTE_LOCK"]

STATE_BOTTOM = "split.bottom"
STATE_OPT = "split.opt"
STATE_META = "split.meta"
# Forward passes and optimizer steps of all nodes served by one process run one at a time:
# they seed torch's global RNG (augmentation, dropout), so concurrent nodes in threads (the
# in-process LocalGrid with the stream transport) would otherwise draw each other's numbers.
# A real ClientApp process serves one node, so the lock is never contended there.
COMPUTE_LOCK = threading.RLock()


@contextmanager
def _released(lock):
    """Give ``lock`` (held once by this thread) up while waiting on the network."""
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


class SplitProtocolError(RuntimeError):
    """A split message arrived out of order (wrong round/step for this node's state)."""


# --------------------------------------------------------------------------- batching and seeds
def step_batch(n: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Indices of the mini-batch of local step ``step`` (1-based) of a round.

    A stateless cursor: step ``s`` takes positions ``[(s-1)*b, s*b)`` of the infinite
    sequence ``perm_0 ++ perm_1 ++ ...`` where ``perm_e = randperm(n)`` seeded by
    ``derive_seed(seed, e)``, so every sample is seen once per epoch and any step's batch
    can be recomputed from ``(seed, step)`` alone. ``seed`` should already depend on the
    run seed, round and partition (the worker uses
    ``derive_seed(task.seed, "split-batch", round, partition)``).
    """
    if n <= 0 or batch_size <= 0:
        raise ValueError(f"cannot draw a batch of {batch_size} from {n} samples")
    start, stop = (step - 1) * batch_size, step * batch_size
    out, e0 = [], start // n
    for e in range(e0, (stop - 1) // n + 1):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, e)))
        lo, hi = max(start - e * n, 0), min(stop - e * n, n)
        out.append(perm[lo:hi])
    return torch.cat(out)


def forward_seed(task_seed: int, rnd: int, partition: int, step: int) -> int:
    """Seed of the augmentation draw and dropout masks of one client forward pass."""
    return derive_seed(task_seed, "split-fwd", rnd, partition, step)


def batch_seed(task_seed: int, rnd: int, partition: int) -> int:
    return derive_seed(task_seed, "split-batch", rnd, partition)


@contextmanager
def seeded(seed: int, device: torch.device | None = None):
    """Run a block under a fixed torch seed without disturbing the global RNG."""
    devices = [device.index or 0] if (device is not None and device.type == "cuda") else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------- hooks
@dataclass
class Worker:
    """What a hook sees: the node's env, the model and its bottom, round/step, state."""

    env: Env
    model: torch.nn.Module
    bottom: torch.nn.Module
    cut: str
    rnd: int
    iters: int
    batch_size: int
    state: RecordDict                    # context.state (store extras under "split.x.<name>")
    algo: dict[str, Any] = field(default_factory=dict)   # the algorithm's flat config
    config: dict[str, Any] = field(default_factory=dict)  # this message's config
    optimizer: torch.optim.Optimizer | None = None
    recomputing: bool = False   # inside the message path's second forward pass (streams not sent)
    node_config: dict[str, Any] = field(default_factory=dict)  # this node's own settings (consent etc.)
    cache: dict[str, Any] = field(default_factory=dict)  # hooks' objects for this round (cleared at step 1)
    streaming: bool = False     # the round runs over the stream in this one call: what a hook keeps in
                                # ``state`` only for the next message need not be written every step

    @property
    def partition(self) -> int:
        return self.env.partition_id


class SplitClientHooks:
    """Algorithm hooks of the worker; subclass and override what differs.

    Defaults: supervised data (``env.labeled()``), weak augmentation, streams
    ``{"act": bottom(weak(x)), "labels": y}``, SGD from the task config, no extras.
    """

    label_mode: str = "all"

    def data(self, w: Worker) -> ArrayDataset:
        return w.env.labeled()

    def make_optimizer(self, w: Worker) -> torch.optim.Optimizer:
        return make_sgd(w.bottom.parameters(), w.env.task)

    def begin(self, w: Worker, env: Envelope) -> None:
        """Step 1: read algorithm extras (e.g. a teacher bottom) into ``w.state``."""

    def forward(self, w: Worker, xb: torch.Tensor, yb: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """Named streams of one step, under a fixed seed.

        Message transport: run twice, without a graph (the streams sent) and again with a
        graph (``w.recomputing``; only the streams that receive gradients matter). Stream
        transport: run once with a graph, and those streams are sent. Streams that never
        receive gradients (e.g. a teacher's features) should be computed under
        ``torch.no_grad()`` and may be skipped when ``w.recomputing``; draw random numbers
        in the same order in every pass.
        """
        return {"act": w.bottom(w.env.augmenter.weak(xb)), "labels": yb}

    def feedback(self, w: Worker, step: int, tensors: dict[str, np.ndarray], labels: np.ndarray
                 ) -> dict[str, np.ndarray]:
        """Tensors that came down with the gradients of ``step`` but are not gradients (e.g. the
        server's pseudo-labels, for a metric the node computes itself): take them out and return
        the gradients. ``labels``: the node's own labels of that step's batch (never sent)."""
        return tensors

    def after_step(self, w: Worker, step: int) -> None:
        """After the optimizer step of ``step`` (e.g. EMA of a teacher bottom)."""

    def end(self, w: Worker) -> Envelope:
        """Extras of the final reply (arrays/metrics), merged into the worker's own."""
        return Envelope()

    def label_histogram(self, w: Worker, data: ArrayDataset) -> np.ndarray:
        """Label counts ``n_k`` for ``split-info`` (override: e.g. zeros when the data is unlabeled)."""
        return np.bincount(data.y.astype(np.int64), minlength=w.env.num_classes).astype(np.int64)

    def info(self, w: Worker) -> dict[str, Any]:
        """Extra config for the one-time ``split-info`` reply."""
        return {}


# --------------------------------------------------------------------------- state helpers
def _save_opt(bottom: torch.nn.Module, opt: torch.optim.Optimizer) -> ArrayRecord:
    bufs = {}
    for name, p in bottom.named_parameters():
        st = opt.state.get(p, {})
        buf = st.get("momentum_buffer")
        if buf is not None:
            bufs[name] = Array(buf.detach().cpu().numpy().copy())
    return ArrayRecord(bufs)


def _load_opt(bottom: torch.nn.Module, opt: torch.optim.Optimizer, rec: ArrayRecord) -> None:
    keys = set(rec.keys())
    for name, p in bottom.named_parameters():
        if name in keys:
            opt.state[p]["momentum_buffer"] = torch.from_numpy(rec[name].numpy().copy()).to(p.device)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


# --------------------------------------------------------------------------- the handlers
def make_split_handlers(hooks: SplitClientHooks, label_mode: str | None = None) -> dict[str, Any]:
    """ClientApp handlers ``{"split": ..., "split-info": ...}`` driven by ``hooks``."""
    mode = label_mode or hooks.label_mode

    def _worker(msg: Message, context: Context, cfg: dict[str, Any]) -> Worker:
        env = client_env(msg, context, label_mode=mode)
        model = env.build_model()
        model.train()
        cut = resolve_cut(model, env.task.cut)
        bottom, _ = split_model(model, cut)
        algo = dict(msg.content.config_records[ALGO_KEY]) if ALGO_KEY in msg.content.config_records else {}
        return Worker(env, model, bottom, cut, int(cfg.get("server-round", 0)), int(cfg.get("split-iters", 0)),
                      int(cfg.get("split-batch", 0)), context.state, algo, cfg,
                      node_config=dict(context.node_config), streaming=STREAM_KEYS["address"] in cfg)

    def info(msg: Message, context: Context) -> Message:
        with COMPUTE_LOCK:
            return _info(msg, context)

    def _info(msg: Message, context: Context) -> Message:
        cfg = dict(msg.content.config_records[CONFIG_KEY])
        w = _worker(msg, context, cfg)
        data = hooks.data(w)
        hist = np.asarray(hooks.label_histogram(w, data), dtype=np.int64)
        actors, threads = simulation_concurrency()
        return reply(msg, Envelope(tensors={"histogram": hist},
                                   config={"partition-id": w.partition, "num-partitions": w.env.num_partitions,
                                           "num-examples": int(len(data)),
                                           "sim-actors": actors, "sim-threads": threads, **hooks.info(w)}))

    def batch_labels(w: Worker, data: ArrayDataset, step: int) -> np.ndarray:
        """The node's labels of the batch of ``step`` (for :meth:`SplitClientHooks.feedback`; stay here)."""
        idx = step_batch(len(data), w.batch_size, step, batch_seed(w.env.task.seed, w.rnd, w.partition))
        return np.asarray(data.y)[idx.numpy()]

    def run_forward(w: Worker, data: ArrayDataset, step: int, grad: bool,
                    recompute: bool = False) -> dict[str, torch.Tensor]:
        """The forward pass of ``step``: ``grad`` keeps a graph; ``recompute`` marks the message
        path's second pass (its streams are not sent again, only backpropagated)."""
        idx = step_batch(len(data), w.batch_size, step, batch_seed(w.env.task.seed, w.rnd, w.partition))
        xb, yb = to_device_batch(data, idx, w.env.device)
        with COMPUTE_LOCK, seeded(forward_seed(w.env.task.seed, w.rnd, w.partition, step), w.env.device):
            w.recomputing = recompute
            try:
                if grad:
                    return hooks.forward(w, xb, yb, step)
                with torch.no_grad():
                    return hooks.forward(w, xb, yb, step)
            finally:
                w.recomputing = False

    def begin(w: Worker, incoming: Envelope, st: RecordDict) -> None:
        """Step 1 (both transports): load the bottom, reset this node's split state, optimizer, hooks."""
        if "bottom" not in incoming.arrays:
            raise SplitProtocolError("split-step 1 carries no 'bottom' weights")
        load_bottom_state(w.model, {k: torch.from_numpy(v.copy()) for k, v in incoming.arrays["bottom"].items()},
                          w.cut)
        for k in [k for k in st.keys() if k.startswith("split.")]:
            del st[k]
        w.optimizer = hooks.make_optimizer(w)
        w.cache.clear()
        hooks.begin(w, incoming)

    def apply(w: Worker, outs: dict[str, torch.Tensor], grads: dict[str, np.ndarray], step: int,
              restore: dict[str, torch.Tensor] | None = None) -> None:
        """Backpropagate the received gradients of ``step`` through ``outs`` (its graph); one SGD step.

        ``restore``: buffer values to put back after the backward pass (the message path's
        recomputation must not update BatchNorm statistics a second time; BatchNorm's
        backward still needs the buffers it saw, so they are restored only afterwards).
        """
        if not grads:
            raise SplitValidationError(f"no gradients received for step {step}")
        tensors, grad_ts = [], []
        for name, g in grads.items():
            if name not in outs or not outs[name].requires_grad:
                raise SplitValidationError(
                    f"gradient for stream '{name}' (partition {w.partition}, step {step}), but that "
                    f"stream was not sent with a graph; streams with a graph: "
                    f"{sorted(k for k, v in outs.items() if v.requires_grad)}")
            check_tensor(name, g, TensorSpec(tuple(outs[name].shape), str(outs[name].dtype).replace("torch.", "")),
                         f"gradient, partition {w.partition}, step {step}")
            tensors.append(outs[name])
            grad_ts.append(torch.from_numpy(np.array(g)).to(outs[name].device))
        with COMPUTE_LOCK:
            w.optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(tensors, grad_ts)
            if restore is not None:
                with torch.no_grad():
                    for n, b in w.bottom.named_buffers():
                        b.copy_(restore[n])
            w.optimizer.step()
            hooks.after_step(w, step)

    def final_envelope(w: Worker, data: ArrayDataset, st: RecordDict) -> Envelope:
        final = hooks.end(w)
        arrays = {"bottom": {k: _to_numpy(v) for k, v in bottom_state(w.model, w.cut).items()}, **final.arrays}
        metrics = {"num-examples": float(len(data)), "batch-size": float(w.batch_size),
                   "steps": float(w.iters), **final.metrics}
        for k in [k for k in st.keys() if k.startswith("split.")]:
            del st[k]
        return Envelope(arrays=arrays, metrics=metrics, config=final.config)

    def check_fault(w: Worker, step: int) -> None:
        if int(w.algo.get("fault-partition", -1)) == w.partition and int(w.algo.get("fault-step", 0)) == step:
            raise RuntimeError(f"fault injection: partition {w.partition} fails at split-step {step} "
                               "(fault-partition/fault-step knobs; testing only)")

    def split(msg: Message, context: Context) -> Message:
        with COMPUTE_LOCK:  # model building draws from the global RNG too
            return _split(msg, context)

    def _split(msg: Message, context: Context) -> Message:
        cfg = dict(msg.content.config_records[CONFIG_KEY])
        step = int(cfg["split-step"])
        w = _worker(msg, context, cfg)
        check_fault(w, step)
        incoming = envelope_from_message(msg)
        st = context.state
        if step == 1 and STREAM_KEYS["address"] in cfg:
            return reply(msg, stream_round(w, incoming, cfg, st))
        if step == 1:
            begin(w, incoming, st)
        else:
            meta = st.get(STATE_META)
            if meta is None or int(meta["round"]) != w.rnd or int(meta["next-step"]) != step:
                have = None if meta is None else (int(meta["round"]), int(meta["next-step"]))
                raise SplitProtocolError(f"split message (round {w.rnd}, step {step}) does not follow this "
                                         f"node's state (round, next step) = {have}")
            w.iters, w.batch_size = int(meta["iters"]), int(meta["batch"])
            rec = st[STATE_BOTTOM]
            load_bottom_state(w.model, {k: torch.from_numpy(rec[k].numpy().copy()) for k in rec.keys()}, w.cut)
            w.optimizer = hooks.make_optimizer(w)
            if STATE_OPT in st:
                _load_opt(w.bottom, w.optimizer, st[STATE_OPT])
        if w.batch_size < 1 or w.iters < 1:
            raise SplitProtocolError(f"bad split-batch={w.batch_size} or split-iters={w.iters}")
        data = hooks.data(w)

        if step > 1:  # apply the gradients of step-1 on the recomputed forward pass
            if not incoming.tensors:
                raise SplitValidationError(f"split-step {step}: no gradients received for step {step - 1}")
            saved = {n: b.detach().clone() for n, b in w.bottom.named_buffers()}
            outs = run_forward(w, data, step - 1, grad=True, recompute=True)
            grads = hooks.feedback(w, step - 1, dict(incoming.tensors), batch_labels(w, data, step - 1))
            apply(w, outs, grads, step - 1, restore=saved)  # BN statistics: updated once

        if step <= w.iters:
            outs = run_forward(w, data, step, grad=False)
            st[STATE_BOTTOM] = state_to_record(bottom_state(w.model, w.cut))
            st[STATE_OPT] = _save_opt(w.bottom, w.optimizer)
            st[STATE_META] = ConfigRecord({"round": w.rnd, "next-step": step + 1, "iters": w.iters,
                                           "batch": w.batch_size})
            return reply(msg, Envelope(tensors={k: _to_numpy(v) for k, v in outs.items()}))
        return reply(msg, final_envelope(w, data, st))

    def stream_round(w: Worker, incoming: Envelope, cfg: dict[str, Any], st: RecordDict) -> Envelope:
        """The node's stream session (see :mod:`split_layer.stream`): this round, and, when the
        session spans rounds (``split-stream-session``), every later round the server starts
        on the stream, until it says ``bye``.

        One forward pass per step, with a graph that is kept until the step's gradients
        arrive (BatchNorm statistics are therefore updated once, as in the message path).
        The data, the model and the environment are built once per session.
        """
        spans = bool(int(cfg.get(STREAM_KEYS["session"], 0)))
        idle = float(cfg.get(STREAM_KEYS["idle"], 0.0)) or None
        with _released(COMPUTE_LOCK):
            client = StreamClient(str(cfg[STREAM_KEYS["address"]]), str(cfg[STREAM_KEYS["token"]]),
                                  int(cfg[STREAM_KEYS["node"]]), str(cfg.get(STREAM_KEYS["cert"], "")),
                                  float(cfg.get(STREAM_KEYS["timeout"], 600.0)),
                                  max_frame=int(cfg.get(STREAM_KEYS["max-frame"], 0)))
        rounds = 0
        try:
            while True:
                final = stream_visit(w, incoming, st, client)
                rounds += 1
                if not spans:
                    return final
                table, tensors = pack_arrays(final.arrays)
                client.send({"final": True, "arrays": table, "metrics": final.metrics,
                             "config": config_to_json(final.config)}, tensors)
                with _released(COMPUTE_LOCK):
                    header, tensors = client.recv(wait=idle)
                if header.get("bye"):
                    return Envelope(metrics={"session-rounds": float(rounds)})
                if "round" not in header:
                    raise SplitProtocolError(f"split stream: expected a round or bye, got header {sorted(header)}")
                w = next_round(w, {**cfg, **config_from_json(header.get("config"))})
                incoming = Envelope(arrays=unpack_arrays(header.get("arrays"), tensors))
                check_fault(w, 1)
        except Exception as e:
            try:  # tell the server why, then fail the Flower message as well
                client.send({"error": f"{type(e).__name__}: {e}"[:1000]}, {})
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            client.close()

    def next_round(w: Worker, cfg: dict[str, Any]) -> Worker:
        """The worker of the session's next round: same env, model and data, this round's config."""
        return dataclasses.replace(w, rnd=int(cfg.get("server-round", 0)), iters=int(cfg.get("split-iters", 0)),
                                   batch_size=int(cfg.get("split-batch", 0)), config=cfg, optimizer=None,
                                   recomputing=False)

    def stream_visit(w: Worker, incoming: Envelope, st: RecordDict, client: StreamClient) -> Envelope:
        """One round's visit over the stream: steps 1..I, the final gradients; the final envelope."""
        begin(w, incoming, st)
        if w.batch_size < 1 or w.iters < 1:
            raise SplitProtocolError(f"bad split-batch={w.batch_size} or split-iters={w.iters}")
        data = hooks.data(w)
        outs = run_forward(w, data, 1, grad=True)
        client.send({"step": 1}, {k: _to_numpy(v) for k, v in outs.items()})
        for step in range(2, w.iters + 2):
            with _released(COMPUTE_LOCK):
                header, grads = client.recv()
            if int(header.get("step", -1)) != step or bool(header.get("final")) != (step > w.iters):
                raise SplitProtocolError(f"split stream: expected step {step}, got header {header}")
            check_fault(w, step)
            grads = hooks.feedback(w, step - 1, dict(grads), batch_labels(w, data, step - 1))
            apply(w, outs, grads, step - 1)
            if step <= w.iters:
                outs = run_forward(w, data, step, grad=True)
                client.send({"step": step}, {k: _to_numpy(v) for k, v in outs.items()})
        return final_envelope(w, data, st)

    return {"split": split, "split-info": info}
