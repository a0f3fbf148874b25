"""FedProx and FedLC: FedAvg whose clients change one term of their objective (SCALA's
full-model baselines: the SCALA paper's Sec. 5.1, Tables III-V; ``docs/baselines.md`` B1, B2).

``fedprox`` -- T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith, "Federated
Optimization in Heterogeneous Networks", MLSys 2020. Client k approximately minimises
``h_k(w) = F_k(w) + mu/2 ||w - w^t||^2`` from the global weights ``w^t``: each local SGD step is
``w <- w - lr (grad F_k(w) + mu (w - w^t))`` (the squared norm over trainable parameters only,
:func:`tasks.losses.proximal_term`). The server is FedAvg's:
``w^{t+1} = sum_k n_k w_k / sum_k n_k`` over the clients that replied, n_k = |D_k| the client's
number of training samples, whatever number of local iterations it ran (the authors' code:
``flearn/models/client.py`` line 11 ``num_samples = len(train_data['y'])``, returned with the
solution by ``solve_inner``, line 48, and ``solve_iters``, line 64; ``flearn/trainers/fedbase.py``
``aggregate``, lines 115-125, weights by it); ``upload-weight=processed-examples`` (the round
policy) weights by the samples processed instead. ``mu = 0.01``
(our choice: the authors give no universal mu and suggest tuning it from {0.001, 0.01, 0.1, 0.5, 1};
FedBN's code, ``federated/fed_digits.py``, runs FedProx with 1e-2).
Not implemented: the paper's systems-heterogeneity setting, in which a share of each
round's selected devices are stragglers (the code's ``--drop_percent``, ``main.py``
lines 81-84, default 0.1). In the authors' ``flearn/trainers/fedprox.py`` (lines 49-68) a
straggler runs a random number of epochs in ``[1, E)`` and its partial solution is aggregated
with the others; ``flearn/trainers/fedavg.py`` (lines 30-35) drops the stragglers instead.
Here every node that replies runs the configured local work, nodes fail only when they fail,
and ``mu`` alone separates FedProx from FedAvg.

``fedlc`` -- J. Zhang, Z. Li, B. Li, J. Xu, S. Wu, S. Ding, C. Wu, "Federated Learning with
Label Distribution Skew via Logits Calibration", ICML 2022. Client k trains on the cross-entropy
of calibrated logits ``f_c(x) - tau n_{k,c}^(-1/4)``, ``n_{k,c}`` its count of class c
(:func:`tasks.losses.calibrated_ce`; ``y`` stays in the softmax denominator, as FL-bench found
necessary: FL-bench ``src/client/fedlc.py``); the server is FedAvg's, and inference uses the raw
logits. ``tau = 1.0`` (FL-bench's value; the paper gives none).

What travels, both: the global weights down and the local weights up (``num-examples`` n_k =
|D_k|, ``processed-examples``), as in FedAvg. In SCALA's comparison they run ``I`` local steps on
batches of ``B/|S_t|``, the client's share of SCALA's concatenated batch (``flower_apps.papers``; our choice: the same samples
per step as SCALA).

Client contract: FedAvg's (:mod:`strategies.fedavg`); the ``algo`` record carries ``mu`` or ``tau``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Context, Message

from strategies.core.records import algo_config
from tasks.config import knob
from tasks.data import ArrayDataset
from tasks.env import Env
from tasks.losses import calibrated_ce, proximal_term

from .client import AlgorithmClient
from .fedavg import FedAvgStrategy
from .fedavg import client_train as fedavg_train
from .registry import AlgorithmSpec, register


@dataclass(frozen=True)
class FedProxConfig:
    """FedProx knobs (namespace ``fedprox``)."""

    mu: float = knob(0.01, lo=0.0, help="mu: weight of the proximal term mu/2 ||w - w^t||^2 (0 = FedAvg)")


@dataclass(frozen=True)
class FedLCConfig:
    """FedLC knobs (namespace ``fedlc``)."""

    tau: float = knob(1.0, lo=0.0, help="tau: calibration strength of f_c - tau n_c^(-1/4) (0 = FedAvg)")


class FedProxStrategy(FedAvgStrategy):
    """FedAvg's server: FedProx changes only the clients' objective."""


class FedLCStrategy(FedAvgStrategy):
    """FedAvg's server: FedLC changes only the clients' loss."""


def fedprox_train(msg: Message, context: Context) -> Message:
    """FedAvg's local training plus ``mu/2 ||w - w^t||^2``."""
    mu = algo_config(msg, FedProxConfig).mu
    return fedavg_train(msg, context, regularizer=lambda model: proximal_term(model, mu))


def fedlc_train(msg: Message, context: Context) -> Message:
    """FedAvg's local training on the logits calibrated by this client's class counts."""
    tau = algo_config(msg, FedLCConfig).tau

    def loss(env: Env, data: ArrayDataset):
        counts = torch.as_tensor(np.bincount(np.asarray(data.y), minlength=env.num_classes), dtype=torch.float32)
        return lambda logits, y: calibrated_ce(logits, y, counts, tau)

    return fedavg_train(msg, context, loss_fn=loss)


ALGORITHMS = register({
    "fedprox": AlgorithmSpec(
        name="fedprox", paper="Li et al. 2020 (MLSys); SCALA baseline", strategy_cls=FedProxStrategy,
        config_cls=FedProxConfig, namespace="fedprox", client={"train": fedprox_train},
        description="FedAvg + proximal term mu/2 ||w - w^t||^2, all client data labeled"),
    "fedlc": AlgorithmSpec(
        name="fedlc", paper="Zhang et al. 2022 (ICML); SCALA baseline", strategy_cls=FedLCStrategy,
        config_cls=FedLCConfig, namespace="fedlc", client={"train": fedlc_train},
        description="FedAvg with logits calibrated by the local class counts, all client data labeled"),
})


class FedProxClient(AlgorithmClient):
    """The client of ``fedprox`` and ``fedlc`` with a user's model and the node's own labeled
    data (``labeled``): FedAvg's local SGD plus the proximal term (``mu``), or on logits
    calibrated by the node's own class counts (``tau``), as the server's message says."""

    module = __name__
    needs = ("labeled",)
