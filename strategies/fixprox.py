"""FixProx: FixAvg (FedAvg + FixMatch) with FedProx's proximal term, a baseline of UM-pFSSL.

FedProx -- Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in
Heterogeneous Networks" (MLSys 2020): client k minimises its local objective plus
``mu/2 ||w - w^t||^2`` (Eq. 2), w^t the global model it received; the server averages as
FedAvg does. Here the local objective is FixMatch's (``strategies.fixmatch_baselines``):

    L_k(w) = CE(f_w(weak(x_l)), y_l) + lambda_u L_u(w) + mu/2 ||w - w^t||^2

``mu`` is ``umpfssl.prox-mu`` (default 0.01, UM-pFSSL's setting). The server is FixAvg's,
unchanged; ``mu`` reaches the client in the ``algo`` record every message carries.

Client contract: FixAvg's (``train``: ``arrays`` in, ``arrays`` and ``num-examples`` out;
``evaluate`` on the node's test split), with the proximal term added to every local step.
The same ``client_train`` serves ``fedprox-sl`` (:mod:`strategies.supervised_refs`), whose mode
trains with plain CE on fully labeled data instead of FixMatch.
"""
from __future__ import annotations

from flwr.app import Context, Message

from tasks.losses import proximal_term

from .fixmatch_baselines import _CLIENT, _STATE, FixMatchClient, FixMatchFedStrategy
from .fixmatch_baselines import client_train as fixavg_train
from .registry import bind
from .umpfssl import _algo_cfg, _spec


class FixProxStrategy(FixMatchFedStrategy):
    """FixAvg's server: FedProx changes only the clients' objective."""


def client_train(msg: Message, context: Context) -> Message:
    """FixAvg's local training plus ``mu/2 ||w - w^t||^2``."""
    mu = _algo_cfg(msg).prox_mu
    return fixavg_train(msg, context, regularizer=lambda model: proximal_term(model, mu))


ALGORITHMS = bind({
    "fixprox": _spec("fixprox", FixProxStrategy, "fixprox", "FedProx + FixMatch on unlabeled data",
                     {**_CLIENT, "train": client_train}, _STATE),
})


class FixProxClient(FixMatchClient):
    """FixProx's client with a user's model and the node's labeled, unlabeled and test data."""

    module = __name__
