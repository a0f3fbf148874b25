"""One typed parser for the whole run config, run before any training starts.

Keys without a dot belong to :class:`AppConfig` (how the run is driven) or to
:class:`tasks.config.TaskConfig` (data, partition, model, optimisation). Keys with a dot
belong to an algorithm namespace (``scala.local-iterations``) and are validated by that
algorithm's config dataclass. Anything unknown, mistyped or out of range raises
:class:`tasks.config.ConfigError` naming the key and listing what is allowed.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strategies.core.round_policy import RoundPolicy
from split_layer.split_policy import SplitPolicy
from split_layer.stream_options import StreamOptions, stream_knobs
from strategies.registry import (
    AlgorithmSpec,
    algorithm_names,
    get_algorithm,
    import_modules,
    namespaces,
)
from tasks.config import (
    ConfigError,
    TaskConfig,
    fields_of,
    key_of,
    knob,
    knob_of,
    parse_dataclass,
)

STREAM_FIELD = "split_stream_"   # AppConfig's field of StreamOptions' knob ``x``: split_stream_x


@dataclass
class AppConfig:
    """How the run is driven (not sent to clients)."""

    algo: str = knob("semisfl", help="which algorithm to run (see README table)")
    algo_modules: str = knob("", help="comma-separated modules outside the library, not installed as packages, "
                                      "that register algorithms (strategies.registry.register); imported on the "
                                      "ServerApp and on every node (an installed package declares them as entry "
                                      "points of the group flower_ssl.algorithms instead)")
    num_rounds: int = knob(4, lo=1, help="communication rounds")
    eval_every: int = knob_of(RoundPolicy, "eval_every")
    stop_accuracy: float = knob_of(RoundPolicy, "stop_accuracy")
    fraction_train: float = knob_of(RoundPolicy, "fraction_train")
    min_nodes: int = knob_of(RoundPolicy, "min_nodes")
    round_timeout: float = knob_of(RoundPolicy, "round_timeout")
    max_in_flight: int = knob_of(RoundPolicy, "max_in_flight")
    startup_timeout: float = knob_of(RoundPolicy, "startup_timeout")
    wait_for_nodes: float = knob_of(RoundPolicy, "wait_for_nodes")
    payload_bound: float = knob_of(RoundPolicy, "payload_bound")
    upload_norm_bound: float = knob_of(RoundPolicy, "upload_norm_bound")
    loss_bound: float = knob_of(RoundPolicy, "loss_bound")
    upload_weight: str = knob_of(RoundPolicy, "upload_weight")
    results_dir: str = knob("results", help="parent folder of run folders; relative paths resolve against $FLOWER_SSL_HOME, else the ServerApp working directory (the folder the local SuperLink was started from)")
    run_name: str = knob("", help="run folder name ('' = <algo>-<timestamp>)")
    resume: bool = knob(False, help="continue the run folder's last completed round")
    split_transport: str = knob_of(SplitPolicy, "split_transport")
    system: str = knob_of(RoundPolicy, "system")
    # the split-stream-* keys: StreamOptions' knobs (their defaults, allowed values, help and rules)
    split_stream_host: str = knob_of(StreamOptions, "host")
    split_stream_advertise: str = knob_of(StreamOptions, "advertise")
    split_stream_port: int = knob_of(StreamOptions, "port")
    split_stream_tls: str = knob_of(StreamOptions, "tls")
    split_stream_session: str = knob_of(StreamOptions, "session")
    split_stream_allow_plaintext: bool = knob_of(StreamOptions, "allow_plaintext")

    def stream_options(self) -> StreamOptions:
        """The stream transport's options (:class:`split_layer.stream_options.StreamOptions`: its
        rules are checked there, once), with the run's ``round-timeout`` as every wait."""
        return StreamOptions(timeout=self.round_timeout,
                             **{f.name: getattr(self, STREAM_FIELD + f.name) for f, _ in stream_knobs()})

    def policy(self) -> RoundPolicy:
        """The round policy these keys choose (every :class:`RoundPolicy` field of the same name)."""
        names = {f.name for f, _ in fields_of(RoundPolicy)}
        return RoundPolicy(**{n: getattr(self, n) for n in names if hasattr(self, n)})

    def split_policy(self) -> SplitPolicy:
        """A split algorithm's options these keys choose: ``split-transport`` and the stream's."""
        return SplitPolicy(split_transport=self.split_transport, stream=self.stream_options())

    def validate(self) -> None:
        if self.algo not in algorithm_names():
            raise ConfigError(f"algo={self.algo!r} is not one of: {', '.join(algorithm_names())}")
        if self.resume and not self.run_name:
            raise ConfigError("resume=true needs run-name='<the run folder to continue>'")
        if self.split_transport in ("stream", "auto"):  # the stream's own rules (one place: StreamOptions)
            try:
                self.stream_options()
            except ValueError as e:
                raise ConfigError(str(e)) from None
        # system: a preset, a readable TOML file, or none (else a ConfigError naming the key); its rule
        # with split-transport is the split policy's (one place)
        RoundPolicy(system=self.system).validate()
        SplitPolicy(split_transport=self.split_transport).check_with(self.system)
        if "/" in self.run_name or "\\" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError(f"run-name={self.run_name!r} must be a plain folder name (no '/'); "
                              f"put the parent folder in results-dir")


@dataclass
class ParsedConfig:
    app: AppConfig
    task: TaskConfig
    spec: AlgorithmSpec
    algo: Any  # the algorithm's config dataclass instance (or None)


def _top_level_keys() -> list[str]:
    return sorted({key_of(f.name) for cls in (AppConfig, TaskConfig) for f, _ in fields_of(cls)})


def parse_run_config(raw: dict[str, Any], explicit: Iterable[str] | None = None) -> ParsedConfig:
    """Validate a flat Flower run config and return typed configs.

    ``explicit``: the keys the user set (the run's override config), so that a key that
    contradicts the chosen variant's fixed switches is an error even at its default value
    (:meth:`strategies.registry.AlgorithmSpec.parse_config`)."""
    flat = dict(raw)
    if isinstance(flat.get("algo-modules", ""), str):   # (a wrong type is the typed parser's error below)
        import_modules(flat.get("algo-modules", ""))   # algorithms from outside the library register now
    allowed_top = _top_level_keys()
    spaces = namespaces()
    for k in flat:
        if "." in k:
            ns = k.split(".", 1)[0]
            if ns not in spaces:
                raise ConfigError(f"unknown run-config namespace in '{k}'; namespaces: {', '.join(sorted(spaces))}")
        elif k not in allowed_top:
            close = [a for a in allowed_top if a[:4] == k[:4]]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown run-config key '{k}'{hint}; allowed keys: {', '.join(allowed_top)}")
    app = parse_dataclass(AppConfig, flat, strict=False)
    task = parse_dataclass(TaskConfig, flat, strict=False)
    # validate every namespace present (typos in another algorithm's keys are errors too)
    for ns, spec in spaces.items():
        if any(k.startswith(ns + ".") for k in flat):
            parse_dataclass(spec.config_cls, flat, ns)
    spec = get_algorithm(app.algo)
    if app.split_transport == "stream":
        from strategies.split_base import SplitStrategy

        if not issubclass(spec.strategy_cls, SplitStrategy):
            split_algos = [n for n in algorithm_names() if issubclass(get_algorithm(n).strategy_cls, SplitStrategy)]
            raise ConfigError(f"split-transport={app.split_transport!r} applies to split algorithms only "
                              f"({', '.join(split_algos)}); algo={app.algo!r} exchanges whole models over "
                              f"Flower messages: drop the key or set split-transport='message'")
    algo_cfg = spec.parse_config(flat, explicit)
    return ParsedConfig(app, task, spec, algo_cfg)


def keys_markdown() -> str:
    """A markdown table of every run-config key: default, allowed values, meaning."""
    from tasks.config import range_text

    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]

    def add(cls, prefix=""):
        for f, typ in fields_of(cls):
            m = dict(f.metadata)
            if m.get("choices"):
                allowed = ", ".join(map(str, m["choices"]))
            elif typ in (int, float) and (m.get("lo") is not None or m.get("hi") is not None):
                allowed = range_text(m)
            else:
                allowed = typ.__name__
            default = f"'{f.default}'" if isinstance(f.default, str) else str(f.default).lower() \
                if isinstance(f.default, bool) else str(f.default)
            rows.append(f"| `{key_of(f.name, prefix)}` | `{default}` | {allowed} | {m.get('help', '')} |")

    add(AppConfig)
    add(TaskConfig)
    for ns, spec in sorted(namespaces().items()):
        add(spec.config_cls, ns)
    return "\n".join(rows)


def _spans(names: list[str]) -> str:
    """``conv1, conv2, conv3, conv4`` as ``conv1 .. conv4`` (runs of 3 or more numbered names)."""
    import re

    out: list[list[tuple[str, int]]] = []
    for n in names:
        m = re.fullmatch(r"(.*?)(\d+)", n)
        stem, i = (m.group(1), int(m.group(2))) if m else (n, -1)
        if m and out and out[-1][-1][0] == stem and out[-1][-1][1] == i - 1:
            out[-1].append((stem, i))
        else:
            out.append([(stem, i)])
    return ", ".join(f"{g[0][0]}{g[0][1]} .. {g[-1][0]}{g[-1][1]}" if len(g) >= 3 else
                     ", ".join(f"{s}{i}" if i >= 0 else s for s, i in g) for g in out)


def models_markdown() -> str:
    """A markdown table of every model family of :data:`tasks.models.MODELS` (the one list):
    its cut points (the ``cut`` key's values) and default cut, read from the model built (on
    PyTorch's meta device: no weights) for 3x32x32 images."""
    import torch

    from tasks.models import MODELS, build_model

    rows = ["| `model` | cut points (`cut`) | default cut |", "|---|---|---|"]
    with torch.device("meta"):
        for name in MODELS:
            m = build_model(name, in_channels=3, num_classes=10, image_size=32)
            rows.append(f"| `{name}` | {_spans(m.cut_points)} | {m.default_cut} |")
    return "\n".join(rows)


PYPROJECT_TABLE = "tool.flwr.app.config"   # where Flower reads the run config's keys and defaults


def _toml_value(value: Any, typ: type) -> str:
    """A default as TOML writes it, in its field's type (a float field's ``0`` is ``0.0``)."""
    if typ is bool:
        return "true" if value else "false"
    if typ is int:
        return str(int(value))
    if typ is float:
        return repr(float(value))   # 0.5, 1e-05, inf: TOML floats
    return json.dumps(value)        # a TOML basic string (JSON's escapes are TOML's)


def pyproject_section() -> str:
    """The ``[tool.flwr.app.config]`` tables of pyproject.toml, made from the config dataclasses:
    :class:`AppConfig` and :class:`tasks.config.TaskConfig` in the top table, each algorithm
    namespace's config (inherited fields included) in ``[tool.flwr.app.config.<namespace>]``.
    Flower reads the keys and defaults there (and rejects a key not listed)."""
    lines = [f"[{PYPROJECT_TABLE}]",
             "# generated from the config dataclasses by `python -m flower_apps.config --pyproject`:",
             "# do not edit by hand (every key's meaning and allowed values: docs/config.md)"]
    seen: dict[str, str] = {}
    for cls in (AppConfig, TaskConfig):
        for f, typ in fields_of(cls):
            key = key_of(f.name)
            if key in seen:
                raise ValueError(f"run-config key {key!r} is declared twice: in {seen[key]} and {cls.__name__}")
            seen[key] = cls.__name__
            lines.append(f"{key} = {_toml_value(f.default, typ)}")
    for ns, spec in sorted(namespaces().items()):
        if spec.config_cls is not None:
            lines += ["", f"[{PYPROJECT_TABLE}.{ns}]"]
            lines += [f"{key_of(f.name)} = {_toml_value(f.default, typ)}" for f, typ in fields_of(spec.config_cls)]
    return "\n".join(lines) + "\n"


def _section_span(lines: list[str]) -> tuple[int, int]:
    """``(first, end)``: the lines of ``lines`` (pyproject.toml's) that hold the run-config tables,
    from their header to the next other table (the comments and blank lines just above that
    table stay with it)."""
    head = f"[{PYPROJECT_TABLE}]"
    try:
        first = next(i for i, ln in enumerate(lines) if ln.strip() == head)
    except StopIteration:
        raise ValueError(f"pyproject.toml has no {head} table") from None
    end = next((i for i in range(first + 1, len(lines)) if lines[i].lstrip().startswith("[")
                and not lines[i].lstrip().startswith(f"[{PYPROJECT_TABLE}.")), len(lines))
    if end < len(lines):
        while end > first + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1
        while not lines[end].strip():   # (the blank lines between are the section's: it ends with one)
            end += 1
    return first, end


def update_pyproject(path: str | Path, check: bool = False) -> bool:
    """Rewrite ``path``'s run-config tables as :func:`pyproject_section` makes them (the rest of
    the file as it is); with ``check``, write nothing. Returns whether the file was up to date."""
    path = Path(path)
    lines = path.read_text().splitlines(keepends=True)
    first, end = _section_span(lines)
    new = pyproject_section() + ("\n" if end < len(lines) else "")
    if "".join(lines[first:end]) == new:
        return True
    if not check:
        path.write_text("".join(lines[:first]) + new + "".join(lines[end:]))
    return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flower_apps.config",
                                 description="Print docs/config.md (every run-config key), or generate "
                                             f"pyproject.toml's [{PYPROJECT_TABLE}] from the config dataclasses.")
    ap.add_argument("--pyproject", nargs="?", const="pyproject.toml", default=None, metavar="FILE",
                    help=f"rewrite FILE's [{PYPROJECT_TABLE}] tables in place (default FILE: ./pyproject.toml)")
    ap.add_argument("--check", action="store_true",
                    help="with --pyproject: change nothing; exit 1 if FILE's tables differ from the dataclasses")
    args = ap.parse_args(argv)
    if args.check and not args.pyproject:
        ap.error("--check goes with --pyproject")
    if args.pyproject:
        ok = update_pyproject(args.pyproject, check=args.check)
        state = "up to date" if ok else ("differs from the config dataclasses: run `python -m flower_apps.config "
                                         "--pyproject`" if args.check else "rewritten")
        print(f"{args.pyproject}: [{PYPROJECT_TABLE}] {state}", file=sys.stderr)
        return 1 if args.check and not ok else 0
    print("# Run-config keys\n\nGenerated by `python -m flower_apps.config`. "
          "Override any key with `flwr run . --run-config \"key=value ...\"`.\n")
    print(keys_markdown())
    print("\n## Models\n\nThe model families (`model`), where each may be cut for split learning (`cut`) and the "
          "cut its paper uses (`cut=''`), as the models report them (`tasks/models.py`):\n")
    print(models_markdown())
    from tasks.system import SYSTEM_DOC

    print("\n" + SYSTEM_DOC)
    return 0


def preflight(parsed: ParsedConfig, num_partitions: int | None = None) -> None:
    """The checks that need the data or a model, run before any node is contacted.

    The dataset loads (offline that means the embedded ``mnist5k``, a local path, or a
    Hugging Face id already in the local cache), the device exists, the model builds for
    the dataset's image size, ``cut`` is one of the model's cut points, and, when
    ``num_partitions`` (the number of SuperNodes) is known, the partition plan is
    feasible. Every failure is a :class:`ConfigError` naming the key.
    """
    from tasks.data import EMBEDDED
    from tasks.env import load_bundle
    from tasks.models import build_model
    from tasks.training import resolve_device

    task = parsed.task
    if task.dataset in EMBEDDED:
        for key, value in (("dataset-split", task.dataset_split), ("image-key", task.image_key),
                           ("label-key", task.label_key)):
            if value:
                raise ConfigError(f"{key}={value!r} does not apply to the embedded dataset={task.dataset!r}; "
                                  f"it selects a split/column of a Hugging Face or local dataset")
    resolve_device(task.device, task.deterministic)
    try:
        bundle = load_bundle(task)
    except ConfigError:
        raise
    except ValueError as e:  # tasks.data.DatasetError: the message names the dataset
        raise ConfigError(str(e)) from e
    try:
        model = build_model(task.model, in_channels=bundle.in_channels, num_classes=bundle.num_classes,
                            image_size=bundle.image_size, norm=task.norm, dropout=task.dropout)
    except ValueError as e:
        raise ConfigError(f"model={task.model!r} cannot be built for dataset={task.dataset!r} "
                          f"({bundle.image_size}x{bundle.image_size}x{bundle.in_channels}): {e}") from e
    if task.cut and task.cut not in model.cut_points:
        raise ConfigError(f"cut={task.cut!r} is not a cut point of model={task.model!r}; "
                          f"allowed: {', '.join(model.cut_points)} ('' = its default, {model.default_cut!r})")
    if num_partitions is not None and parsed.spec.strategy_cls.uses_clients:
        check_partition(parsed, num_partitions)


def check_partition(parsed: ParsedConfig, num_partitions: int) -> None:
    """The partition plan for ``num_partitions`` nodes is feasible (else ConfigError)."""
    from tasks.env import library_env

    cls = parsed.spec.strategy_cls
    try:
        library_env(parsed.task, num_partitions, cls.label_mode, cls.with_client_test)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"the data cannot be partitioned over {num_partitions} SuperNode(s) "
                          f"(num-partitions): {e}") from e


if __name__ == "__main__":  # python -m flower_apps.config > docs/config.md
    from flower_apps.cli import run

    run(main)
