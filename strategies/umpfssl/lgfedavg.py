"""LG-FedAvg + FixMatch, a baseline of UM-pFSSL's Table 1 (``docs/baselines.md`` C4).

LG-FedAvg -- P. P. Liang, T. Liu, L. Ziyin, N. B. Allen, R. P. Auerbach, D. Brent,
R. Salakhutdinov, L.-P. Morency, "Think Locally, Act Globally: Federated Learning with Local
and Global Representations", arXiv:2001.01523 (NeurIPS 2019 workshop on FL; code:
pliang279/LG-FedAvg, ``main_lg.py``, ``models/Nets.py``, ``models/Update.py``; line numbers
at its commit 7af0568).

Rule. The model is split into local layers (kept on the node) and global layers
(``lgfedavg.global-layers``). Each round the sampled client k loads the global layers g plus
its own local layers, trains the **whole** model with FixMatch
(:func:`tasks.training.train_fixmatch`; pseudo-labels from its own model), keeps the local
layers and uploads only g_k; the server sets ``g = (1/|S|) sum_{k in S} g_k`` (uniform, as
``main_lg.py`` lines 98-109) and every client uses g from then on. Client k is evaluated with g
plus its local layers on its own test split.

Which layers are global (``lgfedavg.global-layers``):

* ``head`` (default, the paper's text: local representations below a global model): the head,
  found generically as in ``fedper-fix`` (:func:`tasks.models.head_prefix`: a StagedModel's
  last stage, else the model's last ``nn.Linear``); the final linear layer of the library's
  models. Everything else stays local.
* ``convolutions`` (the code's CIFAR-10 choice): every layer before the model's first
  ``nn.Linear`` (in module order) is global, that ``nn.Linear`` and everything after it local.
  ``main_lg.py`` line 46 makes the last ``num_layers_keep`` entries of the model's
  ``weight_keys`` global; for CIFAR-10 ``models/Nets.py`` lines 90-95 list them reversed
  (fc1, fc2, fc3, conv2, conv1), so ``--num_layers_keep 2`` (``scripts/main_lg_cifar10.sh``)
  makes the two convolutions global and all three fully-connected layers local. [ours] The
  BatchNorm layers of the convolutional part (the code's CNN has none) go with it; a model
  without a layer before its first ``nn.Linear`` (``mlp``) is a ``ConfigError``. (For MNIST the
  code's MLP lists its layers in order, lines 22-27, and ``--num_layers_keep 3`` makes its last
  three layers global.)

What travels: the global layers only, down and up (``weights``; ``eval-weights`` for
evaluation).

Client contract (``train``): ``arrays`` in (the global layers; with
``start(initial_arrays=...)`` also ``local-init``, the initial local layers, with a node's first
message), ``arrays`` out (the global layers) and ``metrics`` (``num-examples`` = |D_k^s| +
|D_k^u|, ``train-loss``, ``mask-rate``); the local layers in ``context.state["umpfssl.body"]``.
``evaluate``: ``arrays`` in, ``accuracy`` out.

Defaults: FixMatch's (``lgfedavg.tau`` ..., as ``fixmatch.*``) and the run's optimizer
(UM-pFSSL's setting). [ours] No FedAvg pre-training (the code's ``--load_fed``, ``main_lg.py``
line 43): every row of Table 1 starts from w_0, and a node's first participation starts from
the initial model's local layers (the seeded initial model, or the initial arrays' local
layers sent once as ``local-init``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tasks.config import ConfigError, knob

from ..client import AlgorithmClient
from .fixmatch_baselines import STATE_BODY, FixMatchConfig, FixMatchFedStrategy, FixMatchTrainer, head_keys, spec
from ..registry import register

#: lgfedavg.global-layers: the paper's text (the head global), the code's CIFAR-10 choice (the convolutions global)
GLOBAL_LAYERS = ("head", "convolutions")


@dataclass(frozen=True)
class LGFedAvgConfig(FixMatchConfig):
    """LG-FedAvg's knobs (``lgfedavg.*``): FixMatch's plus which layers are global."""

    namespace = "lgfedavg"

    global_layers: str = knob("head", choices=GLOBAL_LAYERS,
                              help="layers averaged by the server: head = the model's head, the paper's text; "
                                   "convolutions = every layer before the first nn.Linear, the code's CIFAR-10 "
                                   "choice (all fully-connected layers local)")


def convolution_keys(model: torch.nn.Module) -> list[str]:
    """The state-dict keys of every layer before the model's first ``nn.Linear`` (module order):
    the global layers of ``lgfedavg.global-layers=convolutions``."""
    keys = set(model.state_dict())
    out: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            return out
        entries = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        out += [k for k in (f"{name}.{e}" if name else e for e, _ in entries) if k in keys]
    return out


def global_keys(model: torch.nn.Module, layers: str) -> list[str]:
    """The keys the server averages under ``lgfedavg.global-layers=layers``."""
    if layers == "head":
        return head_keys(model)
    if layers == "convolutions":
        return convolution_keys(model)
    raise ConfigError(f"lgfedavg.global-layers={layers!r} is not one of: {', '.join(GLOBAL_LAYERS)}")


class LGFedAvgTrainer(FixMatchTrainer):
    """LG-FedAvg's client: every entry outside the global layers stays on the node."""

    config_cls = LGFedAvgConfig
    state_key = STATE_BODY

    def local_keys(self, model: torch.nn.Module, cfg: Any = None) -> list[str] | None:
        layers = (cfg if cfg is not None else LGFedAvgConfig()).global_layers
        glob = set(global_keys(model, layers))
        if not glob:
            raise ConfigError(f"lgfedavg.global-layers={layers!r} makes the layers before the model's first "
                              f"nn.Linear global, and {type(model).__name__} has none: use a convolutional model "
                              "(model='cnn', 'resnet9') or lgfedavg.global-layers='head'")
        local = [k for k in model.state_dict() if k not in glob]
        if not local:
            raise ConfigError(f"LG-FedAvg (algo lg-fedavg-fix) keeps the layers outside its global layers "
                              f"(lgfedavg.global-layers={layers!r}) local, and {type(model).__name__} has no other")
        return local


class LGFedAvgStrategy(FixMatchFedStrategy):
    """LG-FedAvg's server: the uniform mean of the global layers (the local layers stay on their nodes)."""

    trainer = LGFedAvgTrainer()
    uniform = send_local_init = True


ALGORITHMS = register({
    "lg-fedavg-fix": spec("lg-fedavg-fix", LGFedAvgStrategy,
                          "LG-FedAvg + FixMatch: local representation, global head or convolutions (uniform mean)"),
})


class LGFedAvgClient(AlgorithmClient):
    """LG-FedAvg's client with a user's model and the node's labeled, unlabeled and test data;
    the node keeps every layer outside the global layers (``lgfedavg.global-layers``)."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
