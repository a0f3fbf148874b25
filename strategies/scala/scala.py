"""SCALA and the split-federated baselines it is compared with, as switches of one module.

Paper: J. Yang, Y. Liu, "SCALA: Split Federated Learning with Concatenated Activations
and Logit Adjustments" (method: its Sec. 3 and Algorithm 1). SplitFed: C. Thapa et al.,
"SplitFed: When Federated Learning Meets Split Learning" (AAAI 2022). SFLLocalLoss: D.-J. Han,
H. I. Bhatti, J. Lee, J. Moon, "Accelerating Federated Learning with Split Learning on Locally
Generated Losses", ICML 2021 Workshop on Federated Learning for User Privacy and Data
Confidentiality. CS-SFL: C. Xie, Z. Chen, W. Yi, H. Shin, A. Nallanathan, "Tackling Class
Imbalance and Client Heterogeneity for Split Federated Learning in Wireless Networks", IEEE
Trans. Wireless Commun., 2025 (SCALA's [11]). Minibatch-SFL: SCALA's name (Table III) for
CA-SFL. What was reconstructed for SFLLocalLoss and CS-SFL, and why: ``docs/baselines.md``
(B5, B6).

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

Priors (``scala.prior``; the SCALA paper, Sec. 3.3, calls P_s "the distribution of concatenated
labels" and P_k client k's label distribution without saying how they are estimated):
``histogram`` (default, our choice: the expected make-up of the batch) P_k = n_k/|D_k| from the label
histogram each client reports once, P_s = sum_k n_k / sum_k |D_k| over the clients whose
activations are in the batch; ``batch``: label counts of the current (concatenated) batch.
Prediction uses the raw logits.

Variants (``algo``): ``scala`` (concat + adjust), ``ca-sfl`` (concat, no adjust) and its alias
``minibatch-sfl`` (the same switches under the name of SCALA's Table III: the same weights),
``lla-sfl`` (per-client + adjust with P_k), ``splitfed-v1`` (per-client, CE),
``splitfed-v2`` (sequential, CE), ``sfl-local-loss`` (local-loss, CE; :class:`SFLLocalLossStrategy`)
and ``cs-sfl`` (per-client, CE, balanced selection; :class:`CSSFLStrategy`). All share the
``scala.*`` run-config namespace.

**SFLLocalLoss** (``scala.server-mode='local-loss'``, partly our reconstruction: no text or code of the
original was found). Each client k holds w_c,k and an auxiliary head a_k = flatten + one linear
layer from the cut's activation to the M classes (:func:`make_aux_head`, sized from the cut's
feature shape, so any model can be cut; our choice; initialised once on the server, seeded by
``derive_seed(seed, "sfl-aux-head")``). Each iteration i: A_k = h(w_c,k; X_k); one SGD step of
(w_c,k, a_k) on ``L_k = CE(a_k(A_k), Y_k)`` (the head's own SGD with the task's settings, which
for SGD equals one optimizer over both); then A_k (computed before that step, detached) and
Y_k go up. The server takes one SGD step of its single w_s per client, on ``CE(w_s(A_k), Y_k)``,
the clients in a seeded random order per iteration (``derive_seed(seed,
"sfl-local-loss-order", round, i)``, our choice: sequential steps, unlike Minibatch-SFL's one step on
the concatenation); **no gradient goes down** (the runtime's gradient messages are empty:
no ``bytes.gradients``). End of round: w_c and a are both |D_k|-averaged. The client
never uses the server: its weights do not depend on w_s. Choices [ours]: the batch B_k of
Eq. 3 (as every split row here, instead of the original's per-client batch); the clients run
in lockstep with the server (one forward per step, the same exchanges as the other rows),
though nothing forces them to wait; the round metrics ``server-loss`` (= ``train-loss``) and
``client-loss`` (the mean of the clients' local losses, ``aux-loss`` of their final replies;
both are reported, since neither alone shows how the two halves train). Prediction: the full
model w_s(h(w_c; x)) (the head is a training aid only) [ours].

**CS-SFL** (``scala.balanced-selection``, our reconstruction: no text or code of the
original was found). SplitFedV1 (per-client server copies, plain CE, both halves
|D_k|-averaged) whose server chooses the round's clients (as many as ``fraction-train`` and
``min-nodes`` give) class-balanced: from the label histograms n_k of the one-time ``split-info``
query (already asked of every split node for SCALA's priors and, when not every node is
sampled, asked of every node then: no new query), by the QCID of the chosen set (Fed-CBS,
:mod:`tasks.client_sampling`). ``scala.selection-rule``: ``cbs`` (default [ours]) draws the
clients one after another from Fed-CBS's step probabilities (``P_1(n) ~ 1/QCID({n}) + lambda
sqrt(3 ln(t+1) / (2 T_n))``, ``P_2(n) ~ QCID({c_1, n})^-2 / P_1(n)``, ``P_k(n) ~
QCID(S_{k-1})^(k-1) / QCID(S_{k-1} + {n})^k``; t the 0-based round, T_n = 1 + the node's past
selections, lambda = ``scala.selection-lambda`` = 10 as Fed-CBS), seeded by ``derive_seed(seed,
"cs-sfl-sample", round)``; ``greedy`` (a deterministic variant, our choice) takes the most probable first pick (its
UCB score, so that every client is eventually picked) and then each time the client that
minimises the QCID of the set so far plus it (ties: partition order). Nodes without a
histogram (or with an empty one) are chosen only when too few have one (uniformly, seeded).
T_n is kept by partition id in the checkpoint. The switch works with every server mode
(both SplitFed versions: ``algo='splitfed-v2' scala.balanced-selection=true``); ``cs-sfl``
fixes it on SplitFedV1 (our choice). Round metric ``sampled-qcid``. The wireless resource
allocation of the original is not modelled.

Client contract (:mod:`split_layer.worker`, ``query`` messages with ``config.op``):
``split-info`` -> reply ``split-tensors["histogram"]`` (int64 [M]) and config
``partition-id``, ``num-examples``; ``split`` step 1 carries ``split-arrays.bottom`` and
config ``split-batch`` (B_k), ``split-iters`` (I); replies of steps 1..I carry
``split-tensors`` ``act`` (float32 [B_k, *A]) and ``labels`` (int64 [B_k]); steps 2..I+1
carry ``split-tensors["act"]`` = G_k of the previous step; the reply of step I+1 carries
``split-arrays.bottom`` and ``metrics["num-examples"]``. SFLLocalLoss: step 1 also carries
``split-arrays.aux-head`` (``1.weight`` [M, D], ``1.bias`` [M], float32); steps 2..I+1 carry no
tensors (each reply of steps 1..I is sent after the client's local step); the final reply
also carries ``split-arrays.aux-head`` (trained) and ``metrics["aux-loss"]``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flwr.common import log
from logging import WARNING

from split_layer.cut import load_top_state, top_state_keys
from ..split_base import SplitStrategy
from split_layer.transport import Envelope
from split_layer.validation import SplitValidationError, TensorSpec, check_streams
from split_layer.worker import SplitClientHooks, Worker, load_opt, make_split_handlers, save_opt
from flwr.app import Array, ArrayRecord, ConfigRecord

from tasks.aggregate import weighted_mean
from tasks.client_sampling import cbs_step_probabilities, choose_balanced, count_selections
from tasks.config import ConfigError, knob
from tasks.losses import logit_adjusted_ce
from tasks.training import derive_seed, make_sgd, seeded

from ..client import AlgorithmClient
from ..registry import AlgorithmSpec, register

SERVER_MODES = ("concat", "per-client", "sequential", "local-loss")


@dataclass(frozen=True)
class ScalaConfig:
    """SCALA / CA-SFL / LLA-SFL / SplitFedV1 / SplitFedV2 knobs (namespace ``scala``)."""

    local_iterations: int = knob(20, lo=1, help="I: split iterations per global round (paper: 20)")
    total_batch: int = knob(320, lo=1, help="B: concatenated server batch, split into B_k (paper: 320)")
    server_mode: str = knob("concat", choices=SERVER_MODES,
                            help="concat (SCALA, CA-SFL) | per-client (SplitFedV1, LLA-SFL) | sequential (SplitFedV2) "
                                 "| local-loss (SFLLocalLoss: clients train on an auxiliary head, no gradients sent)")
    logit_adjust: bool = knob(True, help="g_bal with P_s (server) and P_k (client gradients)")
    prior: str = knob("histogram", choices=("histogram", "batch"), help="source of P_s and P_k, the logit adjustments' label priors (docs/split.md)")
    balanced_selection: bool = knob(False, help="class-balanced client selection by the QCID of the sampled "
                                                "clients' pooled label histograms (CS-SFL; any server mode)")
    selection_rule: str = knob("cbs", choices=("cbs", "greedy"),
                               help="cbs: Fed-CBS's sequential sampling probabilities | greedy: the first pick by "
                                    "Fed-CBS's UCB score, then each next one minimises the set's QCID")
    selection_lambda: float = knob(10.0, lo=0.0, help="lambda of the first pick's UCB exploration term "
                                                      "lambda sqrt(3 ln(t+1) / (2 T_n)) (Fed-CBS: 10)")


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
    asks_histogram = True   # SCALA's priors P_s, P_k and CS-SFL's selection use the nodes' label histograms

    def histogram(self, node: int) -> np.ndarray:
        """``node``'s label histogram n_k (its one-time ``split-info`` reply)."""
        return self.directory[node]["hist"]

    def setup_split(self) -> None:
        c = self.cfg
        self.mode, self.adjust = c.server_mode, c.logit_adjust
        self.has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules())
        self.opt = make_sgd(self.top.parameters(), self.task)
        self.top_keys = top_state_keys(self.model, self.cut)
        self.copies: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
        self._round = 0
        self._losses: list[float] = []
        self.selections: dict[int, int] = {}   # partition id -> times sampled (CS-SFL's T_n - 1)
        self.round_qcid: float | None = None
        if self.mode == "local-loss" and not isinstance(self, SFLLocalLossStrategy):
            raise ConfigError("scala.server-mode='local-loss' is SFLLocalLoss's: run algo='sfl-local-loss' "
                              "(SFLLocalLossStrategy), whose clients train on their auxiliary head")

    def local_iterations(self) -> int:
        return self.cfg.local_iterations

    # ------------------------------------------------------------------ round hooks
    def begin_round(self, server_round: int, nodes: list[int]) -> None:
        self._round = server_round
        shares = batch_shares([self.directory[n]["n"] for n in nodes], self.cfg.total_batch,
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

    # ------------------------------------------------------------------ CS-SFL's client selection
    def sample_nodes(self, grid, server_round: int) -> list[int]:
        """The round's nodes: uniform (:meth:`BaseStrategy.sample_nodes`), or with
        ``scala.balanced-selection`` as many, chosen by :meth:`choose_balanced` from the label
        histograms of the one-time ``split-info`` query (asked of every node when not every node
        is sampled; no other query)."""
        self.round_qcid = None
        if not self.cfg.balanced_selection:
            return super().sample_nodes(grid, server_round)
        nodes = self.connected_nodes(grid)
        k = self.sample_size(len(nodes))
        if k == len(nodes):
            chosen = nodes   # every node: nothing to choose
        else:
            self.learn_partitions(grid, nodes, server_round=server_round)
            chosen = self.choose_balanced(nodes, k, server_round)
        count_selections(self.selections, chosen, self.directory.partitions())
        return sorted(chosen)

    def balanced_pool(self, nodes: list[int]) -> tuple[list[int], list[int]]:
        """``(nodes with a non-empty label histogram, the others)``, each in partition order."""
        part = self.directory.partitions()

        def known(n: int) -> bool:
            return self.directory.has_stats(n) and int(np.asarray(self.histogram(n)).sum()) > 0

        pool = sorted((n for n in nodes if known(n)), key=lambda n: (part[n], n))
        rest = sorted((n for n in nodes if not known(n)), key=lambda n: (part.get(n, 1 << 62), n))
        return pool, rest

    def selection_probabilities(self, pool: list[int], chosen: list[int], server_round: int) -> np.ndarray:
        """The probability of each node of ``pool`` to be the next pick given ``chosen``
        (:func:`tasks.client_sampling.cbs_step_probabilities`: Fed-CBS's step rule with ``t`` the
        0-based round, ``T_n`` = 1 + the node's past selections, lambda = ``scala.selection-lambda``)."""
        counts = np.stack([np.asarray(self.histogram(n), dtype=np.float64) for n in pool])
        t_n = [1 + self.selections.get(self.directory[n]["partition"], 0) for n in pool]
        return cbs_step_probabilities(counts, [pool.index(c) for c in chosen], server_round - 1, t_n,
                                      self.cfg.selection_lambda)

    def choose_balanced(self, nodes: list[int], k: int, server_round: int) -> list[int]:
        """``k`` of ``nodes`` by Fed-CBS's client choice (:func:`tasks.client_sampling.choose_balanced`,
        seeded by ``(seed, "cs-sfl-sample", round)``): ``cbs`` draws each pick from
        :meth:`selection_probabilities`; ``greedy`` takes the first pick's most probable node (its
        UCB score) and then each time the node that minimises the QCID of the set so far plus it
        (ties: partition order). Fewer than ``k`` nodes with a histogram: all of them, the rest
        uniformly (seeded)."""
        pool, rest = self.balanced_pool(nodes)
        rng = np.random.default_rng(derive_seed(self.task.seed, "cs-sfl-sample", server_round))
        if len(pool) < k:
            log(WARNING, "cs-sfl round %s: only %d of %d nodes have a label histogram, %d are needed; the "
                "other places are drawn uniformly", server_round, len(pool), len(nodes), k)
        t_n = [1 + self.selections.get(self.directory[n]["partition"], 0) for n in pool]
        chosen, qcid_ = choose_balanced(pool, rest, k, self.histogram, server_round - 1, t_n,
                                        self.cfg.selection_lambda, rng, self.cfg.selection_rule)
        if qcid_ is not None:
            self.round_qcid = qcid_
        return chosen

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
        loss_cli = (rows * weights).sum()   # sum_k L_k, each a mean over its own B_k rows (SCALA Eq. 6 as written)
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
            new = weighted_mean(states, [float(self.directory[n]["n"]) for n in nodes])
            load_top_state(self.model, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in new.items()},
                           self.cut)
            self.copies = {}
        out = {"train-loss": float(np.mean(self._losses)) if self._losses else float("nan"),
               "batch-sizes": [int(self.round_batch[n]) for n in self.order(finals)]}
        if self.round_qcid is not None:
            out["sampled-qcid"] = self.round_qcid
        return out

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "server-optimizer": self.opt.state_dict(),
                "selections": {int(p): int(c) for p, c in self.selections.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        if "server-optimizer" in state:
            self.opt.load_state_dict(state["server-optimizer"])
        self.selections = {int(p): int(c) for p, c in state.get("selections", {}).items()}


# --------------------------------------------------------------------------- SFLLocalLoss
AUX_HEAD = "aux-head"              # the auxiliary head's state dict (split-arrays.aux-head, weights)
_STATE_AUX = "split.x.aux-head"    # the head between the messages of a round (message path)
_STATE_AUX_OPT = "split.x.aux-opt"
_STATE_AUX_LOSS = "split.x.aux-loss"


def make_aux_head(act_shape, num_classes: int) -> torch.nn.Sequential:
    """SFLLocalLoss's auxiliary head a_k for any model: flatten + one linear layer from the cut's
    activation (``act_shape`` without the batch dimension) to the classes (our choice: it fits any cut)."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(act_shape)), int(num_classes)))


def _head_from_state(state: dict[str, np.ndarray], device: torch.device) -> torch.nn.Sequential:
    w = np.asarray(state.get("1.weight", np.zeros(0)))
    if w.ndim != 2 or set(state) != {"1.weight", "1.bias"}:
        raise SplitValidationError(f"'{AUX_HEAD}' must hold a linear layer's '1.weight' [M, D] and '1.bias' [M], "
                                   f"got keys {sorted(state)}")
    head = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(w.shape[1]), int(w.shape[0])))
    head.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()})
    return head.to(device)


class LocalLossHooks(SplitClientHooks):
    """SFLLocalLoss's client: each step, CE of the auxiliary head on the bottom's activations,
    one SGD step of bottom and head together (the head's own SGD, same settings), and the
    activations of that forward (before the step) sent with the labels; no gradient comes back
    (:attr:`SplitClientHooks.trains_locally`). The head comes with step 1 (``aux-head``) and
    goes back, trained, in the final reply, with ``aux-loss`` (the mean local loss)."""

    trains_locally = True

    def begin(self, w: Worker, env: Envelope) -> None:
        if AUX_HEAD not in env.arrays:
            raise SplitValidationError(f"split-step 1 of sfl-local-loss carries no '{AUX_HEAD}' weights")
        head = _head_from_state(env.arrays[AUX_HEAD], w.env.device)
        w.cache["aux"] = (head, make_sgd(head.parameters(), w.env.task))
        w.state[_STATE_AUX_LOSS] = ConfigRecord({"sum": 0.0, "count": 0})

    def _aux(self, w: Worker) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if "aux" not in w.cache:   # message path, steps 2..I+1: what the previous message kept
            rec = w.state[_STATE_AUX]
            head = _head_from_state({k: rec[k].numpy() for k in rec.keys()}, w.env.device)
            opt = make_sgd(head.parameters(), w.env.task)
            if _STATE_AUX_OPT in w.state:
                load_opt(head, opt, w.state[_STATE_AUX_OPT])
            w.cache["aux"] = (head, opt)
        return w.cache["aux"]

    def local_loss(self, w: Worker, outs: dict[str, torch.Tensor], yb: torch.Tensor, step: int) -> torch.Tensor:
        head, opt = self._aux(w)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(head(outs["act"]), yb)
        rec = w.state[_STATE_AUX_LOSS]
        w.state[_STATE_AUX_LOSS] = ConfigRecord({"sum": float(rec["sum"]) + float(loss.detach()),
                                                 "count": int(rec["count"]) + 1})
        return loss

    def after_step(self, w: Worker, step: int) -> None:
        head, opt = self._aux(w)
        opt.step()
        if not w.streaming:   # the next message of the round rebuilds the head from here
            w.state[_STATE_AUX] = ArrayRecord({k: Array(v.detach().cpu().numpy().copy())
                                               for k, v in head.state_dict().items()})
            w.state[_STATE_AUX_OPT] = save_opt(head, opt)

    def end(self, w: Worker) -> Envelope:
        head, _ = self._aux(w)
        rec = w.state[_STATE_AUX_LOSS]
        loss = float(rec["sum"]) / max(1, int(rec["count"]))
        return Envelope(arrays={AUX_HEAD: {k: np.ascontiguousarray(v.detach().cpu().numpy())
                                           for k, v in head.state_dict().items()}},
                        metrics={"aux-loss": loss})


class SFLLocalLossStrategy(ScalaStrategy):
    """SFLLocalLoss's server (``scala.server-mode='local-loss'``): one server part trained on the
    activations it receives, no gradients sent; the auxiliary heads are FedAvg'ed as the bottoms."""

    def setup_split(self) -> None:
        super().setup_split()
        with seeded(derive_seed(self.task.seed, "sfl-aux-head")):
            head = make_aux_head(self.act_shape, self.env.num_classes)
        self.aux_state = {k: v.detach().cpu().numpy().copy() for k, v in head.state_dict().items()}

    def begin_extras(self, node: int) -> dict[str, dict[str, np.ndarray]]:
        return {AUX_HEAD: self.aux_state}

    def server_iteration(self, step: int, payloads: dict[int, dict[str, torch.Tensor]]
                         ) -> dict[int, dict[str, torch.Tensor]]:
        """One SGD step of the server part per client, on that client's (A_k, Y_k) with plain CE,
        the clients in a seeded random order (``derive_seed(seed, "sfl-local-loss-order", round,
        step)``, our choice); nothing goes back."""
        nodes = self.order(payloads)
        rng = np.random.default_rng(derive_seed(self.task.seed, "sfl-local-loss-order", self._round, step))
        self.top.train()
        total, rows = 0.0, 0
        for i in rng.permutation(len(nodes)):
            n = nodes[int(i)]
            y = payloads[n]["labels"].long()
            with seeded(self._srv_seed(step, self.directory[n]["partition"]), self.env.device):
                logits = self.top(payloads[n]["act"])
            loss = F.cross_entropy(logits, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += float(loss.detach()) * len(y)
            rows += len(y)
        self._losses.append(total / max(1, rows))
        return {n: {} for n in nodes}

    def aggregate(self, server_round: int, finals: dict[int, Envelope]) -> dict[str, Any]:
        out = super().aggregate(server_round, finals)
        spec = {k: TensorSpec(v.shape, str(v.dtype)) for k, v in self.aux_state.items()}
        heads, weights, losses = [], [], []
        for n in self.order(finals):
            try:
                check_streams(finals[n].arrays.get(AUX_HEAD, {}), spec, f"node {n}, final {AUX_HEAD}")
            except SplitValidationError as e:
                log(WARNING, "round %s: %s; its bottom is averaged, its head is not", server_round, e)
                continue
            heads.append(finals[n].arrays[AUX_HEAD])
            weights.append(float(self.directory[n]["n"]))
            if "aux-loss" in finals[n].metrics:
                losses.append(float(finals[n].metrics["aux-loss"]))
        if heads:
            self.aux_state = {k: np.asarray(v, dtype=np.float32) for k, v in weighted_mean(heads, weights).items()}
        out["server-loss"] = out["train-loss"]
        out["client-loss"] = float(np.mean(losses)) if losses else float("nan")
        return out

    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), AUX_HEAD: {k: v.copy() for k, v in self.aux_state.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        if AUX_HEAD in state:
            self.aux_state = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state[AUX_HEAD].items()}


class CSSFLStrategy(ScalaStrategy):
    """CS-SFL (reconstruction): SplitFedV1 with class-balanced client selection
    (``scala.balanced-selection``, :meth:`ScalaStrategy.choose_balanced`); the public name of
    ``cs-sfl``, whose server is :class:`ScalaStrategy`'s."""


_CLIENT = make_split_handlers(SplitClientHooks())
_LOCAL_CLIENT = make_split_handlers(LocalLossHooks())

_VARIANTS = {
    "scala": ("SCALA (Yang & Liu)", {"server_mode": "concat", "logit_adjust": True},
              "concatenated activations, logit adjustment with P_s (server) and P_k (client gradients)"),
    "ca-sfl": ("SCALA ablation CA-SFL (= Minibatch-SFL)", {"server_mode": "concat", "logit_adjust": False},
               "concatenated activations, plain CE"),
    "minibatch-sfl": ("Minibatch-SFL, SCALA's baseline (= CA-SFL)", {"server_mode": "concat", "logit_adjust": False},
                      "CA-SFL under the name of SCALA's Table III: concatenated activations, plain CE"),
    "lla-sfl": ("SCALA ablation LLA-SFL", {"server_mode": "per-client", "logit_adjust": True},
                "one server copy per client, each client's loss adjusted with its P_k"),
    "splitfed-v1": ("SplitFed (Thapa et al. 2022), V1", {"server_mode": "per-client", "logit_adjust": False},
                    "one server copy per client, both halves averaged each round"),
    "splitfed-v2": ("SplitFed (Thapa et al. 2022), V2", {"server_mode": "sequential", "logit_adjust": False},
                    "one shared server part; the clients, in a seeded random order, each train all I "
                    "iterations in turn"),
    "sfl-local-loss": ("SFLLocalLoss (Han et al. 2021, ICML FL workshop), reconstructed (docs/baselines.md)",
                       {"server_mode": "local-loss", "logit_adjust": False},
                       "clients train on a local auxiliary head, no server gradients; one server part trained "
                       "on the activations it receives"),
    "cs-sfl": ("CS-SFL (Xie et al. 2025, IEEE TWC), reconstructed (docs/baselines.md)",
               {"server_mode": "per-client", "logit_adjust": False, "balanced_selection": True},
               "SplitFedV1 with class-balanced client selection (QCID of the label histograms)"),
}
_STRATEGY = {"sfl-local-loss": SFLLocalLossStrategy, "cs-sfl": CSSFLStrategy}

ALGORITHMS = register({
    name: AlgorithmSpec(name=name, paper=paper, strategy_cls=_STRATEGY.get(name, ScalaStrategy),
                        config_cls=ScalaConfig, namespace="scala", overrides=ov,
                        client=_LOCAL_CLIENT if ov["server_mode"] == "local-loss" else _CLIENT, description=desc)
    for name, (paper, ov, desc) in _VARIANTS.items()
})


class ScalaClient(AlgorithmClient):
    """SCALA's client (and the SplitFed / CA-SFL / LLA-SFL baselines) with a user's split
    model and the node's labeled data (``labeled``). Each ``query.split`` step sends the
    bottom's activations and labels of one batch and applies the returned gradients; the
    server concatenates all nodes' activations and trains the top with logit adjustment."""

    module = __name__
    needs = ('labeled',)
