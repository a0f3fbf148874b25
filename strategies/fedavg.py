"""FedAvg (all client data labeled) and the server-only ``supervised-only`` lower bound.

``fedavg`` -- McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (AISTATS 2017). Each round the sampled clients start from the global
weights w, run local SGD on cross-entropy over their labeled data (``local-epochs`` or
``local-steps``) and return w_k with ``num-examples`` n_k = |D_k|, the client's number of
training examples (the paper's Algorithm 1; Flower's convention); the server sets
w <- sum_k n_k w_k / sum_k n_k over the clients that replied (all state-dict entries, BN
buffers included). ``upload-weight=processed-examples`` (the round policy) weights by the
samples each client's local steps processed instead (with ``local-steps`` set: the same for
every client that holds a full batch, nearly the uniform mean).

Client contract: a ``train`` message carries ``arrays`` (the global state dict), ``task``
(the flat TaskConfig) and ``config`` (``server-round``); the reply carries ``arrays``
(the local state dict) and ``metrics`` with ``num-examples`` (|D_k|), ``processed-examples``
(the samples the local steps processed) and ``train-loss``.

``supervised-only`` -- the lower bound every semi-supervised paper here reports: the
server trains on its N_s labeled samples (``server-labels``) alone, ``local-steps`` (or
``local-epochs`` passes) of SGD per round; no client is contacted.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from strategies.core.folds import sized_metrics
from strategies.core.records import (
    ARRAYS_KEY,
    METRICS_KEY,
    client_env,
    model_to_record,
    record_to_numpy,
)
from .base import BaseStrategy
from tasks.data import ArrayDataset
from tasks.env import Env
from tasks.training import (
    derive_seed,
    make_sgd,
    num_local_steps,
    train_supervised,
)

from .client import AlgorithmClient, server_round
from .registry import AlgorithmSpec, register


class FedAvgStrategy(BaseStrategy):
    """Supervised FedAvg on fully labeled clients (the sanity reference)."""

    label_mode = "all"


def client_train(msg: Message, context: Context,
                 regularizer: Callable[[torch.nn.Module], Any] | None = None,
                 loss_fn: Callable[[Env, ArrayDataset], Callable] | None = None) -> Message:
    """Local supervised SGD from the received global weights (see module docstring).

    The hooks of the algorithms that change only the client's objective (FedProx, FedLC:
    :mod:`strategies.fedprox`): ``regularizer(model)`` returns a term added to every step's
    loss, made once the received weights are loaded; ``loss_fn(env, data)`` returns the loss
    ``(logits, y) -> loss`` that replaces the cross-entropy."""
    env = client_env(msg, context, label_mode="all")
    rnd = server_round(msg)
    model = env.model_from(record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    data = env.labeled()
    task = env.task
    metrics = train_supervised(
        model, data, aug=env.augmenter, steps=num_local_steps(task, len(data)),
        batch_size=task.batch_size, optimizer=make_sgd(model.parameters(), task), device=env.device,
        seed=derive_seed(task.seed, "fedavg", rnd, env.partition_id),
        regularizer=regularizer(model) if regularizer is not None else None,
        loss_fn=loss_fn(env, data) if loss_fn is not None else None)
    metrics = sized_metrics(metrics, len(data))   # num-examples = |D_k|, FedAvg's n_k
    return Message(RecordDict({ARRAYS_KEY: model_to_record(model), METRICS_KEY: MetricRecord(metrics)}),
                   reply_to=msg)


class SupervisedOnlyStrategy(BaseStrategy):
    """The server trains on its labeled set alone (no client is contacted)."""

    label_mode = "server"
    uses_clients = False

    def setup_algorithm(self) -> None:
        if len(self.env.server_labeled()) == 0:
            from tasks.config import ConfigError
            raise ConfigError("supervised-only needs labeled data on the server: labeled_data=(x, y)"
                              if self.user is not None else
                              "supervised-only needs server-labels > 0 (N_s labeled samples on the server)")
        self.optimizer = make_sgd(self.model.parameters(), self.task)

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        data = self.env.server_labeled()
        return train_supervised(
            self.model, data, aug=self.env.augmenter, steps=num_local_steps(self.task, len(data)),
            batch_size=self.task.batch_size, optimizer=self.optimizer, device=self.env.device,
            seed=derive_seed(self.task.seed, "server", server_round))

    def extra_state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])


ALGORITHMS = register({
    "fedavg": AlgorithmSpec(
        name="fedavg", paper="McMahan et al. 2017 (reference)", strategy_cls=FedAvgStrategy,
        client={"train": client_train},
        description="supervised FedAvg, all client data labeled"),
    "supervised-only": AlgorithmSpec(
        name="supervised-only", paper="lower bound of Semi-SFL / SSFL", strategy_cls=SupervisedOnlyStrategy,
        description="server trains on its N_s labels alone"),
})


class FedAvgClient(AlgorithmClient):
    """FedAvg's client with a user's model and the node's own labeled data (``labeled``).

    Each ``train`` message: local SGD on cross-entropy from the received global weights
    (``local_epochs`` or ``local_steps``, ``batch_size``, ``lr``, momentum from the server's
    task config); the reply is the local weights, ``num-examples`` (the size of ``labeled``)
    and ``processed-examples``."""

    module = __name__
    needs = ('labeled',)
