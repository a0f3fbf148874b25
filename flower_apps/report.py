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
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flower_apps.results import CONFIG, METRICS

# keys that differ between runs but say nothing about the experiment
_IGNORED_KEYS = {"run-name", "results-dir", "resume", "round-timeout"}


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

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
    return Run(p, cfg, rows)


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


def markdown_table(runs: list[Run], metric: str = "accuracy") -> str:
    vary = varying_keys(runs)
    head = ["run", "algo", *vary, f"final {metric}", f"best {metric} (round)", "rounds", "bytes", "wall time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s = r.summary(metric)
        best = "n/a" if s["best_round"] is None else f"{s['best']:.4f} ({s['best_round']})"
        final = "n/a" if math.isnan(s["final"]) else f"{s['final']:.4f}"
        wall = "n/a" if math.isnan(s["wall"]) else f"{s['wall']:.0f} s"
        cells = [r.name, str(r.config.get("algo", "?")), *(_fmt(r.config.get(k, "")) for k in vary),
                 final, best, str(s["rounds"]), _fmt_bytes(s["bytes"]), wall]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], out: Path, metric: str = "accuracy", title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        s = r.series(metric)
        if not s:
            continue
        rounds, vals = zip(*s)
        a1.plot(rounds, vals, marker=".", label=r.name)
        cum = dict(zip((int(x["round"]) for x in r.rows), r.cumulative_bytes()))
        a2.plot([cum.get(k, math.nan) / 1e6 for k in rounds], vals, marker=".", label=r.name)
    a1.set_xlabel("round"), a1.set_ylabel(f"test {metric}"), a1.grid(alpha=0.3)
    a2.set_xlabel("cumulative MB exchanged"), a2.set_ylabel(f"test {metric}"), a2.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle(title or f"{metric} of {len(runs)} runs")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flower-ssl-report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders, or folders holding run folders")
    ap.add_argument("--out", default="report.md", help="markdown table to write ('-' = stdout only)")
    ap.add_argument("--figure", default="report.png", help="figure to write ('' = none)")
    ap.add_argument("--metric", default="accuracy", help="per-round metric to compare (default: accuracy)")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args(argv)
    try:
        runs = find_runs(args.runs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(runs, args.metric)
    print(table, end="")
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    if args.figure:
        plot(runs, Path(args.figure), args.metric, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
