"""One side of a run: its data, model factory, augmenter and device (plain torch, no Flower).

Every algorithm reads its data and builds its model through an :class:`Env`, so the
algorithms do not know where either comes from. Two builders make one:

* :func:`library_env`: the library's own app. The dataset is named by
  ``TaskConfig.dataset`` and partitioned by its ``partition*`` keys
  (:mod:`tasks.partition`); the model is built by name (:mod:`tasks.models`).
* :func:`user_env`: a user's own model and own data. This is the public API
  (:mod:`strategies.api`): the server's labeled and test sets, or a node's
  labeled/unlabeled/test sets.

A node's ``Env`` holds that node's data only. The server's holds its labeled set (as
``labeled``) and the test set.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from tasks.augment import Augmenter
from tasks.config import ConfigError, TaskConfig
from tasks.data import ArrayDataset, DatasetBundle, as_dataset, load_dataset, stratified_subset
from tasks.models import as_staged, build_model
from tasks.partition import PartitionConfig, PartitionPlan, make_plan
from tasks.training import derive_seed, resolve_device, seeded


@dataclass
class NodeData:
    """The data one side of a run holds. Any set may be missing (``None``)."""

    labeled: ArrayDataset | None = None
    unlabeled: ArrayDataset | None = None
    test: ArrayDataset | None = None

    @classmethod
    def of(cls, labeled: Any = None, unlabeled: Any = None, test: Any = None) -> "NodeData":
        """Convert a user's sets (see :func:`tasks.data.as_dataset`). ``unlabeled`` may be
        images only; its labels, if given, are used for no loss, only for the metrics that
        report pseudo-label accuracy."""
        return cls(None if labeled is None else as_dataset(labeled, "labeled", need_labels=True),
                   None if unlabeled is None else as_dataset(unlabeled, "unlabeled"),
                   None if test is None else as_dataset(test, "test", need_labels=True))

    def first(self) -> ArrayDataset | None:
        return next((d for d in (self.labeled, self.unlabeled, self.test) if d is not None), None)


@dataclass
class Env:
    """Data, model factory, augmenter and device of the server or of one node."""

    task: TaskConfig
    device: torch.device
    augmenter: Augmenter | None     # None: a server without data (it then never augments)
    num_classes: int
    model_fn: Callable[[], nn.Module]
    data: NodeData = field(default_factory=NodeData)
    partition_id: int = -1          # -1 on the server
    num_partitions: int = 0
    plan: PartitionPlan | None = None   # the library's partition plan (library_env only)
    bundle: DatasetBundle | None = None  # the library's whole dataset (library_env only)
    seeded_init: bool = True        # build_model seeds torch first (library models: same init everywhere)
    library_model: bool = False     # model_fn builds one of the library's models (tasks.models)

    def build_model(self) -> nn.Module:
        if self.seeded_init:
            with seeded(derive_seed(self.task.seed, "init")):  # same init on every node
                return self.model_fn().to(self.device)
        return self.model_fn().to(self.device)

    def model_from(self, state: dict[str, np.ndarray]) -> nn.Module:
        """:meth:`build_model` with ``state`` loaded (strict: every key). A library model that
        ``state`` covers entirely (no buffer outside its state dict) is built on PyTorch's meta
        device and allocated on this env's device without initialising it, since ``state``
        overwrites every value: the same module and values, without the seeded random
        initialisation (about a fifth of a small ClientApp's time per message)."""
        from tasks.training import load_numpy_state

        if self.library_model:
            with torch.device("meta"):
                model = self.model_fn()
            own = set(model.state_dict())
            every = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
            if set(state) == own and every <= own:
                model = model.to_empty(device=self.device)
                load_numpy_state(model, state)
                return model
        model = self.build_model()
        load_numpy_state(model, state)
        return model

    @property
    def input_shape(self) -> tuple[int, int, int]:
        if self.augmenter is None:
            raise ConfigError("the image shape is unknown: pass some data (test_data=...) or an augmenter")
        return (self.augmenter.in_channels, self.augmenter.image_size, self.augmenter.image_size)

    def _empty(self) -> ArrayDataset:
        return ArrayDataset(np.zeros((0, *self.input_shape), np.uint8), np.zeros(0, np.int64))

    # a node's data (on the server: ``labeled`` is its labeled set)
    def labeled(self) -> ArrayDataset:
        return self.data.labeled if self.data.labeled is not None else self._empty()

    def unlabeled(self) -> ArrayDataset:
        return self.data.unlabeled if self.data.unlabeled is not None else self._empty()

    def client_test(self) -> ArrayDataset | None:
        return self.data.test

    # the server's data
    def server_labeled(self) -> ArrayDataset:
        return self.labeled()

    @property
    def test(self) -> ArrayDataset | None:
        return self.data.test

    def client_unlabeled_sizes(self) -> list[int] | None:
        """Sizes of every node's unlabeled set, where the server knows them (library_env)."""
        return None if self.plan is None else [len(c.unlabeled) for c in self.plan.clients]


# --------------------------------------------------------------------------- the library's data
def partition_config(task: TaskConfig, label_mode: str = "server") -> PartitionConfig:
    """The partitioner's config. ``server-labels`` only matters with ``label_mode='server'``;
    elsewhere its default is dropped silently and another value is passed on (and warned about)."""
    default = TaskConfig.__dataclass_fields__["server_labels"].default
    server_labels = task.server_labels
    if label_mode != "server" and server_labels == default:
        server_labels = 0
    return PartitionConfig(
        scheme=task.partition, alpha=task.partition_alpha,
        classes_per_client=task.partition_classes_per_client, r=task.partition_r,
        server_labels=server_labels, labeled_alpha=task.partition_labeled_alpha,
        mismatch_ratio=task.partition_mismatch_ratio,
        labeled_per_client=task.partition_labeled_per_client,
        labeled_classes_per_client=task.partition_labeled_classes,
        min_size=task.partition_min_size, seed=task.seed)


def load_bundle(task: TaskConfig) -> DatasetBundle:
    """The run's dataset; with ``train-size`` > 0 a stratified, seeded subset of its training split
    (the test split stays whole)."""
    bundle = load_dataset(task.dataset, seed=task.seed, test_fraction=task.test_fraction,
                          split=task.dataset_split, image_key=task.image_key, label_key=task.label_key)
    if task.train_size <= 0 or task.train_size == len(bundle.train):
        return bundle
    if task.train_size > len(bundle.train):
        raise ConfigError(f"train-size={task.train_size} is more than the {len(bundle.train)} training samples of "
                          f"dataset={task.dataset!r}: use 1 .. {len(bundle.train)}, or 0 for all of them")
    keep = stratified_subset(bundle.train.y, task.train_size, task.seed)
    return DatasetBundle(bundle.name, bundle.train.subset(keep), bundle.test, bundle.num_classes)


@functools.lru_cache(maxsize=8)
def plan_cached(task: TaskConfig, num_partitions: int, label_mode: str, with_test: bool) -> PartitionPlan:
    bundle = load_bundle(task)
    return make_plan(bundle.train.y, num_partitions, partition_config(task, label_mode), label_mode=label_mode,
                     test_labels=bundle.test.y if with_test else None)


def make_augmenter(bundle: DatasetBundle, task: TaskConfig | None = None) -> Augmenter:
    """The data's weak/strong augmenter (flips except on digits; ``task.cutout``)."""
    return task_augmenter(bundle.in_channels, bundle.image_size, flip=not bundle.is_digits, task=task)


def task_augmenter(channels: int, size: int, *, flip: bool, task: TaskConfig | None = None) -> Augmenter:
    """``Augmenter(C, H, flip=flip)`` with the run's Cutout side (``cutout``; -1 = the
    Augmenter's default, half the image)."""
    cut = None if task is None or task.cutout < 0 else int(task.cutout)
    if cut is not None and cut > size:
        raise ConfigError(f"cutout={cut} is larger than the {size}x{size} images: use 0 .. {size} pixels "
                          "(0 = no Cutout, -1 = half the image)")
    return Augmenter(channels, size, flip=flip, cutout_size=cut)


def library_env(task: TaskConfig, num_partitions: int, label_mode: str, with_test: bool = False,
                partition_id: int = -1, local_dataset: str = "") -> Env:
    """The library app's Env: the server's (``partition_id=-1``) or node ``partition_id``'s.

    ``local_dataset``: a node's own copy of the run's dataset (node config ``data-path``),
    partitioned as the server partitions the original."""
    source = task if not local_dataset else dataclasses.replace(task, dataset=local_dataset)
    bundle = load_bundle(source)
    if source is not task:  # keep the run's dataset name (it selects e.g. flip augmentation)
        bundle = DatasetBundle(task.dataset, bundle.train, bundle.test, bundle.num_classes)
    plan = plan_cached(source, max(num_partitions, 1), label_mode, with_test)
    if partition_id < 0:
        data = NodeData(labeled=bundle.train.subset(plan.server_labeled), test=bundle.test)
    else:
        part = plan.clients[partition_id]
        data = NodeData(labeled=bundle.train.subset(part.labeled), unlabeled=bundle.train.subset(part.unlabeled),
                        test=None if part.test is None else bundle.test.subset(part.test))

    def model_fn() -> nn.Module:
        return build_model(task.model, in_channels=bundle.in_channels, num_classes=bundle.num_classes,
                           image_size=bundle.image_size, norm=task.norm, dropout=task.dropout)

    return Env(task, resolve_device(task.device, task.deterministic), make_augmenter(bundle, task), bundle.num_classes, model_fn, data,
               partition_id, num_partitions, plan, bundle, library_model=True)


# --------------------------------------------------------------------------- a user's data
def _staged(model: Any, cut: str | None) -> nn.Module:
    try:
        return as_staged(model, cut)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def check_user_model(model: Any, *, staged: bool, cut: str | None = None, cut_known: bool = True) -> None:
    """Refuse a ``model`` argument the algorithm cannot train, naming what is allowed
    (:class:`tasks.config.ConfigError`): a ``torch.nn.Module`` or a function returning one; for
    a split algorithm (``staged``) a :class:`tasks.models.StagedModel`, a ``(bottom, top)`` pair or
    an ``nn.Sequential`` cut after the child ``cut`` (``cut_known=False``: the cut is the server's,
    not known yet). A function is checked when it is called (:func:`user_env`)."""
    if staged and isinstance(model, (tuple, list)):
        _staged(model, cut)
    elif isinstance(model, nn.Module):
        if staged and (cut_known or not isinstance(model, nn.Sequential)):
            _staged(model, cut)
    elif not callable(model):
        raise ConfigError(f"model must be a torch.nn.Module or a function returning one, got {type(model).__name__}")


def model_outputs(model: Any) -> int | None:
    """The number of outputs of a user's model (a module or a ``(bottom, top)`` pair): its last
    ``nn.Linear``'s ``out_features`` (the classifier, :func:`tasks.models.classifier_prefix`);
    ``None`` for a function or a model without one."""
    parts = model if isinstance(model, (tuple, list)) else (model,)
    linears = [m for p in parts if isinstance(p, nn.Module) for m in p.modules() if isinstance(m, nn.Linear)]
    return int(linears[-1].out_features) if linears else None


def user_num_classes(model: Any, data: NodeData, num_classes: int | None = None) -> int:
    """The number of classes of a user's model and data: ``num_classes``, else the model's
    outputs (:func:`model_outputs`), else the largest label + 1. A label outside the model's
    classes (``0 .. M-1``, M the fewer of ``num_classes`` and the model's outputs) is refused
    with what was found (:class:`tasks.config.ConfigError`), not left to fail in training."""
    ys = {name: d.y for name, d in (("labeled", data.labeled), ("test", data.test)) if d is not None and len(d)}
    outputs = model_outputs(model)
    if num_classes is None:
        if outputs is None and not ys:
            raise ConfigError("num_classes is needed when no labeled or test data is given (num_classes=...)")
        num_classes = outputs if outputs is not None else max(int(y.max()) for y in ys.values()) + 1
    classes = num_classes if outputs is None else min(num_classes, outputs)
    said = (f"the model has {outputs} outputs" if outputs is not None else "") + \
        (f"{' and ' if outputs is not None else ''}num_classes={num_classes}" if outputs != num_classes else "")
    for name, y in ys.items():
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= classes:
            raise ConfigError(f"{name} set's labels: found {lo} .. {hi} ({len(np.unique(y))} distinct values); {said}, so "
                              f"labels must be 0 .. {classes - 1} (map them to 0 .. C-1, C the number of classes)")
    return int(num_classes)


def user_augmenter(data: NodeData, augmenter: Augmenter | None = None, flip: bool = False,
                   task: TaskConfig | None = None) -> Augmenter | None:
    """``augmenter``, else ``Augmenter(C, H, flip=flip)`` for the data's ``[C, H, H]`` images
    (``None`` without data); images that are not square are refused."""
    sample = data.first()
    if augmenter is None and sample is not None:
        c, h, w = sample.x.shape[1:]
        if h != w:
            raise ConfigError(f"images must be square [C, H, H]; got [C, H, W] = {[c, h, w]}")
        try:
            augmenter = task_augmenter(int(c), int(h), flip=flip, task=task)
        except ValueError as e:
            raise ConfigError(f"images of shape {[c, h, w]}: {e}") from None
    return augmenter


def user_env(task: TaskConfig, model: nn.Module | Callable[[], nn.Module], data: NodeData, *,
             num_classes: int | None = None, augmenter: Augmenter | None = None, flip: bool = False,
             partition_id: int = -1, num_partitions: int = 0, staged: bool = False) -> Env:
    """An Env over a user's own model and data.

    ``model``: a module (every :meth:`Env.build_model` returns a deep copy of it, with its
    weights) or a zero-argument factory (:func:`check_user_model`). ``num_classes``: default is
    the model's outputs, else the largest label seen + 1 (:func:`user_num_classes`).
    ``augmenter``: default ``Augmenter(C, H, flip=flip)`` for the data's ``[C, H, H]`` images
    (FixMatch's weak and strong views, :func:`user_augmenter`). ``staged``: a split algorithm's
    Env, whose models are :class:`tasks.models.StagedModel` (:func:`tasks.models.as_staged`
    with ``task.cut``: a ``(bottom, top)`` pair, or an ``nn.Sequential`` cut after a child).
    """
    cut = task.cut or None
    check_user_model(model, staged=staged, cut=cut)
    num_classes = user_num_classes(model, data, num_classes)
    if staged and isinstance(model, (tuple, list)):
        model = _staged(model, cut)
    if isinstance(model, nn.Module):
        proto = model
        model_fn: Callable[[], nn.Module] = lambda: copy.deepcopy(proto)  # noqa: E731
    else:
        model_fn = model
    if staged:
        base_fn = model_fn
        model_fn = lambda: _staged(base_fn(), cut)  # noqa: E731
    augmenter = user_augmenter(data, augmenter, flip, task)
    return Env(task, resolve_device(task.device, task.deterministic), augmenter, int(num_classes), model_fn, data,
               partition_id, num_partitions, seeded_init=False)
