"""The Flower plumbing every algorithm shares: record names, conversions, actions, node env.

* Record names of every message (:data:`TASK_KEY`, :data:`ALGO_KEY`, :data:`CONFIG_KEY`,
  :data:`ARRAYS_KEY`, :data:`METRICS_KEY`).
* The one state-dict <-> ``ArrayRecord`` conversion (:func:`model_to_record`,
  :func:`numpy_to_record`, :func:`record_to_numpy`; into a model:
  :func:`tasks.training.load_numpy_state`).
* Actions: a message's action is its Flower message type: ``train``, ``evaluate``, or
  ``query.<action>`` (Flower's own routing, ``@app.query("<action>")``). The library names
  its actions with hyphens (``node-info``); on the wire they are identifiers
  (``query.node_info``): :func:`message_type` and :func:`action_of` convert.
* Replies: :func:`describe_error` (the real exception of a ClientApp's error reply) and
  :func:`metric_safe` (what a ``MetricRecord`` accepts).
* Consent: :func:`label_consent`, the node's own decision whether metrics computed from
  its labels may leave it (node config ``share-label-metrics``), and
  :func:`withhold_label_metrics`, which every reply passes through
  (:meth:`strategies.registry.AlgorithmSpec.handle`).
* The node side: :func:`node_partition` (node config), :func:`node_info` (the one
  partition-id query, ``query.node_info``) and :func:`client_env`, the node's
  :class:`tasks.env.Env`: the user's model and data inside :func:`node_source`
  (:class:`strategies.client.AlgorithmClient`), else the library's data named by the
  message's ``task`` record.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import re
from typing import Any, Callable, Iterator

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from tasks.config import ConfigError, TaskConfig, parse_dataclass, to_flat
from tasks.env import Env, library_env

TASK_KEY = "task"        # ConfigRecord: the flat TaskConfig
ALGO_KEY = "algo"        # ConfigRecord: the flat algorithm config
CONFIG_KEY = "config"    # ConfigRecord: per-message values (server-round, algo, ...)
ARRAYS_KEY = "arrays"    # ArrayRecord: model weights
METRICS_KEY = "metrics"  # MetricRecord: reply metrics
WORK_KEY = "work"        # MetricRecord of a reply: the FLOPs and optimizer steps the node ran (flops, steps)
COUNT_WORK_KEY = "count-work"   # message config: count them (a simulated system is chosen; tasks.system)

# node config: may this node report metrics computed from its labels? (off by default)
LABEL_CONSENT_KEY = "share-label-metrics"
LABEL_CONSENT_ENV = "FLOWER_SSL_SHARE_LABEL_METRICS"   # the same decision where a node has no node config

NODE_INFO = "node-info"  # the query every node answers (see node_info)
# actions that ask a node about itself (no user config, node state not saved; a layer above adds
# its own: a strategy's ``info_actions``) and actions that evaluate (evaluate_config, node state
# not saved); every other action trains
INFO_ACTIONS = (NODE_INFO,)
EVAL_ACTIONS = ("evaluate",)
_CATEGORIES = ("train", "evaluate", "query")


# --------------------------------------------------------------------------- actions
def message_type(action: str) -> str:
    """The Flower message type of a library action: ``train``/``evaluate`` as they are, any
    other action ``query.<action with _ for ->``."""
    if action in ("train", "evaluate"):
        return action
    name = action.replace("-", "_")
    if not name.isidentifier():
        raise ValueError(f"action {action!r} is not a name Flower can route")
    return f"query.{name}"


def action_of(msg: Message) -> str:
    """The library action of a received message (the inverse of :func:`message_type`);
    ``query`` without an action is ``""``."""
    category, _, action = msg.metadata.message_type.partition(".")
    if category not in _CATEGORIES:
        raise ValueError(f"message type {msg.metadata.message_type!r} is not one of train, evaluate, query.<action>")
    if category != "query":
        return category if action in ("", "default") else f"{category}.{action}"
    return action.replace("_", "-")


def query(content: RecordDict, node: int, action: str, group_id: str = "") -> Message:
    """A query message for ``action`` to ``node``."""
    return Message(content, dst_node_id=node, message_type=message_type(action), group_id=group_id)


# --------------------------------------------------------------------------- records
def model_to_record(model: torch.nn.Module, keys: list[str] | None = None) -> ArrayRecord:
    sd = model.state_dict()
    return state_to_record(sd if keys is None else {k: sd[k] for k in keys})


def state_to_record(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A dict of tensors (a state dict, optimizer buffers) as an ArrayRecord (copied to the CPU)."""
    return numpy_to_record({k: v.detach().cpu().numpy() for k, v in state.items()})


def numpy_to_record(state: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v if v.flags.c_contiguous else v.copy(order="C"))
                        for k, v in state.items()})


def record_to_numpy(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: rec[k].numpy() for k in rec.keys()}


def task_record(task: TaskConfig) -> ConfigRecord:
    return ConfigRecord(to_flat(task))


def task_from_record(rec: ConfigRecord) -> TaskConfig:
    return parse_dataclass(TaskConfig, dict(rec), strict=False)


def algo_record(msg: Message) -> dict[str, Any]:
    """The flat algorithm config a message carries (``{}`` if none)."""
    rec = msg.content.config_records.get(ALGO_KEY)
    return dict(rec) if rec is not None else {}


def algo_config(source: Message | dict[str, Any], cls: type):
    """The algorithm's config dataclass ``cls`` from a message's ``algo`` record (or its flat
    dict): the client parses what the server sent into the same dataclass, with the same checks."""
    flat = algo_record(source) if isinstance(source, Message) else dict(source)
    return parse_dataclass(cls, flat, strict=False)


# --------------------------------------------------------------------------- consent
def label_consent(node_config: Any) -> bool:
    """The node's own decision, off by default, whether anything it computes from its labels
    (pseudo-label accuracy, error counts, per-class counts) may leave it: node config
    ``share-label-metrics``, else the environment variable ``FLOWER_SSL_SHARE_LABEL_METRICS``
    of its ClientApp process (Flower's simulation gives nodes no node config of their own)."""
    v = node_config.get(LABEL_CONSENT_KEY, os.environ.get(LABEL_CONSENT_ENV, "false"))
    return v is True or str(v).strip().lower() in ("true", "1", "yes")


def consented_share(metrics: list[Any], hits: str, total: str) -> tuple[int, float | None]:
    """The server's half of :func:`label_consent`: over the replies' metric records, how many
    nodes reported the label-derived count ``hits`` (only those that consented send it), and
    ``sum(hits) / sum(total)`` over those nodes (``None`` when none did or ``total`` sums to 0:
    the metric is then not reported, never 0)."""
    told = [m for m in metrics if hits in m]
    den = sum(float(m[total]) for m in told)
    return len(told), (sum(float(m[hits]) for m in told) / den if den > 0 else None)


def withhold_label_metrics(reply: Message, names: tuple[str, ...] | frozenset[str], context: Context) -> Message:
    """``reply`` without the metrics ``names`` (those an algorithm computes from a node's
    labels) unless the node consents (:func:`label_consent`); the server then records them
    as not reported. Every reply of every algorithm passes here."""
    if not names or reply.has_error() or label_consent(context.node_config):
        return reply
    for rec in reply.content.metric_records.values():
        for k in [k for k in rec.keys() if k in names]:
            del rec[k]
    return reply


# --------------------------------------------------------------------------- the node side
def node_partition(context: Context, required: bool = True) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config, validated. A node without them,
    when not ``required`` (a user's node with its own data), is ``(node id mod 2^31, 0)``: an id
    that seeds its draws and orders its sampling, in no partition of a known count."""
    nc = context.node_config
    if not required and "partition-id" not in nc:
        return int(context.node_id) % (1 << 31), 0
    try:
        pid, n = int(nc["partition-id"]), int(nc["num-partitions"])
    except (KeyError, ValueError) as e:
        raise ConfigError(
            "this SuperNode has no usable node config: start it with "
            "--node-config \"partition-id=<i> num-partitions=<n>\"") from e
    if not 0 <= pid < n:
        raise ConfigError(f"node config partition-id={pid} is outside [0, num-partitions={n})")
    return pid, n


def node_info(msg: Message, context: Context) -> Message:
    """Reply to the ``node-info`` query: this node's partition id (the server samples in partition
    order, so that runs repeat although simulated node ids are random)."""
    pid, n = node_partition(context, required=_NODE_SOURCE.get() is None)
    return Message(RecordDict({CONFIG_KEY: ConfigRecord({"partition-id": pid, "num-partitions": n})}),
                   reply_to=msg)


# a user's node: (context, task, num_classes) -> Env, set by node_source for one message
_NODE_SOURCE: contextvars.ContextVar[Callable[[Context, TaskConfig, int | None], Env] | None] = \
    contextvars.ContextVar("flower_ssl_node_source", default=None)


@contextlib.contextmanager
def node_source(source: Callable[[Context, TaskConfig, int | None], Env]) -> Iterator[None]:
    """Within this block, :func:`client_env` returns ``source(context, task, num_classes)``
    (``num_classes``: the server's, from the message config): the node's Env built from the
    user's model and data instead of the library's named dataset."""
    token = _NODE_SOURCE.set(source)
    try:
        yield
    finally:
        _NODE_SOURCE.reset(token)


def client_env(msg: Message, context: Context, label_mode: str, with_test: bool = False) -> Env:
    """The node's environment for one message.

    A user's node (inside :func:`node_source`): its own model and data. The library's node:
    rebuilt from the message's ``task`` record and the node config (``partition-id``,
    ``num-partitions``, and ``data-path``, a node's own copy of the run's dataset,
    docs/deployment.md), partitioned by ``label_mode`` as the server does."""
    task = task_from_record(msg.content.config_records[TASK_KEY])
    source = _NODE_SOURCE.get()
    if source is not None:
        cfg = msg.content.config_records.get(CONFIG_KEY)
        n = cfg.get("num-classes") if cfg is not None else None
        return source(context, task, int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None)
    pid, n = node_partition(context)
    return library_env(task, n, label_mode, with_test, pid, str(context.node_config.get("data-path", "")))


# --------------------------------------------------------------------------- replies
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


def metric_safe(d: dict[str, Any]) -> dict[str, Any]:
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
