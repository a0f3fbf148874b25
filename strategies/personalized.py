"""The server side of personalised evaluation: each node's model on that node's own test split.

UM-pFSSL (:mod:`strategies.umpfssl`) and its FixMatch baselines
(:mod:`strategies.fixmatch_baselines`, :mod:`strategies.fixprox`) evaluate this way: the run's
``accuracy`` is the mean over clients and ``client-accuracy-var`` their variance (the paper's
fairness measure).

Client contract: an ``evaluate`` message carries what the node needs to rebuild its model
(:meth:`PersonalizedEvalStrategy.eval_payload`; ``arrays``, or nothing) and the reply's
``metrics`` carry ``accuracy``, ``num-examples`` and ``partition-id``
(:func:`evaluate_on_own_test`, the one client side of it).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message
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
    per-client evaluation (``evaluate`` messages) every ``every`` rounds (the caller's config)
    and at the end.

    The round's ``accuracy`` is the mean of the clients' test accuracies (unweighted, as the
    paper), ``client-accuracies`` the list by partition id (``client-ids``), ``client-accuracy-var`` the
    population variance.
    """

    label_mode = "dir2"
    with_client_test = True

    def __init__(self, *a, **kw) -> None:
        self.last_eval: dict[str, Any] = {}    # (set before the base's __init__, which sets a user's model up)
        self.round_eval: dict[str, Any] = {}   # this round's per-client evaluation (server metrics)
        super().__init__(*a, **kw)

    def eval_payload(self, node: int) -> ArrayRecord | None:
        """What node needs to rebuild its model for evaluation (override)."""
        return self.global_arrays()

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        if key == ARRAYS_KEY and direction == "down" and msg.metadata.message_type == "evaluate":
            return "eval-weights"   # the model a node rebuilds for its personalised evaluation
        return super().record_kind(key, msg, direction)

    def client_eval(self, grid: Grid, server_round: int) -> dict[str, Any]:
        nodes = sorted(grid.get_node_ids())
        msgs = []
        for n in nodes:
            content = self.base_content(server_round, action="evaluate")
            rec = self.eval_payload(n)
            if rec is not None:
                content[ARRAYS_KEY] = rec
            msgs.append(Message(content, dst_node_id=n, message_type="evaluate", group_id=str(server_round)))
        accs: dict[int, float] = {}
        for r in self.exchange(grid, msgs):
            m = r.content.metric_records[METRICS_KEY]
            accs[int(m["partition-id"])] = float(m["accuracy"])
        if not accs:
            return {}
        vals = [accs[k] for k in sorted(accs)]
        return {"accuracy": float(np.mean(vals)), "client-accuracy-mean": float(np.mean(vals)),
                "client-accuracy-var": float(np.var(vals)), "client-accuracy-min": float(np.min(vals)),
                "client-accuracies": vals, "client-ids": sorted(accs)}

    def maybe_eval(self, grid: Grid, server_round: int, every: int = 1) -> dict[str, Any]:
        """The per-client evaluation when ``server_round`` is a multiple of ``every`` or the last."""
        if server_round % every == 0 or server_round == self.num_rounds:
            self.last_eval = self.client_eval(grid, server_round)
            self.round_eval = dict(self.last_eval)
            return dict(self.last_eval)
        return {}

    def evaluate_global(self) -> dict[str, Any]:
        """The per-client evaluation of this round (run in ``run_round``: it needs the grid);
        nothing for round 0 and for rounds between evaluations."""
        out, self.round_eval = self.round_eval, {}
        return out

    def extra_state(self) -> dict[str, Any]:
        return {"last_eval": self.last_eval}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.last_eval = state.get("last_eval", {})
