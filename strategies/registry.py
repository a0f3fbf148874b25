"""Algorithm registry: run-config name -> strategy class, config dataclass, client handlers.

Each algorithm module exposes ``ALGORITHMS: dict[str, AlgorithmSpec]``. Baselines that
differ from an algorithm by a switch are the same module with ``overrides`` (e.g. SCALA's
``ca-sfl``), not copies. Modules are imported lazily: in a deployment every message runs
in a fresh ClientApp process, which then imports only the algorithm it serves.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, Callable

from flwr.app import Context, Message

from tasks.config import ConfigError, key_of, parse_dataclass

ClientHandler = Callable[[Message, Context], Message]

# name -> module that defines it. Add a line here when you add an algorithm module.
_MODULES: dict[str, str] = {
    "fedavg": "strategies.fedavg",
    "supervised-only": "strategies.fedavg",
    **dict.fromkeys(("umpfssl", "fixavg", "fixprox", "fedper-fix", "local-only"), "strategies.umpfssl"),
    **dict.fromkeys(("scala", "ca-sfl", "lla-sfl", "splitfed-v1", "splitfed-v2"), "strategies.scala"),
    **dict.fromkeys(("fedshvr", "fed-pseudo", "fed-mt", "fed-sl", "fedshvr-no-r1", "fedshvr-no-r2", "fedshvr-no-vr", "fedshvr-no-nova"), "strategies.fedshvr"),
    **dict.fromkeys(("ssfl", "ssfl-selftrain"), "strategies.ssfl"),
    **dict.fromkeys(("semisfl", "semisfl-no-cluster", "semisfl-fixed-ks"), "strategies.semisfl"),
}


@dataclass(frozen=True)
class AlgorithmSpec:
    """Everything the app needs to run one algorithm (or one switch-variant of it)."""

    name: str
    paper: str
    strategy_cls: type
    config_cls: type | None = None
    namespace: str = ""                  # run-config namespace of config_cls keys ("scala")
    overrides: dict[str, Any] = field(default_factory=dict)  # fixed switch values of a variant
    client: dict[str, ClientHandler] = field(default_factory=dict)  # op -> handler
    node_state: tuple[str, ...] = ()     # context.state keys kept from round to round (strategies.node_state)
    status: str = "implemented"
    description: str = ""

    def handle(self, msg: Message, context: Context, op: str | None = None) -> Message:
        """Answer one server message on the ClientApp side, as the library's ClientApp does:
        ``train``/``evaluate`` messages by type, queries by their config ``op``; the
        ``node-info`` query (every algorithm); the algorithm's round-to-round node state
        restored before and saved after (:mod:`strategies.node_state`). A user's own
        ClientApp can route every message of this algorithm here."""
        from . import node_state
        from .common import CONFIG_KEY, EVAL_OPS, INFO_OPS, NODE_INFO_OP, node_info

        cfg = msg.content.config_records.get(CONFIG_KEY)
        kind = msg.metadata.message_type.split(".")[0]
        op = op or (kind if kind in ("train", "evaluate") else str((cfg or {}).get("op", "")))
        if op == NODE_INFO_OP:  # the server learns partition ids (to sample in that order)
            return node_info(msg, context)
        handler = self.client.get(op)
        if handler is None:
            raise ValueError(f"algorithm '{self.name}' has no client handler '{op}'; it has: "
                             f"{', '.join(sorted(self.client)) or 'none'}")
        return node_state.handle(handler, msg, context, self.node_state,
                                 persist=op not in INFO_OPS + EVAL_OPS)

    def parse_config(self, flat: dict[str, Any], explicit: Iterable[str] | None = None):
        """The algorithm config from run-config keys under ``namespace``, variant switches applied.

        A key the user set that contradicts one of the variant's fixed switches is a
        :class:`ConfigError` naming both (``algo='fed-pseudo' fedshvr.correction=true``).
        A key counts as set by the user when it is in ``explicit`` (the run's override
        keys, e.g. ``grid.run.override_config``) or, whatever ``explicit`` says, when its
        value differs from the key's default.
        """
        if self.config_cls is None:
            return None
        cfg = parse_dataclass(self.config_cls, flat, self.namespace)
        if self.overrides:
            given = set(explicit or ())
            default = self.config_cls()
            for name, fixed in self.overrides.items():
                key = key_of(name, self.namespace)
                value = getattr(cfg, name)
                user_set = key in given or (key in flat and value != getattr(default, name))
                if user_set and value != fixed:
                    other = [n for n in algorithm_names() if n != self.name and _MODULES[n] == _MODULES[self.name]
                             and get_algorithm(n).overrides.get(name, value) == value]
                    hint = f", or choose algo {' / '.join(repr(n) for n in other)}" if other else ""
                    raise ConfigError(
                        f"{key}={_show(value)} contradicts algo={self.name!r}, which fixes "
                        f"{key}={_show(fixed)} ({self.description or 'a variant'}): drop the key{hint}")
            cfg = dataclasses.replace(cfg, **self.overrides)
        return cfg


def _show(v: Any) -> str:
    """A value as the user writes it in ``--run-config`` (true, 'text', 1.5)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def algorithm_names() -> list[str]:
    return sorted(_MODULES)


def namespaces() -> dict[str, AlgorithmSpec]:
    """namespace -> one spec using it (to validate keys of every namespace)."""
    out: dict[str, AlgorithmSpec] = {}
    for name in _MODULES:
        spec = get_algorithm(name)
        if spec.namespace:
            out.setdefault(spec.namespace, spec)
    return out


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in _MODULES:
        raise ConfigError(f"algo={name!r} is not one of: {', '.join(algorithm_names())}")
    module = importlib.import_module(_MODULES[name])
    return module.ALGORITHMS[name]
