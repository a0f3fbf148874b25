"""The FixMatch baselines of UM-pFSSL's comparison: FixAvg, FedPer-Fix, local-only (and
FixProx, FixAvg plus FedProx's term, in :mod:`strategies.fixprox`).

``fixavg`` -- FedAvg + FixMatch; ``fixprox`` -- FedProx (``prox-mu``) + FixMatch; ``fedper-fix``
-- FedPer (shared body, local head) + FixMatch; ``local-only`` -- each client trains alone,
no weights exchanged. Local training is :func:`tasks.training.train_fixmatch` on the
client's labeled and unlabeled data (``fixmatch-tau``, ``fixmatch-lambda-u``,
``fixmatch-uratio``). They use UM-pFSSL's config (``umpfssl.*`` keys, ``mode`` fixed by the
variant) and its personalized evaluation (:class:`strategies.personalized.PersonalizedEvalStrategy`:
each client's model on its own test split).

Baseline client contract (``train``): ``fixavg``/``fixprox`` receive ``arrays`` (global
model) and reply ``arrays``; ``fedper-fix`` receives and replies only the body (every key
outside the ``head`` stage; the head stays in ``context.state["umpfssl.head"]``);
``local-only`` receives no weights and keeps its model in ``context.state["umpfssl.model"]``.
``evaluate`` messages (Flower's ``evaluate``) carry what the client needs to rebuild
its model (nothing for ``local-only``) and the reply carries ``accuracy`` and ``num-examples``
on the client's test split.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.serverapp import Grid

from split_layer.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    model_to_record,
    record_to_numpy,
)
from tasks.env import Env
from tasks.training import (
    derive_seed,
    load_numpy_state,
    make_sgd,
    num_local_steps,
    train_fixmatch,
)

from .client import AlgorithmClient
from .personalized import PersonalizedEvalStrategy
from .registry import bind
from .umpfssl import (
    _HANDLERS,
    STATE_HEAD,
    STATE_MODEL,
    UMPFSSLConfig,
    _algo_cfg,
    _env,
    _head_keys,
    _reply,
    _spec,
)


def _train(msg: Message, context: Context, env: Env, cfg: UMPFSSLConfig,
           regularizer: Callable[[torch.nn.Module], Any] | None = None) -> Message:
    """fixavg / fixprox / fedper-fix / local-only: FixMatch local training."""
    conf = msg.content.config_records[CONFIG_KEY]
    rnd, pid, t = int(conf["server-round"]), env.partition_id, env.task
    model = env.build_model()
    if cfg.mode == "local":
        if STATE_MODEL in context.state:
            load_numpy_state(model, record_to_numpy(context.state.array_records[STATE_MODEL]))
        elif ARRAYS_KEY in msg.content.array_records:  # the run's initial_arrays, before the first round
            load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    else:
        rec = record_to_numpy(msg.content.array_records[ARRAYS_KEY])
        if cfg.mode == "fedper" and STATE_HEAD in context.state:
            rec.update(record_to_numpy(context.state.array_records[STATE_HEAD]))
        load_numpy_state(model, rec, strict=cfg.mode != "fedper")
    reg = regularizer(model) if regularizer is not None else None
    lab, unl = env.labeled(), env.unlabeled()
    out = train_fixmatch(model, lab, unl, aug=env.augmenter, steps=num_local_steps(t, len(lab) + len(unl)),
                         batch_size=t.batch_size, unlabeled_batch_size=cfg.fixmatch_uratio * t.batch_size,
                         optimizer=make_sgd(model.parameters(), t), device=env.device,
                         seed=derive_seed(t.seed, "fixmatch", rnd, pid), tau=cfg.fixmatch_tau,
                         lambda_u=cfg.fixmatch_lambda_u, regularizer=reg)
    out["num-examples"] = float(len(lab) + len(unl))
    out["partition-id"] = pid
    arrays = None
    if cfg.mode == "local":
        context.state[STATE_MODEL] = model_to_record(model)
    elif cfg.mode == "fedper":
        head = _head_keys(model)
        context.state[STATE_HEAD] = model_to_record(model, head)
        arrays = model_to_record(model, [k for k in model.state_dict() if k not in set(head)])
    else:
        arrays = model_to_record(model)
    return _reply(msg, arrays, out)


def client_train(msg: Message, context: Context, regularizer: Callable[[torch.nn.Module], Any] | None = None
                 ) -> Message:
    """FixMatch local training (module docstring); ``regularizer(model)``, if given, returns a
    term added to every step's loss, made when the received weights are loaded (FixProx:
    :func:`tasks.losses.proximal_term`)."""
    return _train(msg, context, _env(msg, context), _algo_cfg(msg), regularizer)


class FixMatchFedStrategy(PersonalizedEvalStrategy):
    """fixavg / fixprox (global model) and fedper-fix (global body, local heads)."""

    def setup_algorithm(self) -> None:
        self.body_keys = None
        if self.cfg.mode == "fedper":
            head = set(_head_keys(self.model))
            self.body_keys = [k for k in self.model.state_dict() if k not in head]

    def global_arrays(self) -> ArrayRecord:
        return model_to_record(self.model, self.body_keys)

    def result_arrays(self) -> ArrayRecord:
        """The global model (fedper-fix: the global body; the heads stay on the nodes)."""
        return self.global_arrays()

    reply_metrics = ("train-loss", "mask-rate")

    def load_aggregate(self, state: dict[str, np.ndarray]) -> None:
        load_numpy_state(self.model, state, strict=self.body_keys is None)  # fedper-fix: the body only

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        out = super().run_round(server_round, grid)
        out.update(self.maybe_eval(grid, server_round))
        return out


class LocalOnlyStrategy(PersonalizedEvalStrategy):
    """Every client trains alone (FixMatch on its own data); no weights are exchanged, except
    the run's ``initial_arrays`` (if given) with a node's first training message."""

    returns_model = False  # every model stays on its node: Result.arrays is empty

    def setup_algorithm(self) -> None:
        self.started, self.seeded = False, set()

    def eval_payload(self, node: int) -> ArrayRecord | None:
        return None

    def result_arrays(self) -> ArrayRecord:
        return ArrayRecord() if self.started else model_to_record(self.model)

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        nodes = self.sample_nodes(grid, server_round)
        self.started = True
        msgs = []
        for n in nodes:
            content = self.base_content(server_round)
            if self.initial_given and n not in self.seeded:
                content[ARRAYS_KEY] = model_to_record(self.model)
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        self.seeded.update(nodes)
        replies = self.exchange(grid, msgs)
        mets = [r.content.metric_records[METRICS_KEY] for r in replies]
        out: dict[str, Any] = {"participants": len(replies)}
        if mets:
            out["train-loss"] = float(np.mean([float(m["train-loss"]) for m in mets]))
            out["mask-rate"] = float(np.mean([float(m["mask-rate"]) for m in mets]))
        out.update(self.maybe_eval(grid, server_round))
        return out


_CLIENT = {"train": client_train, "evaluate": _HANDLERS["evaluate"]}
_STATE = (STATE_HEAD, STATE_MODEL)

ALGORITHMS = bind({
    "fixavg": _spec("fixavg", FixMatchFedStrategy, "fixavg", "FedAvg + FixMatch on unlabeled data", _CLIENT, _STATE),
    "fedper-fix": _spec("fedper-fix", FixMatchFedStrategy, "fedper", "FedPer (shared body, local head) + FixMatch",
                        _CLIENT, _STATE),
    "local-only": _spec("local-only", LocalOnlyStrategy, "local",
                        "each client trains alone (FixMatch), no weights exchanged", _CLIENT, _STATE),
})


class FixMatchClient(AlgorithmClient):
    """The FixMatch baselines' client with a user's model and the node's labeled, unlabeled and
    test data (the test set is the node's personalized evaluation)."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
