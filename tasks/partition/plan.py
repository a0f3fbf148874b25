"""The single entry point of the library: :func:`make_plan` with :class:`PartitionConfig`."""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from tasks.config import TaskConfig, check_field, fields_of

from ._common import (
    _STAGE_DIR2,
    _STAGE_MISMATCH,
    _STAGE_SERVER,
    _STAGE_TEST,
    CONFIG_KEYS,
    DEFAULTS,
    LABEL_MODES,
    _check_labels,
    _check_num_clients,
    _num_classes,
)
from .clients import (
    dirichlet_partition,
    iid_partition,
    main_class_partition,
    quantity_skew_partition,
)
from .labeled import (
    dir2_labeled_split,
    matched_test_split,
    mismatch_partition,
    server_labeled_split,
)
from .metrics import class_histograms, r_metric


@dataclass
class PartitionConfig:
    """Partitioning options; field -> run-config key in :data:`CONFIG_KEYS`."""

    scheme: str = DEFAULTS["scheme"]                   # "iid" | "dirichlet" | "quantity" | "ssfl-r"
    alpha: float = DEFAULTS["alpha"]                   # Dirichlet concentration
    classes_per_client: int = DEFAULTS["classes_per_client"]   # quantity skew k
    r: float = DEFAULTS["r"]                           # SSFL target R
    server_labels: int = DEFAULTS["server_labels"]     # N_s (label_mode "server")
    labeled_alpha: float = DEFAULTS["labeled_alpha"]   # Dir_2 concentration (label_mode "dir2")
    mismatch_ratio: float = DEFAULTS["mismatch_ratio"]  # label_mode "mismatch"
    labeled_per_client: int = DEFAULTS["labeled_per_client"]
    labeled_classes_per_client: int = DEFAULTS["labeled_classes_per_client"]
    min_size: int = DEFAULTS["min_size"]
    seed: int = DEFAULTS["seed"]

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], **overrides: Any) -> "PartitionConfig":
        """Build from a Flower run config (keys of :data:`CONFIG_KEYS`; missing keys keep defaults)."""
        kwargs = {f: run_config[key] for f, key in CONFIG_KEYS.items() if key in run_config}
        kwargs.update(overrides)
        return cls(**kwargs)

    def validate(self) -> "PartitionConfig":
        """Check types, ranges and choices against the run config's knobs (``TaskConfig``: one
        statement of each); a ``ConfigError`` (a ValueError) names the run-config key."""
        fields = {f.name: (f, typ) for f, typ in fields_of(TaskConfig)}
        for name, key in CONFIG_KEYS.items():
            f, typ = fields[key.replace("-", "_")]
            check_field(key, getattr(self, name), typ, dict(f.metadata))
        return self


@dataclass
class ClientSplit:
    """One client's data: indices into the train set, and optionally into the test set."""

    labeled: np.ndarray      # int64 indices into the train set
    unlabeled: np.ndarray
    test: np.ndarray | None  # indices into the test set (only when test labels given)

    @property
    def all(self) -> np.ndarray:
        """Labeled and unlabeled indices together (sorted)."""
        return np.sort(np.concatenate([self.labeled, self.unlabeled]))


@dataclass
class PartitionPlan:
    """Output of :func:`make_plan`."""

    server_labeled: np.ndarray      # empty unless label_mode == "server"
    clients: list[ClientSplit]
    report: dict = field(default_factory=dict)  # JSON-serialisable realised skew


def scheme_partition(labels: np.ndarray, num_clients: int, cfg: PartitionConfig) -> list[np.ndarray]:
    """Client partition of ``labels`` by ``cfg.scheme`` (the numpy function of the scheme)."""
    _check_num_clients(num_clients, len(labels), cfg.min_size)
    if cfg.scheme == "iid":
        return iid_partition(labels, num_clients, seed=cfg.seed)
    if cfg.scheme == "dirichlet":
        return dirichlet_partition(labels, num_clients, cfg.alpha, min_size=cfg.min_size, seed=cfg.seed)
    if cfg.scheme == "quantity":
        return quantity_skew_partition(labels, num_clients, cfg.classes_per_client, seed=cfg.seed)
    return main_class_partition(labels, num_clients, cfg.r, seed=cfg.seed)


def _scheme_desc(cfg: PartitionConfig) -> str:
    return {
        "iid": "iid",
        "dirichlet": f"dirichlet(alpha={cfg.alpha:g})",
        "quantity": f"quantity(k={cfg.classes_per_client})",
        "ssfl-r": f"ssfl-r(R={cfg.r:g})",
    }[cfg.scheme]


def make_plan(
    train_labels: np.ndarray,
    num_clients: int,
    cfg: PartitionConfig,
    label_mode: str = "all",
    test_labels: np.ndarray | None = None,
) -> PartitionPlan:
    """Partition the training set over ``num_clients`` clients, labeled and unlabeled.

    label_mode
        * ``"all"``: the ``cfg.scheme`` partition, every client sample labeled
          (SCALA, supervised baselines). Identical to the scheme function's output.
        * ``"none"``: the same partition, every client sample unlabeled.
        * ``"server"``: :func:`server_labeled_split` of ``cfg.server_labels`` first; the
          rest is partitioned by the scheme as unlabeled client data (SSFL, Semi-SFL).
        * ``"dir2"``: scheme partition, then :func:`dir2_labeled_split` with
          ``cfg.labeled_alpha`` (UM-pFSSL).
        * ``"mismatch"``: :func:`mismatch_partition` (Fed-SHVR). ``partition`` selects the
          unlabeled sizes: ``iid`` = equal sizes, ``dirichlet`` = ``Dir_K(partition-alpha)``
          weights with a floor; ``quantity`` / ``ssfl-r`` are rejected.

    test_labels
        When given, :func:`matched_test_split` gives each client a test split with its
        own label distribution (shares taken from the client's labeled + unlabeled
        histogram; for ``"dirichlet"`` these equal the drawn ``q_c`` up to rounding).

    Random streams: the scheme partition uses ``cfg.seed`` directly (so it equals the
    scheme function / Partitioner with that seed); the server split, Dir_2 split,
    mismatch construction and test split use ``default_rng([seed, stage])``.
    A non-zero ``server-labels`` outside label_mode ``"server"`` is ignored with a warning.
    """
    cfg.validate()
    if label_mode not in LABEL_MODES:
        raise ValueError(f"label_mode={label_mode!r} is not one of {', '.join(LABEL_MODES)}")
    labels = _check_labels(train_labels, "train_labels")
    test = None if test_labels is None else _check_labels(test_labels, "test_labels")
    c_num = _num_classes(labels, None, *(() if test is None else (test,)))
    k_num = _check_num_clients(num_clients, len(labels), cfg.min_size)
    if cfg.server_labels and label_mode != "server":
        warnings.warn(
            f"{CONFIG_KEYS['server_labels']}={cfg.server_labels} is ignored with label_mode={label_mode!r}",
            stacklevel=2,
        )
    seed = cfg.seed
    server = np.zeros(0, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    report: dict[str, Any] = {
        "scheme": cfg.scheme,
        "label_mode": label_mode,
        "num_clients": k_num,
        "num_classes": c_num,
        "num_train": int(len(labels)),
        "config": asdict(cfg),
    }
    extra: dict[str, Any] = {}

    if label_mode == "mismatch":
        if cfg.scheme not in ("iid", "dirichlet"):
            raise ValueError(
                f"{CONFIG_KEYS['scheme']}={cfg.scheme!r} is not supported with label_mode='mismatch'; "
                f"use iid (equal unlabeled sizes) or dirichlet (Dir_K(partition-alpha) sizes)"
            )
        ms = mismatch_partition(
            labels,
            k_num,
            mismatch_ratio=cfg.mismatch_ratio,
            labeled_per_client=cfg.labeled_per_client,
            labeled_classes_per_client=cfg.labeled_classes_per_client,
            size_alpha=cfg.alpha if cfg.scheme == "dirichlet" else None,
            min_size=cfg.min_size,
            num_classes=c_num,
            seed=int(np.random.default_rng([seed, _STAGE_MISMATCH]).integers(2**63)),
        )
        lab, unl = ms.labeled, ms.unlabeled
        extra["mismatch"] = {
            "target": float(cfg.mismatch_ratio),
            "per_client": [float(v) for v in ms.realised_mismatch],
            "mean": float(ms.realised_mismatch.mean()),
            "max_abs_error": float(np.abs(ms.realised_mismatch - cfg.mismatch_ratio).max()),
            "labeled_classes": ms.labeled_classes,
            "target_unlabeled_sizes": ms.target_sizes.tolist(),
        }
        extra["unassigned"] = ms.unassigned
    else:
        pool = np.arange(len(labels), dtype=np.int64)
        if label_mode == "server":
            key = CONFIG_KEYS["server_labels"]
            if cfg.server_labels <= 0:
                raise ValueError(f"{key}={cfg.server_labels} must be > 0 with label_mode='server'")
            server, pool = server_labeled_split(
                labels, cfg.server_labels, num_classes=c_num,
                seed=int(np.random.default_rng([seed, _STAGE_SERVER]).integers(2**63)),
            )
            if len(pool) < k_num * max(cfg.min_size, 1):
                raise ValueError(
                    f"{key}={cfg.server_labels} leaves {len(pool)} samples for {k_num} clients; lower {key}"
                )
        parts = [pool[p] for p in scheme_partition(labels[pool], k_num, cfg)]
        if label_mode == "all":
            lab, unl = parts, [empty] * k_num
        elif label_mode in ("none", "server"):
            lab, unl = [empty] * k_num, parts
        else:  # dir2
            lab, unl, p_s = dir2_labeled_split(
                parts, cfg.labeled_alpha,
                seed=int(np.random.default_rng([seed, _STAGE_DIR2]).integers(2**63)),
            )
            extra["drawn_labeled_ratio"] = [float(v) for v in p_s]
        if cfg.scheme == "ssfl-r":
            _, a = main_class_partition(labels[pool], k_num, cfg.r, seed=seed, return_targets=True)
            extra["target_r"] = float(cfg.r)
            extra["expected_r"] = r_metric(a)
        extra["unassigned"] = 0

    lab = [np.asarray(p, dtype=np.int64) for p in lab]
    unl = [np.asarray(p, dtype=np.int64) for p in unl]
    full = [np.sort(np.concatenate([a, b])) for a, b in zip(lab, unl)]
    sizes = np.array([len(f) for f in full])
    if sizes.min() == 0:
        raise ValueError(f"client {int(sizes.argmin())} received no samples; use fewer clients or a larger partition-alpha")

    hist_l = class_histograms(labels, lab, c_num)
    hist_u = class_histograms(labels, unl, c_num)
    hist = hist_l + hist_u
    tests: list[np.ndarray | None] = [None] * k_num
    if test is not None:
        col = hist.sum(axis=0, keepdims=True)
        shares = np.divide(hist, col, out=np.zeros(hist.shape), where=col > 0).T  # [C, K]
        tests = matched_test_split(
            test, shares, seed=int(np.random.default_rng([seed, _STAGE_TEST]).integers(2**63))
        )
        hist_t = class_histograms(test, tests, c_num)
        p_train = hist / hist.sum(axis=1, keepdims=True)
        tsum = hist_t.sum(axis=1, keepdims=True)
        p_test = np.divide(hist_t, tsum, out=np.zeros(hist_t.shape), where=tsum > 0)
        extra["test_sizes"] = hist_t.sum(axis=1).tolist()
        extra["test_class_counts"] = hist_t.tolist()
        extra["test_tv"] = (0.5 * np.abs(p_train - p_test).sum(axis=1)).tolist()

    report.update(
        {
            "realised_r": r_metric(hist),
            "sizes": sizes.tolist(),
            "labeled_sizes": hist_l.sum(axis=1).tolist(),
            "unlabeled_sizes": hist_u.sum(axis=1).tolist(),
            "labeled_ratio": (hist_l.sum(axis=1) / sizes).tolist(),
            "labeled_class_counts": hist_l.tolist(),
            "unlabeled_class_counts": hist_u.tolist(),
            "classes_per_client": (hist > 0).sum(axis=1).tolist(),
            "server_labeled": {
                "size": int(len(server)),
                "class_counts": np.bincount(labels[server], minlength=c_num).tolist(),
            },
        }
    )
    report.update(extra)
    clients = [ClientSplit(labeled=a, unlabeled=b, test=t) for a, b, t in zip(lab, unl, tests)]
    return PartitionPlan(server_labeled=server, clients=clients, report=report)


def plan_summary(plan: PartitionPlan) -> str:
    """One log line: scheme, label mode, sizes, labeled share, realised R (and mismatch)."""
    rep = plan.report
    cfg = PartitionConfig(**rep["config"]) if "config" in rep else None
    sizes = np.asarray(rep["sizes"])
    lab = int(np.sum(rep["labeled_sizes"]))
    unl = int(np.sum(rep["unlabeled_sizes"]))
    parts = [
        f"partition={_scheme_desc(cfg) if cfg else rep.get('scheme')}",
        f"label_mode={rep['label_mode']}",
        f"K={rep['num_clients']} C={rep['num_classes']}",
        f"size min/med/max={sizes.min()}/{int(np.median(sizes))}/{sizes.max()}",
        f"labeled={lab} unlabeled={unl}",
    ]
    if rep["server_labeled"]["size"]:
        parts.append(f"server_labels={rep['server_labeled']['size']}")
    parts.append(f"R={rep['realised_r']:.3f}")
    if "target_r" in rep:
        parts.append(f"(target {rep['target_r']:.3f}, expected {rep['expected_r']:.3f})")
    if "mismatch" in rep:
        parts.append(f"mismatch={rep['mismatch']['mean']:.3f} (target {rep['mismatch']['target']:.3f})")
    if rep.get("unassigned"):
        parts.append(f"unassigned={rep['unassigned']}")
    if "test_sizes" in rep:
        parts.append(f"test={int(np.sum(rep['test_sizes']))} (mean TV {np.mean(rep['test_tv']):.3f})")
    return " ".join(parts)
