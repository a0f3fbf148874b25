"""What did the cut disclose? The evaluation inversion attacker on a finished split run.

    python -m flower_apps.attack results/papers/scala/scala-s0
    python -m flower_apps.attack results/my-run --images 500 --epochs 50
    python -m flower_apps.attack results/fedavg-run --cut conv1      # a full-model run: name a cut

Loads the run folder's ``config.json`` and its final global model (``checkpoint.pt``'s model:
the weights the server sends the clients, whose bottom produced the activations; ``model.pt``
where no checkpoint is left), rebuilds the model and its cut from the config (``cut`` ``''`` =
the model's default), takes the held-out images of the run's dataset (the library's **test
split**, never trained on by the run; the run evaluates its accuracy on it), computes the bottom's
activations in eval mode on the library's test view of the images, and trains the attacker of
:mod:`tasks.scala.inversion` (by default SCALA's shallow 64-channel conv decoder, ResSFL's
``conv_normN0C64``; ``--blocks 4 --residual true`` gives ResSFL's deeper ``res_normN4C64``) on one part of
them, picks its epoch on a second and reports MSE, SSIM and PSNR of its reconstructions on a
third (the three parts disjoint, seeded: ``--test-fraction``, ``--val-fraction``, ``--seed``),
beside the run's final accuracy and the trivial attacker that predicts the mean image.

Written to ``<run folder>/attack.json`` (replaced by a later attack; the settings are in it;
``--save-as NAME`` writes ``attack-NAME.json`` instead, another attacker's record beside the
default one, which the results pages put side by side):
``{"round", "accuracy", "attack-mse", "attack-ssim", "attack-psnr", "baseline-*", ...}``, and
printed. ``metrics.jsonl`` stays per round (as resume needs it); :mod:`flower_apps.report` reads
``attack.json`` and adds the columns "attack MSE", "attack SSIM", "attack PSNR".

A run of a full-model algorithm has no cut: pass ``--cut`` (one of the model's cut points) to
see what its first stages would disclose; for a split run, ``--cut`` other than the run's is a
what-if (recorded as such). ``--seed`` (the split of the images, the decoder's initialisation and
batch order) defaults to the run's seed. As functions: :func:`attack_run` (a folder),
:func:`attack_model` (a model and a cut) or :func:`tasks.scala.inversion.attack` (a bottom and images).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

from flower_apps.report import ATTACK_FILE, OTHER_ATTACK_PREFIX
from tasks.config import ConfigError, fields_of, key_of


def _split_algorithms() -> list[str]:
    from strategies.split_base import SplitStrategy
    from strategies.registry import algorithm_names, get_algorithm

    return [n for n in algorithm_names() if issubclass(get_algorithm(n).strategy_cls, SplitStrategy)]


def _final_state(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    from flower_apps.results import RunFolder, load_safely

    ck = RunFolder(folder).load_checkpoint()
    if ck is not None and isinstance(ck.get("state"), dict) and "model" in ck["state"]:
        return ck["state"]["model"], "checkpoint.pt"
    if (folder / "model.pt").exists():
        return load_safely(folder / "model.pt"), "model.pt"
    raise FileNotFoundError(f"{folder} holds no checkpoint.pt or model.pt: no finished model to attack")


def _last_metrics(folder: Path) -> dict[str, Any]:
    from flower_apps.results import RunFolder

    rows = RunFolder(folder).metrics()
    return rows[-1] if rows else {}


_SAVE_AS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def record_file(save_as: str = "") -> str:
    """The file an attack record is written to: ``attack.json``, or ``attack-<save_as>.json``
    (``save_as``: letters, digits, ``_.-``, up to 64 characters, not starting with a sign)."""
    if not save_as:
        return ATTACK_FILE
    if not isinstance(save_as, str) or not _SAVE_AS.fullmatch(save_as):
        raise ConfigError(f"save-as={save_as!r}: a name of letters, digits and _.- (up to 64 characters, "
                          "starting with a letter or digit); it names the file attack-<save-as>.json")
    return f"{OTHER_ATTACK_PREFIX}{save_as}.json"


def attack_run(folder: str | Path, *, cut: str | None = None, device: str | None = None, write: bool = True,
               save_as: str = "", **settings: Any) -> dict[str, Any]:
    """Attack the final model of run ``folder`` (see the module docstring); return the record
    written to ``attack.json`` (``save_as``: to ``attack-<save_as>.json``; ``write=False``: not
    written). ``settings``: the fields of :class:`tasks.scala.inversion.AttackConfig`
    (``epochs=5``, ``num_images=200``, ...)."""
    from flower_apps.config import parse_run_config
    from flower_apps.results import CONFIG, RunFolder, atomic_write_bytes
    from split_layer.cut import split_model
    from strategies.split_base import SplitStrategy
    from tasks.env import load_bundle, make_augmenter
    from tasks.scala.inversion import attack, attack_config
    from tasks.models import build_model
    from tasks.training import resolve_device

    folder = Path(folder)
    out_file = record_file(save_as)   # a bad name fails before the attack's minutes, not after
    if not (folder / CONFIG).exists():
        raise FileNotFoundError(f"{folder} is not a run folder: no {CONFIG}")
    cfg_raw = json.loads((folder / CONFIG).read_text())
    parsed = parse_run_config(cfg_raw)
    task, spec = parsed.task, parsed.spec
    is_split = issubclass(spec.strategy_cls, SplitStrategy)
    if not is_split and not cut:
        raise ConfigError(f"algo={spec.name!r} trains the full model on the nodes: nothing crosses a cut. "
                          f"The attack applies to split algorithms ({', '.join(_split_algorithms())}); to see "
                          f"what a cut of this model would disclose, pass --cut <cut point>")
    if settings.get("seed") is None:   # default: the run's seed (each seed of a sweep its own attacker draw)
        settings["seed"] = task.seed
    acfg = attack_config(**settings)
    bundle = load_bundle(task)
    model = build_model(task.model, in_channels=bundle.in_channels, num_classes=bundle.num_classes,
                        image_size=bundle.image_size, norm=task.norm, dropout=task.dropout)
    state, source = _final_state(folder)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    run_cut = task.cut or model.default_cut
    the_cut = cut or run_cut
    if the_cut not in model.cut_points:
        raise ConfigError(f"cut={the_cut!r} is not a cut point of model={task.model!r}; allowed: "
                          f"{', '.join(model.cut_points)}")
    dev = resolve_device(device or task.device, task.deterministic)
    model = model.to(dev)
    bottom, _ = split_model(model, the_cut)
    aug = make_augmenter(bundle)
    x_uint8 = torch.from_numpy(bundle.test.x)

    def transform(x: torch.Tensor) -> torch.Tensor:   # unit images -> the library's test view
        return aug.test((x * 255.0).round().to(torch.uint8))

    res = attack(bottom, x_uint8, transform=transform, device=dev, cfg=acfg)
    last = _last_metrics(folder)
    record = {"round": last.get("round"), "accuracy": last.get("accuracy"),
              "attack-mse": res["mse"], "attack-ssim": res["ssim"], "attack-psnr": res["psnr"],
              **{k: v for k, v in res.items() if k not in ("mse", "ssim", "psnr")},
              "algo": spec.name, "model": task.model, "cut": the_cut,
              "cut-from": "run config" if the_cut == run_cut and is_split else "--cut (what-if)",
              "weights": source, "images": f"test split of dataset={task.dataset!r} ({len(x_uint8)} images)"}
    if write:
        RunFolder(folder).check_no_links()
        atomic_write_bytes(folder / out_file, json.dumps(record, indent=2, default=str).encode())
    return record


def attack_model(model: Any, cut: str | None, images: Any, **kw: Any) -> dict[str, Any]:
    """:func:`tasks.scala.inversion.attack` on the bottom of ``model`` cut after ``cut`` (a
    :class:`tasks.models.StagedModel`, or any model :func:`tasks.models.as_staged` accepts: a
    ``(bottom, top)`` pair, an ``nn.Sequential`` cut after a child); ``kw`` as for ``attack``."""
    from split_layer.cut import split_model
    from tasks.scala.inversion import attack
    from tasks.models import StagedModel, as_staged

    try:
        staged = model if isinstance(model, StagedModel) else as_staged(model, cut or None)
        bottom, _ = split_model(staged, cut or staged.default_cut)
    except ValueError as e:
        raise ConfigError(f"model/cut: {e}") from None
    return attack(bottom, images, **kw)


def summary_line(rec: dict[str, Any]) -> str:
    acc = rec.get("accuracy")
    acc_s = "n/a" if not isinstance(acc, (int, float)) else f"{acc:.4f}"
    return (f"{rec['algo']} cut={rec['cut']} round {rec.get('round')}: accuracy {acc_s} | attack MSE "
            f"{rec['attack-mse']:.4f} SSIM {rec['attack-ssim']:.3f} PSNR {rec['attack-psnr']:.2f} dB | mean-image "
            f"baseline MSE {rec['baseline-mse']:.4f} SSIM {rec['baseline-ssim']:.3f} PSNR "
            f"{rec['baseline-psnr']:.2f} dB | {rec['n-train']}/{rec['n-val']}/{rec['n-test']} train/val/test images")


def main(argv: list[str] | None = None) -> int:
    from tasks.scala.inversion import AttackConfig

    ap = argparse.ArgumentParser(prog="python -m flower_apps.attack", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run folder (config.json + checkpoint.pt or model.pt)")
    ap.add_argument("--cut", default=None, help="attack at this cut point (default: the run's cut; required "
                                                "for a full-model run)")
    ap.add_argument("--device", default=None, help="default: the run's device key")
    ap.add_argument("--no-write", action="store_true", help=f"print only; do not write {ATTACK_FILE}")
    ap.add_argument("--save-as", default="", metavar="NAME",
                    help=f"write {OTHER_ATTACK_PREFIX}NAME.json instead of {ATTACK_FILE}: another attacker's "
                         "record beside the default one (e.g. --save-as res_normN4C64 --blocks 4 --residual true)")
    for f, typ in fields_of(AttackConfig):
        opt = "--images" if f.name == "num_images" else "--" + key_of(f.name)
        default = None if f.name == "seed" else f.default
        kw: dict[str, Any] = {"dest": f.name, "default": default,
                              "help": f"{f.metadata['help']} (default {'the run seed' if default is None else default})"}
        if typ is bool:
            kw["type"] = lambda s: {"true": True, "false": False}.get(s.lower(), s)
        else:
            kw["type"] = typ
        ap.add_argument(opt, **kw)
    args = ap.parse_args(argv)
    settings = {f.name: getattr(args, f.name) for f, _ in fields_of(AttackConfig)}
    try:
        rec = attack_run(args.run, cut=args.cut, device=args.device, write=not args.no_write,
                         save_as=args.save_as, **settings)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary_line(rec))
    print(json.dumps({k: v for k, v in rec.items() if not (isinstance(v, float) and math.isnan(v))},
                     indent=2, default=str))
    if not args.no_write:
        print(f"written: {Path(args.run) / record_file(args.save_as)}")
    return 0


if __name__ == "__main__":
    from flower_apps.cli import run

    run(main)
