"""Compare runs: several run folders in, one markdown table and one figure out.

Each run folder is one written by :mod:`flower_apps.results` (``config.json`` and
``metrics.jsonl``). A folder that holds run folders (no ``metrics.jsonl`` of its own)
stands for all of them. Usage::

    flower-ssl-report results/ssfl-small --out report.md --figure report.png
    python -m flower_apps.report results/run-a results/run-b --metric accuracy

Table columns: run, algo, the config keys that differ between the runs, final and best
test accuracy (with the round of the best), rounds completed, total bytes exchanged,
wall time. The figure plots accuracy against round (left) and against cumulative bytes
(right) for every run.

With ``--by-seed`` runs that differ only in ``seed`` are one experiment: one row each with
the mean ± sample std over the seeds of the final, best and last-5-round accuracy, and a
figure of the mean curves with ±1 std bands (``flower_apps.papers`` writes its tables so).

Where a run folder holds an ``attack.json`` (written by ``python -m flower_apps.attack``: the
evaluation inversion attacker on the run's final model), both tables add the columns "attack
MSE", "attack SSIM" and "attack PSNR" (the seed table: mean ± std over the seeds that have one);
runs without one get "n/a" there. Without any ``attack.json`` the tables are as before. Another
attacker's record on the same model (``python -m flower_apps.attack RUN --save-as NAME``:
``attack-NAME.json``) is read into :attr:`Run.other_attacks`; the results pages put it beside the
default attacker's (:func:`flower_apps.pages.attacker_table`).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flower_apps.plotting import pyplot as _pyplot
from flower_apps.plotting import round_axis
from flower_apps.plotting import save as _save
from flower_apps.results import CONFIG, METRICS

ATTACK_FILE = "attack.json"   # (flower_apps.attack writes it)
#: another attacker's record on the same model: ``attack-<name>.json`` (``--save-as <name>``)
OTHER_ATTACK_PREFIX = "attack-"
#: the attack metrics shown, as (attack.json key, column name, digits)
ATTACK_COLUMNS = (("attack-mse", "attack MSE", 4), ("attack-ssim", "attack SSIM", 3), ("attack-psnr", "attack PSNR", 2))

# keys that differ between runs but say nothing about the experiment: where its files go, how long
# to wait, and how a split algorithm's exchanges travel (the transport and its stream's addressing,
# TLS and session length give the same weights bit for bit: tests/test_transport_choice.py,
# tests/test_split_sessions.py), so runs over messages and over the stream are one experiment's seeds
_IGNORED_KEYS = {"run-name", "results-dir", "resume", "round-timeout", "startup-timeout", "wait-for-nodes",
                 "split-transport", "split-stream-host", "split-stream-advertise", "split-stream-port",
                 "split-stream-tls", "split-stream-session", "split-stream-allow-plaintext"}


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    attack: dict[str, Any] | None = None   # the run's attack.json, if any
    #: other attackers' records on the same model, by name (``attack-<name>.json``)
    other_attacks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def attack_value(self, key: str, name: str = "") -> float:
        """``key`` of the default attacker's record (``name`` ``""``) or of ``attack-<name>.json``;
        NaN where the run has no such record or value."""
        rec = self.attack if not name else self.other_attacks.get(name)
        v = (rec or {}).get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, metric: str) -> list[tuple[int, float]]:
        return [(int(r["round"]), float(r[metric])) for r in self.rows
                if isinstance(r.get(metric), (int, float)) and math.isfinite(float(r[metric]))]

    def cumulative_bytes(self) -> list[float]:
        out, total = [], 0.0
        for r in self.rows:
            total += float(r.get("bytes.total", 0) or 0)
            out.append(total)
        return out

    @property
    def stopped_at_target(self) -> bool:
        """The run stopped on reaching ``stop-accuracy`` (a time-to-target run: its last value
        is where it crossed the target, not a final accuracy)."""
        return any(r.get("stopped-at-target") for r in self.rows)

    @property
    def has_sim(self) -> bool:
        """The run was timed by a simulated system (``system``: ``sim-seconds-total`` per round)."""
        return any("sim-seconds-total" in r for r in self.rows)

    def clock(self) -> list[float]:
        """Per row of :attr:`rows`: seconds since the start, simulated where the run was timed by a
        system (``sim-seconds-total``), else the real wall time (``wall-seconds``)."""
        key = "sim-seconds-total" if self.has_sim else "wall-seconds"
        return [float(r.get(key, math.nan)) for r in self.rows]

    def to_target(self, target: float, metric: str = "accuracy") -> dict[str, float] | None:
        """The first round whose ``metric`` reaches ``target``: its round, the time to it
        (:meth:`clock`) and the bytes exchanged until then; ``None`` where it never does."""
        for row, t, b in zip(self.rows, self.clock(), self.cumulative_bytes()):
            v = row.get(metric)
            if isinstance(v, (int, float)) and v >= target:
                return {"round": float(row["round"]), "seconds": t, "bytes": b}
        return None

    def summary(self, metric: str = "accuracy") -> dict[str, Any]:
        s = self.series(metric)
        best_round, best = max(s, key=lambda t: t[1]) if s else (None, math.nan)
        last = self.rows[-1] if self.rows else {}
        return {
            "final": s[-1][1] if s else math.nan,
            "best": best,
            "best_round": best_round,
            "rounds": int(last.get("round", 0)) if last else 0,
            "bytes": self.cumulative_bytes()[-1] if self.rows else 0.0,
            "wall": float(last.get("wall-seconds", math.nan)) if last else math.nan,
        }


def read_run(path: str | Path) -> Run:
    """One run folder (``config.json`` optional, ``metrics.jsonl`` required)."""
    p = Path(path)
    mpath = p / METRICS
    if not mpath.exists():
        raise FileNotFoundError(f"{p} is not a run folder: no {METRICS}")
    cfg = json.loads((p / CONFIG).read_text()) if (p / CONFIG).exists() else {}
    rows = []
    for line in mpath.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # torn last line of a killed run
    others = {f.name[len(OTHER_ATTACK_PREFIX):-len(".json")]: rec
              for f in sorted(p.glob(f"{OTHER_ATTACK_PREFIX}*.json")) if (rec := _json_dict(f)) is not None}
    return Run(p, cfg, rows, _json_dict(p / ATTACK_FILE), others)


def _json_dict(path: Path) -> dict[str, Any] | None:
    """A JSON object file's content; ``None`` where it is missing, unreadable or not an object
    (an attack record so: shown as n/a)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Run folders named directly, or the run folders inside a given folder (sorted)."""
    runs: list[Run] = []
    for p in map(Path, paths):
        if (p / METRICS).exists():
            runs.append(read_run(p))
        elif p.is_dir():
            subs = sorted(d for d in p.iterdir() if (d / METRICS).exists())
            if not subs:
                raise FileNotFoundError(f"{p} holds no run folders (no */{METRICS})")
            runs.extend(read_run(d) for d in subs)
        else:
            raise FileNotFoundError(f"{p} does not exist")
    if not runs:
        raise FileNotFoundError("no run folders given")
    return runs


def varying_keys(runs: list[Run]) -> list[str]:
    """Config keys (besides algo) whose values differ between the runs that have them.

    A key only some runs have (another algorithm's namespace) shows only if it varies
    among those runs; the others get an empty cell.
    """
    keys = sorted(set().union(*(r.config for r in runs)) - _IGNORED_KEYS - {"algo"})
    return [k for k in keys
            if len({json.dumps(r.config[k], sort_keys=True) for r in runs if k in r.config}) > 1]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} TB"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _has_attack(runs: list[Run]) -> bool:
    return any(r.attack for r in runs)


def _num(v: float, digits: int) -> str:
    return "n/a" if math.isnan(v) else f"{v:.{digits}f}"


def markdown_table(runs: list[Run], metric: str = "accuracy") -> str:
    vary = varying_keys(runs)
    attack = _has_attack(runs)
    head = ["run", "algo", *vary, f"final {metric}", f"best {metric} (round)", "rounds", "bytes", "wall time",
            *([c for _, c, _ in ATTACK_COLUMNS] if attack else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s = r.summary(metric)
        best = "n/a" if s["best_round"] is None else f"{s['best']:.4f} ({s['best_round']})"
        final = "n/a" if math.isnan(s["final"]) else f"{s['final']:.4f}"
        wall = "n/a" if math.isnan(s["wall"]) else f"{s['wall']:.0f} s"
        cells = [r.name, str(r.config.get("algo", "?")), *(_fmt(r.config.get(k, "")) for k in vary),
                 final, best, str(s["rounds"]), _fmt_bytes(s["bytes"]), wall,
                 *([_num(r.attack_value(k), d) for k, _, d in ATTACK_COLUMNS] if attack else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def at_round_table(runs: list[Run], rounds: list[int], metric: str = "accuracy") -> str:
    """Each run's ``metric`` at each of ``rounds`` ("n/a" where the run stopped before that round):
    runs of unequal length (a sweep stopped at a time limit) compared where all of them were."""
    head = ["run", *(f"{metric} at round {r}" for r in rounds)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        at = dict(run.series(metric))
        lines.append("| " + " | ".join([run.name, *(f"{at[r]:.4f}" if r in at else "n/a" for r in rounds)]) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- seeds
_SEED_KEYS = {"seed"}


@dataclass
class SeedGroup:
    """Runs whose configs differ only in ``seed`` (and run bookkeeping): one experiment."""

    label: str
    runs: list[Run]

    @property
    def config(self) -> dict[str, Any]:
        return self.runs[0].config

    @property
    def stopped(self) -> bool:
        """Some run of the group stopped at its target (:attr:`Run.stopped_at_target`)."""
        return any(r.stopped_at_target for r in self.runs)

    def stats(self, metric: str = "accuracy", last: int = 5) -> dict[str, Any]:
        """Mean and sample std (ddof 1; 0 for one seed) over the seeds of: the final value,
        the best value, and the mean of the last ``last`` rounds."""
        finals, bests, tails, walls, rounds = [], [], [], [], []
        for r in self.runs:
            s = r.series(metric)
            if not s:
                continue
            vals = [v for _, v in s]
            finals.append(vals[-1])
            bests.append(max(vals))
            tails.append(sum(vals[-last:]) / len(vals[-last:]))
            rounds.append(s[-1][0])
            w = r.summary(metric)["wall"]
            if not math.isnan(w):
                walls.append(w)
        attack = {k: _mean_std([v for v in (r.attack_value(k) for r in self.runs) if not math.isnan(v)])
                  for k, _, _ in ATTACK_COLUMNS}
        return {"seeds": [r.config.get("seed") for r in self.runs], "n": len(finals),
                "final": _mean_std(finals), "best": _mean_std(bests), "last": _mean_std(tails),
                "rounds": min(rounds) if rounds else 0, "wall": _mean_std(walls), "attack": attack}

    def mean_curve(self, metric: str = "accuracy") -> tuple[list[int], list[float], list[float]]:
        """Per round (rounds all seeds reached): mean and sample std over the seeds."""
        per = [dict(r.series(metric)) for r in self.runs]
        per = [p for p in per if p]
        if not per:
            return [], [], []
        common = sorted(set.intersection(*(set(p) for p in per)))
        ms = [_mean_std([p[k] for p in per]) for k in common]
        return common, [m for m, _ in ms], [s for _, s in ms]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _group_key(run: Run) -> str:
    # a key the run predates (added to the project after it ran) ran at its default: runs from
    # before and after the key was added are the same experiment when it is at its default
    cfg = {k: v for k, v in {**_project_defaults(), **run.config}.items() if k not in _IGNORED_KEYS | _SEED_KEYS}
    return json.dumps(cfg, sort_keys=True, default=str)


@functools.lru_cache(maxsize=1)
def _project_defaults() -> dict[str, Any]:
    """The project's run config as ``pyproject.toml`` gives it now (``{}`` where it cannot be read)."""
    try:
        from flower_apps.simulate import fused_run_config

        return fused_run_config(None)
    except Exception:   # (a report read outside the project: group on the saved keys alone)
        return {}


def _strip_seed(name: str) -> str:
    import re

    return re.sub(r"[-_]s(eed)?-?\d+$", "", name)


def seed_groups(runs: list[Run]) -> list[SeedGroup]:
    """Group runs that differ only in their seed, in first-seen order; the label is the run
    name without a ``-s<seed>`` suffix."""
    groups: dict[str, SeedGroup] = {}
    for r in runs:
        g = groups.setdefault(_group_key(r), SeedGroup(_strip_seed(r.name), []))
        g.runs.append(r)
    return list(groups.values())


def _pm(ms: tuple[float, float], digits: int = 3, sign: bool = False) -> str:
    m, s = ms
    return "n/a" if math.isnan(m) else f"{m:{'+' if sign else ''}.{digits}f} ± {s:.{digits}f}"


def seed_table(groups: list[SeedGroup], metric: str = "accuracy", last: int = 5) -> str:
    """One row per experiment: mean ± std over its seeds (final, best, last-``last`` mean)."""
    vary = [k for k in varying_keys([g.runs[0] for g in groups]) if k not in _SEED_KEYS]   # (the seeds column)
    attack = _has_attack([r for g in groups for r in g.runs])
    head = ["row", "algo", *vary, "seeds", f"final {metric}", f"best {metric}", f"last-{last} mean",
            "rounds", "wall time / run", *([c for _, c, _ in ATTACK_COLUMNS] if attack else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        st = g.stats(metric, last)
        wall = "n/a" if math.isnan(st["wall"][0]) else f"{st['wall'][0]:.0f} s"
        cells = [g.label, str(g.config.get("algo", "?")), *(_fmt(g.config.get(k, "")) for k in vary),
                 ",".join(str(s) for s in st["seeds"]), _pm(st["final"]), _pm(st["best"]), _pm(st["last"]),
                 str(st["rounds"]) + (" (stopped at stop-accuracy)" if g.stopped else ""), wall,
                 *([_pm(st["attack"][k], d) for k, _, d in ATTACK_COLUMNS] if attack else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def target_table(groups: list[SeedGroup], target: float, metric: str = "accuracy", reference: str = "") -> str:
    """Time and bytes to ``target`` per experiment: how many seeds reach it, and over those the
    mean ± std of the round, the time (simulated minutes where the runs were timed by a system,
    else wall seconds) and the MB exchanged; the last two columns compare each row with the row
    labelled ``reference`` (default: the first; a paper's own method comes first) seed by seed:
    the geometric mean, over the seeds on which both reached the target, of the row's time (MB)
    over the reference's, and those seeds (above 1, the reference is faster or moves fewer
    bytes). Means over different seeds would compare different draws of the data."""
    sim = any(r.has_sim for g in groups for r in g.runs)
    unit, scale = ("simulated min", 60.0) if sim else ("wall s", 1.0)
    stats = []
    for g in groups:
        hits = [h for h in (r.to_target(target, metric) for r in g.runs) if h is not None]
        stats.append((g, hits, _mean_std([h["seconds"] / scale for h in hits])))
    labels = [g.label for g, _, _ in stats]
    if reference and reference not in labels:
        raise ValueError(f"reference={reference!r} is not one of the rows: {', '.join(labels)}")
    ref = labels.index(reference) if reference else 0
    first = labels[ref] if stats else ""

    def by_seed(g: SeedGroup) -> dict[Any, dict[str, float]]:
        return {r.config.get("seed"): h for r in g.runs if (h := r.to_target(target, metric)) is not None}

    ref_hits = by_seed(stats[ref][0]) if stats else {}

    def ratios(g: SeedGroup) -> tuple[str, str]:
        hits = by_seed(g)
        seeds = sorted((s for s in hits if s in ref_hits), key=str)
        if not seeds:
            return "n/a (no seed both reached)", "n/a"
        seed_note = f" (seeds {','.join(map(str, seeds))})"

        def geo(key: str) -> str:
            logs = [math.log(hits[s][key] / ref_hits[s][key]) for s in seeds
                    if hits[s][key] > 0 and ref_hits[s][key] > 0]
            return f"{math.exp(sum(logs) / len(logs)):.2f}x{seed_note}" if len(logs) == len(seeds) else "n/a"
        return geo("seconds"), geo("bytes")

    head = ["row", "algo", f"seeds reaching {metric} {target:g}", "round", f"time ({unit})",
            "MB exchanged", f"time / {first}'s", f"MB / {first}'s"]
    lines = [f"Time and bytes to {metric} >= {target:g}" + (" (simulated system: "
             + ", ".join(sorted({str(r.config.get('system', '?')) for g in groups for r in g.runs})) + ")"
             if sim else " (wall time)") + ":\n", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g, hits, t in stats:
        rnd = _mean_std([h["round"] for h in hits])
        mb = _mean_std([h["bytes"] / 1e6 for h in hits])
        lines.append("| " + " | ".join([g.label, str(g.config.get("algo", "?")), f"{len(hits)}/{len(g.runs)}",
                                        _pm(rnd, 1), _pm(t, 2), _pm(mb, 1), *ratios(g)]) + " |")
    return "\n".join(lines) + "\n"


def round_cost_table(groups: list[SeedGroup]) -> str:
    """Where the simulated time of a round goes, per row (runs timed by a system only): the
    simulated seconds and the MB of an average round (mean ± std over the seeds), and the share
    of the simulated time the nodes' links took (the rest: the slowest node's compute in each
    exchange, ``sim-node-compute-seconds``, and the server's, ``sim-server-seconds``). Empty
    where no run was timed."""
    lines = []
    for g in groups:
        per_s, per_mb, link = [], [], []
        for r in g.runs:
            timed = [row for row in r.rows if "sim-seconds" in row]
            if not timed:
                continue
            sim = sum(float(row["sim-seconds"]) for row in timed)
            work = sum(float(row.get("sim-node-compute-seconds", 0.0)) + float(row.get("sim-server-seconds", 0.0))
                       for row in timed)
            per_s.append(sim / len(timed))
            per_mb.append(sum(float(row.get("bytes.total", 0) or 0) for row in timed) / len(timed) / 1e6)
            link.append(1.0 - work / sim if sim > 0 else math.nan)
        if per_s:
            lines.append("| " + " | ".join([g.label, str(g.config.get("algo", "?")), str(len(per_s)),
                                            _pm(_mean_std(per_s), 1), _pm(_mean_std(per_mb), 1),
                                            _pm(_mean_std(link), 3)]) + " |")
    if not lines:
        return ""
    head = ["row", "algo", "runs", "simulated s / round", "MB / round", "share of the time on the links"]
    return ("Where a round's simulated time goes (every timed round of every run; mean ± std over the runs):\n\n"
            + "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n" + "\n".join(lines) + "\n")


def paired_table(groups: list[SeedGroup], reference: str, metric: str = "accuracy", last: int = 5) -> str:
    """Each row against the row labelled ``reference``, seed by seed: over the seeds both ran, the
    mean ± sample std of (row - reference) for the final value and the last-``last`` mean, how many
    seeds the row is ahead on (final), and the paired t statistic of the final difference (mean /
    (std / sqrt n); |t| above 2.78 / 2.13 is the two-sided 5% level at 5 / 3 seeds). Rows whose runs
    stopped at ``stop-accuracy`` are left out."""
    labels = [g.label for g in groups]
    if reference not in labels:
        raise ValueError(f"reference={reference!r} is not one of the rows: {', '.join(labels)}")

    def per_seed(g: SeedGroup) -> dict[Any, tuple[float, float]]:
        out = {}
        for r in g.runs:
            vals = [v for _, v in r.series(metric)]
            if vals:
                out[r.config.get("seed")] = (vals[-1], sum(vals[-last:]) / len(vals[-last:]))
        return out

    ref = per_seed(groups[labels.index(reference)])
    head = ["row", "seeds paired", f"final - {reference}'s", f"last-{last} mean - {reference}'s",
            "seeds ahead (final)", "paired t (final)"]
    lines = [f"Paired differences against `{reference}`, seed by seed ({metric}):\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        if g.label == reference or g.stopped:   # a time-to-target row has no final value to pair
            continue
        mine = per_seed(g)
        seeds = [sd for sd in mine if sd in ref]
        d_final = [mine[sd][0] - ref[sd][0] for sd in seeds]
        d_last = [mine[sd][1] - ref[sd][1] for sd in seeds]
        m, sd_ = _mean_std(d_final)
        t = ("n/a" if len(seeds) < 2 or math.isnan(m) else
             ("inf" if sd_ == 0 and m != 0 else "0.00" if sd_ == 0 else f"{m / (sd_ / math.sqrt(len(seeds))):+.2f}"))
        lines.append("| " + " | ".join([g.label, ",".join(str(x) for x in seeds), _pm(_mean_std(d_final)),
                                        _pm(_mean_std(d_last)), f"{sum(d > 0 for d in d_final)}/{len(seeds)}",
                                        t]) + " |")
    return "\n".join(lines) + "\n"


def onset_table(runs: list[Run], metric: str = "accuracy", after: int = 3) -> str:
    """Where runs report the per-class histogram of the users' confident pseudo-labels
    (``pseudo-hist``, e.g. SSFL with label-metric consent): per run, the first round with a
    confident pseudo-label (the onset), how many classes it holds and the largest class's share,
    the classes held ``after`` rounds later, and ``metric`` just before the onset, at its lowest
    from the onset on, and at the end. A run with no confident pseudo-label shows "none"."""
    head = ["run", "onset round", "classes at onset", "main class : share", f"classes {after} rounds later",
            f"{metric} before onset", f"lowest {metric} from onset", f"final {metric}"]
    lines = [f"Onset of the first confident pseudo-labels ({metric}):\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        hist = [(int(row["round"]), row["pseudo-hist"]) for row in r.rows
                if isinstance(row.get("pseudo-hist"), list) and sum(row["pseudo-hist"]) > 0]
        acc = dict(r.series(metric))
        final = _num(acc[max(acc)], 3) if acc else "n/a"
        if not hist:
            lines.append("| " + " | ".join([r.name, "none", "", "", "", "", "", final]) + " |")
            continue
        t0, h0 = hist[0]
        later = dict(hist).get(t0 + after)
        main = max(range(len(h0)), key=lambda c: h0[c])
        before = acc.get(t0 - 1)
        if before is None and r.rows and isinstance(r.rows[0].get("warm-accuracy"), (int, float)):
            before = float(r.rows[0]["warm-accuracy"])   # onset in round 1: the warm-started model's
        low = min((v for k, v in acc.items() if k >= t0), default=math.nan)
        lines.append("| " + " | ".join([
            r.name, str(t0), str(sum(v > 0 for v in h0)), f"{main} : {h0[main] / sum(h0):.2f}",
            "n/a" if later is None else str(sum(v > 0 for v in later)),
            "n/a" if before is None else _num(before, 3), _num(low, 3), final]) + " |")
    return "\n".join(lines) + "\n"


def mean_cost_curve(g: SeedGroup, metric: str = "accuracy") -> tuple[list[float], list[float], list[float]]:
    """Per round all seeds reached: mean time (:meth:`Run.clock`), mean cumulative MB and mean ``metric``."""
    per = []
    for r in g.runs:
        acc = dict(r.series(metric))
        rounds = [int(x["round"]) for x in r.rows]
        per.append({k: (t, b / 1e6, acc[k]) for k, t, b in zip(rounds, r.clock(), r.cumulative_bytes())
                    if k in acc})
    per = [p for p in per if p]
    if not per:
        return [], [], []
    common = sorted(set.intersection(*(set(p) for p in per)))
    mean = [tuple(sum(p[k][i] for p in per) / len(per) for i in range(3)) for k in common]
    return [m[0] for m in mean], [m[1] for m in mean], [m[2] for m in mean]


def plot_cost(groups: list[SeedGroup], out: Path, metric: str = "accuracy", title: str = "",
              target: float | None = None) -> Path:
    """Mean ``metric`` (over seeds) against time (simulated minutes where the runs were timed by a
    system, else wall seconds) and against cumulative MB exchanged; ``target`` as a line."""
    sim = any(r.has_sim for g in groups for r in g.runs)
    scale = 60.0 if sim else 1.0
    fig, (a1, a2) = _pyplot().subplots(1, 2, figsize=(11, 4))
    for g in groups:
        t, mb, acc = mean_cost_curve(g, metric)
        if not t:
            continue
        a1.plot([x / scale for x in t], acc, marker=".", label=f"{g.label} (n={len(g.runs)})")
        a2.plot(mb, acc, marker=".", label=g.label)
    for ax in (a1, a2):
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_ylabel(f"test {metric}"), ax.grid(alpha=0.3)
    a1.set_xlabel("simulated minutes" if sim else "wall seconds")
    a2.set_xlabel("cumulative MB exchanged")
    a1.legend(fontsize=8)
    fig.suptitle(title or f"{metric} against time and bytes")
    return _save(fig, out)


def plot_seed_groups(groups: list[SeedGroup], out: Path, metric: str = "accuracy", title: str = "") -> Path:
    """Mean curve per experiment with a ±1 std band over its seeds."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.2))
    for g in groups:
        rounds, mean, std = g.mean_curve(metric)
        if not rounds:
            continue
        (line,) = ax.plot(rounds, mean, marker=".", label=f"{g.label} (n={len(g.runs)})")
        ax.fill_between(rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        color=line.get_color(), alpha=0.2)
    round_axis(ax), ax.set_ylabel(f"test {metric}" if metric.endswith("accuracy") and "pseudo" not in metric
                                  else metric), ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or f"{metric}: mean ± std over seeds")
    return _save(fig, out)


def plot(runs: list[Run], out: Path, metric: str = "accuracy", title: str = "") -> Path:
    fig, (a1, a2) = _pyplot().subplots(1, 2, figsize=(11, 4))
    for r in runs:
        s = r.series(metric)
        if not s:
            continue
        rounds, vals = zip(*s)
        a1.plot(rounds, vals, marker=".", label=r.name)
        cum = dict(zip((int(x["round"]) for x in r.rows), r.cumulative_bytes()))
        a2.plot([cum.get(k, math.nan) / 1e6 for k in rounds], vals, marker=".", label=r.name)
    round_axis(a1), a1.set_ylabel(f"test {metric}"), a1.grid(alpha=0.3)
    a2.set_xlabel("cumulative MB exchanged"), a2.set_ylabel(f"test {metric}"), a2.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle(title or f"{metric} of {len(runs)} runs")
    return _save(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flower-ssl-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders, or folders holding run folders")
    ap.add_argument("--out", default="report.md", help="markdown table to write ('-' = stdout only)")
    ap.add_argument("--figure", default="report.png", help="figure to write ('' = none)")
    ap.add_argument("--metric", default="accuracy", help="per-round metric to compare (default: accuracy)")
    ap.add_argument("--title", default="", help="figure title")
    ap.add_argument("--by-seed", action="store_true",
                    help="one row per experiment: runs that differ only in seed become mean ± std")
    ap.add_argument("--target", type=float, default=None,
                    help="add the time (simulated where the runs chose a system) and bytes to this accuracy, "
                         "and a figure of accuracy against time and bytes (<figure>-cost.png)")
    ap.add_argument("--reference", default="",
                    help="with --target: the row (a run or seed-group label) the time and bytes are divided by")
    ap.add_argument("--onset", action="store_true",
                    help="a table of when the users' first confident pseudo-labels appear, over how many classes "
                         "(runs that report pseudo-hist, e.g. SSFL), and the accuracy around it")
    ap.add_argument("--paired", default="",
                    help="with --by-seed: a table of every row's per-seed differences from this row")
    ap.add_argument("--at-round", type=int, nargs="+", default=[], metavar="R",
                    help="a table of every run's metric at these rounds (runs of unequal length)")
    args = ap.parse_args(argv)
    try:
        runs = find_runs(args.runs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    groups = seed_groups(runs) if args.by_seed else None
    table = seed_table(groups, args.metric) if groups else markdown_table(runs, args.metric)
    cost_groups = groups or [SeedGroup(r.name, [r]) for r in runs]
    if args.target is not None:
        try:
            table += "\n" + target_table(cost_groups, args.target, args.metric, args.reference)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.at_round:
        table += "\n" + at_round_table(runs, args.at_round, args.metric)
    if args.onset:
        table += "\n" + onset_table(runs, args.metric)
    if args.paired:
        if not groups:
            print("error: --paired needs --by-seed", file=sys.stderr)
            return 2
        try:
            table += "\n" + paired_table(groups, args.paired, args.metric)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(table, end="")
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    if args.figure:
        if groups:
            plot_seed_groups(groups, Path(args.figure), args.metric, args.title)
        else:
            plot(runs, Path(args.figure), args.metric, args.title)
        if args.target is not None or any(r.has_sim for r in runs):
            fig = Path(args.figure)
            plot_cost(cost_groups, fig.with_name(fig.stem + "-cost" + fig.suffix), args.metric, args.title,
                      args.target)
    return 0


if __name__ == "__main__":
    from flower_apps.cli import run

    run(main)
