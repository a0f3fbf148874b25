"""The server side of personalised evaluation: each node's model on that node's own test split.

UM-pFSSL (:mod:`strategies.umpfssl.umpfssl`) and its FixMatch baselines
(:mod:`strategies.umpfssl.fixmatch_baselines`, :mod:`strategies.umpfssl.fixprox`) evaluate this way: the run's
``accuracy`` is the mean over clients and ``client-accuracy-var`` their variance (the paper's
fairness measure).

Client contract: an ``evaluate`` message carries what the node needs to rebuild its model
(:meth:`PersonalizedEvalStrategy.eval_payload`; ``arrays``, or nothing) and the reply's
``metrics`` carry ``accuracy``, ``num-examples`` and ``partition-id``
(:func:`evaluate_on_own_test`, the one client side of it).
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid

from strategies.core.records import ARRAYS_KEY, METRICS_KEY, client_env
from tasks.env import Env
from tasks.training import evaluate

from .base import BaseStrategy
from .client import reply


def personal_env(msg: Message, context: Context) -> Env:
    """The node's Env for personalised evaluation: the ``dir2`` partition (labeled and
    unlabeled shares per client) with the node's own test split."""
    return client_env(msg, context, label_mode="dir2", with_test=True)


def evaluate_on_own_test(msg: Message, env: Env, model: torch.nn.Module) -> Message:
    """The reply to an ``evaluate`` message: ``model``'s accuracy on the node's own test split."""
    test = env.client_test()
    res = evaluate(model, test, aug=env.augmenter, device=env.device, num_classes=env.num_classes)
    return reply(msg, None, {"accuracy": res["accuracy"], "num-examples": float(len(test)),
                             "partition-id": env.partition_id})


class PersonalizedEvalStrategy(BaseStrategy):
    """Shared server side of every variant: dir2 partition with per-client test splits, and
    per-client evaluation through Flower's evaluate hooks (``evaluate`` messages) every
    :meth:`eval_period` rounds and at the end.

    The round's ``accuracy`` is the mean of the clients' test accuracies (unweighted, as the
    paper), ``client-accuracies`` the list by partition id (``client-ids``), ``client-accuracy-var`` the
    population variance.
    """

    label_mode = "dir2"
    with_client_test = True

    def __init__(self, *a, **kw) -> None:
        self.last_eval: dict[str, Any] = {}    # (set before the base's __init__, which sets a user's model up)
        super().__init__(*a, **kw)

    def eval_payload(self, node: int) -> ArrayRecord | None:
        """What node needs to rebuild its model for evaluation (override)."""
        return self.global_arrays()

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        if key == ARRAYS_KEY and direction == "down" and msg.metadata.message_type == "evaluate":
            return "eval-weights"   # the model a node rebuilds for its personalised evaluation
        return super().record_kind(key, msg, direction)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """Flower's hook: one ``evaluate`` message per node, with what it needs to rebuild its
        model (:meth:`eval_payload`)."""
        msgs = []
        for n in sorted(grid.get_node_ids()):
            content = self.base_content(server_round, action="evaluate")
            rec = self.eval_payload(n)
            if rec is not None:
                content[ARRAYS_KEY] = rec
            msgs.append(Message(content, dst_node_id=n, message_type="evaluate", group_id=str(server_round)))
        return msgs

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Flower's hook: the clients' accuracies, their mean (the round's ``accuracy``), variance
        and minimum, by partition id; kept for checkpoints (``last_eval``)."""
        accs: dict[int, float] = {}
        for r in replies:
            m = r.content.metric_records[METRICS_KEY]
            accs[int(m["partition-id"])] = float(m["accuracy"])
        if not accs:
            self.last_eval = {}
            return None
        vals = [accs[k] for k in sorted(accs)]
        self.last_eval = {"accuracy": float(np.mean(vals)), "client-accuracy-mean": float(np.mean(vals)),
                          "client-accuracy-var": float(np.var(vals)), "client-accuracy-min": float(np.min(vals)),
                          "client-accuracies": vals, "client-ids": sorted(accs)}
        return MetricRecord(self.last_eval)

    def evaluate_global(self) -> dict[str, Any]:
        """No evaluation on the server: each client's model is evaluated on its own test split
        (Flower's evaluate hooks, above)."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        return {"last_eval": self.last_eval}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.last_eval = state.get("last_eval", {})
