"""One results writer for every run: a folder per run.

``<results-dir>/<run-name>/``
  ``config.json``     the resolved run config (every key, defaults included)
  ``metrics.jsonl``   one JSON object per completed round
  ``checkpoint.pt``   everything needed to resume, replaced atomically after each round;
                      loadable with ``torch.load(..., weights_only=True)`` (tensors, numbers, strings,
                      lists, tuples, dicts; numpy arrays are stored as tensors and restored on load),
                      so a tampered checkpoint cannot run code on resume
  ``model.pt``        the final global model's state dict
  ``curves.png``      accuracy and loss per round
  ``partition.json``  the realised partition skew (R, class histograms, ...)

The folder is opened once (``O_DIRECTORY | O_NOFOLLOW``: a symbolic link there is refused) and
every file is read and written relative to that open folder (``dir_fd``, ``O_NOFOLLOW``,
atomic renames within it), so a path swapped for a link after the start cannot redirect a
write: the run keeps writing into the folder it opened.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch

CHECKPOINT = "checkpoint.pt"
_NDARRAY = "__flower_ssl_ndarray__"   # marks a numpy array stored as a tensor in a checkpoint
METRICS = "metrics.jsonl"
CONFIG = "config.json"
# keys that may differ between the original run and a resumed one
RESUMABLE_KEYS = ("resume", "num-rounds", "round-timeout", "min-nodes")


def _json_default(o: Any):
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded safely (the message names the file)."""


def to_safe(obj: Any, where: str = "state") -> Any:
    """``obj`` with numpy arrays as tensors (marked) and numpy scalars as Python numbers, so
    that ``torch.load(weights_only=True)`` reads it back; anything else that the safe loader
    would refuse raises ``TypeError`` naming where it is (at save time, not at resume)."""
    if isinstance(obj, np.generic):  # (before the Python types: np.float64 is a float)
        return obj.item()
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc":
            raise TypeError(f"checkpoint: {where} is a numpy array of dtype {obj.dtype}; not storable safely")
        return {_NDARRAY: torch.from_numpy(np.array(obj, copy=True, order="C")), "dtype": obj.dtype.str}
    if isinstance(obj, dict):
        return {k: to_safe(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [to_safe(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    raise TypeError(f"checkpoint: {where} is a {type(obj).__name__}, which a safe (weights_only) load "
                    f"cannot read; store tensors, numbers, strings, lists, tuples or dicts")


def from_safe(obj: Any) -> Any:
    """Inverse of :func:`to_safe`."""
    if isinstance(obj, dict):
        if _NDARRAY in obj and set(obj) == {_NDARRAY, "dtype"}:
            return obj[_NDARRAY].numpy().astype(np.dtype(obj["dtype"]), copy=False)
        return {k: from_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_safe(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_safe(v) for v in obj)
    return obj


def load_safely(path: Path, data: bytes | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` (of ``data``, the file's bytes, where given); any
    failure is a :class:`CheckpointError` naming the file."""
    try:
        src = path if data is None else io.BytesIO(data)
        return from_safe(torch.load(src, map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001 - unpickling errors come in many types
        text = str(e)
        if "WeightsUnpickler error:" in text:  # torch's one relevant line (not its advice to drop weights_only)
            text = text.split("WeightsUnpickler error:", 1)[1].split(". Please use", 1)[0].strip()
        text = text.splitlines()[0][:300] if text.strip() else ""
        raise CheckpointError(
            f"cannot load checkpoint {path}: {type(e).__name__}: {text}. It is loaded with "
            f"weights_only=True (no code runs), so it was tampered with, is damaged, or was written by an "
            f"older version of flower-ssl; nothing was overwritten. Move it away to start over, or restore "
            f"a good copy to resume.") from None


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def open_dir(path: str | os.PathLike) -> int:
    """A descriptor of the folder ``path``, opened without following a link as its last component
    (a link there: ``ValueError``)."""
    try:
        return os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"run folder {path} is a symbolic link; results are written only into a real "
                             f"folder: remove the link, or point results-dir at the folder you want") from None
        raise e


def write_at(dir_fd: int, name: str, write: Callable[[BinaryIO], Any]) -> None:
    """Atomically replace file ``name`` of the open folder ``dir_fd``: a new temporary file there
    (``O_EXCL | O_NOFOLLOW``) filled by ``write(fh)``, synced, then renamed onto ``name``."""
    tmp = f".{name}.{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (its folder made and opened once, :func:`write_at`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    d = open_dir(path.parent)
    try:
        write_at(d, path.name, lambda fh: fh.write(data))
    finally:
        os.close(d)


class RunFolder:
    """Writes (and, on resume, reads back) one run's folder."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def dir_fd(self) -> int:
        """The run folder, opened once (:func:`open_dir`); every file is read and written relative
        to it."""
        if self._fd is None:
            self._fd = open_dir(self.path)
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _opened(self) -> bool:
        """Whether the folder is open, or there to be opened."""
        return self._fd is not None or self.path.is_dir()

    def _read(self, name: str) -> bytes | None:
        """File ``name`` of the folder (not through a link), or ``None`` if it (or the folder) is absent."""
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=self.dir_fd())
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as fh:
            return fh.read()

    def _write(self, name: str, data: bytes) -> None:
        write_at(self.dir_fd(), name, lambda fh: fh.write(data))

    # ---------------------------------------------------------------- writing
    def start(self, config: dict[str, Any], *, resume: bool, defaults: dict[str, Any] | None = None) -> int:
        """Prepare the folder; return the last completed round (0 for a fresh run). A run folder
        that is a symbolic link, or that holds one in place of a results file, is refused:
        results go where the run config says, never through a link to somewhere else.

        On resume the config must equal the saved one, except :data:`RESUMABLE_KEYS` and keys the
        saved config lacks whose value is their default in ``defaults`` (a knob the library
        gained after the run started, left at its default, changes nothing)."""
        self.check_no_links()
        cfg_path = self.path / CONFIG
        if resume:
            saved = self._read(CONFIG) if self._opened() else None
            if saved is None:
                raise FileNotFoundError(f"resume=true but {cfg_path} does not exist")
            old = json.loads(saved)
            new_at_default = {k for k in set(config) - set(old)
                              if defaults is not None and k in defaults and defaults[k] == config[k]}
            diff = sorted(k for k in set(old) | set(config)
                          if k not in RESUMABLE_KEYS and k not in new_at_default and old.get(k) != config.get(k))
            if diff:
                raise ValueError(f"resume=true but the run config differs from {cfg_path} in: {', '.join(diff)}")
            if new_at_default:   # the folder says what runs: the new knobs at their defaults
                self._write(CONFIG, json.dumps({**old, **{k: config[k] for k in new_at_default}},
                                               indent=2, sort_keys=True).encode())
            done = self.last_checkpoint_round()
            self.truncate_metrics(done)
            return done
        self.path.mkdir(parents=True, exist_ok=True)
        if self._read(METRICS):
            raise FileExistsError(
                f"run folder {self.path} already holds a run; choose another run-name, "
                f"or set resume=true to continue it")
        self._write(CONFIG, json.dumps(config, indent=2, sort_keys=True).encode())
        return 0

    def check_no_links(self) -> None:
        if self.path.is_symlink():
            raise ValueError(
                f"run folder {self.path} is a symbolic link (to {os.readlink(self.path)}); results are written only "
                f"into a real folder: remove the link, or point results-dir at the folder you want")
        for name in (CONFIG, METRICS, CHECKPOINT, "model.pt", "curves.png", "partition.json"):
            if (self.path / name).is_symlink():
                raise ValueError(f"{self.path / name} is a symbolic link; results are written only into real "
                                 f"files: remove it, or choose another run-name")

    def write_json(self, name: str, obj: Any) -> None:
        self._write(name, json.dumps(obj, indent=2, default=_json_default).encode())

    def append_metrics(self, rnd: int, metrics: dict[str, Any]) -> None:
        row = {"round": rnd, **metrics}
        fd = os.open(METRICS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644, dir_fd=self.dir_fd())
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=_json_default) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def save_checkpoint(self, rnd: int, state: dict[str, Any]) -> None:
        obj = to_safe({"round": int(rnd), "state": state}, "checkpoint")
        write_at(self.dir_fd(), CHECKPOINT, lambda fh: torch.save(obj, fh))

    def save_model(self, state_dict: dict[str, torch.Tensor]) -> None:
        obj = {k: v.detach().cpu() for k, v in state_dict.items()}
        write_at(self.dir_fd(), "model.pt", lambda fh: torch.save(obj, fh))

    # ---------------------------------------------------------------- reading
    def last_checkpoint_round(self) -> int:
        p = self.path / CHECKPOINT
        data = self._read(CHECKPOINT) if self._opened() else None
        if data is None:
            return 0
        ck = load_safely(p, data)
        try:
            return int(ck["round"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint {p} has no round number; nothing was overwritten") from None

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint (``{"round", "state"}``), read with ``weights_only=True``; ``None`` if absent."""
        data = self._read(CHECKPOINT) if self._opened() else None
        return load_safely(self.path / CHECKPOINT, data) if data is not None else None

    def metrics(self) -> list[dict[str, Any]]:
        data = self._read(METRICS) if self._opened() else None
        if data is None:
            return []
        rows = []
        for line in data.decode("utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a killed process
        return rows

    def truncate_metrics(self, last_round: int) -> None:
        """Keep rows of rounds <= last_round (a round after the checkpoint is redone)."""
        rows = [r for r in self.metrics() if int(r.get("round", 0)) <= last_round]
        self._write(METRICS, "".join(json.dumps(r, default=_json_default) + "\n" for r in rows).encode())

    # ---------------------------------------------------------------- plot
    def plot(self, title: str = "") -> Path | None:
        rows = self.metrics()
        if not rows:
            return None
        from flower_apps.plotting import png, pyplot, round_axis

        rounds = [r["round"] for r in rows]
        fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(10, 3.6))
        acc_keys = [k for k in rows[-1] if k == "accuracy" or k.endswith("-accuracy") and "per-class" not in k]
        for k in acc_keys:
            a1.plot(rounds, [r.get(k, math.nan) for r in rows], label=k)
        round_axis(a1), a1.set_ylabel("test accuracy"), a1.grid(alpha=0.3), a1.legend(fontsize=8)
        for k in ("loss", "train-loss"):
            if any(k in r for r in rows):
                a2.plot(rounds, [r.get(k, math.nan) for r in rows], label=k)
        round_axis(a2), a2.set_ylabel("loss"), a2.grid(alpha=0.3), a2.legend(fontsize=8)
        fig.suptitle(title or self.path.name)
        self._write("curves.png", png(fig))
        return self.path / "curves.png"
