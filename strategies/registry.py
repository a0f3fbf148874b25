"""Algorithm registry: run-config name -> strategy class, config dataclass, client handlers.

Each algorithm module exposes ``ALGORITHMS: dict[str, AlgorithmSpec]``. Baselines that
differ from an algorithm by a switch are the same module with ``overrides`` (e.g. SCALA's
``ca-sfl``), not copies. Modules are imported lazily: in a deployment every message runs
in a fresh ClientApp process, which then imports only the algorithm it serves.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

from flwr.app import Context, Message

from tasks.config import ConfigError, key_of, parse_dataclass, replace_checked

ClientHandler = Callable[[Message, Context], Message]

# name -> module that defines it. Add a line here when you add an algorithm module.
_MODULES: dict[str, str] = {
    "fedavg": "strategies.fedavg",
    "supervised-only": "strategies.fedavg",
    "umpfssl": "strategies.umpfssl",
    **dict.fromkeys(("fixavg", "fixprox", "fedper-fix", "local-only"), "strategies.fixmatch_baselines"),
    **dict.fromkeys(("scala", "ca-sfl", "lla-sfl", "splitfed-v1", "splitfed-v2"), "strategies.scala"),
    **dict.fromkeys(("fedshvr", "fed-pseudo", "fed-mt", "fed-sl", "fedshvr-no-r1", "fedshvr-no-r2", "fedshvr-no-vr", "fedshvr-no-nova"), "strategies.fedshvr"),
    **dict.fromkeys(("ssfl", "ssfl-selftrain"), "strategies.ssfl"),
    **dict.fromkeys(("semisfl", "semisfl-no-cluster", "semisfl-fixed-ks"), "strategies.semisfl"),
}


# Every query action a node of some algorithm answers (Flower message type ``query.<action>``,
# with ``_`` for ``-``), besides ``train`` and ``evaluate``. A ClientApp registers these with
# ``@app.query(...)`` before any algorithm module is imported (a deployment's ClientApp process
# imports only the algorithm it serves); an AlgorithmSpec with a handler not listed here is refused.
QUERY_ACTIONS: tuple[str, ...] = ("node-info", "split-info", "split", "warmup", "select")


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
    # reply metrics computed from a node's labels: sent only with the node's consent
    # (split_layer.records.label_consent); without it the server records them as not reported
    label_metrics: tuple[str, ...] = ()
    status: str = "implemented"
    description: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.client) - {"train", "evaluate", *QUERY_ACTIONS})
        if unknown:
            raise ValueError(f"algorithm {self.name!r}: client actions {unknown} are not in "
                             f"strategies.registry.QUERY_ACTIONS; add them there")

    def handle(self, msg: Message, context: Context, action: str | None = None) -> Message:
        """Answer one server message on the ClientApp side: the handler of its action
        (Flower's message type: ``train``, ``evaluate``, ``query.<action>``; ``action``
        overrides it), the ``node-info`` query of every algorithm, the algorithm's
        round-to-round node state restored before and saved after
        (:mod:`strategies.node_state`), and no metric of :attr:`label_metrics` in the reply
        without the node's consent."""
        from split_layer.records import (
            EVAL_ACTIONS,
            INFO_ACTIONS,
            NODE_INFO,
            action_of,
            node_info,
            withhold_label_metrics,
        )

        from . import node_state

        action = action or action_of(msg)
        if action == NODE_INFO:  # the server learns partition ids (to sample in that order)
            return node_info(msg, context)
        handler = self.client.get(action)
        if handler is None:
            raise ValueError(f"algorithm '{self.name}' has no client handler for action '{action}'; it has: "
                             f"{', '.join(sorted(self.client)) or 'none'}")
        reply = node_state.handle(handler, msg, context, self.node_state,
                                  persist=action not in INFO_ACTIONS + EVAL_ACTIONS)
        return withhold_label_metrics(reply, self.label_metrics, context)

    @property
    def actions(self) -> list[str]:
        """Every action a node of this algorithm answers (``node-info`` included)."""
        from split_layer.records import NODE_INFO
        return sorted({*self.client, NODE_INFO})

    def build_config(self, cfg: Any, options: dict[str, Any]):
        """The config of a strategy constructed in Python: ``cfg`` (default: the paper's
        defaults) with keyword ``options`` checked and applied, then the variant's fixed
        switches. An option or a ``cfg`` value that contradicts a fixed switch is a
        :class:`ConfigError`, as in :meth:`parse_config`."""
        if self.config_cls is None:
            if options:
                raise TypeError(f"algo={self.name!r} has no options; got {', '.join(sorted(options))}")
            return None
        default = self.config_cls()
        base = cfg if cfg is not None else default
        for name, fixed in self.overrides.items():
            value = options.get(name, getattr(base, name))
            if (name in options or value != getattr(default, name)) and value != fixed:
                raise ConfigError(f"{name}={value!r} contradicts algo={self.name!r}, which fixes {name}={fixed!r} "
                                  f"({self.description or 'a variant'})")
        try:
            out = replace_checked(base, **options)
        except TypeError as e:
            raise TypeError(f"algo={self.name!r}: {e}") from None
        return dataclasses.replace(out, **self.overrides) if self.overrides else out

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


def bind(algorithms: dict[str, AlgorithmSpec]) -> dict[str, AlgorithmSpec]:
    """Give each strategy class of an algorithm module the specs it runs (``cls.specs``,
    its first name first), so that ``Strategy(algo=..., **options)`` builds and checks its
    config from the same specs as the run config. Returns ``algorithms``."""
    for spec in algorithms.values():
        cls = spec.strategy_cls
        if "specs" not in cls.__dict__:
            cls.specs = {}
            cls.__doc__ = _doc(cls)
        cls.specs[spec.name] = spec
    for cls in {s.strategy_cls for s in algorithms.values()}:
        cls.__doc__ += _variants_doc(cls)
    return algorithms


def _doc(cls: type) -> str:
    """A strategy class's docstring for ``help()``: its own, its module's (the paper, the math,
    the client's contract); :func:`_variants_doc` adds its algorithms and keyword options."""
    import sys

    own = (cls.__doc__ or "").strip()
    module = (sys.modules[cls.__module__].__doc__ or "").strip()
    return f"{own}\n\n{module}\n" if module else f"{own}\n"


def _variants_doc(cls: type) -> str:
    from tasks.config import fields_of, range_text

    lines = ["", "Algorithms (``algo=``, the first is the default): "
             + ", ".join(f"``{n}`` ({s.description})" if s.description else f"``{n}``" for n, s in cls.specs.items())]
    config_cls = next(iter(cls.specs.values())).config_cls
    if config_cls is not None:
        lines += ["", "Keyword options (the paper's defaults; run-config keys in docs/config.md):"]
        for f, typ in fields_of(config_cls):
            m = dict(f.metadata)
            rng = f", in {range_text(m)}" if m.get("lo") is not None or m.get("hi") is not None else ""
            choices = f", one of {', '.join(map(str, m['choices']))}" if m.get("choices") else ""
            lines.append(f"    {f.name}={f.default!r}{rng}{choices}: {m.get('help', '')}")
    lines += ["", "Also any ``TaskConfig`` field (``lr``, ``batch_size``, ``local_epochs``, ``local_steps``, "
              "``seed``, ``device``...) and ``RoundPolicy`` field (``fraction_train``, ``min_nodes``, "
              "``round_timeout``...), and ``model``, ``labeled_data``, ``test_data``, ``num_classes``, "
              "``augmenter``, ``flip`` (:class:`split_layer.rounds.SSLStrategy`)."]
    return "\n".join(lines) + "\n"
