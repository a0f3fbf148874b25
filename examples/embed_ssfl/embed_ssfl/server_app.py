"""ServerApp: build flower-ssl's ``SSFLStrategy`` from this app's run config and start it.

Only ``strategies`` and ``tasks`` of flower-ssl are imported; the library's own
``flower_apps`` (its ServerApp, config parser and results writer) are not used.
"""
from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from strategies.base import RoundPolicy
from strategies.ssfl import SSFLConfig, SSFLStrategy
from tasks.config import TaskConfig, parse_dataclass

# Used when the run config is empty (flwr.simulation.run_simulation passes none);
# the same values as [tool.flwr.app.config] in this app's pyproject.toml.
DEFAULTS: dict[str, Any] = {
    "num-rounds": 3, "fraction-train": 1.0, "dataset": "mnist5k", "partition": "ssfl-r",
    "partition-r": 0.4, "server-labels": 100, "model": "mlp", "norm": "gn", "local-steps": 8,
    "batch-size": 32, "lr": 0.05, "ssfl.groups": 2, "ssfl.tau": 0.95,
}
HISTORY: list[dict[str, Any]] = []   # per-round metrics of the last run (for tests / notebooks)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = {**DEFAULTS, **dict(context.run_config)}
    task = parse_dataclass(TaskConfig, cfg, strict=False)          # data, partition, model, optimiser
    algo = parse_dataclass(SSFLConfig, {k: v for k, v in cfg.items() if k.startswith("ssfl.")}, "ssfl")
    strategy = SSFLStrategy(task, algo, "ssfl", RoundPolicy(fraction_train=float(cfg["fraction-train"]),
                                                            min_nodes=2))
    HISTORY.clear()

    def on_round_end(rnd: int, metrics: dict[str, Any]) -> None:
        HISTORY.append({"round": rnd, **metrics})
        log(INFO, "embed_ssfl round %d: accuracy %.4f, %d participants", rnd, metrics["accuracy"],
            metrics.get("participants", 0))

    result = strategy.start(grid, num_rounds=int(cfg["num-rounds"]), on_round_end=on_round_end)
    log(INFO, "embed_ssfl done: final accuracy %.4f", HISTORY[-1]["accuracy"] if HISTORY else float("nan"))
    del result
