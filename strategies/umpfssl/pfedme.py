"""pFedMe + FixMatch, a baseline of UM-pFSSL's Table 1 (``docs/baselines.md`` C5).

pFedMe -- C. T. Dinh, N. H. Tran, T. D. Nguyen, "Personalized Federated Learning with Moreau
Envelopes", NeurIPS 2020 (code: CharlieDinh/pFedMe, ``FLAlgorithms/users/userpFedMe.py``,
``optimizers/fedoptimizer.py``, ``servers/serverpFedMe.py``). Here f_k is FixMatch's loss on
the node's labeled and unlabeled data (``CE(f(weak(x_l)), y_l) + lambda_u L_u``, Sohn et al.'s
FixMatch, NeurIPS 2020).

Update rule (:mod:`tasks.umpfssl.pfedme_update`). Client k sets w_k <- w, theta <- w, and for each of its
R local steps (``local-epochs`` passes over D_k^s + D_k^u, or ``local-steps``), on one mini-batch:

1. K inner steps (``pfedme.inner-steps``) approximate
   ``theta_k = argmin_theta f_k(theta) + lambda/2 ||theta - w_k||^2``:
   ``theta <- theta - plr (grad f_k(theta) + lambda (theta - w_k) + wd theta)``
   (``pfedme.personal-lr`` = plr, ``pfedme.lamda`` = lambda, the run's ``weight-decay`` = wd);
2. ``w_k <- w_k - eta lambda (w_k - theta_k)``, eta the run's ``lr``.

Server: ``w <- (1 - beta) w + beta sum_{k in S} n_k w_k / sum_{k in S} n_k`` (``pfedme.beta``;
n_k weights as the code, the paper writes 1/S).

Evaluation (``pfedme.eval-model``). ``local`` (default, as the code): each node runs its local
update from the w of the round (the w the round's training started from, sent as
``eval-weights``; the same steps and seed as ``train``, so a node that trained this round
rebuilds exactly the w_k it uploaded) and tests the local model w_k. The code's "personalised"
model is w_k (line numbers at its commit caf24b1): ``pFedMeOptimizer.step`` returns the model's
own parameter list (``FLAlgorithms/optimizers/fedoptimizer.py`` line 65), bound to
``persionalized_model_bar`` (``FLAlgorithms/users/userpFedMe.py`` line 50) and overwritten
with w_k after the local rounds (line 58, ``update_parameters(self.local_model)``);
``test_persionalized_model`` (``FLAlgorithms/users/userbase.py`` lines 95-107) tests those
parameters; the server trains every user (``FLAlgorithms/servers/serverpFedMe.py`` lines
54-55) and evaluates them before it aggregates (lines 64-66); the repository's
github.com/CharlieDinh/pFedMe/issues/5 reports the same. ``theta`` [ours, the paper's
personalised model]: theta_k fitted from the current (aggregated) w by K inner steps at
``pfedme.personal-lr`` (the code's ``personal_learning_rate``, used only by its training's
inner steps, ``userpFedMe.py`` line 26) on one seeded mini-batch of the node's data, a
test-time fit on local data that no other personalised row gets.

Defaults (the code's CIFAR-10 README): lambda = 15, K = 5, plr = 0.01,
beta = 1. What travels: w down and w_k up (``weights``), as FedAvg; w for evaluation
(``eval-weights``).

Client contract (``train``): ``arrays`` in (w), ``arrays`` out (w_k's parameters, with theta's
BatchNorm statistics as its buffers) and ``metrics`` (``num-examples`` = |D_k^s| + |D_k^u|,
``train-loss``: f_k at the last inner step, ``mask-rate``). ``evaluate``: ``arrays`` in (w),
``accuracy`` of w_k (or theta_k, ``pfedme.eval-model=theta``) out. No node state.

[ours] The augmented views of a local step's batch are drawn once and kept for its K inner
steps (the inner problem is one fixed objective, as the code's one batch X); the pseudo-labels
of f_k come from the current theta (FixMatch's own model), recomputed at each inner step;
pFedMe's steps are plain gradient steps (no momentum, as ``pFedMeOptimizer``); eta is the run's
``lr`` (UM-pFSSL's one learning rate for every method; the code's default is 0.01);
w_k's buffers are theta's (the code's models have none); only sampled clients train.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid

from strategies.core.folds import sized_metrics
from strategies.core.records import ARRAYS_KEY, algo_config, model_to_record, record_to_numpy
from tasks.config import knob
from tasks.env import Env
from tasks.umpfssl.pfedme_update import moreau_inner_steps, moreau_outer_step
from tasks.training import (
    derive_seed,
    fixmatch_loss,
    load_numpy_state,
    num_local_steps,
    paired_batches,
    seeded,
    to_device_batch,
)

from ..client import AlgorithmClient, reply, server_round
from .fixmatch_baselines import FixMatchConfig, FixMatchFedStrategy, FixMatchTrainer, spec
from ..personalized import evaluate_on_own_test, personal_env
from ..registry import register


EVAL_MODELS = ("local", "theta")   # pfedme.eval-model: w_k after the local rounds (the code), or a fitted theta_k


@dataclass(frozen=True)
class PFedMeConfig(FixMatchConfig):
    """pFedMe's knobs (``pfedme.*``): FixMatch's plus the Moreau envelope's (defaults: the code's
    CIFAR-10 README)."""

    namespace = "pfedme"

    lamda: float = knob(15.0, lo=0.0, help="Moreau-envelope weight lambda (the code's --lamda)")
    inner_steps: int = knob(5, lo=1, help="K gradient steps approximating theta_k per local step")
    personal_lr: float = knob(0.01, lo=0.0, lo_open=True, help="step size of the K inner steps")
    beta: float = knob(1.0, lo=0.0, hi=2.0, lo_open=True, help="server w <- (1 - beta) w + beta * weighted mean")
    eval_model: str = knob("local", choices=EVAL_MODELS,
                           help="model each node tests: local = w_k after its local rounds from the round's w "
                                "(the code); theta = theta_k fitted from the current w by K inner steps on one batch")


def pfedme_local(theta: torch.nn.Module, anchor: list[torch.Tensor], env: Env, cfg: PFedMeConfig, steps: int,
                 seed: int, outer: bool = True) -> dict[str, float]:
    """``steps`` pFedMe local steps (module docstring) on the node's data; ``outer=False``:
    the inner steps only (theta_k from a fixed w_k, for evaluation)."""
    t, aug = env.task, env.augmenter
    lab, unl = env.labeled(), env.unlabeled()
    theta.train()
    total, done, kept, seen_u, seen = 0.0, 0, 0.0, 0, 0
    with seeded(seed, env.device):   # augmentation and dropout draws
        for il, iu in paired_batches(len(lab), len(unl), t.batch_size, cfg.uratio * t.batch_size, steps, seed):
            xw = y = views = None
            if il is not None:
                xb, y = to_device_batch(lab, il, env.device)
                xw = aug.weak(xb)
            if iu is not None:
                xu, _ = to_device_batch(unl, iu, env.device)
                views = aug.weak_strong(xu)   # drawn once: the K inner steps share one objective
            masks: list[torch.Tensor] = []

            def loss_fn() -> torch.Tensor:
                loss, mask, _ = fixmatch_loss(theta, xw, y, views, tau=cfg.tau, lambda_u=cfg.lambda_u)
                if mask is not None:
                    masks.append(mask)
                return loss

            total += moreau_inner_steps(theta, anchor, loss_fn, lam=cfg.lamda, steps=cfg.inner_steps,
                                        lr=cfg.personal_lr, weight_decay=t.weight_decay)
            if outer:
                moreau_outer_step(anchor, theta, lam=cfg.lamda, eta=t.lr)
            if masks:
                kept += float(masks[-1].sum())
                seen_u += len(masks[-1])
            seen += (len(il) if il is not None else 0) + (len(iu) if iu is not None else 0)
            done += 1
    return {"train-loss": total / max(done, 1), "mask-rate": kept / seen_u if seen_u else 0.0,
            "num-examples": float(seen)}   # processed (labeled + unlabeled samples of the steps)


def _models(msg: Message, env: Env) -> tuple[torch.nn.Module, torch.nn.Module, list[torch.Tensor]]:
    """w_k (= the received w), theta (= w) and w_k's trainable parameters (the anchor)."""
    model = env.build_model()
    load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    theta = copy.deepcopy(model)
    return model, theta, [p for p in model.parameters() if p.requires_grad]


def local_update(msg: Message, env: Env, cfg: PFedMeConfig) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Node k's local rounds from the received w (module docstring): w_k, with theta's
    BatchNorm statistics as its buffers, and the rounds' metrics. Seeded by run seed, round and
    partition, so ``train`` and the ``local`` evaluation of one round compute the same w_k."""
    rnd, pid, t = server_round(msg), env.partition_id, env.task
    model, theta, anchor = _models(msg, env)
    n = len(env.labeled()) + len(env.unlabeled())
    out = pfedme_local(theta, anchor, env, cfg, num_local_steps(t, n), derive_seed(t.seed, "pfedme", rnd, pid))
    with torch.no_grad():   # w_k's buffers: theta's BatchNorm statistics
        own = dict(model.named_buffers())
        for name, b in theta.named_buffers():
            own[name].copy_(b)
    return model, out


class PFedMeTrainer(FixMatchTrainer):
    """pFedMe's client: the Moreau-envelope local update; w_k evaluated (or theta_k, ``eval-model``)."""

    config_cls = PFedMeConfig

    def train(self, msg: Message, context: Context) -> Message:
        """pFedMe's local update (module docstring); replies w_k."""
        env, cfg = personal_env(msg, context), algo_config(msg, self.config_cls)
        model, out = local_update(msg, env, cfg)
        out = sized_metrics(out, len(env.labeled()) + len(env.unlabeled()))   # n_k = |D_k^s| + |D_k^u|
        out["partition-id"] = env.partition_id
        return reply(msg, model_to_record(model), out)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """``local``: w_k after the local rounds from the received w (the round's w), as the
        code; ``theta``: theta_k from the received w (the current w) by K inner steps on one
        seeded batch. Tested on the node's own test split."""
        env, cfg = personal_env(msg, context), algo_config(msg, self.config_cls)
        if cfg.eval_model == "local":
            return evaluate_on_own_test(msg, env, local_update(msg, env, cfg)[0])
        rnd, pid, t = server_round(msg), env.partition_id, env.task
        _, theta, anchor = _models(msg, env)
        if len(env.labeled()) + len(env.unlabeled()) > 0:
            pfedme_local(theta, anchor, env, cfg, 1, derive_seed(t.seed, "pfedme-eval", rnd, pid), outer=False)
        return evaluate_on_own_test(msg, env, theta)


class PFedMeStrategy(FixMatchFedStrategy):
    """pFedMe's server: ``w <- (1 - beta) w + beta * (n_k-weighted mean of the w_k)``."""

    trainer = PFedMeTrainer()

    def setup_algorithm(self) -> None:
        super().setup_algorithm()
        self.round_w: ArrayRecord | None = None   # the w this round's training started from

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.round_w = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def eval_payload(self, node: int) -> ArrayRecord | None:
        """``eval-model=local``: the round's w, from which every node reruns its local rounds (the
        code evaluates w_k before it aggregates); ``theta``: the current w."""
        if self.cfg.eval_model == "local" and self.round_w is not None:
            return self.round_w
        return super().eval_payload(node)

    def load_aggregate(self, state: dict[str, np.ndarray]) -> None:
        beta = float(self.cfg.beta)
        if beta != 1.0:
            cur = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
            state = {k: ((1.0 - beta) * cur[k] + beta * v).astype(cur[k].dtype)
                     if np.issubdtype(cur[k].dtype, np.floating) else v for k, v in state.items()}
        load_numpy_state(self.model, state)


ALGORITHMS = register({
    "pfedme-fix": spec("pfedme-fix", PFedMeStrategy,
                       "pFedMe + FixMatch: Moreau-envelope personalisation, w_k evaluated", (), label_metrics=False),
})


class PFedMeClient(AlgorithmClient):
    """pFedMe's client with a user's model and the node's labeled, unlabeled and test data."""

    module = __name__
    needs = ("labeled", "unlabeled", "test")
