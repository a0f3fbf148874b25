"""The baselines of UM-pFSSL's Table 1 (its Sec. 6.1; ``docs/baselines.md`` C1-C4, C6): modes of
one client on UM-pFSSL's config and personalised evaluation (FixProx and FedProx-SL, which add
FedProx's term, are :mod:`strategies.fixprox`; pFedMe-Fix is :mod:`strategies.pfedme`). This module
holds the modes' client and server; the rows added for Table 1 register in their own modules:
``fixbn`` in :mod:`strategies.fedbn`, ``lg-fedavg-fix`` in :mod:`strategies.lgfedavg`, the
``*-sl`` references in :mod:`strategies.supervised_refs`.

``fixavg`` -- FedAvg + FixMatch; ``fixprox`` -- FedProx (``prox-mu``) + FixMatch; ``fedper-fix``
-- FedPer (shared body, local head) + FixMatch; ``local-only`` -- each client trains alone,
no weights exchanged. Local training is :func:`tasks.training.train_fixmatch` on the
client's labeled and unlabeled data (``fixmatch-tau``, ``fixmatch-lambda-u``,
``fixmatch-uratio``). They use UM-pFSSL's config (``umpfssl.*`` keys, ``mode`` fixed by the
variant) and its personalized evaluation (:class:`strategies.personalized.PersonalizedEvalStrategy`:
each client's model on its own test split).

``fixbn`` -- FedBN + FixMatch (FixBN). FedBN: X. Li, M. Jiang, X. Zhang, M. Kamp, Q. Dou,
"FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR 2021.
Every BatchNorm layer's parameters and buffers (weight, bias, running mean/var,
num_batches_tracked; found by module type, ``torch.nn.modules.batchnorm._BatchNorm``) stay on
the node; the server sets every other entry to the **uniform** mean of the uploads,
``w_j = (1/|S|) sum_k w_{k,j}`` (FedBN's code, ``fed_digits.py: communication()``). Client k's
model is the shared entries plus its own BN.

``lg-fedavg-fix`` -- LG-FedAvg + FixMatch. P. P. Liang, T. Liu, L. Ziyin, N. B. Allen, R. P.
Auerbach, D. Brent, R. Salakhutdinov, L.-P. Morency, "Think Locally, Act Globally: Federated
Learning with Local and Global Representations", arXiv:2001.01523 (NeurIPS 2019 FL workshop).
The opposite of FedPer: the head (``tasks.models.head_prefix``: a StagedModel's last stage,
else the last ``nn.Linear``) is global, the rest (the representation) stays on the node.
Clients train the **whole** model and upload only the head; the server sets
``g = (1/|S|) sum_k g_k`` (uniform, ``main_lg.py``).

``fedavg-sl`` / ``fedbn-sl`` (and ``fedprox-sl``, :mod:`strategies.fixprox`) -- the privileged-label
references of Table 1: FedAvg (McMahan et al., AISTATS 2017: ``w = sum_k n_k w_k / sum n_k``)
and FedBN (as ``fixbn``, uniform) trained with plain cross-entropy
(:func:`tasks.training.train_supervised`, weak view) on D_k^s united with D_k^u **with
D_k^u's true labels**; n_k = |D_k^s| + |D_k^u| (the split is not redrawn). A node whose
unlabeled images carry no labels (a user's own, y = -1) cannot run them: ``ConfigError``.

Choices the sources leave open, [ours]: a node's first participation starts from the initial
model's local part (BN for fixbn/fedbn-sl, the body for lg-fedavg-fix): the library's seeded
initial model, or with ``start(initial_arrays=...)`` the server sends that part once with
the node's first training message (record ``local-init``, bytes kind ``local-init``); a node
never trained is evaluated with it too. LG-FedAvg starts from w_0, not from a FedAvg
checkpoint (no pre-training, as every other row). FixMatch's pseudo-labels come from the
node's own personalised model (its BN / its body).

Baseline client contract (``train``): ``fixavg``/``fixprox``/``fedavg-sl``/``fedprox-sl``
receive ``arrays`` (global model) and reply ``arrays``; ``fedper-fix`` receives and replies
only the body (every key outside the ``head`` stage; the head stays in
``context.state["umpfssl.head"]``); ``fixbn``/``fedbn-sl`` receive and reply every non-BN
entry (BN in ``context.state["umpfssl.bn"]``); ``lg-fedavg-fix`` receives and replies the head
(the body in ``context.state["umpfssl.body"]``); ``local-only`` receives no weights and keeps
its model in ``context.state["umpfssl.model"]``. Every reply's ``metrics`` carry
``num-examples`` (n_k), ``train-loss`` (and ``mask-rate`` for the FixMatch modes).
``evaluate`` messages (Flower's ``evaluate``) carry what the client needs to rebuild
its model (nothing for ``local-only``) and the reply carries ``accuracy`` and ``num-examples``
on the client's test split.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid

from split_layer.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    model_to_record,
    record_to_numpy,
)
from tasks.config import ConfigError
from tasks.data import ArrayDataset
from tasks.env import Env
from tasks.training import (
    derive_seed,
    evaluate,
    load_numpy_state,
    make_sgd,
    num_local_steps,
    train_fixmatch,
    train_supervised,
)

from .base import TrainFold
from .client import AlgorithmClient
from .personalized import PersonalizedEvalStrategy
from .registry import AlgorithmSpec, bind
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

STATE_BN = "umpfssl.bn"       # ArrayRecord: FedBN's local BatchNorm (fixbn, fedbn-sl)
STATE_BODY = "umpfssl.body"   # ArrayRecord: LG-FedAvg's local representation
LOCAL_INIT_KEY = "local-init"  # ArrayRecord: the initial model's local part, with a node's first message
#: mode -> the context.state key of the part of the model that stays on the node
LOCAL_PART = {"fedper": STATE_HEAD, "fixbn": STATE_BN, "fedbn-sl": STATE_BN, "lg": STATE_BODY}
SL_MODES = ("fedavg-sl", "fedprox-sl", "fedbn-sl")   # plain CE on fully labeled data (the references)
UNIFORM_MODES = ("fixbn", "fedbn-sl", "lg")          # uniform mean of the uploads (FedBN's, LG-FedAvg's code)
SEND_LOCAL_INIT = ("fixbn", "fedbn-sl", "lg")        # initial_arrays' local part reaches a node once


def batchnorm_keys(model: torch.nn.Module) -> list[str]:
    """The state-dict keys of every BatchNorm layer (parameters and buffers), found by module type."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            out += [f"{name}.{k}" if name else k for k in m.state_dict()]
    return out


def local_keys(model: torch.nn.Module, mode: str) -> list[str] | None:
    """The keys that stay on the node in ``mode`` (``None``: the whole model travels)."""
    if mode in ("fixbn", "fedbn-sl"):
        keys = batchnorm_keys(model)
        if not keys:
            raise ConfigError(f"umpfssl.mode={mode!r} (FedBN) keeps the BatchNorm layers local, and "
                              f"{type(model).__name__} has none: use a model with nn.BatchNorm layers "
                              "(run config: norm='bn')")
        return keys
    if mode == "fedper":
        return _head_keys(model)
    if mode == "lg":
        head = set(_head_keys(model))
        body = [k for k in model.state_dict() if k not in head]
        if not body:
            raise ConfigError(f"umpfssl.mode='lg' (LG-FedAvg) keeps the layers below the head local, and "
                              f"{type(model).__name__} has only its head")
        return body
    return None


def fully_labeled(env: Env) -> ArrayDataset:
    """D_k^s united with D_k^u with its true labels (the *-sl references)."""
    lab, unl = env.labeled(), env.unlabeled()
    if len(unl) == 0:
        return lab
    if not unl.labels_known:
        raise ConfigError("algo fedavg-sl / fedprox-sl / fedbn-sl train on the true labels of the node's "
                          "unlabeled split (a privileged-label reference), and this node's unlabeled data "
                          "has unknown labels (y = -1): give it (x, y) pairs, or run fixavg / fixprox / fixbn")
    return ArrayDataset(np.concatenate([lab.x, unl.x]), np.concatenate([lab.y, unl.y]))


def load_personal(model: torch.nn.Module, msg: Message, context: Context, mode: str) -> None:
    """The node's model: the received (global) part, plus its local part from ``context.state``,
    else the ``local-init`` the server sent, else the model's own initial values."""
    rec = record_to_numpy(msg.content.array_records[ARRAYS_KEY])
    key = LOCAL_PART.get(mode)
    if key is not None and key in context.state:
        rec.update(record_to_numpy(context.state.array_records[key]))
    elif key is not None and LOCAL_INIT_KEY in msg.content.array_records:
        rec.update(record_to_numpy(msg.content.array_records[LOCAL_INIT_KEY]))
    load_numpy_state(model, rec, strict=key is None)


def _train(msg: Message, context: Context, env: Env, cfg: UMPFSSLConfig,
           regularizer: Callable[[torch.nn.Module], Any] | None = None) -> Message:
    """Every mode of this module (FixMatch, or CE on fully labeled data for the *-sl modes)."""
    conf = msg.content.config_records[CONFIG_KEY]
    rnd, pid, t = int(conf["server-round"]), env.partition_id, env.task
    model = env.build_model()
    if cfg.mode == "local":
        if STATE_MODEL in context.state:
            load_numpy_state(model, record_to_numpy(context.state.array_records[STATE_MODEL]))
        elif ARRAYS_KEY in msg.content.array_records:  # the run's initial_arrays, before the first round
            load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    else:
        load_personal(model, msg, context, cfg.mode)
    local = local_keys(model, cfg.mode) if cfg.mode != "local" else None
    reg = regularizer(model) if regularizer is not None else None
    lab, unl = env.labeled(), env.unlabeled()
    if cfg.mode in SL_MODES:
        data = fully_labeled(env)
        out = train_supervised(model, data, aug=env.augmenter, steps=num_local_steps(t, len(data)),
                               batch_size=t.batch_size, optimizer=make_sgd(model.parameters(), t),
                               device=env.device, seed=derive_seed(t.seed, "supervised-ref", rnd, pid),
                               regularizer=reg)
    else:
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
    elif local is not None:
        context.state[LOCAL_PART[cfg.mode]] = model_to_record(model, local)
        arrays = model_to_record(model, [k for k in model.state_dict() if k not in set(local)])
    else:
        arrays = model_to_record(model)
    return _reply(msg, arrays, out)


def client_train(msg: Message, context: Context, regularizer: Callable[[torch.nn.Module], Any] | None = None
                 ) -> Message:
    """Local training of the mode (module docstring); ``regularizer(model)``, if given, returns a
    term added to every step's loss, made when the received weights are loaded (FixProx:
    :func:`tasks.losses.proximal_term`)."""
    return _train(msg, context, _env(msg, context), _algo_cfg(msg), regularizer)


def client_evaluate(msg: Message, context: Context) -> Message:
    """``evaluate`` of the modes with a local part (fixbn, fedbn-sl, lg): the received global
    part plus the node's own local part, on the node's test split."""
    env, cfg = _env(msg, context), _algo_cfg(msg)
    model = env.build_model()
    load_personal(model, msg, context, cfg.mode)
    test = env.client_test()
    res = evaluate(model, test, aug=env.augmenter, device=env.device, num_classes=env.num_classes)
    return _reply(msg, None, {"accuracy": res["accuracy"], "num-examples": float(len(test)),
                              "partition-id": env.partition_id})


class FixMatchFedStrategy(PersonalizedEvalStrategy):
    """fixavg / fixprox / fedavg-sl / fedprox-sl (global model), fedper-fix (global body, local
    heads), fixbn / fedbn-sl (global non-BN entries, local BN, uniform mean) and lg-fedavg-fix
    (global head, local bodies, uniform mean)."""

    def setup_algorithm(self) -> None:
        self.body_keys = None   # the keys that travel (None: all)
        self.seeded: set[int] = set()   # nodes that trained once (they hold their local part)
        local = local_keys(self.model, self.cfg.mode)
        if local is not None:
            self.body_keys = [k for k in self.model.state_dict() if k not in set(local)]
        self.uniform = self.cfg.mode in UNIFORM_MODES
        if self.cfg.mode in SL_MODES:
            self.reply_metrics = ("train-loss",)

    def global_arrays(self) -> ArrayRecord:
        return model_to_record(self.model, self.body_keys)

    def result_arrays(self) -> ArrayRecord:
        """The global model (fedper-fix: the global body, fixbn: the non-BN entries, lg-fedavg-fix:
        the head; the local parts stay on the nodes)."""
        return self.global_arrays()

    reply_metrics = ("train-loss", "mask-rate")

    def local_init(self) -> ArrayRecord:
        """The initial model's local part (the server aggregates only the shared part, so its
        model's local part stays the initial one)."""
        shared = set(self.body_keys or ())
        return model_to_record(self.model, [k for k in self.model.state_dict() if k not in shared])

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        if key == LOCAL_INIT_KEY:
            return "local-init"
        return super().record_kind(key, msg, direction)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        msgs = list(super().configure_train(server_round, arrays, config, grid))
        if self.initial_given and self.cfg.mode in SEND_LOCAL_INIT:
            for m in msgs:
                if m.metadata.dst_node_id not in self.seeded:
                    m.content[LOCAL_INIT_KEY] = self.local_init()
        return msgs

    def eval_payload(self, node: int) -> ArrayRecord | None:
        if self.initial_given and self.cfg.mode in SEND_LOCAL_INIT and node not in self.seeded:
            return model_to_record(self.model)   # never trained: the initial local part
        return self.global_arrays()

    def train_fold(self, server_round: int) -> TrainFold:
        """FedAvg's ``num-examples`` weights, or the uniform mean (fixbn, fedbn-sl, lg); every node
        that replies holds its local part from then on (``seeded``)."""
        return _SeedingFold(self, uniform=self.uniform)

    def load_aggregate(self, state: dict[str, np.ndarray]) -> None:
        load_numpy_state(self.model, state, strict=self.body_keys is None)  # the shared part only

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        out = super().run_round(server_round, grid)
        out.update(self.maybe_eval(grid, server_round))
        return out

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "seeded": sorted(self.seeded)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        self.seeded = set(state.get("seeded", ()))


class _SeedingFold(TrainFold):
    def add(self, reply: Message) -> None:
        self.strategy.seeded.add(reply.metadata.src_node_id)
        super().add(reply)


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
_CLIENT_LOCAL = {"train": client_train, "evaluate": client_evaluate}   # modes with a local part
_STATE = (STATE_HEAD, STATE_MODEL, STATE_BN, STATE_BODY)


def spec(name: str, cls: type, mode: str, desc: str, client: dict, node_state: tuple[str, ...] = _STATE,
         label_metrics: bool = True) -> AlgorithmSpec:
    """UM-pFSSL's ``_spec`` (its config, ``mode`` fixed); ``label_metrics=False`` for the *-sl
    references, whose replies carry no metric computed from labels."""
    out = _spec(name, cls, mode, desc, client, node_state)
    return out if label_metrics else dataclasses.replace(out, label_metrics=())


ALGORITHMS = bind({
    "fixavg": _spec("fixavg", FixMatchFedStrategy, "fixavg", "FedAvg + FixMatch on unlabeled data", _CLIENT, _STATE),
    "fedper-fix": _spec("fedper-fix", FixMatchFedStrategy, "fedper", "FedPer (shared body, local head) + FixMatch",
                        _CLIENT, _STATE),
    "local-only": _spec("local-only", LocalOnlyStrategy, "local",
                        "each client trains alone (FixMatch), no weights exchanged", _CLIENT, _STATE),
})


class FixMatchClient(AlgorithmClient):
    """The baselines' client with a user's model and the node's labeled, unlabeled and test data
    (the test set is the node's personalized evaluation; the *-sl references need the
    unlabeled split's labels)."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
