"""What a cut discloses: image-quality metrics and the evaluation inversion attacker (plain torch).

A split client sends its bottom's activations ``a = bottom(x)``; an honest-but-curious server
(or anyone who sees them) can train a decoder ``D`` with ``D(a) ~ x`` on images it holds and
then invert the clients' activations. :func:`attack` measures how well that works for a given
bottom: it trains a separate convolutional decoder on (activation, image) pairs of held-out
images and reports the MSE, SSIM and PSNR of its reconstructions on other held-out images.
Lower MSE and higher SSIM/PSNR mean the cut discloses more. Following ResSFL (Li, Rakin, Chen,
He, Fan, Chakrabarti, *ResSFL: A Resistance Transfer Framework for Defending Model Inversion
Attack in Split Federated Learning*, CVPR 2022; authors' code github.com/zlijingtao/ResSFL,
``MIA_torch.py``: ``MIA_attack``, ``attack``, ``test_attack``; ``architectures_torch.py``:
``conv_normN_AE`` / ``res_normN_AE``), the model-based inversion attack (MIA) of SCALA's
Table VI.

Metrics (images in ``[0, 1]`` (``data_range``), ``[N, C, H, W]``):

* :func:`mse`: mean squared error over every pixel.
* :func:`psnr`: ``10 log10(data_range^2 / MSE)``; identical images give ``inf`` (no cap).
  ``per_image=True`` gives one value per image; the attacker reports the mean of the per-image
  values (ResSFL's ``test_attack`` evaluates batches of one image and averages ``get_PSNR``).
* :func:`ssim`: the Gaussian-window SSIM of Wang, Bovik, Sheikh & Simoncelli (IEEE TIP 2004):
  11x11 window, sigma 1.5, K1 = 0.01, K2 = 0.03, local means/variances/covariance weighted by
  the window (population, not sample, statistics), per channel, averaged over the map, the
  channels and the images. ``padding="valid"`` (default: the map only where the window fits
  inside the image, as in Wang et al.'s reference code and scikit-image) or ``"same"`` (zero
  padding, as the ``pytorch_ssim`` package ResSFL uses; its border windows see zeros, so it
  reads lower near the edges). The attacker's ``ssim_padding`` setting picks one (default
  ``"valid"``); choose ``"same"`` to compare with ResSFL's published SSIM numbers.

The attacker (:class:`InversionDecoder`, trained by :func:`train_decoder`, run by
:func:`attack`):

* Architecture: SCALA's attacker, "a shallow convolutional autoencoder with an internal channel
  size of 64" (SCALA Sec. 5.7, Table VI), which in ResSFL's naming is ``conv_normN0C64``
  (``MIA_torch.py`` lines 1501-1511 parse ``conv_normN<N>C<C>``: N middle layers, C internal
  channels; ``architectures_torch.py`` lines 473-527, ``conv_normN_AE``), the default: a 3x3 conv
  to 64 channels + BN + ReLU, ``blocks`` (default 0) more conv3x3 + BN + ReLU, two stages that are
  each a stride-2 transposed conv (3x3, + BN) while up-sampling is needed and a 3x3 conv + BN
  otherwise (each + ReLU), further transposed convs (+ BN + ReLU) while needed, a 3x3 conv to the
  image's channels + BN and a sigmoid (:func:`normN_layers`). ``residual=True`` gives ResSFL's
  ``res_normN_AE`` (lines 533-582; its residual blocks, lines 12-51, are BN-ReLU-conv-BN-ReLU-conv
  plus a shortcut) in place of each conv layer and of the output conv: ``residual=True, blocks=4``
  is ResSFL's deeper ``res_normN4C64``, its strongest test-time attacker. The record names the
  decoder built (``decoder``). [ours] where ResSFL has powers of two only (32x32 CIFAR): the
  number of up-samplings is ``ceil(log2(H / H_a))`` and a bilinear resize before the output
  layer then gives exactly ``H x W`` (28 = 7 x 4 needs none); a flat activation ``[N, D]`` (a cut
  after a linear layer) is read as ``[N, D, 1, 1]`` (ResSFL's confidence-score case); PyTorch's
  default initialisation (as ResSFL's ``MIA_attack``, which does not apply ``init_weights``).
* Training as ResSFL: Adam, lr 1e-3, batch 32, MSE loss, 50 epochs there (default here 20
  [ours], a CPU budget: a knob), the decoder of the epoch with the lowest validation MSE is
  the one tested.
* Data [ours where it differs]: ResSFL trains the decoder on 90% of the dataset's *test* set
  (the attacker's own data; 10% for validation) and tests it on a fixed batch of test images
  passed through the target client's model. Here the held-out images are split by a seeded
  permutation into three disjoint parts: test (``test_fraction``, default 0.2), validation
  (``val_fraction``, default 0.1) and attacker-train (the rest), so the reported numbers are
  on images the decoder never saw (ResSFL's fixed target batch is drawn from the same test set
  its decoder trains on).
* Also reported: the same three metrics for the trivial attacker that predicts the mean
  attacker-train image for every input (``baseline-*``): an attack is informative only where
  it beats it.

Everything is seeded (:func:`tasks.training.derive_seed` from ``seed``): the split, the
decoder's initialisation and its mini-batch order; the caller's RNG is left alone.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.config import ConfigError, knob, replace_checked, to_flat
from tasks.training import derive_seed, seeded

__all__ = [
    "AttackConfig",
    "InversionDecoder",
    "as_unit_images",
    "attack",
    "gaussian_window",
    "mse",
    "normN_layers",
    "psnr",
    "split_indices",
    "ssim",
    "train_decoder",
]


# --------------------------------------------------------------------------- metrics
def _check_pair(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.shape != y.shape:
        raise ValueError(f"images of different shapes: {tuple(x.shape)} vs {tuple(y.shape)}")
    if x.dim() != 4:
        raise ValueError(f"images must be [N, C, H, W]; got shape {tuple(x.shape)}")


def mse(x: torch.Tensor, y: torch.Tensor, *, per_image: bool = False) -> float | torch.Tensor:
    """Mean squared error over every pixel (``per_image``: one value per image, ``[N]``)."""
    _check_pair(x, y)
    d = (x.double() - y.double()).pow(2).flatten(1).mean(1)
    return d if per_image else float(d.mean())


def psnr(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0, *,
         per_image: bool = False) -> float | torch.Tensor:
    """Peak signal-to-noise ratio in dB, ``10 log10(data_range^2 / MSE)`` over the whole batch
    (``per_image``: one value per image). Identical images: ``inf``."""
    m = mse(x, y, per_image=True)
    if per_image:
        return 10.0 * torch.log10(data_range ** 2 / m)
    total = float(m.mean())
    return math.inf if total == 0.0 else 10.0 * math.log10(data_range ** 2 / total)


def gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """The normalised 2-D Gaussian window ``[size, size]`` (float64)."""
    r = torch.arange(size, dtype=torch.float64) - (size - 1) / 2.0
    g = torch.exp(-(r ** 2) / (2.0 * sigma ** 2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0, window: int = 11, sigma: float = 1.5, *,
         padding: str = "valid", per_image: bool = False, k1: float = 0.01,
         k2: float = 0.03) -> float | torch.Tensor:
    """Structural similarity (Wang et al. 2004), Gaussian window, averaged over the image's SSIM
    map, its channels and (unless ``per_image``) the images. See the module docstring."""
    _check_pair(x, y)
    if padding not in ("valid", "same"):
        raise ValueError(f"padding={padding!r}: allowed 'valid' or 'same'")
    _n, c, h, w = x.shape
    if window < 1 or window % 2 == 0:
        raise ValueError(f"window={window} must be a positive odd number")
    if padding == "valid" and (h < window or w < window):
        raise ValueError(f"images of {h}x{w} are smaller than the {window}x{window} SSIM window; "
                         f"pass a smaller odd window (<= {min(h, w)}) or padding='same'")
    kern = gaussian_window(window, sigma).to(x.device)[None, None].expand(c, 1, window, window)
    pad = window // 2 if padding == "same" else 0
    a, b = x.double(), y.double()

    def filt(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, kern, padding=pad, groups=c)

    mu_a, mu_b = filt(a), filt(b)
    var_a = filt(a * a) - mu_a ** 2
    var_b = filt(b * b) - mu_b ** 2
    cov = filt(a * b) - mu_a * mu_b
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    smap = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    per = smap.flatten(1).mean(1)
    return per if per_image else float(per.mean())


def batch_ssim(recon: torch.Tensor, image: torch.Tensor, window: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Differentiable batch-mean SSIM as ``pytorch_ssim.SSIM()`` (11x11 Gaussian window, sigma
    1.5, zero "same" padding, K1 = 0.01, K2 = 0.03, data range 1), in the images' dtype: the
    value of :func:`ssim` with ``padding="same"`` (tests/test_scala_pe.py checks it), computed
    with the window's two separable 1-D passes, fast enough for a training loss (SCALA-PE's
    client objective, :mod:`strategies.scala.scala_pe`); :func:`ssim` is the float64 measurement."""
    c = recon.shape[1]
    r = torch.arange(window, dtype=torch.float64) - (window - 1) / 2.0
    g = torch.exp(-(r ** 2) / (2.0 * sigma ** 2))
    g = (g / g.sum()).to(device=recon.device, dtype=recon.dtype)
    kh, kw = g.view(1, 1, 1, window).expand(c, 1, 1, window), g.view(1, 1, window, 1).expand(c, 1, window, 1)
    pad = window // 2

    def filt(t: torch.Tensor) -> torch.Tensor:
        t = F.conv2d(t, kh, padding=(0, pad), groups=c)
        return F.conv2d(t, kw, padding=(pad, 0), groups=c)

    a, b = recon, image.to(recon.dtype)
    mu_a, mu_b = filt(a), filt(b)
    var_a, var_b, cov = filt(a * a) - mu_a ** 2, filt(b * b) - mu_b ** 2, filt(a * b) - mu_a * mu_b
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    smap = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return smap.mean()


def _ssim_window_for(h: int, w: int, window: int = 11) -> int:
    """The SSIM window for images of ``h x w``: 11, or the largest odd size that fits [ours]."""
    size = min(window, h, w)
    return size if size % 2 == 1 else size - 1


def quality(recon: torch.Tensor, images: torch.Tensor, ssim_padding: str = "valid") -> dict[str, float]:
    """MSE, SSIM (mean per image) and PSNR (mean of the per-image values) of reconstructions."""
    win = _ssim_window_for(images.shape[2], images.shape[3])
    return {"mse": mse(recon, images),
            "ssim": float(ssim(recon, images, window=win, padding=ssim_padding, per_image=True).mean()),
            "psnr": float(psnr(recon, images, per_image=True).mean())}


# --------------------------------------------------------------------------- the attacker's decoder
class ResBlock(nn.Module):
    """ResSFL's ``ResBlock(in, out, bn=True)`` (``architectures_torch.py`` lines 12-51):
    BN-ReLU-conv3x3-BN-ReLU-conv3x3 plus a shortcut (the identity, or conv1x1 without bias + BN
    where the width changes); no ReLU after the sum."""

    def __init__(self, ch: int, out: int | None = None) -> None:
        super().__init__()
        out = ch if out is None else out
        self.body = nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, out, 3, padding=1),
                                  nn.BatchNorm2d(out), nn.ReLU(), nn.Conv2d(out, out, 3, padding=1))
        self.shortcut: nn.Module = (nn.Identity() if out == ch else
                                    nn.Sequential(nn.Conv2d(ch, out, 1, bias=False), nn.BatchNorm2d(out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shortcut(x) + self.body(x)


def normN_layers(in_ch: int, out_ch: int, ups: int, channels: int = 64, blocks: int = 0,
                 residual: bool = False) -> tuple[list[nn.Module], list[nn.Module]]:
    """The layers of ResSFL's decoders ``conv_normN<N>C<C>`` (``conv_normN_AE``,
    ``architectures_torch.py`` lines 473-527) and ``res_normN<N>C<C>`` (``res_normN_AE``, lines
    533-582), N = ``blocks``, C = ``channels``, with ``ups`` stride-2 up-samplings; the names are
    parsed in ``MIA_torch.py`` lines 1501-1523 (``MIA_attack``) and 462-483 (the simulated
    attacker). Returned as ``(body, head)``: ``head`` maps C channels to ``out_ch`` (conv3x3 + BN,
    or a ``ResBlock``), the final activation is the caller's. ``conv``: conv3x3(in -> C) + BN + ReLU,
    N x (conv3x3 + BN + ReLU), two stages that are each a stride-2 transposed conv3x3 + BN while
    up-sampling is needed and a conv3x3 + BN otherwise (each + ReLU), then the remaining
    ``ups - 2`` transposed convs (+ BN + ReLU). ``res``: the same with ``ResBlock(in, C)`` + ReLU
    first, N x (``ResBlock`` + ReLU), a ``ResBlock`` where a stage needs no up-sampling, and
    ``ResBlock(C, out)`` as the head."""
    c = channels

    def up() -> list[nn.Module]:
        return [nn.ConvTranspose2d(c, c, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(c)]

    def same() -> list[nn.Module]:
        return [ResBlock(c)] if residual else [nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)]

    body: list[nn.Module] = ([ResBlock(in_ch, c), nn.ReLU()] if residual else
                             [nn.Conv2d(in_ch, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()])
    for _ in range(blocks):
        body += [*same(), nn.ReLU()]
    body += [*(up() if ups >= 1 else same()), nn.ReLU()]
    body += [*(up() if ups >= 2 else same()), nn.ReLU()]
    for _ in range(max(0, ups - 2)):
        body += [*up(), nn.ReLU()]
    head: list[nn.Module] = [ResBlock(c, out_ch)] if residual else [nn.Conv2d(c, out_ch, 3, padding=1),
                                                                      nn.BatchNorm2d(out_ch)]
    return body, head


class InversionDecoder(nn.Module):
    """Maps activations ``[N, C_a, H_a, W_a]`` (or flat ``[N, D]``) to images ``[N, C, H, W]`` in
    [0, 1]: ResSFL's ``conv_normN<blocks>C<channels>`` (default ``conv_normN0C64``, SCALA's
    attacker) or, ``residual=True``, ``res_normN<blocks>C<channels>`` (:func:`normN_layers`; the
    module docstring)."""

    def __init__(self, act_shape: tuple[int, ...], image_shape: tuple[int, int, int], channels: int = 64,
                 blocks: int = 0, residual: bool = False) -> None:
        super().__init__()
        if len(act_shape) == 1:
            act_shape = (act_shape[0], 1, 1)
        if len(act_shape) != 3:
            raise ValueError(f"activation shape per sample must be [C, H, W] or [D]; got {list(act_shape)}")
        ca, ha, wa = (int(s) for s in act_shape)
        c, h, w = (int(s) for s in image_shape)
        self.out_size = (h, w)
        self.name = f"{'res' if residual else 'conv'}_normN{blocks}C{channels}"
        ups = max(0, math.ceil(math.log2(max(h / ha, w / wa)))) if max(h / ha, w / wa) > 1 else 0
        body, head = normN_layers(ca, c, ups, channels, blocks, residual)
        self.body = nn.Sequential(*body)
        self.resize = (ha * 2 ** ups, wa * 2 ** ups) != (h, w)
        self.out = nn.Sequential(*head)
        self.upsamplings = ups

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if a.dim() == 2:
            a = a[:, :, None, None]
        z = self.body(a)
        if self.resize:
            z = F.interpolate(z, size=self.out_size, mode="bilinear", align_corners=False)
        return torch.sigmoid(self.out(z))


# --------------------------------------------------------------------------- settings
@dataclass
class AttackConfig:
    """The attacker's settings (``python -m flower_apps.attack --help`` lists them as options)."""

    epochs: int = knob(20, lo=1, help="decoder training epochs over the attacker-train images (ResSFL: 50)")
    batch_size: int = knob(32, lo=1, help="decoder mini-batch size (ResSFL: 32)")
    lr: float = knob(1e-3, lo=0.0, lo_open=True, help="Adam learning rate (ResSFL: 1e-3)")
    channels: int = knob(64, lo=1, help="the decoder's internal channels C (SCALA Sec. 5.7: 64)")
    blocks: int = knob(0, lo=0, help="the decoder's middle layers N (SCALA's shallow conv_normN0C64: 0; "
                                     "ResSFL's res_normN4C64: 4)")
    residual: bool = knob(False, help="false: conv layers, ResSFL's conv_normN<N>C<C> (SCALA's attacker); "
                                      "true: residual blocks, ResSFL's res_normN<N>C<C> (with blocks=4 its "
                                      "deeper res_normN4C64)")
    test_fraction: float = knob(0.2, lo=0.0, hi=1.0, lo_open=True, hi_open=True,
                                help="share of the held-out images the decoder is tested on (never trained on)")
    val_fraction: float = knob(0.1, lo=0.0, hi=1.0, hi_open=True,
                               help="share of the rest kept to pick the decoder's best epoch (0: the last epoch)")
    num_images: int = knob(0, lo=0, help="held-out images to use (0 = all; the command's --images)")
    ssim_padding: str = knob("valid", choices=("valid", "same"),
                             help="SSIM map where the window fits (Wang et al.) or zero-padded (ResSFL's pytorch_ssim)")
    seed: int = knob(0, lo=0, help="seed of the split, the decoder's initialisation and its batch order")


def attack_config(cfg: AttackConfig | None = None, **kw: Any) -> AttackConfig:
    """``cfg`` (default: the defaults) with the keyword settings replaced (``test_fraction=0.3``),
    every value checked: a bad one is a :class:`tasks.config.ConfigError` naming the key and the
    allowed values."""
    try:
        return replace_checked(cfg if cfg is not None else AttackConfig(), **kw)
    except TypeError as e:   # an unknown name
        raise ConfigError(f"attack settings: {e}") from None


def split_indices(n: int, cfg: AttackConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint ``(train, val, test)`` indices of ``n`` held-out images (seeded permutation; the
    first ``cfg.num_images`` of it when set)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(cfg.seed, "attack-split")))
    perm = perm.numpy()
    if cfg.num_images:
        perm = perm[: cfg.num_images]
    m = len(perm)
    n_test = max(1, round(cfg.test_fraction * m))
    n_val = round(cfg.val_fraction * (m - n_test))
    n_train = m - n_test - n_val
    if n_train < 1:
        raise ConfigError(f"images: {m} held-out image(s) leave none to train the attacker on "
                          f"(test-fraction={cfg.test_fraction}, val-fraction={cfg.val_fraction}); "
                          f"use more images (at least 3) or smaller fractions")
    return perm[n_test + n_val:], perm[n_test: n_test + n_val], perm[:n_test]


def as_unit_images(images: Any) -> torch.Tensor:
    """Images as float ``[N, C, H, W]`` in [0, 1]: uint8 (divided by 255) or float already in
    [0, 1]; numpy or torch; ``[N, H, W]`` gets a channel axis."""
    t = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    if t.dim() == 3:
        t = t[:, None]
    if t.dim() != 4:
        raise ConfigError(f"images must be [N, C, H, W] (or [N, H, W]); got shape {list(t.shape)}")
    if t.dtype == torch.uint8:
        return t.float() / 255.0
    t = t.float()
    if t.numel() and (float(t.min()) < 0.0 or float(t.max()) > 1.0):
        raise ConfigError("float images must lie in [0, 1] (or pass uint8 images in 0..255)")
    return t


# --------------------------------------------------------------------------- training and testing
@torch.no_grad()
def activations(bottom: nn.Module, inputs: torch.Tensor, device: torch.device, batch_size: int = 256) -> torch.Tensor:
    """``bottom(inputs)`` in eval mode, in batches, on ``device`` (the bottom's mode is restored)."""
    was = bottom.training
    bottom.eval()
    try:
        outs = [bottom(inputs[i: i + batch_size].to(device)).detach() for i in range(0, len(inputs), batch_size)]
    finally:
        bottom.train(was)
    return torch.cat(outs)


@torch.no_grad()
def _reconstruct(decoder: nn.Module, acts: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    decoder.eval()
    return torch.cat([decoder(acts[i: i + batch_size]) for i in range(0, len(acts), batch_size)])


def train_decoder(acts: torch.Tensor, images: torch.Tensor, cfg: AttackConfig, *,
                  val: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[InversionDecoder, dict[str, Any]]:
    """Train an :class:`InversionDecoder` on (activation, image) pairs with MSE (Adam); return it
    (at the epoch of the lowest validation MSE when ``val`` holds pairs, else the last) and a
    log ``{"train-mse": [...], "val-mse": [...], "best-epoch": e}``."""
    device = acts.device
    with seeded(derive_seed(cfg.seed, "attack-init"), device):
        decoder = InversionDecoder(tuple(acts.shape[1:]), tuple(images.shape[1:]), cfg.channels, cfg.blocks,
                                   cfg.residual).to(device)
    opt = torch.optim.Adam(decoder.parameters(), lr=cfg.lr)
    n = len(acts)
    log: dict[str, Any] = {"train-mse": [], "val-mse": [], "best-epoch": cfg.epochs}
    best, best_state = math.inf, None
    for epoch in range(1, cfg.epochs + 1):
        decoder.train()
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(cfg.seed, "attack-batches",
                                                                                      epoch)))
        total = 0.0
        for i in range(0, n, cfg.batch_size):
            idx = perm[i: i + cfg.batch_size].to(device)
            if len(idx) < 2 and n >= 2:   # (a batch of one cannot train BatchNorm: folded away)
                continue
            loss = F.mse_loss(decoder(acts[idx]), images[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        log["train-mse"].append(total / n)
        if val is not None and len(val[0]):
            v = mse(_reconstruct(decoder, val[0]), val[1])
            log["val-mse"].append(v)
            if v < best:
                best, best_state = v, copy.deepcopy(decoder.state_dict())
                log["best-epoch"] = epoch
    if best_state is not None:
        decoder.load_state_dict(best_state)
    decoder.eval()
    return decoder, log


def attack(bottom: nn.Module, images: Any, *, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
           device: torch.device | str | None = None, cfg: AttackConfig | None = None,
           **settings: Any) -> dict[str, Any]:
    """Train the evaluation attacker against ``bottom`` on ``images`` and report its reconstruction
    quality on held-out images.

    ``bottom``: the client part (any module, e.g. ``split_layer.cut.split_model(model, cut)[0]``),
    run in eval mode. ``images``: the held-out images, uint8 ``[N, C, H, W]`` (or float in [0, 1]):
    the reconstruction targets. ``transform(x)``: the bottom's input for unit images ``x``
    (default: ``x`` itself; the library's models take ``Augmenter.test`` of the uint8 images:
    :mod:`flower_apps.attack` passes that). ``device``: default the bottom's. Settings: ``cfg``
    or the fields of :class:`AttackConfig` as keywords (``epochs=5``).

    Returns ``{"mse", "ssim", "psnr"}`` of the decoder's reconstructions of the test images,
    ``baseline-mse/ssim/psnr`` of predicting the mean attacker-train image, the sizes of the
    three parts, the activation shape, the decoder's best epoch and the settings."""
    cfg = attack_config(cfg, **settings)
    x = as_unit_images(images)
    if device is None:
        p = next(iter(bottom.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    tr, va, te = split_indices(len(x), cfg)
    inputs = transform(x) if transform is not None else x
    acts = activations(bottom, inputs, device)
    x = x.to(device)
    t_tr, t_va, t_te = (torch.as_tensor(i, dtype=torch.long, device=device) for i in (tr, va, te))
    decoder, log = train_decoder(acts[t_tr], x[t_tr], cfg, val=(acts[t_va], x[t_va]))
    recon = _reconstruct(decoder, acts[t_te])
    q = quality(recon.cpu(), x[t_te].cpu(), cfg.ssim_padding)
    mean_img = x[t_tr].mean(0, keepdim=True).expand_as(x[t_te])
    b = quality(mean_img.cpu(), x[t_te].cpu(), cfg.ssim_padding)
    return {"mse": q["mse"], "ssim": q["ssim"], "psnr": q["psnr"],
            "baseline-mse": b["mse"], "baseline-ssim": b["ssim"], "baseline-psnr": b["psnr"],
            "ssim-window": _ssim_window_for(x.shape[2], x.shape[3]), "decoder": decoder.name,
            "n-train": len(tr), "n-val": len(va), "n-test": len(te),
            "activation-shape": list(acts.shape[1:]), "image-shape": list(x.shape[1:]),
            "best-epoch": log["best-epoch"], "final-train-mse": log["train-mse"][-1] if log["train-mse"] else None,
            "settings": {k: v for k, v in to_flat(cfg).items()}}
