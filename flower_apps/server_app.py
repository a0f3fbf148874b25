"""The ServerApp: validate the run config, build the algorithm's strategy, run, write results."""
from __future__ import annotations

import os
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from flower_apps.config import ParsedConfig, parse_run_config, preflight
from flower_apps.results import RunFolder
from tasks.config import ConfigError, to_flat

app = ServerApp()


def resolve_results_dir(results_dir: str) -> Path:
    """Absolute as given; relative paths resolve against $FLOWER_SSL_HOME or the cwd.

    Under ``flwr run`` the ServerApp's cwd is the SuperLink's, not the project's, so the
    README passes an absolute ``results-dir`` (or sets FLOWER_SSL_HOME).
    """
    p = Path(os.path.expanduser(results_dir))
    if p.is_absolute():
        return p
    return Path(os.environ.get("FLOWER_SSL_HOME", os.getcwd())) / p


def resolved_config(parsed: ParsedConfig) -> dict:
    cfg = {**to_flat(parsed.app), **to_flat(parsed.task)}
    if parsed.algo is not None:
        cfg.update(to_flat(parsed.algo, parsed.spec.namespace))
    return cfg


def default_config(parsed: ParsedConfig) -> dict:
    """What :func:`resolved_config` gives with every knob at its default (same algorithm)."""
    cfg = {**to_flat(type(parsed.app)()), **to_flat(type(parsed.task)())}
    if parsed.algo is not None:
        cfg.update(to_flat(type(parsed.algo)(), parsed.spec.namespace))
    return cfg


def user_keys(grid: Grid) -> set[str] | None:
    """The run-config keys the user set for this run (``flwr run --run-config``), or None
    where the grid does not know its run."""
    try:
        return set(grid.run.override_config)
    except Exception:  # noqa: BLE001 - a grid without a run (LocalGrid, tests)
        return None


def run(grid: Grid, run_config: dict, explicit: set[str] | None = None) -> Path:
    """Run one configured experiment on ``grid``; return the run folder. ``explicit``: the
    keys the user set (default: the grid's run override config)."""
    try:
        parsed = parse_run_config(run_config, user_keys(grid) if explicit is None else explicit)
        preflight(parsed)  # dataset, device, model, cut: before any node is contacted
    except ConfigError as e:
        log(ERROR, "invalid run config: %s", e)
        raise
    app_cfg, spec = parsed.app, parsed.spec
    name = app_cfg.run_name or f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = RunFolder(resolve_results_dir(app_cfg.results_dir) / name)

    from strategies.split_base import SplitStrategy
    split = {"split": app_cfg.split_policy()} if issubclass(spec.strategy_cls, SplitStrategy) else {}
    strategy = spec.strategy_cls(parsed.task, parsed.algo, spec.name, app_cfg.policy(), **split)
    try:
        strategy.setup(grid)  # waits for min-nodes, partitions the data over the nodes seen
    except ConfigError as e:
        log(ERROR, "invalid run config: %s", e)
        raise
    except ValueError as e:  # e.g. more nodes than samples: still before any training
        err = ConfigError(f"the run cannot start with {strategy.num_partitions} SuperNode(s): {e}")
        log(ERROR, "invalid run config: %s", err)
        raise err from e
    done = folder.start(resolved_config(parsed), resume=app_cfg.resume, defaults=default_config(parsed))
    folder.write_json("partition.json", strategy.env.plan.report)
    if done:
        ck = folder.load_checkpoint()
        strategy.load_state_dict(ck["state"])
        log(INFO, "resuming %s after completed round %d of %d", folder.path, done, app_cfg.num_rounds)
    log(INFO, "run %s: algo=%s dataset=%s model=%s rounds=%d -> %s", name, spec.name,
        parsed.task.dataset, parsed.task.model, app_cfg.num_rounds, folder.path)

    t_start = time.time()

    def on_round_end(rnd: int, metrics: dict) -> None:
        metrics["wall-seconds"] = time.time() - t_start
        folder.append_metrics(rnd, metrics)
        folder.save_checkpoint(rnd, strategy.state_dict())

    strategy.start(grid, num_rounds=app_cfg.num_rounds, start_round=done + 1, on_round_end=on_round_end)
    if strategy.guard.diverged:   # (rolled back: the saved model is from before those rounds)
        log(WARNING, "round(s) %s diverged and were not applied (metrics.jsonl: diverged); model.pt is the model "
                     "from before them", strategy.guard.diverged)
    folder.save_model(strategy.eval_model().state_dict())
    folder.plot(f"{spec.name} on {parsed.task.dataset}")
    folder.close()
    log(INFO, "results written to %s", folder.path)
    return folder.path


@app.main()
def main(grid: Grid, context: Context) -> None:
    run(grid, dict(context.run_config))
