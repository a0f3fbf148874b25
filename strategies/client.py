"""The client side of an algorithm for a user's own model and own data.

Each algorithm module has a small subclass of :class:`AlgorithmClient` (``FedAvgClient``,
``SSFLClient``, ``SemiSFLClient``, ``ScalaClient``, ``FedSHVRClient``, ``UMPFSSLClient``)
that answers every message of that algorithm, and of its variants and baselines, with
the user's model and the node's own data::

    from flwr.app import Context
    from strategies.fedavg import FedAvgClient

    def node_data(context: Context):                  # this node's own sets
        x, y = load_my_shard(context.node_config)     # uint8 or float [N, C, H, H], int labels
        return {"labeled": (x, y)}

    app = FedAvgClient(model=MyNet(), data=node_data).app()   # a flwr.clientapp.ClientApp

or, in a ClientApp of your own, ``client.register(app)`` (registers ``train``,
``evaluate`` and each ``query.<action>`` the algorithm uses), or ``client.handle(msg, context)``
from your own handler.

``data`` is the node's :class:`tasks.env.NodeData` or a dict with the keys ``labeled``,
``unlabeled`` and ``test`` (each an ``(x, y)`` pair, images alone for ``unlabeled``, or a
dataset of ``(image, label)`` pairs: :func:`tasks.data.as_dataset`), or a function of
Flower's ``Context`` that returns one (called once per message, so in a deployment, where
each message runs in a fresh process, it should read the node's data, not download it).
Nothing but ``context.state`` is kept between messages.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    message_type,
    node_partition,
    node_source,
)
from tasks.augment import Augmenter
from tasks.config import ConfigError, TaskConfig
from tasks.env import Env, NodeData, check_user_model, user_augmenter, user_env, user_num_classes

from .registry import algorithm_for

DataSource = NodeData | dict | Callable[[Context], "NodeData | dict"]


class AlgorithmClient:
    """Answers one algorithm's messages with a user's model and the node's own data.

    Parameters
    ----------
    model : torch.nn.Module or a function returning one
        The same architecture as the server's (its weights come from the server). A split
        algorithm's model: a ``tasks.models.StagedModel``, a ``(bottom, top)`` pair, or an
        ``nn.Sequential`` (the server's ``cut`` names the child after which it is cut).
    data : NodeData, dict or function of Context
        The node's own sets (module docstring); which are needed: :attr:`needs`.
    num_classes : int, optional
        Default: the server's (every message carries it).
    augmenter : tasks.augment.Augmenter, optional
        Weak/strong views (default ``Augmenter(C, H, flip=flip)``).
    """

    module: str = ""                 # the algorithm module whose specs this client serves
    needs: tuple[str, ...] = ()      # data sets the node must have ("labeled", "unlabeled")

    def __init__(self, model: Any, data: DataSource, *, num_classes: int | None = None,
                 augmenter: Augmenter | None = None, flip: bool = False) -> None:
        self.model, self.data = model, data
        self.num_classes, self.augmenter, self.flip = num_classes, augmenter, flip
        self._envs: dict[tuple[int, TaskConfig, int | None], Env] = {}
        # what can be checked before a message comes is checked here, with the strategies' checks
        # (tasks.env.user_env): a model the algorithm cannot train; the sets it needs, images,
        # labels outside the model's classes (data given as a function of the node's Context:
        # at its first message)
        try:
            check_user_model(model, staged=self.staged, cut_known=False)
            if not callable(data):
                node = self.node_data(None)
                user_num_classes(model, node, num_classes)
                user_augmenter(node, augmenter, flip)
        except ConfigError as e:
            name = type(self).__name__
            raise ConfigError(str(e) if str(e).startswith(f"{name}: ") else f"{name}: {e}") from None

    @property
    def specs(self) -> dict[str, Any]:
        """The registry specs of the algorithms this client serves (its module's ``ALGORITHMS``)."""
        return importlib.import_module(self.module).ALGORITHMS

    def __getstate__(self) -> dict[str, Any]:
        # Flower's simulation sends the ClientApp to its Ray workers: the model and the data
        # function travel, the built environments do not
        return {**self.__dict__, "_envs": {}}

    # ------------------------------------------------------------------ the node's Env
    def node_data(self, context: Context) -> NodeData:
        data = self.data(context) if callable(self.data) else self.data
        if isinstance(data, dict):
            unknown = sorted(set(data) - {"labeled", "unlabeled", "test"})
            if unknown:
                raise ConfigError(f"node data: unknown set(s) {unknown}; allowed: labeled, unlabeled, test")
            data = NodeData.of(**data)
        if not isinstance(data, NodeData):
            raise ConfigError(f"node data must be a NodeData or a dict of sets, got {type(data).__name__}")
        missing = [k for k in self.needs if getattr(data, k) is None or len(getattr(data, k)) == 0]
        if missing:
            raise ConfigError(f"{type(self).__name__}: this node has no {' and no '.join(missing)} data; "
                              f"it needs: {', '.join(self.needs)}")
        return data

    def env(self, context: Context, task: TaskConfig, num_classes: int | None = None) -> Env:
        """The node's Env for a message with ``task`` and the server's ``num_classes`` (kept per
        node and task config: a simulation runs many nodes in one process)."""
        num_classes = self.num_classes or num_classes
        key = (context.node_id, task, num_classes)
        if key not in self._envs:
            pid, n = node_partition(context, required=False)
            self._envs[key] = user_env(
                task, self.model, self.node_data(context), num_classes=num_classes,
                augmenter=self.augmenter, flip=self.flip, staged=self.staged, partition_id=pid, num_partitions=n)
        return self._envs[key]

    @property
    def staged(self) -> bool:
        return any(getattr(s.strategy_cls, "staged", False) for s in self.specs.values())

    # ------------------------------------------------------------------ Flower's side
    def handle(self, msg: Message, context: Context) -> Message:
        """Answer ``msg`` (any action of this algorithm) with the user's model and data."""
        spec = algorithm_for(msg, self.specs, type(self).__name__)
        with node_source(self.env):
            return spec.handle(msg, context)

    @property
    def actions(self) -> list[str]:
        """Every action this client answers (``train``, ``evaluate``, query actions)."""
        return sorted({a for s in self.specs.values() for a in s.actions})

    def register(self, app: ClientApp) -> ClientApp:
        """Register :meth:`handle` on ``app`` for each of :attr:`actions` (Flower's routing by
        message type: ``train``, ``evaluate``, ``query.<action>``)."""
        return register_actions(app, self.actions, self.handle)

    def app(self) -> ClientApp:
        """A new ClientApp with this client registered."""
        return self.register(ClientApp())


def server_round(msg: Message) -> int:
    """The round a server message belongs to (its config's ``server-round``)."""
    return int(msg.content.config_records[CONFIG_KEY]["server-round"])


def reply(msg: Message, arrays: ArrayRecord | None = None, metrics: dict | None = None,
          config: dict | None = None) -> Message:
    """The reply to ``msg``: ``arrays`` (if given), ``metrics`` (always, maybe empty) and
    ``config`` (if given) under the library's record keys."""
    content = RecordDict()
    if arrays is not None:
        content[ARRAYS_KEY] = arrays
    content[METRICS_KEY] = MetricRecord(dict(metrics or {}))
    if config is not None:
        content[CONFIG_KEY] = ConfigRecord(config)
    return Message(content, reply_to=msg)


def client_app(*clients: AlgorithmClient) -> ClientApp:
    """One ClientApp for several algorithms: each message goes to the client that serves the
    algorithm it names (one client per algorithm module)."""
    by_algo: dict[str, AlgorithmClient] = {}
    for c in clients:
        for name in c.specs:
            if name in by_algo:
                raise ValueError(f"two clients serve algo={name!r}")
            by_algo[name] = c

    def handle(msg: Message, context: Context) -> Message:
        return algorithm_for(msg, by_algo).handle(msg, context)

    return register_actions(ClientApp(), sorted({a for c in clients for a in c.actions}), handle)


def register_actions(app: ClientApp, actions: list[str], handler: Callable[[Message, Context], Message]
                     ) -> ClientApp:
    """Register ``handler`` on ``app`` for each action (``train``, ``evaluate``, ``query.<action>``)."""
    for action in actions:
        category, _, name = message_type(action).partition(".")
        register = getattr(app, category)
        (register(name) if name else register())(handler)
    return app
