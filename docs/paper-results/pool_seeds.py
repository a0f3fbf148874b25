"""Three of issue 29's Fashion-MNIST comparisons at 5 seeds, from what survives of each seed.

Seeds 0-2 of these rows ran on 2026-11-25/26 on a machine that is gone with their run folders; what
survives is the committed report of those seeds (mean ± std, paired differences, and for SSFL each
run's final accuracy in its onset table, 3 decimals). Seeds 3-4 ran on 2026-11-26 (ninth session);
their run folders are committed under ``runs/`` (``config.json``, ``metrics.jsonl``,
``partition.json``: what ``flower_apps.report`` reads). Both sets ran the same configuration (keys
added in between at their defaults) on code whose random streams moved slightly in between: a rerun
of a seed-0-2 run today follows the same course, not the same digits (docs/ssfl.md gives the check).

    python docs/paper-results/pool_seeds.py ssfl      # SSFL's design ablation, 10 rows
    python docs/paper-results/pool_seeds.py semisfl   # Semi-SFL's full-model baselines at 500 labels
    python docs/paper-results/pool_seeds.py scala     # SCALA's Table III: FedLC against FedAvg

``ssfl``: every run's final accuracy is known, so the 5-seed statistics are computed from the values.
``semisfl``, ``scala``: seeds 0-2 survive as mean ± sample std (of each row, and of each row's paired
difference from the reference), so the 5-seed mean and sample std are pooled from those and the two new values
(exact up to the 3 printed decimals).
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from flower_apps.report import _mean_std, find_runs

HERE = Path(__file__).parent

SSFL_ROWS = ["supervised-only-gn", "ssfl-gn", "ssfl-bn", "ssfl-gn-s2", "ssfl-selftrain-gn", "ssfl-gn-cutout7",
             "ssfl-afo", "ssfl-afo-warm", "ssfl-gn-warm", "ssfl-gn-warm-cutout7"]
#: (row, reference): the claim each pair tests
SSFL_PAIRS = [(r, "supervised-only-gn") for r in SSFL_ROWS[1:]] + [
    ("ssfl-gn", "ssfl-bn"),                     # GN > BN
    ("ssfl-gn", "ssfl-selftrain-gn"),           # CRL >> self-training
    ("ssfl-gn-s2", "ssfl-gn"),                  # grouping recovers part of the gap
    ("ssfl-gn-cutout7", "ssfl-gn"),             # (a) does not depend on the Cutout size
    ("ssfl-gn-warm-cutout7", "ssfl-gn-warm"),   # (b) does, in part
    ("ssfl-afo-warm", "ssfl-gn-warm"),          # (b) without normalisation
]
SEMISFL_ROWS = ["semifl", "fedswitch", "fedmatch", "supervised-only-x4"]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _pm(s: str) -> tuple[float, float]:
    m, sd = s.split("±")
    return float(m), float(sd)


def _t(m: float, sd: float, n: int) -> str:
    if n < 2:
        return "n/a"
    return "inf" if sd == 0 and m != 0 else "0.00" if sd == 0 else f"{m / (sd / math.sqrt(n)):+.2f}"


def pooled(n1: int, m1: float, s1: float, xs: list[float]) -> tuple[int, float, float]:
    """n, mean and sample std of a group known by (n1, mean m1, sample std s1) joined with ``xs``."""
    n = n1 + len(xs)
    m = (n1 * m1 + sum(xs)) / n
    ss = (n1 - 1) * s1 ** 2 + n1 * m1 ** 2 + sum(x * x for x in xs)
    return n, m, math.sqrt(max(ss - n * m * m, 0.0) / (n - 1))


def run_finals(folder: Path, last: int = 1) -> dict[tuple[str, int], float]:
    """``(row, seed) -> final accuracy`` (``last`` > 1: the mean of the last ``last`` rounds') of
    the finished runs in ``folder``."""
    out = {}
    for r in find_runs([folder]):
        m = re.fullmatch(r"(.+)-s(\d+)", r.name)
        s = [a for _, a in r.series("accuracy")]
        if m and s and r.series("accuracy")[-1][0] >= int(r.config.get("num-rounds", 0)):
            out[(m.group(1), int(m.group(2)))] = sum(s[-last:]) / len(s[-last:])
    return out


def ssfl(report: Path, runs: Path) -> None:
    finals = {}
    for line in report.read_text().splitlines():   # the onset table: one row per run, final last
        c = _cells(line)
        m = re.fullmatch(r"(.+)-s(\d+)", c[0]) if len(c) == 8 else None
        if m and m.group(1) in SSFL_ROWS:
            finals[(m.group(1), int(m.group(2)))] = float(c[-1])
    finals.update({k: v for k, v in run_finals(runs).items() if k[0] in SSFL_ROWS and k[1] >= 3})
    print("| row | seeds | final accuracy | per seed |\n|---|---|---|---|")
    for row in SSFL_ROWS:
        seeds = sorted(s for r, s in finals if r == row)
        vals = [finals[(row, s)] for s in seeds]
        m, sd = _mean_std(vals)
        print(f"| {row} | {','.join(map(str, seeds))} | {m:.3f} ± {sd:.3f} | "
              + " / ".join(f"{v:.3f}" for v in vals) + " |")
    print("\n| row - reference | seeds paired | final, paired | seeds ahead | paired t |\n|---|---|---|---|---|")
    for row, ref in SSFL_PAIRS:
        seeds = sorted(s for r, s in finals if r == row and (ref, s) in finals)
        d = [finals[(row, s)] - finals[(ref, s)] for s in seeds]
        m, sd = _mean_std(d)
        print(f"| {row} - {ref} | {','.join(map(str, seeds))} | {m:+.3f} ± {sd:.3f} | "
              f"{sum(x > 0 for x in d)}/{len(d)} | {_t(m, sd, len(d))} |")


def seed_table(report: Path) -> dict[str, tuple[int, float, float, float, float]]:
    """``row -> (seeds, final mean, final std, last-5 mean, last-5 std)`` from a report's seed table
    (the columns found by the header's names)."""
    out, cols = {}, None
    for line in report.read_text().splitlines():
        c = _cells(line)
        if "seeds" in c and "final accuracy" in c and "last-5 mean" in c:
            cols = (c.index("seeds"), c.index("final accuracy"), c.index("last-5 mean"), len(c))
        elif cols and len(c) == cols[3] and "±" in c[cols[1]]:
            out[c[0]] = (len(c[cols[0]].split(",")), *_pm(c[cols[1]]), *_pm(c[cols[2]]))
        elif not line.strip():
            cols = None
    return out


def paired_table(report: Path) -> dict[str, tuple[int, float, float, int]]:
    """``row -> (seeds, mean, std, seeds ahead)`` of the final differences in a report's paired table."""
    out = {}
    for line in report.read_text().splitlines():
        c = _cells(line)
        if len(c) == 6 and re.fullmatch(r"\d+/\d+", c[4]) and "±" in c[2]:
            ahead, n = map(int, c[4].split("/"))
            out[c[0]] = (n, *_pm(c[2]), ahead)
    return out


def pooled_rows(rows: dict, paired: dict, reference: str, names: list[str], runs: Path) -> None:
    """Print each row of ``names`` at 5 seeds: its committed 3-seed statistics (``rows``) and its
    paired difference from ``reference`` (``paired``) pooled with the seed-3/4 values in ``runs``."""
    new, new5 = run_finals(runs), run_finals(runs, last=5)
    print(f"| row | seeds | final accuracy | last-5 mean | seeds 3, 4 (final) | final - {reference}'s, paired "
          "| seeds ahead | paired t |")
    print("|---|---|---|---|---|---|---|---|")
    for row in [reference] + names:
        xs = [new[(row, s)] for s in (3, 4) if (row, s) in new]
        n, m, sd, m5, sd5 = rows[row]
        if n < 5:
            n, m, sd = pooled(n, m, sd, xs)
            _, m5, sd5 = pooled(rows[row][0], m5, sd5, [new5[(row, s)] for s in (3, 4) if (row, s) in new5])
        if row == reference:
            print(f"| {row} | {n} | {m:.3f} ± {sd:.3f} | {m5:.3f} ± {sd5:.3f} | "
                  + ("rerun: " if rows[row][0] >= 5 else "") + " / ".join(f"{x:.3f}" for x in xs) + " |  |  |  |")
            continue
        d = [new[(row, s)] - new[(reference, s)] for s in (3, 4) if (row, s) in new and (reference, s) in new]
        pn, pm, psd, ahead = paired[row]
        dn, dm, dsd = pooled(pn, pm, psd, d)
        print(f"| {row} | {n} | {m:.3f} ± {sd:.3f} | {m5:.3f} ± {sd5:.3f} | " + " / ".join(f"{x:.3f}" for x in xs)
              + f" | {dm:+.3f} ± {dsd:.3f} | {ahead + sum(x > 0 for x in d)}/{dn} | {_t(dm, dsd, dn)} |")


def semisfl(report: Path, runs: Path) -> None:
    """Semi-SFL's full-model baselines and ``supervised-only-x4`` against ``semisfl`` (whose committed
    row already has 5 seeds: shown as committed, its seeds 3-4 rerun beside the baselines)."""
    pooled_rows(seed_table(report), paired_table(report), "semisfl", SEMISFL_ROWS, runs)


#: FedLC - FedAvg on seeds 0-2, as docs/split.md ("Off the ceiling: SCALA's Table III") records it
#: (the committed report pairs every row with ``scala`` only): n, mean, sample std, seeds ahead
SCALA_FEDLC_FEDAVG_S012 = (3, 0.004, 0.016, 2)


def scala(report: Path, runs: Path) -> None:
    """SCALA's Table III claim FedLC > FedAvg (+8.6 points in the paper)."""
    pooled_rows(seed_table(report), {"fedlc": SCALA_FEDLC_FEDAVG_S012}, "fedavg", ["fedlc"], runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("comparison", choices=["ssfl", "semisfl", "scala"])
    ap.add_argument("--report", type=Path, help="seeds 0-2's committed report (default: <comparison>-fmnist.md)")
    ap.add_argument("--runs", type=Path, help="seeds 3-4's run folders (default: runs/<comparison>-fmnist)")
    a = ap.parse_args()
    report = a.report or HERE / f"{a.comparison}-fmnist.md"
    runs = a.runs or HERE / "runs" / f"{a.comparison}-fmnist"
    {"ssfl": ssfl, "semisfl": semisfl, "scala": scala}[a.comparison](report, runs)


if __name__ == "__main__":
    main()
