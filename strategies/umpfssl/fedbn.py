"""FixBN: FedBN + FixMatch, a baseline of UM-pFSSL's Table 1 (``docs/baselines.md`` C2-C3).

FedBN -- X. Li, M. Jiang, X. Zhang, M. Kamp, Q. Dou, "FedBN: Federated Learning on Non-IID
Features via Local Batch Normalization", ICLR 2021 (code: med-air/FedBN,
``federated/fed_digits.py: communication()``). FixMatch -- K. Sohn et al., "FixMatch:
Simplifying Semi-Supervised Learning with Consistency and Confidence", NeurIPS 2020.

Rule. Every BatchNorm layer's parameters and buffers (weight, bias, running_mean,
running_var, num_batches_tracked) stay on the node; they are found by module type
(``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm), not by name,
and a model without any is a ``ConfigError``. Each round the sampled client k loads the
shared (non-BN) entries w plus its own BN_k, runs FixAvg's local FixMatch steps
(:func:`tasks.training.train_fixmatch`: ``CE(f(weak(x_l)), y_l) + lambda_u L_u``, pseudo-labels
from its own model: its own BN), keeps BN_k and uploads the rest; the server sets every
shared entry to the **uniform** mean ``w_j = (1/|S|) sum_{k in S} w_{k,j}`` (FedBN's code; the
UM-pFSSL paper gives no weighting). Client k is evaluated with w plus BN_k on its own test split.

Pseudo-labels are computed in train mode, as FixMatch's code (FixBN has no code of its own:
FedBN's rule with FixMatch's loss). The weak view's forward pass
(:func:`tasks.training.fixmatch_loss`, under ``torch.no_grad()`` only) normalises with the
batch's BatchNorm statistics and updates the node's running statistics, as the labeled and
strong passes do: google-research/fixmatch (commit d4985a1) ``fixmatch.py`` lines 99-104 run one
``training=True`` pass over the labeled, weak and strong batches and line 113 takes
``pseudo_labels = stop_gradient(softmax(logits_weak))`` from it (kekmodel/FixMatch-pytorch,
commit 040be3b, ``train.py`` the same: ``model.train()`` line 317, one pass lines 357-360, the pseudo-label
line 368). [ours] The three views pass through the model separately (BatchNorm statistics per
view, the running statistics updated three times a step), not as one concatenated batch.

What travels: the non-BN entries, down and up (``weights``); the ``evaluate`` message carries
them too (``eval-weights``).

Client contract (``train``): ``arrays`` in (the non-BN entries; with ``start(initial_arrays=...)``
also ``local-init``, the initial BN, with a node's first message), ``arrays`` out (non-BN
entries) and ``metrics`` (``num-examples`` = |D_k^s| + |D_k^u|, ``train-loss``, ``mask-rate``);
BN_k in ``context.state["umpfssl.bn"]``. ``evaluate``: ``arrays`` in, ``accuracy`` out.

[ours] A node's first participation starts from the initial model's BN (the seeded initial
model, or the initial arrays' BN sent once as ``local-init``); a node that never trained is
evaluated with it. FedBN-SL, the same federation trained with CE on fully labeled data, is
:mod:`strategies.umpfssl.supervised_refs`.
"""
from __future__ import annotations

import torch

from tasks.config import ConfigError

from ..client import AlgorithmClient
from .fixmatch_baselines import STATE_BN, FixMatchFedStrategy, FixMatchTrainer, batchnorm_keys, spec
from ..registry import register


class FixBNTrainer(FixMatchTrainer):
    """FedBN's client: every BatchNorm entry stays on the node."""

    state_key = STATE_BN

    def local_keys(self, model: torch.nn.Module, cfg: object = None) -> list[str] | None:
        keys = batchnorm_keys(model)
        if not keys:
            raise ConfigError(f"FedBN (algo fixbn, fedbn-sl) keeps the BatchNorm layers local, and "
                              f"{type(model).__name__} has none: use a model with nn.BatchNorm layers "
                              "(run config: norm='bn')")
        return keys


class FixBNStrategy(FixMatchFedStrategy):
    """FedBN's server: the uniform mean of the non-BN entries (every BatchNorm layer stays on its node)."""

    trainer = FixBNTrainer()
    uniform = send_local_init = True


ALGORITHMS = register({
    "fixbn": spec("fixbn", FixBNStrategy, "FedBN + FixMatch: BatchNorm layers local, uniform mean of the rest"),
})


class FixBNClient(AlgorithmClient):
    """FixBN's client with a user's model (with BatchNorm layers) and the node's labeled,
    unlabeled and test data; the node keeps its BatchNorm layers."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
