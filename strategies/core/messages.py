"""The records every message of a run carries: :class:`MessageContent` (the task, the algorithm
config and the per-message config), with the task and algorithm records built once and shared
while their values stay the same."""
from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord, RecordDict

from tasks.config import to_flat

from .records import ALGO_KEY, CONFIG_KEY, COUNT_WORK_KEY, EVAL_ACTIONS, TASK_KEY

__all__ = ["MessageContent"]


class MessageContent:
    """Builds ``strategy``'s message records (its ``task``, ``cfg``, ``algo``, ``state_key``,
    ``session``, ``train_config``/``evaluate_config``, ``clock``, ``env`` and ``info_actions``)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self._cache: tuple[tuple[dict, dict], tuple[ConfigRecord, ConfigRecord]] | None = None

    def build(self, server_round: int, action: str = "train", **config: Any) -> RecordDict:
        """The records of a message for ``action``: the task, the algorithm config, and the
        config (Flower's ``train_config``/``evaluate_config`` by action, none for an action that
        asks a node about itself, then the round's values)."""
        s = self.strategy
        user = ({} if action in s.info_actions else s.evaluate_config if action in EVAL_ACTIONS
                else s.train_config)
        cfg = {**user, "server-round": server_round, "algo": s.algo, "state-key": s.state_key,
               "state-session": s.session, **config}
        if s.clock.active:   # nodes count their FLOPs and steps (tasks.system.count_work)
            cfg[COUNT_WORK_KEY] = True
        if s.env is not None:
            cfg.setdefault("num-classes", s.env.num_classes)
        task, algo = self.shared_records()
        return RecordDict({TASK_KEY: task, ALGO_KEY: algo, CONFIG_KEY: ConfigRecord(cfg)})

    def shared_records(self) -> tuple[ConfigRecord, ConfigRecord]:
        """The task and algorithm records, the same in every message while the task and the
        algorithm config say the same: built once and shared (a round sends one per sampled
        node, and building a record checks every value), rebuilt when a value changed."""
        s = self.strategy
        flat = (to_flat(s.task), to_flat(s.cfg) if s.cfg is not None else {})
        if self._cache is None or self._cache[0] != flat:
            self._cache = (flat, (ConfigRecord(flat[0]), ConfigRecord(flat[1])))
        return self._cache[1]
