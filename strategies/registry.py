"""Algorithm registry: run-config name -> strategy class, config dataclass, client handlers.

An algorithm module registers its algorithms when it is imported, by one call at its top level::

    ALGORITHMS = register({"my-algo": AlgorithmSpec(name="my-algo", strategy_cls=MyStrategy, ...)})

Every algorithm reaches the registry that way, by an ordinary import of its module:

* **the library's own**: :func:`load` imports every module of the ``strategies`` package
  (found from the package's folder: adding a module adds its algorithms, no list is
  edited);
* **an installed package's**: a package declares its algorithm modules as Python entry points
  of the group :data:`ENTRY_POINT_GROUP` in its ``pyproject.toml``::

      [project.entry-points."flower_ssl.algorithms"]
      my-algo = "my_package.my_algo"

  and :func:`load` imports each of them (:func:`importlib.metadata.entry_points`), on the
  ServerApp and in every ClientApp process, as Flower's own plugins are found;
* **a module that is not an installed package** (a file on the path of the ServerApp and of
  every SuperNode): the run config's ``algo-modules`` names it (:func:`import_modules`).

A node's query actions (Flower message type ``query.<action>``) are the keys of the
registered specs' ``client`` handlers besides ``train`` and ``evaluate``
(:func:`query_actions`): the library's ClientApp registers each with Flower's routing, its
entry-point plugins' included. Registering gives each strategy class the specs it runs
(``cls.specs``, its first the default ``algo=``) and a signature with the defaults of that
first algorithm (``cls.__signature__``: ``help(CSSFLStrategy)`` shows CS-SFL's own switches).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from flwr.app import Context, Message

from tasks.config import ConfigError, key_of, parse_dataclass, replace_checked

__all__ = ["ENTRY_POINT_GROUP", "AlgorithmSpec", "register", "load", "load_entry_points", "import_modules",
           "algorithm_names", "get_algorithm", "algorithm_for", "query_actions", "namespaces", "module_of",
           "wrong_algo", "unregister"]

ClientHandler = Callable[[Message, Context], Message]

#: the entry-point group an installed package declares its algorithm modules under
ENTRY_POINT_GROUP = "flower_ssl.algorithms"

_REGISTERED: dict[str, "AlgorithmSpec"] = {}   # name -> spec, in the order registered
_LOADED = False                                # load() ran in this process


def register(algorithms: dict[str, AlgorithmSpec]) -> dict[str, AlgorithmSpec]:
    """Register an algorithm module's algorithms (``ALGORITHMS = register({...})`` at the
    module's top level; the keys are the specs' names) and give each strategy class the specs
    it runs (``cls.specs``, its first name first, so that ``Strategy(algo=..., **options)``
    builds and checks its config from the same specs as the run config) and the signature of
    its first one (:func:`signature_of`). A name registered by another module is a
    ``ValueError``; the same module imported again replaces its own. Returns ``algorithms``."""
    for name, spec in algorithms.items():
        if name != spec.name:
            raise ValueError(f"ALGORITHMS key {name!r} names a spec of algo={spec.name!r}")
        old = _REGISTERED.get(name)
        module = spec.strategy_cls.__module__
        if old is not None and old.strategy_cls.__module__ != module:
            raise ValueError(f"algo={name!r} is registered by {old.strategy_cls.__module__} already; "
                             f"{module} registers it again")
        _REGISTERED[name] = spec
        cls = spec.strategy_cls
        if "specs" not in cls.__dict__:
            cls.specs = {}
        cls.specs[name] = spec
    for cls in {s.strategy_cls for s in algorithms.values()}:
        cls.__signature__ = signature_of(cls)
    return algorithms


def signature_of(cls: type) -> inspect.Signature:
    """The constructor signature ``help(cls)`` shows: ``cls.__init__``'s, with ``algo`` defaulting
    to the class's first algorithm and that algorithm's config fields as keyword options with
    the values it runs with (the config's defaults, the variant's fixed switches applied). An
    ``__init__(self, *args, <keywords>, **kwargs)`` that passes the rest on adds its keywords
    to its parent's."""
    own: list[inspect.Parameter] = []   # keywords of __init__s that pass the rest on
    for owner in cls.__mro__:
        if "__init__" not in owner.__dict__:
            continue
        sig = inspect.signature(owner.__init__)
        params = list(sig.parameters.values())[1:]   # (self)
        kinds = {p.kind for p in params}
        if not {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
            break
        own += [p for p in params if p.kind is p.KEYWORD_ONLY and p.name not in {q.name for q in own}]
    first = next(iter(cls.specs.values()))
    params = [p.replace(default=first.name) if p.name == "algo" else p for p in params]
    var_kw = [p for p in params if p.kind is p.VAR_KEYWORD]
    out = [p for p in params if p.kind is not p.VAR_KEYWORD]
    out += [p for p in own if p.name not in {q.name for q in out}]
    if first.config_cls is not None and var_kw:
        from tasks.config import fields_of, range_text

        taken = {p.name for p in out}
        cfg = first.config_cls()
        for f, typ in fields_of(first.config_cls):
            if f.init and f.name not in taken:
                m = dict(f.metadata)   # the knob's type, range and choices (tasks.config.knob)
                kind = getattr(typ, "__name__", str(typ))
                if m.get("lo") is not None or m.get("hi") is not None:
                    kind += f" in {range_text(m)}"
                if m.get("choices"):
                    kind += f", one of {', '.join(map(str, m['choices']))}"
                out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                             default=first.overrides.get(f.name, getattr(cfg, f.name))))
    return sig.replace(parameters=out + var_kw)


def wrong_algo(owner: str, algo: str, runs: Iterable[str]) -> ConfigError:
    """The error for ``Owner(algo=algo)`` where ``owner`` runs only ``runs``: it names the
    class that runs ``algo`` (or the algorithms there are)."""
    load()
    spec = _REGISTERED.get(algo)
    fix = (f"algo={algo!r} is run by {spec.strategy_cls.__name__} (from {spec.strategy_cls.__module__} "
           f"import {spec.strategy_cls.__name__})" if spec is not None
           else f"the algorithms are: {', '.join(algorithm_names())}")
    return ConfigError(f"algo={algo!r} is not run by {owner}; it runs: {', '.join(runs)}; {fix}")


def load() -> None:
    """Register every algorithm there is, once per process: the modules of the ``strategies``
    package, then the modules installed packages declare under :data:`ENTRY_POINT_GROUP`."""
    global _LOADED
    if _LOADED:
        return
    for name in _package_modules():
        importlib.import_module(name)
    load_entry_points()
    _LOADED = True


def _package_modules() -> list[str]:
    """Every module of the ``strategies`` package, from its folder's files (not through
    :func:`pkgutil.walk_packages`, which found no module in the ClientApp process of the runtime
    environment a SuperLink makes for a run: ``tests/test_cli_run.py``)."""
    names: list[str] = []
    for root in map(Path, sys.modules[__package__].__path__):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if any(not (root.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
                continue   # (a folder that is not a package)
            names.append(".".join((__package__, *parts[:-1])) if parts[-1] == "__init__"
                         else ".".join((__package__, *parts)))
    return [n for n in dict.fromkeys(names) if n != __package__]


def load_entry_points() -> list[str]:
    """Import the module of every entry point of :data:`ENTRY_POINT_GROUP` (each registers its
    algorithms); returns the entry points' names. :func:`load` calls it once per process; call
    it again for a package installed since. One that cannot be imported is a ``ConfigError``
    naming it and its package."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    for ep in eps:
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001 - any error of a plugin's import: name the plugin
            dist = getattr(ep, "dist", None)
            where = f" of package {dist.name} {dist.version}" if dist is not None else ""
            raise ConfigError(f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP}){where}: "
                              f"cannot import it ({type(e).__name__}: {e})") from e
    return [ep.name for ep in eps]


def import_modules(modules: str | Iterable[str]) -> None:
    """Import algorithm modules that are not installed packages (run-config ``algo-modules``: a
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


def query_actions() -> tuple[str, ...]:
    """Every query action a node answers besides ``train`` and ``evaluate`` (Flower message
    type ``query.<action>``, with ``_`` for ``-``): ``node-info`` (every node), then those of
    the registered algorithms' client handlers, sorted. The library's ClientApp registers these
    with Flower's routing."""
    from strategies.core.records import NODE_INFO

    load()
    own = {a for s in _REGISTERED.values() for a in s.client} - {"train", "evaluate", NODE_INFO}
    return (NODE_INFO, *sorted(own))


@dataclass(frozen=True, repr=False)
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
    # (strategies.core.records.label_consent); without it the server records them as not reported
    label_metrics: tuple[str, ...] = ()
    status: str = "implemented"
    description: str = ""

    def __post_init__(self) -> None:
        from strategies.core.records import message_type

        for action in self.client:   # (Flower routes query.<name>: a name it cannot route is refused now)
            try:
                message_type(action)
            except ValueError as e:
                raise ValueError(f"algorithm {self.name!r}: client {e}") from None

    def __repr__(self) -> str:   # (help() of a strategy class lists its specs: one line each)
        fixed = ", ".join(f"{k}={v!r}" for k, v in self.overrides.items())
        return (f"<algo {self.name!r}: {self.description or self.paper}"
                + (f"; fixes {fixed}" if fixed else "") + ">")

    def handle(self, msg: Message, context: Context, action: str | None = None) -> Message:
        """Answer one server message on the ClientApp side: the handler of its action
        (Flower's message type: ``train``, ``evaluate``, ``query.<action>``; ``action``
        overrides it), the ``node-info`` query of every algorithm, the algorithm's
        round-to-round node state restored before and saved after
        (:mod:`strategies.node_state`), and no metric of :attr:`label_metrics` in the reply
        without the node's consent."""
        from strategies.core.records import (
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
                                          persist=action not in self.quiet_actions)
            if not reply.has_error():
                reply.content[WORK_KEY] = MetricRecord({"flops": work.flops, "steps": work.steps,
                                                        "recompute-flops": work.recompute_flops})
        else:
            reply = node_state.handle(handler, msg, context, self.node_state,
                                      persist=action not in self.quiet_actions)
        return withhold_label_metrics(reply, self.label_metrics, context)

    @property
    def quiet_actions(self) -> tuple[str, ...]:
        """Actions after which a node's state is not saved: those that ask a node about itself
        (the strategy's ``info_actions``: ``node-info``, a split node's ``split-info``) and
        evaluation."""
        from strategies.core.records import EVAL_ACTIONS, INFO_ACTIONS
        return (*getattr(self.strategy_cls, "info_actions", INFO_ACTIONS), *EVAL_ACTIONS)

    @property
    def actions(self) -> list[str]:
        """Every action a node of this algorithm answers (``node-info`` included)."""
        from strategies.core.records import NODE_INFO
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
                other = [n for n in algorithm_names() if n != self.name
                         and get_algorithm(n).namespace == self.namespace
                         and get_algorithm(n).overrides.get(name, value) == value]
                advice = ": drop the key" + (f", or choose algo {' / '.join(repr(n) for n in other)}" if other else "")
            raise ConfigError(f"{key}={show(value)} contradicts algo={self.name!r}, which fixes {key}={show(fixed)} "
                              f"({self.description or 'a variant'}){advice}")


def _counts_work(msg: Message) -> bool:
    """Whether the server asked this message's work counted (``count-work`` in its config)."""
    from strategies.core.records import CONFIG_KEY, COUNT_WORK_KEY

    rec = msg.content.config_records.get(CONFIG_KEY)
    return bool(rec is not None and rec.get(COUNT_WORK_KEY, False))


def _show(v: Any) -> str:
    """A value as the user writes it in ``--run-config`` (true, 'text', 1.5)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def algorithm_names() -> list[str]:
    """Every registered algorithm (:func:`load`; and those of ``algo-modules`` imported)."""
    load()
    return sorted(_REGISTERED)


def module_of(name: str) -> str:
    """The module of the strategy class that runs ``name``."""
    return get_algorithm(name).strategy_cls.__module__


def namespaces() -> dict[str, AlgorithmSpec]:
    """namespace -> one spec using it (to validate keys of every namespace)."""
    out: dict[str, AlgorithmSpec] = {}
    for name in algorithm_names():
        spec = get_algorithm(name)
        if spec.namespace:
            out.setdefault(spec.namespace, spec)
    return out


def get_algorithm(name: str) -> AlgorithmSpec:
    load()
    if name not in _REGISTERED:
        raise ConfigError(f"algo={name!r} is not one of: {', '.join(algorithm_names())} (an algorithm outside "
                          f"the library: install a package that declares its module under the entry-point group "
                          f"{ENTRY_POINT_GROUP!r}, or name its module in algo-modules)")
    return _REGISTERED[name]


def algorithm_for(msg: Message, served: dict[str, Any] | None = None, who: str = "this ClientApp",
                  context: Context | None = None) -> Any:
    """The one lookup of the algorithm a server message names (``config["algo"]``, which every
    message carries): ``served[name]`` (what a client serves: specs, or one client per
    algorithm), or with ``served=None`` the registry's :class:`AlgorithmSpec` (an algorithm
    from a module that is not installed is imported first from ``context``'s run config
    ``algo-modules``). A message without ``algo`` or naming another algorithm is a
    ``ValueError`` (a ``ConfigError`` from the registry) that names what is served."""
    from strategies.core.records import CONFIG_KEY

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
    """Forget registered algorithms (tests of modules from outside the library)."""
    for n in names:
        spec = _REGISTERED.pop(n, None)
        if spec is not None:
            spec.strategy_cls.__dict__.get("specs", {}).pop(n, None)
