"""flwr-datasets ``Partitioner`` classes over this package's numpy partitioners.

Each calls the matching function on the dataset's label column (``partition_by``), once,
and ``load_partition`` selects those rows. Importing this module imports flwr-datasets
(``datasets`` and plotting code, a slow import), so :mod:`tasks.partition` imports it only when one
of these classes is asked for.
"""
from __future__ import annotations

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import Partitioner

from ._common import DEFAULTS, _check_int, _check_labels
from .clients import (
    dirichlet_partition,
    iid_partition,
    main_class_partition,
    quantity_skew_partition,
)
from .metrics import skew_report


class _IndexPartitioner(Partitioner):
    """Base for partitioners that compute index lists from the label column once.

    ``partition_indices`` is computed lazily on first use from
    ``self.dataset[partition_by]`` by the matching numpy function; ``load_partition``
    returns ``self.dataset.select(indices)``.
    """

    def __init__(self, num_partitions: int, partition_by: str = "label", seed: int = 0) -> None:
        super().__init__()
        self._num_partitions = _check_int(num_partitions, "num_partitions", 1)
        self._partition_by = partition_by
        self._seed = seed
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def _labels(self) -> np.ndarray:
        ds = self.dataset
        if self._partition_by not in ds.column_names:
            raise ValueError(f"partition_by={self._partition_by!r} is not a column; columns are {ds.column_names}")
        col = ds.with_format("numpy", columns=[self._partition_by])[:][self._partition_by]
        return _check_labels(np.asarray(col), f"column {self._partition_by!r}")

    def _num_classes(self) -> int | None:
        feat = self.dataset.features.get(self._partition_by)
        return getattr(feat, "num_classes", None)

    def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
        raise NotImplementedError

    @property
    def partition_indices(self) -> list[np.ndarray]:
        """Sorted int64 row indices of every partition."""
        if self._indices is None:
            self._indices = self._compute(self._labels())
        return self._indices

    def load_partition(self, partition_id: int) -> Dataset:
        if not 0 <= partition_id < self._num_partitions:
            raise ValueError(f"partition_id={partition_id} is not in [0, {self._num_partitions - 1}]")
        return self.dataset.select(self.partition_indices[partition_id])

    def report(self) -> dict:
        """Realised skew (sizes, class histograms, R, classes per partition)."""
        return skew_report(self._labels(), self.partition_indices, self._num_classes())


class IidSplitPartitioner(_IndexPartitioner):
    """IID: a seeded shuffle cut into near-equal parts (:func:`iid_partition`)."""

    def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
        return iid_partition(labels, self._num_partitions, seed=self._seed)


class ClassDirichletPartitioner(_IndexPartitioner):
    """Per-class Dirichlet ``q_c ~ Dir_K(alpha)``, count-conserving (:func:`dirichlet_partition`)."""

    def __init__(
        self, num_partitions: int, partition_by: str = "label", alpha: float = DEFAULTS["alpha"],
        min_size: int = 1, max_retries: int = 100, seed: int = 0,
    ) -> None:
        super().__init__(num_partitions, partition_by, seed)
        self._alpha = alpha  # checked by dirichlet_partition
        self._min_size = min_size
        self._max_retries = max_retries

    def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
        return dirichlet_partition(
            labels, self._num_partitions, self._alpha, min_size=self._min_size,
            max_retries=self._max_retries, seed=self._seed,
        )


class QuantitySkewPartitioner(_IndexPartitioner):
    """At most k classes per partition, shard-based (:func:`quantity_skew_partition`)."""

    def __init__(self, num_partitions: int, partition_by: str = "label", classes_per_partition: int = DEFAULTS["classes_per_client"],
                 seed: int = 0) -> None:
        super().__init__(num_partitions, partition_by, seed)
        self._k = classes_per_partition  # checked by quantity_skew_partition

    def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
        return quantity_skew_partition(labels, self._num_partitions, self._k, seed=self._seed)


class MainClassPartitioner(_IndexPartitioner):
    """SSFL main-class construction for a target non-IID level R (:func:`main_class_partition`)."""

    def __init__(self, num_partitions: int, partition_by: str = "label", r: float = DEFAULTS["r"], seed: int = 0) -> None:
        super().__init__(num_partitions, partition_by, seed)
        self._r = r  # checked by main_class_partition

    def _compute(self, labels: np.ndarray) -> list[np.ndarray]:
        return main_class_partition(labels, self._num_partitions, self._r, seed=self._seed)
