"""The shared server-side base of every algorithm in this library: :class:`BaseStrategy`.

``BaseStrategy`` is a :class:`flwr.serverapp.strategy.Strategy` whose ``start()`` runs
the same round loop for all algorithms, with what Flower's loop lacks and every paper
here needs:

* seeded node sampling (``fraction-train``, ``min-nodes``) and a per-round timeout;
* fault handling: an error reply or a node that misses the timeout is dropped from the
  round with a logged warning and recorded in the round's metrics (``dropped``); a round
  with fewer than ``min-nodes`` usable replies is skipped cleanly (no aggregation);
* byte accounting by kind and direction (``bytes.<kind>.<up|down>``) for every message;
* server-side evaluation of the global model on the held-out test set each round;
* resumable state (``state_dict``/``load_state_dict``) and an ``on_round_end`` hook,
  used by ``flower_apps`` to write metrics and atomic checkpoints.

A subclass overrides only what differs (as Flower's FedProx only adds to FedAvg):
``configure_train``/``aggregate_train`` for full-model algorithms, or ``run_round`` when
the round itself has another shape (server-only training). Split algorithms subclass
:class:`SplitStrategy`: this base with the split layer's round
(:class:`split_layer.runtime.SplitRuntime`) mixed in.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import time
import uuid
from logging import INFO, WARNING
from typing import Any, Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from split_layer.records import (
    ALGO_KEY,
    ARRAYS_KEY,
    CONFIG_KEY,
    COUNT_WORK_KEY,
    EVAL_ACTIONS,
    INFO_ACTIONS,
    METRICS_KEY,
    NODE_INFO,
    TASK_KEY,
    WORK_KEY,
    model_to_record,
    query,
    record_to_numpy,
)
from split_layer.rounds import (
    ByteMeter,
    NodeDirectory,
    RoundPolicy,
    _metric_safe,
    array_bytes,
    describe_error,
)
from split_layer.runtime import SplitRuntime
from strategies.deadlines import ReplyDeadlines, WallClock
from strategies.partition_count import settle_partitions, wait_for
from strategies.round_guard import RoundGuard
from tasks.aggregate import RunningWeightedMean
from tasks.config import ConfigError, TaskConfig, fields_of, replace_checked, to_flat
from tasks.env import Env, NodeData, library_env, user_env
from tasks.system import RoundClock, load_system
from tasks.training import derive_seed, evaluate, load_numpy_state

__all__ = ["BaseStrategy", "SplitStrategy", "RoundPolicy"]


class BaseStrategy(Strategy):
    """Base strategy: round loop, sampling, faults, bytes, evaluation, checkpoints.

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

    label_mode: str = "all"      # how the partition plan labels data (tasks.partition.LABEL_MODES)
    uses_clients: bool = True    # False for server-only baselines (supervised-only)
    #: the server trains on its own labels before a round's first message (Semi-SFL's stage A,
    #: SemiFL's and FedSwitch's server stage), so the first weights a node receives are not
    #: ``initial_arrays`` themselves (the round-0 evaluation still is)
    server_trains_first: bool = False
    with_client_test: bool = False
    staged: bool = False         # split algorithms: models are StagedModels (tasks.models.as_staged)
    #: registry name -> spec of every algorithm this class runs, its own first (set by
    #: ``strategies.registry.bind``); a spec builds the config: ``spec.build_config(cfg, options)``
    specs: dict[str, Any] = {}

    def __init__(self, task: TaskConfig | None = None, cfg: Any = None, algo: str | None = None,
                 policy: RoundPolicy | None = None, *, model: Any = None, labeled_data: Any = None,
                 test_data: Any = None, num_classes: int | None = None, augmenter: Any = None,
                 flip: bool = False, **options: Any) -> None:
        specs = type(self).specs
        if algo is None:
            algo = next(iter(specs), type(self).__name__)
        elif specs and algo not in specs:
            raise ConfigError(f"algo={algo!r} is not run by {type(self).__name__}; it runs: {', '.join(specs)}")
        policy = policy or RoundPolicy()
        task = task or TaskConfig()
        by_target: dict[str, dict[str, Any]] = {"policy": {}, "task": {}, "algo": {}}
        policy_names = {f.name for f, _ in fields_of(RoundPolicy)}
        task_names = {f.name for f, _ in fields_of(TaskConfig)}
        for name, value in options.items():
            target = "policy" if name in policy_names else "task" if name in task_names else "algo"
            by_target[target][name] = value
        spec = specs.get(algo)
        algo_names = {f.name for f, _ in fields_of(spec.config_cls)} if spec is not None and spec.config_cls else set()
        unknown = sorted(set(by_target["algo"]) - algo_names)
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) {', '.join(unknown)}; "
                            f"options of algo={algo!r}: {', '.join(sorted(algo_names)) or 'none'}; task: "
                            f"{', '.join(sorted(task_names))}; rounds: {', '.join(sorted(policy_names))}")
        if spec is not None:
            cfg = spec.build_config(cfg, by_target["algo"])
        if by_target["policy"]:
            policy = replace_checked(policy, **by_target["policy"])
        if by_target["task"]:
            task = replace_checked(task, **by_target["task"])
        self.task, self.cfg, self.algo = task, cfg, algo
        self.policy = policy
        self.user = None
        if model is not None:
            self.user = dict(model=model, data=NodeData.of(labeled=labeled_data, test=test_data),
                             num_classes=num_classes, augmenter=augmenter, flip=flip)
        elif labeled_data is not None or test_data is not None:
            raise ConfigError("labeled_data/test_data are a user's own data: pass your model too (model=...)")
        self.meter = ByteMeter()
        self.env: Env | None = None
        self.model: torch.nn.Module | None = None
        self.dropped: list[int] = []
        self.num_partitions = 0
        self.directory = NodeDirectory()   # who each node is: partition id (+ a split node's statistics)
        self._asked: set[int] = set()
        self.train_config: dict[str, Any] = {}     # Flower's start(train_config=...): in every training message
        self.evaluate_config: dict[str, Any] = {}  # Flower's start(evaluate_config=...): in evaluation messages
        self.initial_given = False                 # start(initial_arrays=...) was used
        self.num_rounds = 0                        # start()'s num_rounds: the horizon of schedules
        self.state_key = uuid.uuid4().hex          # names this run's node-side state (kept on resume)
        self.session = uuid.uuid4().hex            # one per start(): nodes restore saved state on a new one
        self.clock: RoundClock | None = None       # the simulated system's clock (policy.system; start())
        self.timer = WallClock()                   # what waits read and sleep on (tests drive their own)
        self.warm_nodes: set[int] = set()          # nodes that answered in this run (strategies.deadlines)
        self.guard = RoundGuard(self)              # upload bound, divergence roll-back (strategies.round_guard)
        self._sim_total = 0.0                      # simulated seconds of the rounds before a resume
        if self.user is not None:
            # the user's model and data are all there is to check: every setup error (missing
            # labeled_data, a model the algorithm cannot use, bad images) is raised here, in the
            # constructor, not at the first round of a run
            self.setup(None)

    # ------------------------------------------------------------------ setup
    def setup(self, grid: Grid | None) -> None:
        """Build the server environment and the global model (idempotent)."""
        if self.env is not None:
            return
        if grid is not None and self.uses_clients:   # the count the nodes state (strategies.partition_count)
            self.num_partitions = settle_partitions(self, grid)
        else:
            self.num_partitions = max(self.policy.min_nodes, 1)
        self.env = self.make_env()
        self.model = self.env.build_model()
        self.setup_algorithm()

    def make_env(self) -> Env:
        """The server's Env: the user's model and data (``model=...``), else the library's
        dataset named by the task config, partitioned over the nodes' ``num-partitions``."""
        if self.user is not None:
            u = self.user
            return user_env(self.task, u["model"], u["data"], num_classes=u["num_classes"],
                            augmenter=u["augmenter"], flip=u["flip"], staged=self.staged)
        return library_env(self.task, self.num_partitions, self.label_mode, self.with_client_test)

    def begin_run(self) -> None:
        """Hook: ``start()`` calls it after :meth:`setup`, before the first round, with
        ``self.num_rounds`` set (e.g. schedules over the run's rounds)."""

    def setup_algorithm(self) -> None:
        """Hook for subclasses: extra server-side models, optimizers, queues."""

    def wait_for_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes once ``min-nodes`` are (``wait-for-nodes`` seconds, else a ``ConfigError``)."""
        return wait_for(self, grid, self.policy.min_nodes, self.timer.now() + self.policy.wait_for_nodes,
                        f"min-nodes={self.policy.min_nodes} asks for")

    # ------------------------------------------------------------------ messaging
    def sample_nodes(self, grid: Grid, server_round: int) -> list[int]:
        """``fraction-train`` of the nodes, drawn by a seeded RNG over the nodes in partition order.

        Simulated SuperNodes get random ids (partition ids in creation order), so drawing over
        sorted node ids would pick other partitions in every run; the partition ids are asked
        once per node (``node-info``) when not all nodes are sampled. Nodes that do not answer
        it (e.g. a ClientApp without that handler) come last, in node-id order.
        """
        nodes = self.connected_nodes(grid)
        k = self.sample_size(len(nodes))
        if k == len(nodes):
            if self.clock is not None:   # the system's draws are keyed by partition id (tasks.system)
                self.learn_partitions(grid, nodes, server_round=server_round)
            return nodes
        self.learn_partitions(grid, nodes, server_round=server_round)
        part = self.directory.partitions()
        ordered = sorted(nodes, key=lambda n: (part.get(n, 1 << 62), n))
        rng = random.Random(derive_seed(self.task.seed, "sample", server_round))
        return sorted(rng.sample(ordered, k))

    def connected_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, sorted; fewer than ``min-nodes``: wait for them (``wait-for-nodes``)."""
        nodes = sorted(grid.get_node_ids())
        return nodes if len(nodes) >= self.policy.min_nodes else self.wait_for_nodes(grid)

    def sample_size(self, num_nodes: int) -> int:
        """How many of ``num_nodes`` nodes a round samples: ``fraction-train`` of them, at least
        ``min-nodes``, at most all."""
        return min(max(self.policy.min_nodes, int(round(self.policy.fraction_train * num_nodes))), num_nodes)

    def learn_partitions(self, grid: Grid, nodes: list[int], poll: float = 0.01, server_round: int = 0) -> list[int]:
        """How the server learns which partition a node holds: nodes not asked before get one
        ``node-info`` query each (every ClientApp of this library answers it in
        ``flower_apps.client_app.dispatch``), noted in the node directory (``partition_of``,
        ``partition_count``: the nodes' ``num-partitions``). Returns the nodes of ``nodes``
        whose partition is known (a node that does not answer is asked once, never again).
        A split strategy asks its own ``split-info`` instead
        (:meth:`split_layer.runtime.SplitRuntime.learn_partitions`)."""
        todo = [n for n in nodes if n not in self._asked and n not in self.directory]
        if not todo:
            return [n for n in nodes if n in self.directory]
        self._asked.update(todo)
        msgs = [query(self.base_content(0, action=NODE_INFO), n, NODE_INFO) for n in todo]

        def note(r: Message) -> None:
            if CONFIG_KEY in r.content.config_records:   # (else sampled after the nodes that answered)
                info = r.content.config_records[CONFIG_KEY]
                self.note_partition(r.metadata.src_node_id, info["partition-id"], info["num-partitions"])

        self._exchange(grid, msgs, note, min(self.policy.round_timeout, 120.0), poll, optional=True)
        return [n for n in nodes if n in self.directory]

    def note_partition(self, node: int, partition_id: Any, num_partitions: Any = 0) -> None:
        """Record what a node said of its partition (``node-info``, or an algorithm's own query
        that carries it) in the node directory."""
        self.directory.note(node, partition_id, num_partitions)

    @property
    def partition_of(self) -> dict[int, int]:
        """node id -> partition id of every node known (a view of the node directory)."""
        return self.directory.partitions()

    @property
    def partition_count(self) -> int:
        """The nodes' ``num-partitions`` (0 until a node said it)."""
        return self.directory.num_partitions

    def base_content(self, server_round: int, action: str = "train", **config: Any) -> RecordDict:
        """The records of a message for ``action``: the task, the algorithm config, and the
        config (Flower's ``train_config``/``evaluate_config`` by action, then the round's values)."""
        user = ({} if action in INFO_ACTIONS else self.evaluate_config if action in EVAL_ACTIONS
                else self.train_config)
        cfg = {**user, "server-round": server_round, "algo": self.algo, "state-key": self.state_key,
               "state-session": self.session, **config}
        if self.clock is not None:   # nodes count their FLOPs and steps (tasks.system.count_work)
            cfg[COUNT_WORK_KEY] = True
        if self.env is not None:
            cfg.setdefault("num-classes", self.env.num_classes)
        task, algo = self._shared_records()
        return RecordDict({TASK_KEY: task, ALGO_KEY: algo, CONFIG_KEY: ConfigRecord(cfg)})

    def _shared_records(self) -> tuple[ConfigRecord, ConfigRecord]:
        """The task and algorithm records, the same in every message while the task and the
        algorithm config say the same: built once and shared (a round sends one per sampled
        node, and building a record checks every value), rebuilt when a value changed."""
        flat = (to_flat(self.task), self.algo_flat())
        cached = getattr(self, "_records_cache", None)
        if cached is None or cached[0] != flat:
            cached = (flat, (ConfigRecord(flat[0]), ConfigRecord(flat[1])))
            self._records_cache = cached
        return cached[1]

    def algo_flat(self) -> dict[str, Any]:
        from tasks.config import to_flat
        return to_flat(self.cfg) if self.cfg is not None else {}

    def exchange(self, grid: Grid, messages: Iterable[Message], timeout: float | None = None,
                 poll: float = 0.01) -> list[Message]:
        """Send ``messages``, collect the good replies (the windowed loop of :meth:`exchange_fold`).

        Error replies and missing replies are logged, and their nodes are added to
        ``self.dropped`` for this round. Only good replies are returned.
        """
        out: list[Message] = []
        self.exchange_fold(grid, messages, out.append, timeout, poll)
        return out

    def exchange_fold(self, grid: Grid, messages: Iterable[Message], fold: Callable[[Message], None],
                      timeout: float | None = None, poll: float = 0.01) -> int:
        """Send ``messages`` with at most :meth:`in_flight` of them out at once (refilled as replies
        come back) and hand each good reply to ``fold`` as it arrives, then let it go; returns how
        many were folded. An error reply, and a node that has not replied ``timeout`` (default
        ``round-timeout``) seconds after its instruction was sent (plus ``startup-timeout`` for
        its first instruction of the run: :mod:`strategies.deadlines`), drop their node from the
        round (logged, ``dropped``); an instruction waiting for a free slot is not late."""
        timeout = self.policy.round_timeout if timeout is None else timeout
        messages = list(messages)
        if not messages:
            return 0
        with self.clock_stage():
            return self._exchange(grid, messages, fold, timeout, poll)

    #: seconds of replies kept in flight by the auto window in a simulation. Flower's simulation
    #: engine takes new instructions in by scanning its LinkState for every node, then waiting
    #: 0.1 s; each scan walks every stored instruction once per node (``get_message_ins``), under
    #: the ServerApp process's GIL. So the window must cover one such period (else the ClientApps
    #: wait for work) and no more: each instruction more out makes every scan longer. Measured with
    #: ``bench/scale.py`` (500 and 1,000 ``cnn`` clients, 2 CPUs): 0.1 s starves the workers, 0.2-0.3
    #: s is fastest, 0.5 s is 5-15% slower, and every instruction at once (Flower's strategies)
    #: 50-70% slower.
    IN_FLIGHT_SECONDS = 0.25

    #: how an exchange waits for replies: it pulls every ``poll`` seconds (0.01) for the first
    #: ``POLL_FAST_SECONDS`` after a reply or the push, then less often the longer nothing came
    #: (``POLL_BACKOFF`` x the time since the last reply), at most every ``POLL_MAX_SECONDS``
    #: (Flower's own in-memory grid pulls every 0.1 s). A reply that comes within 0.4 s (a split
    #: exchange, a small model's round) is noticed within ``poll``, as with a fixed poll; a later
    #: one at most 0.1 s late (at most 25%). A round of large models no longer wakes this thread
    #: 100 times a second for seconds on end: each wake-up takes the GIL from the threads that hand
    #: messages to the ClientApps (measured with ``py-spy`` on ``bench/scale.py``'s library side,
    #: ResNet-18 at 10 clients). ``bench/split_overhead.py --poll-variants`` measures the policies
    #: side by side on split rounds.
    POLL_FAST_SECONDS = 0.4
    POLL_BACKOFF = 0.25
    POLL_MAX_SECONDS = 0.1

    def poll_interval(self, waited: float, poll: float) -> float:
        """Seconds to sleep before the next pull, ``waited`` seconds after the last reply."""
        if waited < self.POLL_FAST_SECONDS:
            return poll
        return min(max(poll, self.POLL_BACKOFF * waited), max(poll, self.POLL_MAX_SECONDS))

    def in_flight(self, grid: Grid, num_messages: int, replies_per_second: float = 0.0) -> int:
        """How many of a round's ``num_messages`` instructions are out at once (run-config
        ``max-in-flight``; 0 = auto). Auto, in Flower's simulation engine and the in-process
        engine, where the ClientApps share this machine's CPUs: twice its CPU count, or the
        replies of :attr:`IN_FLIGHT_SECONDS` at the rate they came so far in this exchange if
        that is more, so that the workers never wait for the next instruction while the server
        holds that many instructions and replies, not one per sampled node (nor ``min-nodes``:
        the window only bounds what is out at once, the round still waits for every reply).
        Auto in a deployment: every node runs on its own machine, so all are sent at once (the
        SuperLink holds them; each reply is still folded in as it arrives)."""
        if self.policy.max_in_flight > 0:
            return self.policy.max_in_flight
        if type(grid).__name__ in ("InMemoryGrid", "LocalGrid"):
            return max(2 * (os.cpu_count() or 1), math.ceil(replies_per_second * self.IN_FLIGHT_SECONDS))
        return max(num_messages, 1)

    def clock_stage(self):
        """One stage of the simulated clock (a no-op context without one): an exchange."""
        return self.clock.stage() if self.clock is not None else contextlib.nullcontext()

    def node_key(self, node: int) -> int:
        """The node's stable key for the simulated system's draws: its partition id where known
        (simulated node ids are random), else its node id."""
        entry = self.directory.get(node) if node in self.directory else None
        return int(entry["partition"]) if entry is not None else int(node)

    def _exchange(self, grid: Grid, messages: list[Message], fold: Callable[[Message], None], timeout: float,
                  poll: float, optional: bool = False) -> int:
        """:meth:`exchange_fold`'s loop; ``optional``: a query whose answer a node may not give (a node
        that fails it is not dropped)."""
        window = self.in_flight(grid, len(messages))
        queue = iter(messages)
        unsent = len(messages)
        out = ReplyDeadlines(timeout, self.policy.startup_timeout, self.warm_nodes, self.timer)
        folded = answered = 0
        start = last = self.timer.now()
        self.guard.begin_exchange()
        while len(out) or unsent:
            for node, allowed in out.expired():   # each instruction's own clock (strategies.deadlines)
                if optional:
                    continue
                first = " (its first: round-timeout + startup-timeout)" if allowed > timeout else ""
                self.drop(node, f"no reply within {allowed:.0f} s of its instruction{first}")
                if self.clock is not None:
                    self.clock.missing(self.node_key(node))
            if unsent and answered:
                window = self.in_flight(grid, len(messages), answered / max(self.timer.now() - start, 1e-6))
            if unsent and len(out) < window:
                batch = [m for _, m in zip(range(min(window - len(out), unsent)), queue)]
                unsent -= len(batch)
                for mid, m in zip(grid.push_messages(batch), batch):
                    out.sent(mid, m.metadata.dst_node_id)
                    self.count_bytes(m, "down")
            arrived = False
            for r in grid.pull_messages(out.ids()):
                rid = r.metadata.reply_to_message_id
                if rid not in out:
                    continue
                arrived = True
                answered += 1
                node = out.answered(rid)
                if r.has_error():
                    if not optional:
                        self.drop(node, f"error {r.error.code}: {describe_error(r.error.reason or '')}")
                    continue
                self.count_bytes(r, "up")
                self.note_work(r)
                refused = self.guard.refused_upload(r)
                if refused is not None:
                    self.drop(node, refused)
                    continue
                fold(r)
                folded += 1
            now = self.timer.now()
            if arrived:
                last = now
            elif len(out) or unsent:
                self.timer.sleep(self.poll_interval(now - last, poll))
        return folded

    def note_work(self, reply: Message) -> None:
        """The simulated clock's share of a reply: the work its node counted (``work`` record)."""
        if self.clock is None or WORK_KEY not in reply.content.metric_records:
            return
        w = reply.content.metric_records[WORK_KEY]
        self.clock.add_work(self.node_key(reply.metadata.src_node_id), float(w.get("flops", 0.0)),
                            float(w.get("steps", 0.0)))

    def count_bytes(self, msg: Message, direction: str) -> None:
        """The one place a message's model weights are counted (by :meth:`exchange`, as the
        message leaves or its reply arrives), by :meth:`record_kind` and direction. A split
        round's payloads are counted where they cross too, by the split runtime
        (:meth:`split_layer.runtime.SplitRuntime.exchange_payloads`)."""
        for key, rec in msg.content.array_records.items():
            kind = self.record_kind(key, msg, direction)
            if kind is not None:
                self.meter.add_record(kind, direction, rec)
                if self.clock is not None:
                    node = msg.metadata.dst_node_id if direction == "down" else msg.metadata.src_node_id
                    self.clock.add_bytes(self.node_key(node), direction, array_bytes(rec))

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        """The byte kind of array record ``key`` of ``msg`` (``None``: not counted here). Default:
        the model weights (``ARRAYS_KEY``) are ``weights``; override for other kinds."""
        return "weights" if key == ARRAYS_KEY else None

    def drop(self, node: int, why: str) -> None:
        """Drop ``node`` from this round: a logged warning, and the round's ``dropped`` metric."""
        log(WARNING, "node %s dropped from round: %s", node, why)
        self.dropped.append(node)

    # ------------------------------------------------------------------ FedAvg-style round
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

    #: reply metrics averaged (weighted by ``num-examples``) into the round's metrics
    reply_metrics: tuple[str, ...] = ("train-loss",)

    def load_aggregate(self, state: dict[str, np.ndarray]) -> None:
        """Hook: put the aggregated state into the global model (e.g. only the shared body)."""
        load_numpy_state(self.model, state)

    def train_fold(self, server_round: int) -> "TrainFold":
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

    def _own_aggregate_train(self) -> bool:
        """Whether a subclass overrides ``aggregate_train`` without a :meth:`train_fold` of its own
        (a user's Flower-style strategy): its round then collects every reply and passes the list."""
        cls = type(self)
        return cls.aggregate_train is not BaseStrategy.aggregate_train and cls.train_fold is BaseStrategy.train_fold

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is centralised on the server test set (evaluate_global)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log(INFO, "%s: %s", type(self).__name__, self.task)

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        """One round; returns its metrics. Default: FedAvg-style train round."""
        msgs = list(self.configure_train(server_round, self.global_arrays(), ConfigRecord(), grid))
        if self._own_aggregate_train():   # a subclass's aggregate_train needs the replies together
            replies = self.exchange(grid, msgs)
            folded = len(replies)
            arrays, metrics = self.aggregate_train(server_round, replies)
        else:
            fold = self.train_fold(server_round)
            folded = self.exchange_fold(grid, msgs, fold.add)
            arrays, metrics = fold.finish()
        out: dict[str, Any] = {"participants": folded}
        if arrays is None:
            out["skipped"] = 1
            log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round,
                folded, self.policy.min_nodes)
        if metrics is not None:
            out.update(dict(metrics))
        return out

    # ------------------------------------------------------------------ evaluation
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

    def eval_model(self) -> torch.nn.Module:
        """The model whose test accuracy is the run's result (override: e.g. EMA teacher)."""
        return self.model

    #: the name of :meth:`eval_model` in the metrics (``<name>-accuracy`` beside ``accuracy``),
    #: where another model is also evaluated (:meth:`also_evaluated`): e.g. ``"teacher"``
    eval_name: str = ""

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

    def result_arrays(self) -> ArrayRecord:
        """What ``start`` returns as ``Result.arrays`` and passes to ``evaluate_fn``: the
        evaluated model (override: per-client models of a personalized algorithm)."""
        return model_to_record(self.eval_model())

    def load_initial_arrays(self, arrays: ArrayRecord) -> None:
        """``start(initial_arrays=...)``: the global model starts from them, and so does every
        model derived from it (teacher, server part, optimizer state): the algorithm is set up again."""
        load_numpy_state(self.model, record_to_numpy(arrays))
        self.initial_given = True
        self.setup_algorithm()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume after the last completed round (every random draw of a
        round is seeded by :func:`tasks.training.derive_seed` from the run seed and the round,
        so no RNG state is kept)."""
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                "state-key": self.state_key, "initial-given": self.initial_given,
                "sim-seconds-total": self.clock.total if self.clock is not None else self._sim_total,
                "extra": self.extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (a checkpoint of an older version may hold an ``"rng"``
        entry: it is ignored)."""
        self.model.load_state_dict(state["model"])
        self.state_key = str(state.get("state-key", self.state_key))
        self.initial_given = bool(state.get("initial-given", False))
        self._sim_total = float(state.get("sim-seconds-total", 0.0))
        if self.clock is not None:
            self.clock.total = self._sim_total
        self.load_extra_state(state.get("extra", {}))

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

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
        is called for round 0 and after every round with what ``Result.arrays`` returns,
        and its metrics join the round's server metrics. Plus ``start_round`` and
        ``on_round_end`` for resuming and for writing results (``initial_arrays`` only
        applies to a run that starts at round 1).
        """
        if timeout is not None:
            self.policy.round_timeout = float(timeout)
        self.train_config = dict(train_config or {})
        self.evaluate_config = dict(evaluate_config or {})
        self.session = uuid.uuid4().hex
        self.num_rounds = int(num_rounds)
        self.setup(grid)
        system = load_system(self.policy.system)
        self.policy.validate()
        self.clock = None if system is None else RoundClock(system, self.task.seed, self.policy.round_timeout)
        if self.clock is not None:
            self.clock.total = self._sim_total
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
            result.evaluate_metrics_serverapp[0] = MetricRecord(_metric_safe(server_eval(0)))
        t_start = time.time()
        for rnd in range(start_round, num_rounds + 1):
            t0 = time.time()
            self.dropped = []
            before = self.guard.snapshot()   # a diverged round is rolled back to it (strategies.round_guard)
            if self.clock is None:
                metrics = self.run_round(rnd, grid)
            else:
                self.clock.begin_round(rnd)
                with self.clock.server_work():
                    metrics = self.run_round(rnd, grid)
                metrics.update(self.clock.end_round())
            self.guard.check(rnd, metrics, before, "train-loss")
            metrics.update(self.meter.flush())
            metrics["dropped"] = sorted(set(self.dropped))
            ev = server_eval(rnd)
            if "loss" in ev and self.guard.check(rnd, {**metrics, "loss": ev["loss"]}, before, "loss"):
                metrics.update(diverged=1, skipped=1)
                ev = server_eval(rnd)   # the model from before the round
            metrics.update(ev)
            metrics["round-seconds"] = time.time() - t0
            result.train_metrics_clientapp[rnd] = MetricRecord(_metric_safe(metrics))
            result.evaluate_metrics_serverapp[rnd] = MetricRecord(_metric_safe(ev))
            if on_round_end is not None:
                on_round_end(rnd, metrics)
            log(INFO, "%s", progress_line(rnd, num_rounds, metrics, time.time() - t_start, rnd - start_round + 1))
        result.arrays = self.result_arrays()
        return result


class TrainFold:
    """One round's train replies folded in as they arrive (:meth:`BaseStrategy.train_fold`): the
    weighted mean of the uploaded states (``ARRAYS_KEY``) and of the strategy's
    ``reply_metrics``, kept as running float64 sums (:class:`tasks.aggregate.RunningWeightedMean`),
    so the server holds one model's worth of sums however many nodes reply. Weights: each
    reply's ``num-examples`` (FedAvg), or 1 (``uniform=True``). :meth:`finish` loads the mean
    into the global model (``strategy.load_aggregate``) and returns Flower's ``(arrays,
    metrics)``; fewer than ``min-nodes`` replies, or no weight: ``(None, None)``."""

    def __init__(self, strategy: BaseStrategy, uniform: bool = False) -> None:
        self.strategy, self.uniform = strategy, uniform
        self.mean = RunningWeightedMean()
        self.values = {k: [0.0, 0.0] for k in strategy.reply_metrics}   # sum w v, sum w
        self.count = 0

    def weight(self, metrics: MetricRecord) -> float:
        return 1.0 if self.uniform else float(metrics["num-examples"])

    def add(self, reply: Message) -> None:
        met = reply.content.metric_records[METRICS_KEY]
        w = self.weight(met)
        self.mean.add(record_to_numpy(reply.content.array_records[ARRAYS_KEY]), w)
        for k, acc in self.values.items():
            acc[0] += w * float(met.get(k, float("nan")))
            acc[1] += w
        self.count += 1

    def finish(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        s = self.strategy
        if self.count < s.policy.min_nodes or self.mean.total <= 0:
            return None, None
        s.load_aggregate(self.mean.result())
        return s.global_arrays(), MetricRecord({k: a / b if b > 0 else math.nan for k, (a, b) in self.values.items()})


class SplitStrategy(SplitRuntime, BaseStrategy):
    """The base of split algorithms: :class:`BaseStrategy`'s loop with the split layer's round
    (:class:`split_layer.runtime.SplitRuntime`: begin, I fused exchanges, end, aggregate)."""


def progress_line(rnd: int, total: int, metrics: dict, elapsed: float, done_rounds: int) -> str:
    """The one line per round every app using a strategy logs (Flower's log, ``flwr run --stream``)."""
    eta = elapsed / max(done_rounds, 1) * (total - rnd)
    acc = metrics.get("accuracy", float("nan"))
    # the test loss where the round measured one; personalised rows (each client's own model on
    # its own split) report none, and "loss nan" there read as a diverged run: the training loss
    # is named as such instead, or nothing
    loss_key = next((k for k in ("loss", "train-loss") if k in metrics), None)
    loss = f" | {loss_key} {metrics[loss_key]:.4f}" if loss_key else ""
    extra = f" | dropped {metrics['dropped']}" if metrics.get("dropped") else ""
    if metrics.get("skipped"):
        extra += " | SKIPPED"
    sim = f" | sim {metrics['sim-seconds-total']:.1f}s" if "sim-seconds-total" in metrics else ""
    return (f"round {rnd}/{total} | acc {acc:.4f}{loss} | "
            f"{metrics.get('round-seconds', 0.0):.1f}s{sim} | ETA {eta:.0f}s{extra}")
