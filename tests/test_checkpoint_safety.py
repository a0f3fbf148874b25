"""Checkpoints are read with ``torch.load(weights_only=True)``: a tampered
``checkpoint.pt`` cannot run code on resume; a checkpoint that fails to load is a clear
error naming the file, and nothing in the run folder is overwritten."""
from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch

from flower_apps.results import CHECKPOINT, CheckpointError, RunFolder

CONFIG = {"algo": "fedavg", "num-rounds": 3}


def _folder(tmp_path, state) -> RunFolder:
    f = RunFolder(tmp_path / "run")
    f.start(CONFIG, resume=False)
    f.append_metrics(1, {"accuracy": 0.5})
    f.save_checkpoint(1, state)
    return f


def test_a_strategy_like_state_round_trips_through_a_safe_load(tmp_path):
    rng = random.Random(3)
    state = {"model": {"w": torch.randn(3, 2), "bn.num_batches_tracked": torch.tensor(4)},
             "rng": rng.getstate(),
             "extra": {"info": {1001: {"partition": 0, "n": 50, "hist": np.array([3, 0, 7], np.int64)}},
                       "c": [np.zeros((2, 2), np.float32), np.float64(2.5), np.int64(7), np.bool_(True)],
                       "scalar": np.array(1.5), "none": None, "name": "x"}}
    f = _folder(tmp_path, state)
    torch.load(f.path / CHECKPOINT, weights_only=True)   # the file itself is weights-only loadable
    ck = f.load_checkpoint()
    assert ck["round"] == 1 and f.last_checkpoint_round() == 1
    got = ck["state"]
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    r2 = random.Random()
    r2.setstate(got["rng"])
    assert r2.random() == rng.random()
    h = got["extra"]["info"][1001]["hist"]
    assert isinstance(h, np.ndarray) and h.dtype == np.int64 and h.tolist() == [3, 0, 7]
    c = got["extra"]["c"]
    assert c[0].dtype == np.float32 and c[0].shape == (2, 2) and c[1:] == [2.5, 7, True]
    assert got["extra"]["scalar"].shape == () and float(got["extra"]["scalar"]) == 1.5


def test_saving_something_a_safe_load_could_not_read_fails_at_save_time(tmp_path):
    f = RunFolder(tmp_path / "run")
    f.start(CONFIG, resume=False)
    with pytest.raises(TypeError, match=r"checkpoint\['state'\]\['extra'\]\['obj'\] is a object"):
        f.save_checkpoint(1, {"extra": {"obj": object()}})
    assert not (f.path / CHECKPOINT).exists()


class _Payload:
    """Unpickling this would create ``marker`` (stands for arbitrary code)."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("kind", ["code", "garbage", "truncated"])
def test_a_bad_checkpoint_is_a_clear_error_runs_nothing_and_overwrites_nothing(tmp_path, kind):
    f = _folder(tmp_path, {"x": torch.ones(3)})
    p = f.path / CHECKPOINT
    marker = tmp_path / "pwned"
    if kind == "code":
        torch.save({"round": 1, "state": {"x": _Payload(marker)}}, p)   # a tampered checkpoint
        with pytest.raises(pickle.UnpicklingError):  # (what the old weights_only=False load would not stop)
            torch.load(p, weights_only=True)
    elif kind == "garbage":
        p.write_bytes(b"\x80\x04not a checkpoint")
    else:
        p.write_bytes(p.read_bytes()[:50])
    before = {q.name: q.read_bytes() for q in f.path.iterdir()}
    for load in (f.load_checkpoint, f.last_checkpoint_round, lambda: f.start(CONFIG, resume=True)):
        with pytest.raises(CheckpointError, match=f"(?s)cannot load checkpoint {p}: .*nothing was overwritten"):
            load()
    assert not marker.exists()   # no code ran
    assert {q.name: q.read_bytes() for q in f.path.iterdir()} == before   # metrics, config, checkpoint as they were
    assert json.loads((f.path / "metrics.jsonl").read_text())["round"] == 1


def test_a_run_folder_that_is_a_symbolic_link_is_refused(tmp_path):
    """Results go where the run config says, never through a link elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="is a symbolic link.*remove the link"):
        RunFolder(tmp_path / "results" / "run").start(CONFIG, resume=False)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("resume", [False, True])
def test_a_results_file_that_is_a_symbolic_link_is_refused(tmp_path, resume):
    f = _folder(tmp_path, {"w": torch.zeros(2)})
    target = tmp_path / "victim.txt"
    target.write_text("keep me\n")
    (f.path / "metrics.jsonl").unlink()
    (f.path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        RunFolder(f.path).start(CONFIG, resume=resume)
    with pytest.raises(OSError):   # and a link planted after the start is not followed either
        f.append_metrics(2, {"accuracy": 0.6})
    assert target.read_text() == "keep me\n"


def test_a_run_folder_swapped_for_a_link_mid_run_does_not_redirect_writes(tmp_path):
    """After round 1 the run folder is moved away and a link to another folder put in its place:
    rounds 2-3's metrics, the checkpoint, the model and the plot still land in the folder the run
    opened (now at its new path); the link's target gets nothing."""
    f = _folder(tmp_path, {"w": torch.zeros(2)})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = tmp_path / "moved"
    f.path.rename(moved)
    f.path.symlink_to(elsewhere, target_is_directory=True)
    for rnd in (2, 3):
        f.append_metrics(rnd, {"accuracy": 0.5 + rnd / 10})
        f.save_checkpoint(rnd, {"w": torch.full((2,), float(rnd))})
    f.save_model({"w": torch.ones(2)})
    f.write_json("partition.json", {"R": 1})
    assert f.plot() is not None
    assert f.last_checkpoint_round() == 3 and [r["round"] for r in f.metrics()] == [1, 2, 3]
    f.close()
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in moved.iterdir()) == sorted(
        ["checkpoint.pt", "config.json", "curves.png", "metrics.jsonl", "model.pt", "partition.json"])
    assert [json.loads(x)["round"] for x in (moved / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_run_whose_folder_is_swapped_after_round_1_writes_into_the_folder_it_opened(tmp_path, monkeypatch):
    """The same through the ServerApp's run (in process): the swap happens in round 1's
    ``on_round_end`` callback chain, right after its checkpoint."""
    from flower_apps import results
    from flower_apps.client_app import dispatch
    from flower_apps.server_app import run
    from flower_apps.simulate import fused_run_config
    from split_layer.transport import LocalGrid

    cfg = {**fused_run_config(None), "algo": "fedavg", "model": "mlp", "num-rounds": 3, "local-steps": 1,
           "device": "cpu", "results-dir": str(tmp_path / "results"), "run-name": "r"}
    elsewhere, moved = tmp_path / "elsewhere", tmp_path / "moved"
    elsewhere.mkdir()
    real = results.RunFolder.save_checkpoint

    def save_then_swap(self, rnd, state):
        real(self, rnd, state)
        if rnd == 1:
            self.path.rename(moved)
            self.path.symlink_to(elsewhere, target_is_directory=True)

    monkeypatch.setattr(results.RunFolder, "save_checkpoint", save_then_swap)
    run(LocalGrid(3, dispatch, run_config=cfg), cfg)
    assert list(elsewhere.iterdir()) == []
    assert {"metrics.jsonl", "checkpoint.pt", "model.pt", "curves.png"} <= {p.name for p in moved.iterdir()}
    assert [json.loads(x)["round"] for x in (moved / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
