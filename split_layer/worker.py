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
the same batch (:func:`tasks.training.batch_at`: a stateless cursor over seeded epochs), the same
seed for the augmentation draw and the dropout masks
(``derive_seed(seed, "split-fwd", round, partition, step)``), and BatchNorm running
statistics are updated once (buffers are restored after the recomputation). So the bottom
follows exactly the trajectory of an in-process model fed the same gradients.

Stream transport (``split-stream-address`` in the step-1 config, :mod:`split_layer.stream`):
the same handler runs the whole round in the one call of step 1: steps 1..I over the gRPC
stream, each forward pass once with its graph kept until the gradients arrive, and the
final bottom returned as the Flower reply. Same batches, seeds and hooks, hence the same
weights as the message path. Hooks see ``w.recomputing`` only in the message path.

Local-loss split learning (hooks with ``trains_locally``, e.g. SFLLocalLoss): the bottom
trains on the hooks' ``local_loss`` at the step it sends (one forward with a graph, one
optimizer step, the streams of that forward sent detached); the server sends no gradients
(steps 2..I+1 carry none) and nothing is recomputed (:meth:`SplitWorker.local_message_step`,
:meth:`SplitWorker.local_stream_visit`).

Validation: incoming gradients must name a stream that was sent with a graph and match
its shape and dtype, with no NaN/Inf; otherwise :class:`SplitValidationError` is raised
(the reply is an error; nothing is applied).

Each step of the protocol is one method of :class:`SplitWorker` (both transports share
``begin``, ``forward``, ``apply_gradients`` and ``finish``); a test that needs a node to fail
at split step ``k`` makes it fail when the gradients of step ``k - 1`` reach it
(``tests/split_faults.py``).
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

from strategies.core.records import ALGO_KEY, CONFIG_KEY, client_env, state_to_record
from tasks.data import ArrayDataset, label_counts
from tasks.env import Env
from tasks.training import batch_at, derive_seed, make_sgd, seeded, seeded_perms, to_device_batch
from tasks.system import recomputation

from .cut import bottom_state, load_bottom_state, resolve_cut, split_model
from .stream import (
    STREAM_KEYS,
    StreamClient,
    config_from_json,
    config_to_json,
    pack_arrays,
    unpack_arrays,
)
from .simulation import simulation_concurrency
from .split_info import HISTOGRAM_KEY
from .transport import Envelope, envelope_from_message, reply
from .validation import SplitValidationError, TensorSpec, check_tensor

__all__ = ["SplitClientHooks", "SplitWorker", "Worker", "make_split_handlers", "forward_seed", "batch_seed",
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


# --------------------------------------------------------------------------- seeds
def forward_seed(task_seed: int, rnd: int, partition: int, step: int) -> int:
    """Seed of the augmentation draw and dropout masks of one client forward pass."""
    return derive_seed(task_seed, "split-fwd", rnd, partition, step)


def batch_seed(task_seed: int, rnd: int, partition: int) -> int:
    """Seed of a node's batches in a round (:meth:`SplitWorker.batch`)."""
    return derive_seed(task_seed, "split-batch", rnd, partition)


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
        return label_counts(data.y, w.env.num_classes, "split-info's label histogram")

    def info(self, w: Worker) -> dict[str, Any]:
        """Extra config for the one-time ``split-info`` reply."""
        return {}

    #: Local-loss split learning (e.g. SFLLocalLoss): the bottom trains on :meth:`local_loss`
    #: at the step it sends its streams (one forward pass with a graph, one optimizer step, then
    #: the streams of that forward, detached, are sent); the server sends no gradients and any
    #: tensor that comes down is ignored. Default ``False``: the bottom trains on the server's
    #: gradients.
    trains_locally: bool = False

    def local_loss(self, w: Worker, outs: dict[str, torch.Tensor], yb: torch.Tensor, step: int) -> torch.Tensor:
        """The loss a local-loss bottom steps on (:attr:`trains_locally`), from the step's streams
        ``outs`` (with their graph) and the batch's labels ``yb``; called under the step's seed,
        before the optimizer's ``zero_grad``. Parameters outside ``w.optimizer`` (e.g. an
        auxiliary head) are the hook's to zero and step (:meth:`after_step`)."""
        raise NotImplementedError("trains_locally hooks must define local_loss")


# --------------------------------------------------------------------------- state helpers
def save_opt(bottom: torch.nn.Module, opt: torch.optim.Optimizer) -> ArrayRecord:
    """``opt``'s SGD momentum buffers of ``bottom``'s parameters, by parameter name (node state)."""
    bufs = {}
    for name, p in bottom.named_parameters():
        st = opt.state.get(p, {})
        buf = st.get("momentum_buffer")
        if buf is not None:
            bufs[name] = Array(buf.detach().cpu().numpy().copy())
    return ArrayRecord(bufs)


def load_opt(bottom: torch.nn.Module, opt: torch.optim.Optimizer, rec: ArrayRecord) -> None:
    """Restore the momentum buffers :func:`save_opt` kept into ``opt``."""
    keys = set(rec.keys())
    for name, p in bottom.named_parameters():
        if name in keys:
            opt.state[p]["momentum_buffer"] = torch.from_numpy(rec[name].numpy().copy()).to(p.device)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


# --------------------------------------------------------------------------- the protocol
class SplitWorker:
    """The ClientApp side of the split protocol for one algorithm's ``hooks``; each step of the
    protocol is one method (module docstring). Holds nothing between messages but its hooks:
    a node's state lives in ``context.state`` (message path) or in the call (stream path).

    Entry points (Flower handlers): :meth:`info` (``split-info``) and :meth:`split`
    (``split``: :meth:`message_step`, or :meth:`stream_round` when step 1 names a stream).
    Shared by both transports: :meth:`worker` (the node's model, cut and round), :meth:`begin`
    (step 1), :meth:`batch`, :meth:`forward`, :meth:`apply_gradients` (a step's gradients
    arrive: hooks' feedback, backward, one optimizer step) and :meth:`finish` (the final reply).
    Message path only: :meth:`resume` (the state the previous message kept) and :meth:`keep`.
    """

    def __init__(self, hooks: SplitClientHooks, label_mode: str | None = None) -> None:
        self.hooks = hooks
        self.mode = label_mode or hooks.label_mode

    def handlers(self) -> dict[str, Any]:
        return {"split": self.split, "split-info": self.info}

    # ------------------------------------------------------------------ entry points
    def info(self, msg: Message, context: Context) -> Message:
        """``split-info``: partition id, ``|D_k|``, and the label histogram where the server asks
        for it (once per node and run)."""
        with COMPUTE_LOCK:  # model building draws from the global RNG
            w = self.worker(msg, context, dict(msg.content.config_records[CONFIG_KEY]))
            return reply(msg, self.info_envelope(w))

    def split(self, msg: Message, context: Context) -> Message:
        """``split``: one step of the message path, or (step 1 naming a stream) the stream session."""
        with COMPUTE_LOCK:  # model building draws from the global RNG too
            cfg = dict(msg.content.config_records[CONFIG_KEY])
            w = self.worker(msg, context, cfg)
            incoming = envelope_from_message(msg)
            if int(cfg["split-step"]) == 1 and STREAM_KEYS["address"] in cfg:
                return reply(msg, self.stream_round(w, incoming, cfg, context.state))
            return reply(msg, self.message_step(w, incoming, int(cfg["split-step"]), context.state))

    # ------------------------------------------------------------------ shared steps
    def worker(self, msg: Message, context: Context, cfg: dict[str, Any]) -> Worker:
        """This message's :class:`Worker`: the node's env, a fresh model cut as the task says."""
        env = client_env(msg, context, label_mode=self.mode)
        model = env.build_model()
        model.train()
        cut = resolve_cut(model, env.task.cut)
        bottom, _ = split_model(model, cut)
        algo = dict(msg.content.config_records[ALGO_KEY]) if ALGO_KEY in msg.content.config_records else {}
        return Worker(env, model, bottom, cut, int(cfg.get("server-round", 0)), int(cfg.get("split-iters", 0)),
                      int(cfg.get("split-batch", 0)), context.state, algo, cfg,
                      node_config=dict(context.node_config), streaming=STREAM_KEYS["address"] in cfg)

    def info_envelope(self, w: Worker) -> Envelope:
        data = self.hooks.data(w)
        tensors = {}
        if w.config.get(HISTOGRAM_KEY):   # only an algorithm that uses it asks (split_layer.split_info)
            tensors["histogram"] = np.asarray(self.hooks.label_histogram(w, data), dtype=np.int64)
        actors, threads = simulation_concurrency()
        return Envelope(tensors=tensors,
                        config={"partition-id": w.partition, "num-partitions": w.env.num_partitions,
                                "num-examples": int(len(data)),
                                "sim-actors": actors, "sim-threads": threads, **self.hooks.info(w)})

    def begin(self, w: Worker, incoming: Envelope, st: RecordDict) -> None:
        """Step 1 (both transports): load the bottom, reset this node's split state, optimizer, hooks."""
        if "bottom" not in incoming.arrays:
            raise SplitProtocolError("split-step 1 carries no 'bottom' weights")
        load_bottom_state(w.model, {k: torch.from_numpy(v.copy()) for k, v in incoming.arrays["bottom"].items()},
                          w.cut)
        _clear_split_state(st)
        w.optimizer = self.hooks.make_optimizer(w)
        w.cache.clear()
        self.hooks.begin(w, incoming)

    @staticmethod
    def check_sizes(w: Worker) -> None:
        if w.batch_size < 1 or w.iters < 1:
            raise SplitProtocolError(f"bad split-batch={w.batch_size} or split-iters={w.iters}")

    @staticmethod
    def batch(w: Worker, data: ArrayDataset, step: int) -> torch.Tensor:
        """Indices of the batch of ``step`` (1-based): :func:`tasks.training.batch_at`, fixed-size
        batches over epochs seeded by the round and partition (recomputable from the step alone)."""
        return batch_at(len(data), w.batch_size, step - 1,
                        seeded_perms(len(data), batch_seed(w.env.task.seed, w.rnd, w.partition)), fixed=True)

    def forward(self, w: Worker, data: ArrayDataset, step: int, grad: bool,
                recompute: bool = False) -> dict[str, torch.Tensor]:
        """The forward pass of ``step``: ``grad`` keeps a graph; ``recompute`` marks the message
        path's second pass (its streams are not sent again, only backpropagated)."""
        xb, yb = to_device_batch(data, self.batch(w, data, step), w.env.device)
        with COMPUTE_LOCK, seeded(forward_seed(w.env.task.seed, w.rnd, w.partition, step), w.env.device):
            w.recomputing = recompute
            try:
                if grad:
                    return self.hooks.forward(w, xb, yb, step)
                with torch.no_grad():
                    return self.hooks.forward(w, xb, yb, step)
            finally:
                w.recomputing = False

    def apply_gradients(self, w: Worker, data: ArrayDataset, outs: dict[str, torch.Tensor],
                        tensors: dict[str, np.ndarray], step: int,
                        restore: dict[str, torch.Tensor] | None = None) -> None:
        """The tensors that came down for ``step`` arrived: the hooks take out what is not a
        gradient (:meth:`SplitClientHooks.feedback`, with the node's own labels of the step's
        batch, which stay here), the rest is backpropagated through ``outs`` (the step's graph)
        and the optimizer steps once (:meth:`backward`)."""
        labels = np.asarray(data.y)[self.batch(w, data, step).numpy()]
        self.backward(w, outs, self.hooks.feedback(w, step, dict(tensors), labels), step, restore)

    def backward(self, w: Worker, outs: dict[str, torch.Tensor], grads: dict[str, np.ndarray], step: int,
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
            self.hooks.after_step(w, step)

    def finish(self, w: Worker, data: ArrayDataset, st: RecordDict) -> Envelope:
        """The final reply (both transports): the trained bottom, the hooks' extras, metrics."""
        final = self.hooks.end(w)
        arrays = {"bottom": {k: _to_numpy(v) for k, v in bottom_state(w.model, w.cut).items()}, **final.arrays}
        metrics = {"num-examples": float(len(data)), "batch-size": float(w.batch_size),
                   "steps": float(w.iters), **final.metrics}
        _clear_split_state(st)
        return Envelope(arrays=arrays, metrics=metrics, config=final.config)

    # ------------------------------------------------------------------ message path
    def resume(self, w: Worker, st: RecordDict, step: int) -> None:
        """Steps 2..I+1: check the message follows this node's state, then restore what the
        previous message kept (:meth:`keep`): iterations, batch size, bottom, optimizer."""
        meta = st.get(STATE_META)
        if meta is None or int(meta["round"]) != w.rnd or int(meta["next-step"]) != step:
            have = None if meta is None else (int(meta["round"]), int(meta["next-step"]))
            raise SplitProtocolError(f"split message (round {w.rnd}, step {step}) does not follow this "
                                     f"node's state (round, next step) = {have}")
        w.iters, w.batch_size = int(meta["iters"]), int(meta["batch"])
        rec = st[STATE_BOTTOM]
        load_bottom_state(w.model, {k: torch.from_numpy(rec[k].numpy().copy()) for k in rec.keys()}, w.cut)
        w.optimizer = self.hooks.make_optimizer(w)
        if STATE_OPT in st:
            load_opt(w.bottom, w.optimizer, st[STATE_OPT])

    @staticmethod
    def keep(w: Worker, st: RecordDict, step: int) -> None:
        """What the next message of the round needs (``context.state``): bottom, momentum, meta."""
        st[STATE_BOTTOM] = state_to_record(bottom_state(w.model, w.cut))
        st[STATE_OPT] = save_opt(w.bottom, w.optimizer)
        st[STATE_META] = ConfigRecord({"round": w.rnd, "next-step": step + 1, "iters": w.iters,
                                       "batch": w.batch_size})

    def message_step(self, w: Worker, incoming: Envelope, step: int, st: RecordDict) -> Envelope:
        """Message ``step`` of a round over Flower messages: apply the gradients of ``step - 1``
        on its recomputed forward pass, then send the streams of ``step`` (or, after step
        ``I``, the final reply)."""
        if self.hooks.trains_locally:
            return self.local_message_step(w, incoming, step, st)
        if step == 1:
            self.begin(w, incoming, st)
        else:
            self.resume(w, st, step)
        self.check_sizes(w)
        data = self.hooks.data(w)
        if step > 1:
            if not incoming.tensors:
                raise SplitValidationError(f"split-step {step}: no gradients received for step {step - 1}")
            saved = {n: b.detach().clone() for n, b in w.bottom.named_buffers()}
            with recomputation():   # the clock bills it apart: the algorithm computed it once
                outs = self.forward(w, data, step - 1, grad=True, recompute=True)
            self.apply_gradients(w, data, outs, incoming.tensors, step - 1, restore=saved)  # BN: updated once
        if step <= w.iters:
            outs = self.forward(w, data, step, grad=False)
            self.keep(w, st, step)
            return Envelope(tensors={k: _to_numpy(v) for k, v in outs.items()})
        return self.finish(w, data, st)

    # ------------------------------------------------------------------ stream path
    def stream_round(self, w: Worker, incoming: Envelope, cfg: dict[str, Any], st: RecordDict) -> Envelope:
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
                final = self.stream_visit(w, incoming, st, client)
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
                w = self.next_round(w, {**cfg, **config_from_json(header.get("config"))})
                incoming = Envelope(arrays=unpack_arrays(header.get("arrays"), tensors))
        except Exception as e:
            try:  # tell the server why, then fail the Flower message as well
                client.send({"error": f"{type(e).__name__}: {e}"[:1000]}, {})
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            client.close()

    @staticmethod
    def next_round(w: Worker, cfg: dict[str, Any]) -> Worker:
        """The worker of the session's next round: same env, model and data, this round's config."""
        return dataclasses.replace(w, rnd=int(cfg.get("server-round", 0)), iters=int(cfg.get("split-iters", 0)),
                                   batch_size=int(cfg.get("split-batch", 0)), config=cfg, optimizer=None,
                                   recomputing=False)

    def stream_visit(self, w: Worker, incoming: Envelope, st: RecordDict, client: StreamClient) -> Envelope:
        """One round's visit over the stream: steps 1..I, the final gradients; the final envelope."""
        if self.hooks.trains_locally:
            return self.local_stream_visit(w, incoming, st, client)
        self.begin(w, incoming, st)
        self.check_sizes(w)
        data = self.hooks.data(w)
        outs = self.forward(w, data, 1, grad=True)
        client.send({"step": 1}, {k: _to_numpy(v) for k, v in outs.items()})
        for step in range(2, w.iters + 2):
            with _released(COMPUTE_LOCK):
                header, grads = client.recv()
            if int(header.get("step", -1)) != step or bool(header.get("final")) != (step > w.iters):
                raise SplitProtocolError(f"split stream: expected step {step}, got header {header}")
            self.apply_gradients(w, data, outs, grads, step - 1)
            if step <= w.iters:
                outs = self.forward(w, data, step, grad=True)
                client.send({"step": step}, {k: _to_numpy(v) for k, v in outs.items()})
        return self.finish(w, data, st)

    # ------------------------------------------------------------------ local-loss path
    def local_step(self, w: Worker, data: ArrayDataset, step: int) -> dict[str, torch.Tensor]:
        """Local-loss split learning (:attr:`SplitClientHooks.trains_locally`), both transports:
        the forward pass of ``step`` with its graph (same batch and seed as :meth:`forward`), one
        optimizer step on :meth:`SplitClientHooks.local_loss`, and the streams of that forward,
        detached, to send (computed before the step; BatchNorm statistics updated once)."""
        xb, yb = to_device_batch(data, self.batch(w, data, step), w.env.device)
        with COMPUTE_LOCK, seeded(forward_seed(w.env.task.seed, w.rnd, w.partition, step), w.env.device):
            outs = self.hooks.forward(w, xb, yb, step)
            loss = self.hooks.local_loss(w, outs, yb, step)
            w.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            w.optimizer.step()
            self.hooks.after_step(w, step)
        return {k: v.detach() for k, v in outs.items()}

    def local_message_step(self, w: Worker, incoming: Envelope, step: int, st: RecordDict) -> Envelope:
        """:meth:`message_step` of a local-loss bottom: step ``s <= I`` trains and sends its streams
        in the same message (no recomputation: no gradient comes back); step ``I + 1`` the final
        reply. Tensors that come down are ignored."""
        if step == 1:
            self.begin(w, incoming, st)
        else:
            self.resume(w, st, step)
        self.check_sizes(w)
        data = self.hooks.data(w)
        if step <= w.iters:
            outs = self.local_step(w, data, step)
            self.keep(w, st, step)
            return Envelope(tensors={k: _to_numpy(v) for k, v in outs.items()})
        return self.finish(w, data, st)

    def local_stream_visit(self, w: Worker, incoming: Envelope, st: RecordDict, client: StreamClient) -> Envelope:
        """:meth:`stream_visit` of a local-loss bottom: the same steps as
        :meth:`local_message_step`, each sent after the server's frame of the step before (in
        lockstep, as over messages); the frames that come down carry no gradients."""
        self.begin(w, incoming, st)
        self.check_sizes(w)
        data = self.hooks.data(w)
        for step in range(1, w.iters + 2):
            if step > 1:
                with _released(COMPUTE_LOCK):
                    header, _ = client.recv()
                if int(header.get("step", -1)) != step or bool(header.get("final")) != (step > w.iters):
                    raise SplitProtocolError(f"split stream: expected step {step}, got header {header}")
            if step <= w.iters:
                outs = self.local_step(w, data, step)
                client.send({"step": step}, {k: _to_numpy(v) for k, v in outs.items()})
        return self.finish(w, data, st)


def _clear_split_state(st: RecordDict) -> None:
    for k in [k for k in st.keys() if k.startswith("split.")]:
        del st[k]


def make_split_handlers(hooks: SplitClientHooks, label_mode: str | None = None) -> dict[str, Any]:
    """ClientApp handlers ``{"split": ..., "split-info": ...}`` driven by ``hooks`` (:class:`SplitWorker`)."""
    return SplitWorker(hooks, label_mode).handlers()
