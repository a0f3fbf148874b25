"""FixProx: FixAvg (FedAvg + FixMatch) with FedProx's proximal term, a baseline of UM-pFSSL.

FedProx -- Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks" (MLSys 2020): client k minimises its local objective plus
``mu/2 ||w - w^t||^2`` (Eq. 2), w^t the global model it received; the server averages as
FedAvg does. Here the local objective is FixMatch's (``strategies.umpfssl.fixmatch_baselines``):

    L_k(w) = CE(f_w(weak(x_l)), y_l) + lambda_u L_u(w) + mu/2 ||w - w^t||^2

``mu`` is ``fixprox.mu`` (default 0.01, UM-pFSSL's setting; FixMatch's keys as ``fixmatch.*``,
under ``fixprox.*``). The server is FixAvg's, unchanged; ``mu`` reaches the client in the
``algo`` record every message carries.

Client contract: FixAvg's (``train``: ``arrays`` in, ``arrays`` and ``num-examples`` out;
``evaluate`` on the node's test split), with the proximal term added to every local step.
:class:`FixProxTrainer` is also the base of ``fedprox-sl``'s client
(:mod:`strategies.umpfssl.supervised_refs`), which trains with plain CE on fully labeled data instead of FixMatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tasks.config import knob
from tasks.losses import proximal_term

from .fixmatch_baselines import FixMatchClient, FixMatchConfig, FixMatchFedStrategy, FixMatchTrainer, spec
from ..registry import register


@dataclass(frozen=True)
class FixProxConfig(FixMatchConfig):
    """FixProx's knobs (``fixprox.*``): FixMatch's plus FedProx's ``mu``."""

    namespace = "fixprox"

    mu: float = knob(0.01, lo=0.0, help="FedProx proximal weight mu")


class FixProxTrainer(FixMatchTrainer):
    """FixAvg's client plus ``mu/2 ||w - w^t||^2`` in every local step."""

    config_cls = FixProxConfig

    def regularizer(self, model: torch.nn.Module, cfg: Any) -> Callable[[], torch.Tensor] | None:
        return proximal_term(model, cfg.mu)


class FixProxStrategy(FixMatchFedStrategy):
    """FixAvg's server: FedProx changes only the clients' objective."""

    trainer = FixProxTrainer()


ALGORITHMS = register({
    "fixprox": spec("fixprox", FixProxStrategy, "FedProx + FixMatch on unlabeled data"),
})


class FixProxClient(FixMatchClient):
    """FixProx's client with a user's model and the node's labeled, unlabeled and test data."""

    module = __name__
