"""SCALA-PE: SCALA whose clients also make their activations hard to invert (ResSFL's regularizer).

Papers: J. Yang, Y. Liu, "SCALA: Split Federated Learning with Concatenated Activations and
Logit Adjustments" (Sec. 5.7, Table VI), following J. Li,
A. S. Rakin, X. Chen, Z. He, D. Fan, C. Chakrabarti, "ResSFL: A Resistance Transfer Framework
for Defending Model Inversion Attack in Split Federated Learning", CVPR 2022, pp. 10194-10202
(authors' code github.com/zlijingtao/ResSFL, read for the choices below: ``MIA_torch.py``
``train_target_step`` / ``gan_train_step``, ``architectures_torch.py`` ``conv_normN_AE``,
``vgg.py`` ``make_layers``, ``reproduce/table2`` scripts). Marks: [C] ResSFL's code, [ours] a
choice the sources leave open (``docs/baselines.md`` B7).

Server: SCALA's, unchanged (:class:`strategies.scala.scala.ScalaStrategy` with its switches fixed to
``server-mode = concat`` and ``logit-adjust = true``): concatenated activations, one server
model, logit-adjusted losses with P_s (server) and P_k (client gradients), Eq. 8's |D_k|-mean
of the bottoms. The model is meant to be ``vgg11`` / ``vgg11-small`` cut at ``bottleneck``
(VGG-11 split after its second conv with the 8-channel, stride-1 bottleneck pair of
:mod:`tasks.models`, as SCALA's Sec. 5.7 and ResSFL's code [C]); any model and cut work.

Client k, split step i of a round, batch (x, y) of B_k images, A = h(w_c; x) the activation sent:

* objective (SCALA's Sec. 5.7): ``f_k = L_k(w_s; A) + gamma * Rq(w_v(A), x)``, so the bottom w_c steps on
  ``G_k + gamma * dRq/dA`` back-propagated through A (G_k = dL_k/dA the server's gradient,
  unchanged; the inversion term never leaves the node);
* Rq, the reconstruction quality of the simulated inversion model w_v (``scala-pe.rq``):

  - ``ssim`` (default, ResSFL's code [C]): ``Rq = max(0, SSIM(w_v(A), x) - s0)`` with the
    threshold ``s0 = scala-pe.ssim-threshold`` (0.5 [C]; 0 means plain ``SSIM``, as the code),
    SSIM the batch mean of the Gaussian-window SSIM (11x11, sigma 1.5, zero "same" padding, as
    the ``pytorch_ssim`` package ResSFL uses; :func:`tasks.scala.inversion.batch_ssim`, equal to
    :func:`tasks.scala.inversion.ssim` with ``padding="same"``, in float32 with a separable window),
    x in [0, 1];
  - ``neg-mse`` (ResSFL's MSE mode [C]): ``Rq = -MSE(w_v(A), x)``;

  w_v is frozen (eval mode, its BatchNorm on running statistics) in this term, as in the code;
* the simulated attacker w_v (ResSFL ``conv_normN0C16`` [C], :class:`SimulatedInverter`):
  conv3x3(C_a -> 16)+BN+ReLU, two layers that are stride-2 transposed convs (3x3, + BN + ReLU)
  while up-sampling is needed and 3x3 convs otherwise, more transposed convs if
  ``floor(log2(H / H_a)) > 2``, conv3x3(16 -> C)+BN, sigmoid; [ours] a bilinear resize to
  H x W when the up-sampling does not land on it exactly, and a flat activation [B, D] is read
  as [B, D, 1, 1] (the code's confidence-score case); Xavier-uniform initialisation, zero biases
  [C], seeded by ``(seed, partition)``;
* alternation [C]: before the Rq term of the node's n-th split step (counted over all its
  rounds), if ``n % scala-pe.inverter-interval == 0`` (5 [C]), w_v takes
  ``scala-pe.inverter-steps`` (1 [C]) Adam steps (lr ``scala-pe.inverter-lr`` = 1e-3 [C]) on the
  same batch: minimise ``-SSIM(w_v(A), x)`` (``rq = ssim``) or ``MSE(w_v(A), x)`` (``neg-mse``),
  as the code does in each mode; [ours] A is the activation
  the server receives (training-mode BatchNorm; the code recomputes it in eval mode), and a
  batch of one is skipped (w_v's BatchNorm cannot train on it);
* gamma (``scala-pe.gamma``): 0.3, ResSFL's ``regularization_strength`` with ``ssim_threshold
  0.5`` in its table-2 scripts [C] (SCALA gives none; a sweep trades accuracy for
  reconstruction quality). ``gamma = 0`` gives exactly SCALA's weights (w_v still trains, and is reported).

What travels: exactly SCALA's (the activations, the labels, the gradients, the bottoms); w_v and
its optimizer stay on the node. Client contract: SCALA's (:mod:`strategies.scala.scala`), plus reply
metrics of the final step ``pe-sim-ssim`` / ``pe-sim-mse`` (the simulated attacker's mean
reconstruction SSIM / MSE on the round's batches, measured before each of its steps' Rq term)
and ``pe-penalty`` (mean ``gamma * Rq``); the server reports their mean over the round's nodes
as ``pe-sim-ssim``, ``pe-sim-mse``, ``pe-penalty``.

Node state (``AlgorithmSpec.node_state``): ``scala-pe.inverter``, an ArrayRecord with w_v's
state dict (``m.<key>``), its Adam moments and step counts (``adam.<i>.*``) and the node's
split-step counter (``count``): w_v lives on the node from round to round (ResSFL keeps one
per client) and is rebuilt from its seed only when a node has no state (first visit, or a lost
state). The message path writes it after every step, the stream path after the round.

The evaluation attacker of Table VI (64 channels, trained after the fact on activations of
held-out images) is :mod:`tasks.scala.inversion` / :mod:`flower_apps.attack`, for any split run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord
from torch import nn

from split_layer.cut import feature_shape, split_model
from strategies.core.records import algo_config
from split_layer.transport import Envelope
from split_layer.worker import SplitClientHooks, Worker, make_split_handlers
from tasks.config import ConfigError, knob
from tasks.scala.inversion import batch_ssim, normN_layers
from tasks.training import derive_seed, seeded

from ..client import AlgorithmClient
from ..registry import AlgorithmSpec, register
from .scala import ScalaConfig, ScalaStrategy

STATE_INVERTER = "scala-pe.inverter"   # node state (not "split.*": the worker clears those)
RQ_MODES = ("ssim", "neg-mse")


@dataclass(frozen=True)
class ScalaPEConfig(ScalaConfig):
    """SCALA's knobs (server-mode and logit-adjust fixed by the variant) plus the privacy term's
    (namespace ``scala-pe``)."""

    gamma: float = knob(0.3, lo=0.0, help="weight of the inversion term Rq in the client objective "
                                          "(ResSFL regularization_strength 0.3; 0 = SCALA)")
    rq: str = knob("ssim", choices=RQ_MODES,
                   help="Rq: ssim = max(0, SSIM - ssim-threshold) (ResSFL's code) | neg-mse = -MSE (the library's alternative)")
    ssim_threshold: float = knob(0.5, lo=0.0, hi=1.0, hi_open=True,
                                 help="s0 of rq=ssim: only SSIM above it is penalised (ResSFL 0.5; 0 = plain SSIM)")
    inverter_channels: int = knob(16, lo=1, help="internal channels of the simulated inverter w_v (ResSFL C16)")
    inverter_interval: int = knob(5, lo=1, help="w_v trains before every n-th split step of a node (ResSFL 5)")
    inverter_steps: int = knob(1, lo=1, help="Adam steps of w_v each time it trains (ResSFL gan_adv_step1)")
    inverter_lr: float = knob(1e-3, lo=0.0, lo_open=True, help="Adam learning rate of w_v (ResSFL 1e-3)")


# --------------------------------------------------------------------------- the simulated attacker
class SimulatedInverter(nn.Module):
    """ResSFL's ``conv_normN_AE`` with N = 0: activations ``[B, C_a, H_a, W_a]`` (or flat
    ``[B, D]``) -> images ``[B, C, H, W]`` in [0, 1] (module docstring)."""

    def __init__(self, act_shape: tuple[int, ...], image_shape: tuple[int, int, int], channels: int = 16) -> None:
        super().__init__()
        if len(act_shape) == 1:
            act_shape = (act_shape[0], 1, 1)
        if len(act_shape) != 3:
            raise ConfigError(f"scala-pe: the activation at the cut must be [C, H, W] or flat [D] per sample; "
                              f"got {list(act_shape)}")
        ca, ha, _ = (int(s) for s in act_shape)
        c, h, w = (int(s) for s in image_shape)
        ups = int(math.floor(math.log2(h / ha))) if h > ha else 0
        body, head = normN_layers(ca, c, ups, channels, blocks=0, residual=False)   # conv3x3 + BN, the head
        self.body = nn.Sequential(*body, *head)
        self.out_size = (h, w)
        for m in self.modules():  # ResSFL's init_weights
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.xavier_uniform_(m.weight, gain=1.0)
                nn.init.zeros_(m.bias)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        if a.dim() == 2:
            a = a[:, :, None, None]
        z = self.body[:-2](a)
        if tuple(z.shape[-2:]) != self.out_size:
            z = F.interpolate(z, size=self.out_size, mode="bilinear", align_corners=False)
        return torch.sigmoid(self.body[-2:](z))


# --------------------------------------------------------------------------- the objective
def inversion_term(recon: torch.Tensor, image: torch.Tensor, rq: str = "ssim",
                   ssim_threshold: float = 0.5, *, quality: torch.Tensor | None = None) -> torch.Tensor:
    """Rq of the client objective (higher = better reconstruction = worse for the client):
    ``max(0, SSIM - s0)`` (``s0 > 0``) or ``SSIM`` (``s0 = 0``) for ``rq = "ssim"``;
    ``-MSE`` for ``rq = "neg-mse"``. ``quality``: the SSIM or MSE already computed."""
    if rq == "ssim":
        q = batch_ssim(recon, image) if quality is None else quality
        return torch.clamp(q - ssim_threshold, min=0.0) if ssim_threshold > 0 else q
    if rq == "neg-mse":
        return -(F.mse_loss(recon, image) if quality is None else quality)
    raise ConfigError(f"scala-pe.rq={rq!r} is not one of: {', '.join(RQ_MODES)}")


def client_objective(task_loss: torch.Tensor, recon: torch.Tensor, image: torch.Tensor, gamma: float,
                     rq: str = "ssim", ssim_threshold: float = 0.5) -> torch.Tensor:
    """``f_k = L_k + gamma * Rq(w_v(A), x)`` (the client trains w_c on its gradient)."""
    return task_loss + gamma * inversion_term(recon, image, rq, ssim_threshold)


def inverter_loss(recon: torch.Tensor, image: torch.Tensor, rq: str = "ssim") -> torch.Tensor:
    """What w_v minimises (ResSFL ``gan_train_step``): ``-SSIM`` (``rq = ssim``) or ``MSE``."""
    return -batch_ssim(recon, image) if rq == "ssim" else F.mse_loss(recon, image)


def penalty_gradient(inverter: nn.Module, act: torch.Tensor, image: torch.Tensor, gamma: float,
                     rq: str = "ssim", ssim_threshold: float = 0.5) -> tuple[torch.Tensor, dict[str, float]]:
    """``gamma * dRq/dA`` at ``act`` with w_v frozen in eval mode, and the statistics of the
    reconstruction (``ssim``, ``mse``, ``penalty`` = gamma * Rq)."""
    inverter.eval()
    a = act.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        recon = inverter(a)
        q_ssim, q_mse = batch_ssim(recon, image), F.mse_loss(recon, image)
        term = inversion_term(recon, image, rq, ssim_threshold, quality=q_ssim if rq == "ssim" else q_mse)
        if gamma > 0 and term.requires_grad:
            (g,) = torch.autograd.grad(gamma * term, a)
        else:
            g = torch.zeros_like(a)
    stats = {"ssim": float(q_ssim.detach()), "mse": float(q_mse.detach()), "penalty": float(gamma * term.detach())}
    return g.detach(), stats


def train_inverter(inverter: nn.Module, opt: torch.optim.Optimizer, act: torch.Tensor, image: torch.Tensor,
                   rq: str = "ssim", steps: int = 1) -> None:
    """``steps`` optimizer steps of w_v on one batch (train mode; A detached)."""
    inverter.train()
    for _ in range(steps):
        loss = inverter_loss(inverter(act.detach()), image, rq)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


# --------------------------------------------------------------------------- node state of w_v
def _save_inverter(inv: nn.Module, opt: torch.optim.Optimizer, count: int) -> ArrayRecord:
    arrays = {f"m.{k}": Array(np.ascontiguousarray(v.detach().cpu().numpy()).reshape(v.shape or (1,)))
              for k, v in inv.state_dict().items()}
    for i, p in enumerate(inv.parameters()):
        st = opt.state.get(p, {})
        for name in ("step", "exp_avg", "exp_avg_sq"):
            if name in st:
                t = st[name]
                t = t if isinstance(t, torch.Tensor) else torch.tensor(float(t), dtype=torch.float32)
                arrays[f"adam.{i}.{name}"] = Array(np.ascontiguousarray(t.detach().cpu().numpy()).reshape(t.shape or (1,)))
    arrays["count"] = Array(np.asarray([count], dtype=np.int64))
    return ArrayRecord(arrays)


def _load_inverter(rec: ArrayRecord, inv: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> int:
    own = inv.state_dict()
    state = {k: torch.from_numpy(rec[f"m.{k}"].numpy().copy()).reshape(v.shape).to(device) for k, v in own.items()}
    inv.load_state_dict(state)
    keys = set(rec.keys())
    for i, p in enumerate(inv.parameters()):
        if f"adam.{i}.step" not in keys:
            continue
        opt.state[p] = {
            "step": torch.from_numpy(rec[f"adam.{i}.step"].numpy().copy()).reshape(()),
            "exp_avg": torch.from_numpy(rec[f"adam.{i}.exp_avg"].numpy().copy()).to(device),
            "exp_avg_sq": torch.from_numpy(rec[f"adam.{i}.exp_avg_sq"].numpy().copy()).to(device),
        }
    return int(rec["count"].numpy()[0])


# --------------------------------------------------------------------------- client hooks
class ScalaPEClientHooks(SplitClientHooks):
    """SCALA's client streams plus the inversion term (module docstring): the images of each
    step are kept for its Rq, and the term's gradient joins the server's in :meth:`feedback`
    (both transports call it once per step, in order)."""

    def forward(self, w: Worker, xb: torch.Tensor, yb: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        aug = w.env.augmenter
        u = aug.weak_uint8(xb)                 # the same draws as SplitClientHooks.forward's weak(x)
        act = w.bottom(aug.normalize(u))
        w.cache[("pe", step)] = (u, act.detach())
        return {"act": act, "labels": yb}

    def _inverter(self, w: Worker, act: torch.Tensor, cfg: ScalaPEConfig):
        if "pe-inverter" not in w.cache:
            dev = w.env.device
            with seeded(derive_seed(w.env.task.seed, "scala-pe-inverter", w.partition), dev):
                inv = SimulatedInverter(tuple(act.shape[1:]), w.env.input_shape, cfg.inverter_channels).to(dev)
            opt = torch.optim.Adam(inv.parameters(), lr=cfg.inverter_lr)
            count = 0
            if STATE_INVERTER in w.state.array_records:
                count = _load_inverter(w.state.array_records[STATE_INVERTER], inv, opt, dev)
            w.cache["pe-inverter"] = [inv, opt, count]
            w.cache["pe-stats"] = w.cache.get("pe-stats", [])
        return w.cache["pe-inverter"]

    def _keep(self, w: Worker) -> None:
        if "pe-inverter" in w.cache:
            inv, opt, count = w.cache["pe-inverter"]
            w.state[STATE_INVERTER] = _save_inverter(inv, opt, count)

    def feedback(self, w: Worker, step: int, tensors: dict[str, np.ndarray], labels: np.ndarray
                 ) -> dict[str, np.ndarray]:
        cfg = algo_config(w.algo, ScalaPEConfig)
        u, act = w.cache.pop(("pe", step))
        image = u.to(torch.float32) / 255.0
        slot = self._inverter(w, act, cfg)
        inv, opt, count = slot
        if count % cfg.inverter_interval == 0 and act.shape[0] >= 2:
            train_inverter(inv, opt, act, image, cfg.rq, cfg.inverter_steps)
        slot[2] = count + 1
        grad, stats = penalty_gradient(inv, act, image, cfg.gamma, cfg.rq, cfg.ssim_threshold)
        w.cache.setdefault("pe-stats", []).append(stats)
        if not w.streaming:   # the message path's next step is a new call: keep w_v in the node's state
            self._keep(w)
            self._stats_to_state(w)
        out = dict(tensors)
        if cfg.gamma > 0:
            out["act"] = (np.asarray(tensors["act"]) + grad.cpu().numpy()).astype(np.float32)
        return out

    @staticmethod
    def _stats_to_state(w: Worker) -> None:
        """The message path: the round's statistics so far (a new Worker per message)."""
        stats = w.cache.get("pe-stats", [])
        prev = w.state.array_records.get("split.pe-stats")
        rows = [] if prev is None else prev["rows"].numpy().tolist()
        rows += [[s["ssim"], s["mse"], s["penalty"]] for s in stats]
        w.cache["pe-stats"] = []
        w.state["split.pe-stats"] = ArrayRecord({"rows": Array(np.asarray(rows, dtype=np.float64).reshape(-1, 3))})

    def end(self, w: Worker) -> Envelope:
        self._keep(w)
        rows = [[s["ssim"], s["mse"], s["penalty"]] for s in w.cache.get("pe-stats", [])]
        prev = w.state.array_records.get("split.pe-stats")   # ("split.*": cleared by the worker after this)
        if prev is not None:
            rows = prev["rows"].numpy().tolist() + rows
        if not rows:
            return Envelope()
        m = np.asarray(rows, dtype=np.float64).mean(0)
        return Envelope(metrics={"pe-sim-ssim": float(m[0]), "pe-sim-mse": float(m[1]), "pe-penalty": float(m[2])})


# --------------------------------------------------------------------------- server
class ScalaPEStrategy(ScalaStrategy):
    """SCALA's server (unchanged); reports the nodes' simulated-attacker statistics."""

    def setup_split(self) -> None:
        super().setup_split()
        if self.env.augmenter is not None:
            bottom, _ = split_model(self.model, self.cut)
            shape = feature_shape(bottom, self.env.input_shape, self.env.device)
            if len(shape) not in (1, 3):
                raise ConfigError(f"algo='scala-pe': the activation at cut={self.cut!r} has shape {list(shape)} per "
                                  f"sample; the inversion model needs [C, H, W] or a flat [D]")

    def aggregate(self, server_round: int, finals: dict[int, Envelope]) -> dict[str, Any]:
        out = super().aggregate(server_round, finals)
        for key in ("pe-sim-ssim", "pe-sim-mse", "pe-penalty"):
            vals = [float(e.metrics[key]) for e in finals.values() if key in e.metrics]
            if vals:
                out[key] = float(np.mean(vals))
        return out


_HOOKS = ScalaPEClientHooks()

ALGORITHMS = register({
    "scala-pe": AlgorithmSpec(
        name="scala-pe", paper="SCALA-PE (Yang & Liu, Table VI), following ResSFL (Li et al., CVPR 2022)",
        strategy_cls=ScalaPEStrategy, config_cls=ScalaPEConfig, namespace="scala-pe",
        overrides={"server_mode": "concat", "logit_adjust": True}, client=make_split_handlers(_HOOKS),
        node_state=(STATE_INVERTER,),
        description="SCALA whose clients add gamma * Rq of a simulated inversion model (16-channel conv "
                    "autoencoder, trained alternately on the node) to their objective: SSIM above a threshold "
                    "(ResSFL) or -MSE"),
})


class ScalaPEClient(AlgorithmClient):
    """SCALA-PE's client with a user's split model and the node's labeled data (``labeled``):
    SCALA's split steps, with the gradient of ``gamma * Rq`` of the node's own simulated
    inversion model added to the server's before each bottom step; w_v stays on the node."""

    module = __name__
    needs = ("labeled",)
