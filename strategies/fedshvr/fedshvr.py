"""Fed-SHVR and its baselines: federated SSL under class-distribution mismatch.

Paper: Z. Wang, X. Wang, R. Sun, T.-H. Chang, "Federated Semi-Supervised Learning with
Class Distribution Mismatch" (arXiv 2110.15813, 2021): the algorithm is its Sec. III and
Algorithm 1 (soft labels Eq. 8 and Lemma 1, the correction d_k Eqs. 15-16), the settings its
Sec. V. The paper's extracted text lost almost every equation; the formulas below are
reconstructions ([D]; ``docs/fedshvr.md``) and are checked numerically in ``tests/test_fedshvr.py`` and
``tests/test_aggregate.py`` / ``tests/test_losses.py``.

Setting (client-labeled). Client k holds N_k labeled samples from a few classes and M_k
unlabeled samples, a fraction ``partition-mismatch-ratio`` of which come from classes
absent from its labeled set (``tasks.partition.mismatch_partition``, label_mode
``"mismatch"``). All clients train the full model; the output is one global model.

Per round t (Algorithm 1):

1. Server (FedNova normalised averaging, ``tasks.aggregate.fednova_aggregate``)::

       theta^t = theta^{t-1} - tau * sum_k omega_k (theta^{t-1} - theta_k^{t-1,tau_k}) / tau_k,
       tau = sum_k omega_k tau_k,   omega_k ∝ N_k + M_k

   (trainable parameters; BN buffers, if any, get the plain omega-weighted mean).
2. Client k, soft pseudo-labels once per round with the fresh global model (Lemma 1,
   ``tasks.losses.closed_form_soft_label``)::

       v_{k,i} = argmin_{v in simplex} alpha0(t) CE(v, p) + alpha1 KL(v || u)
               = p^(alpha0/alpha1) / sum_s p_s^(alpha0/alpha1),   p = f_{theta^t}(u_{k,i})

   with the Gaussian ramp alpha0(t) = alpha0 * exp(-5 (1 - min(1, E t / rampup))^2)
   (the paper's Sec. V only says alpha0 ramps from 0 over the first 50 epochs; the Gaussian shape
   is our choice; E = ``local-epochs``, so e = E t local epochs).
3. Client k, correction (VRL-SGD / SCAFFOLD style, ``tasks.aggregate.vr_correction_update``)::

       d_k^t = d_k^{t-1} + (1/eta) [ (theta^{t-1} - theta_k^{t-1,tau_k}) / tau_k
                                    - (theta^{t-1} - theta^t) / tau ]

   so that sum_k omega_k d_k^t = 0.
4. Client k, tau_k = ceil(max(M_k E / B_u, N_k E / B_l)) local steps (``local-steps`` > 0
   overrides it with a fixed count) of::

       g = grad[ CE(y, f(x)) + alpha0(t) CE(v, f(u)) + alpha2 KL(f(u) || u) ]   (batch means)
       theta <- theta - eta (g - d_k^t)

   (the step is the task's SGD optimizer on the corrected gradient ``g - d_k``). The paper
   uses plain SGD, momentum 0 and weight decay 0, as ``conf/fedshvr-mnist5k.toml`` does; the
   library's task default is momentum 0.9 (every algorithm shares ``momentum``), so pass
   ``momentum=0.0`` (run config: ``momentum=0.0``) for the paper's optimizer.

Client state (``context.state``), kept minimal -- two model-sized ArrayRecords:

* ``fedshvr-carry`` = d_k^{t-1} + (theta^{t-1} - theta_k^{t-1,tau_k}) / (eta tau_k)
  (the correction plus this client's own normalised step of its last round: everything
  of d_k^t that is known when the round ends), and
* ``fedshvr-prev`` = theta^{t-1} (the global model it trained from),

plus ``fedshvr-info`` (ConfigRecord: the round it trained in). Then
d_k^t = carry - (theta^{t-1} - theta^t) / (eta tau) (:func:`correction_from_carry`); the
server sends only theta^t and scalars, as in the paper. No data, pseudo-label or d_k
leaves the client.

Missed rounds (the paper assumes full participation). The server broadcasts which round
produced the current global (``agg-round``), which partitions' uploads it contains
(``agg-partitions``) and the tau it used. A client applies the update of step 3 only if
its last upload is part of the current global (it trained in round ``agg-round`` and its
upload was aggregated). Otherwise -- it was not sampled, it timed out, or the round was
skipped -- its stored d_k is stale and it **resets d_k = 0** for this round (a fresh client,
i.e. plain FedNova for it), reported as ``vr-reset``. With partial participation the server
averages over the participants (omegas renormalised over them), so sum_k omega_k d_k = 0
then holds only approximately.

Client contract: a ``train`` message carries ``arrays`` (the global state dict), ``task``,
``algo`` (this config) and ``config`` with ``server-round``, ``tau`` (float, tau of the
aggregation that produced ``arrays``), ``agg-round`` (int, 0 = initial model) and
``agg-partitions`` (list of partition ids). The reply carries ``arrays`` (theta_k^{t,tau_k})
and ``metrics`` with ``num-examples`` (omega_k before normalisation: N_k + M_k, or N_k for
``fed-sl``), ``tau`` (tau_k), ``partition-id`` and the loss / pseudo-label diagnostics.

Baselines and ablations (switches of this code, see ``ALGORITHMS``):

* ``fed-pseudo``: FedAvg + hard pseudo-labels (alpha1 = alpha2 = 0, no correction, plain
  omega-weighted averaging).
* ``fed-mt``: FedAvg + mean-teacher consistency ||softmax(student(aug u)) -
  softmax(teacher(aug' u))||^2 weighted by alpha0(t); the EMA teacher is re-initialised
  from the global model at the start of every round (no client state) and updated after
  each local step with ``ema-decay``; inputs get the weak augmentation.
* ``fed-sl``: supervised FedAvg on the labeled part only (tau_k = ceil(N_k E / B_l)).
* ``fedshvr-no-r1`` (alpha1 = 0: hard labels), ``fedshvr-no-r2`` (alpha2 = 0),
  ``fedshvr-no-vr`` (no d_k: "FedNova only"), ``fedshvr-no-nova`` (plain averaging with
  d_k: "VRL-SGD only").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    algo_config,
    client_env,
    model_to_record,
    numpy_to_record,
    record_to_numpy,
)
from ..base import BaseStrategy
from tasks.aggregate import RunningFedNova, RunningWeightedMean, fednova_aggregate, weighted_mean
from tasks.config import knob
from tasks.ema import ema_update
from tasks.losses import closed_form_soft_label, kl_to_uniform, soft_ce
from tasks.training import (
    batch_indices,
    derive_seed,
    load_numpy_state,
    make_sgd,
    seeded,
    to_device_batch,
    trainable_keys,
)

from ..client import AlgorithmClient, server_round
from ..registry import AlgorithmSpec, register

NAMESPACE = "fedshvr"
STATE_CARRY = "fedshvr-carry"   # ArrayRecord: d_k^{t-1} + own normalised step / eta
STATE_PREV = "fedshvr-prev"     # ArrayRecord: theta^{t-1} (trainable parameters)
STATE_INFO = "fedshvr-info"     # ConfigRecord: {"trained-round": t-1}


@dataclass(frozen=True)
class FedSHVRConfig:
    """Fed-SHVR knobs (``fedshvr.<key>``); defaults are the paper's MNIST settings (its Sec. V)."""

    alpha0: float = knob(1.0, lo=0.0, help="final weight of the unlabeled loss (ramped; docs/fedshvr.md)")
    alpha1: float = knob(0.75, lo=0.0, help="r1 weight: soft-label sharpening T = alpha1/alpha0 (0 = hard labels)")
    alpha2: float = knob(0.1, lo=0.0, help="r2 weight: confidence penalty KL(f(u)||uniform) on unlabeled inputs")
    rampup_epochs: float = knob(50.0, lo=0.0, help="alpha0 Gaussian ramp length in local epochs (0 = no ramp)")
    unlabeled_batch_size: int = knob(32, lo=1, help="B_u (B_l is batch-size)")
    correction: bool = knob(True, help="variance-reduction correction d_k (VRL-SGD/SCAFFOLD style)")
    normalized_averaging: bool = knob(True, help="FedNova normalised averaging over heterogeneous tau_k")
    unsup_loss: str = knob("soft-label", choices=("soft-label", "mean-teacher", "none"),
                           help="unlabeled term: closed-form soft labels, mean-teacher consistency, or none (fed-sl)")
    ema_decay: float = knob(0.99, lo=0.0, hi=1.0, help="mean-teacher EMA decay (fed-mt)")
    augment: str = knob("none", choices=("none", "weak"), help="input augmentation for local training")
    weighting: str = knob("size", choices=("size", "uniform"), help="omega_k: N_k + M_k, or 1/K")
    steps: str = knob("own", choices=("own", "matched"),
                      help="tau_k: the algorithm's own ('own': fed-sl sweeps only its labeled set), or 'matched': "
                           "ceil(max(M_k E / B_u, N_k E / B_l)) for every algorithm, so fed-sl takes as many steps "
                           "(cycling its labels) as the semi-supervised rows")


# --------------------------------------------------------------------------- the rules
def alpha0_at(cfg: FedSHVRConfig, server_round: int, local_epochs: int) -> float:
    """alpha0(t) = alpha0 * exp(-5 (1 - min(1, e / rampup))^2), e = E t (the paper, Sec. V: a ramp
    from 0 over the first 50 epochs; its Gaussian shape is our choice)."""
    if cfg.rampup_epochs <= 0:
        return cfg.alpha0
    e = float(local_epochs) * server_round
    x = 1.0 - min(1.0, e / cfg.rampup_epochs)
    return cfg.alpha0 * math.exp(-5.0 * x * x)


def num_steps(task, cfg: FedSHVRConfig, n_labeled: int, n_unlabeled: int) -> int:
    """tau_k = ceil(max(M_k E / B_u, N_k E / B_l)) (E local epochs, the paper's Sec. V); ``fed-sl`` (no unlabeled term) sweeps its
    labeled set only, ceil(N_k E / B_l), unless ``steps='matched'``; ``local-steps`` > 0 overrides."""
    if task.local_steps > 0:
        return int(task.local_steps)
    e = task.local_epochs
    need = math.ceil(n_labeled * e / task.batch_size)
    if cfg.unsup_loss != "none" or cfg.steps == "matched":
        need = max(need, math.ceil(n_unlabeled * e / cfg.unlabeled_batch_size))
    return max(1, int(need))


def server_update(prev: Mapping[str, np.ndarray], uploads: list[Mapping[str, np.ndarray]],
                  taus: Iterable[float], omegas: Iterable[float], *, normalized: bool,
                  param_keys: Iterable[str] | None = None) -> tuple[dict[str, np.ndarray], float]:
    """The server rule: FedNova normalised averaging (or plain omega-weighted averaging).

    Returns ``(theta^t, tau)`` with ``tau = sum_k omega_k tau_k`` (omegas normalised over
    the uploads given). ``param_keys`` follow the rule; other keys (BN buffers) get the
    plain omega-weighted mean.
    """
    taus = np.asarray(list(taus), dtype=np.float64)
    w = np.asarray(list(omegas), dtype=np.float64)
    w = w / w.sum()
    tau = float(np.sum(w * taus))
    keys = list(prev) if param_keys is None else list(param_keys)
    others = [k for k in prev if k not in set(keys)]
    if normalized:
        new = fednova_aggregate(prev, uploads, taus, w, keys=keys, mean_keys=others)
    else:
        new = weighted_mean(uploads, w)
    return {k: np.asarray(v) for k, v in new.items()}, tau


def correction_from_carry(carry: Mapping[str, np.ndarray], prev_global: Mapping[str, np.ndarray],
                          new_global: Mapping[str, np.ndarray], tau: float, lr: float) -> dict[str, np.ndarray]:
    """d_k^t = carry - (theta^{t-1} - theta^t) / (eta tau)  (float64).

    With ``carry`` from :func:`carry_after_round` this is exactly
    ``tasks.aggregate.vr_correction_update`` (step 3 above; the paper's Eq. 15), from two stored vectors
    instead of three.
    """
    if tau <= 0 or lr <= 0:
        raise ValueError("tau and lr must be > 0")
    return {k: np.asarray(carry[k], dtype=np.float64)
            - (np.asarray(prev_global[k], dtype=np.float64) - np.asarray(new_global[k], dtype=np.float64))
            / (lr * tau) for k in carry}


def carry_after_round(d: Mapping[str, np.ndarray] | None, start: Mapping[str, np.ndarray],
                      final: Mapping[str, np.ndarray], tau_k: float, lr: float,
                      keys: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """carry = d_k^t + (theta^t - theta_k^{t,tau_k}) / (eta tau_k)  (float64); ``d=None`` is 0."""
    if tau_k <= 0 or lr <= 0:
        raise ValueError("tau_k and lr must be > 0")
    keys = list(start) if keys is None else list(keys)
    out = {}
    for k in keys:
        own = (np.asarray(start[k], dtype=np.float64) - np.asarray(final[k], dtype=np.float64)) / (lr * tau_k)
        out[k] = own + (np.asarray(d[k], dtype=np.float64) if d is not None else 0.0)
    return out


def corrected_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   d: Mapping[str, torch.Tensor] | None) -> None:
    """theta <- theta - eta (g - d_k): subtract d_k from the gradients, then the SGD step."""
    if d is not None:
        for name, p in model.named_parameters():
            if name in d:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.sub_(d[name])
    optimizer.step()


@torch.no_grad()
def soft_pseudo_labels(model: torch.nn.Module, data, aug, alpha0: float, alpha1: float,
                       device: torch.device, batch_size: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form soft labels v for all of ``data`` with the current model (eval mode).

    Returns ``(v [M, C], probs [M, C])``.
    """
    was = model.training
    model.eval()
    logits = []
    for s in range(0, len(data), batch_size):
        xb = torch.from_numpy(data.x[s:s + batch_size]).to(device)
        logits.append(model(aug.test(xb)).float())
    model.train(was)
    z = torch.cat(logits) if logits else torch.zeros(0, 1, device=device)
    return closed_form_soft_label(z, alpha0, alpha1, from_logits=True), torch.softmax(z, 1)


def local_train(model: torch.nn.Module, labeled, unlabeled, targets: torch.Tensor | None, *,
                cfg: FedSHVRConfig, task, aug, steps: int, alpha0: float,
                d: Mapping[str, torch.Tensor] | None, device: torch.device, seed: int) -> dict[str, float]:
    """tau_k corrected SGD steps on CE + alpha0 (soft-label CE | MT consistency) + alpha2 r2."""
    model.train()
    optimizer = make_sgd(model.parameters(), task)
    view = aug.weak if cfg.augment == "weak" else aug.test
    use_u = cfg.unsup_loss != "none" and len(unlabeled) > 0
    lab = batch_indices(len(labeled), task.batch_size, steps, torch.Generator().manual_seed(seed))
    unl = batch_indices(len(unlabeled), cfg.unlabeled_batch_size, steps,
                        torch.Generator().manual_seed(seed + 1)) if use_u else None
    teacher = None
    if use_u and cfg.unsup_loss == "mean-teacher":
        import copy
        teacher = copy.deepcopy(model)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
    sums = {"train-loss": 0.0, "sup-loss": 0.0, "unsup-loss": 0.0, "r2-loss": 0.0}
    with seeded(seed, device):   # augmentation and dropout draws
        for _ in range(steps):
            xl, yl = to_device_batch(labeled, next(lab), device)
            if use_u:
                iu = next(unl)
                xu, _ = to_device_batch(unlabeled, iu, device)
                logits = model(torch.cat([view(xl), view(xu)]))
                ll, lu = logits[: len(xl)], logits[len(xl):]
            else:
                ll = model(view(xl))
            sup = F.cross_entropy(ll, yl)
            loss = sup
            unsup = r2 = torch.zeros((), device=device)
            if use_u:
                if cfg.unsup_loss == "soft-label":
                    unsup = soft_ce(lu, targets[iu.to(targets.device)])
                else:
                    with torch.no_grad():
                        pt = torch.softmax(teacher(view(xu)), 1)
                    unsup = ((torch.softmax(lu, 1) - pt) ** 2).sum(1).mean()
                loss = loss + alpha0 * unsup
                if cfg.alpha2 > 0:
                    r2 = kl_to_uniform(lu)
                    loss = loss + cfg.alpha2 * r2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            corrected_step(model, optimizer, d)
            if teacher is not None:
                ema_update(teacher, model, cfg.ema_decay)
            for k, v in (("train-loss", loss), ("sup-loss", sup), ("unsup-loss", unsup), ("r2-loss", r2)):
                sums[k] += float(v.detach())
    return {k: v / max(steps, 1) for k, v in sums.items()}


# --------------------------------------------------------------------------- server
class FedSHVRStrategy(BaseStrategy):
    """FedNova normalised averaging over heterogeneous tau_k (or plain averaging), and the
    scalars the clients need for their correction (see module docstring)."""

    label_mode = "mismatch"

    def setup_algorithm(self) -> None:
        self.param_keys = trainable_keys(self.model)
        self.agg_round = 0           # round whose uploads produced the current global (0 = init)
        self.agg_partitions: list[int] = []
        self.agg_tau = 1.0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        cfg = ConfigRecord({**dict(config), "tau": float(self.agg_tau), "agg-round": int(self.agg_round),
                            "agg-partitions": [int(p) for p in self.agg_partitions] or [-1]})
        return super().configure_train(server_round, arrays, cfg, grid)

    def train_fold(self, server_round: int) -> "NovaFold":
        return NovaFold(self, server_round)

    def extra_state(self) -> dict[str, Any]:
        return {"agg_round": self.agg_round, "agg_partitions": list(self.agg_partitions),
                "agg_tau": self.agg_tau}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.agg_round = int(state.get("agg_round", 0))
        self.agg_partitions = list(state.get("agg_partitions", []))
        self.agg_tau = float(state.get("agg_tau", 1.0))


class NovaFold:
    """Fed-SHVR's round aggregate, folded reply by reply (:meth:`FedSHVRStrategy.train_fold`):
    FedNova's running sums (:class:`tasks.aggregate.RunningFedNova`; plain omega-weighted
    means without normalised averaging), omega = ``num-examples`` (``weighting='size'``) or 1,
    and the omega-weighted means of the reply metrics."""

    METRICS = ("train-loss", "sup-loss", "unsup-loss", "r2-loss", "alpha0", "pl-acc", "pl-acc-unseen",
               "pl-confidence", "d-norm")

    def __init__(self, strategy: "FedSHVRStrategy", server_round: int) -> None:
        self.s, self.round = strategy, server_round
        prev = {k: v.detach().cpu().numpy() for k, v in strategy.model.state_dict().items()}
        keys = list(prev) if strategy.param_keys is None else list(strategy.param_keys)
        others = [k for k in prev if k not in set(keys)]
        self.nova = RunningFedNova(prev, keys=keys, mean_keys=others)
        self.plain = RunningWeightedMean()
        self.taus: list[float] = []
        self.pids: list[int] = []
        self.sums = {k: [0.0, 0.0] for k in self.METRICS}
        self.consenting = self.vr_reset = self.vr_applied = 0
        self.omega = self.tau_sum = 0.0      # sum omega_k, sum omega_k tau_k

    def add(self, reply: Message) -> None:
        up = record_to_numpy(reply.content.array_records[ARRAYS_KEY])
        met = reply.content.metric_records[METRICS_KEY]
        omega = float(met["num-examples"]) if self.s.cfg.weighting == "size" else 1.0
        tau = float(met["tau"])
        if self.s.cfg.normalized_averaging:
            self.nova.add(up, tau, omega)
        else:
            self.plain.add(up, omega)
        self.taus.append(tau)
        self.pids.append(int(met["partition-id"]))
        for key, acc in self.sums.items():
            if key in met and math.isfinite(float(met[key])):
                acc[0] += omega * float(met[key])
                acc[1] += omega
        self.consenting += int("pl-acc" in met)   # consenting nodes (records.label_consent)
        self.vr_reset += int(met.get("vr-reset", 0))
        self.vr_applied += int(met.get("vr-applied", 0))
        self.omega += omega
        self.tau_sum += omega * tau

    def finish(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        s = self.s
        if len(self.taus) < s.policy.min_nodes:
            return None, None
        if s.cfg.normalized_averaging:
            new, tau = self.nova.result()
        else:
            new, tau = self.plain.result(), self.tau_sum / self.omega
        load_numpy_state(s.model, {k: np.asarray(v) for k, v in new.items()})
        s.agg_round, s.agg_partitions, s.agg_tau = self.round, sorted(self.pids), float(tau)
        out: dict[str, Any] = {"tau": float(tau), "tau-min": float(min(self.taus)), "tau-max": float(max(self.taus))}
        out.update({k: a / b for k, (a, b) in self.sums.items() if b > 0})
        out["label-metrics-nodes"] = self.consenting
        out["vr-reset"] = self.vr_reset
        out["vr-applied"] = self.vr_applied
        return s.global_arrays(), MetricRecord(out)


# --------------------------------------------------------------------------- client
def _algo_config(msg: Message) -> FedSHVRConfig:
    return algo_config(msg, FedSHVRConfig)


def client_train(msg: Message, context: Context) -> Message:
    """One Fed-SHVR round on this client (see the module docstring for the contract)."""
    env = client_env(msg, context, label_mode="mismatch")
    cfg, task = _algo_config(msg), env.task
    conf = msg.content.config_records[CONFIG_KEY]
    rnd = server_round(msg)
    model = env.build_model()
    global_np = record_to_numpy(msg.content.array_records[ARRAYS_KEY])
    load_numpy_state(model, global_np)
    keys = trainable_keys(model)
    labeled, unlabeled = env.labeled(), env.unlabeled()
    lr = float(task.lr)

    # step 3: the correction d_k^t from the stored carry (or 0 / reset)
    d_np, applied, reset = None, 0, 0
    st = context.state
    if cfg.correction and STATE_INFO in st.config_records:
        trained = int(st.config_records[STATE_INFO]["trained-round"])
        parts = [int(p) for p in conf.get("agg-partitions", [])]
        if (trained == int(conf.get("agg-round", -1)) and env.partition_id in parts
                and STATE_CARRY in st.array_records and STATE_PREV in st.array_records):
            d_np = correction_from_carry(record_to_numpy(st.array_records[STATE_CARRY]),
                                         record_to_numpy(st.array_records[STATE_PREV]),
                                         global_np, float(conf["tau"]), lr)
            applied = 1
        else:
            reset = 1  # stale d_k: this client's last upload is not in the current global
    d = None if d_np is None else {k: torch.from_numpy(v.astype(np.float32)).to(env.device)
                                   for k, v in d_np.items()}

    # step 2: pseudo-labels once per round with theta^t
    a0 = alpha0_at(cfg, rnd, task.local_epochs)
    metrics: dict[str, Any] = {}
    targets = None
    if cfg.unsup_loss != "none" and len(unlabeled) > 0:
        v, probs = soft_pseudo_labels(model, unlabeled, env.augmenter, a0, cfg.alpha1, env.device)
        targets = v
        if unlabeled.labels_known:  # a user's unlabeled images have no hidden labels to compare with
            y_true = torch.from_numpy(unlabeled.y).to(env.device)
            correct = (probs.argmax(1) == y_true).float()
            seen = torch.zeros(env.num_classes, dtype=torch.bool, device=env.device)
            seen[torch.from_numpy(np.unique(labeled.y)).to(env.device)] = True
            unseen = ~seen[y_true]
            metrics["pl-acc"] = float(correct.mean())
            metrics["pl-acc-unseen"] = float(correct[unseen].mean()) if bool(unseen.any()) else float("nan")
        metrics["pl-confidence"] = float(v.max(1).values.mean())

    # step 4: tau_k corrected local steps
    tau_k = num_steps(task, cfg, len(labeled), len(unlabeled))
    seed = derive_seed(task.seed, NAMESPACE, rnd, env.partition_id)
    metrics.update(local_train(model, labeled, unlabeled, targets, cfg=cfg, task=task, aug=env.augmenter,
                               steps=tau_k, alpha0=a0, d=d, device=env.device, seed=seed))
    final = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}

    if cfg.correction:
        carry = carry_after_round(d_np, global_np, final, tau_k, lr, keys=keys)
        st[STATE_CARRY] = numpy_to_record({k: v.astype(np.float32) for k, v in carry.items()})
        st[STATE_PREV] = numpy_to_record({k: global_np[k] for k in keys})
        st[STATE_INFO] = ConfigRecord({"trained-round": rnd})
    n_ex = len(labeled) + (len(unlabeled) if cfg.unsup_loss != "none" else 0)
    metrics.update({"num-examples": float(n_ex), "tau": float(tau_k), "partition-id": int(env.partition_id),
                    "alpha0": float(a0), "vr-applied": applied, "vr-reset": reset,
                    "d-norm": float(math.sqrt(sum(float(np.sum(x * x)) for x in d_np.values())))
                    if d_np is not None else 0.0})
    metrics = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
    return Message(RecordDict({ARRAYS_KEY: model_to_record(model), METRICS_KEY: MetricRecord(metrics)}),
                   reply_to=msg)


# --------------------------------------------------------------------------- registry
def _spec(name: str, description: str, **overrides: Any) -> AlgorithmSpec:
    return AlgorithmSpec(name=name, paper="Wang et al. 2021 (Fed-SHVR)", strategy_cls=FedSHVRStrategy,
                         config_cls=FedSHVRConfig, namespace=NAMESPACE, overrides=overrides,
                         client={"train": client_train}, description=description,
                         node_state=(STATE_CARRY, STATE_PREV, STATE_INFO),
                         label_metrics=("pl-acc", "pl-acc-unseen"))   # (from the node's hidden labels)


ALGORITHMS = register({
    "fedshvr": _spec("fedshvr", "soft labels (r1) + confidence penalty (r2) + VR correction + FedNova"),
    "fed-pseudo": _spec("fed-pseudo", "FedAvg + hard pseudo-labels (baseline)", alpha1=0.0, alpha2=0.0,
                        correction=False, normalized_averaging=False),
    "fed-mt": _spec("fed-mt", "FedAvg + mean-teacher consistency (baseline)", unsup_loss="mean-teacher",
                    alpha2=0.0, correction=False, normalized_averaging=False),
    "fed-sl": _spec("fed-sl", "supervised FedAvg on the clients' labeled data only (baseline)",
                    unsup_loss="none", alpha2=0.0, correction=False, normalized_averaging=False),
    "fedshvr-no-r1": _spec("fedshvr-no-r1", "ablation: alpha1 = 0 (hard pseudo-labels)", alpha1=0.0),
    "fedshvr-no-r2": _spec("fedshvr-no-r2", "ablation: alpha2 = 0 (no confidence penalty)", alpha2=0.0),
    "fedshvr-no-vr": _spec("fedshvr-no-vr", "ablation: no correction d_k (FedNova only)", correction=False),
    "fedshvr-no-nova": _spec("fedshvr-no-nova", "ablation: plain averaging (VRL-SGD only)",
                             normalized_averaging=False),
})


class FedSHVRClient(AlgorithmClient):
    """Fed-SHVR's client (and its baselines and ablations) with a user's model and the node's
    labeled and unlabeled data (``labeled``, ``unlabeled``; ``fed-sl`` uses the labeled set
    only). Each ``train`` message: sharpened soft pseudo-labels, the confidence penalty and
    the variance-reduction correction over tau_k local steps; the node keeps its correction
    between rounds."""

    module = __name__
    needs = ('labeled',)
