"""The round loop every algorithm of the library runs: :class:`RoundLoopStrategy`.

A :class:`flwr.serverapp.strategy.Strategy` whose :meth:`~RoundLoopStrategy.start` reads like
Flower's: set up, evaluate round 0, then per round train (:meth:`run_round`), evaluate through
Flower's evaluate hooks (``configure_evaluate``/``aggregate_evaluate``) and on the server
(``evaluate_global``), record. It composes parts with one job each:

* :class:`~strategies.core.node_directory.NodeDirectory` and
  :class:`~strategies.core.node_directory.NodeSampler`: who the nodes are, which a round samples;
* :class:`~strategies.core.messages.MessageContent`: the records every message carries;
* :class:`~strategies.core.exchange_window.ExchangeWindow`: the windowed send/receive, faults;
* :class:`~strategies.core.byte_meter.ByteMeter`: bytes by kind and direction;
* :class:`~strategies.core.clock.SimClock`: the simulated system's clock (``system``);
* :class:`~strategies.core.round_guard.RoundGuard`: the upload bound and divergence roll-back;
* checkpoints: :meth:`state_dict`/:meth:`load_state_dict`.

What a round trains is a subclass's (:class:`strategies.base.BaseStrategy`: FedAvg as a fold).
Faults: an error reply or a node past its timeout is dropped from the round (logged, the
round's ``dropped``); a round with fewer than ``min-nodes`` usable replies is skipped; a round
in which every node sent an instruction (at least ``min-nodes`` of them) failed with the same
error stops the run with that error (:class:`RoundFailedError`): a setup error every node meets is not a fault to tolerate.
"""
from __future__ import annotations

import time
import uuid
from logging import INFO, WARNING
from typing import Any, Callable, Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from tasks.config import ConfigError, TaskConfig
from tasks.env import Env, NodeData, library_env, user_env
from tasks.training import load_numpy_state

from .byte_meter import ByteMeter
from .clock import SimClock
from .deadlines import WallClock
from .evaluation import federated_evaluation
from .exchange_window import ExchangeWindow
from .messages import MessageContent
from .node_directory import NodeDirectory, NodeSampler
from .options import route_options
from .partition_count import settle_partitions
from .records import ARRAYS_KEY, INFO_ACTIONS, metric_safe, model_to_record, record_to_numpy
from .round_guard import RoundGuard
from .round_policy import RoundPolicy

__all__ = ["RoundLoopStrategy", "RoundFailedError", "progress_line"]


class RoundFailedError(RuntimeError):
    """Every node sent an instruction in a round failed with the same error: the run stops."""


class RoundLoopStrategy(Strategy):
    """The round loop, its parts and its hooks (see the module docstring; the parameters are
    :class:`strategies.base.BaseStrategy`'s)."""

    label_mode: str = "all"      # how the partition plan labels data (tasks.partition.LABEL_MODES)
    uses_clients: bool = True    # False for server-only baselines (supervised-only)
    with_client_test: bool = False
    staged: bool = False         # a user's model is cut into stages (tasks.models.as_staged)
    #: actions that ask a node about itself: no user config in the message
    info_actions: tuple[str, ...] = INFO_ACTIONS
    #: registry name -> spec of every algorithm this class runs, its own first (set by the
    #: registry); a spec builds the config: ``spec.build_config(cfg, options)``
    specs: dict[str, Any] = {}
    #: ``(owner, algo, runs) -> error`` for an ``algo=`` this class does not run (None: a plain
    #: ``ConfigError``; the library's strategies name the class that runs it, the registry's)
    wrong_algo: Any = None

    def __init__(self, task: TaskConfig | None = None, cfg: Any = None, algo: str | None = None,
                 policy: RoundPolicy | None = None, *, model: Any = None, labeled_data: Any = None,
                 test_data: Any = None, num_classes: int | None = None, augmenter: Any = None,
                 flip: bool = False, **options: Any) -> None:
        self.algo, self.cfg, configs = route_options(type(self).__name__, type(self).specs, algo, cfg,
                                                     {"rounds": policy or RoundPolicy(), "task": task or TaskConfig()},
                                                     options, type(self).wrong_algo)
        self.policy, self.task = configs["rounds"], configs["task"]
        self.user = None
        if model is not None:
            self.user = dict(model=model, data=NodeData.of(labeled=labeled_data, test=test_data),
                             num_classes=num_classes, augmenter=augmenter, flip=flip)
        elif labeled_data is not None or test_data is not None:
            raise ConfigError("labeled_data/test_data are a user's own data: pass your model too (model=...)")
        self.env: Env | None = None
        self.model: torch.nn.Module | None = None
        self.dropped: list[int] = []
        self.num_partitions = 0
        self.directory = NodeDirectory()   # who each node is: partition id (+ a node's data statistics)
        self.nodes = NodeSampler(self)     # the connected nodes, node-info, each round's sample
        self.content = MessageContent(self)
        self.window = ExchangeWindow(self)
        self.meter = ByteMeter()
        self.clock = SimClock(self.directory.key_of)   # the simulated system's clock (policy.system; start())
        self.train_config: dict[str, Any] = {}     # Flower's start(train_config=...): in every training message
        self.evaluate_config: dict[str, Any] = {}  # Flower's start(evaluate_config=...): in evaluation messages
        self.initial_given = False                 # start(initial_arrays=...) was used
        self.num_rounds = 0                        # start()'s num_rounds: the horizon of schedules
        self.stopped_at = 0                        # the round that reached stop-accuracy (0: none yet)
        self.state_key = uuid.uuid4().hex          # names this run's node-side state (kept on resume)
        self.session = uuid.uuid4().hex            # one per start(): nodes restore saved state on a new one
        self.timer = WallClock()                   # what waits read and sleep on (tests drive their own)
        self.warm_nodes: set[int] = set()          # nodes that answered in this run (strategies.core.deadlines)
        self.guard = RoundGuard(self)              # upload bound, divergence roll-back (strategies.core.round_guard)
        if self.user is not None:
            # the user's model and data are all there is to check: every setup error (missing
            # labeled_data, a model the algorithm cannot use, bad images) is raised here, in the
            # constructor, not at the first round of a run
            self.setup(None)

    # ------------------------------------------------------------------ setup
    def setup(self, grid: Grid | None) -> None:
        """Build the server environment and the global model (idempotent): the user's model and
        data (``model=...``), else the library's dataset named by the task config, partitioned
        over the nodes' ``num-partitions``."""
        if self.env is not None:
            return
        if grid is not None and self.uses_clients:   # the count the nodes state (strategies.core.partition_count)
            self.num_partitions = settle_partitions(self, grid)
        else:
            self.num_partitions = max(self.policy.min_nodes, 1)
        if self.user is not None:
            u = self.user
            self.env = user_env(self.task, u["model"], u["data"], num_classes=u["num_classes"],
                                augmenter=u["augmenter"], flip=u["flip"], staged=self.staged)
        else:
            self.env = library_env(self.task, self.num_partitions, self.label_mode, self.with_client_test)
        self.model = self.env.build_model()
        self.setup_algorithm()

    def begin_run(self) -> None:
        """Hook: ``start()`` calls it after :meth:`setup`, before the first round, with
        ``self.num_rounds`` set (e.g. schedules over the run's rounds)."""

    def setup_algorithm(self) -> None:
        """Hook for subclasses: extra server-side models, optimizers, queues."""

    def load_initial_arrays(self, arrays: ArrayRecord) -> None:
        """``start(initial_arrays=...)``: the global model starts from them, and so does every
        model derived from it (teacher, server part, optimizer state): the algorithm is set up again."""
        load_numpy_state(self.model, record_to_numpy(arrays))
        self.initial_given = True
        self.setup_algorithm()

    # ------------------------------------------------------------------ nodes and messages
    def sample_nodes(self, grid: Grid, server_round: int) -> list[int]:
        """The nodes round ``server_round`` trains: ``fraction-train`` of them, seeded, in partition
        order (:meth:`strategies.core.node_directory.NodeSampler.sample`; override: another rule)."""
        return self.nodes.sample(grid, server_round)

    def learn_partitions(self, grid: Grid, nodes: list[int], poll: float = 0.01, server_round: int = 0) -> list[int]:
        """Learn the partitions of ``nodes`` (default: the one ``node-info`` query per node,
        :meth:`strategies.core.node_directory.NodeSampler.ask_node_info`; a strategy with a query
        of its own that carries them overrides this); returns the nodes whose partition is known."""
        return self.nodes.ask_node_info(grid, nodes, poll)

    def base_content(self, server_round: int, action: str = "train", **config: Any) -> RecordDict:
        """The records of a message for ``action`` (:meth:`strategies.core.messages.MessageContent.build`)."""
        return self.content.build(server_round, action, **config)

    def exchange(self, grid: Grid, messages: Iterable[Message], timeout: float | None = None,
                 poll: float = 0.01) -> list[Message]:
        """Send ``messages``, collect the good replies (the windowed loop of :meth:`exchange_fold`)."""
        out: list[Message] = []
        self.exchange_fold(grid, messages, out.append, timeout, poll)
        return out

    def exchange_fold(self, grid: Grid, messages: Iterable[Message], fold: Callable[[Message], None],
                      timeout: float | None = None, poll: float = 0.01) -> int:
        """Send ``messages`` through the exchange window and hand each good reply to ``fold`` as it
        arrives, then let it go; returns how many were folded. An error reply, and a node that
        has not replied ``timeout`` (default ``round-timeout``) seconds after its instruction was
        sent, drop their node from the round (:class:`strategies.core.exchange_window.ExchangeWindow`)."""
        timeout = self.policy.round_timeout if timeout is None else timeout
        messages = list(messages)
        if not messages:
            return 0
        with self.clock.stage():
            return self.window.send(grid, messages, fold, timeout, poll)

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        """The byte kind of array record ``key`` of ``msg`` (``None``: not counted). Default: the
        model weights (``ARRAYS_KEY``) are ``weights``; override for other kinds."""
        return "weights" if key == ARRAYS_KEY else None

    def drop(self, node: int, why: str) -> None:
        """Drop ``node`` from this round: a logged warning, and the round's ``dropped`` metric."""
        log(WARNING, "node %s dropped from round: %s", node, why)
        self.dropped.append(node)

    # ------------------------------------------------------------------ a round
    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        """One round's training; returns its metrics (a subclass's: e.g. FedAvg's)."""
        raise NotImplementedError

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Flower's hook: the federated evaluation messages of a round (default: none; the global
        model is evaluated on the server, :meth:`evaluate_global`)."""
        return []

    def evaluates_round(self, server_round: int) -> bool:
        """Whether round ``server_round`` is evaluated: every ``eval-every`` rounds of the round
        policy and the last (the server's evaluation, and :meth:`configure_evaluate`'s where a
        subclass has one, e.g. a personalised evaluation)."""
        return server_round % self.policy.eval_every == 0 or server_round == self.num_rounds

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Flower's hook: the round's evaluation metrics from the replies to :meth:`configure_evaluate`."""
        return None

    def evaluate_global(self) -> dict[str, Any]:
        """The server's own evaluation of the global model (default: none)."""
        return {}

    def eval_model(self) -> torch.nn.Module:
        """The model whose test accuracy is the run's result (override: e.g. EMA teacher)."""
        return self.model

    def result_arrays(self) -> ArrayRecord:
        """What ``start`` returns as ``Result.arrays`` and passes to ``evaluate_fn``: the
        evaluated model (override: per-client models of a personalized algorithm)."""
        return model_to_record(self.eval_model())

    def summary(self) -> None:
        log(INFO, "%s: %s", type(self).__name__, self.task)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume after the last completed round (every random draw of a
        round is seeded by :func:`tasks.training.derive_seed` from the run seed and the round,
        so no RNG state is kept)."""
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "state-key": self.state_key, "initial-given": self.initial_given,
                "sim-seconds-total": self.clock.total, "stopped-at": self.stopped_at, "extra": self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (a checkpoint of an older version may hold an ``"rng"``
        entry: it is ignored)."""
        self.model.load_state_dict(state["model"])
        self.state_key = str(state.get("state-key", self.state_key))
        self.initial_given = bool(state.get("initial-given", False))
        self.clock.total = float(state.get("sim-seconds-total", 0.0))
        self.stopped_at = int(state.get("stopped-at", 0))
        self.load_extra_state(state.get("extra", {}))

    def extra_state(self) -> dict[str, Any]:
        """Hook: the algorithm's own state to checkpoint."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Hook: restore :meth:`extra_state`."""

    # ------------------------------------------------------------------ the loop
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None, *,
              start_round: int = 1,
              on_round_end: Callable[[int, dict[str, Any]], None] | None = None) -> Result:
        """Run rounds ``start_round..num_rounds`` and return Flower's ``Result``.

        Same signature and meaning as Flower's ``Strategy.start``: ``initial_arrays``
        (optional: else the model is built from the task config) is the global model of
        round 1 and of the round-0 evaluation, ``train_config``/``evaluate_config`` are added
        to the config of every training/evaluation message, ``evaluate_fn(round, arrays)``
        is called for round 0 and after every round (every ``eval-every`` rounds of the
        round policy, and the last) with what ``Result.arrays`` returns, and its metrics join
        the round's server metrics. Plus ``start_round`` and
        ``on_round_end`` for resuming and for writing results (``initial_arrays`` only
        applies to a run that starts at round 1). A round whose every node failed with the
        same error raises it (:class:`RoundFailedError`).
        """
        if timeout is not None:
            self.policy.round_timeout = float(timeout)
        self.train_config = dict(train_config or {})
        self.evaluate_config = dict(evaluate_config or {})
        self.session = uuid.uuid4().hex
        self.num_rounds = int(num_rounds)
        self.setup(grid)
        self.policy.validate()
        self.clock.start(self.policy.system, self.task.seed, self.policy.round_timeout)
        self.begin_run()
        if initial_arrays is not None and start_round == 1:
            self.load_initial_arrays(initial_arrays)
        result = Result()

        def server_eval(rnd: int) -> dict[str, Any]:
            ev = self.evaluate_global()
            if evaluate_fn is not None:
                extra = evaluate_fn(rnd, self.result_arrays())
                if extra is not None:
                    ev.update(dict(extra))
            return ev

        if start_round == 1:
            result.evaluate_metrics_serverapp[0] = MetricRecord(metric_safe(server_eval(0)))
        t_start = time.time()
        if self.stopped_at:   # a resumed run that had reached stop-accuracy is over
            log(INFO, "the run stopped at round %d on reaching stop-accuracy: no more rounds", self.stopped_at)
        for rnd in range(num_rounds + 1 if self.stopped_at else start_round, num_rounds + 1):
            t0 = time.time()
            self.dropped = []
            self.window.begin_round()
            before = self.guard.snapshot()   # a diverged round is rolled back to it (strategies.core.round_guard)
            with self.clock.round(rnd) as clock_metrics:
                metrics = self.run_round(rnd, grid)
                federated = federated_evaluation(self, rnd, grid)
            metrics.update(clock_metrics)
            failure = self.window.common_failure() if metrics.get("skipped") else None
            if failure is not None:   # a setup error every node meets is not a fault to tolerate
                raise RoundFailedError(f"round {rnd}: every node it sent an instruction failed with the same "
                                       f"error, so the run stops: {failure}")
            self.guard.check(rnd, metrics, before, "train-loss")
            metrics.update(self.meter.flush())
            metrics["dropped"] = sorted(set(self.dropped))
            ev = {**(server_eval(rnd) if self.evaluates_round(rnd) else {}), **federated}
            if "loss" in ev and self.guard.check(rnd, {**metrics, "loss": ev["loss"]}, before, "loss"):
                metrics.update(diverged=1, skipped=1)
                ev = {**server_eval(rnd), **federated}   # the model from before the round
            metrics.update(ev)
            stop = reached_target(ev, self.policy.stop_accuracy)
            if stop:   # before on_round_end: the round's checkpoint and metrics line say so
                self.stopped_at = rnd
                metrics["stopped-at-target"] = 1
            metrics["round-seconds"] = time.time() - t0
            result.train_metrics_clientapp[rnd] = MetricRecord(metric_safe(metrics))
            result.evaluate_metrics_serverapp[rnd] = MetricRecord(metric_safe(ev))
            if federated:
                result.evaluate_metrics_clientapp[rnd] = MetricRecord(metric_safe(federated))
            if on_round_end is not None:
                on_round_end(rnd, metrics)
            log(INFO, "%s", progress_line(rnd, num_rounds, metrics, time.time() - t_start, rnd - start_round + 1))
            if stop:
                log(INFO, "round %d reached stop-accuracy=%s: the run stops here", rnd, self.policy.stop_accuracy)
                break
        result.arrays = self.result_arrays()
        return result


def reached_target(ev: dict[str, Any], stop_accuracy: float) -> bool:
    """Whether a round's evaluation ``ev`` ends a run with ``stop-accuracy`` set (0: never)."""
    acc = ev.get("accuracy")
    return bool(stop_accuracy) and isinstance(acc, (int, float)) and acc >= stop_accuracy


def progress_line(rnd: int, total: int, metrics: dict, elapsed: float, done_rounds: int) -> str:
    """The one line per round every app using a strategy logs (Flower's log, ``flwr run --stream``)."""
    eta = elapsed / max(done_rounds, 1) * (total - rnd)
    acc = f"acc {metrics['accuracy']:.4f}" if "accuracy" in metrics else "not evaluated"
    # the test loss where the round measured one; personalised rows (each client's own model on
    # its own split) report none, and "loss nan" there read as a diverged run: the training loss
    # is named as such instead, or nothing
    loss_key = next((k for k in ("loss", "train-loss") if k in metrics), None)
    loss = f" | {loss_key} {metrics[loss_key]:.4f}" if loss_key else ""
    extra = f" | dropped {metrics['dropped']}" if metrics.get("dropped") else ""
    if metrics.get("skipped"):
        extra += " | SKIPPED"
    sim = f" | sim {metrics['sim-seconds-total']:.1f}s" if "sim-seconds-total" in metrics else ""
    return (f"round {rnd}/{total} | {acc}{loss} | "
            f"{metrics.get('round-seconds', 0.0):.1f}s{sim} | ETA {eta:.0f}s{extra}")
