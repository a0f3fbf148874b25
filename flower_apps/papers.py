"""One command per paper: rerun its comparison on the embedded data, several seeds, one table.

    python -m flower_apps.papers semisfl                  # all rows, seeds 0 1 2
    python -m flower_apps.papers fedshvr --seeds 0 1 2 3 4
    python -m flower_apps.papers scala --rows scala splitfed-v2 --engine simulation
    python -m flower_apps.papers scala --list             # its tables, each method's rows, settings
    python -m flower_apps.papers semisfl --set system=semisfl --target 0.95   # time and bytes to 95%
    python -m flower_apps.papers semisfl --page           # regenerate docs/paper-results/semisfl.md

Each paper's comparison (``conf/papers/<paper>.toml``, read into :class:`Paper`, :class:`Row`
and :class:`Claim`: :func:`papers`) is a set of rows (an ``algo`` and its keys) on a
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

The tables ship in the repository and the source distribution, not in the wheel: where they are
elsewhere, ``--tables DIR`` or ``FLOWER_SSL_PAPERS_DIR=DIR`` points to them.

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
    #: a method rebuilt from partial sources (docs/baselines.md): its results are tagged so
    reconstruction: bool = False
    #: the method(s) of the paper's tables this row reruns ("" = the row's name)
    label: str | tuple[str, ...] = ""
    #: a row that reruns this one as the library ran it before it was corrected to its original
    #: (a probe: its note says what changed); the results page puts the two side by side
    former: str = ""

    @property
    def methods(self) -> tuple[str, ...]:
        return (self.label,) if isinstance(self.label, str) and self.label else tuple(self.label) or (self.name,)


@dataclass(frozen=True)
class Budget:
    """A paper's comparison on another dataset (``[datasets.<name>]``), or a longer budget on one
    of those (``[budgets.<name>]``, over the dataset's): the base overrides and the budget in
    words; ``rows``: a row's own overrides on this dataset, where its budget scales with the data
    (over the row's keys, e.g. a shared set sized as a share of the users' data). A budget names
    its ``dataset`` and may fix an accuracy ``target`` before its runs (its page tabulates the
    time, simulated where a system is set, and the bytes to reach it)."""
    overrides: dict[str, Any]
    settings: str
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    dataset: str = ""
    target: float | None = None


@dataclass(frozen=True)
class Claim:
    """A claim of the paper that two of our rows test: ``better`` ends above ``worse``
    (:func:`flower_apps.pages.verdict` judges it from the paired seeds); ``paper``: what the
    paper reports for it, with its table and setting; ``paper_time``: what it reports for the
    same two methods in time to a target accuracy, where it does (judged at a budget that fixes
    a target: :func:`flower_apps.pages.time_claim_table`)."""
    text: str
    better: str
    worse: str
    paper: str
    paper_time: str = ""


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
    #: ``--budget NAME``: the comparison at another budget on one of :attr:`datasets` (e.g. more
    #: rounds), its runs and claims beside the dataset's own on the results page
    budgets: dict[str, Budget] = field(default_factory=dict)
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
        for name, b in self.budgets.items():
            lines.append(f"  --budget {name} (on {b.dataset}): {b.overrides} ({b.settings})"
                         + (f"; target {b.target}" if b.target is not None else ""))
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


# The tables themselves are data, not code: conf/papers/<paper>.toml in the repository (and the
# source distribution; not in the wheel). Each holds a paper's settings (optimizer, lr, schedule
# and batch sizes from the paper's hyperparameter tables; model family scaled down; rounds cut
# to fit a 2-core CPU sweep), its rows, tables, reported numbers and claims.
PAPERS_ENV = "FLOWER_SSL_PAPERS_DIR"   # the folder of the paper tables, where they are elsewhere


class PapersNotFound(FileNotFoundError):
    """No folder of paper tables (``<paper>.toml``) where they were looked for."""


def papers_dirs(tables: str | Path | None = None) -> list[Path]:
    """Where the paper tables are looked for, in order: ``tables`` (``--tables``) if given, else
    ``$FLOWER_SSL_PAPERS_DIR`` if set, else ``conf/papers`` of the source tree this module is
    in (a checkout or an editable install), then ``./conf/papers``."""
    if tables:
        return [Path(tables)]
    if os.environ.get(PAPERS_ENV):
        return [Path(os.environ[PAPERS_ENV])]
    return [Path(__file__).resolve().parents[1] / "conf" / "papers", Path("conf") / "papers"]


def find_papers_dir(tables: str | Path | None = None) -> Path:
    """The first of :func:`papers_dirs` that holds a ``<paper>.toml``; else :class:`PapersNotFound`
    saying where it looked and how to point elsewhere."""
    tried = papers_dirs(tables)
    for folder in tried:
        if folder.is_dir() and any(folder.glob("*.toml")):
            return folder
    raise PapersNotFound(
        f"no paper tables (<paper>.toml) in {', '.join(str(f.resolve()) for f in tried)}: they are in the "
        f"repository's and the source distribution's conf/papers/, not in the wheel; point to that folder with "
        f"--tables DIR or {PAPERS_ENV}=DIR")


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None


def load_paper(path: str | Path, data: dict[str, Any] | None = None) -> Paper:
    """One paper's tables from ``path`` (``<paper>.toml``; the file name is the paper's name), or
    from ``data``, the file already read: top-level :class:`Paper` fields, ``[base]``,
    ``[tables]`` (table -> methods), ``[reported]``, ``[missing]``, ``[[claims]]``
    (:class:`Claim`), ``[datasets.<name>]`` and ``[budgets.<name>]`` (:class:`Budget`; a budget's
    ``dataset`` must be one of the datasets) and ``[[rows]]`` (:class:`Row`);
    ``order`` places it in listings. A key none of them takes, or a file that is not TOML, is a
    ``ValueError`` naming the file."""
    path = Path(path)
    data = dict(_read_toml(path) if data is None else data)
    data.pop("order", None)
    try:
        rows = tuple(Row(**{**r, "label": tuple(r["label"]) if isinstance(r.get("label"), list) else
                            r.get("label", "")}) for r in data.pop("rows", []))
        paper = Paper(name=path.stem, rows=rows, claims=tuple(Claim(**{k.replace("-", "_"): v for k, v in c.items()})
                                                          for c in data.pop("claims", [])),
                      tables={t: tuple(ms) for t, ms in data.pop("tables", {}).items()},
                      datasets={n: Budget(**b) for n, b in data.pop("datasets", {}).items()},
                      budgets={n: Budget(**b) for n, b in data.pop("budgets", {}).items()}, **data)
    except TypeError as e:   # a key that no field takes (or a required one missing): the message names it
        raise ValueError(f"{path}: {e}; the keys allowed are the fields of flower_apps.papers' Paper, "
                         f"Row, Claim and Budget") from None
    for r in paper.rows:
        if r.former and (r.former == r.name or r.former not in paper.rows_by_name):
            raise ValueError(f"{path}: row {r.name!r} former={r.former!r} is not another row of the paper: "
                             f"{', '.join(n for n in paper.rows_by_name if n != r.name)}")
    for name, b in paper.budgets.items():
        if b.dataset not in paper.datasets:
            raise ValueError(f"{path}: [budgets.{name}] dataset={b.dataset!r} is not one of its [datasets.*]: "
                             f"{', '.join(paper.datasets) or 'none'}")
    return paper


def load_papers(tables: str | Path | None = None) -> dict[str, Paper]:
    """Every paper of the tables folder (:func:`find_papers_dir`), in their ``order`` (then by name)."""
    read = {f: _read_toml(f) for f in sorted(find_papers_dir(tables).glob("*.toml"))}
    first = sorted(read, key=lambda f: (read[f].get("order", len(read) + 1), f.stem))
    return {f.stem: load_paper(f, read[f]) for f in first}


_LOADED: dict[Path, dict[str, Paper]] = {}


def papers(tables: str | Path | None = None) -> dict[str, Paper]:
    """The papers' comparisons (read once per folder): ``flower_apps.papers.PAPERS`` is
    ``papers()``."""
    folder = find_papers_dir(tables).resolve()
    if folder not in _LOADED:
        _LOADED[folder] = load_papers(folder)
    return _LOADED[folder]


def __getattr__(name: str) -> Any:   # PAPERS: read from conf/papers when first asked for
    if name == "PAPERS":
        return papers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _last_metrics(folder: Path) -> dict[str, Any]:
    """The last line of ``folder``'s metrics.jsonl ({} where there is none)."""
    try:
        lines = [ln for ln in (folder / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return dict(json.loads(lines[-1])) if lines else {}
    except (OSError, ValueError):
        return {}


def _done_rounds(folder: Path) -> int:
    try:
        return int(_last_metrics(folder).get("round", 0))
    except (TypeError, ValueError):
        return 0


def _finished(folder: Path, num_rounds: int) -> bool:
    """The run in ``folder`` ran its ``num_rounds``, or stopped on reaching ``stop-accuracy``."""
    return _done_rounds(folder) >= num_rounds or (
        bool(_last_metrics(folder).get("stopped-at-target")) and (folder / "model.pt").exists())


def run_one(cfg: dict, explicit: set[str], supernodes: int, engine: str) -> Path:
    if engine == "simulation":
        from flower_apps.simulate import run_simulation_inprocess

        return run_simulation_inprocess(cfg, supernodes, explicit=explicit)
    from flower_apps.client_app import dispatch
    from flower_apps.server_app import run
    from split_layer.transport import LocalGrid

    return run(LocalGrid(supernodes, dispatch, run_config=cfg), cfg, explicit=explicit)


def run_paper(name: str | Paper, seeds=DEFAULT_SEEDS, out: Path | None = None, engine: str = "inprocess",
              rows: list[str] | None = None, rounds: int | None = None, log=print,
              sets: dict[str, Any] | None = None, target: float | None = None, paired: str = "",
              dataset: str = "", budget: str = "") -> Path:
    """Run every (row, seed) of paper ``name`` (a name of :func:`papers`, or a :class:`Paper`) that
    is not finished; write the report; return ``out``.
    ``dataset``: one of the paper's :attr:`Paper.datasets`, whose budget goes under ``sets``;
    ``budget``: one of :attr:`Paper.budgets` (on its own dataset), over the dataset's."""
    paper = name if isinstance(name, Paper) else papers()[name]
    name = paper.name
    row_sets: dict[str, dict[str, Any]] = {}
    user_sets = dict(sets or {})   # the report names them: they override the paper's settings text
    if budget:
        b = paper.budgets[budget]
        dataset = b.dataset
        sets = {**b.overrides, **(sets or {})}
        target = b.target if target is None else target
    if dataset:
        sets = {**paper.datasets[dataset].overrides, **(sets or {})}
        row_sets = paper.datasets[dataset].rows
    if budget:   # a row's keys at this budget over its keys on the dataset
        extra = paper.budgets[budget].rows
        row_sets = {r: {**row_sets.get(r, {}), **extra.get(r, {})} for r in set(row_sets) | set(extra)}
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
            if _finished(folder, cfg["num-rounds"]):
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
    ap.add_argument("paper", nargs="?", help="which paper's comparison (a <paper>.toml of the tables folder)")
    ap.add_argument("--tables", default=None, metavar="DIR",
                    help=f"the folder of the paper tables, <paper>.toml (default: ${PAPERS_ENV} if set, else "
                         f"conf/papers/ of the source tree, then ./conf/papers/)")
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
    ap.add_argument("--budget", default="", metavar="NAME",
                    help="rerun the comparison at another budget the paper records (on its dataset; --list shows "
                         "them; results in results/papers/<paper>-<dataset>-<NAME>)")
    ap.add_argument("--paired", default="", metavar="ROW",
                    help="also tabulate every row's per-seed differences from this row (paired over seeds)")
    ap.add_argument("--page", action="store_true",
                    help="regenerate the paper's results page docs/paper-results/<paper>.md (and .png) from the run "
                         "folders committed under docs/paper-results/runs/<paper>-fmnist/ (no paper: every page); "
                         "runs nothing")
    ap.add_argument("--list", action="store_true",
                    help="print the paper's tables (each method and the rows that rerun it), rows and settings")
    args = ap.parse_args(argv)
    try:
        known = papers(args.tables)
    except (PapersNotFound, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.paper is not None and args.paper not in known:
        ap.error(f"argument paper: invalid choice: {args.paper!r} (choose from {', '.join(map(repr, sorted(known)))})")
    if args.page:
        from flower_apps.pages import write_page

        for p in ([known[args.paper]] if args.paper else known.values()):
            print(write_page(p, args.dataset or "fashion-mnist"))
        return 0
    if args.list or not args.paper:
        for p in ([known[args.paper]] if args.paper else known.values()):
            print(p.listing())
        return 0 if args.list else 2
    paper = known[args.paper]
    unknown = [r for r in (args.rows or []) + ([args.paired] if args.paired else []) if r not in paper.rows_by_name]
    if unknown:
        print(f"error: --rows {unknown} not in {args.paper}'s rows: "
              f"{', '.join(paper.rows_by_name)}", file=sys.stderr)
        return 2
    if args.budget and args.budget not in paper.budgets:
        print(f"error: --budget {args.budget!r} is not one of {args.paper}'s budgets: "
              f"{', '.join(paper.budgets) or 'none'}", file=sys.stderr)
        return 2
    if args.budget and args.dataset and args.dataset != paper.budgets[args.budget].dataset:
        print(f"error: --budget {args.budget!r} is on --dataset {paper.budgets[args.budget].dataset!r}, "
              f"not {args.dataset!r}", file=sys.stderr)
        return 2
    if args.dataset and args.dataset not in paper.datasets:
        print(f"error: --dataset {args.dataset!r}: {args.paper} has a budget for "
              f"{', '.join(paper.datasets) or 'no other dataset'}", file=sys.stderr)
        return 2
    if args.paired and args.rows and args.paired not in args.rows:
        print(f"error: --paired {args.paired!r} is not one of the --rows", file=sys.stderr)
        return 2
    from tasks.config import ConfigError

    try:
        dataset = paper.budgets[args.budget].dataset if args.budget else args.dataset
        tail = "-".join(x for x in (dataset, args.budget) if x)
        out = Path(args.out) if args.out else (Path("results") / "papers" / f"{args.paper}-{tail}" if tail else None)
        run_paper(paper, args.seeds, out, args.engine, args.rows, args.rounds, sets=parse_sets(args.set),
                  target=args.target, paired=args.paired, dataset=dataset, budget=args.budget)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from flower_apps.cli import run

    run(main)
