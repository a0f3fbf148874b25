"""FedAvg-SL, FedProx-SL, FedBN-SL: the privileged-label references of UM-pFSSL's Table 1
(the UM-pFSSL paper's Sec. 6.1, Table 1; ``docs/baselines.md`` C6).

The standard methods trained with plain cross-entropy on **fully labeled** client data: the
node's labeled split D_k^s united with its unlabeled split D_k^u **with D_k^u's true labels**
(a reference no semi-supervised method can have; not a strict upper bound: in the paper's Table 1
UM-pFSSL beats FedAvg-SL on CIFAR-10 at alpha = 0.5). n_k = |D_k^s| + |D_k^u|: the split that
defines every other row is kept, not redrawn.

* ``fedavg-sl`` -- FedAvg: H. B. McMahan, E. Moore, D. Ramage, S. Hampson, B. Agüera y Arcas,
  "Communication-Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017.
  Local SGD on CE from the global w; ``w <- sum_k n_k w_k / sum_k n_k`` (every entry).
* ``fedprox-sl`` -- FedProx: T. Li, A. K. Sahu, M. Zaheer, M. Sanjabi, A. Talwalkar, V. Smith,
  "Federated Optimization in Heterogeneous Networks", MLSys 2020. FedAvg-SL plus
  ``mu/2 ||w - w^t||^2`` in every local step (``fixprox.mu``, 0.01, FedProx's default here too).
* ``fedbn-sl`` -- FedBN: X. Li, M. Jiang, X. Zhang, M. Kamp, Q. Dou, "FedBN: Federated Learning
  on Non-IID Features via Local Batch Normalization", ICLR 2021. Every BatchNorm layer
  (parameters and buffers, found by module type) stays on the node; the uniform mean of
  the rest, as FedBN's code (:mod:`strategies.umpfssl.fedbn`, same federation as ``fixbn``).

Every row is evaluated as the other UM-pFSSL rows: each node's model (the global one for
fedavg-sl/fedprox-sl, the global entries plus the node's BN for fedbn-sl) on its own test
split; the run's accuracy is the mean over nodes.

Client contract (``train``): ``arrays`` in (fedbn-sl: the non-BN entries, plus ``local-init``
with a node's first message when the run has initial arrays), ``arrays`` out and ``metrics``
(``num-examples``, ``train-loss``); fedbn-sl keeps its BN in ``context.state["umpfssl.bn"]``.
The node needs the true labels of its unlabeled split: the library's data have them; a user's
unlabeled images without labels (y = -1) are a ``ConfigError`` (run fixavg / fixprox / fixbn).

[ours] Local training is :func:`tasks.training.train_supervised` on the weak view (as every
supervised loop here), ``local-epochs`` passes over D_k^s + D_k^u (or ``local-steps``), the run's
optimizer, no warm-up.
"""
from __future__ import annotations

from ..client import AlgorithmClient
from .fedbn import FixBNStrategy, FixBNTrainer
from .fixmatch_baselines import FixMatchFedStrategy, FixMatchTrainer, SupervisedReference, spec
from .fixprox import FixProxStrategy, FixProxTrainer
from ..registry import register


class FedAvgSLTrainer(SupervisedReference, FixMatchTrainer):
    """FedAvg's client: CE on fully labeled data."""


class FedProxSLTrainer(SupervisedReference, FixProxTrainer):
    """FedProx's client: CE on fully labeled data plus ``mu/2 ||w - w^t||^2``."""


class FedBNSLTrainer(SupervisedReference, FixBNTrainer):
    """FedBN's client: CE on fully labeled data, BatchNorm kept on the node."""


class FedAvgSLStrategy(FixMatchFedStrategy):
    """FedAvg (n_k-weighted) on fully labeled clients, evaluated per client."""

    trainer = FedAvgSLTrainer()
    reply_metrics = ("train-loss",)


class FedProxSLStrategy(FixProxStrategy):
    """FedAvg's server: FedProx-SL changes only the clients' objective."""

    trainer = FedProxSLTrainer()
    reply_metrics = ("train-loss",)


class FedBNSLStrategy(FixBNStrategy):
    """FedBN's server (uniform mean of the non-BN entries) on fully labeled clients."""

    trainer = FedBNSLTrainer()
    reply_metrics = ("train-loss",)


ALGORITHMS = register({
    "fedavg-sl": spec("fedavg-sl", FedAvgSLStrategy,
                      "FedAvg, CE on fully labeled clients (the unlabeled split's true labels): reference",
                      label_metrics=False),
    "fedprox-sl": spec("fedprox-sl", FedProxSLStrategy,
                       "FedProx, CE on fully labeled clients (the unlabeled split's true labels): reference",
                       label_metrics=False),
    "fedbn-sl": spec("fedbn-sl", FedBNSLStrategy,
                     "FedBN, CE on fully labeled clients (the unlabeled split's true labels): reference",
                     label_metrics=False),
})


class FedAvgSLClient(AlgorithmClient):
    """The client of the three references with a user's model and the node's labeled data,
    unlabeled data **with its labels** (``(x, y)``; images alone are refused) and test data."""

    module = __name__
    needs = ("labeled", "test")
