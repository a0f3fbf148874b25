"""One seeding mechanism (issue "one place per concept"): library code seeds torch's global RNG
only through :func:`tasks.training.seeded`, so a training call or a model build leaves the
caller's RNG as it found it, and the same seed gives the same weights."""
from __future__ import annotations

import ast

import numpy as np
import pytest
import torch

from tasks.augment import Augmenter
from tasks.config import TaskConfig
from tasks.data import ArrayDataset
from tasks.env import Env
from tasks.models import build_model
from tasks.training import seeded, train_fixmatch, train_supervised
from tests.flower_harness import ROOT

C = 3


def _data(n: int, seed: int) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, C, n))


def _model() -> torch.nn.Module:
    with seeded(0):
        return build_model("mlp", in_channels=1, num_classes=C, image_size=8, norm="none", hidden=(16,),
                           dropout=0.5)


def _supervised(model: torch.nn.Module, seed: int) -> None:
    train_supervised(model, _data(20, 1), aug=Augmenter(1, 8, flip=True), steps=4, batch_size=8,
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"),
                     seed=seed, view="strong")


def _fixmatch(model: torch.nn.Module, seed: int) -> None:
    train_fixmatch(model, _data(12, 1), _data(20, 2), aug=Augmenter(1, 8, flip=True), steps=4, batch_size=4,
                   unlabeled_batch_size=8, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                   device=torch.device("cpu"), seed=seed, tau=0.0)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [v.detach().clone() for v in model.state_dict().values()]


@pytest.mark.parametrize("train", [_supervised, _fixmatch], ids=["supervised", "fixmatch"])
def test_training_leaves_the_callers_rng_alone_and_repeats_with_the_same_seed(train):
    torch.manual_seed(1234)   # the caller's own RNG (a test may seed it; the library may not)
    before = torch.get_rng_state()
    a, b, c = _model(), _model(), _model()
    train(a, 7)
    assert torch.equal(torch.get_rng_state(), before)       # untouched: the caller's next draw is its own
    train(b, 7)
    train(c, 8)
    assert torch.equal(torch.get_rng_state(), before)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))    # same seed: identical weights
    assert not all(torch.equal(x, y) for x, y in zip(wa, wc))  # (the seed does matter)
    # the same run after the caller drew from its RNG: still identical
    torch.rand(5)
    d = _model()
    train(d, 7)
    assert all(torch.equal(x, y) for x, y in zip(wa, _weights(d)))


def test_build_model_is_seeded_and_leaves_the_callers_rng_alone():
    task = TaskConfig()
    env = Env(task=task, device=torch.device("cpu"), augmenter=Augmenter(1, 8, flip=False), num_classes=C,
              model_fn=lambda: build_model("mlp", in_channels=1, num_classes=C, image_size=8, hidden=(16,)))
    torch.manual_seed(99)
    before = torch.get_rng_state()
    m1 = env.build_model()
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(3)
    m2 = env.build_model()
    assert all(torch.equal(x, y) for x, y in zip(_weights(m1), _weights(m2)))


def test_seeded_restores_the_state_and_reproduces_the_draws():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with seeded(11):
        x = torch.rand(4)
    with seeded(11):
        y = torch.rand(4)
    assert torch.equal(x, y) and torch.equal(torch.get_rng_state(), before)


def test_library_code_seeds_the_global_rng_only_through_seeded():
    """``torch.manual_seed`` appears once in the library: inside :func:`tasks.training.seeded`
    (explicit ``torch.Generator().manual_seed(...)`` objects are fine)."""
    found = []
    for package in ("tasks", "split_layer", "strategies", "flower_apps"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("manual_seed", "seed", "manual_seed_all")
                        and isinstance(node.func.value, (ast.Name, ast.Attribute))
                        and ast.unparse(node.func.value) in ("torch", "torch.cuda", "torch.random")):
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert len(found) == 1 and found[0].startswith("tasks/training.py:"), found


@pytest.fixture
def _restore_determinism():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def test_cuda_determinism_switch_sets_and_clears_torchs_mode(_restore_determinism, monkeypatch):
    """``deterministic`` (run config, default true) is PyTorch's deterministic mode on CUDA: deterministic
    algorithms (warn-only), cuDNN's deterministic kernels, no autotuning, and the cuBLAS workspace that
    mode needs; false turns it off. The CPU device changes nothing (its kernels are deterministic)."""
    from tasks.config import ConfigError
    from tasks.training import resolve_device, set_cuda_determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_cuda_determinism(False)
    assert resolve_device("cpu", True) == torch.device("cpu") and not torch.are_deterministic_algorithms_enabled()
    set_cuda_determinism(True)
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    import os
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")    # a user's own setting is kept
    set_cuda_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    set_cuda_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    assert not torch.backends.cudnn.deterministic
    assert TaskConfig().deterministic is True
    from flower_apps.config import parse_run_config
    from flower_apps.simulate import fused_run_config
    assert parse_run_config(fused_run_config(["deterministic=false"])).task.deterministic is False
    with pytest.raises(ConfigError, match="deterministic"):
        parse_run_config(fused_run_config(["deterministic='yes'"]))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda", True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_same_seed_same_weights_on_cuda(_restore_determinism):
    """On a GPU, with the default ``deterministic=true``, a conv net trained twice from the same seed
    has bitwise-equal weights (cuDNN's default backward sums in a varying order)."""
    from tasks.training import make_sgd, resolve_device

    dev = resolve_device("cuda", True)
    x = np.random.default_rng(0).integers(0, 256, (256, 1, 28, 28), dtype=np.uint8)
    data = ArrayDataset(x, np.random.default_rng(1).integers(0, 10, 256))
    out = []
    for _ in range(2):
        with seeded(0):
            net = build_model("cnn", in_channels=1, num_classes=10, image_size=28, norm="bn").to(dev)
        train_supervised(net, data, aug=Augmenter(1, 28, flip=False), steps=20, batch_size=64,
                         optimizer=make_sgd(net.parameters(), TaskConfig(lr=0.05)), device=dev, seed=3, view="strong")
        out.append(_weights(net))
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("name", ["cnn", "cnn-afo", "mlp", "alexnet", "resnet18", "resnet9", "cnn13", "vgg11-small"])
@pytest.mark.parametrize("norm", ["bn", "gn"])
def test_model_from_a_full_state_equals_build_and_load(name, norm):
    """``Env.model_from`` (built on the meta device, not initialised, then loaded) gives the
    module ``build_model`` + ``load_numpy_state`` gives: same keys, values and outputs, and the
    caller's RNG is untouched; a partial state falls back to the seeded build."""
    from tasks.config import TaskConfig
    from tasks.env import Env
    from tasks.models import build_model
    from tasks.training import load_numpy_state

    task = TaskConfig(model=name, norm=norm)
    fn = lambda: build_model(name, in_channels=1, num_classes=10, image_size=28, norm=norm)  # noqa: E731
    env = Env(task, torch.device("cpu"), None, 10, fn, library_model=True)
    torch.manual_seed(123)
    donor = fn()
    state = {k: (v.detach().numpy() + (0.5 if v.dtype.is_floating_point else 0)).astype(v.detach().numpy().dtype)
             for k, v in donor.state_dict().items()}
    ref = env.build_model()
    load_numpy_state(ref, state)
    before = torch.random.get_rng_state()
    got = env.model_from(state)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert list(got.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    x = torch.randn(4, 1, 28, 28)
    got.eval(), ref.eval()
    assert torch.equal(got(x), ref(x))
    partial = {k: v for i, (k, v) in enumerate(state.items()) if i > 0}
    with pytest.raises(ValueError, match="mismatch"):
        env.model_from(partial)   # (strict, as build + load: a missing key is an error, not garbage)
