"""Partitioning of a labelled training set over federated clients.

Everything here works on the integer label array of the training set
(``labels: np.ndarray[int64]``, classes ``0..C-1``) and returns **index arrays**
into it, so the same code serves numpy arrays, torch datasets and Hugging Face
datasets. Every function is deterministic given ``seed`` (``np.random.default_rng``).

Layers
------
1. *Client partitions* (who holds which samples):

   * :func:`iid_partition` -- shuffle and cut into K near-equal parts.
   * :func:`dirichlet_partition` -- per-class Dirichlet over clients,
     ``q_c ~ Dir_K(alpha)`` (Yurochkin et al.; as Semi-SFL Sec. V-D, UM-pFSSL Sec. 6.1 and
     SCALA Sec. 5.1 "beta" use it).
   * :func:`quantity_skew_partition` -- at most k classes per client
     (SCALA Sec. 5.1 "alpha").
   * :func:`main_class_partition` -- the SSFL main-class construction for a target
     non-IID level R (SSFL Sec. 3.2 and Appendix A.2), with the metric :func:`r_metric`.

   Each has a :class:`flwr_datasets.partitioner.Partitioner` wrapper
   (:class:`IidSplitPartitioner`, :class:`ClassDirichletPartitioner`,
   :class:`QuantitySkewPartitioner`, :class:`MainClassPartitioner`, in
   :mod:`tasks.partition.partitioners`) that calls the function on the dataset's label
   column. They are imported on first attribute access, so importing this package for
   :func:`make_plan` does not import flwr-datasets.

2. *Labeled / unlabeled constructions*, composed with the above:

   * :func:`server_labeled_split` -- N_s class-balanced labels kept on the server
     (SSFL Sec. 3.1 and Appendix A.2; Semi-SFL Sec. V-A).
   * :func:`dir2_labeled_split` -- per-client labeled ratio ``(p_s, p_u) ~ Dir_2(beta)``
     (UM-pFSSL Sec. 6.1).
   * :func:`mismatch_partition` -- Fed-SHVR class-distribution mismatch (its Sec. V;
     the library's choices in ``docs/fedshvr.md``).
   * :func:`matched_test_split` -- a per-client test split with the client's own label
     distribution (UM-pFSSL Sec. 6.1).

3. The single entry point :func:`make_plan` (+ :class:`PartitionConfig`,
   :class:`PartitionPlan`, :func:`plan_summary`) used by the whole library. Every
   Flower client process recomputes the plan from the seed, so it is pure numpy and
   fast (a few ms for 60k labels and 100 clients).

Modules: ``clients`` (layer 1), ``labeled`` (layer 2), ``plan`` (layer 3), ``metrics``
(R and the skew report), ``partitioners`` (flwr-datasets), ``_common`` (constants, the
parameters' defaults, argument checks).

Conventions: returned index arrays are ``int64`` and sorted ascending; client index
lists of one partition are pairwise disjoint. Errors are :class:`ValueError` whose
message names the run-config key (see :data:`CONFIG_KEYS`) and the allowed values.
"""
from __future__ import annotations

from typing import Any

from ._common import CONFIG_KEYS, DEFAULTS, LABEL_MODES, SCHEMES
from .clients import (
    dirichlet_partition,
    iid_partition,
    main_class_partition,
    main_class_targets,
    quantity_skew_partition,
)
from .labeled import (
    MismatchSplit,
    dir2_labeled_split,
    matched_test_split,
    mismatch_partition,
    server_labeled_split,
)
from .metrics import class_histograms, r_metric, skew_report
from .plan import (
    ClientSplit,
    PartitionConfig,
    PartitionPlan,
    make_plan,
    plan_summary,
    scheme_partition,
)

__all__ = [
    "CONFIG_KEYS",
    "ClassDirichletPartitioner",
    "ClientSplit",
    "DEFAULTS",
    "IidSplitPartitioner",
    "LABEL_MODES",
    "MainClassPartitioner",
    "MismatchSplit",
    "PartitionConfig",
    "PartitionPlan",
    "QuantitySkewPartitioner",
    "SCHEMES",
    "class_histograms",
    "dir2_labeled_split",
    "dirichlet_partition",
    "iid_partition",
    "main_class_partition",
    "main_class_targets",
    "make_plan",
    "matched_test_split",
    "mismatch_partition",
    "plan_summary",
    "quantity_skew_partition",
    "r_metric",
    "scheme_partition",
    "server_labeled_split",
    "skew_report",
]

_PARTITIONERS = ("IidSplitPartitioner", "ClassDirichletPartitioner", "QuantitySkewPartitioner", "MainClassPartitioner")


def __getattr__(name: str) -> Any:
    if name in _PARTITIONERS:
        from . import partitioners

        return getattr(partitioners, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
