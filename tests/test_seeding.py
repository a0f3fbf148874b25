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
