"""The shared server-side base of every algorithm in this library: :class:`BaseStrategy`.

``BaseStrategy`` is the core's round loop (:class:`strategies.core.round_loop.RoundLoopStrategy`:
sampling, the windowed exchange, faults, bytes, the simulated clock, evaluation through Flower's
hooks, checkpoints) with FedAvg as its round: the sampled nodes train the global model, their
replies are folded into the ``num-examples``-weighted mean as they arrive
(:class:`strategies.core.folds.TrainFold`), and the server evaluates the global model on its
held-out test set each round.

A subclass overrides only what differs (as Flower's FedProx only adds to FedAvg):
``configure_train``/``train_fold``/``aggregate_train`` for full-model algorithms, or ``run_round``
when the round itself has another shape (server-only training). Split algorithms subclass
:class:`strategies.split_base.SplitStrategy`.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from strategies.core.folds import TrainFold, fold_train_round
from strategies.core.records import ARRAYS_KEY, model_to_record
from strategies.core.round_loop import RoundLoopStrategy
from tasks.training import evaluate, load_numpy_state

__all__ = ["BaseStrategy", "TrainFold"]


def _wrong_algo(owner: str, algo: str, runs: Iterable[str]) -> Exception:
    """The registry's error for an ``algo=`` a class does not run (it names the class that does)."""
    from strategies.registry import wrong_algo

    return wrong_algo(owner, algo, runs)


class BaseStrategy(RoundLoopStrategy):
    """Base strategy: the round loop with FedAvg's round and the server's evaluation.

    Every argument is optional; the defaults are the paper's (the algorithm's config
    dataclass) and the library's (``TaskConfig``, ``RoundPolicy``).

    Parameters
    ----------
    task : TaskConfig
        Data, partition, model and local-optimisation settings (sent to every client).
    cfg : dataclass
        The algorithm's own config (sent to every client as the ``algo`` record).
    algo : str
        Which of the algorithms of this class runs (a variant or baseline, e.g.
        ``"fed-pseudo"`` of ``FedSHVRStrategy``); default: the class's own. Any other
        name is a ``ConfigError``.
    policy : RoundPolicy
        Sampling, timeout and minimum number of nodes per round.
    model : torch.nn.Module or a function returning one
        The user's own model (else the task config's named model and dataset). For a split
        algorithm: a ``tasks.models.StagedModel``, ``(bottom, top)`` or ``nn.Sequential``
        with ``cut=<index>`` (:func:`tasks.models.as_staged`).
    labeled_data, test_data
        The server's own labeled set (algorithms with labels on the server) and test set
        (evaluated every round; else ``start(evaluate_fn=...)`` evaluates): ``(x, y)``
        arrays or tensors, uint8 or float in [0, 1], ``[N, C, H, H]`` (``tasks.data.as_dataset``).
    num_classes, augmenter, flip
        Number of classes (default: from the labels), the weak/strong augmenter (default
        ``tasks.augment.Augmenter(C, H, flip=flip)``).
    **options
        Any field of the algorithm's config, of ``TaskConfig`` (``lr``, ``batch_size``,
        ``local_epochs``, ``local_steps``, ``seed``, ``device``, ``cut``...) or of
        ``RoundPolicy`` (``fraction_train``, ``min_nodes``, ``round_timeout``...), checked
        against the same ranges and choices as the run config.
    """

    #: the server trains on its own labels before a round's first message (Semi-SFL's stage A,
    #: SemiFL's and FedSwitch's server stage), so the first weights a node receives are not
    #: ``initial_arrays`` themselves (the round-0 evaluation still is)
    server_trains_first: bool = False
    #: reply metrics averaged (weighted by ``num-examples``) into the round's metrics
    reply_metrics: tuple[str, ...] = ("train-loss",)
    #: the name of :meth:`eval_model` in the metrics (``<name>-accuracy`` beside ``accuracy``),
    #: where another model is also evaluated (:meth:`also_evaluated`): e.g. ``"teacher"``
    eval_name: str = ""
    wrong_algo = staticmethod(_wrong_algo)

    # ------------------------------------------------------------------ what every algorithm calls
    def connected_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, sorted; fewer than ``min-nodes``: wait for them (``wait-for-nodes``)."""
        return self.nodes.connected(grid)

    def sample_size(self, num_nodes: int) -> int:
        """How many of ``num_nodes`` nodes a round samples (``fraction-train``, ``min-nodes``)."""
        return self.nodes.sample_size(num_nodes)

    def note_partition(self, node: int, partition_id: Any, num_partitions: Any = 0) -> None:
        """Record what a node said of its partition (an algorithm's own query that carries it)."""
        self.directory.note(node, partition_id, num_partitions)

    @property
    def partition_of(self) -> dict[int, int]:
        """node id -> partition id of every node known (a view of the node directory)."""
        return self.directory.partitions()

    @property
    def partition_count(self) -> int:
        """The nodes' ``num-partitions`` (0 until a node said it)."""
        return self.directory.num_partitions

    # ------------------------------------------------------------------ FedAvg's round
    def global_arrays(self) -> ArrayRecord:
        return model_to_record(self.model)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        nodes = self.sample_nodes(grid, server_round)
        msgs = []
        for n in nodes:
            content = self.base_content(server_round, **dict(config))
            content[ARRAYS_KEY] = arrays
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        return msgs

    def load_aggregate(self, state: dict[str, np.ndarray]) -> None:
        """Hook: put the aggregated state into the global model (e.g. only the shared body)."""
        load_numpy_state(self.model, state)

    def train_fold(self, server_round: int) -> TrainFold:
        """The running aggregate of round ``server_round``'s train replies (fold-as-you-go: each
        reply is added as it arrives and let go). Default: the ``num-examples``-weighted mean of
        the uploaded states and of :attr:`reply_metrics` (FedAvg); an algorithm with another rule
        returns its own fold (uniform weights, FedNova's normalised sums, ...)."""
        return TrainFold(self)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's ``aggregate_train``: the replies folded into :meth:`train_fold` one by one."""
        fold = self.train_fold(server_round)
        for r in replies:
            fold.add(r)
        return fold.finish()

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        """One round; returns its metrics. Default: FedAvg-style train round
        (:func:`strategies.core.folds.fold_train_round`)."""
        return fold_train_round(self, server_round, grid, BaseStrategy)

    # ------------------------------------------------------------------ the server's evaluation
    def test_transform(self, x: Any) -> torch.Tensor:
        """The exact input the library's evaluation feeds the model, for images ``x`` in any
        form the API takes (numpy or torch, uint8 or float in [0, 1], ``[N, C, H, W]`` or
        ``[N, H, W]``): stored as uint8 (floats rounded to steps of 1/255), then the
        augmenter's test view, ``(x / 255 - mean) / std`` per channel (default mean = std =
        0.5; choose with ``augmenter=tasks.augment.Augmenter(C, H, mean=..., std=...)``).
        Use it in an ``evaluate_fn`` to measure what the library measures:
        ``net(strategy.test_transform(x)).argmax(1)``. On the CPU; move it where your model is."""
        from tasks.data import as_dataset

        if self.env is None:   # (a user's model sets the strategy up in its constructor)
            raise RuntimeError("test_transform needs the library's data set up: call it after start()")
        images = as_dataset(x, "x").x
        return self.env.augmenter.test(torch.from_numpy(images))

    def also_evaluated(self) -> dict[str, torch.nn.Module]:
        """Models evaluated beside :meth:`eval_model`, by name: ``<name>-accuracy`` (e.g. the
        student beside its EMA teacher)."""
        return {}

    def evaluate_global(self) -> dict[str, Any]:
        """Accuracy, loss and per-class accuracy on the server's test set (none given: ``{}``,
        and ``start(evaluate_fn=...)`` is the evaluation), and the accuracy of the models of
        :meth:`also_evaluated`."""
        env = self.env
        if env.test is None or len(env.test) == 0:
            return {}
        out = evaluate(self.eval_model(), env.test, aug=env.augmenter, device=env.device,
                       num_classes=env.num_classes)
        if self.eval_name:
            out[f"{self.eval_name}-accuracy"] = out["accuracy"]
        for name, model in self.also_evaluated().items():
            out[f"{name}-accuracy"] = evaluate(model, env.test, aug=env.augmenter, device=env.device,
                                               num_classes=env.num_classes)["accuracy"]
        return out
