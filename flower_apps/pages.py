"""Results pages: one markdown page per paper, generated from the run folders committed beside it.

    python -m flower_apps.papers semisfl --page      # docs/paper-results/semisfl.md (+ .png)

A page is a function of the run folders under ``docs/paper-results/runs/<paper>-<dataset>/``
(each run's ``config.json`` and ``metrics.jsonl``) and of the paper's tables
``conf/papers/<paper>.toml``, read by :func:`flower_apps.papers.papers` (its tables, the numbers
the paper reports, its claims):

* **Claims**: for every claim "row A beats row B", the paired difference of the final accuracy
  over the seeds both rows ran, the seeds A is ahead on, the paired t statistic and a verdict
  (:func:`verdict`) beside what the paper reports; one more set of columns per budget of the
  paper's (``[budgets.<name>]``) with committed runs in ``runs/<paper>-<dataset>-<name>/``;
* **The paper's tables**: every method of the paper's tables with the paper's number and ours
  (mean ± sample std over the committed seeds), or "not regenerable" where no run folder of its
  row is committed, with the command that reruns it; a row marked ``reconstruction`` in the
  paper's table is tagged "(reconstruction)";
* **Every committed row**: :func:`flower_apps.report.seed_table` (final, best and last-5 mean),
  the paired table against the paper's own method, the onset table where runs logged
  pseudo-label histograms, a figure of the mean accuracy (``<paper>.png``) and one per metric of
  :data:`CURVES` some run reports (``<paper>-<metric>.png``).
* **At the budget `<name>`**, one section per such budget (:func:`budget_section`): its rows,
  the paired table, the time and bytes to the target it fixed before its runs, the paper's time
  claims judged there (:func:`time_claim_table`), and figures per metric
  (``<paper>-<name>-<metric>.png``: accuracy and the :data:`CURVES` its runs report).

Nothing on a page is typed by hand: ``tests/test_results_pages.py`` regenerates every page and
fails when the committed one differs.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from flower_apps.report import (SeedGroup, _mean_std, _pm, onset_table, paired_table, plot_seed_groups, read_run,
                                round_cost_table, seed_groups, seed_table, target_table)

if TYPE_CHECKING:
    from flower_apps.papers import Claim, Paper

#: two-sided 5% critical values of Student's t, by degrees of freedom (1-30)
T_CRIT = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
          2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
          2.045, 2.042)

DOCS = Path("docs") / "paper-results"


def runs_dir(paper: str, dataset: str = "fashion-mnist", root: Path = DOCS) -> Path:
    """Where a paper's committed run folders live."""
    return root / "runs" / f"{paper}-{'fmnist' if dataset == 'fashion-mnist' else dataset}"


def t_critical(df: int) -> float:
    """The two-sided 5% critical value of Student's t at ``df`` degrees of freedom (1.96 beyond 30)."""
    return T_CRIT[df - 1] if 1 <= df <= len(T_CRIT) else 1.96


def verdict(diffs: list[float]) -> str:
    """The verdict on "A beats B" from the paired differences A - B over seeds:

    * ``reproduced``: A ahead on average and the paired t at or above the two-sided 5% level;
    * ``in direction only``: A ahead on average, not significant at that level (or one seed);
    * ``not reproduced``: A not ahead on average; ``(reversed, significant)`` is added where B is
      ahead at the 5% level;
    * ``no committed runs`` where no seed has both rows.
    """
    n = len(diffs)
    if n == 0:
        return "no committed runs"
    m, s = _mean_std(diffs)
    t = paired_t(diffs)
    if m > 0:
        return "reproduced" if n >= 2 and t >= t_critical(n - 1) else "in direction only"
    return "not reproduced" + (" (reversed, significant)" if n >= 2 and t <= -t_critical(n - 1) else "")


def paired_t(diffs: list[float]) -> float:
    """mean / (sample std / sqrt n) of the differences (inf where they are all equal and non-zero)."""
    m, s = _mean_std(diffs)
    if len(diffs) < 2 or math.isnan(m):
        return math.nan
    if s == 0:
        return 0.0 if m == 0 else math.copysign(math.inf, m)
    return m / (s / math.sqrt(len(diffs)))


def _finals(g: SeedGroup | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in (g.runs if g else []):
        s = r.series("accuracy")
        if s:
            out[int(r.config.get("seed", 0))] = s[-1][1]
    return out


def claim_cells(claim: Claim, by_label: dict[str, SeedGroup]) -> list[str]:
    """A claim judged on one set of runs: A - B (final), seeds A ahead, paired t, verdict."""
    a, b = _finals(by_label.get(claim.better)), _finals(by_label.get(claim.worse))
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    missing = [r for r in (claim.better, claim.worse) if r not in by_label]
    if missing:
        return [f"not regenerable: no committed runs of {', '.join(f'`{r}`' for r in missing)}", "", "",
                "not regenerable"]
    stopped = [r for r in (claim.better, claim.worse) if by_label[r].stopped]
    if stopped:
        return [f"time-to-target runs of {', '.join(f'`{r}`' for r in stopped)} (stopped at stop-accuracy): "
                "no final accuracy", "", "", "not judged"]
    t = paired_t(diffs)
    m, sd = _mean_std(diffs)
    return [f"{m:+.3f} ± {sd:.3f} (seeds {','.join(map(str, seeds))})",
            f"{sum(d > 0 for d in diffs)}/{len(diffs)}", "n/a" if math.isnan(t) else f"{t:+.2f}", verdict(diffs)]


def claim_row(claim: Claim, by_label: dict[str, SeedGroup], *more: dict[str, SeedGroup]) -> list[str]:
    """One line of the claims table: the claim judged on ``by_label``'s runs, then on each of
    ``more`` (the runs of the paper's other budgets)."""
    return [claim.text, claim.paper, *claim_cells(claim, by_label),
            *(c for other in more for c in claim_cells(claim, other))]


def budget_folder(folder: Path, budget: str) -> Path:
    """Where the committed runs of the paper's budget ``budget`` live, beside its dataset's."""
    return folder.parent / f"{folder.name}-{budget}"


#: the per-round metrics a budget's section plots beside accuracy, where its runs logged them
#: (Semi-SFL's teacher: mask rate, pseudo-label accuracy with node consent, the labeled steps K_s;
#: UM-pFSSL's pseudo-labels by source: the client's own model and its helpers)
CURVES = ("mask-rate", "pseudo-label-accuracy", "ks", "pseudo-label-accuracy-self", "pseudo-label-accuracy-helpers")


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(r) + " |" for r in rows)]) + "\n"


def _row_cell(paper: Paper, name: str) -> str:
    """A row as the paper's tables show it: its name, tagged "(reconstruction)" where the paper's
    table marks it one (``Row.reconstruction``: a method rebuilt from partial sources,
    ``docs/baselines.md``), so that its number is not read as the original's."""
    row = paper.rows_by_name.get(name)
    return f"`{name}`" + (" (reconstruction)" if row is not None and row.reconstruction else "")


def _settings_line(paper: Paper, dataset: str) -> str:
    """The paper's settings in words; on a dataset's budget, these are the base comparison's, so the
    line names the keys the budget sets over them (where the two disagree, the budget holds)."""
    over = paper.datasets[dataset].overrides if dataset in paper.datasets else {}
    if not over:
        return f"Settings: {paper.settings}.\n"
    keys = ", ".join(f"`{k} = {v!r}`" for k, v in over.items())
    return (f"Settings of the base comparison, under the budget above, which sets {keys} over them: "
            f"{paper.settings}.\n")


def results_page(paper: Paper, folder: Path, dataset: str = "fashion-mnist", figure: str = "") -> tuple[str, list]:
    """The page's markdown and the seed groups it was made of (for the figure)."""
    runs = [read_run(d) for d in sorted(folder.iterdir()) if (d / "metrics.jsonl").exists()] if folder.is_dir() else []
    groups = seed_groups(runs)
    by_label = {g.label: g for g in groups}
    rerun = f"python -m flower_apps.papers {paper.name} --dataset {dataset} --seeds 0 1 2 --rows"
    out = [f"# {paper.title}: results on {dataset}\n",
           f"Generated by `python -m flower_apps.papers {paper.name} --page` from the run folders in "
           + (f"[`docs/paper-results/runs/{folder.name}/`](runs/{folder.name}/)" if folder.is_dir() else
              f"`docs/paper-results/runs/{folder.name}/` (none committed yet)")
           + " (each run's `config.json` and `metrics.jsonl`); do not edit by hand. Accuracy is the test accuracy "
           "after the last round; mean ± sample std over the committed seeds.\n",
           f"Budget: {paper.datasets[dataset].settings}.\n" if dataset in paper.datasets else "",
           _settings_line(paper, dataset), f"The paper's ordering: {paper.expected}.\n"]
    budgets = budgets_of(paper, folder, dataset)
    if paper.claims:
        head = ["claim", "paper", "ours: A - B (final)", "seeds A ahead", "paired t", "verdict"]
        for name in budgets:
            head += [f"{name}: A - B (final)", f"{name}: seeds A ahead", f"{name}: paired t", f"{name}: verdict"]
        out += ["## Claims\n",
                "Verdict on \"A beats B\" from the paired differences of the final accuracy over the seeds both "
                "rows ran: *reproduced* where A is ahead and the paired t reaches the two-sided 5% level, *in "
                "direction only* where A is ahead without reaching it, *not reproduced* where A is not ahead."
                + (" The first columns are at the budget above; " + "; ".join(
                    f"`{n}` is the budget of its section below" for n in budgets) + "." if budgets else "") + "\n",
                _table(head, [claim_row(c, by_label, *(g for _, g in budgets.values())) for c in paper.claims])]
    lines = []
    for table, method, rows in paper.coverage():
        got = [r for r in rows if r in by_label]
        paper_num = paper.reported.get(method, "")
        if got:
            for r in got:
                st = by_label[r].stats()
                lines.append([table, method, paper_num, _row_cell(paper, r), _pm(st["final"]),
                              ",".join(str(s) for s in st["seeds"])])
        else:
            why = (f"not regenerable: no committed run folder (`{rerun} {' '.join(rows)}`)" if rows
                   else f"no row ({paper.missing.get(method, 'not implemented')})")
            lines.append([table, method, paper_num, ", ".join(_row_cell(paper, r) for r in rows), why, ""])
    out += ["## The paper's tables\n",
            "The paper's numbers are its own setting's (dataset and model as the paper states them), ours are "
            f"on {dataset} at the budget above: compare orderings, not values.\n",
            _table(["table", "method", "paper", "row", "ours: final accuracy", "seeds"], lines)]
    if groups:
        out += ["## Every committed row\n", seed_table(groups)]
        if paper.reference in by_label and len(groups) > 1:
            out.append("\n" + paired_table(groups, paper.reference))
        if any("pseudo-hist" in row for r in runs for row in r.rows):
            out.append("\n" + onset_table(runs))
        if figure:
            out.append(f"\n![mean accuracy per round, ±1 std over seeds]({figure})\n")
            for metric in curves_of(groups):
                out.append(f"\n![{metric} per round, mean ± std over seeds]({Path(figure).stem}-{metric}.png)\n")
    corrected = "\n".join(t for t in (corrected_table(paper, by_label), attacker_table(paper, by_label)) if t)
    if corrected:
        out += ["## Baselines corrected to their originals\n", corrected]
    for name, (bfolder, bgroups) in budgets.items():
        out.append(budget_section(paper, name, bfolder, bgroups, figure))
    notes = [f"* `{r.name}`: {r.note}" for r in paper.rows if r.note]
    if notes:
        out += ["## Rows\n", "\n".join(notes) + "\n"]
    return "\n".join(s for s in out if s), groups


def corrected_table(paper: Paper, by_label: dict[str, SeedGroup]) -> str:
    """Each row that names its ``former`` self (the same baseline as the library ran it before it
    was corrected to its original), beside it: both final accuracies, the paired difference
    (now - former) over the seeds both ran, and what changed (the former row's note). Empty where
    no row names one."""
    rows = []
    for r in (r for r in paper.rows if r.former):
        now, old = _finals(by_label.get(r.name)), _finals(by_label.get(r.former))
        seeds = sorted(set(now) & set(old))
        if not seeds:
            cells = ["no committed runs of both rows", "", ""]
        else:
            d = [now[s] - old[s] for s in seeds]
            m, sd = _mean_std(d)
            cells = [_pm(by_label[r.name].stats()["final"]), _pm(by_label[r.former].stats()["final"]),
                     f"{m:+.3f} ± {sd:.3f} (seeds {','.join(map(str, seeds))})"]
        rows.append([_row_cell(paper, r.name), cells[0], f"`{r.former}`", *cells[1:],
                     paper.rows_by_name[r.former].note])
    if not rows:
        return ""
    return ("Rows whose baseline the library once ran differently from its original, beside a probe row "
            "that reruns the former behaviour on the same seeds (final accuracy, mean ± sample std; "
            "the difference paired by seed).\n\n"
            + _table(["row", "now: final accuracy", "former (row)", "former: final accuracy",
                      "now - former (paired)", "what changed"], rows))


def attacker_table(paper: Paper, by_label: dict[str, SeedGroup]) -> str:
    """Each row whose runs also hold another attacker's record on the same final model
    (``attack-<name>.json``, ``python -m flower_apps.attack RUN --save-as <name>``) beside the
    default attacker's (``attack.json``): per attacker, MSE, SSIM and PSNR (mean ± sample std over
    the seeds that have both records), and the other's difference from the default, paired by
    seed. Empty where no run holds one."""
    from flower_apps.report import ATTACK_COLUMNS, OTHER_ATTACK_PREFIX

    lines = []
    for r in paper.rows:
        g = by_label.get(r.name)
        for name in sorted({n for run in (g.runs if g else []) for n in run.other_attacks}):
            both = [run for run in g.runs if run.attack and name in run.other_attacks]
            if not both:
                continue
            seeds = ",".join(str(run.config.get("seed", "?")) for run in both)

            def cells(att: str) -> list[str]:
                return [_pm(_mean_std([run.attack_value(k, att) for run in both]), d) for k, _, d in ATTACK_COLUMNS]

            diffs = [_pm(_mean_std([run.attack_value(k, name) - run.attack_value(k) for run in both]), d, sign=True)
                     for k, _, d in ATTACK_COLUMNS]
            lines.append([_row_cell(paper, r.name), f"{both[0].attack.get('decoder', '?')} (default)",
                          "`attack.json`", seeds, *cells(""), ""])
            lines.append([_row_cell(paper, r.name), str(both[0].other_attacks[name].get("decoder", "?")),
                          f"`{OTHER_ATTACK_PREFIX}{name}.json`", seeds, *cells(name), " / ".join(diffs)])
    if not lines:
        return ""
    return ("The inversion attacker: the default decoder's record on each run's final model beside another "
            "decoder's on the same model (`python -m flower_apps.attack RUN --save-as NAME`), mean ± sample std "
            "over the seeds that hold both; the last column is the other decoder's MSE / SSIM / PSNR minus the "
            "default's, paired by seed.\n\n"
            + _table(["row", "attacker (decoder)", "record", "seeds", *(c for _, c, _ in ATTACK_COLUMNS),
                      "other - default (paired)"], lines))


def budgets_of(paper: Paper, folder: Path, dataset: str) -> dict[str, tuple[Path, dict[str, SeedGroup]]]:
    """The paper's budgets on ``dataset`` that have committed runs: name -> (folder, groups by row)."""
    out = {}
    for name, b in paper.budgets.items():
        bfolder = budget_folder(folder, name)
        if b.dataset != dataset or not bfolder.is_dir():
            continue
        runs = [read_run(d) for d in sorted(bfolder.iterdir()) if (d / "metrics.jsonl").exists()]
        if runs:
            out[name] = (bfolder, {g.label: g for g in seed_groups(runs)})
    return out


def _times_to(g: SeedGroup | None, target: float) -> dict[int, tuple[float, bool]]:
    """Per seed: the time to ``target`` (simulated where the run was timed by a system), and
    whether the run reached it; one that did not counts its last round's time (a lower bound)."""
    out: dict[int, tuple[float, bool]] = {}
    for r in (g.runs if g else []):
        hit, clock = r.to_target(target), [t for t in r.clock() if not math.isnan(t)]
        if hit is not None:
            out[int(r.config.get("seed", 0))] = (hit["seconds"], True)
        elif clock:
            out[int(r.config.get("seed", 0))] = (clock[-1], False)
    return out


def _bounded_verdict(v: str, bound: str, missed: list[int]) -> str:
    """A time verdict where some seed's time is a bound (a row never reached the target): a bound
    supports a verdict only in its own direction. Where only B missed it (B's times are lower bounds)
    "A is sooner" stands but "B is significantly sooner" does not; where only A missed it (upper
    bounds), the reverse; where both did on some seed, neither significant verdict stands."""
    if not bound:
        return v
    on = f"a bound on seeds {','.join(map(str, missed))}"
    if v == "reproduced" and bound != ">= ":
        return f"in direction only ({on})"
    if v.endswith("(reversed, significant)") and bound != "<= ":
        return f"not reproduced ({on})"
    return v


def time_claim_table(paper: Paper, by_label: dict[str, SeedGroup], target: float) -> str:
    """The claims the paper makes in time to a target (``Claim.paper_time``), judged at ``target``:
    per seed both rows ran, the ratio of B's time to A's (a run that never reached the target
    counts its whole time, so a ratio over such a run is a bound: ">=" where only B missed it,
    "<=" where only A did); the verdict on "A reaches it sooner" from the paired differences of
    the log times, by the rule of the claims table (:func:`verdict`), where a bound supports only a
    verdict in its own direction (:func:`_bounded_verdict`)."""
    rows = []
    for c in (c for c in paper.claims if c.paper_time):
        a, b = _times_to(by_label.get(c.better), target), _times_to(by_label.get(c.worse), target)
        seeds = sorted(set(a) & set(b))
        if not seeds:
            rows.append([c.text, c.paper_time, "no committed runs of both rows", "", "", "not regenerable"])
            continue
        d = [math.log(b[s][0] / a[s][0]) for s in seeds if a[s][0] > 0 and b[s][0] > 0]
        missed = [s for s in seeds if not (a[s][1] and b[s][1])]
        if not missed:
            bound = ""
        elif all(a[s][1] for s in missed):    # only B missed it: B's time is at least this
            bound = ">= "
        elif all(b[s][1] for s in missed):    # only A missed it
            bound = "<= "
        else:
            bound = "~ "
        ratio = math.exp(sum(d) / len(d)) if d else math.nan
        reached = f"{sum(a[s][1] for s in seeds)}/{len(seeds)} and {sum(b[s][1] for s in seeds)}/{len(seeds)}"
        t = paired_t(d)
        rows.append([c.text, c.paper_time, f"{bound}{ratio:.2f}x (seeds {','.join(map(str, seeds))})", reached,
                     "n/a" if math.isnan(t) else f"{t:+.2f}", _bounded_verdict(verdict(d), bound, missed)])
    return (f"Time claims at accuracy {target:g}: B's time over A's, the geometric mean over the seeds both rows ran "
            "(above 1: A is sooner); a run that never reached the target counts its whole time, so that seed's ratio "
            "is a bound. Verdict on \"A is sooner\" from the paired differences of the log times, by the rule of "
            "the claims table; a bound supports only a verdict in its own direction.\n\n"
            + _table(["claim", "paper", "ours: B's time / A's", "seeds reaching it (A and B)", "paired t", "verdict"],
                     rows))


def budget_section(paper: Paper, name: str, folder: Path, by_label: dict[str, SeedGroup], figure: str) -> str:
    """The section of budget ``name``: its settings, every committed row (final, best, last-5
    mean), the paired table against the paper's own method, the time and bytes to the target it
    fixed before its runs, and figures of accuracy and of :data:`CURVES` per round."""
    b = paper.budgets[name]
    groups = list(by_label.values())
    keys = " ".join(f"{k}={v!r}" for k, v in b.overrides.items())
    seeds = sorted({int(r.config.get("seed", 0)) for g in groups for r in g.runs}) or [0, 1, 2]
    out = [f"## At the budget `{name}`\n",
           f"Run folders: [`docs/paper-results/runs/{folder.name}/`](runs/{folder.name}/), rerun with "
           f"`python -m flower_apps.papers {paper.name} --budget {name} --seeds {' '.join(map(str, seeds))}` "
           f"(the committed seeds; the keys `{keys}` over the "
           f"budget above). {b.settings}.\n", seed_table(groups)]
    if paper.reference in by_label and len(groups) > 1:
        out.append("\n" + paired_table(groups, paper.reference))
    if b.target is not None:
        ref = paper.reference if paper.reference in by_label else ""
        out.append("\nThe target was fixed before these runs. " + target_table(groups, b.target, reference=ref))
        cost = round_cost_table(groups)
        if cost:
            out.append("\n" + cost)
        if any(c.paper_time for c in paper.claims):
            out.append("\n" + time_claim_table(paper, by_label, b.target))
    stem = Path(figure).stem if figure else paper.name
    for metric in ("accuracy", *curves_of(groups)):
        if figure and any(r.series(metric) for g in groups for r in g.runs):
            out.append(f"\n![{metric} per round, mean ± std over seeds]({stem}-{name}-{metric}.png)\n")
    return "\n".join(out)


def curves_of(groups: list[SeedGroup]) -> list[str]:
    """The metrics of :data:`CURVES` some run of ``groups`` reports per round."""
    return [m for m in CURVES if any(r.series(m) for g in groups for r in g.runs)]


def write_page(paper: Paper, dataset: str = "fashion-mnist", root: Path = DOCS) -> Path:
    """Regenerate ``<root>/<paper>.md`` and its figure ``<root>/<paper>.png``; return the page's path."""
    folder = runs_dir(paper.name, dataset, root)
    md, png = root / f"{paper.name}.md", root / f"{paper.name}.png"
    text, groups = results_page(paper, folder, dataset, figure=png.name)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    if groups:
        plot_seed_groups(groups, png, title=f"{paper.name} on {dataset}: mean ± std over seeds")
        for metric in curves_of(groups):
            plot_seed_groups(groups, root / f"{paper.name}-{metric}.png", metric=metric,
                             title=f"{paper.name} on {dataset}: {metric}, mean ± std over seeds")
    elif png.exists():
        png.unlink()
    for name, (_, by_label) in budgets_of(paper, folder, dataset).items():
        for metric in ("accuracy", *curves_of(list(by_label.values()))):
            plot_seed_groups(list(by_label.values()), root / f"{paper.name}-{name}-{metric}.png", metric=metric,
                             title=f"{paper.name} on {dataset}, budget {name}: {metric}, mean ± std over seeds")
    return md
