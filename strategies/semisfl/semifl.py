"""SemiFL: labels on the server, unlabeled clients, full-model FL with alternate training.

Paper: E. Diao, J. Ding, V. Tarokh, "SemiFL: Semi-Supervised Federated Learning for Unlabeled
Clients with Alternate Training", NeurIPS 2022 (arXiv:2106.01432); code
github.com/diaoenmao/SemiFL-Semi-Supervised-Federated-Learning-for-Unlabeled-Clients-with-Alternate-Training
(``src/train_classifier_ssfl.py``, ``src/modules/modules.py``); ``docs/baselines.md`` A1. A
comparison row of Semi-SFL (the Semi-SFL paper's Sec. V-B, Tables II, IV, V). **Not** :mod:`strategies.semisfl.semisfl`, which is Semi-SFL (Sun et al.), another paper.

Setting: the server holds the labeled set D_S (``server-labels``, label mode ``"server"``); the
clients hold only unlabeled, possibly non-IID data. One global model w, evaluated on the
server's test set (with its sBN statistics).

Round t (the authors' order, ``train_classifier_ssfl.py``: clients, then the server update,
then the server's fine-tuning):

1. Sample the clients (``fraction-train``); send w (its state dict, BN statistics included) and
   the round's learning rate ``lr``.
2. Client m pseudo-labels all its data once with the received model in eval mode:
   ``q = softmax(f_w(weak(x)))``, ``yhat = argmax q``. The **fix set** is
   ``F = {x : max q >= tau}``; the **mix set** is all its data with their ``yhat`` (no threshold).
   A client with ``F`` empty skips the round and says so (``trained = 0``, no weights up).
3. Local SGD over F (``local-steps``, else ``local-epochs`` passes over F; batches of
   ``batch-size``): per batch x with pseudo-labels yhat, partners (x', yhat') drawn uniformly
   **with replacement** from the mix set, ``lam ~ Beta(a, a)`` (one per batch),
   ``x_mix = lam weak(x) + (1 - lam) weak(x')`` and
   ``L = CE(f(strong(x)), yhat) + lam CE(f(x_mix), yhat) + (1 - lam) CE(f(x_mix), yhat')``
   (batch means over the fix batch; :func:`tasks.semisfl.semifl_losses.fix_mix_loss`); gradients clipped
   to norm ``clip-norm`` before every step; the client's SGD state (momentum buffers) is kept
   from one round to the next (``context.state["semifl.optimizer"]``), its lr set by the server.
4. Global momentum over the trainable parameters of the clients that trained:
   ``wbar = (1/|A|) sum_{m in A} w_m``, ``v <- beta_g v + (w - wbar)``, ``w <- w - v``
   (authors' ``Server.update``: SGD, lr 1, momentum beta_g; :func:`tasks.semisfl.semifl_losses.global_momentum_step`).
   No client trained: w and v are unchanged.
5. The server fine-tunes w with CE on D_S (weak view; ``semifl.server-steps``, else
   ``local-steps`` / ``local-epochs`` passes over D_S; batches of ``batch-size``; clip-norm as the
   clients), then **sBN** (``sbn=0``): every BatchNorm layer's running statistics are recomputed
   from scratch over D_S (test view, in order, cumulative average;
   :func:`tasks.semisfl.semifl_losses.static_bn`). The result is evaluated and is what round t+1 sends.

Defaults (authors' code unless noted): tau = 0.95, a = 0.75, beta_g = 0.5, clip norm 1, Nesterov
momentum (the task's ``momentum``, ``weight-decay``, ``lr``), cosine decay of the lr over the
rounds (one rate per round, shared by the server and the clients of that round).

What travels per sampled client: down the whole state dict (parameters and BN buffers, kind
``weights``); up the trainable parameters (kind ``weights``), nothing from a client that skipped.

Client contract: a ``train`` message carries ``arrays`` (the global state dict), ``task``, ``algo``
(:class:`SemiFLConfig`) and ``config`` (``server-round``, ``lr``); the reply carries ``arrays``
(the trainable parameters after local training; absent when the client skipped) and ``metrics``:
``num-examples`` (fix samples seen), ``train-loss``, ``fix-size`` (|F|), ``unlabeled-size``,
``trained`` (1/0), ``partition-id`` and, with the node's consent only, ``fix-correct`` (fix-set
pseudo-labels that match the hidden labels). Node state: ``semifl.optimizer`` (SGD momentum
buffers by parameter name).

Choices the sources leave open, ours:

* [ours] budgets: the client runs ``local-steps`` steps (the Semi-SFL row: K_u = 20, batch 64)
  and the server ``semifl.server-steps`` (the row: 50, batch 64); the authors run E = 5 epochs
  over F with batch 10 and E_S = 5 epochs over D_S.
* [ours] ``semifl.server-first`` (default false, the authors' code): one server fine-tuning stage
  (and sBN) before round 1's clients (in the code round 1
  pseudo-labels come from the random model, so nearly every client skips it). The Semi-SFL
  row sets it true.
* [ours] round 1 sends the initial model as it is (the code recomputes its BN statistics on
  D_S first); from round 2 on the model sent is the evaluated one, sBN included, as in the code.
* [ours] the server's fine-tuning starts from a fresh SGD state every round, as the authors'
  code did up to commit 246dc1b (``src/modules/modules.py``, ``Server.train`` loads
  ``self.optimizer_state_dict``, saved once in ``Server.__init__``, and never writes it back).
  From commit a11493e on (HEAD 4ec3663: ``Server.train``, line 201) the code writes the state
  back after each fine-tuning, so its server SGD momentum persists across rounds; not followed
  here. The clients' SGD state persists (``Client.train``), as in every version.
* [ours] sBN batches are ``batch-size`` (a last batch of 1 joins the one before it); a model
  without BatchNorm running statistics (GroupNorm, none, a user's model) skips sBN.
* [ours] a round with fewer than ``min-nodes`` replies is skipped whole (no server stage), as
  in the library's other algorithms; the code always fine-tunes.
* Not implemented: the ``sbn=1`` option (statistics from server plus client data, which needs a
  statistics query to the clients) and the ``ft=0`` parallel variant.
"""
from __future__ import annotations

from dataclasses import dataclass
from logging import WARNING
from typing import Any

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
from tasks.aggregate import RunningWeightedMean
from tasks.config import ConfigError, knob
from tasks.data import ArrayDataset
from tasks.schedules import cosine_decay
from tasks.semisfl.semifl_losses import (
    ClippedSGD,
    fix_mix_loss,
    fix_set,
    global_momentum_step,
    pseudo_labels,
    static_bn,
)
from tasks.training import (
    batch_indices,
    derive_seed,
    load_numpy_state,
    num_local_steps,
    seeded,
    train_supervised,
    trainable_keys,
)

from ..base import BaseStrategy
from ..client import AlgorithmClient, server_round
from ..registry import AlgorithmSpec, register

OPT_STATE_KEY = "semifl.optimizer"   # context.state ArrayRecord: the client's SGD momentum buffers
LABEL_METRICS = ("fix-correct",)


@dataclass(frozen=True)
class SemiFLConfig:
    """``semifl.*`` run-config keys (defaults: the authors' code; ``docs/baselines.md`` A1)."""

    tau: float = knob(0.95, lo=0.0, hi=1.0, help="confidence threshold of the fix set (max softmax >= tau)")
    mix_alpha: float = knob(0.75, lo=0.0, lo_open=True, help="a of the Mixup weight lam ~ Beta(a, a)")
    global_momentum: float = knob(0.5, lo=0.0, hi=1.0, hi_open=True,
                                  help="beta_g of the server update v <- beta_g v + (w - wbar), w <- w - v")
    server_steps: int = knob(0, lo=0, help="server fine-tuning steps per round (0 = local-steps, else "
                                           "local-epochs passes over the server's labeled set)")
    server_first: bool = knob(False, help="one server fine-tuning stage before round 1's clients "
                                          "(a choice the sources leave open, docs/baselines.md; false = the authors' code)")
    static_bn: bool = knob(True, help="sBN: recompute the BN running statistics from the server's labeled "
                                      "data after each server stage (sbn=0)")
    clip_norm: float = knob(1.0, lo=0.0, help="clip the gradient norm before every SGD step (0 = no clip)")
    nesterov: bool = knob(True, help="Nesterov momentum (authors' code)")
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"),
                            help="per-round lr: cosine decay over num-rounds, or constant")


def make_optimizer(params, task, cfg: SemiFLConfig, lr: float) -> ClippedSGD:
    """SemiFL's local optimizer (server and clients): SGD with the task's momentum and weight
    decay, Nesterov (``nesterov``), gradient norm clipped to ``clip-norm`` before every step."""
    return ClippedSGD(params, lr=lr, momentum=task.momentum, weight_decay=task.weight_decay,
                      nesterov=cfg.nesterov and task.momentum > 0, clip_norm=cfg.clip_norm)


# --------------------------------------------------------------------------- client side
def train_fix_mix(model: torch.nn.Module, data: ArrayDataset, fix: np.ndarray, yhat: torch.Tensor, *, aug,
                  steps: int, batch_size: int, optimizer: torch.optim.Optimizer, device: torch.device,
                  seed: int, alpha: float) -> dict[str, float]:
    """``steps`` SGD steps of :func:`tasks.semisfl.semifl_losses.fix_mix_loss` over the fix set ``fix``
    (indices into ``data``, reshuffled epochs of ``batch_size``), partners drawn with replacement
    from all of ``data``; ``yhat`` (on the CPU) are the pseudo-labels of all of ``data``."""
    model.train()
    gen = torch.Generator().manual_seed(derive_seed(seed, "batches"))
    partners = torch.Generator().manual_seed(derive_seed(seed, "partners"))
    lams = np.random.default_rng(derive_seed(seed, "lambda")).beta(alpha, alpha, size=max(steps, 1))
    total = fix_total = mix_total = 0.0
    seen = 0
    with seeded(seed, device):   # augmentation and dropout draws
        for i, idx in enumerate(batch_indices(len(fix), batch_size, steps, gen)):
            rows = fix[idx.numpy()]
            other = torch.randint(len(data), (len(rows),), generator=partners).numpy()
            x = torch.from_numpy(data.x[rows]).to(device)
            xp = torch.from_numpy(data.x[other]).to(device)
            y = yhat[torch.from_numpy(rows)].to(device)
            yp = yhat[torch.from_numpy(other)].to(device)
            lam = float(lams[i])
            x_mix = lam * aug.weak(x) + (1.0 - lam) * aug.weak(xp)
            loss, lf, lm = fix_mix_loss(model(aug.strong(x)), y, model(x_mix), yp, lam)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(rows)
            fix_total += float(lf.detach()) * len(rows)
            mix_total += float(lm.detach()) * len(rows)
            seen += len(rows)
    n = max(seen, 1)
    return {"train-loss": total / n, "fix-loss": fix_total / n, "mix-loss": mix_total / n,
            "num-examples": float(seen)}


def _load_momentum(optimizer: torch.optim.Optimizer, model: torch.nn.Module, context: Context,
                   device: torch.device) -> None:
    if OPT_STATE_KEY not in context.state:
        return
    saved = record_to_numpy(context.state[OPT_STATE_KEY])
    for name, p in model.named_parameters():
        buf = saved.get(name)
        if buf is not None and tuple(buf.shape) == tuple(p.shape):
            optimizer.state[p]["momentum_buffer"] = torch.from_numpy(np.array(buf)).to(device=device, dtype=p.dtype)


def _save_momentum(optimizer: torch.optim.Optimizer, model: torch.nn.Module, context: Context) -> None:
    bufs = {name: optimizer.state[p]["momentum_buffer"].detach().cpu().numpy()
            for name, p in model.named_parameters()
            if p in optimizer.state and optimizer.state[p].get("momentum_buffer") is not None}
    if bufs:
        context.state[OPT_STATE_KEY] = numpy_to_record(bufs)


def client_train(msg: Message, context: Context) -> Message:
    """One round on a client (see the module docstring's client contract)."""
    env = client_env(msg, context, label_mode="server")
    cfg = algo_config(msg, SemiFLConfig)
    conf = msg.content.config_records[CONFIG_KEY]
    task = env.task
    rnd = server_round(msg)
    lr = float(conf["lr"]) if "lr" in conf else task.lr
    model = env.build_model()
    load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    data = env.unlabeled()
    seed = derive_seed(task.seed, "semifl-client", rnd, env.partition_id)
    yhat, confidence = pseudo_labels(model, data, env.augmenter.weak, env.device, derive_seed(seed, "label"))
    yhat = yhat.cpu()
    fix = fix_set(confidence, cfg.tau)
    metrics: dict[str, Any] = {"unlabeled-size": float(len(data)), "fix-size": float(len(fix)),
                               "partition-id": float(env.partition_id)}
    if data.labels_known:   # (label-derived: sent with the node's consent only)
        metrics["fix-correct"] = float((yhat[fix] == torch.from_numpy(data.y[fix])).sum()) if len(fix) else 0.0
    if len(fix) == 0:       # nothing confident: this client skips the round (authors' code)
        metrics.update({"trained": 0.0, "num-examples": 0.0})
        return Message(RecordDict({METRICS_KEY: MetricRecord(metrics)}), reply_to=msg)
    optimizer = make_optimizer(model.parameters(), task, cfg, lr)
    _load_momentum(optimizer, model, context, env.device)
    metrics.update(train_fix_mix(model, data, fix, yhat, aug=env.augmenter,
                                 steps=num_local_steps(task, len(fix)), batch_size=task.batch_size,
                                 optimizer=optimizer, device=env.device, seed=seed, alpha=cfg.mix_alpha))
    _save_momentum(optimizer, model, context)
    metrics["trained"] = 1.0
    return Message(RecordDict({ARRAYS_KEY: model_to_record(model, trainable_keys(model)),
                               METRICS_KEY: MetricRecord(metrics)}), reply_to=msg)


# --------------------------------------------------------------------------- server side
class SemiFLStrategy(BaseStrategy):
    """SemiFL (Diao et al. 2022): server fine-tuning + sBN, fix/mix clients, global momentum."""

    label_mode = "server"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.keys: list[str] = []     # (set before the base's __init__, which sets a user's model up)
        self.velocity: dict[str, np.ndarray] | None = None
        self.warm = False
        super().__init__(*args, **kwargs)
        if self.user is None and self.task.server_labels <= 0:
            raise ConfigError("semifl needs server-labels > 0 (N_s labeled samples on the server)")

    def setup_algorithm(self) -> None:
        if len(self.env.server_labeled()) == 0:
            raise ConfigError("semifl needs labeled data on the server: labeled_data=(x, y)" if self.user is not None
                              else "semifl needs labeled data on the server (run config: server-labels > 0)")
        self.keys = trainable_keys(self.model)
        self.velocity = None
        self.warm = False

    @property
    def server_trains_first(self) -> bool:   # (BaseStrategy's flag: round 1 sends the fine-tuned model)
        return bool(self.cfg is not None and self.cfg.server_first)

    def round_lr(self, server_round: int) -> float:
        if self.cfg.lr_schedule == "constant":
            return self.task.lr
        return cosine_decay(server_round - 1, max(self.num_rounds or server_round, 1), self.task.lr)

    def server_stage(self, server_round: int, lr: float, tag: str) -> dict[str, float]:
        """CE fine-tuning on the server's labeled set, then sBN (module docstring, step 5)."""
        env, task = self.env, self.task
        data = env.server_labeled()
        steps = self.cfg.server_steps or num_local_steps(task, len(data))
        out = train_supervised(self.model, data, aug=env.augmenter, steps=steps, batch_size=task.batch_size,
                               optimizer=make_optimizer(self.model.parameters(), task, self.cfg, lr),
                               device=env.device, seed=derive_seed(task.seed, "semifl-server", server_round, tag))
        if self.cfg.static_bn:
            static_bn(self.model, data, env.augmenter.test, task.batch_size, env.device,
                      derive_seed(task.seed, "semifl-sbn", server_round, tag))
        return out

    def params(self) -> dict[str, np.ndarray]:
        sd = self.model.state_dict()
        return {k: sd[k].detach().cpu().numpy().copy() for k in self.keys}

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        lr = self.round_lr(server_round)
        out: dict[str, Any] = {"lr": lr}
        if self.cfg.server_first and not self.warm:
            out["server-first-loss"] = self.server_stage(server_round, lr, "first")["train-loss"]
        self.warm = True
        arrays = model_to_record(self.model)
        msgs = []
        for n in self.sample_nodes(grid, server_round):
            content = self.base_content(server_round, lr=lr)
            content[ARRAYS_KEY] = arrays
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        # each reply folded as it arrives (the uniform mean's running sums, its small metrics
        # kept), then let go: the server holds one model's worth however many clients reply
        mean, mets = RunningWeightedMean(keys=self.keys), []

        def fold(r: Message) -> None:
            mets.append(dict(r.content.metric_records[METRICS_KEY]))
            if ARRAYS_KEY not in r.content.array_records:   # (a client with an empty fix set)
                return
            u = record_to_numpy(r.content.array_records[ARRAYS_KEY])
            if set(u) != set(self.keys):
                self.drop(r.metadata.src_node_id, "its upload is not the model's trainable parameters: "
                          f"{sorted(set(u) ^ set(self.keys))[:5]}")
                return
            mean.add(u, 1.0)

        out["participants"] = self.exchange_fold(grid, msgs, fold)
        if out["participants"] < self.policy.min_nodes:
            out["skipped"] = 1
            log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round, out["participants"],
                self.policy.min_nodes)
            return out
        out["trained-clients"] = mean.count
        if mean.count:
            new_w, self.velocity = global_momentum_step(self.params(), mean.result(), self.velocity,
                                                        self.cfg.global_momentum)
            load_numpy_state(self.model, new_w, strict=False)
        out["server-train-loss"] = self.server_stage(server_round, lr, "fine-tune")["train-loss"]
        told = [(float(m["train-loss"]), float(m["num-examples"])) for m in mets if "train-loss" in m]
        if told:
            out["train-loss"] = float(np.average([v for v, _ in told], weights=[w for _, w in told]))
        size = sum(float(m.get("unlabeled-size", 0.0)) for m in mets)
        fix = sum(float(m.get("fix-size", 0.0)) for m in mets)
        out["fix-rate"] = fix / size if size > 0 else 0.0
        # label-derived: from the nodes that consented (records.label_consent); else not reported
        out["label-metrics-nodes"], correct = consented_share(mets, "fix-correct", "fix-size")
        if correct is not None:
            out["pseudo-label-accuracy"] = correct
        return out

    # ---------------------------------------------------------------- checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"velocity": self.velocity, "warm": self.warm}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.velocity = state.get("velocity")
        self.warm = bool(state.get("warm", False))


ALGORITHMS = register({
    "semifl": AlgorithmSpec(
        name="semifl", paper="Diao, Ding, Tarokh 2022 (NeurIPS); Semi-SFL baseline", strategy_cls=SemiFLStrategy,
        config_cls=SemiFLConfig, namespace="semifl", client={"train": client_train},
        node_state=(OPT_STATE_KEY,), label_metrics=LABEL_METRICS,
        description="labels on the server: fine-tuning + sBN, fix/mix pseudo-label clients, global momentum"),
})


class SemiFLClient(AlgorithmClient):
    """SemiFL's client with a user's model and the node's unlabeled data (``unlabeled``; labels,
    if given, only feed the ``fix-correct`` metric, with the node's consent).

    Each ``train`` message: pseudo-label every sample once with the received model (eval mode,
    weak view); if some reach ``tau``, ``local_steps`` steps of the fix + mix loss over them, the
    node's SGD momentum kept between rounds; the reply is the trained parameters."""

    module = __name__
    needs = ("unlabeled",)
