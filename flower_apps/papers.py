"""One command per paper: rerun its comparison on the embedded data, several seeds, one table.

    python -m flower_apps.papers semisfl                  # all rows, seeds 0 1 2
    python -m flower_apps.papers fedshvr --seeds 0 1 2 3 4
    python -m flower_apps.papers scala --rows scala splitfed-v2 --engine simulation
    python -m flower_apps.papers scala --list             # its tables, each method's rows, settings
    python -m flower_apps.papers semisfl --set system=semisfl --target 0.95   # time and bytes to 95%
    python -m flower_apps.papers semisfl --page           # regenerate docs/paper-results/semisfl.md

Each paper's comparison (:data:`PAPERS`) is a set of rows (an ``algo`` and its keys) on a
shared base config at the paper's own hyperparameters (optimizer, learning rate, schedule,
batch sizes; the model family scaled down to the 28x28 embedded MNIST-5k). Every row runs
once per seed into ``<out>/<row>-s<seed>/`` (the usual run folder: ``config.json``,
``metrics.jsonl``, checkpoints); then :mod:`flower_apps.report` writes ``<out>/report.md``
(mean ± sample std over the seeds of the final, best and last-5-round accuracy) and
``<out>/report.png`` (mean curves with ±1 std bands).

Engines: ``inprocess`` (default) runs the ServerApp's ``run`` and the ClientApp's
``dispatch`` in this process over :class:`split_layer.transport.LocalGrid`: the same
messages, handlers and results as Flower's simulation engine, one node after another,
without Ray's worker start-up and serialisation (what a 2-core machine can afford for a
sweep of dozens of runs); ``simulation`` runs each row through Flower's simulation engine
(:func:`flower_apps.simulate.run_simulation_inprocess`).

``--set key=value ...`` sets run-config keys for every row (over the paper's base; a row's own
keys win), e.g. a simulated system (``system=semisfl``) or another model; ``--target`` adds the
time (simulated where a system is set) and bytes to that accuracy to the report, and
``report-cost.png`` plots accuracy against time and bytes.

The sweep is restartable: a finished run folder is kept and skipped, a partial one is
resumed from its checkpoint (node-side state under ``<out>/.node-state``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Row:
    name: str
    overrides: dict[str, Any]
    note: str = ""
    probe: bool = False    # not a row of the paper's table: a probe that isolates a cause (ours)
    #: the method(s) of the paper's tables this row reruns ("" = the row's name)
    label: str | tuple[str, ...] = ""

    @property
    def methods(self) -> tuple[str, ...]:
        return (self.label,) if isinstance(self.label, str) and self.label else tuple(self.label) or (self.name,)


@dataclass(frozen=True)
class Budget:
    """A paper's comparison on another dataset: the base overrides and the budget in words;
    ``rows``: a row's own overrides on this dataset, where its budget scales with the data
    (over the row's keys, e.g. a shared set sized as a share of the users' data)."""
    overrides: dict[str, Any]
    settings: str
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """A claim of the paper that two of our rows test: ``better`` ends above ``worse``
    (:func:`flower_apps.pages.verdict` judges it from the paired seeds); ``paper``: what the
    paper reports for it, with its table and setting."""
    text: str
    better: str
    worse: str
    paper: str


@dataclass(frozen=True)
class Paper:
    name: str
    title: str
    base: dict[str, Any]
    rows: tuple[Row, ...]
    supernodes: int
    expected: str                      # the paper's ordering, as the doc states it
    settings: str = ""                 # what differs from the paper, in words
    #: the paper's own comparison tables: table -> its methods, in the paper's order
    tables: dict[str, tuple[str, ...]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)   # method -> why it has no row here
    #: ``--dataset NAME``: the comparison on another dataset, at the budget chosen for it (base
    #: overrides, e.g. a training subset) and that budget in words
    datasets: dict[str, Budget] = field(default_factory=dict)
    #: the paper's own number for a method of its tables (the cell its results page shows beside ours)
    reported: dict[str, str] = field(default_factory=dict)
    claims: tuple[Claim, ...] = ()
    reference: str = ""                # the paper's own method's row: the results page pairs every row with it
    rows_by_name: dict[str, Row] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.rows_by_name.update({r.name: r for r in self.rows})

    def coverage(self) -> list[tuple[str, str, list[str]]]:
        """``(table, method, rows)`` for every method of the paper's tables, in the paper's
        order: the (non-probe) rows that rerun it, ``[]`` where none does."""
        return [(table, m, [r.name for r in self.rows if not r.probe and m in r.methods])
                for table, methods in self.tables.items() for m in methods]

    def listing(self) -> str:
        """What ``--list`` prints for this paper: settings, then every table of the paper with
        each method's rows, then the rows with their run-config overrides."""
        lines = [f"{self.name}: {self.title}", f"  settings: {self.settings}", f"  base: {self.base}"]
        for name, b in self.datasets.items():
            lines.append(f"  --dataset {name}: {b.overrides} ({b.settings})")
            for row, keys in b.rows.items():
                lines.append(f"      row {row} on {name}: {keys}")
        for table, methods in self.tables.items():
            lines.append(f"  {table}:")
            for _, m, rows in (c for c in self.coverage() if c[0] == table):
                where = ", ".join(rows) if rows else f"no row yet ({self.missing.get(m, 'not implemented')})"
                lines.append(f"    {m:<22} -> {where}")
        lines.append("  rows:")
        for r in self.rows:
            tables = [t for t, ms in self.tables.items() if set(r.methods) & set(ms)]
            tag = "probe (ours)" if r.probe else ", ".join(tables) or "extra (ours)"
            lines.append(f"  - {r.name} [{tag}]: {r.overrides}" + (f"  ({r.note})" if r.note else ""))
        return "\n".join(lines)


# Settings: each paper's optimizer, lr, schedule and batch sizes (the papers'
# hyperparameter tables); model family scaled down; rounds cut to fit a 2-core CPU sweep.
PAPERS: dict[str, Paper] = {
    "semisfl": Paper(
        name="semisfl", title="Semi-SFL (Sun et al.): Table IV ordering on non-IID unlabeled clients",
        base={"model": "cnn", "cut": "conv2", "norm": "bn", "partition": "dirichlet", "partition-alpha": 0.1,
              "server-labels": 500, "fraction-train": 0.3, "min-nodes": 2, "num-rounds": 15,
              "lr": 0.02, "momentum": 0.9, "weight-decay": 0.0005, "batch-size": 64,
              "semisfl.k-s": 50, "semisfl.k-u": 20, "semisfl.labeled-batch-size": 64, "semisfl.ema-decay": 0.99},
        rows=(Row("supervised-only", {"algo": "supervised-only", "local-steps": 50},
                  "the server alone: 50 labeled steps of batch 64 per round, same lr schedule", label="Supervised-only"),
              Row("supervised-only-x4", {"algo": "supervised-only", "local-steps": 200},
                  "the server alone at the K_s controller's cap (4 K_s^1 = 200 steps per round): at least as many "
                  "labeled steps as `semisfl` takes in any seed, so its margin is not a step count", probe=True),
              Row("semifl", {"algo": "semifl", "local-steps": 20, "semifl.server-steps": 50, "semifl.server-first": True},
                  "SemiFL, full model: the server fine-tunes 50 steps of batch 64, then static BN statistics; "
                  "clients K_u = 20 fix+mix steps on pseudo-labels >= 0.95; global momentum 0.5; one server "
                  "stage before round 1 (docs/baselines.md, SemiFL)", label="SemiFL"),
              Row("fedmatch", {"algo": "fedmatch", "local-steps": 20},
                  "FedMatch, labels at the server: theta = sigma + psi, 50 server steps on sigma, K_u = 20 "
                  "client steps on psi, helpers every 10th round (the authors' h_interval)", label="FedMatch"),
              Row("fedswitch", {"algo": "fedswitch", "local-steps": 20, "fedswitch.ema-decay": 0.99},
                  "FedSwitch (reconstruction, docs/baselines.md): full model, EMA teacher evaluated, local teacher "
                  "adaptation, teacher/student switch; K_s 50, K_u = 20, EMA 0.99 as the base's Semi-SFL",
                  label="FedSwitch"),
              Row("semisfl-no-cluster", {"algo": "semisfl-no-cluster"}, "FedSwitch-SL-style: l_u = H_u, l_s = H_s, fixed K_s",
                  label="FedSwitch-SL"),
              Row("semisfl", {"algo": "semisfl"}, label=("Semi-SFL", "w/ K_s controller")),
              Row("semisfl-fixed-ks", {"algo": "semisfl-fixed-ks"}, "clustering on, K_s fixed at 50",
                  label="w/o K_s controller"),
              Row("fedmatch-ls1", {"algo": "fedmatch", "local-steps": 20, "fedmatch.lambda-s": 1.0},
                  "probe: lambda_s = 1 (the authors' lambda_s = 10 goes with their lr 1e-3 and no momentum; "
                  "at the seed's lr 0.02 with momentum 0.9 it makes the server's steps 10x supervised-only's)",
                  probe=True),
              Row("semisfl-T-all", {"algo": "semisfl", "semisfl.supcon-queue-positives": "all"},
                  "probe: T with every same-label queue entry a positive (the literal Eq. 3; the default "
                  "counts only confident entries)", probe=True)),
        datasets={"fashion-mnist": Budget(
            {"dataset": "fashion-mnist"},
            "the full Fashion-MNIST (59,500 unlabeled images over the 10 clients, 10,000 test images) at the "
            "MNIST-5k budget: every row's steps per round are fixed (K_s, K_u, server steps), so the data size "
            "changes no row's compute")},
        reference="semisfl",
        reported={"Supervised-only": "75.1 (CIFAR-10, IID, Table II)", "SemiFL": "78.9 (CIFAR-10, Dir(0.1), Table IV)",
                  "FedMatch": "79.7 (CIFAR-10, Dir(0.1), Table IV)", "FedSwitch": "79.4 (CIFAR-10, Dir(0.1), Table IV)",
                  "FedSwitch-SL": "79.2 (CIFAR-10, Dir(0.1), Table IV)", "Semi-SFL": "83.4 (CIFAR-10, Dir(0.1), Table IV)",
                  "w/ K_s controller": "+8.7 points over fixed K_s (250 labels, §8)",
                  "w/o K_s controller": "-8.7 points (250 labels, §8)"},
        claims=(Claim("Semi-SFL > FedSwitch-SL (clustering regularization)", "semisfl", "semisfl-no-cluster",
                      "+4.2 (83.4 vs 79.2, CIFAR-10 Dir(0.1), Table IV)"),
                Claim("Semi-SFL > SemiFL", "semisfl", "semifl", "+4.5 (83.4 vs 78.9, Table IV)"),
                Claim("Semi-SFL > FedMatch", "semisfl", "fedmatch", "+3.7 (83.4 vs 79.7, Table IV)"),
                Claim("Semi-SFL > FedSwitch", "semisfl", "fedswitch", "+4.0 (83.4 vs 79.4, Table IV)"),
                Claim("Semi-SFL > Supervised-only", "semisfl", "supervised-only", "+13.6 (88.7 vs 75.1, CIFAR-10 IID, Table II)"),
                Claim("adaptive K_s > fixed K_s", "semisfl", "semisfl-fixed-ks", "+8.7 points at 250 labels (§8)"),
                Claim("Semi-SFL > the server alone at the K_s controller's cap (ours)", "semisfl", "supervised-only-x4",
                      "not in the paper: separates the unlabeled clients' share from the labeled steps'")),
        supernodes=10,
        tables={"Tables II, IV, V": ("Supervised-only", "SemiFL", "FedMatch", "FedSwitch", "FedSwitch-SL", "Semi-SFL"),
                "K_s controller ablation (§8)": ("w/ K_s controller", "w/o K_s controller")},
        expected="Semi-SFL > FedSwitch-SL (no clustering) > supervised-only; adaptive K_s >= fixed K_s",
        settings="SGD momentum 0.9, lr 0.02 cosine, weight decay 5e-4, batch 64 (paper); K_s 50 initial, "
                 "K_u 20, EMA 0.99 (a small-scale check); 10 clients Dir(0.1), 3 per round (paper 10 of 30); "
                 "500 labels on the PS; Semi-SFL CNN split after conv2; 15 rounds (paper 1000)"),
    "ssfl": Paper(
        name="ssfl", title="SSFL benchmark (Zhang et al.): CRL, GN vs BN, grouping, vs supervised references",
        base={"dataset": "mnist5k", "partition": "ssfl-r", "partition-r": 0.4, "server-labels": 1000,
              "num-rounds": 15, "model": "cnn", "batch-size": 64, "local-steps": 16, "lr": 0.03,
              "momentum": 0.9, "weight-decay": 0.0001, "ssfl.lr-c": 0.4375, "ssfl.lr-horizon": 1.0,
              "ssfl.nesterov": True},
        rows=(Row("ssfl-selftrain-gn", {"algo": "ssfl-selftrain", "norm": "gn"}, "self-training instead of CRL",
                  label="self-training"),
              Row("ssfl-bn", {"algo": "ssfl", "norm": "bn"}, label="CRL+BN"),
              Row("ssfl-gn", {"algo": "ssfl", "norm": "gn"}, label=("CRL+GN", "ours (no user labels)", "ours FedAvg")),
              Row("ssfl-gn-s2", {"algo": "ssfl", "norm": "gn", "ssfl.groups": 2}, "grouping-based averaging, S = 2",
                  label=("CRL+GN+grouping", "ours grouping")),
              Row("supervised-only-gn", {"algo": "supervised-only", "norm": "gn"}, "the server's 1,000 labels alone"),
              Row("fedavg-gn", {"algo": "fedavg", "norm": "gn"}, "reference: every user sample labeled"),
              Row("fedavg-gn-r029", {"algo": "fedavg", "norm": "gn", "partition-r": 0.29},
                  "Table 3's supervised FedAvg, at its R = 0.29", label="supervised FedAvg"),
              Row("datasharing-gn", {"algo": "datasharing", "norm": "gn", "server-labels": 200,
                                     "datasharing.target-r": 0.29},
                  "G = 200 class-balanced samples (beta = 5% of the 4,000), warm-up 5 passes over G; "
                  "alpha chosen so that R(D_k + G_k) = 0.29 (Table 3's R) from the private R = 0.4",
                  label="DataSharing"),
              Row("easgd-gn", {"algo": "easgd", "norm": "gn"},
                  "synchronous EASGD, period T = 16, a = 0.9/K; the centre z is evaluated", label="EASGD"),
              Row("overlapsgd-gn", {"algo": "overlapsgd", "norm": "gn"},
                  "Overlap Local-SGD, period T = 16, pull 0.6, anchor momentum 0.7; the anchor is evaluated",
                  label="OverlapSGD"),
              # what makes CRL collapse: one ingredient changed per row
              Row("ssfl-gn-cutout7", {"algo": "ssfl", "norm": "gn", "cutout": 7},
                  "probe: CRL + GN with a 7-px Cutout instead of the authors' half-image 14 px", probe=True),
              Row("ssfl-afo", {"algo": "ssfl", "model": "cnn-afo", "norm": "none", "dropout": 0.5},
                  "probe: CRL on the authors' EMNIST net (Reddi et al.'s CNN: no normalisation in its forward, "
                  "Dropout2d 0.25, Dropout 0.5)", probe=True),
              Row("ssfl-gn-warm", {"algo": "ssfl", "norm": "gn", "ssfl.warm-start-steps": 240},
                  "probe: CRL + GN from a warm server model (240 labeled steps at the constant lr before round 1: "
                  "the run's whole server budget)", probe=True),
              Row("ssfl-afo-warm", {"algo": "ssfl", "model": "cnn-afo", "norm": "none", "dropout": 0.5,
                                    "ssfl.warm-start-steps": 240},
                  "probe: the authors' net from the same warm start", probe=True),
              Row("ssfl-gn-warm-cutout7", {"algo": "ssfl", "norm": "gn", "ssfl.warm-start-steps": 240, "cutout": 7},
                  "probe: the same warm start with a 7-px Cutout", probe=True)),
        datasets={"fashion-mnist": Budget(
            {"dataset": "fashion-mnist"},
            "the full Fashion-MNIST (59,000 user images, 1,000 server labels, 10,000 test images) at the MNIST-5k "
            "budget: T = 16 steps per party per round whatever the data size; DataSharing's shared set G is "
            "beta = 5% of the users' data as on MNIST-5k (2,950 here, 200 there), since 200 images cannot move "
            "the R of 5,900-image users to 0.29",
            rows={"datasharing-gn": {"server-labels": 2950}})},
        reference="ssfl-gn",
        reported={"self-training": "52.10 (CIFAR-10, §9)", "CRL+BN": "85.11 (CIFAR-10, §9)",
                  "CRL+GN": "92.83 (CIFAR-10, §9)", "CRL+GN+grouping": "93.38 (CIFAR-10, §9)",
                  "supervised FedAvg": "78.52 (CIFAR-10, R = 0.29, Table 3)", "DataSharing": "81.82 (Table 3)",
                  "ours (no user labels)": "91.35 (Table 3)", "EASGD": "91.12 (T = 2, Table 4)",
                  "OverlapSGD": "91.63 (T = 2, Table 4)", "ours FedAvg": "93.83 (T = 2, Table 4)",
                  "ours grouping": "94.22 (T = 2, Table 4)"},
        claims=(Claim("CRL >> self-training", "ssfl-gn", "ssfl-selftrain-gn", "+40.7 (92.83 vs 52.10, CIFAR-10)"),
                Claim("GN > BN", "ssfl-gn", "ssfl-bn", "+7.7 (92.83 vs 85.11, CIFAR-10)"),
                Claim("grouping > FedAvg (S = 2)", "ssfl-gn-s2", "ssfl-gn", "+0.55 (93.38 vs 92.83, CIFAR-10)"),
                Claim("SSFL > the server's labels alone", "ssfl-gn", "supervised-only-gn",
                      "implied: the users' unlabeled data add to the server's labels"),
                Claim("SSFL > DataSharing", "ssfl-gn", "datasharing-gn", "+9.5 (91.35 vs 81.82, Table 3)"),
                Claim("SSFL > EASGD", "ssfl-gn", "easgd-gn", "+2.7 (93.83 vs 91.12, T = 2, Table 4)"),
                Claim("SSFL > OverlapSGD", "ssfl-gn", "overlapsgd-gn", "+2.2 (93.83 vs 91.63, T = 2, Table 4)")),
        supernodes=10,
        tables={"design ablation (§9)": ("self-training", "CRL+BN", "CRL+GN", "CRL+GN+grouping"),
                "Table 3": ("supervised FedAvg", "DataSharing", "ours (no user labels)"),
                "Table 4": ("EASGD", "OverlapSGD", "ours FedAvg", "ours grouping")},
        expected="CRL >> self-training; GN > BN; grouping recovers part of the non-IID gap; SSFL above supervised-only",
        settings="SGD Nesterov momentum 0.9, lr 0.03, weight decay 1e-4, cosine c = 7/16 over the run "
                 "(the paper's EMNIST row), B = 64, T = 16 steps per party per round; K = 10 users all "
                 "participating, R = 0.4, N_s = 1,000; small CNN; 15 rounds (240 iterations). The supervised "
                 "references (Tables 3-4: DataSharing, EASGD, OverlapSGD; Nesterov momentum 0.9, constant lr) "
                 "keep T = 16 and K = 10 for parity (paper: T = 32 in Table 3, T in {2, 8} with K = 16 in Table 4)"),
    "fedshvr": Paper(
        name="fedshvr", title="Fed-SHVR (Wang et al.): class-mismatch FSSL",
        base={"dataset": "mnist5k", "model": "mlp", "norm": "none", "lr": 0.01, "momentum": 0.0,
              "weight-decay": 0.0, "batch-size": 32, "local-epochs": 2, "partition": "dirichlet",
              "partition-alpha": 0.5, "partition-labeled-per-client": 60, "partition-labeled-classes": 2,
              "partition-mismatch-ratio": 0.5, "num-rounds": 40, "min-nodes": 10},
        rows=(Row("fedshvr", {"algo": "fedshvr"}),
              Row("fed-pseudo", {"algo": "fed-pseudo"}),
              Row("fed-mt", {"algo": "fed-mt"}),
              Row("fed-sl", {"algo": "fed-sl"}, "labeled-only FedAvg"),
              Row("fed-sl-matched", {"algo": "fed-sl", "fedshvr.steps": "matched"},
                  "labeled-only FedAvg at the semi-supervised rows' tau_k (cycling each client's 60 labels)",
                  probe=True),
              Row("fed-pseudo-uniform", {"algo": "fed-pseudo", "fedshvr.weighting": "uniform"},
                  "Fed-Pseudo with omega_k = 1/K instead of N_k + M_k (the paper's weights did not survive; "
                  "N_k + M_k is the recommended reading)", probe=True),
              Row("fedshvr-no-vr", {"algo": "fedshvr-no-vr"}, "ablation: no correction d_k"),
              Row("fedshvr-no-nova", {"algo": "fedshvr-no-nova"}, "ablation: plain averaging"),
              Row("fed-pseudo+dk", {"algo": "fedshvr", "fedshvr.alpha1": 0.0, "fedshvr.alpha2": 0.0,
                                    "fedshvr.normalized-averaging": False},
                  "probe: Fed-Pseudo (hard labels, plain averaging) plus the drift correction d_k", probe=True),
              Row("fed-pseudo+nova", {"algo": "fedshvr", "fedshvr.alpha1": 0.0, "fedshvr.alpha2": 0.0,
                                      "fedshvr.correction": False},
                  "probe: Fed-Pseudo with FedNova averaging instead of plain averaging", probe=True)),
        datasets={"fashion-mnist": Budget(
            {"dataset": "fashion-mnist", "train-size": 10000, "partition-alpha": 5.0},
            "a stratified 10,000-image subset of Fashion-MNIST (600 labels, about 9,300 unlabeled over the 10 "
            "clients); unlabeled sizes Dir_10(5), which gives tau_k = 37-80 and a largest-to-smallest ratio of "
            "1.86 / 2.11 / 1.87 (seeds 0-2) against the paper's 270-500 (1.85); 40 rounds of E = 2 epochs")},
        reference="fedshvr",
        claims=(Claim("Fed-SHVR >= Fed-Pseudo", "fedshvr", "fed-pseudo", "qualitative (no numbers survived), MNIST"),
                Claim("Fed-SHVR > Fed-MT", "fedshvr", "fed-mt", "qualitative, MNIST"),
                Claim("Fed-Pseudo > labeled-only FedAvg", "fed-pseudo", "fed-sl", "qualitative, MNIST"),
                Claim("removing the correction d_k hurts", "fedshvr", "fedshvr-no-vr", "qualitative (loss, run-to-run std)"),
                Claim("removing FedNova averaging hurts", "fedshvr", "fedshvr-no-nova", "qualitative (loss, run-to-run std)")),
        supernodes=10,
        expected="Fed-SHVR >= Fed-MT, Fed-Pseudo > labeled-only FedAvg; removing d_k or FedNova hurts",
        settings="plain SGD lr 0.01, B_l = B_u = 32, E = 2, K = 10, MLP, alpha1 0.75, alpha2 0.1, alpha0 "
                 "ramped over 50 epochs (paper MNIST column); mismatch r = 0.5; 40 rounds (paper 100)"),
    "umpfssl": Paper(
        name="umpfssl", title="UM-pFSSL (Shi et al.): personalised FSSL, mean per-client accuracy",
        base={"dataset": "mnist5k", "model": "cnn", "norm": "bn", "dropout": 0.5, "partition": "dirichlet",
              "partition-alpha": 0.5, "partition-labeled-alpha": 0.5, "fraction-train": 0.1, "min-nodes": 2,
              "num-rounds": 20, "batch-size": 64, "lr": 0.0001, "momentum": 0.9, "weight-decay": 0.0,
              "local-epochs": 1},
        rows=(Row("fedavg-sl", {"algo": "fedavg-sl"},
                  "FedAvg, CE on D_k^s + D_k^u with D_k^u's true labels (privileged-label reference)", label="FedAvg-SL"),
              Row("fedprox-sl", {"algo": "fedprox-sl"},
                  "FedProx (mu = 0.01), CE on fully labeled clients (reference)", label="FedProx-SL"),
              Row("fedbn-sl", {"algo": "fedbn-sl"},
                  "FedBN (BatchNorm local, uniform mean), CE on fully labeled clients (reference)", label="FedBN-SL"),
              Row("fixavg", {"algo": "fixavg"}, label="FixAvg"),
              Row("fixprox", {"algo": "fixprox"}, label="FixProx"),
              Row("fixbn", {"algo": "fixbn"}, "FedBN + FixMatch (BatchNorm layers local, uniform mean)", label="FixBN"),
              Row("fedper-fix", {"algo": "fedper-fix"}, label="FedPer"),
              Row("lg-fedavg-fix", {"algo": "lg-fedavg-fix"},
                  "LG-FedAvg + FixMatch (local body, global head, uniform mean)", label="LG-FedAvg"),
              Row("pfedme-fix", {"algo": "pfedme-fix"},
                  "pFedMe + FixMatch (lambda 15, K 5, personal lr 0.01, beta 1; theta_k evaluated)", label="pFedMe"),
              Row("umpfssl", {"algo": "umpfssl"}, label="UM-pFSSL"),
              Row("umpfssl-no-helpers", {"algo": "umpfssl", "umpfssl.helpers": 1, "umpfssl.replace": 0},
                  "M = 1: the client's own model only (uncertainty-weighted pseudo-labels, no helpers)"),
              Row("local-only", {"algo": "local-only"}),
              Row("umpfssl-lr0.01", {"algo": "umpfssl", "lr": 0.01},
                  "probe: 100x the paper's learning rate", probe=True),
              Row("fixavg-lr0.01", {"algo": "fixavg", "lr": 0.01}, "probe: FixAvg at 100x the paper's lr",
                  probe=True),
              Row("local-only-lr0.01", {"algo": "local-only", "lr": 0.01},
                  "probe: local-only at 100x the paper's lr", probe=True),
              *(Row(f"{a}-lr0.01", {"algo": a, "lr": 0.01}, f"probe: {a} at 100x the paper's lr", probe=True)
                for a in ("fedavg-sl", "fedprox-sl", "fedbn-sl", "fixbn", "lg-fedavg-fix", "pfedme-fix"))),
        datasets={"fashion-mnist": Budget(
            {"dataset": "fashion-mnist", "train-size": 12000, "fraction-train": 0.5, "num-rounds": 40},
            "the paper's participation, scaled down: a stratified 12,000-image subset over K = 20 clients "
            "(600 per client, the paper's 60,000 / 100), 10 clients per round (the paper's 10% of 100) for 40 "
            "rounds: 20 participations per client of one epoch, about 9 steps of 64 (the paper: about 20 of "
            "about 9)")},
        reference="umpfssl",
        reported={"FedAvg-SL": "81.71 (Fashion-MNIST, alpha 0.5, Table 1)", "FedProx-SL": "81.83", "FedBN-SL": "75.79",
                  "FixAvg": "75.94", "FixProx": "76.77", "FixBN": "76.40", "FedPer": "60.65", "LG-FedAvg": "74.64",
                  "pFedMe": "44.53", "UM-pFSSL": "78.38 (Fashion-MNIST, alpha 0.5, Table 1)"},
        claims=tuple(Claim(f"UM-pFSSL > {label}", "umpfssl", row, f"+{78.38 - num:.2f} (78.38 vs {num}, Table 1)")
                     for label, row, num in (("FixAvg", "fixavg", 75.94), ("FixProx", "fixprox", 76.77),
                                             ("FixBN", "fixbn", 76.40), ("FedPer", "fedper-fix", 60.65),
                                             ("LG-FedAvg", "lg-fedavg-fix", 74.64), ("pFedMe", "pfedme-fix", 44.53))),
        supernodes=20,
        tables={"Table 1": ("FedAvg-SL", "FedProx-SL", "FedBN-SL", "FixAvg", "FixProx", "FixBN", "FedPer", "LG-FedAvg",
                            "pFedMe", "UM-pFSSL")},
        expected="UM-pFSSL > FixAvg/FixProx/FedPer in mean per-client accuracy, with a lower variance",
        settings="SGD lr 1e-4 momentum 0.9, batch 64, dropout 0.5, 10% of the clients per round, M = 5, "
                 "R = 2, F = 20, nu = 10 (paper); K = 20, Dir(0.5) labels, Dir_2(0.5) labeled ratios, E = 1, "
                 "T_mc = 10; MNIST-5k instead of Fashion-MNIST (offline), the small CNN with BatchNorm "
                 "and dropout instead of ResNet-9; 20 rounds (paper 200)"),
    "scala": Paper(
        name="scala", title="SCALA (Yang & Liu): split FL under label skew",
        base={"partition": "quantity", "partition-classes-per-client": 2, "fraction-train": 0.25,
              "min-nodes": 2, "num-rounds": 30, "model": "cnn", "cut": "conv2", "lr": 0.01, "momentum": 0.0,
              "weight-decay": 0.0, "scala.local-iterations": 10, "scala.total-batch": 160},
        rows=(Row("fedavg", {"algo": "fedavg", "local-steps": 10, "batch-size": 32},
                  "Table III, full-model FL: I = 10 local steps on batches of B/|S_t| = 32", label="FedAvg"),
              Row("fedprox", {"algo": "fedprox", "local-steps": 10, "batch-size": 32},
                  "Tables III-V, full-model FL: I = 10 local steps on batches of B/|S_t| = 32, mu = 0.01", label="FedProx"),
              Row("fedlc", {"algo": "fedlc", "local-steps": 10, "batch-size": 32},
                  "Tables III-V, full-model FL: I = 10 local steps on batches of B/|S_t| = 32, tau = 1.0", label="FedLC"),
              Row("fedcbs", {"algo": "fedcbs", "local-steps": 10, "batch-size": 32},
                  "Table III, full-model FL: FedAvg with class-balanced client sampling (QCID, lambda = 10); "
                  "I = 10 local steps on batches of 32; the nodes' label histograms go to the server", label="FedCBS"),
              Row("splitfed-v1", {"algo": "splitfed-v1"}, label="SplitFedV1"),
              Row("splitfed-v2", {"algo": "splitfed-v2"}, "sequential: clients in a random order per round",
                  label="SplitFedV2"),
              Row("sfl-local-loss", {"algo": "sfl-local-loss"},
                  "Table III, reconstruction: clients train on a local auxiliary head (flatten + linear on the cut's "
                  "activation), no server gradients; one server part, one CE step per client in a seeded "
                  "random order; bottoms and heads averaged", label="SFLLocalLoss"),
              Row("ca-sfl", {"algo": "ca-sfl"}, "= Minibatch-SFL (also registered as minibatch-sfl): concatenation, "
                  "plain CE", label=("CA-SFL", "Minibatch-SFL")),
              Row("cs-sfl", {"algo": "cs-sfl"},
                  "Table III, reconstruction: SplitFedV1 with class-balanced client selection (Fed-CBS's "
                  "QCID sampler, lambda = 10) from the split-info label histograms", label="CS-SFL"),
              Row("scala", {"algo": "scala"}, label="SCALA"),
              Row("lla-sfl", {"algo": "lla-sfl"}, label="LLA-SFL"),
              Row("scala-vgg11", {"algo": "scala", "model": "vgg11-small", "cut": "bottleneck"},
                  "Table VI, SCALA at SCALA-PE's cut: VGG-11 (widths / 4) split after conv2 with the 8-channel "
                  "bottleneck", label="SCALA"),
              Row("scala-pe", {"algo": "scala-pe", "model": "vgg11-small", "cut": "bottleneck", "scala-pe.local-iterations": 10,
                            "scala-pe.total-batch": 160, "scala-pe.ssim-threshold": 0.0, "scala-pe.inverter-interval": 1,
                            "scala-pe.inverter-steps": 3},
                  "Table VI: SCALA + gamma * SSIM of each node's simulated inverter (16-channel conv autoencoder, 3 "
                  "Adam steps before every split step), gamma = 0.3 (ResSFL); plain SSIM (threshold 0) instead of "
                  "ResSFL's 0.5 hinge, which the simulated inverter never reaches in this budget", label="SCALA-PE"),
              Row("scala-pe-g1", {"algo": "scala-pe", "model": "vgg11-small", "cut": "bottleneck", "scala-pe.local-iterations": 10,
                            "scala-pe.total-batch": 160, "scala-pe.ssim-threshold": 0.0, "scala-pe.inverter-interval": 1,
                            "scala-pe.inverter-steps": 3, "scala-pe.gamma": 1.0},
                  "gamma sweep: SCALA-PE at gamma = 1", probe=True),
              Row("scala-pe-g0.1", {"algo": "scala-pe", "model": "vgg11-small", "cut": "bottleneck", "scala-pe.local-iterations": 10,
                            "scala-pe.total-batch": 160, "scala-pe.ssim-threshold": 0.0, "scala-pe.inverter-interval": 1,
                            "scala-pe.inverter-steps": 3, "scala-pe.gamma": 0.1},
                  "gamma sweep: SCALA-PE at gamma = 0.1", probe=True),
              Row("fedconcat", {"algo": "fedconcat", "local-steps": 10, "batch-size": 32},
                  "Table IV, full-model FL: K = 5 clusters by K-means on the nodes' label distributions; rounds "
                  "1-15 FedAvg within each cluster, rounds 16-30 a head over the 5 concatenated encoders "
                  "(initialised from the cluster heads); I = 10 local steps on batches of 32", label="FedConcat")),
        datasets={"fashion-mnist": Budget(
            {"dataset": "fashion-mnist"},
            "the full Fashion-MNIST at the MNIST-5k budget: I = 10 iterations of B = 160 per round whatever the "
            "data size")},
        reference="scala",
        reported={"SplitFedV1": "60.97 (CIFAR-10, alpha 2, rho 10%, Tables II-III)", "CA-SFL": "74.47 (Table II)",
                  "LLA-SFL": "75.87 (Table II)", "SCALA": "82.70 (CIFAR-10, alpha 2, rho 10%, Tables II-III)",
                  "FedAvg": "68.36 (Table III)", "FedProx": "69.03 (Table III)", "FedLC": "76.91 (Table III)",
                  "FedCBS": "68.54 (Table III)", "SplitFedV2": "62.24 (Table III)", "SFLLocalLoss": "71.56 (Table III)",
                  "Minibatch-SFL": "74.47 (Table III)", "CS-SFL": "77.13 (Table III)",
                  "FedConcat": "17.74 (CIFAR-100, ResNet-18, alpha 3, rho 10%, Table IV)"},
        claims=(Claim("SCALA > SplitFedV1", "scala", "splitfed-v1", "+21.7 (82.70 vs 60.97, Table II)"),
                Claim("SCALA > CA-SFL (logit adjustment)", "scala", "ca-sfl", "+8.2 (82.70 vs 74.47, Table II)"),
                Claim("SCALA > LLA-SFL (concatenation)", "scala", "lla-sfl", "+6.8 (82.70 vs 75.87, Table II)"),
                Claim("CA-SFL > SplitFedV1", "ca-sfl", "splitfed-v1", "+13.5 (74.47 vs 60.97, Table II)"),
                Claim("LLA-SFL > SplitFedV1", "lla-sfl", "splitfed-v1", "+14.9 (75.87 vs 60.97, Table II)"),
                Claim("SCALA > FedLC", "scala", "fedlc", "+5.8 (82.70 vs 76.91, Table III)"),
                Claim("FedLC > FedAvg", "fedlc", "fedavg", "+8.6 (76.91 vs 68.36, Table III)"),
                Claim("SCALA > FedAvg", "scala", "fedavg", "+14.3 (82.70 vs 68.36, Table III)")),
        supernodes=20,
        tables={"Table II": ("SplitFedV1", "CA-SFL", "LLA-SFL", "SCALA"),
                "Table III": ("FedAvg", "FedProx", "FedLC", "FedCBS", "SplitFedV1", "SplitFedV2", "SFLLocalLoss",
                              "Minibatch-SFL", "CS-SFL", "SCALA"),
                "Table IV": ("FedProx", "FedLC", "FedConcat", "SCALA"),
                "Table V": ("FedProx", "FedLC", "SCALA"),
                "Table VI": ("SCALA", "SCALA-PE")},

        expected="SCALA > CA-SFL (= Minibatch-SFL) > SplitFedV2 ~ SplitFedV1 (Table III, CIFAR-10 alpha = 2: "
                 "82.70 > 74.47 > 62.24 ~ 60.97), LLA-SFL > SplitFedV1 (Table II); SCALA smallest per-class spread",
        settings="plain SGD lr 0.01, B = 160, I = 10 (a small-scale check; paper B = 320, I = 20); K = 20, "
                 "rho = 25%, 2 classes per client (alpha = 2); Semi-SFL CNN split after conv2 instead of "
                 "AlexNet; 30 rounds = 300 global iterations"),
}


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """``--set key=value`` pairs: the value read as TOML (``2``, ``0.5``, ``true``, ``'x'``), else as
    a string (``system=semisfl``)."""
    import tomllib

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r} is not key=value")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def row_config(paper: Paper, row: Row, seed: int, out: Path, rounds: int | None = None,
               sets: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None,
               row_sets: dict[str, Any] | None = None) -> tuple[dict, set[str]]:
    """The fused run config of one (row, seed) and the keys set for it (the 'user' keys);
    ``sets``: keys set for every row (``--set``), over the paper's base, under the row's own;
    ``row_sets``: this row's keys on the chosen dataset (:attr:`Budget.rows`), over the row's own;
    ``defaults``: the project's run config (default: read from pyproject.toml now)."""
    from flower_apps.simulate import fused_run_config

    over = {**paper.base, **(sets or {}), **row.overrides, **(row_sets or {}), "seed": seed,
            "run-name": f"{row.name}-s{seed}", "results-dir": str(out)}
    if rounds is not None:
        over["num-rounds"] = rounds
    cfg = dict(defaults) if defaults is not None else fused_run_config(None)
    unknown = sorted(set(over) - set(cfg))
    if unknown:
        raise KeyError(f"paper {paper.name!r}, row {row.name!r}: unknown run-config keys {unknown}")
    cfg.update(over)
    return cfg, set(over)


def _done_rounds(folder: Path) -> int:
    try:
        lines = [ln for ln in (folder / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return int(json.loads(lines[-1])["round"]) if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def run_one(cfg: dict, explicit: set[str], supernodes: int, engine: str) -> Path:
    if engine == "simulation":
        from flower_apps.simulate import run_simulation_inprocess

        return run_simulation_inprocess(cfg, supernodes, explicit=explicit)
    from flower_apps.client_app import dispatch
    from flower_apps.server_app import run
    from split_layer.transport import LocalGrid

    return run(LocalGrid(supernodes, dispatch, run_config=cfg, keep_sent=False), cfg, explicit=explicit)


def run_paper(name: str, seeds=DEFAULT_SEEDS, out: Path | None = None, engine: str = "inprocess",
              rows: list[str] | None = None, rounds: int | None = None, log=print,
              sets: dict[str, Any] | None = None, target: float | None = None, paired: str = "",
              dataset: str = "") -> Path:
    """Run every (row, seed) of paper ``name`` that is not finished; write the report; return ``out``.
    ``dataset``: one of the paper's :attr:`Paper.datasets`, whose budget goes under ``sets``."""
    paper = PAPERS[name]
    row_sets: dict[str, dict[str, Any]] = {}
    user_sets = dict(sets or {})   # the report names them: they override the paper's settings text
    if dataset:
        sets = {**paper.datasets[dataset].overrides, **(sets or {})}
        row_sets = paper.datasets[dataset].rows
    out = Path(out or Path("results") / "papers" / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLOWER_SSL_STATE_DIR", str(out / ".node-state"))
    chosen = [paper.rows_by_name[r] for r in rows] if rows else list(paper.rows)
    from flower_apps.simulate import fused_run_config

    defaults = fused_run_config(None)   # read once: editing pyproject.toml mid-sweep changes nothing
    t_all = time.time()
    for row in chosen:
        for seed in seeds:
            cfg, explicit = row_config(paper, row, seed, out, rounds, sets, defaults, row_sets.get(row.name))
            folder = out / cfg["run-name"]
            done = _done_rounds(folder)
            if done >= cfg["num-rounds"]:
                log(f"[{name}] {folder.name}: done ({done} rounds), kept")
                continue
            if folder.exists():
                cfg["resume"] = True
                explicit.add("resume")
            t0 = time.time()
            log(f"[{name}] {folder.name}: {'resuming after round ' + str(done) if done else 'running'}")
            run_one(cfg, explicit, paper.supernodes, engine)
            log(f"[{name}] {folder.name}: {time.time() - t0:.0f} s")
    write_report(paper, out, [r.name for r in chosen], seeds, target, paired, dataset, user_sets)
    log(f"[{name}] report: {out / 'report.md'} ({time.time() - t_all:.0f} s)")
    return out


def write_report(paper: Paper, out: Path, rows: list[str], seeds, target: float | None = None,
                 paired: str = "", dataset: str = "", sets: dict[str, Any] | None = None) -> str:
    """``out``'s report.md (and its figures) over ``rows`` x ``seeds``. ``sets``: the keys the
    sweep set on every row (``--set``), named under the title, since the settings text below is
    the paper's budget."""
    from flower_apps.report import (onset_table, paired_table, plot_cost, plot_seed_groups, read_run, seed_groups,
                                    seed_table, target_table)

    runs = [read_run(out / f"{r}-s{s}") for r in rows for s in seeds if (out / f"{r}-s{s}" / "metrics.jsonl").exists()]
    groups = seed_groups(runs)
    table = seed_table(groups)
    notes = "\n".join(f"* `{r.name}`: {r.note}" for r in paper.rows if r.name in rows and r.note)
    if target is not None:   # time (simulated, where a system was chosen) and bytes to the target
        table += "\n" + target_table(groups, target)
    if paired:   # every row against one, seed by seed
        table += "\n" + paired_table(groups, paired)
    if any("pseudo-hist" in row for r in runs for row in r.rows):   # SSFL: when the first confident labels come
        table += "\n" + onset_table(runs)
    on = (f"\n\nOn {dataset} (`--dataset {dataset}`: {paper.datasets[dataset].overrides}): "
          f"{paper.datasets[dataset].settings}." if dataset else "")
    title = f"{paper.title}, on {dataset or 'the embedded MNIST-5k'}"   # (the data the table was run on)
    over = (f"Set on every row (`--set {' '.join(f'{k}={v!r}' for k, v in sets.items())}`): where the settings "
            f"below say otherwise, these hold.\n\n" if sets else "")
    text = (f"# {title}\n\n{over}{table}\nSettings: {paper.settings}.{on}\n\nPaper's ordering: {paper.expected}.\n"
            + (f"\n{notes}\n" if notes else ""))
    (out / "report.md").write_text(text)
    plot_seed_groups(groups, out / "report.png", title=title)
    if any(r.has_sim for r in runs):
        plot_cost(groups, out / "report-cost.png", title=title, target=target)
    print(text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flower_apps.papers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paper", nargs="?", choices=sorted(PAPERS), help="which paper's comparison")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    ap.add_argument("--rows", nargs="+", default=None, help="a subset of the paper's rows (default: all)")
    ap.add_argument("--engine", choices=("inprocess", "simulation"), default="inprocess")
    ap.add_argument("--out", default=None, help="results folder (default: results/papers/<paper>)")
    ap.add_argument("--rounds", type=int, default=None, help="override num-rounds (quick looks)")
    ap.add_argument("--set", nargs="+", default=None, metavar="KEY=VALUE",
                    help="run-config keys for every row, over the paper's base (a row's own keys win): "
                         "e.g. --set system=semisfl model=alexnet cut=conv5")
    ap.add_argument("--target", type=float, default=None,
                    help="also tabulate the time (simulated where a system is set) and bytes to this accuracy")
    ap.add_argument("--dataset", default="", metavar="NAME",
                    help="rerun the comparison on another dataset at the budget the paper records for it "
                         "(--list shows them; results in results/papers/<paper>-<NAME>)")
    ap.add_argument("--paired", default="", metavar="ROW",
                    help="also tabulate every row's per-seed differences from this row (paired over seeds)")
    ap.add_argument("--page", action="store_true",
                    help="regenerate the paper's results page docs/paper-results/<paper>.md (and .png) from the run "
                         "folders committed under docs/paper-results/runs/<paper>-fmnist/ (no paper: every page); "
                         "runs nothing")
    ap.add_argument("--list", action="store_true",
                    help="print the paper's tables (each method and the rows that rerun it), rows and settings")
    args = ap.parse_args(argv)
    if args.page:
        from flower_apps.pages import write_page

        for p in ([PAPERS[args.paper]] if args.paper else PAPERS.values()):
            print(write_page(p, args.dataset or "fashion-mnist"))
        return 0
    if args.list or not args.paper:
        for p in ([PAPERS[args.paper]] if args.paper else PAPERS.values()):
            print(p.listing())
        return 0 if args.list else 2
    unknown = [r for r in (args.rows or []) + ([args.paired] if args.paired else [])
               if r not in PAPERS[args.paper].rows_by_name]
    if unknown:
        print(f"error: --rows {unknown} not in {args.paper}'s rows: "
              f"{', '.join(PAPERS[args.paper].rows_by_name)}", file=sys.stderr)
        return 2
    paper = PAPERS[args.paper]
    if args.dataset and args.dataset not in paper.datasets:
        print(f"error: --dataset {args.dataset!r}: {args.paper} has a budget for "
              f"{', '.join(paper.datasets) or 'no other dataset'}", file=sys.stderr)
        return 2
    if args.paired and args.rows and args.paired not in args.rows:
        print(f"error: --paired {args.paired!r} is not one of the --rows", file=sys.stderr)
        return 2
    from tasks.config import ConfigError

    try:
        out = Path(args.out) if args.out else (Path("results") / "papers" / f"{args.paper}-{args.dataset}"
                                               if args.dataset else None)
        run_paper(args.paper, args.seeds, out, args.engine, args.rows, args.rounds,
                  sets=parse_sets(args.set), target=args.target, paired=args.paired, dataset=args.dataset)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
