"""Datasets: the embedded default, local Hugging Face folders/parquet, offline hub ids."""
import numpy as np
import pytest

from tasks.data import DatasetError, load_dataset, stratified_holdout
from tests.datasets import needs_dataset


def test_embedded_mnist5k_real_and_balanced():
    b = load_dataset("mnist5k", seed=0, test_fraction=0.2)
    assert b.num_classes == 10 and b.in_channels == 1 and b.image_size == 28
    assert len(b.train) == 4000 and len(b.test) == 1000
    assert np.bincount(b.train.y, minlength=10).tolist() == [400] * 10
    assert np.bincount(b.test.y, minlength=10).tolist() == [100] * 10
    assert b.train.x.dtype == np.uint8 and b.train.x.max() == 255
    # real digits: ink covers a plausible share of the pixels, and classes differ on average
    ink = (b.train.x > 127).mean()
    assert 0.05 < ink < 0.3
    means = np.stack([b.train.x[b.train.y == c].mean(0) for c in range(10)])
    assert np.abs(means[0] - means[1]).mean() > 10


def test_holdout_is_seeded_and_disjoint():
    y = np.repeat(np.arange(5), 20)
    a_tr, a_te = stratified_holdout(y, 0.25, seed=3)
    b_tr, b_te = stratified_holdout(y, 0.25, seed=3)
    assert np.array_equal(a_te, b_te) and not set(a_tr) & set(a_te)
    assert len(a_tr) + len(a_te) == 100 and np.bincount(y[a_te]).tolist() == [5] * 5


def _make_hf(tmp_path, channels=3, with_test=True):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image

    rng = np.random.default_rng(0)
    shape = (12, 12, 3) if channels == 3 else (12, 12)
    imgs = [rng.integers(0, 255, shape, dtype=np.uint8) for _ in range(40)]
    feats = Features({"img": Image(), "label": ClassLabel(num_classes=4)})
    d = Dataset.from_dict({"img": imgs, "label": [i % 4 for i in range(40)]}, features=feats)
    dd = DatasetDict({"train": d, "test": d.select(range(8))} if with_test else {"train": d})
    return dd, imgs


@pytest.mark.parametrize("channels", [1, 3])
def test_local_save_to_disk_and_parquet_load_like_a_hub_dataset(tmp_path, channels):
    dd, imgs = _make_hf(tmp_path, channels)
    dd.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    for split in dd:
        dd[split].to_parquet(str(tmp_path / "pq" / f"{split}.parquet"))
    for src in (tmp_path / "saved", tmp_path / "pq"):
        b = load_dataset(str(src), seed=0)
        assert (len(b.train), len(b.test), b.num_classes) == (40, 8, 4)
        assert b.train.x.shape == (40, channels, 12, 12) and b.train.x.dtype == np.uint8
        first = imgs[0] if channels == 1 else imgs[0].transpose(2, 0, 1)
        assert np.array_equal(b.train.x[0].squeeze(), first.squeeze())
        assert b.train.y[:4].tolist() == [0, 1, 2, 3]


def test_local_dataset_without_test_split_gets_a_holdout(tmp_path):
    dd, _ = _make_hf(tmp_path, 3, with_test=False)
    dd.save_to_disk(str(tmp_path / "saved"))
    b = load_dataset(str(tmp_path / "saved"), seed=0, test_fraction=0.2)
    assert (len(b.train), len(b.test)) == (32, 8)


def test_unknown_columns_name_the_key(tmp_path):
    dd, _ = _make_hf(tmp_path)
    dd.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DatasetError, match="image-key='pixels' is not a column"):
        load_dataset(str(tmp_path / "saved"), image_key="pixels")


def test_hub_id_offline_gives_clear_error(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    # offline mode as a machine without network has it (the env vars are read at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DatasetError, match="could not be loaded through flwr-datasets.*mnist5k"):
        load_dataset("no-such-user/no-such-dataset-xyz")


def test_decoded_datasets_are_cached_on_disk_keyed_by_their_source(tmp_path, monkeypatch):
    """A fresh ClientApp process (every message in a deployment) reads the decoded arrays
    from the disk cache instead of decoding the dataset again; a changed source, a damaged
    entry or ``FLOWER_SSL_DATA_CACHE=off`` rebuild."""
    from tasks import data

    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    dd, _ = _make_hf(tmp_path, 3)
    dd.save_to_disk(str(tmp_path / "saved"))
    builds = []
    real = data.hf_to_arrays
    monkeypatch.setattr(data, "hf_to_arrays", lambda *a, **k: builds.append(1) or real(*a, **k))

    def load():
        data._load_dataset_cached.cache_clear()   # as a new process
        return load_dataset(str(tmp_path / "saved"), seed=0)

    a = load()
    assert len(builds) == 2 and len(list((tmp_path / "cache").glob("*.npz"))) == 1   # train + test decoded once
    b = load()
    assert len(builds) == 2                                                          # read from the cache
    assert np.array_equal(a.train.x, b.train.x) and np.array_equal(a.test.y, b.test.y)
    assert (b.num_classes, len(b.train), len(b.test)) == (4, 40, 8)
    (entry,) = (tmp_path / "cache").glob("*.npz")
    entry.write_bytes(b"not an npz")                                                  # damaged: rebuilt
    c = load()
    assert len(builds) == 4 and np.array_equal(c.train.x, a.train.x)
    dd["train"].select(range(20)).save_to_disk(str(tmp_path / "saved" / "train"))     # the source changed
    d = load()
    assert len(builds) == 6 and len(d.train) == 20
    monkeypatch.setenv(data.CACHE_ENV, "off")
    load()
    assert len(builds) == 8 and len(list((tmp_path / "cache").glob("*.npz"))) == 2


def test_the_embedded_dataset_is_cached_too(tmp_path, monkeypatch):
    from tasks import data

    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "c"))
    data._load_mnist5k.cache_clear()
    x, y = data._load_mnist5k()
    assert len(list((tmp_path / "c").glob("*.npz"))) == 1
    data._load_mnist5k.cache_clear()
    import pandas  # noqa: F401  (imported by the first build; the cached load must not need it)
    monkeypatch.setitem(__import__("sys").modules, "pandas", None)   # importing pandas now fails
    x2, y2 = data._load_mnist5k()
    assert np.array_equal(x, x2) and np.array_equal(y, y2) and x2.shape == (5000, 1, 28, 28)
    data._load_mnist5k.cache_clear()


# ----------------------------------------------------------------------------- idx folders
def _write_idx(path, array, gz):
    """An idx file as the MNIST format defines it: magic (0, 0, type 0x08 = uint8, ndim), the
    big-endian dimensions, then the bytes."""
    import gzip
    import struct

    body = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) \
        + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as fh:
            fh.write(body)
    else:
        path.write_bytes(body)


def _idx_folder(folder, gz, n_train=30, n_test=10):
    rng = np.random.default_rng(5)
    folder.mkdir()
    sets = {"train": (rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8), rng.integers(0, 10, n_train)),
            "t10k": (rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8), rng.integers(0, 10, n_test))}
    for part, (x, y) in sets.items():
        _write_idx(folder / f"{part}-images-idx3-ubyte", x, gz)
        _write_idx(folder / f"{part}-labels-idx1-ubyte", y.astype(np.uint8), gz)
    return sets


@pytest.mark.parametrize("gz", [False, True])
def test_a_folder_of_idx_files_loads_as_its_own_train_and_test(tmp_path, monkeypatch, gz):
    """A folder with the four MNIST-format idx files (plain or .gz) is a dataset: images and
    labels exactly as written, its own test split, and ``fashion-mnist`` reads such a folder."""
    monkeypatch.setenv("FLOWER_SSL_DATA_CACHE", "off")
    from tasks import data

    sets = _idx_folder(tmp_path / "idx", gz)
    data._load_dataset_cached.cache_clear()
    b = load_dataset(str(tmp_path / "idx"))
    np.testing.assert_array_equal(b.train.x[:, 0], sets["train"][0])
    np.testing.assert_array_equal(b.train.y, sets["train"][1])
    np.testing.assert_array_equal(b.test.x[:, 0], sets["t10k"][0])
    np.testing.assert_array_equal(b.test.y, sets["t10k"][1])
    assert b.train.x.dtype == np.uint8 and b.train.x.shape == (30, 1, 28, 28)
    monkeypatch.setenv("FLOWER_SSL_FASHION_MNIST_DIR", str(tmp_path / "idx"))
    data._load_dataset_cached.cache_clear()
    f = load_dataset("fashion-mnist")
    np.testing.assert_array_equal(f.train.y, sets["train"][1])
    assert not f.is_digits   # (mirrored clothes keep their class: the weak view may flip them)
    data._load_dataset_cached.cache_clear()


def test_fashion_mnist_without_its_files_names_the_package(tmp_path, monkeypatch):
    from tasks import data

    monkeypatch.setenv("FLOWER_SSL_FASHION_MNIST_DIR", str(tmp_path / "nothing-here"))
    data._load_dataset_cached.cache_clear()
    with pytest.raises(DatasetError, match=r"apt-get install dataset-fashion-mnist.*FLOWER_SSL_FASHION_MNIST_DIR"):
        load_dataset("fashion-mnist")
    (tmp_path / "half").mkdir()
    _write_idx(tmp_path / "half" / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8), False)
    monkeypatch.setenv("FLOWER_SSL_FASHION_MNIST_DIR", str(tmp_path / "half"))
    with pytest.raises(DatasetError, match="does not hold them"):
        load_dataset("fashion-mnist")
    data._load_dataset_cached.cache_clear()


@needs_dataset("fashion-mnist")
def test_the_real_fashion_mnist_files(monkeypatch):
    """The Debian package's files (or the folder ``$FLOWER_SSL_FASHION_MNIST_DIR`` names): 60,000
    training and 10,000 test images, 6,000 and 1,000 of each of the 10 classes, 28x28 grey."""
    from tasks import data

    data._load_dataset_cached.cache_clear()
    b = load_dataset("fashion-mnist")
    assert b.train.x.shape == (60000, 1, 28, 28) and b.test.x.shape == (10000, 1, 28, 28)
    assert b.num_classes == 10
    assert (np.bincount(b.train.y) == 6000).all() and (np.bincount(b.test.y) == 1000).all()
    data._load_dataset_cached.cache_clear()


def test_train_size_takes_a_stratified_seeded_subset_of_the_training_split():
    """``train-size=N``: N training samples, each class's share kept (to one sample), the same N
    for the same seed and another draw for another seed; the test split stays whole; too many is
    a ConfigError naming the key."""
    from tasks.config import ConfigError, TaskConfig
    from tasks.env import load_bundle

    full = load_bundle(TaskConfig())
    sub = load_bundle(TaskConfig(train_size=1001))
    assert len(sub.train) == 1001 and len(sub.test) == len(full.test)
    share = np.bincount(full.train.y, minlength=10) / len(full.train)
    assert np.all(np.abs(np.bincount(sub.train.y, minlength=10) - share * 1001) < 1.0)
    again = load_bundle(TaskConfig(train_size=1001))
    other = load_bundle(TaskConfig(train_size=1001, seed=1))
    np.testing.assert_array_equal(again.train.x, sub.train.x)
    assert not np.array_equal(other.train.x, sub.train.x)
    assert load_bundle(TaskConfig(train_size=len(full.train))).train is full.train
    with pytest.raises(ConfigError, match=rf"train-size=99999 is more than the {len(full.train)} training samples"):
        load_bundle(TaskConfig(train_size=99999))
