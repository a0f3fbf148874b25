"""Algorithm registry: run-config name -> strategy class, config dataclass, client handlers.

An algorithm registers itself from its own module: the module defines
``ALGORITHMS = bind({name: AlgorithmSpec(...), ...})`` (and, if its nodes answer queries of
their own, ``QUERY_ACTIONS = ("action", ...)``), and nothing else in the library is edited.
Baselines that differ from an algorithm by a switch are the same module with ``overrides``
(e.g. SCALA's ``ca-sfl``), not copies.

* **The library's own algorithms** (the modules of this package) are found without importing
  them: the registry reads the string keys of each module's ``ALGORITHMS = bind({...})`` and
  its ``QUERY_ACTIONS`` from the source (:func:`library_index`). A module is imported when one
  of its algorithms is asked for, so a deployment's ClientApp process, which serves one
  algorithm per message, imports only that one.
* **An algorithm outside the library** registers when its module is imported (``bind``): a
  user's own Flower app imports it anyway; the library's app imports the modules named in
  the run config's ``algo-modules`` on the server and on every node (:func:`import_modules`).
  Its query actions (if any) are answered by its own ClientApp (``XClient.register(app)``);
  the library's ClientApp routes ``train``, ``evaluate`` and the library's query actions.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from flwr.app import Context, Message

from tasks.config import ConfigError, key_of, parse_dataclass, replace_checked

ClientHandler = Callable[[Message, Context], Message]

_REGISTERED: dict[str, "AlgorithmSpec"] = {}   # name -> spec, filled by bind() when a module is imported
_MODULE_OF: dict[str, str] = {}                 # name -> the module that registered it
_INDEX: tuple[dict[str, str], tuple[str, ...]] | None = None


def library_index() -> tuple[dict[str, str], tuple[str, ...]]:
    """``(name -> module, query actions)`` of the algorithm modules of this package, read from
    their source without importing them: the string keys of ``ALGORITHMS = bind({...})`` and
    the strings of ``QUERY_ACTIONS = (...)``. A module whose ``ALGORITHMS`` is not such a
    literal is imported to learn its names."""
    global _INDEX
    if _INDEX is not None:
        return _INDEX
    names: dict[str, str] = {}
    actions: list[str] = []
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        module = f"{__package__}.{info.name}"
        path = Path(__file__).parent / f"{info.name}.py"
        if info.ispkg or not path.is_file():
            continue
        found, acts, literal = _read_module(path)
        if not literal:   # not the convention: import it (it registers itself)
            importlib.import_module(module)
            found = [n for n, m in _MODULE_OF.items() if m == module]
            acts = list(getattr(sys.modules[module], "QUERY_ACTIONS", ()))
        for n in found:
            names[n] = module
        actions += [a for a in acts if a not in actions]
    _INDEX = (names, tuple(actions))
    return _INDEX


def _read_module(path: Path) -> tuple[list[str], list[str], bool]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names: list[str] = []
    actions: list[str] = []
    literal = True
    dicts: dict[str, list] = {}   # module-level dict literals (a table of variants)
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if len(targets) != 1 or not isinstance(targets[0], ast.Name) or node.value is None:
            continue
        target, value = targets[0].id, node.value
        if isinstance(value, ast.Dict):
            dicts[target] = value.keys
        if target == "ALGORITHMS":
            arg = value.args[0] if isinstance(value, ast.Call) and value.args else None
            keys = arg.keys if isinstance(arg, ast.Dict) else None
            # {name: ... for name, ... in TABLE.items()} over a module-level dict literal
            if (isinstance(arg, ast.DictComp) and len(arg.generators) == 1
                    and isinstance(it := arg.generators[0].iter, ast.Call) and isinstance(it.func, ast.Attribute)
                    and it.func.attr == "items" and isinstance(it.func.value, ast.Name)):
                keys = dicts.get(it.func.value.id)
            if keys is None or not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
                literal = False
            else:
                names += [k.value for k in keys]
        elif target == "QUERY_ACTIONS" and isinstance(value, (ast.Tuple, ast.List)):
            actions += [e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return names, actions, literal


def query_actions() -> tuple[str, ...]:
    """Every query action a node of the library's algorithms answers (Flower message type
    ``query.<action>``, with ``_`` for ``-``), besides ``train`` and ``evaluate``: the one every
    node answers (``node-info``), the split runtime's, and the algorithm modules' own
    ``QUERY_ACTIONS``. The library's ClientApp registers these with Flower's routing."""
    from split_layer.records import NODE_INFO, SPLIT_ACTIONS

    own = library_index()[1]
    return (NODE_INFO, *SPLIT_ACTIONS, *(a for a in own if a not in (NODE_INFO, *SPLIT_ACTIONS)))


def import_modules(modules: str | Iterable[str]) -> None:
    """Import algorithm modules from outside the library (run-config ``algo-modules``: a
    comma-separated list of importable module names); each registers its algorithms."""
    names = [m.strip() for m in modules.split(",")] if isinstance(modules, str) else list(modules)
    for m in names:
        if not m:
            continue
        try:
            importlib.import_module(m)
        except ImportError as e:
            raise ConfigError(f"algo-modules: cannot import {m!r} ({e}); it must be importable on the "
                              f"ServerApp and on every SuperNode") from None


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
        from split_layer.records import NODE_INFO, SPLIT_ACTIONS

        module = sys.modules.get(self.strategy_cls.__module__)
        own = tuple(getattr(module, "QUERY_ACTIONS", ()))
        unknown = sorted(set(self.client) - {"train", "evaluate", NODE_INFO, *SPLIT_ACTIONS, *own})
        if unknown:
            raise ValueError(f"algorithm {self.name!r}: client actions {unknown} are not declared; name them in "
                             f"QUERY_ACTIONS = (...) at the top of {self.strategy_cls.__module__}")

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
            WORK_KEY,
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
        if _counts_work(msg):   # a simulated system is chosen: count this message's FLOPs and steps
            from flwr.app import MetricRecord

            from tasks.system import count_work

            with count_work() as work:
                reply = node_state.handle(handler, msg, context, self.node_state,
                                          persist=action not in INFO_ACTIONS + EVAL_ACTIONS)
            if not reply.has_error():
                reply.content[WORK_KEY] = MetricRecord({"flops": work.flops, "steps": work.steps})
        else:
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
        values = {name: options.get(name, getattr(base, name)) for name in self.overrides}
        self.check_switches(values, {n for n, v in values.items() if n in options or v != getattr(default, n)})
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
            values = {name: getattr(cfg, name) for name in self.overrides}
            key = {name: key_of(name, self.namespace) for name in self.overrides}
            self.check_switches(values, {n for n, v in values.items() if key[n] in given
                                         or (key[n] in flat and v != getattr(default, n))}, run_config=True)
            cfg = dataclasses.replace(cfg, **self.overrides)
        return cfg

    def check_switches(self, values: dict[str, Any], user_set: set[str], run_config: bool = False) -> None:
        """The one check of a variant's fixed switches (:attr:`overrides`) against what the user
        asked for: a switch in ``user_set`` whose value in ``values`` is not the fixed one is a
        :class:`ConfigError` naming both, as a run-config key (``run_config``: ``scala.x=true``,
        with the variants that allow the value) or as a keyword (``x=True``)."""
        for name, fixed in self.overrides.items():
            value = values[name]
            if name not in user_set or value == fixed:
                continue
            key, show, advice = name, repr, ""
            if run_config:
                key, show = key_of(name, self.namespace), _show
                other = [n for n in algorithm_names() if n != self.name and module_of(n) == module_of(self.name)
                         and get_algorithm(n).overrides.get(name, value) == value]
                advice = ": drop the key" + (f", or choose algo {' / '.join(repr(n) for n in other)}" if other else "")
            raise ConfigError(f"{key}={show(value)} contradicts algo={self.name!r}, which fixes {key}={show(fixed)} "
                              f"({self.description or 'a variant'}){advice}")


def _counts_work(msg: Message) -> bool:
    """Whether the server asked this message's work counted (``count-work`` in its config)."""
    from split_layer.records import CONFIG_KEY, COUNT_WORK_KEY

    rec = msg.content.config_records.get(CONFIG_KEY)
    return bool(rec is not None and rec.get(COUNT_WORK_KEY, False))


def _show(v: Any) -> str:
    """A value as the user writes it in ``--run-config`` (true, 'text', 1.5)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def algorithm_names() -> list[str]:
    """Every algorithm: the library's own (:func:`library_index`) and those registered by
    modules imported from outside it."""
    return sorted(set(library_index()[0]) | set(_REGISTERED))


def module_of(name: str) -> str:
    return _MODULE_OF.get(name) or library_index()[0][name]


def namespaces() -> dict[str, AlgorithmSpec]:
    """namespace -> one spec using it (to validate keys of every namespace)."""
    out: dict[str, AlgorithmSpec] = {}
    for name in algorithm_names():
        spec = get_algorithm(name)
        if spec.namespace:
            out.setdefault(spec.namespace, spec)
    return out


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in _REGISTERED:
        module = library_index()[0].get(name)
        if module is None:
            raise ConfigError(f"algo={name!r} is not one of: {', '.join(algorithm_names())} (an algorithm "
                              f"outside the library: name its module in algo-modules)")
        importlib.import_module(module)
        if name not in _REGISTERED:
            raise ConfigError(f"module {module} did not register algo={name!r}")
    return _REGISTERED[name]


def algorithm_for(msg: Message, served: dict[str, Any] | None = None, who: str = "this ClientApp",
                  context: Context | None = None) -> Any:
    """The one lookup of the algorithm a server message names (``config["algo"]``, which every
    message carries): ``served[name]`` (what a client serves: specs, or one client per
    algorithm), or with ``served=None`` the registry's :class:`AlgorithmSpec` (an algorithm
    from outside the library is imported first from ``context``'s run config ``algo-modules``).
    A message without ``algo`` or naming another algorithm is a ``ValueError`` (a
    ``ConfigError`` from the registry) that names what is served."""
    from split_layer.records import CONFIG_KEY

    cfg = msg.content.config_records.get(CONFIG_KEY)
    if cfg is None or "algo" not in cfg:
        raise ValueError(f"malformed message: no '{CONFIG_KEY}' record with an 'algo' entry")
    algo = str(cfg["algo"])
    if served is None:
        if algo not in algorithm_names() and context is not None:
            import_modules(str((context.run_config or {}).get("algo-modules", "")))
        return get_algorithm(algo)
    if algo not in served:
        raise ValueError(f"{who} serves algo {', '.join(sorted(served))}; the message asks for algo={algo!r}")
    return served[algo]


def unregister(*names: str) -> None:
    """Forget algorithms registered from outside the library (tests)."""
    for n in names:
        _REGISTERED.pop(n, None)
        _MODULE_OF.pop(n, None)


def bind(algorithms: dict[str, AlgorithmSpec]) -> dict[str, AlgorithmSpec]:
    """Register an algorithm module's algorithms (call it as ``ALGORITHMS = bind({...})`` at
    the module's top level), and give each strategy class the specs it runs (``cls.specs``,
    its first name first), so that ``Strategy(algo=..., **options)`` builds and checks its
    config from the same specs as the run config. Returns ``algorithms``."""
    for name, spec in algorithms.items():
        if name != spec.name:
            raise ValueError(f"ALGORITHMS key {name!r} names a spec of algo={spec.name!r}")
        owner = _MODULE_OF.get(name)
        module = sys._getframe(1).f_globals.get("__name__", spec.strategy_cls.__module__)
        if owner is not None and owner != module:
            raise ValueError(f"algo={name!r} is registered by {owner} already; {module} registers it again")
        _REGISTERED[name], _MODULE_OF[name] = spec, module
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
              "``augmenter``, ``flip`` (:class:`strategies.base.BaseStrategy`)."]
    return "\n".join(lines) + "\n"
