"""Typed, validated configuration from Flower's flat run-config dicts.

A config is a dataclass whose fields carry their constraints in ``knob(...)``.
``parse_dataclass(cls, flat, prefix)`` reads the kebab-case keys (``batch-size``
for the field ``batch_size``; ``ssfl.num-groups`` for ``num_groups`` under the
prefix ``ssfl``), checks types, ranges and choices, and raises :class:`ConfigError`
naming the key and what is allowed. Nothing here knows Flower, so the algorithm
modules use the same machinery for their own namespaced keys.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from tasks.models import MODELS, NORMS


class ConfigError(ValueError):
    """A run-config key or value is invalid. The message names the key."""


def knob(default: Any, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, hi_open: bool = False, choices: tuple | None = None,
         help: str = "") -> Any:  # noqa: A002 - 'help' reads naturally here
    """A dataclass field with validation metadata."""
    return field(default=default, metadata={
        "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "choices": choices, "help": help})


def knob_of(cls, name: str) -> Any:
    """The knob of field ``name`` of dataclass ``cls``, for another dataclass that takes the same
    setting (one statement of its default, range and help)."""
    f = cls.__dataclass_fields__[name]
    return field(default=f.default, metadata=f.metadata)


def key_of(name: str, prefix: str = "") -> str:
    k = name.replace("_", "-")
    return f"{prefix}.{k}" if prefix else k


def range_text(m: dict) -> str:
    lo = "(" if m["lo_open"] else "["
    hi = ")" if m["hi_open"] else "]"
    a = "-inf" if m["lo"] is None else m["lo"]
    b = "inf" if m["hi"] is None else m["hi"]
    return f"{lo}{a}, {b}{hi}"


def _coerce(key: str, value: Any, typ: type) -> Any:
    tname = getattr(typ, "__name__", str(typ))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}={value!r} must be a boolean (true or false)")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be an integer")
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{key}={value!r} must be an integer")
            value = int(value)
        return int(value)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string (quote it: {key}='...')")
        return value
    raise TypeError(f"unsupported config field type {tname} for {key}")  # programming error


def check_field(key: str, value: Any, typ: type, meta: dict) -> Any:
    value = _coerce(key, value, typ)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, choices))}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if typ in (int, float):
        bad = (lo is not None and (value < lo or (meta.get("lo_open") and value == lo))) or (
            hi is not None and (value > hi or (meta.get("hi_open") and value == hi)))
        if bad:
            raise ConfigError(f"{key}={value!r} is out of range; allowed {range_text(meta)}")
    return value


def fields_of(cls) -> list[tuple[dataclasses.Field, type]]:
    """``(field, type)`` of every field of dataclass ``cls`` (resolved once per class: the
    server builds a task record per message, thousands per round)."""
    return list(_fields_of(cls))


@functools.lru_cache(maxsize=None)
def _fields_of(cls) -> tuple[tuple[dataclasses.Field, type], ...]:
    hints = get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def parse_dataclass(cls, flat: dict[str, Any], prefix: str = "", *, strict: bool = True):
    """Build ``cls`` from the keys of ``flat`` under ``prefix`` (missing keys keep defaults).

    With ``strict``, a key under ``prefix`` that ``cls`` does not define is an error.
    """
    known = {}
    for f, typ in fields_of(cls):
        k = key_of(f.name, prefix)
        if k in flat:
            known[f.name] = check_field(k, flat[k], typ, dict(f.metadata))
    if strict:
        allowed = sorted(key_of(f.name, prefix) for f, _ in fields_of(cls))
        for k in flat:
            in_ns = (k.startswith(prefix + ".") and k.count(".") == prefix.count(".") + 1) if prefix else "." not in k
            if in_ns and k not in allowed:
                close = [a for a in allowed if a.split(".")[-1][:4] == k.split(".")[-1][:4]]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(f"unknown run-config key '{k}'{hint}; allowed keys: {', '.join(allowed)}")
    obj = cls(**known)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def replace_checked(obj, **changes: Any):
    """``dataclasses.replace(obj, **changes)`` with every value checked as the run config
    checks it (type, range, choices, ``validate()``); errors name the keyword as given. An
    unknown name is a ``TypeError`` naming the allowed ones (keyword arguments of a constructor)."""
    fields = {f.name: (f, typ) for f, typ in fields_of(type(obj))}
    unknown = sorted(set(changes) - set(fields))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}; allowed: {', '.join(sorted(fields))}")
    checked = {name: check_field(name, v, fields[name][1], dict(fields[name][0].metadata))
               if fields[name][1] in (bool, int, float, str) else v
               for name, v in changes.items()}
    new = dataclasses.replace(obj, **checked)
    validate = getattr(new, "validate", None)
    if callable(validate):
        validate()
    return new


def to_flat(obj, prefix: str = "") -> dict[str, Any]:
    """Dataclass -> flat kebab-case dict (the inverse of :func:`parse_dataclass`)."""
    return {key_of(f.name, prefix): getattr(obj, f.name) for f, _ in fields_of(type(obj))}



@dataclass(frozen=True)
class TaskConfig:
    """What a run trains on and how: data, partitioning, model and local optimisation.

    The server sends these to every client (as a flat ConfigRecord), so a ClientApp
    needs nothing but the message to rebuild its data partition and model.
    """

    seed: int = knob(0, lo=0, help="seeds partitioning, sampling, augmentation, init")
    dataset: str = knob("mnist5k", help="'mnist5k' (embedded), 'fashion-mnist' (Debian package dataset-fashion-mnist), "
                                         "a Hugging Face id, or a local path (save_to_disk, parquet, idx files)")
    dataset_split: str = knob("", help="use only this split of the source ('' = train/test as shipped)")
    train_size: int = knob(0, lo=0, help="use a stratified, seeded subset of this many training samples (0 = all; "
                                         "the test split stays whole)")
    image_key: str = knob("", help="image column ('' = auto)")
    label_key: str = knob("", help="label column ('' = auto)")
    test_fraction: float = knob(0.2, lo=0.0, hi=1.0, lo_open=True, hi_open=True,
                                help="held-out test share when the source has no test split")
    partition: str = knob("iid", choices=("iid", "dirichlet", "quantity", "ssfl-r"),
                           help="how client data is spread over the nodes")
    partition_alpha: float = knob(0.5, lo=0.0, lo_open=True, help="Dirichlet concentration")
    partition_classes_per_client: int = knob(2, lo=1, help="quantity skew: classes per client")
    partition_r: float = knob(0.4, lo=0.0, hi=1.0, help="SSFL target non-IID level R")
    partition_labeled_alpha: float = knob(0.5, lo=0.0, lo_open=True, help="Dir_2 labeled ratio (UM-pFSSL)")
    partition_mismatch_ratio: float = knob(0.0, lo=0.0, hi=1.0, help="Fed-SHVR class mismatch r")
    partition_labeled_per_client: int = knob(60, lo=1, help="Fed-SHVR labeled samples per client")
    partition_labeled_classes: int = knob(2, lo=1, help="Fed-SHVR labeled classes per client")
    partition_min_size: int = knob(1, lo=0, help="minimum samples per client")
    server_labels: int = knob(500, lo=0, help="N_s class-balanced labeled samples kept on the server (algorithms "
                                              "with labels on the server: semisfl, ssfl, supervised-only; the others "
                                              "ignore the default and warn about another value)")
    model: str = knob("cnn", choices=tuple(MODELS),   # (the one list: tasks.models.MODELS)
                       help="model family (tasks/models.py); input shape and classes come from the data")
    cut: str = knob("", help="split-learning cut point ('' = the model's default)")
    norm: str = knob("bn", choices=NORMS, help="BatchNorm, GroupNorm(32) or none")
    dropout: float = knob(0.0, lo=0.0, hi=1.0, hi_open=True, help="dropout rate where the model family places it")
    cutout: int = knob(-1, lo=-1, help="side in pixels of the strong view's Cutout square (-1 = half the image, "
                                       "the authors' FixMatch code: 14 px on 28x28; 0 = no Cutout)")
    batch_size: int = knob(32, lo=1, help="local mini-batch size")
    local_epochs: int = knob(1, lo=0, help="local passes over the node's data per round")
    local_steps: int = knob(0, lo=0, help="> 0 overrides local-epochs with a fixed number of steps")
    lr: float = knob(0.05, lo=0.0, lo_open=True, help="SGD learning rate")
    momentum: float = knob(0.9, lo=0.0, hi=1.0, hi_open=True, help="SGD momentum")
    weight_decay: float = knob(0.0, lo=0.0, help="SGD weight decay")
    device: str = knob("auto", help="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    deterministic: bool = knob(True, help="on CUDA: PyTorch's deterministic algorithms (cuDNN's deterministic "
                                          "kernels, no autotuning), so one seed gives the same weights run after "
                                          "run and a resumed run equals an uninterrupted one; false lets cuDNN "
                                          "pick the fastest kernels (faster, not bitwise reproducible)")

    def validate(self) -> None:
        if self.local_epochs == 0 and self.local_steps == 0:
            raise ConfigError("local-epochs and local-steps are both 0: set one of them > 0")
        if not (self.device in ("auto", "cpu", "mps") or self.device.startswith("cuda")):
            raise ConfigError(f"device={self.device!r} is not one of: auto, cpu, cuda, cuda:<index>, mps")
