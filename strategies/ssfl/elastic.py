"""EASGD and OverlapSGD: the SSFL benchmark's supervised references with elastic/anchor
averaging (the SSFL paper's Sec. 4.4, Table 4; ``docs/baselines.md`` D2, D3).

Both run the same worker loop: worker i keeps its own model x_i from round to round
(``context.state``), runs tau local SGD steps on its labeled data (tau = the round's local
steps: ``local-steps``, else ``local-epochs`` passes), and then is pulled toward a centre
variable held by the server. One Flower round = one communication period. Every client's
data is labeled (label mode ``"all"``, as :mod:`strategies.fedavg`).

``easgd`` -- S. Zhang, A. Choromanska, Y. LeCun, "Deep Learning with Elastic Averaging SGD",
NeurIPS 2015. Synchronous EASGD with period tau. After the tau local steps, with the
PRE-update x_i and the centre z of this round (the one the message carried)::

    x_i <- x_i - a (x_i - z)                       (on the worker, kept for the next round)
    z   <- z + a sum_i (x_i - z)                   (on the server, sum over the replies)

a = ``easgd.beta`` / K, K the number of workers (nodes connected this round); beta = m a =
0.9 is the EASGD paper's choice, hence a = 0.9/K. ``easgd.alpha`` > 0 fixes a instead;
the centre update is ``z <- (1 - m a) z + a sum_i x_i`` and needs m a <= 1 (else z overshoots): a K a > 1
is a :class:`ConfigError` naming the key. The server evaluates the centre z.

``overlapsgd`` -- J. Wang, H. Liang, G. Joshi, "Overlap Local-SGD: An Algorithmic Approach to
Hide Communication Delays in Distributed SGD", ICASSP 2020 (arXiv:2002.09539), following the
authors' ``distoptim/OverlapLocalSGD.py``. The anchor z the workers pull toward in
round r is the all-reduce result of round r-1 (one period stale: in the original it was
all-reduced in the background while round r's local steps ran). After the tau local steps::

    x_i <- (1 - a) x_i + a z                       (pull toward the stale anchor; a = pull)
    v_i <- gmf v_i + (z - x_i) / lr                (anchor momentum; v_i = 0 at the start)
    z_i' = z - lr v_i                              (the worker's contribution)
    z   <- (1/m) sum_i z_i'                        (server: the all-reduce; the next round's anchor)

a = ``overlapsgd.pull`` = 0.6, gmf = ``overlapsgd.gmf`` = 0.7 (the authors' ``launch_baseline.sh``);
with gmf = 0 the anchor is the mean of the pulled models. lr is the task's ``lr``.

What travels, both: the centre/anchor z down (``arrays``, byte kind ``weights``) and one model
per worker up (EASGD: x_i before the pull; OverlapSGD: z_i'), |w| each way per period.

Client contract (both): a ``train`` message carries ``arrays`` (z, the full state dict),
``task``, ``algo`` (the config below) and ``config`` (``server-round``; EASGD also
``elastic-a``, the a of this round). The node loads x_i from ``context.state['elastic.x']``
(a node without it -- its first round, or its state lost -- starts from z) and its local SGD
momentum from ``'elastic.momentum'``, trains, applies its rule and stores x_i (OverlapSGD also
v_i, ``'elastic.anchor-v'``); the reply carries ``arrays`` (see above) and ``metrics``
(``num-examples``: samples seen, ``train-loss``).

Parameters only, as the authors' code [C]: the elastic / anchor rule applies to the model's
parameters, not to its buffers. The originals are optimizers over ``model.parameters()``
(github.com/JYWa/Overlap_Local_SGD ``train_LocalSGD.py`` lines 151 and 160) whose anchors and
rules run over their ``param_groups`` (``distoptim/EASGD.py`` lines 78-82, 147-157
``block_average`` and 175-181 ``average``; ``distoptim/OverlapLocalSGD.py`` lines 79-82 and
155-173; the SSFL authors' copy, ``LocalSGD.py`` lines 146-158 and 214-240). BatchNorm's
running statistics stay each worker's own: never pulled, never averaged (with the SSFL paper's
GroupNorm there are none).

Choices the sources leave open, ours [ours]:

* the server evaluates the centre / anchor z, which has no counterpart in the originals
  (each worker evaluates its own model, ``train_LocalSGD.py`` line 178): its buffers are the
  mean of the workers' (EASGD: of the pre-update x_i; OverlapSGD: the workers contribute their
  own buffers to the all-reduce; integer buffers rounded), and a worker that starts from z takes them;
* the local SGD momentum buffer persists on the worker across periods (as in the authors'
  optimizer, which never resets it), with Nesterov momentum (``nesterov``, as the OverlapSGD authors' code);
* constant learning rate (the task's ``lr``; the originals' step schedule, x0.1 at 50% and 83%
  of training, is not implemented), as the library's supervised FedAvg it is compared with;
* partial participation: the centre update sums over the replies that arrived, with a = beta/K
  over all K connected workers; OverlapSGD's all-reduce is the mean over the replies;
* OverlapSGD's evaluated model is the anchor z (the mean of the workers is not returned).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.serverapp import Grid

from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    algo_config,
    client_env,
    numpy_to_record,
    record_to_numpy,
)
from tasks.config import ConfigError, knob
from tasks.training import derive_seed, load_numpy_state, make_sgd, num_local_steps, train_supervised

from ..base import BaseStrategy
from ..client import AlgorithmClient, reply, server_round
from ..registry import AlgorithmSpec, register

X_KEY = "elastic.x"              # context.state: the worker's own model x_i (full state dict)
MOMENTUM_KEY = "elastic.momentum"  # context.state: the local SGD momentum buffers (by parameter name)
ANCHOR_V_KEY = "elastic.anchor-v"  # context.state: OverlapSGD's anchor momentum v_i


@dataclass(frozen=True)
class EASGDConfig:
    """EASGD knobs (namespace ``easgd``)."""

    beta: float = knob(0.9, lo=0.0, hi=1.0, lo_open=True,
                       help="beta = m a: the moving rate is a = beta / K over the K workers (paper: 0.9)")
    alpha: float = knob(0.0, lo=0.0, hi=1.0, hi_open=True,
                        help="fixed moving rate a (0 = beta / K); needs K a <= 1")
    nesterov: bool = knob(True, help="Nesterov momentum in the local steps (EAMSGD; the SSFL authors' optimizer)")


@dataclass(frozen=True)
class OverlapSGDConfig:
    """OverlapSGD knobs (namespace ``overlapsgd``)."""

    pull: float = knob(0.6, lo=0.0, hi=1.0, help="a: pull x_i <- (1 - a) x_i + a z toward the stale anchor")
    gmf: float = knob(0.7, lo=0.0, hi=1.0, hi_open=True, help="anchor momentum factor (0 = anchor is the mean)")
    nesterov: bool = knob(True, help="Nesterov momentum in the local steps (the authors' launch script)")


# --------------------------------------------------------------------------- the rules
def _f64(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in d.items()}


def _cast_like(values: dict[str, np.ndarray], like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in values.items():
        t, v = np.asarray(like[k]), np.asarray(v)   # (0-d arithmetic gives numpy scalars)
        out[k] = np.asarray(v.astype(t.dtype) if np.issubdtype(t.dtype, np.floating) else np.rint(v).astype(t.dtype))
    return out


def _ruled(keys, params) -> set[str]:
    """The entries the elastic / anchor rule applies to: ``params`` (the model's parameters), or
    every entry where ``params`` is None."""
    return set(keys) if params is None else set(params) & set(keys)


def easgd_worker(x: dict[str, np.ndarray], z: dict[str, np.ndarray], a: float,
                 params=None) -> dict[str, np.ndarray]:
    """The worker's elastic step ``x <- x - a (x - z)`` on the entries ``params`` (default: all);
    the others (BatchNorm's buffers) keep the worker's own values."""
    xf, zf = _f64(x), _f64(z)
    ruled = _ruled(xf, params)
    return _cast_like({k: xf[k] - a * (xf[k] - zf[k]) if k in ruled else xf[k] for k in xf}, x)


class SumFold:
    """A running float64 sum of states, folded one at a time (the server then lets each go):
    ``add(x)`` adds ``x - centre`` (or ``x`` without a centre); ``result()`` hands the sum and the
    count to ``finish``. The same additions in the same order as summing the list at once."""

    def __init__(self, like: dict[str, np.ndarray], finish, centre: dict[str, np.ndarray] | None = None):
        self.like, self.finish, self.centre = like, finish, centre
        self.sums: dict[str, Any] = {k: 0 for k in like}
        self.count = 0

    def add(self, x: dict[str, np.ndarray]) -> None:
        for k in self.sums:
            v = np.asarray(x[k], dtype=np.float64)
            self.sums[k] = self.sums[k] + (v - self.centre[k] if self.centre is not None else v)
        self.count += 1

    def result(self) -> dict[str, np.ndarray]:
        if self.count == 0:
            raise ValueError("need at least one state")
        return _cast_like(self.finish(self.sums, self.count), self.like)


def easgd_fold(z: dict[str, np.ndarray], a: float, params=None) -> SumFold:
    """The centre's step ``z <- z + a sum_i (x_i - z)`` on the entries ``params`` (default: all),
    folded over the workers' pre-update ``x_i``; the other entries (BatchNorm's buffers) become the
    mean of the workers' ``z + sum_i (x_i - z) / n``."""
    zf = _f64(z)
    ruled = _ruled(zf, params)
    return SumFold(z, lambda sums, n: {k: zf[k] + (a * sums[k] if k in ruled else sums[k] / n) for k in zf},
                   centre=zf)


def easgd_centre(z: dict[str, np.ndarray], xs: list[dict[str, np.ndarray]], a: float,
                 params=None) -> dict[str, np.ndarray]:
    """The centre's step ``z <- z + a sum_i (x_i - z)`` with the workers' pre-update ``x_i``
    (:func:`easgd_fold`)."""
    fold = easgd_fold(z, a, params)
    for x in xs:
        fold.add(x)
    return fold.result()


def overlap_worker(x: dict[str, np.ndarray], v: dict[str, np.ndarray] | None, z: dict[str, np.ndarray],
                   pull: float, gmf: float, lr: float, params=None):
    """OverlapSGD's period end on one worker (``OverlapLocalSGD.average``): returns the pulled
    ``x``, the anchor momentum ``v`` (float32) and the contribution ``z - lr v`` to the all-reduce,
    on the entries ``params`` (default: all); the other entries (BatchNorm's buffers) are not
    pulled, have no ``v`` and are contributed as the worker's own."""
    xf, zf = _f64(x), _f64(z)
    ruled = _ruled(xf, params)
    pulled = {k: (1.0 - pull) * xf[k] + pull * zf[k] if k in ruled else xf[k] for k in xf}
    new_v = {k: (gmf * np.asarray(v[k], dtype=np.float64) if v is not None and k in v else 0.0)
             + (zf[k] - pulled[k]) / lr for k in xf if k in ruled}
    contrib = {k: zf[k] - lr * new_v[k] if k in ruled else xf[k] for k in xf}
    return (_cast_like(pulled, x), {k: np.asarray(val, dtype=np.float32) for k, val in new_v.items()},
            _cast_like(contrib, z))


def overlap_fold(like: dict[str, np.ndarray]) -> SumFold:
    """The all-reduce, folded: the mean of the workers' ``z_i'`` (the next round's anchor)."""
    return SumFold(like, lambda sums, n: {k: v / n for k, v in sums.items()})


def overlap_anchor(contribs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The all-reduce: the mean of the workers' ``z_i'`` (the next round's anchor)."""
    fold = overlap_fold(contribs[0])
    for c in contribs:
        fold.add(c)
    return fold.result()


# --------------------------------------------------------------------------- worker side
def _state(context: Context, key: str) -> dict[str, np.ndarray] | None:
    return record_to_numpy(context.state[key]) if key in context.state else None


def _local_steps(model: torch.nn.Module, env, optimizer: torch.optim.Optimizer, rnd: int, name: str) -> dict:
    """The tau local SGD steps of cross-entropy on the node's labeled data (weak view)."""
    data = env.labeled()
    task = env.task
    return train_supervised(model, data, aug=env.augmenter, steps=num_local_steps(task, len(data)),
                            batch_size=task.batch_size, optimizer=optimizer, device=env.device,
                            seed=derive_seed(task.seed, name, rnd, env.partition_id))


def _worker_period(msg: Message, context: Context, name: str, nesterov: bool):
    """Load x_i (else z) and the momentum, run the local steps, keep the momentum; returns
    ``(x_i after the local steps, z, metrics, the node's Env, whether x_i was the node's own, the
    names of the model's parameters)``."""
    env = client_env(msg, context, label_mode="all")
    if len(env.labeled()) == 0:
        raise ConfigError(f"{name}: this node has no labeled data (every worker trains on its own labels)")
    rnd = server_round(msg)
    z = record_to_numpy(msg.content.array_records[ARRAYS_KEY])
    model = env.build_model()
    x = _state(context, X_KEY)
    if x is not None and (set(x) != set(z) or any(np.shape(x[k]) != np.shape(z[k]) for k in z)):
        x = None   # another model than the centre's (a node reused across runs): start from z
    load_numpy_state(model, x if x is not None else z)
    optimizer = make_sgd(model.parameters(), env.task, nesterov=nesterov)
    buffers = _state(context, MOMENTUM_KEY) if x is not None else None
    if buffers:
        for k, p in model.named_parameters():
            if k in buffers and tuple(buffers[k].shape) == tuple(p.shape):
                optimizer.state[p]["momentum_buffer"] = torch.from_numpy(buffers[k].copy()).to(p.device, p.dtype)
    metrics = _local_steps(model, env, optimizer, rnd, name)
    kept = {k: optimizer.state[p]["momentum_buffer"] for k, p in model.named_parameters()
            if optimizer.state.get(p, {}).get("momentum_buffer") is not None}
    if kept:
        context.state[MOMENTUM_KEY] = numpy_to_record({k: v.detach().cpu().numpy() for k, v in kept.items()})
    trained = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    return trained, z, metrics, env, x is not None, {k for k, _ in model.named_parameters()}


def easgd_train(msg: Message, context: Context) -> Message:
    """One EASGD period on a worker: tau local steps, then ``x <- x - a (x - z)``; replies the
    pre-update x_i."""
    cfg = algo_config(msg, EASGDConfig)
    a = float(msg.content.config_records[CONFIG_KEY]["elastic-a"])
    trained, z, metrics, _, _, params = _worker_period(msg, context, "easgd", cfg.nesterov)
    context.state[X_KEY] = numpy_to_record(easgd_worker(trained, z, a, params))
    return reply(msg, numpy_to_record(trained), metrics)


def overlap_train(msg: Message, context: Context) -> Message:
    """One OverlapSGD period on a worker: tau local steps, the pull toward the (stale) anchor z
    this message carries, the anchor momentum; replies ``z_i' = z - lr v_i``."""
    cfg = algo_config(msg, OverlapSGDConfig)
    trained, z, metrics, env, own, params = _worker_period(msg, context, "overlapsgd", cfg.nesterov)
    v = _state(context, ANCHOR_V_KEY) if own else None   # (a node starting from z has v_i = 0)
    lr = float(env.task.lr)
    if lr <= 0:
        raise ConfigError(f"overlapsgd: lr={lr} must be > 0 (the anchor momentum divides by lr)")
    pulled, new_v, contrib = overlap_worker(trained, v, z, cfg.pull, cfg.gmf, lr, params)
    context.state[X_KEY] = numpy_to_record(pulled)
    context.state[ANCHOR_V_KEY] = numpy_to_record(new_v)
    return reply(msg, numpy_to_record(contrib), metrics)


# --------------------------------------------------------------------------- server side
class _ElasticStrategy(BaseStrategy):
    """The server of both: sends the centre/anchor, combines the replies (one rule each)."""

    label_mode = "all"

    def round_config(self, server_round: int, grid: Grid) -> dict[str, Any]:
        return {}

    def fold(self, z: dict[str, np.ndarray], conf: dict) -> SumFold:
        """The rule that combines the round's replies with the centre ``z``, folded one reply at a
        time as it arrives (:class:`SumFold`)."""
        raise NotImplementedError

    def param_names(self) -> set[str]:
        """The entries the rule applies to: the model's parameters (not BatchNorm's buffers)."""
        return {k for k, _ in self.model.named_parameters()}

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        conf = self.round_config(server_round, grid)
        msgs = list(self.configure_train(server_round, self.global_arrays(), ConfigRecord(conf), grid))
        z = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
        fold, loss = self.fold(z, conf), [0.0, 0.0]   # sum n_k loss_k, sum n_k

        def add(r: Message) -> None:
            fold.add(record_to_numpy(r.content.array_records[ARRAYS_KEY]))
            m = r.content.metric_records[METRICS_KEY]
            loss[0] += float(m["num-examples"]) * float(m["train-loss"])
            loss[1] += float(m["num-examples"])

        folded = self.exchange_fold(grid, msgs, add)
        out: dict[str, Any] = {"participants": folded, **conf}
        if folded < self.policy.min_nodes:
            out["skipped"] = 1
            return out
        load_numpy_state(self.model, fold.result())
        out["train-loss"] = loss[0] / loss[1] if loss[1] > 0 else float("nan")
        return out


class EASGDStrategy(_ElasticStrategy):
    """Synchronous EASGD (Zhang, Choromanska, LeCun 2015): the server holds the centre z."""

    def moving_rate(self, workers: int) -> float:
        """a = beta / K, or the fixed ``alpha`` (checked: K a <= 1)."""
        cfg = self.cfg
        if cfg.alpha <= 0:
            return cfg.beta / max(workers, 1)
        if workers * cfg.alpha > 1.0:
            raise ConfigError(
                f"easgd.alpha={cfg.alpha:g} with K={workers} workers gives m*a={workers * cfg.alpha:g} > 1: the "
                f"centre update z <- (1 - m a) z + a sum x_i is unstable; allowed: easgd.alpha <= 1/K = "
                f"{1.0 / workers:g}, or easgd.alpha=0 (a = easgd.beta / K)")
        return cfg.alpha

    def round_config(self, server_round: int, grid: Grid) -> dict[str, Any]:
        workers = len(grid.get_node_ids())
        return {"elastic-a": float(self.moving_rate(workers)), "workers": workers}

    def fold(self, z, conf):
        return easgd_fold(z, float(conf["elastic-a"]), self.param_names())


class OverlapSGDStrategy(_ElasticStrategy):
    """Overlap Local-SGD (Wang, Liang, Joshi 2020): the server holds the anchor z."""

    def fold(self, z, conf):
        return overlap_fold(z)


ALGORITHMS = register({
    "easgd": AlgorithmSpec(
        name="easgd", paper="Zhang, Choromanska, LeCun 2015 (NeurIPS); SSFL Table 4", strategy_cls=EASGDStrategy,
        config_cls=EASGDConfig, namespace="easgd", client={"train": easgd_train},
        node_state=(X_KEY, MOMENTUM_KEY),
        description="synchronous elastic averaging SGD, period = local steps, all client data labeled"),
    "overlapsgd": AlgorithmSpec(
        name="overlapsgd", paper="Wang, Liang, Joshi 2020 (ICASSP); SSFL Table 4", strategy_cls=OverlapSGDStrategy,
        config_cls=OverlapSGDConfig, namespace="overlapsgd", client={"train": overlap_train},
        node_state=(X_KEY, MOMENTUM_KEY, ANCHOR_V_KEY),
        description="Overlap Local-SGD: pull toward the one-period-stale anchor, anchor momentum, all data labeled"),
})


class EASGDClient(AlgorithmClient):
    """The worker of ``easgd`` and ``overlapsgd`` with a user's model and the node's own labeled
    data (``labeled``): it keeps its own model x_i between rounds, runs the round's local SGD
    steps and applies the elastic (EASGD) or anchor (OverlapSGD) rule the server's message names."""

    module = __name__
    needs = ("labeled",)
