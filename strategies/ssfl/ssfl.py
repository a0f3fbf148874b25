"""SSFL: semi-supervised FL with labels only at the server (the benchmark of the library).

Paper: Z. Zhang, Z. Yao, Y. Yang, Y. Yan, J. E. Gonzalez, M. W. Mahoney,
"Benchmarking Semi-supervised Federated Learning" (2020), code
github.com/jhcknzzm/SSFL-Benchmarking-Semi-supervised-Federated-Learning.
Section and equation numbers below are the paper's; the library's own choices where it is
silent are in ``docs/ssfl.md`` ("Decisions and deviations").

Setting (Sec. 3.1): the server holds N_s class-balanced labeled samples (``server-labels``,
label mode ``"server"``); the K users hold only unlabeled data, class-skewed to a
target non-IID level R (``partition='ssfl-r'``, ``partition-r``). One global model;
the server's own model is a member of every average.

One communication period of T local iterations (Sec. 3.1, 3.3) = one Flower round:

1. Every sampled user (C_k of K, ``fraction-train``) receives the trainable
   parameters of its group's average w_avg,i (w_avg when S = 1) and runs T SGD steps
   of the user loss on unlabeled batches:

   * CRL, Eq. 4 (``ssfl.user-loss='crl'``, FixMatch style)::

         ybar_i = softmax f(alpha(x_i); w_k)          (weak view, no gradient)
         L_k = (1/N_b) sum_i 1[max ybar_i >= tau] CE(argmax ybar_i, f(A(x_i); w_k))

     A = strong augmentation (RandAugment + Cutout); the denominator is the full batch
     (masked samples count as zeros) -- :func:`tasks.losses.masked_pseudo_label_ce`.
   * Self-training, Eq. 3 (``ssfl.user-loss='self-training'``, variant
     ``ssfl-selftrain``): the same with the weak-view logits in place of the strong.

2. The server runs T SGD steps of cross-entropy on its labeled data (weak view, Eq. 2),
   starting from w_avg -- :func:`tasks.training.train_supervised`.
3. Averaging over the trainable parameters only (our reading of Sec. 3.3 "Normalization": BN
   statistics differ across non-IID users):

   * S = 1 (Eq. 5): ``w_avg = (w_s + sum_{k in C_k} w_k) / (|C_k| + 1)``;
   * S > 1 (Eq. 6, ``ssfl.groups``): ``w_avg,i = (w_s + sum_{k in G_i} w_k)/(|G_i|+1)``,
     ``w_avg = (1/S) sum_i w_avg,i``; group G_i is sent w_avg,i next round and the
     server continues from w_avg. Groups are fixed and contiguous in the users'
     ``partition-id`` (the paper does not say how groups form; the
     authors' code fixes them by index), learned once per node with the library's ``node-info`` query
     (:meth:`strategies.base.BaseStrategy.learn_partitions`).
     A group without participants this round has w_avg,i = w_s (authors' code).

   BatchNorm buffers never travel: each user keeps its own running statistics in
   ``context.state``; the server's come from its labeled data and are the ones used to
   evaluate w_avg on the test set [ours]. With ``norm='gn'`` there are no buffers.
4. Weight diversity (Eq. 7, Sec. 4.2) on the classifier layer
   (``StagedModel.classifier_prefix``), with update vectors u_i = w_i - (the model user
   i received): ``weight-diversity`` = sum_i ||u_i||^2 / ||sum_i u_i||^2 and
   ``weight-diversity-k`` = K times it (the authors' plotted convention).

Learning rate (Appendix A.3, Eq. 10), ``ssfl.lr-schedule='cosine'``: every party uses
``gamma_t = lr * max{cos(pi c (t - w)/(H - w)), eps}`` with linear warmup from 0 before
t = w, where t is the GLOBAL iteration (round r, local step i: t = (r-1) T + i) and
w = ``lr-warmup`` x (num-rounds x T), H = ``lr-horizon`` x (num-rounds x T). So the
paper's epochs map to fractions of the run: EMNIST is ``lr-horizon=1, lr-c=0.4375,
lr-warmup=0``; CIFAR-10 (E = 300, code horizon 1024, e = 5) is ``lr-horizon=3.4133,
lr-c=2.3, lr-warmup=0.01667``. SGD momentum (``momentum``), Nesterov (``ssfl.nesterov``)
and ``weight-decay`` apply on every party. The server's optimizer persists across
rounds; a user's momentum restarts each period (it may have been idle for many).

T is ``local-steps``; if that is 0, T = ``local-epochs`` passes over the mean user
partition (batches of ``batch-size``). The server sends T with every message.

Client contract
---------------
``train`` message (``message_type="train"``):
  * ``arrays``: ArrayRecord of the TRAINABLE parameters (``model.named_parameters()``
    names) of the user's group model;
  * ``task``: the flat TaskConfig; ``algo``: the flat :class:`SSFLConfig`;
  * ``config``: ``server-round``, ``algo``, ``local-steps`` (T), ``global-step``
    ((r-1) T), ``lr-total-steps`` (H), ``lr-warmup-steps`` (w).
  The user loads its own BN buffers from ``context.state['ssfl.local']`` (if any), then
  the received parameters, trains T steps of the user loss on its unlabeled partition,
  stores its buffers back and replies ``arrays`` (trainable parameters) and ``metrics``
  with ``num-examples``, ``train-loss``, ``mask-rate``, ``pseudo-kept``,
  ``pseudo-correct`` (diagnostics only: true labels are never used to train) and
  ``partition-id``.
``query`` message with ``config['op'] = 'node-info'`` (only when ``ssfl.groups > 1`` or
  ``fraction-train < 1``): answered for every algorithm by ``flower_apps.client_app.dispatch``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Callable

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
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
    numpy_to_record,
    record_to_numpy,
)
from ..base import BaseStrategy
from tasks.aggregate import (
    RunningDiversity,
    RunningWeightedMean,
    combine_groups,
    contiguous_groups,
    state_delta,
)
from tasks.config import ConfigError, knob
from tasks.data import ArrayDataset
from tasks.losses import masked_pseudo_label_ce
from tasks.models import classifier_prefix
from tasks.schedules import cosine_lr
from tasks.training import (
    batch_indices,
    derive_seed,
    load_numpy_state,
    make_sgd,
    seeded,
    set_lr,
    to_device_batch,
    train_supervised,
    trainable_keys,
)

from ..client import AlgorithmClient, server_round
from ..registry import AlgorithmSpec, register

LOCAL_STATE_KEY = "ssfl.local"   # context.state ArrayRecord: the user's BN buffers


@dataclass(frozen=True)
class SSFLConfig:
    """``ssfl.*`` run-config keys (defaults: the paper's EMNIST setting, Sec. 4 and Appendix A.3)."""

    tau: float = knob(0.95, lo=0.0, hi=1.0, help="confidence threshold of the pseudo-labels (Eq. 3, 4)")
    user_loss: str = knob("crl", choices=("crl", "self-training"),
                          help="users' loss: CRL (Eq. 4, FixMatch) or self-training (Eq. 3)")
    groups: int = knob(1, lo=1, help="S: 1 = average incl. the server (Eq. 5); > 1 = grouping (Eq. 6)")
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"), help="Eq. 10 cosine or constant lr")
    lr_c: float = knob(0.4375, lo=0.0, lo_open=True, help="periodic coefficient c of Eq. 10")
    lr_horizon: float = knob(1.0, lo=0.0, lo_open=True,
                             help="cosine horizon E_sched in multiples of the run (num-rounds x T)")
    lr_warmup: float = knob(0.0, lo=0.0, hi=1.0, hi_open=True,
                            help="linear warmup e/E as a share of the run (num-rounds x T)")
    lr_eps: float = knob(1e-4, lo=0.0, hi=1.0, help="floor eps of Eq. 10, relative to lr")
    nesterov: bool = knob(True, help="Nesterov momentum (authors' code)")
    warm_start_steps: int = knob(0, lo=0, help="W labeled steps of the server, at the constant lr, before round "
                                                "1 (a warm start; 0 = cold, the paper)")

    def validate(self) -> None:
        if self.lr_schedule == "cosine" and self.lr_warmup >= self.lr_horizon:
            raise ConfigError(f"ssfl.lr-warmup={self.lr_warmup} must be below ssfl.lr-horizon={self.lr_horizon}")


# --------------------------------------------------------------------------- schedule
def schedule_config(cfg: SSFLConfig, server_round: int, period: int, num_rounds: int) -> dict[str, Any]:
    """The per-message schedule values (global iteration of the round start, H, w)."""
    run_steps = max(num_rounds, 1) * period
    return {"local-steps": int(period), "global-step": int((server_round - 1) * period),
            "lr-total-steps": float(cfg.lr_horizon * run_steps),
            "lr-warmup-steps": float(cfg.lr_warmup * run_steps)}


def lr_function(cfg: SSFLConfig, base_lr: float, sched: dict[str, Any]) -> Callable[[int], float]:
    """Local step i -> learning rate of global iteration ``global-step + i`` (Eq. 10)."""
    if cfg.lr_schedule == "constant":
        return lambda i: base_lr
    t0, total, warm = int(sched["global-step"]), float(sched["lr-total-steps"]), float(sched["lr-warmup-steps"])
    return lambda i: cosine_lr(t0 + i, total, base_lr, warmup_steps=warm, floor=cfg.lr_eps, c=cfg.lr_c)


# --------------------------------------------------------------------------- user side
def user_loss(model: torch.nn.Module, x_weak: torch.Tensor, x_strong: torch.Tensor | None, tau: float,
              kind: str = "crl") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The users' unsupervised loss on one batch; returns ``(loss, mask, pseudo_labels)``.

    ``crl`` (Eq. 4): pseudo-labels from the same model's softmax on the weak view (no
    gradient), loss on the strong view; both views go through the model in one forward
    pass (FixMatch; with BN, batch statistics are over both views). ``self-training``
    (Eq. 3): pseudo-labels and loss on the same weak-view logits (``x_strong`` unused).
    Masked samples count as zeros over the full batch (:func:`masked_pseudo_label_ce`).
    """
    if kind == "crl":
        if x_strong is None:
            raise ValueError("CRL needs the strong view")
        n = x_weak.shape[0]
        logits = model(torch.cat([x_weak, x_strong]))
        logits_weak, logits_strong = logits[:n], logits[n:]
        probs = torch.softmax(logits_weak.detach(), dim=1)
        loss, mask = masked_pseudo_label_ce(logits_strong, probs, tau)
    elif kind == "self-training":
        logits_weak = model(x_weak)
        probs = torch.softmax(logits_weak.detach(), dim=1)
        loss, mask = masked_pseudo_label_ce(logits_weak, probs, tau)
    else:
        raise ValueError(f"ssfl.user-loss={kind!r} is not one of: crl, self-training")
    return loss, mask, probs.argmax(dim=1)


# reply metrics computed from a node's labels or its pseudo-labels' classes: sent with consent only
LABEL_METRICS = ("pseudo-correct", "pseudo-hist")


def train_unlabeled(model: torch.nn.Module, data: ArrayDataset, *, aug, steps: int, batch_size: int,
                    optimizer: torch.optim.Optimizer, device: torch.device, seed: int, tau: float,
                    kind: str = "crl", lr_fn: Callable[[int], float] | None = None) -> dict[str, float]:
    """``steps`` SGD steps of :func:`user_loss` on unlabeled ``data``.

    The labels stored in ``data.y`` are read only to report ``pseudo-correct``.
    """
    model.train()
    gen = torch.Generator().manual_seed(seed)
    total, seen, kept, correct = 0.0, 0, 0.0, 0.0
    hist = None  # confident pseudo-labels per class (no true label involved)
    with seeded(seed, device):   # augmentation and dropout draws
        for i, idx in enumerate(batch_indices(len(data), batch_size, steps, gen)):
            if lr_fn is not None:
                set_lr(optimizer, lr_fn(i))
            xb, yb = to_device_batch(data, idx, device)
            xw = aug.weak(xb)
            xs = aug.strong(xb) if kind == "crl" else None
            loss, mask, pseudo = user_loss(model, xw, xs, tau, kind)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
            kept += float(mask.sum())
            correct += float(((pseudo == yb).to(mask.dtype) * mask).sum())
            counts = torch.bincount(pseudo[mask > 0].long())
            hist = counts.cpu() if hist is None else _add_hist(hist, counts.cpu())
    # no confident pseudo-label all period: the loss had nothing to measure (not 0: absent)
    out = {**({"train-loss": total / max(seen, 1)} if kept > 0 else {}), "num-examples": float(seen),
           "mask-rate": kept / max(seen, 1), "pseudo-kept": kept,
           "pseudo-hist": [float(v) for v in (hist.tolist() if hist is not None else [])]}
    if data.labels_known:  # a user's unlabeled images have no hidden labels to compare with
        out["pseudo-correct"] = correct
    return out


def _add_hist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    n = max(len(a), len(b))
    return torch.nn.functional.pad(a, (0, n - len(a))) + torch.nn.functional.pad(b, (0, n - len(b)))


def _ssfl_config(msg: Message) -> SSFLConfig:
    return algo_config(msg, SSFLConfig)


def client_train(msg: Message, context: Context) -> Message:
    """One communication period on a user (see the module docstring's client contract)."""
    env = client_env(msg, context, label_mode="server")
    cfg = _ssfl_config(msg)
    conf = msg.content.config_records[CONFIG_KEY]
    rnd, steps = server_round(msg), int(conf["local-steps"])
    task = env.task
    model = env.build_model()
    params = trainable_keys(model)
    if LOCAL_STATE_KEY in context.state:     # this user's own BN statistics
        load_numpy_state(model, record_to_numpy(context.state[LOCAL_STATE_KEY]), strict=False)
    received = record_to_numpy(msg.content.array_records[ARRAYS_KEY])
    unknown = sorted(set(received) - set(params))
    if unknown:
        raise ValueError(f"ssfl: the server sent non-trainable entries {unknown[:5]}; only parameters travel")
    load_numpy_state(model, received, strict=False)
    optimizer = make_sgd(model.parameters(), task, nesterov=cfg.nesterov)
    metrics = train_unlabeled(
        model, env.unlabeled(), aug=env.augmenter, steps=steps, batch_size=task.batch_size,
        optimizer=optimizer, device=env.device, seed=derive_seed(task.seed, "ssfl-user", rnd, env.partition_id),
        tau=cfg.tau, kind=cfg.user_loss, lr_fn=lr_function(cfg, task.lr, conf))
    buffers = [k for k in model.state_dict() if k not in set(params)]
    if buffers:
        context.state[LOCAL_STATE_KEY] = model_to_record(model, buffers)
    metrics["partition-id"] = float(env.partition_id)
    return Message(RecordDict({ARRAYS_KEY: model_to_record(model, params), METRICS_KEY: MetricRecord(metrics)}),
                   reply_to=msg)


# --------------------------------------------------------------------------- server side
class SSFLStrategy(BaseStrategy):
    """SSFL (Zhang et al. 2020): CRL users, labeled server, averaging incl. the server."""

    label_mode = "server"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.period = 0   # (set before the base's __init__, which sets a user's model up)
        self.keys: list[str] = []
        self.classifier_keys: list[str] = []
        self.group_params: list[dict[str, np.ndarray]] | None = None
        super().__init__(*args, **kwargs)
        if self.user is None and self.task.server_labels <= 0:
            raise ConfigError("ssfl needs server-labels > 0 (N_s class-balanced labeled samples on the server)")

    # ---------------------------------------------------------------- setup
    def setup_algorithm(self) -> None:
        if len(self.env.server_labeled()) == 0:
            raise ConfigError("ssfl needs labeled data on the server: labeled_data=(x, y) (run config: "
                              "server-labels > 0)" if self.user is not None else
                              "ssfl needs labeled data on the server (run config: server-labels > 0)")
        self.keys = trainable_keys(self.model)
        prefix = classifier_prefix(self.model)
        self.classifier_keys = [k for k in self.keys if k.startswith(prefix)]
        self.optimizer = make_sgd(self.model.parameters(), self.task, nesterov=self.cfg.nesterov)
        t = self.task
        if t.local_steps > 0:
            self.period = t.local_steps
        else:
            sizes = self.env.client_unlabeled_sizes()
            if sizes is None:
                raise ConfigError("ssfl with your own data: set local_steps=K (the communication period, in "
                                  "steps); the server does not know the nodes' data sizes for local_epochs")
            self.period = max(1, t.local_epochs * math.ceil(float(np.mean(sizes)) / t.batch_size))

    def warm_start(self) -> dict[str, Any]:
        """``ssfl.warm-start-steps`` labeled steps of the server before round 1, at the constant
        ``lr`` (not the paper's: a probe of how a warm server model fares in the users' first
        period); returns the warm model's test accuracy and loss as ``warm-*`` metrics."""
        res = train_supervised(self.model, self.env.server_labeled(), aug=self.env.augmenter,
                               steps=self.cfg.warm_start_steps, batch_size=self.task.batch_size,
                               optimizer=self.optimizer, device=self.env.device,
                               seed=derive_seed(self.task.seed, "ssfl-warm-start"), lr_fn=lambda i: self.task.lr)
        out = {"warm-train-loss": res["train-loss"]}
        ev = self.evaluate_global()
        if "accuracy" in ev:
            out["warm-accuracy"] = ev["accuracy"]
        log(INFO, "ssfl warm start: %s labeled steps, test accuracy %s", self.cfg.warm_start_steps,
            out.get("warm-accuracy", "n/a"))
        return out

    def server_params(self) -> dict[str, np.ndarray]:
        sd = self.model.state_dict()
        return {k: sd[k].detach().cpu().numpy().copy() for k in self.keys}

    # ---------------------------------------------------------------- groups
    def group_of(self, node: int) -> int:
        """Fixed contiguous group of a node by its partition-id (as the authors' code); 0 when S = 1."""
        s = self.cfg.groups
        if s == 1:
            return 0
        if node not in self.partition_of or self.partition_count <= 0:
            raise ConfigError(f"groups={s} groups nodes by partition id: node {node} has none (start each "
                              "SuperNode with --node-config \"partition-id=<i> num-partitions=<n>\")")
        pid, k = self.partition_of[node], self.partition_count
        for i, g in enumerate(contiguous_groups(range(k), s)):
            if pid in g:
                return i
        raise ValueError(f"partition-id {pid} outside [0, {k})")

    # ---------------------------------------------------------------- round
    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        warm: dict[str, Any] = {}
        if self.group_params is None:
            if self.cfg.warm_start_steps > 0:
                warm = self.warm_start()
            self.group_params = [self.server_params() for _ in range(self.cfg.groups)]
        nodes = self.sample_nodes(grid, server_round)
        if self.cfg.groups > 1:
            nodes = self.learn_partitions(grid, nodes)  # the fixed groups follow partition ids
        sched = schedule_config(self.cfg, server_round, self.period, self.num_rounds or server_round)
        sent: dict[int, int] = {}
        msgs = []
        for n in nodes:
            g = self.group_of(n)
            rec = numpy_to_record(self.group_params[g])
            content = self.base_content(server_round, **sched)
            content[ARRAYS_KEY] = rec
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
            sent[n] = g
        # each reply folded into its group's running sums as it arrives, then let go
        fold = UsersFold(self, sent)
        mets: list[dict[str, float]] = []

        def add(r: Message) -> None:
            fold.add(r.metadata.src_node_id, record_to_numpy(r.content.array_records[ARRAYS_KEY]))
            mets.append({k: (list(v) if isinstance(v, list) else float(v))
                         for k, v in r.content.metric_records[METRICS_KEY].items()})

        folded = self.exchange_fold(grid, msgs, add)
        out: dict[str, Any] = {"participants": folded, **warm}
        if fold.count < self.policy.min_nodes:
            out["skipped"] = 1
            log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round, fold.count,
                self.policy.min_nodes)
            return out
        # the server's own period on its labeled data (Eq. 2), from w_avg
        data = self.env.server_labeled()
        lr_fn = lr_function(self.cfg, self.task.lr, sched)
        srv = train_supervised(self.model, data, aug=self.env.augmenter, steps=self.period,
                               batch_size=self.task.batch_size, optimizer=self.optimizer, device=self.env.device,
                               seed=derive_seed(self.task.seed, "ssfl-server", server_round), lr_fn=lr_fn)
        out.update(fold.finish())
        n_ex = np.array([m["num-examples"] for m in mets])
        told = [(m["train-loss"], m["num-examples"]) for m in mets if "train-loss" in m]
        if told:   # (users with no confident pseudo-label measured no loss)
            out["train-loss"] = float(np.average([v for v, _ in told], weights=[w for _, w in told]))
        out["mask-rate"] = float(sum(m["pseudo-kept"] for m in mets) / max(n_ex.sum(), 1.0))
        # label-derived metrics come from the users that consented (records.label_consent); a
        # metric no user reported is left out (not reported), never 0
        told = [m for m in mets if "pseudo-correct" in m or "pseudo-hist" in m]
        out["label-metrics-nodes"] = len(told)
        _, correct = consented_share(mets, "pseudo-correct", "pseudo-kept")
        if correct is not None:
            out["impurity"] = 1.0 - correct
        hists = [np.asarray(m.get("pseudo-hist", []), dtype=np.float64) for m in told]
        size = max((len(h) for h in hists), default=0)
        if size and sum(h.sum() for h in hists) > 0:
            total = sum(np.pad(h, (0, size - len(h))) for h in hists)
            # which class the users' confident pseudo-labels go to: a collapse shows as share -> 1
            out["pseudo-main-class"] = int(np.argmax(total))
            out["pseudo-main-share"] = float(total.max() / total.sum())
            # per class: its confident pseudo-labels this round (a class's onset is its first count > 0)
            out["pseudo-hist"] = [float(v) for v in np.pad(total, (0, max(self.env.num_classes - size, 0)))]
            out["pseudo-classes"] = int((total > 0).sum())
        out["server-train-loss"] = srv["train-loss"]
        out["lr"] = float(lr_fn(self.period - 1))
        out["period"] = self.period
        return out

    def aggregate_users(self, users: dict[int, dict[str, np.ndarray]], user_group: dict[int, int]
                        ) -> dict[str, float]:
        """Eq. 5 / Eq. 6 over the trainable parameters, with the server's current model as w_s.

        ``users``: node -> uploaded parameters; ``user_group``: node -> the group whose
        model it received. Loads w_avg into the server model (its buffers untouched),
        stores the group models for the next round and returns the weight diversity
        (:class:`UsersFold` over the users in node order).
        """
        fold = UsersFold(self, user_group)
        for n in sorted(users):
            fold.add(n, users[n])
        return fold.finish()

    # ---------------------------------------------------------------- checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "group_params": self.group_params}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.group_params = state.get("group_params")



class UsersFold:
    """SSFL's aggregation (Eq. 5 / Eq. 6 and the weight diversity), folded one user at a time as
    the replies arrive: per group, the running sum of its users' parameters
    (:class:`tasks.aggregate.RunningWeightedMean`), and the diversity's running sums of the
    classifier updates ``u_i = w_i - w_avg,i`` (:class:`tasks.aggregate.RunningDiversity`). The
    server's own model w_s is one more member of every group, added in :meth:`finish` (after its
    period, as in the paper's round); a group nobody replied to keeps w_s."""

    def __init__(self, strategy: "SSFLStrategy", user_group: dict[int, int]) -> None:
        self.s, self.user_group = strategy, user_group
        self.groups = [RunningWeightedMean(keys=strategy.keys) for _ in range(strategy.cfg.groups)]
        self.diversity = RunningDiversity(keys=strategy.classifier_keys)
        self.nodes: set[int] = set()

    @property
    def count(self) -> int:
        return len(self.nodes)

    def add(self, node: int, state: dict[str, np.ndarray]) -> None:
        g = self.user_group[node]
        self.diversity.add(state_delta(state, self.s.group_params[g], keys=self.s.classifier_keys))
        self.groups[g].add(state, 1.0)
        self.nodes.add(node)

    def finish(self) -> dict[str, float]:
        """Loads w_avg into the server model (its buffers untouched), stores the group models
        for the next round; returns the weight diversity."""
        s = self.s
        server = s.server_params()
        per_group = []
        for g in self.groups:
            g.add(server, 1.0)   # w_avg,i = (w_s + sum_{k in G_i} w_k) / (|G_i| + 1)
            per_group.append(g.result())
        if len(per_group) == 1:
            avg = {**{k: v.copy() for k, v in server.items()}, **per_group[0]}
            group_states = [avg]
        else:
            avg, group_states = combine_groups(server, per_group, keys=s.keys)
        load_numpy_state(s.model, avg, strict=False)
        s.group_params = [{k: np.asarray(g[k]) for k in s.keys} for g in group_states]
        div = self.diversity.result()
        if not math.isfinite(div):   # all users' updates zero (nothing above tau yet) or cancelling
            return {}
        return {"weight-diversity": div, "weight-diversity-k": div * self.diversity.count}


_PAPER = "Zhang et al. 2020, Benchmarking Semi-supervised Federated Learning"
_CLIENT = {"train": client_train}

ALGORITHMS = register({
    "ssfl": AlgorithmSpec(
        name="ssfl", paper=_PAPER, strategy_cls=SSFLStrategy, config_cls=SSFLConfig, namespace="ssfl",
        client=_CLIENT, node_state=(LOCAL_STATE_KEY,), label_metrics=LABEL_METRICS,
        description="labels on the server, CRL (FixMatch) users, averaging incl. the server; ssfl.groups=S for Eq. 6"),
    "ssfl-selftrain": AlgorithmSpec(
        name="ssfl-selftrain", paper=_PAPER, strategy_cls=SSFLStrategy, config_cls=SSFLConfig, namespace="ssfl",
        overrides={"user_loss": "self-training"}, client=_CLIENT, node_state=(LOCAL_STATE_KEY,),
        label_metrics=LABEL_METRICS,
        description="SSFL with the traditional self-training loss (Eq. 3) on users (paper: with norm='bn')"),
})


class SSFLClient(AlgorithmClient):
    """SSFL's client (``ssfl``, ``ssfl-selftrain``) with a user's model and the node's
    unlabeled data (``unlabeled``; labels, if given, only feed the ``pseudo-correct`` metric).

    Each ``train`` message: K = ``local_steps`` steps of consistency regularization (FixMatch
    CE of the strong view on the weak view's confident pseudo-label, tau) from the received
    model; the node keeps its own BatchNorm statistics between rounds."""

    module = __name__
    needs = ('unlabeled',)
