"""One typed parser for the whole run config, run before any training starts.

Keys without a dot belong to :class:`AppConfig` (how the run is driven) or to
:class:`tasks.config.TaskConfig` (data, partition, model, optimisation). Keys with a dot
belong to an algorithm namespace (``scala.local-iterations``) and are validated by that
algorithm's config dataclass. Anything unknown, mistyped or out of range raises
:class:`tasks.config.ConfigError` naming the key and listing what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strategies.registry import AlgorithmSpec, algorithm_names, get_algorithm, namespaces
from tasks.config import ConfigError, TaskConfig, fields_of, key_of, knob, parse_dataclass


@dataclass
class AppConfig:
    """How the run is driven (not sent to clients)."""

    algo: str = knob("fedavg", help="which algorithm to run (see README table)")
    num_rounds: int = knob(10, lo=1)
    fraction_train: float = knob(1.0, lo=0.0, hi=1.0, lo_open=True, help="share of nodes sampled per round")
    min_nodes: int = knob(2, lo=1, help="fewest nodes a round needs; fewer usable replies skip the round")
    round_timeout: float = knob(600.0, lo=0.0, lo_open=True, help="seconds to wait for replies")
    results_dir: str = knob("results", help="parent folder of run folders (relative: to the project dir)")
    run_name: str = knob("", help="run folder name ('' = <algo>-<timestamp>)")
    resume: bool = knob(False, help="continue the run folder's last completed round")

    def validate(self) -> None:
        if self.algo not in algorithm_names():
            raise ConfigError(f"algo={self.algo!r} is not one of: {', '.join(algorithm_names())}")
        if self.resume and not self.run_name:
            raise ConfigError("resume=true needs run-name='<the run folder to continue>'")


@dataclass
class ParsedConfig:
    app: AppConfig
    task: TaskConfig
    spec: AlgorithmSpec
    algo: Any  # the algorithm's config dataclass instance (or None)


def _top_level_keys() -> list[str]:
    return sorted({key_of(f.name) for cls in (AppConfig, TaskConfig) for f, _ in fields_of(cls)})


def parse_run_config(raw: dict[str, Any]) -> ParsedConfig:
    """Validate a flat Flower run config and return typed configs."""
    flat = dict(raw)
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
            spec.parse_config(flat)
    spec = get_algorithm(app.algo)
    algo_cfg = spec.parse_config(flat)
    return ParsedConfig(app, task, spec, algo_cfg)
