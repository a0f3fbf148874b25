"""The evaluation inversion attacker (tasks.scala.inversion), its command (flower_apps.attack) and the
report tool's attack columns (flower_apps.report)."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from tasks.config import ConfigError
from tasks.scala.inversion import (
    AttackConfig,
    attack,
    attack_config,
    mse,
    psnr,
    split_indices,
    ssim,
)

C1, C2 = 0.01 ** 2, 0.03 ** 2


# --------------------------------------------------------------------------- PSNR
def test_psnr_identical_is_inf_and_a_constant_offset_is_exact():
    g = torch.Generator().manual_seed(0)
    x = 0.2 + 0.6 * torch.rand(3, 2, 9, 9, generator=g, dtype=torch.float64)
    assert psnr(x, x.clone()) == math.inf
    assert torch.isinf(psnr(x, x.clone(), per_image=True)).all()
    for d in (0.1, 0.05):
        y = x + d                                # MSE = d^2 exactly: PSNR = 10 log10(1 / d^2)
        assert mse(x, y) == pytest.approx(d * d, rel=1e-12)
        assert psnr(x, y) == pytest.approx(10 * math.log10(1 / (d * d)), abs=1e-9)
        assert torch.allclose(psnr(x, y, per_image=True), torch.full((3,), 10 * math.log10(1 / (d * d)),
                                                                     dtype=torch.float64), atol=1e-9)
    # data_range 255: an offset of 25.5 is the same 20 dB as 0.1 on [0, 1]
    assert psnr(255 * x, 255 * x + 25.5, data_range=255.0) == pytest.approx(20.0, abs=1e-9)


# --------------------------------------------------------------------------- SSIM
def _np_ssim(x: np.ndarray, y: np.ndarray, win: int = 11, sigma: float = 1.5, same: bool = False) -> float:
    """Wang et al. (2004) written out: per window position, Gaussian-weighted means, variances and
    covariance, the SSIM formula, then the mean over positions, channels and images."""
    r = np.arange(win) - (win - 1) / 2
    g = np.exp(-r ** 2 / (2 * sigma ** 2))
    g /= g.sum()
    w = np.outer(g, g)
    vals = []
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            a, b = x[n, c], y[n, c]
            if same:
                a, b = np.pad(a, win // 2), np.pad(b, win // 2)
            for i in range(a.shape[0] - win + 1):
                for j in range(a.shape[1] - win + 1):
                    pa, pb = a[i:i + win, j:j + win], b[i:i + win, j:j + win]
                    ma, mb = (w * pa).sum(), (w * pb).sum()
                    va, vb = (w * (pa - ma) ** 2).sum(), (w * (pb - mb) ** 2).sum()
                    cov = (w * (pa - ma) * (pb - mb)).sum()
                    vals.append((2 * ma * mb + C1) * (2 * cov + C2) / ((ma ** 2 + mb ** 2 + C1) * (va + vb + C2)))
    return float(np.mean(vals))


def test_ssim_identical_is_one_and_constant_images_follow_the_luminance_term():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 16, 16, generator=g)
    assert ssim(x, x.clone()) == pytest.approx(1.0, abs=1e-12)
    assert ssim(x, x.clone(), padding="same") == pytest.approx(1.0, abs=1e-12)
    # constant images a and b: zero variances, so SSIM = (2ab + C1) / (a^2 + b^2 + C1) everywhere
    a, b = 0.3, 0.7
    xa, xb = (torch.full((1, 1, 12, 12), v, dtype=torch.float64) for v in (a, b))
    assert ssim(xa, xb) == pytest.approx((2 * a * b + C1) / (a * a + b * b + C1), rel=1e-9)


@pytest.mark.parametrize("same", [False, True], ids=["valid", "same"])
def test_ssim_matches_the_formula_written_out_in_numpy(same):
    g = torch.Generator().manual_seed(2)
    x = torch.rand(2, 2, 13, 14, generator=g)
    y = (x + 0.2 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    want = _np_ssim(x.double().numpy(), y.double().numpy(), same=same)
    got = ssim(x, y, padding="same" if same else "valid")
    assert got == pytest.approx(want, abs=1e-10)
    assert 0.0 < got < 0.95     # (a real difference, not a trivially equal pair)
    # per image: the mean of the per-image values is the batch value; symmetric in its arguments
    assert float(ssim(x, y, per_image=True, padding="same" if same else "valid").mean()) == pytest.approx(got)
    assert ssim(y, x, padding="same" if same else "valid") == pytest.approx(got, abs=1e-12)
    # more noise, lower SSIM
    z = (x + 0.5 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    assert ssim(x, z) < ssim(x, y)
    with pytest.raises(ValueError, match="smaller than the 11x11 SSIM window"):
        ssim(x[:, :, :8, :8], y[:, :, :8, :8])
    assert ssim(x[:, :, :8, :8], y[:, :, :8, :8], window=7) == pytest.approx(
        _np_ssim(x[:, :, :8, :8].double().numpy(), y[:, :, :8, :8].double().numpy(), win=7), abs=1e-10)


# --------------------------------------------------------------------------- the attacker
def _mnist(n: int) -> np.ndarray:
    from tasks.data import load_dataset

    return load_dataset("mnist5k").test.x[:n]


# (the default decoder, ResSFL's conv_normN with BN before its sigmoid, needs a larger step than
# Adam's 1e-3 to leave the mean image behind in 6 epochs of 216 images)
FAST = {"epochs": 6, "channels": 16, "blocks": 1, "batch_size": 8, "lr": 1e-2, "seed": 3}


def test_split_is_disjoint_seeded_and_checked():
    cfg = AttackConfig()
    tr, va, te = split_indices(100, cfg)
    assert (len(tr), len(va), len(te)) == (72, 8, 20)
    assert len(set(tr) | set(va) | set(te)) == 100
    assert all(np.array_equal(a, b) for a, b in zip((tr, va, te), split_indices(100, cfg)))
    assert not np.array_equal(te, split_indices(100, attack_config(seed=1))[2])
    assert len(np.concatenate(split_indices(100, attack_config(num_images=40)))) == 40
    with pytest.raises(ConfigError, match="leave none to train"):
        split_indices(1, cfg)
    with pytest.raises(ConfigError, match="epochs=0 is out of range"):
        attack_config(epochs=0)
    with pytest.raises(ConfigError, match="test_fraction=1.5 is out of range"):
        attack_config(test_fraction=1.5)
    with pytest.raises(ConfigError, match="unexpected keyword argument.*epoch"):
        attack_config(epoch=3)


def test_the_attacker_inverts_an_identity_like_cut_and_not_a_blind_one():
    """An average-pooling 'bottom' (14x14 from 28x28: invertible up to detail) is reconstructed far
    better than the mean image; a bottom whose output ignores the image is not."""
    x = _mnist(300)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    r = attack(nn.AvgPool2d(2), x, **FAST)
    assert torch.equal(torch.get_rng_state(), before)        # the caller's RNG is left alone
    assert r["activation-shape"] == [1, 14, 14] and (r["n-train"], r["n-val"], r["n-test"]) == (216, 24, 60)
    assert r["mse"] < 0.35 * r["baseline-mse"], r
    assert r["ssim"] > r["baseline-ssim"] + 0.3 and r["psnr"] > r["baseline-psnr"] + 4.0, r

    class Blind(nn.Module):   # activations independent of the image
        def forward(self, t):
            return torch.zeros(len(t), 4, 7, 7)

    b = attack(Blind(), x, **FAST)
    assert b["mse"] > 0.9 * b["baseline-mse"], b
    # seeded: the same settings give the same numbers; another seed other ones
    assert attack(nn.AvgPool2d(2), x, **FAST)["mse"] == r["mse"]
    assert attack(nn.AvgPool2d(2), x, **{**FAST, "seed": 4})["mse"] != r["mse"]


def test_a_flat_activation_and_an_odd_size_are_decoded_to_the_image_size():
    from tasks.scala.inversion import InversionDecoder

    assert InversionDecoder((10,), (1, 28, 28), 8, 0)(torch.randn(2, 10)).shape == (2, 1, 28, 28)
    d = InversionDecoder((5, 5, 5), (3, 28, 28), 8, 1)
    assert d.upsamplings == 3 and d(torch.randn(2, 5, 5, 5)).shape == (2, 3, 28, 28)
    assert InversionDecoder((4, 7, 7), (1, 28, 28), 8, 1).resize is False   # 7 x 4 = 28: no resize
    y = d(torch.randn(2, 5, 5, 5))
    assert float(y.detach().min()) >= 0.0 and float(y.detach().max()) <= 1.0


def _layers(m: nn.Module) -> list[str]:
    """The decoder's layers in order as ``Kind(in,out)`` strings (ResBlocks as one entry)."""
    from tasks.scala.inversion import ResBlock

    out = []
    for layer in m.modules():
        if isinstance(layer, ResBlock):
            out.append(f"Res({layer.body[2].in_channels},{layer.body[2].out_channels})")
        elif isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d)) and not any(
                layer is sub for r in m.modules() if isinstance(r, ResBlock) for sub in r.modules()):
            out.append(f"{type(layer).__name__}({layer.in_channels},{layer.out_channels})")
    return out


def test_the_default_decoder_is_scalas_shallow_64_channel_conv_normN0C64():
    """SCALA Sec. 5.7: a shallow conv autoencoder with 64 internal channels, ResSFL's
    conv_normN0C64 (architectures_torch.py conv_normN_AE): conv(in->64)+BN+ReLU, two stages
    (transposed convs where up-sampling is needed, else convs), conv(64->C)+BN, sigmoid."""
    from tasks.scala.inversion import InversionDecoder

    assert (AttackConfig().channels, AttackConfig().blocks, AttackConfig().residual) == (64, 0, False)
    cfg = AttackConfig()
    # VGG-11's bottleneck at 28x28: 8x7x7 -> two up-samplings, both stages transposed convs
    d = InversionDecoder((8, 7, 7), (1, 28, 28), cfg.channels, cfg.blocks, cfg.residual)
    assert d.name == "conv_normN0C64"
    assert _layers(d) == ["Conv2d(8,64)", "ConvTranspose2d(64,64)", "ConvTranspose2d(64,64)", "Conv2d(64,1)"]
    assert [type(m).__name__ for m in d.out] == ["Conv2d", "BatchNorm2d"]   # ResSFL's last conv + BN
    assert sum(isinstance(m, nn.BatchNorm2d) for m in d.modules()) == 4
    # no up-sampling needed (a cut at full size): the two stages are 3x3 convs ("two required")
    d0 = InversionDecoder((32, 28, 28), (1, 28, 28))
    assert _layers(d0) == ["Conv2d(32,64)", "Conv2d(64,64)", "Conv2d(64,64)", "Conv2d(64,1)"]
    # three up-samplings: one more transposed conv after the two stages
    assert _layers(InversionDecoder((8, 4, 4), (3, 32, 32))) == [
        "Conv2d(8,64)", "ConvTranspose2d(64,64)", "ConvTranspose2d(64,64)", "ConvTranspose2d(64,64)", "Conv2d(64,3)"]
    assert d(torch.randn(2, 8, 7, 7)).shape == (2, 1, 28, 28)


def test_ressfls_deeper_res_normN4C64_is_an_option():
    """ResSFL's res_normN4C64 (architectures_torch.py res_normN_AE): ResBlock(in->64)+ReLU, 4 x
    (ResBlock+ReLU), the two stages, ResBlock(64->C), sigmoid."""
    from tasks.scala.inversion import InversionDecoder, ResBlock

    cfg = attack_config(blocks=4, residual=True)
    d = InversionDecoder((8, 7, 7), (1, 28, 28), cfg.channels, cfg.blocks, cfg.residual)
    assert d.name == "res_normN4C64"
    assert _layers(d) == ["Res(8,64)", *["Res(64,64)"] * 4, "ConvTranspose2d(64,64)", "ConvTranspose2d(64,64)",
                          "Res(64,1)"]
    blocks = [m for m in d.modules() if isinstance(m, ResBlock)]
    assert len(blocks) == 6 and all(len(b.body) == 6 for b in blocks)   # BN-ReLU-conv-BN-ReLU-conv
    assert isinstance(blocks[0].shortcut, nn.Sequential) and isinstance(blocks[1].shortcut, nn.Identity)
    # no up-sampling: the stages are residual blocks too
    assert _layers(InversionDecoder((8, 28, 28), (1, 28, 28), 64, 4, True)) == [
        "Res(8,64)", *["Res(64,64)"] * 6, "Res(64,1)"]
    deeper = sum(p.numel() for p in d.parameters())
    shallow = sum(p.numel() for p in InversionDecoder((8, 7, 7), (1, 28, 28)).parameters())
    assert deeper > 5 * shallow, (deeper, shallow)
    y = d(torch.randn(2, 8, 7, 7))
    assert y.shape == (2, 1, 28, 28) and float(y.min()) >= 0.0 and float(y.max()) <= 1.0


def test_a_users_model_and_cut():
    from flower_apps.attack import attack_model

    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(196, 10))
    r = attack_model(net, "2", _mnist(40), epochs=1, channels=8, blocks=0)
    assert r["activation-shape"] == [4, 14, 14] and r["n-test"] == 8
    with pytest.raises(ConfigError, match="cut='9'"):
        attack_model(net, "9", _mnist(40), epochs=1)


# --------------------------------------------------------------------------- the command and the report
@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """A 1-round scala run (cnn cut after conv1, 3 nodes), in process over LocalGrid."""
    import os

    from flower_apps.papers import run_one
    from flower_apps.simulate import fused_run_config

    tmp = tmp_path_factory.mktemp("attack-run")
    old = os.environ.get("FLOWER_SSL_STATE_DIR")
    os.environ["FLOWER_SSL_STATE_DIR"] = str(tmp / "node-state")
    try:
        over = {"algo": "scala", "model": "cnn", "cut": "conv1", "num-rounds": 1, "min-nodes": 2,
                "scala.local-iterations": 2, "scala.total-batch": 32, "device": "cpu", "partition": "iid",
                "run-name": "scala-s0", "results-dir": str(tmp / "runs")}
        cfg = {**fused_run_config(None), **over}
        return run_one(cfg, set(over), 3, "inprocess")
    finally:
        if old is None:
            os.environ.pop("FLOWER_SSL_STATE_DIR", None)
        else:
            os.environ["FLOWER_SSL_STATE_DIR"] = old


def test_the_command_writes_the_attack_and_the_report_shows_it(split_run, tmp_path, capsys):
    from flower_apps.attack import main as attack_main
    from flower_apps.report import main as report_main

    run = tmp_path / "runs" / "scala-s0"
    shutil.copytree(split_run, run)
    assert attack_main([str(run), "--images", "120", "--epochs", "2", "--channels", "8", "--blocks", "1"]) == 0
    out = capsys.readouterr().out
    assert "scala cut=conv1 round 1: accuracy" in out and "attack MSE" in out
    rec = json.loads((run / "attack.json").read_text())
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert rec["round"] == 1 and rec["accuracy"] == final["accuracy"]
    assert rec["cut"] == "conv1" and rec["cut-from"] == "run config" and rec["weights"] == "checkpoint.pt"
    assert rec["activation-shape"] == [32, 12, 12] and rec["n-test"] == 24
    assert rec["decoder"] == "conv_normN1C8"   # --blocks 1 --channels 8, conv layers (the default)
    assert rec["settings"]["num-images"] == 120 and rec["settings"]["epochs"] == 2
    for k in ("attack-mse", "attack-ssim", "attack-psnr", "baseline-mse"):
        assert isinstance(rec[k], float) and math.isfinite(rec[k])
    # the report: three more columns, with this run's numbers; a run without an attack gets n/a
    other = tmp_path / "runs" / "scala-s1"
    shutil.copytree(split_run, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "seed": 1, "run-name": "scala-s1"}))
    assert report_main([str(tmp_path / "runs"), "--out", "-", "--figure", ""]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("| attack MSE | attack SSIM | attack PSNR |")
    assert lines[2].endswith(f"| {rec['attack-mse']:.4f} | {rec['attack-ssim']:.3f} | {rec['attack-psnr']:.2f} |")
    assert lines[3].endswith("| n/a | n/a | n/a |")
    assert report_main([str(tmp_path / "runs"), "--by-seed", "--out", "-", "--figure", ""]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("| attack MSE | attack SSIM | attack PSNR |")
    # (mean ± std over the seeds that have an attack: here one)
    assert lines[2].endswith(f"| {rec['attack-mse']:.4f} ± 0.0000 | {rec['attack-ssim']:.3f} ± 0.000 "
                             f"| {rec['attack-psnr']:.2f} ± 0.00 |")
    # another attacker's record goes beside it, not over it; a name that is no file name is refused first
    assert attack_main([str(run), "--images", "120", "--epochs", "1", "--channels", "8", "--blocks", "0",
                        "--save-as", "conv0"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"written: {run / 'attack-conv0.json'}")
    other_rec = json.loads((run / "attack-conv0.json").read_text())
    assert other_rec["decoder"] == "conv_normN0C8" and json.loads((run / "attack.json").read_text()) == rec
    from flower_apps.report import read_run
    assert read_run(run).attack_value("attack-mse", "conv0") == other_rec["attack-mse"]
    assert attack_main([str(run), "--save-as", "../x"]) == 2
    assert "save-as='../x': a name of letters, digits and _.-" in capsys.readouterr().err
    # without any attack.json the tables are as before
    (run / "attack.json").unlink()
    assert report_main([str(tmp_path / "runs"), "--out", "-", "--figure", ""]) == 0
    assert "attack" not in capsys.readouterr().out


def test_a_full_model_run_needs_a_cut(split_run, tmp_path, capsys):
    from flower_apps.attack import attack_run
    from flower_apps.attack import main as attack_main

    run = tmp_path / "fedavg-run"
    shutil.copytree(split_run, run)
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "algo": "fedavg"}))
    assert attack_main([str(run), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "algo='fedavg' trains the full model" in err and "scala" in err and "--cut" in err
    assert not (run / "attack.json").exists()
    rec = attack_run(run, cut="conv2", epochs=1, num_images=60, channels=8, blocks=0, write=False)
    assert rec["cut"] == "conv2" and rec["cut-from"] == "--cut (what-if)" and rec["activation-shape"] == [64, 4, 4]
    with pytest.raises(ConfigError, match="cut='nope' is not a cut point of model='cnn'; allowed: conv1, conv2, fc1"):
        attack_run(run, cut="nope", epochs=1)
    assert attack_main([str(tmp_path / "missing")]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert attack_main([str(run), "--cut", "conv1", "--epochs", "0"]) == 2
    assert "epochs=0 is out of range; allowed [1, inf]" in capsys.readouterr().err
    assert attack_main([str(run), "--cut", "conv1", "--ssim-padding", "full"]) == 2
    assert "ssim_padding='full' is not one of: valid, same" in capsys.readouterr().err


def test_the_attacker_keeps_to_the_device():
    """Under the emulated accelerator (tests/accel_emulation.py) a host tensor fed to a device
    tensor raises: the activations, images, indices and decoder all live on the device."""
    from tests.accel_emulation import DEVICE, emulated_accelerator

    x = _mnist(40)
    with emulated_accelerator():
        bottom = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.AvgPool2d(2)).to(DEVICE)
        r = attack(bottom, x, epochs=1, channels=8, blocks=1)
    assert r["activation-shape"] == [4, 14, 14] and math.isfinite(r["mse"])
