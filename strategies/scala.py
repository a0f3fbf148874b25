"""SCALA and the split-federated baselines it is compared with, as switches of one module.

Paper: J. Yang, Y. Liu, "SCALA: Split Federated Learning with Concatenated Activations
and Logit Adjustments" (spec: ``shared/specs/scala.md``). SplitFed: C. Thapa et al.,
"SplitFed: When Federated Learning Meets Split Learning" (AAAI 2022).

The model is cut (``cut``, default: the model's) into a client part w_c (bottom) and a
server part w_s (top). Global iteration t, sampled clients C^t (``fraction-train``):

* batch shares (Eq. 3) ``B_k = |D_k| B / sum_{j in C^t} |D_j|``, floored, remainder by
  largest fraction, ``B_k >= 1``, ``sum_k B_k = B`` (:func:`batch_shares`);
* for i = 1..I (``scala.local-iterations``): client k sends A_k = h(w_c,k; X_k) [B_k x ...]
  and Y_k; the server, depending on ``scala.server-mode``:

  - ``concat`` (SCALA, CA-SFL): A = concat_k A_k, Y = concat_k Y_k (partition order),
    one forward of w_s, S = logits. Server loss (Eq. 12) L_srv = mean_n g_bal(Y_n, S_n; P_s),
    client loss (Eq. 13) L_k = (1/B_k) sum_{n in k} g_bal(Y_n, S_n; P_k); G_k = dL_k/dA_k is
    computed with w_s^i (before the step), then one SGD step of w_s on L_srv (Eq. 5);
  - ``per-client`` (SplitFedV1, LLA-SFL): one copy of w_s per client, each steps on its own
    client's loss L_k (with P_k) and G_k comes from the same loss; the copies are
    |D_k|-averaged at the end of the round;
  - ``sequential`` (SplitFedV2): one shared w_s; the sampled clients, in a seeded random
    order (``derive_seed(seed, "splitfed-v2-order", t)``, a new permutation every round),
    each run all I iterations against it in turn, starting from the same w_c (the runtime's
    :meth:`~strategies.base.SplitStrategy.visit_groups`: one client per group); each
    iteration = forward on A_k, G_k and one SGD step of w_s on L_k; the bottoms are then
    |D_k|-averaged;

  with ``g_bal(y, s; P) = CE(s + log P, y)`` (:func:`tasks.losses.logit_adjusted_ce`,
  P clamped at 1e-8) when ``scala.logit-adjust`` is on and plain CE otherwise;
* clients: A_k.backward(G_k), SGD step on w_c,k (Eq. 7); after I iterations
  w_c = sum_k |D_k| w_c,k / sum_k |D_k| (Eq. 8).

Priors (``scala.prior``): ``histogram`` [spec 8.1 R] P_k = n_k/|D_k| from the label
histogram each client reports once, P_s = sum_k n_k / sum_k |D_k| over the clients whose
activations are in the batch; ``batch``: label counts of the current (concatenated) batch.
Prediction uses the raw logits.

Variants (``algo``): ``scala`` (concat + adjust), ``ca-sfl`` (concat, no adjust),
``lla-sfl`` (per-client + adjust with P_k), ``splitfed-v1`` (per-client, CE),
``splitfed-v2`` (sequential, CE). All share the ``scala.*`` run-config namespace.

Client contract (:mod:`split_layer.worker`, ``query`` messages with ``config.op``):
``split-info`` -> reply ``split-tensors["histogram"]`` (int64 [M]) and config
``partition-id``, ``num-examples``; ``split`` step 1 carries ``split-arrays.bottom`` and
config ``split-batch`` (B_k), ``split-iters`` (I); replies of steps 1..I carry
``split-tensors`` ``act`` (float32 [B_k, *A]) and ``labels`` (int64 [B_k]); steps 2..I+1
carry ``split-tensors["act"]`` = G_k of the previous step; the reply of step I+1 carries
``split-arrays.bottom`` and ``metrics["num-examples"]``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from split_layer.cut import load_top_state, top_state_keys
from .base import SplitStrategy
from split_layer.transport import Envelope
from split_layer.worker import SplitClientHooks, make_split_handlers
from tasks.aggregate import weighted_mean
from tasks.config import ConfigError, knob
from tasks.losses import logit_adjusted_ce
from tasks.training import derive_seed, make_sgd, seeded

from .client import AlgorithmClient
from .registry import AlgorithmSpec, bind

SERVER_MODES = ("concat", "per-client", "sequential")


@dataclass(frozen=True)
class ScalaConfig:
    """SCALA / CA-SFL / LLA-SFL / SplitFedV1 / SplitFedV2 knobs (namespace ``scala``)."""

    local_iterations: int = knob(20, lo=1, help="I: split iterations per global round (paper: 20)")
    total_batch: int = knob(320, lo=1, help="B: concatenated server batch, split into B_k (paper: 320)")
    server_mode: str = knob("concat", choices=SERVER_MODES,
                            help="concat (SCALA, CA-SFL) | per-client (SplitFedV1, LLA-SFL) | sequential (SplitFedV2)")
    logit_adjust: bool = knob(True, help="g_bal with P_s (server) and P_k (client gradients)")
    prior: str = knob("histogram", choices=("histogram", "batch"), help="source of P_s and P_k (spec 8.1)")


def batch_shares(sizes, total: int, key: str = "scala.total-batch", min_share: int = 1) -> list[int]:
    """Eq. 3 with largest remainders: ``B_k ~ |D_k| B / sum|D|``, ``sum B_k = B``,
    ``B_k >= min_share`` (2 for a model with BatchNorm, which cannot train on a batch of 1)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    k = len(sizes)
    if k == 0:
        return []
    if total < k * min_share:
        why = " with BatchNorm (a batch of 1 cannot train)" if min_share > 1 else ""
        raise ConfigError(f"{key}={total} is smaller than {min_share} x the {k} participating clients "
                          f"(each needs B_k >= {min_share}{why})")
    if (sizes < 0).any() or sizes.sum() <= 0:
        raise ValueError(f"client sizes must be >= 0 with a positive sum, got {sizes.tolist()}")
    q = sizes * total / sizes.sum()
    b = np.maximum(np.floor(q).astype(np.int64), min_share)
    frac = q - np.floor(q)
    diff = int(total - b.sum())
    order = sorted(range(k), key=lambda i: (-frac[i], i))
    j = 0
    while diff > 0:
        b[order[j % k]] += 1
        diff -= 1
        j += 1
    while diff < 0:  # only after raising zeros to 1: take from the most over-allocated
        cand = [i for i in range(k) if b[i] > min_share]
        i = max(cand, key=lambda i: (b[i] - q[i], -i))
        b[i] -= 1
        diff += 1
    return [int(x) for x in b]


def _prior(counts: torch.Tensor) -> torch.Tensor:
    c = counts.to(torch.float64)
    return (c / c.sum().clamp_min(1)).to(torch.float32)


class ScalaStrategy(SplitStrategy):
    """SCALA and its switches over the split runtime (see module docstring)."""

    label_mode = "all"

    def setup_split(self) -> None:
        c = self.cfg
        self.mode, self.adjust = c.server_mode, c.logit_adjust
        self.has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        self.opt = make_sgd(self.top.parameters(), self.task)
        self.top_keys = top_state_keys(self.model, self.cut)
        self.copies: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
        self._round = 0
        self._losses: list[float] = []

    def local_iterations(self) -> int:
        return self.cfg.local_iterations

    # ------------------------------------------------------------------ round hooks
    def begin_round(self, server_round: int, nodes: list[int]) -> None:
        self._round = server_round
        shares = batch_shares([self.num_examples(n) for n in nodes], self.cfg.total_batch,
                              min_share=2 if self.has_batchnorm else 1)
        self.round_batch = dict(zip(nodes, shares))
        self._losses = []
        self.copies = {}
        if self.mode == "per-client":
            for n in nodes:
                top = copy.deepcopy(self.top)
                self.copies[n] = (top, make_sgd(top.parameters(), self.task))

    def max_batch(self, node: int) -> int:
        return int(self.cfg.total_batch)  # B_k <= B whatever the round's nodes

    def visit_groups(self, server_round: int, nodes: list[int]) -> list[list[int]]:
        """SplitFedV2 (``sequential``): every client alone, in a random order per round, seeded
        by ``(seed, round)`` (the same on a rerun or a resume); the other modes: the barrier."""
        if self.mode != "sequential":
            return super().visit_groups(server_round, nodes)
        nodes = self.order(nodes)  # partition order first: the permutation never depends on node ids
        rng = np.random.default_rng(derive_seed(self.task.seed, "splitfed-v2-order", server_round))
        return [[nodes[i]] for i in rng.permutation(len(nodes))]

    def server_snapshot(self) -> Any:
        return super().server_snapshot(), copy.deepcopy(self.opt.state_dict())

    def server_restore(self, snap: Any) -> None:
        super().server_restore(snap[0])
        self.opt.load_state_dict(snap[1])
        self.copies = {}

    def priors(self, nodes: list[int], ys: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """P_s over ``nodes`` and P_k per node (histograms or batch counts)."""
        m = self.env.num_classes
        if self.cfg.prior == "histogram":
            hists = [torch.from_numpy(self.histogram(n)).to(self.env.device) for n in nodes]
        else:
            hists = [torch.bincount(y, minlength=m) for y in ys]
        return _prior(torch.stack(hists).sum(0)), [_prior(h) for h in hists]

    def loss_rows(self, logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
        if self.adjust and prior is not None:
            return logit_adjusted_ce(logits, y, prior, reduction="none")
        return F.cross_entropy(logits, y, reduction="none")

    def _srv_seed(self, step: int, *extra: object) -> int:
        return derive_seed(self.task.seed, "split-srv", self._round, step, *extra)

    def server_iteration(self, step: int, payloads: dict[int, dict[str, torch.Tensor]]
                         ) -> dict[int, dict[str, torch.Tensor]]:
        nodes = self.order(payloads)
        ys = [payloads[n]["labels"].long() for n in nodes]
        p_s, p_k = self.priors(nodes, ys)
        self.top.train()
        if self.mode == "concat":
            return self._concat_step(step, nodes, payloads, ys, p_s, p_k)
        out, losses = {}, []
        for n, y, pk in zip(nodes, ys, p_k):
            top, opt = self.copies[n] if self.mode == "per-client" else (self.top, self.opt)
            a = payloads[n]["act"].clone().requires_grad_(True)
            with seeded(self._srv_seed(step, self.directory[n]["partition"]), self.env.device):
                logits = top(a)
            loss = self.loss_rows(logits, y, pk).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            out[n] = {"act": a.grad.detach()}
            losses.append(float(loss.detach()) * len(y))
        self._losses.append(sum(losses) / sum(len(y) for y in ys))
        return out

    def _concat_step(self, step, nodes, payloads, ys, p_s, p_k):
        acts = torch.cat([payloads[n]["act"] for n in nodes]).requires_grad_(True)
        y = torch.cat(ys)
        sizes = [len(t) for t in ys]
        with seeded(self._srv_seed(step), self.env.device):
            logits = self.top(acts)
        loss_srv = self.loss_rows(logits, y, p_s).mean()
        if self.adjust:  # per-row prior P_k of the row's client
            prior_rows = torch.cat([pk.expand(b, -1) for pk, b in zip(p_k, sizes)])
            rows = self.loss_rows(logits, y, prior_rows)
        else:
            rows = F.cross_entropy(logits, y, reduction="none")
        weights = torch.cat([torch.full((b,), 1.0 / b, device=logits.device) for b in sizes])
        loss_cli = (rows * weights).sum()   # sum_k L_k, each a mean over its own B_k rows (spec 8.2)
        params = [p for p in self.top.parameters() if p.requires_grad]
        g_top = torch.autograd.grad(loss_srv, params, retain_graph=True)
        (g_act,) = torch.autograd.grad(loss_cli, acts)
        self.opt.zero_grad(set_to_none=True)
        for p, g in zip(params, g_top):
            p.grad = g
        self.opt.step()
        self._losses.append(float(loss_srv.detach()))
        out, s = {}, 0
        for n, b in zip(nodes, sizes):
            out[n] = {"act": g_act[s:s + b].detach()}
            s += b
        return out

    def aggregate(self, server_round: int, finals: dict[int, Envelope]) -> dict[str, Any]:
        self.aggregate_bottoms(finals)
        if self.mode == "per-client":
            nodes = self.order(finals)
            states = [{k: v.detach().cpu().numpy() for k, v in self.copies[n][0].state_dict().items()}
                      for n in nodes]
            new = weighted_mean(states, [float(self.num_examples(n)) for n in nodes])
            load_top_state(self.model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()},
                           self.cut)
            self.copies = {}
        return {"train-loss": float(np.mean(self._losses)) if self._losses else float("nan"),
                "batch-sizes": [int(self.round_batch[n]) for n in self.order(finals)]}

    def split_extra_state(self) -> dict[str, Any]:
        return {"server-optimizer": self.opt.state_dict()}

    def load_split_extra_state(self, state: dict[str, Any]) -> None:
        if "server-optimizer" in state:
            self.opt.load_state_dict(state["server-optimizer"])


_CLIENT = make_split_handlers(SplitClientHooks())

_VARIANTS = {
    "scala": ("SCALA (Yang & Liu)", {"server_mode": "concat", "logit_adjust": True},
              "concatenated activations, logit adjustment with P_s (server) and P_k (client gradients)"),
    "ca-sfl": ("SCALA ablation CA-SFL (= Minibatch-SFL)", {"server_mode": "concat", "logit_adjust": False},
               "concatenated activations, plain CE"),
    "lla-sfl": ("SCALA ablation LLA-SFL", {"server_mode": "per-client", "logit_adjust": True},
                "one server copy per client, each client's loss adjusted with its P_k"),
    "splitfed-v1": ("SplitFed (Thapa et al. 2022), V1", {"server_mode": "per-client", "logit_adjust": False},
                    "one server copy per client, both halves averaged each round"),
    "splitfed-v2": ("SplitFed (Thapa et al. 2022), V2", {"server_mode": "sequential", "logit_adjust": False},
                    "one shared server part; the clients, in a seeded random order, each train all I "
                    "iterations in turn"),
}

ALGORITHMS = bind({
    name: AlgorithmSpec(name=name, paper=paper, strategy_cls=ScalaStrategy, config_cls=ScalaConfig,
                        namespace="scala", overrides=ov, client=_CLIENT, description=desc)
    for name, (paper, ov, desc) in _VARIANTS.items()
})


class ScalaClient(AlgorithmClient):
    """SCALA's client (and the SplitFed / CA-SFL / LLA-SFL baselines) with a user's split
    model and the node's labeled data (``labeled``). Each ``query.split`` step sends the
    bottom's activations and labels of one batch and applies the returned gradients; the
    server concatenates all nodes' activations and trains the top with logit adjustment."""

    module = __name__
    needs = ('labeled',)
