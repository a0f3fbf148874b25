"""FedSwitch: federated semi-supervised learning with a teacher-student EMA, local teacher
adaptation and an adaptive teacher/student switch for the pseudo-labels (a baseline of the
Semi-SFL paper: Sec. V-B, Tables II, IV, V; ``docs/baselines.md`` A3).

Paper: J. Zhao, S. Ghosh, A. Bharadwaj, C.-Y. Ma, "When does the student surpass the teacher?
Federated Semi-supervised Learning with Teacher-Student EMA", arXiv:2301.10114 (2023); the
Semi-SFL paper's reference [19]. No code is public.

**A reconstruction.** Only the abstract could be read (arXiv, and the copies found by this
library's search; the full text was not retrieved): FixMatch-style federated SSL with a
teacher-student EMA, two features -- *local teacher adaptation* and *adaptive switching
between teacher and student for pseudo-label generation* -- aimed at client statelessness
and low communication. The Semi-SFL paper adds that it relies on an "IIDness
hyper-parameter" and is tested on the global teacher. Everything else below is the library's
reconstruction (``docs/baselines.md`` A3), tagged [rec], or this module's own choice, tagged
[ours]. Results are tagged "reconstruction" (the row's note in ``conf/papers/semisfl.toml``; the
results page's tables and the claim against it carry the tag: :mod:`flower_apps.pages`);
re-check against the paper before quoting numbers.

Setting: labels on the server only (``server-labels``: D_l), unlabeled clients; full model
w (student) and its EMA w~ (teacher), both on the server.

Round h (the server's side, :class:`FedSwitchStrategy`)
-------------------------------------------------------
1. **Server stage** [rec]: K_s (``fedswitch.k-s``) steps of cross-entropy on D_l (weak view
   [ours], batches of ``fedswitch.labeled-batch-size``) on w, each followed by
   w~ <- g w~ + (1 - g) w (:func:`tasks.semisfl.fedswitch_rule.server_steps`).
2. **Broadcast** [rec]: every sampled client gets w and w~ (2|w| down).
3. **Client i, stateless** [rec] (:func:`tasks.semisfl.fedswitch_rule.train_fedswitch`): w_i <- w,
   t_i <- w~; per local step on an unlabeled batch u (``local-steps``, or ``local-epochs``
   passes, batches of ``batch-size``):

   * the switch: s = t_i if ``fedswitch.iid`` (the IIDness flag, [rec] stand-in for the
     paper's hyper-parameter); otherwise s is whichever of {t_i, w_i} has the higher mean
     max-softmax on weak(u), ties to t_i [rec]. Both predict weak(u) in eval mode without
     gradients [ours] (like with like: no dropout, running BN statistics);
   * q = softmax(f_s(weak(u))),
     L = (1/B) sum_b 1[max q_b >= tau] CE(argmax q_b, f_{w_i}(strong(u_b))) [rec]
     (normalised by the full batch, :func:`tasks.losses.masked_pseudo_label_ce`);
   * one SGD step on w_i, then **local teacher adaptation** t_i <- g_l t_i + (1 - g_l) w_i [rec].

   The client uploads w_i and discards t_i (|w| up): nothing is kept in ``context.state``.
4. **Aggregation**: w = (1/|S|) sum_i w_i, uniform over the replies [rec] ("mean_i"; as
   Semi-SFL's stage D), every state entry (BN buffers included); then w~ <- g w~ + (1 - g) w [rec].
5. **Evaluation** of the global teacher w~ (the Semi-SFL paper's Sec. V-B) (``accuracy``; also ``student-accuracy``).

Order [rec]: the server stage opens every round (``server_trains_first``: round 1's nodes
receive what K_s steps made of the initial model, whose confidences would rarely reach tau).
A round with fewer than ``min-nodes`` replies keeps its server stage and skips step 4 [ours].

Defaults [rec] (``docs/baselines.md`` A3; the Semi-SFL paper's optimizer, its Sec. V-C): tau = 0.95, g = 0.999
per server step (``ema-decay``), g_l = 0.99 per client step (``local-ema-decay``), K_s = 50
(Semi-SFL's initial K_s: the same server budget), labeled batch = ``batch-size`` (0); SGD with
the task's lr, momentum and weight decay (Semi-SFL's: 0.02, 0.9, 5e-4), the learning rate
decayed by a cosine over the run's rounds (``lr-schedule``; one rate per round, shared by
the server stage and the clients [ours], as in :mod:`strategies.semisfl.semisfl`). The server's
optimizer keeps its momentum across rounds; a client's starts fresh each round (stateless).
The EMA copies BN buffers from the student (:func:`tasks.ema.ema_update`'s default) [ours].

FedSwitch-SL (the same pipeline on the split model) is ``semisfl-no-cluster`` in
:mod:`strategies.semisfl.semisfl`.

Client contract
---------------
``train`` message: ``arrays`` (w, the full state dict), ``fedswitch.teacher`` (w~, the same
keys), ``task``, ``algo`` (:class:`FedSwitchConfig`) and ``config`` with ``server-round`` and
``fedswitch-lr`` (this round's learning rate). Reply: ``arrays`` (w_i) and ``metrics`` with
``num-examples`` (unlabeled samples seen), ``train-loss``, ``mask-rate``, ``pseudo-kept``,
``teacher-share`` (share of local steps whose pseudo-labels came from the teacher) and, only
with the node's consent (``share-label-metrics``), ``pseudo-correct`` (confident pseudo-labels
equal to the node's hidden label), from which the server reports ``impurity``. Bytes:
``bytes.weights.*`` for w and w_i, ``bytes.teacher-weights.down`` for w~.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    algo_config,
    client_env,
    consented_share,
    model_to_record,
    record_to_numpy,
)
from tasks.aggregate import RunningWeightedMean
from tasks.config import ConfigError, knob
from tasks.ema import ema_update
from tasks.semisfl.fedswitch_rule import server_steps, train_fedswitch
from tasks.schedules import cosine_decay
from tasks.training import derive_seed, load_numpy_state, make_sgd, num_local_steps, set_lr

from ..base import BaseStrategy
from ..client import AlgorithmClient, server_round
from ..registry import AlgorithmSpec, register

__all__ = ["FedSwitchConfig", "FedSwitchStrategy", "FedSwitchClient", "TEACHER_KEY", "client_train", "ALGORITHMS"]

TEACHER_KEY = "fedswitch.teacher"   # the array record of w~ in a train message
LABEL_METRICS = ("pseudo-correct",)


@dataclass(frozen=True)
class FedSwitchConfig:
    """Run-config keys ``fedswitch.<key>``; defaults: the reconstruction's (``docs/baselines.md`` A3)
    and the Semi-SFL paper's."""

    k_s: int = knob(50, lo=1, help="K_s: server cross-entropy steps on D_l per round (EMA after each)")
    labeled_batch_size: int = knob(0, lo=0, help="server batch size on D_l (0 = batch-size)")
    tau: float = knob(0.95, lo=0.0, hi=1.0, help="confidence threshold of the pseudo-labels (max q >= tau)")
    ema_decay: float = knob(0.999, lo=0.0, hi=1.0, help="g: global teacher EMA per server step and after "
                                                        "aggregation")
    local_ema_decay: float = knob(0.99, lo=0.0, hi=1.0, help="g_l: local teacher adaptation per client step "
                                                             "(1 = no adaptation)")
    iid: bool = knob(False, help="IIDness flag: true = pseudo-labels always from the teacher (no switch)")
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"),
                            help="per-round lr: cosine decay over num-rounds, or constant")


class FedSwitchStrategy(BaseStrategy):
    """FedSwitch's server (math in the module docstring): broadcast w and w~, uniform mean of
    the clients' w_i, EMA, K_s supervised steps with a per-step EMA; the result is w~."""

    label_mode = "server"
    server_trains_first = True   # step 1, the K_s supervised steps, opens every round
    reply_metrics = ("train-loss", "mask-rate", "teacher-share")

    def setup_algorithm(self) -> None:
        if len(self.env.server_labeled()) == 0:
            raise ConfigError("fedswitch needs labeled data on the server: labeled_data=(x, y)"
                              if self.user is not None else
                              "fedswitch needs server-labels > 0 (the labeled set D_l on the server)")
        self.teacher = copy.deepcopy(self.model)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.optimizer = make_sgd(self.model.parameters(), self.task)

    # ------------------------------------------------------------------ schedule
    def round_lr(self, server_round: int) -> float:
        if self.cfg.lr_schedule == "constant":
            return self.task.lr
        return cosine_decay(server_round - 1, max(self.num_rounds, 1), self.task.lr)

    # ------------------------------------------------------------------ messages
    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        return "teacher-weights" if key == TEACHER_KEY else super().record_kind(key, msg, direction)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        teacher = model_to_record(self.teacher)
        msgs = []
        for n in self.sample_nodes(grid, server_round):
            content = self.base_content(server_round, **dict(config))
            content[ARRAYS_KEY] = arrays
            content[TEACHER_KEY] = teacher
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        return msgs

    # ------------------------------------------------------------------ round
    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        lr = self.round_lr(server_round)
        t = self.task
        set_lr(self.optimizer, lr)
        out: dict[str, Any] = dict(server_steps(
            self.model, self.teacher, self.env.server_labeled(), aug=self.env.augmenter, steps=self.cfg.k_s,
            batch_size=self.cfg.labeled_batch_size or t.batch_size, optimizer=self.optimizer,
            device=self.env.device, seed=derive_seed(t.seed, "fedswitch-server", server_round),
            decay=self.cfg.ema_decay))
        msgs = list(self.configure_train(server_round, self.global_arrays(),
                                         ConfigRecord({"fedswitch-lr": float(lr)}), grid))
        fold = ClientsFold(self)   # each reply folded as it arrives, then let go
        folded = self.exchange_fold(grid, msgs, fold.add)
        out.update({"participants": folded, "lr": float(lr)})
        if folded < max(self.policy.min_nodes, 1):
            out["skipped"] = 1
            log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round, folded,
                self.policy.min_nodes)
        else:
            out.update(fold.finish())
        return out

    def aggregate_clients(self, replies: list[Message]) -> dict[str, float]:
        """w = uniform mean of the w_i, then w~ <- g w~ + (1 - g) w; the reply metrics
        (:class:`ClientsFold` over a list)."""
        fold = ClientsFold(self)
        for r in replies:
            fold.add(r)
        return fold.finish()

    def finish_clients(self, mean: dict[str, np.ndarray], mets: list) -> dict[str, float]:
        """Load the clients' uniform mean w, then w~ <- g w~ + (1 - g) w; the reply metrics."""
        load_numpy_state(self.model, mean)
        ema_update(self.teacher, self.model, self.cfg.ema_decay)
        seen = np.array([float(m["num-examples"]) for m in mets])
        w = seen if seen.sum() > 0 else np.ones(len(mets))
        out = {k: float(np.average([float(m.get(k, float("nan"))) for m in mets], weights=w))
               for k in self.reply_metrics}
        out["label-metrics-nodes"], correct = consented_share(mets, "pseudo-correct", "pseudo-kept")
        if correct is not None:
            out["impurity"] = 1.0 - correct
        return out

    # ------------------------------------------------------------------ evaluation
    eval_name = "teacher"

    def eval_model(self) -> torch.nn.Module:
        return self.teacher   # the global teacher w~, as the Semi-SFL paper tests it

    def also_evaluated(self) -> dict[str, torch.nn.Module]:
        return {"student": self.model}

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"teacher": {k: v.detach().cpu().clone() for k, v in self.teacher.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "teacher" in state:
            self.teacher.load_state_dict(state["teacher"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])


def client_train(msg: Message, context: Context) -> Message:
    """One FedSwitch client round (module docstring, "Client contract"); keeps nothing."""
    env = client_env(msg, context, label_mode="server")
    cfg = algo_config(msg, FedSwitchConfig)
    conf = msg.content.config_records[CONFIG_KEY]
    if TEACHER_KEY not in msg.content.array_records:
        raise ValueError(f"fedswitch: the train message carries no '{TEACHER_KEY}' record (the teacher w~)")
    rnd = server_round(msg)
    task = env.task
    student = env.build_model()
    load_numpy_state(student, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    teacher = copy.deepcopy(student)
    load_numpy_state(teacher, record_to_numpy(msg.content.array_records[TEACHER_KEY]))
    data = env.unlabeled()
    lr = float(conf.get("fedswitch-lr", task.lr))
    metrics = train_fedswitch(
        student, teacher, data, aug=env.augmenter, steps=num_local_steps(task, len(data)),
        batch_size=task.batch_size, optimizer=make_sgd(student.parameters(), task, lr=lr), device=env.device,
        seed=derive_seed(task.seed, "fedswitch-client", rnd, env.partition_id), tau=cfg.tau, iid=cfg.iid,
        local_decay=cfg.local_ema_decay)
    return Message(RecordDict({ARRAYS_KEY: model_to_record(student), METRICS_KEY: MetricRecord(metrics)}),
                   reply_to=msg)


class ClientsFold:
    """FedSwitch's round, folded: the uniform mean of the clients' ``w_i`` as running float64
    sums (:class:`tasks.aggregate.RunningWeightedMean`) and their small metric records, each reply
    added as it arrives; :meth:`finish` is :meth:`FedSwitchStrategy.finish_clients`."""

    def __init__(self, strategy: "FedSwitchStrategy") -> None:
        self.strategy, self.mean, self.mets = strategy, RunningWeightedMean(), []

    def add(self, reply: Message) -> None:
        self.mean.add(record_to_numpy(reply.content.array_records[ARRAYS_KEY]), 1.0)
        self.mets.append(reply.content.metric_records[METRICS_KEY])

    def finish(self) -> dict[str, float]:
        return self.strategy.finish_clients(self.mean.result(), self.mets)


ALGORITHMS = register({
    "fedswitch": AlgorithmSpec(
        name="fedswitch", paper="Zhao et al. 2023 (arXiv:2301.10114), reconstruction; Semi-SFL baseline",
        strategy_cls=FedSwitchStrategy, config_cls=FedSwitchConfig, namespace="fedswitch",
        client={"train": client_train}, label_metrics=LABEL_METRICS,
        description="labels on the server, EMA teacher, local teacher adaptation, teacher/student switch "
                    "(reconstruction)"),
})


class FedSwitchClient(AlgorithmClient):
    """FedSwitch's client with a user's model and the node's unlabeled data (``unlabeled``;
    labels, if given, only feed the consented ``pseudo-correct`` metric).

    Each ``train`` message: from the received student w and teacher w~, local steps of the
    FixMatch loss on pseudo-labels from whichever of the two is more confident on the batch
    (the teacher if ``iid``), the teacher adapted by EMA after every step; the reply is the
    student alone. Nothing is kept between rounds."""

    module = __name__
    needs = ("unlabeled",)
