"""LG-FedAvg + FixMatch, a baseline of UM-pFSSL's Table 1 (``docs/baselines.md`` C4).

LG-FedAvg -- P. P. Liang, T. Liu, L. Ziyin, N. B. Allen, R. P. Auerbach, D. Brent,
R. Salakhutdinov, L.-P. Morency, "Think Locally, Act Globally: Federated Learning with Local
and Global Representations", arXiv:2001.01523 (NeurIPS 2019 workshop on FL; code:
pliang279/LG-FedAvg, ``main_lg.py``, ``models/Update.py``).

Rule (the opposite of FedPer). The model is a local representation (kept on the node) below
a global head. The head is found generically: a StagedModel's last stage, else the model's
last ``nn.Linear`` (:func:`tasks.models.head_prefix`, as ``fedper-fix``); everything else is
the body. Each round the sampled client k loads the global head g plus its own body, trains
the **whole** model with FixMatch (:func:`tasks.training.train_fixmatch`; pseudo-labels from
its own model), keeps the body and uploads only the head; the server sets
``g = (1/|S|) sum_{k in S} g_k`` (uniform, as ``main_lg.py``) and every client uses g from then on.
Client k is evaluated with g plus its body on its own test split.

What travels: the head only, down and up (``weights``; ``eval-weights`` for evaluation).

Client contract (``train``): ``arrays`` in (the head; with ``start(initial_arrays=...)`` also
``local-init``, the initial body, with a node's first message), ``arrays`` out (the head)
and ``metrics`` (``num-examples`` = |D_k^s| + |D_k^u|, ``train-loss``, ``mask-rate``); the body in
``context.state["umpfssl.body"]``. ``evaluate``: ``arrays`` in, ``accuracy`` out.

Defaults: FixMatch's (``umpfssl.fixmatch-*``) and the run's optimizer (UM-pFSSL's setting).
[ours] No FedAvg pre-training (the code's ``--load_fed``): every row of Table 1 starts from
w_0, and a node's first participation starts from the initial model's body (the seeded
initial model, or the initial arrays' body sent once as ``local-init``). The code's
``num_layers_keep`` (the last layers global) is the head here: the final linear layer for
the library's models (for ResNet-9 too [ours]: the code's CNN keeps its last two layers global).
"""
from __future__ import annotations

import torch

from tasks.config import ConfigError

from ..client import AlgorithmClient
from .fixmatch_baselines import STATE_BODY, FixMatchFedStrategy, FixMatchTrainer, head_keys, spec
from ..registry import register


class LGFedAvgTrainer(FixMatchTrainer):
    """LG-FedAvg's client: every entry below the head stays on the node."""

    state_key = STATE_BODY

    def local_keys(self, model: torch.nn.Module) -> list[str] | None:
        head = set(head_keys(model))
        body = [k for k in model.state_dict() if k not in head]
        if not body:
            raise ConfigError(f"LG-FedAvg (algo lg-fedavg-fix) keeps the layers below the head local, and "
                              f"{type(model).__name__} has only its head")
        return body


class LGFedAvgStrategy(FixMatchFedStrategy):
    """LG-FedAvg's server: the uniform mean of the heads (the bodies stay on their nodes)."""

    trainer = LGFedAvgTrainer()
    uniform = send_local_init = True


ALGORITHMS = register({
    "lg-fedavg-fix": spec("lg-fedavg-fix", LGFedAvgStrategy,
                          "LG-FedAvg + FixMatch: local representation, global head (uniform mean)"),
})


class LGFedAvgClient(AlgorithmClient):
    """LG-FedAvg's client with a user's model and the node's labeled, unlabeled and test data;
    the node keeps every layer below the head."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
