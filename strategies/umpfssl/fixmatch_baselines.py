"""The baselines of UM-pFSSL's Table 1 (its Sec. 6.1; ``docs/baselines.md`` C1-C4, C6): modes of
one client on UM-pFSSL's config and personalised evaluation (FixProx and FedProx-SL, which add
FedProx's term, are :mod:`strategies.umpfssl.fixprox`; pFedMe-Fix is :mod:`strategies.umpfssl.pfedme`). This module
holds the modes' client and server; the rows added for Table 1 register in their own modules:
``fixbn`` in :mod:`strategies.umpfssl.fedbn`, ``lg-fedavg-fix`` in :mod:`strategies.umpfssl.lgfedavg`, the
``*-sl`` references in :mod:`strategies.umpfssl.supervised_refs`.

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

``fedavg-sl`` / ``fedbn-sl`` (and ``fedprox-sl``, :mod:`strategies.umpfssl.fixprox`) -- the privileged-label
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
``num-examples`` (n_k = |D_k^s| + |D_k^u|), ``processed-examples`` (the samples the local steps
processed), ``train-loss`` (and ``mask-rate`` for the FixMatch modes).
``evaluate`` messages (Flower's ``evaluate``) carry what the client needs to rebuild
its model (nothing for ``local-only``) and the reply carries ``accuracy`` and ``num-examples``
on the client's test split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid

from strategies.core.folds import sized_metrics
from strategies.core.records import (
    ARRAYS_KEY,
    METRICS_KEY,
    algo_config,
    model_to_record,
    record_to_numpy,
)
from tasks.config import ConfigError, knob
from tasks.data import ArrayDataset
from tasks.env import Env
from tasks.models import head_prefix
from tasks.training import (
    derive_seed,
    load_numpy_state,
    make_sgd,
    num_local_steps,
    train_fixmatch,
    train_supervised,
)

from ..base import TrainFold
from ..client import AlgorithmClient, reply, server_round
from ..personalized import PersonalizedEvalStrategy, evaluate_on_own_test, personal_env
from ..registry import AlgorithmSpec, register
from .umpfssl import PAPER

STATE_HEAD = "umpfssl.head"   # ArrayRecord: FedPer's local head
STATE_MODEL = "umpfssl.model"  # ArrayRecord: local-only's model
STATE_BN = "umpfssl.bn"       # ArrayRecord: FedBN's local BatchNorm (fixbn, fedbn-sl)
STATE_BODY = "umpfssl.body"   # ArrayRecord: LG-FedAvg's local representation
LOCAL_INIT_KEY = "local-init"  # ArrayRecord: the initial model's local part, with a node's first message
#: the context.state keys a baseline keeps from round to round (strategies.node_state)
NODE_STATE = (STATE_HEAD, STATE_MODEL, STATE_BN, STATE_BODY)


@dataclass(frozen=True)
class FixMatchConfig:
    """The FixMatch baselines' knobs (``fixmatch.*``; FixProx's and pFedMe's configs extend it):
    FixMatch's defaults (Sohn et al. 2020) and UM-pFSSL's per-client evaluation period."""

    namespace = "fixmatch"   # (a class attribute, not a key)

    tau: float = knob(0.95, lo=0.0, hi=1.0, help="FixMatch confidence threshold")
    lambda_u: float = knob(1.0, lo=0.0, help="FixMatch unlabeled-loss weight")
    uratio: int = knob(1, lo=1, help="FixMatch unlabeled batch = uratio x batch-size")


def batchnorm_keys(model: torch.nn.Module) -> list[str]:
    """The state-dict keys of every BatchNorm layer (parameters and buffers), found by module type."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            out += [f"{name}.{k}" if name else k for k in m.state_dict()]
    return out


def head_keys(model: torch.nn.Module) -> list[str]:
    """The state-dict keys of the model's head (:func:`tasks.models.head_prefix`)."""
    prefix = head_prefix(model)
    return [k for k in model.state_dict() if k.startswith(prefix)]


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


def load_personal(model: torch.nn.Module, msg: Message, context: Context, state_key: str | None) -> None:
    """The node's model: the received (global) part, plus its local part from
    ``context.state[state_key]``, else the ``local-init`` the server sent, else the model's own
    initial values (``state_key=None``: the received model is the whole model)."""
    rec = record_to_numpy(msg.content.array_records[ARRAYS_KEY])
    if state_key is not None and state_key in context.state:
        rec.update(record_to_numpy(context.state.array_records[state_key]))
    elif state_key is not None and LOCAL_INIT_KEY in msg.content.array_records:
        rec.update(record_to_numpy(msg.content.array_records[LOCAL_INIT_KEY]))
    load_numpy_state(model, rec, strict=state_key is None)


# =============================================================================== client side
class FixMatchTrainer:
    """FixAvg's client (FedAvg + FixMatch): the whole model travels, FixMatch's local steps
    (:func:`tasks.training.train_fixmatch`) on the node's labeled and unlabeled data. A
    baseline overrides what differs: the part kept on the node (:attr:`state_key`,
    :meth:`local_keys`), a term added to the loss (:meth:`regularizer`), the local
    training (:meth:`fit`), how the model is loaded and kept (:meth:`load`, :meth:`keep`)."""

    config_cls: type = FixMatchConfig
    state_key: str | None = None   # context.state key of the part that stays on the node

    def local_keys(self, model: torch.nn.Module, cfg: Any = None) -> list[str] | None:
        """The keys that stay on the node (``None``: the whole model travels); ``cfg``: the
        algorithm's config (a row whose split is a knob reads it)."""
        return None

    def regularizer(self, model: torch.nn.Module, cfg: Any) -> Callable[[], torch.Tensor] | None:
        """A term added to every step's loss, made when the received weights are loaded."""
        return None

    def fit(self, model: torch.nn.Module, env: Env, cfg: Any, rnd: int, reg: Callable | None) -> dict[str, Any]:
        """The local training: FixMatch on the node's labeled and unlabeled data."""
        t, lab, unl = env.task, env.labeled(), env.unlabeled()
        return train_fixmatch(model, lab, unl, aug=env.augmenter, steps=num_local_steps(t, len(lab) + len(unl)),
                              batch_size=t.batch_size, unlabeled_batch_size=cfg.uratio * t.batch_size,
                              optimizer=make_sgd(model.parameters(), t), device=env.device,
                              seed=derive_seed(t.seed, "fixmatch", rnd, env.partition_id), tau=cfg.tau,
                              lambda_u=cfg.lambda_u, regularizer=reg)

    def load(self, model: torch.nn.Module, msg: Message, context: Context) -> None:
        """The node's model for this message (:func:`load_personal`)."""
        load_personal(model, msg, context, self.state_key)

    def keep(self, model: torch.nn.Module, local: list[str] | None, context: Context) -> ArrayRecord | None:
        """Keep the local part in ``context.state``; return what the node uploads (the rest)."""
        if local is None:
            return model_to_record(model)
        context.state[self.state_key] = model_to_record(model, local)
        return model_to_record(model, [k for k in model.state_dict() if k not in set(local)])

    def train(self, msg: Message, context: Context) -> Message:
        """``train``: load, train locally, keep the local part, upload the rest."""
        env, cfg = personal_env(msg, context), algo_config(msg, self.config_cls)
        model = env.build_model()
        self.load(model, msg, context)
        local = self.local_keys(model, cfg)
        out = self.fit(model, env, cfg, server_round(msg), self.regularizer(model, cfg))
        out = sized_metrics(out, len(env.labeled()) + len(env.unlabeled()))   # n_k = |D_k^s| + |D_k^u|
        out["partition-id"] = env.partition_id
        return reply(msg, self.keep(model, local, context), out)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """``evaluate``: the node's model (:meth:`load`) on its own test split."""
        env = personal_env(msg, context)
        model = env.build_model()
        self.load(model, msg, context)
        return evaluate_on_own_test(msg, env, model)

    def handlers(self) -> dict[str, Callable[[Message, Context], Message]]:
        return {"train": self.train, "evaluate": self.evaluate}


class FedPerTrainer(FixMatchTrainer):
    """FedPer + FixMatch: the head stays on the node, the body travels."""

    state_key = STATE_HEAD

    def local_keys(self, model: torch.nn.Module, cfg: Any = None) -> list[str] | None:
        return head_keys(model)


class LocalOnlyTrainer(FixMatchTrainer):
    """Local-only: the whole model stays on the node (the run's initial arrays, if any, before
    its first training), nothing is uploaded."""

    state_key = STATE_MODEL

    def load(self, model: torch.nn.Module, msg: Message, context: Context) -> None:
        if STATE_MODEL in context.state:
            load_numpy_state(model, record_to_numpy(context.state.array_records[STATE_MODEL]))
        elif ARRAYS_KEY in msg.content.array_records:  # the run's initial_arrays, before the first round
            load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))

    def keep(self, model: torch.nn.Module, local: list[str] | None, context: Context) -> ArrayRecord | None:
        context.state[STATE_MODEL] = model_to_record(model)
        return None


class SupervisedReference:
    """Mixin of the privileged-label references (``*-sl``): plain CE on the node's fully labeled
    data (:func:`fully_labeled`, weak view) instead of FixMatch."""

    def fit(self, model: torch.nn.Module, env: Env, cfg: Any, rnd: int, reg: Callable | None) -> dict[str, Any]:
        t, data = env.task, fully_labeled(env)
        return train_supervised(model, data, aug=env.augmenter, steps=num_local_steps(t, len(data)),
                                batch_size=t.batch_size, optimizer=make_sgd(model.parameters(), t),
                                device=env.device, seed=derive_seed(t.seed, "supervised-ref", rnd, env.partition_id),
                                regularizer=reg)


# =============================================================================== server side
class FixMatchFedStrategy(PersonalizedEvalStrategy):
    """FixAvg's server: FedAvg of what travels (:attr:`trainer`'s shared part), evaluated per
    client. A baseline sets :attr:`trainer` (its client side), :attr:`uniform` (the uniform
    mean of the uploads instead of FedAvg's n_k weights) and :attr:`send_local_init` (the
    initial arrays' local part reaches a node once)."""

    trainer: FixMatchTrainer = FixMatchTrainer()
    uniform = False
    send_local_init = False
    reply_metrics = ("train-loss", "mask-rate")

    def setup_algorithm(self) -> None:
        self.body_keys = None   # the keys that travel (None: all)
        self.seeded: set[int] = set()   # nodes that trained once (they hold their local part)
        local = self.trainer.local_keys(self.model, self.cfg)
        if local is not None:
            self.body_keys = [k for k in self.model.state_dict() if k not in set(local)]

    def global_arrays(self) -> ArrayRecord:
        return model_to_record(self.model, self.body_keys)

    def result_arrays(self) -> ArrayRecord:
        """The global model (fedper-fix: the global body, fixbn: the non-BN entries, lg-fedavg-fix:
        the head; the local parts stay on the nodes)."""
        return self.global_arrays()

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
        if self.initial_given and self.send_local_init:
            for m in msgs:
                if m.metadata.dst_node_id not in self.seeded:
                    m.content[LOCAL_INIT_KEY] = self.local_init()
        return msgs

    def eval_payload(self, node: int) -> ArrayRecord | None:
        if self.initial_given and self.send_local_init and node not in self.seeded:
            return model_to_record(self.model)   # never trained: the initial local part
        return self.global_arrays()

    def train_fold(self, server_round: int) -> TrainFold:
        """FedAvg's ``num-examples`` weights, or the uniform mean (:attr:`uniform`); every node
        that replies holds its local part from then on (``seeded``)."""
        return _SeedingFold(self, uniform=self.uniform)

    def load_aggregate(self, state: dict[str, np.ndarray]) -> None:
        load_numpy_state(self.model, state, strict=self.body_keys is None)  # the shared part only

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "seeded": sorted(self.seeded)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        self.seeded = set(state.get("seeded", ()))


class _SeedingFold(TrainFold):
    def add(self, reply: Message) -> None:
        self.strategy.seeded.add(reply.metadata.src_node_id)
        super().add(reply)


class FedPerFixStrategy(FixMatchFedStrategy):
    """FedPer's server: FedAvg of the bodies (the heads stay on their nodes)."""

    trainer = FedPerTrainer()


class LocalOnlyStrategy(PersonalizedEvalStrategy):
    """Every client trains alone (FixMatch on its own data); no weights are exchanged, except
    the run's ``initial_arrays`` (if given) with a node's first training message."""

    trainer: FixMatchTrainer = LocalOnlyTrainer()
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
        return out


def spec(name: str, cls: type, desc: str, node_state: tuple[str, ...] = NODE_STATE,
         label_metrics: bool = True) -> AlgorithmSpec:
    """A baseline's spec: its strategy class, the config and client handlers of the class's
    :attr:`trainer`; ``label_metrics=False`` for the rows whose replies carry no metric
    computed from labels (the *-sl references, pFedMe)."""
    cfg = cls.trainer.config_cls
    return AlgorithmSpec(name=name, paper=f"{PAPER}, baseline", strategy_cls=cls, config_cls=cfg,
                         namespace=cfg.namespace, client=cls.trainer.handlers(), description=desc,
                         node_state=node_state,
                         label_metrics=("pseudo-label-accuracy", "corr-self") if label_metrics else ())


ALGORITHMS = register({
    "fixavg": spec("fixavg", FixMatchFedStrategy, "FedAvg + FixMatch on unlabeled data"),
    "fedper-fix": spec("fedper-fix", FedPerFixStrategy, "FedPer (shared body, local head) + FixMatch"),
    "local-only": spec("local-only", LocalOnlyStrategy, "each client trains alone (FixMatch), no weights exchanged"),
})


class FixMatchClient(AlgorithmClient):
    """The baselines' client with a user's model and the node's labeled, unlabeled and test data
    (the test set is the node's personalized evaluation; the *-sl references need the
    unlabeled split's labels)."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
