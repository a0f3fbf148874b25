"""ServerApp: one of flower-ssl's algorithms on this app's own model and data.

``algo`` (run config) picks the algorithm. Each strategy gets this app's model, the
server's labeled set where the algorithm has labels on the server, the test set, and the
paper's defaults for everything not named. ``evaluate_fn`` is this app's own evaluation.
"""
from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from own_model.task import SmallCNN, server_labeled, split_pair, test_set
from strategies.fedavg import FedAvgStrategy
from strategies.fedshvr.fedshvr import FedSHVRStrategy
from strategies.scala.scala import ScalaStrategy
from strategies.semisfl.semisfl import SemiSFLStrategy
from strategies.ssfl.ssfl import SSFLStrategy
from strategies.umpfssl.umpfssl import UMPFSSLStrategy
from tasks.augment import Augmenter
from tasks.models import as_staged

# Used when the run config is empty (flwr.simulation.run_simulation passes none);
# the same values as [tool.flwr.app.config] in this app's pyproject.toml.
DEFAULTS: dict[str, Any] = {"algo": "fedavg", "num-rounds": 3, "local-steps": 4, "batch-size": 16, "lr": 0.05}
RESULTS: dict[str, Any] = {}   # algo -> Flower's Result of the last run (tests, notebooks)

app = ServerApp()


def make_strategy(algo: str, local_steps: int, batch_size: int, lr: float):
    opts = dict(test_data=test_set(), local_steps=local_steps, batch_size=batch_size, lr=lr, min_nodes=2)
    if algo == "fedavg":
        return FedAvgStrategy(model=SmallCNN(), **opts)
    if algo == "ssfl":          # labels on the server; the server model joins the average
        return SSFLStrategy(model=SmallCNN(), labeled_data=server_labeled(), **opts)
    if algo == "semisfl":       # split: the nodes run the bottom, the server the top and the labeled loss
        return SemiSFLStrategy(model=split_pair(), labeled_data=server_labeled(), k_s=local_steps, k_u=local_steps,
                               **opts)
    if algo == "scala":         # split: the server concatenates the nodes' activations
        return ScalaStrategy(model=split_pair(), **opts)
    if algo == "fedshvr":       # labeled and unlabeled data on the nodes
        return FedSHVRStrategy(model=SmallCNN(), **opts)
    if algo == "umpfssl":       # personalized: evaluated on each node's own test set
        return UMPFSSLStrategy(model=SmallCNN(), num_classes=4, **{k: v for k, v in opts.items() if k != "test_data"})
    raise ValueError(f"algo={algo!r} is not one of: fedavg, ssfl, semisfl, scala, fedshvr, umpfssl")


def evaluate_fn(algo: str):
    """This app's own evaluation of the global model (Flower's ``evaluate_fn``)."""
    x, y = test_set()
    xt = Augmenter(1, x.shape[-1], flip=False).test(torch.from_numpy(x))  # what the strategies evaluate on

    def fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if algo == "umpfssl":
            return None  # one model per node: the nodes evaluate their own
        model = as_staged(split_pair()) if algo in ("semisfl", "scala") else SmallCNN()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            acc = float((model(xt).argmax(1).numpy() == y).mean())
        return MetricRecord({"own-accuracy": acc})

    return fn


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = {**DEFAULTS, **dict(context.run_config)}
    for algo in str(cfg["algo"]).split(","):   # 'fedavg,scala': one run after the other, same SuperNodes
        algo = algo.strip()
        strategy = make_strategy(algo, int(cfg["local-steps"]), int(cfg["batch-size"]), float(cfg["lr"]))
        result = strategy.start(grid, num_rounds=int(cfg["num-rounds"]), evaluate_fn=evaluate_fn(algo))
        RESULTS[algo] = result
        last = result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]
        log(INFO, "own_model %s: final accuracy %.4f", algo, float(last.get("accuracy", np.nan)))
