"""UM-pFSSL: personalized federated semi-supervised learning with uncertainty-selected helpers.

Paper: Y. Shi, S. Chen, H. Zhang, "Uncertainty Minimization for Personalized Federated
Semi-Supervised Learning" (method: Sec. 4, Algorithms 1-2; choices where it is silent:
``docs/umpfssl.md``). The paper's FixMatch baselines
(``fixavg``, ``fixprox``, ``fedper-fix``, ``local-only``, ...) are :mod:`strategies.umpfssl.fixmatch_baselines`
and its subclasses, with their own config and this module's evaluation. Every variant is evaluated the same way: each client's model on that
client's own test split; the run's ``accuracy`` is the mean over clients and
``client-accuracy-var`` their variance (the paper's fairness measure).

Setting
-------
Client k holds labeled D_k^s and unlabeled D_k^u (``label_mode="dir2"``: per-class
Dirichlet over clients, then ``(p_s, p_u) ~ Dir_2(partition-labeled-alpha)`` per client;
matched per-client test splits), ``mu_k = |D_k^s| / (|D_k^s| + |D_k^u|)``.
The server trains nothing: it is a **versioned model pool** (each client's latest upload,
stamped with the round it was uploaded in; 0 = warm-up), plus the older versions that some
helper list still references. Each client keeps a **helper list** H_k of at most M members,
self included, as ids and versions in ``context.state`` (no weights: a cached copy is
fetched again from the pool whenever it is needed).

Math (MC-dropout, Eqs. 9-14)
----------------------------
* ``P_j(y|x) = 1/T sum_t softmax(f_{w_j, mask_t}(x))``, ``H_j(x) = -sum_c P_c log P_c``
  (``tasks.mc_dropout.mc_dropout_predict``: dropout on, BatchNorm in eval mode).
* ``Hbar(k|j) = mean_{x in D_k^u} H_j(x) / log C``, clamped ``>= entropy-floor`` (our choice: the
  paper sums over x; the mean keeps Hbar in [0, 1] as its Section 5 assumes;
  ``tasks.mc_dropout.normalized_entropy``).
* ``Corr(k|j) = (1 - mu_k) / Hbar(k|j) + mu_k * Acc(D_k^s; argmax P_j)``; the first term is
  0 when D_k^u is empty, the second when D_k^s is empty; floored at ``CORR_FLOOR`` so the
  aggregation weights are defined when every term is 0 (``tasks.mc_dropout.relation_score``;
  a client scores models with ``tasks.umpfssl.helper_selection.HelperScorer``).
* Aggregation: ``w_k <- sum_{j in H_k} Corr(k|j) w_j / sum_j Corr(k|j)``
  (``tasks.aggregate.personalized_weighted``; self with its current weights).
* Pseudo-labels: ``yhat(x) = P_{j*}(y|x)``, ``j* = argmin_{j in H_k} H_j(x)`` (soft), with
  self = the freshly aggregated w_k (the paper does not say which "self" labels; this one is the
  model the client trains next; ``tasks.mc_dropout.select_pseudo_labels``), or with
  ``umpfssl.self-labels=own`` the client's model as it uploaded it, before this round's
  aggregation (trained like every helper it is compared with).
* Local training, E epochs: one pass over labeled batches with ``mu_k * CE`` then one pass
  over unlabeled batches with ``(1 - mu_k) * KL(yhat || f_{w_k}(x))``
  (``tasks.losses.kl_to_target``), weak augmentation, dropout on (``tasks.umpfssl.distill.train_distill``).
* Helper list rules (Alg. 2) and Eq. 27: ``tasks.umpfssl.helper_selection`` (``replace_helpers``,
  ``refresh_ids``, ``cost2``). The per-client evaluation of every variant is
  :class:`strategies.personalized.PersonalizedEvalStrategy`.

Rounds
------
Before round 1 every client trains ``warmup-epochs`` of CE on D_k^s from the common w_0 and
uploads (``query.warmup``). Round t, for each sampled client k:

1. ``query`` op ``"select"`` (only when k has something to select this round). The server
   sends the pool directory (ids, latest versions), k's list as the server knows it, and the
   **candidate models** it drew uniformly at random from the pool minus H_k (seeded):
   *fill* ``M - |H_k|`` of them, and *replace* ``R`` more while ``t <= search-rounds`` (F).
   The client scores them (Corr), adds the fill models, then swaps replace candidates in for
   the R lowest-Corr non-self members, greedily best candidate vs worst member, while the
   candidate's Corr is higher. If ``t mod nu == 0`` (``update-period``) it ranks the new list
   and asks for the latest pool version of every non-self member that is not among the R
   lowest and whose pool copy changed. Corr of members it already holds is read from its
   state (computed at its last participation on exactly those cached versions: the models
   and its data have not changed since). Reply config: ``helper-ids``, ``helper-versions``
   (requested), ``refresh-ids``, ``swaps``; no weights.
2. ``train``: the server sends ``arrays`` = k's own pool model, and ``helper.<id>`` = each
   helper at the listed version. The client recomputes Corr for every member (spec
   ambiguity 7), aggregates, pseudo-labels, trains, stores its list (ids, versions, Corr) in
   ``context.state["umpfssl.helpers"]`` and replies ``arrays`` (its model: the pool's new
   version of k, stamped t), ``config`` (``helper-ids``, ``helper-versions``) and
   ``metrics`` (``num-examples``, ``train-loss``, ``mu``, ``partition-id``, ...).

Bytes and the paper's cost model
--------------------------------
Cost2 = (M n/nu + n + F R) K_bar |w| (Eq. 27) counts, per sampled client, R candidate
downloads in each of the first F rounds, up to M refreshed helpers every nu rounds, and one
upload per round. We count transfers by reason (``transfers.<reason>``) and bytes by kind:

* ``helper-weights`` down: a helper version reaching the client for the first time under
  the paper's cache semantics: *fill* and *replace* candidates (in ``select``) and
  *refresh* downloads (in ``train``). ``weights`` up: uploads (``transfers.upload``).
  ``transfers.replace + transfers.refresh + transfers.upload`` is what Cost2 bounds.
* Not in Cost2 and reported separately: ``transfers.fill`` (the paper's cost model omits the
  initial fill, at most K(M-1) per run) and ``transfers.warmup-upload`` (K, once).
* ``own-weights`` and ``helper-cache`` down: the client's own model and the helpers it
  already holds, re-sent each participation because we keep no weights in
  ``context.state``. The paper's client caches them locally, so these are implementation
  overhead, not part of its cost. ``eval-weights`` down: models sent for per-client test
  evaluation (run-config ``eval-every`` rounds).

"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.common import log
from flwr.serverapp import Grid

from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    algo_config,
    model_to_record,
    numpy_to_record,
    query,
    record_to_numpy,
)
from tasks.aggregate import personalized_weighted
from tasks.config import ConfigError, knob
from tasks.umpfssl.distill import train_distill
from tasks.env import Env
from tasks.umpfssl.helper_selection import HelperScorer, refresh_ids, replace_helpers
from tasks.mc_dropout import select_pseudo_labels
from tasks.models import has_dropout
from tasks.training import (
    derive_seed,
    load_numpy_state,
    make_sgd,
    train_supervised,
)

from ..client import AlgorithmClient, reply, server_round
from ..personalized import PersonalizedEvalStrategy, evaluate_on_own_test, personal_env
from ..registry import AlgorithmSpec, register

NS = "umpfssl"
STATE_HELPERS = "umpfssl.helpers"   # ConfigRecord: ids, versions, corr (non-self members)


@dataclass(frozen=True)
class UMPFSSLConfig:
    """UM-pFSSL knobs (``umpfssl.*``); defaults from the paper (Sec. 6.1) or, where it gives none,
    the library's (``docs/umpfssl.md``)."""

    helpers: int = knob(5, lo=1, help="helper-list size M, self included")
    replace: int = knob(2, lo=0, help="helpers replaced per round R (first F rounds)")
    search_rounds: int = knob(20, lo=0, help="F: replacement runs in rounds 1..F")
    update_period: int = knob(10, lo=1, help="nu: refresh changed helpers when round mod nu == 0")
    mc_samples: int = knob(10, lo=1, help="MC-dropout passes T_mc")
    entropy_floor: float = knob(1e-3, lo=0.0, lo_open=True, help="clamp of the normalised entropy Hbar")
    warmup_epochs: int = knob(5, lo=0, help="supervised CE epochs on D_k^s before round 1")
    self_labels: str = knob("aggregated", choices=("aggregated", "own"),
                            help="the self model among the pseudo-label sources (the paper does not say which): "
                                 "the freshly aggregated w_k the client trains next, or its own model as it "
                                 "uploaded it (before this round's aggregation, trained as every helper is)")

    def validate(self) -> None:
        if self.replace > self.helpers - 1:
            raise ConfigError(f"{NS}.replace={self.replace} must be <= {NS}.helpers - 1 = {self.helpers - 1} "
                              "(self is never replaced)")


# =============================================================================== client side
def _algo_cfg(msg: Message) -> UMPFSSLConfig:
    return algo_config(msg, UMPFSSLConfig)


def _load(env: Env, rec: ArrayRecord) -> torch.nn.Module:
    model = env.build_model()
    load_numpy_state(model, record_to_numpy(rec))
    return model


def _scorer(env: Env, cfg: UMPFSSLConfig, seed: int) -> HelperScorer:
    return HelperScorer(env, mc_samples=cfg.mc_samples, entropy_floor=cfg.entropy_floor, seed=seed)


def _read_helpers(context: Context) -> tuple[list[int], list[int], list[float]] | None:
    rec = context.state.config_records.get(STATE_HELPERS) if STATE_HELPERS in context.state else None
    if rec is None:
        return None
    return list(rec["ids"]), list(rec["versions"]), list(rec["corr"])


def _write_helpers(context: Context, ids: list[int], versions: list[int], corr: list[float]) -> None:
    context.state[STATE_HELPERS] = ConfigRecord({"ids": [int(i) for i in ids],
                                                 "versions": [int(v) for v in versions],
                                                 "corr": [float(c) for c in corr]})


def _warmup_model(env: Env, cfg: UMPFSSLConfig, seed: int, init: ArrayRecord | None = None
                  ) -> tuple[torch.nn.Module, dict]:
    """w_0 (the common seeded init, or ``init``: the server's ``initial_arrays``) plus
    ``warmup-epochs`` of CE on D_k^s (mu_k = 0: w_0)."""
    model = env.build_model()
    if init is not None:
        load_numpy_state(model, record_to_numpy(init))
    lab = env.labeled()
    stats = {"warmup-loss": float("nan")}
    if cfg.warmup_epochs > 0 and len(lab) > 0:
        t = env.task
        steps = cfg.warmup_epochs * max(1, math.ceil(len(lab) / t.batch_size))
        out = train_supervised(model, lab, aug=env.augmenter, steps=steps, batch_size=t.batch_size,
                               optimizer=make_sgd(model.parameters(), t), device=env.device, seed=seed)
        stats["warmup-loss"] = out["train-loss"]
    return model, stats


def client_warmup(msg: Message, context: Context) -> Message:
    """``query`` op ``warmup``: build w_0, train on D_k^s, upload (version 0)."""
    env, cfg = personal_env(msg, context), _algo_cfg(msg)
    model, stats = _warmup_model(env, cfg, derive_seed(env.task.seed, "umpfssl-warmup", env.partition_id),
                                 msg.content.array_records.get(ARRAYS_KEY))
    return reply(msg, model_to_record(model), {"partition-id": env.partition_id, **stats})


def client_select(msg: Message, context: Context) -> Message:
    """``query`` op ``select``: fill, replace and choose refreshes (see module docstring)."""
    env, cfg = personal_env(msg, context), _algo_cfg(msg)
    conf = msg.content.config_records[CONFIG_KEY]
    rnd = server_round(msg)
    latest = dict(zip((int(i) for i in conf["pool-ids"]), (int(v) for v in conf["pool-versions"])))
    server_ids, server_vers = [int(i) for i in conf["helper-ids"]], [int(v) for v in conf["helper-versions"]]
    mine = _read_helpers(context)
    if mine is not None and (mine[0], mine[1]) == (server_ids, server_vers):
        corr = mine[2]
    else:
        if mine is not None or server_ids:
            log(WARNING, "umpfssl client %s: helper list in state %s differs from the server's %s; "
                "adopting the server's (Corr unknown this round)", env.partition_id, mine, server_ids)
        corr = [math.inf] * len(server_ids)
    members = list(zip(server_ids, server_vers, corr))
    scorer = _scorer(env, cfg, derive_seed(env.task.seed, "umpfssl-select", rnd, env.partition_id))
    fills, cands = [], []
    for cid, reason in zip((int(i) for i in conf["cand-ids"]), conf["cand-reasons"]):
        model = _load(env, msg.content.array_records[f"cand.{cid}"])
        c = scorer.score(model, ("cand", cid))[0]
        (fills if reason == "fill" else cands).append((cid, latest[cid], c))
    members += fills
    members, swaps = replace_helpers(members, cands, cfg.replace)
    refresh = refresh_ids(members, latest, cfg.replace) if bool(conf["do-refresh"]) else []
    versions = [latest[m[0]] if m[0] in refresh else m[1] for m in members]
    return reply(msg, None, {"swaps": swaps, "partition-id": env.partition_id},
                  {"helper-ids": [m[0] for m in members], "helper-versions": versions,
                   "refresh-ids": refresh})


def _train_umpfssl(msg: Message, context: Context, env: Env, cfg: UMPFSSLConfig) -> Message:
    conf = msg.content.config_records[CONFIG_KEY]
    rnd, pid = server_round(msg), env.partition_id
    seed = derive_seed(env.task.seed, "umpfssl-train", rnd, pid)
    ids, versions = [int(i) for i in conf["helper-ids"]], [int(v) for v in conf["helper-versions"]]
    if ARRAYS_KEY in msg.content.array_records:
        own = _load(env, msg.content.array_records[ARRAYS_KEY])
        extra = {}
    else:  # not in the pool yet (e.g. it missed the warm-up): warm up now
        own, extra = _warmup_model(env, cfg, derive_seed(env.task.seed, "umpfssl-warmup", pid))
    helpers = [_load(env, msg.content.array_records[f"helper.{i}"]) for i in ids]
    scorer = _scorer(env, cfg, seed)
    scored = [scorer.score(own, "self")] + [scorer.score(h, ("helper", i)) for h, i in zip(helpers, ids)]
    corr = [s[0] for s in scored]
    # personalized aggregation (self included with its current weights)
    states = [{k: v.detach().cpu().numpy() for k, v in m.state_dict().items()} for m in [own] + helpers]
    load_numpy_state(own, personalized_weighted(states, corr))
    # pseudo-labels: helpers' MC predictions + self's (the aggregated w_k, or the own model as uploaded)
    metrics: dict[str, Any] = {}
    unl = env.unlabeled()
    targets = torch.zeros(0, env.num_classes)
    if len(unl) > 0:
        p_self, h_self = (scored[0][1], scored[0][2]) if cfg.self_labels == "own" else \
            scorer.predict(own, scorer.xu, ("u", "aggregated"))
        targets, choice = select_pseudo_labels([p_self] + [s[1] for s in scored[1:]],
                                               [h_self] + [s[2] for s in scored[1:]])
        if unl.labels_known:  # a user's unlabeled images have no hidden labels to compare with
            right = lambda p: float((p.argmax(1) == scorer.yu).float().mean())   # noqa: E731
            metrics["pseudo-label-accuracy"] = right(targets)
            # which source is right how often: self's MC prediction (umpfssl.self-labels), and the
            # helpers' (the mean over them), before the per-sample choice
            metrics["pseudo-label-accuracy-self"] = right(p_self)
            if len(scored) > 1:
                metrics["pseudo-label-accuracy-helpers"] = float(np.mean([right(s[1]) for s in scored[1:]]))
        metrics["pseudo-label-from-self"] = float((choice == 0).float().mean())
    out = train_distill(own, env.labeled(), unl, targets, scorer.mu, env=env, seed=seed)
    _write_helpers(context, ids, versions, corr[1:])
    weights = np.asarray(corr) / np.sum(corr)
    metrics.update({"num-examples": float(len(env.labeled()) + len(unl)), "train-loss": out["train-loss"],
                    "mu": scorer.mu, "partition-id": pid, "corr-self": corr[0],
                    "self-weight": float(weights[0]), "num-helpers": len(ids) + 1, **extra})
    return reply(msg, model_to_record(own), metrics, {"helper-ids": ids, "helper-versions": versions})


def client_train(msg: Message, context: Context) -> Message:
    return _train_umpfssl(msg, context, personal_env(msg, context), _algo_cfg(msg))


def client_evaluate(msg: Message, context: Context) -> Message:
    """``evaluate``: this client's model on its own test split."""
    env = personal_env(msg, context)
    model = env.build_model()
    if ARRAYS_KEY in msg.content.array_records:  # absent only if not in the pool yet
        load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    return evaluate_on_own_test(msg, env, model)


# =============================================================================== server side
class UMPFSSLStrategy(PersonalizedEvalStrategy):
    """The versioned model pool and the per-round select/train exchanges (module docstring)."""

    personalized = True  # Result.arrays: one model per client, keys '<partition-id>/<name>'
    #: node -> the helper ids it is sent afresh in the round's training messages (record_kind)
    _refreshed: dict[int, set[int]] = {}

    def result_arrays(self) -> ArrayRecord:
        if not self.pool:
            return model_to_record(self.model)
        return numpy_to_record({f"{pid}/{k}": v for pid in sorted(self.pool) for k, v in self.pool[pid][1].items()})

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        """UM-pFSSL's kinds: a node's own model (``own-weights``), candidates (``cand.<i>``) and
        refreshed helpers (``helper-weights``), helpers the node holds already (``helper-cache``:
        sent here for the simulation's sake, kept by a real client), and ``weights`` otherwise."""
        if direction == "down" and msg.metadata.message_type == "train":
            if key == ARRAYS_KEY:
                return "own-weights"
            if key.startswith("helper."):
                fresh = int(key.split(".", 1)[1]) in self._refreshed.get(msg.metadata.dst_node_id, ())
                return "helper-weights" if fresh else "helper-cache"
        if key.startswith("cand."):
            return "helper-weights"
        return super().record_kind(key, msg, direction)

    def setup_algorithm(self) -> None:
        if not has_dropout(self.model):
            raise ConfigError("algo=umpfssl needs a model with dropout > 0 for MC-dropout (the paper uses "
                              "dropout=0.5): model= needs an nn.Dropout layer (run config: dropout=0.5)")
        self.pool: dict[int, tuple[int, dict[str, np.ndarray]]] = {}       # pid -> (version, state)
        self.archive: dict[tuple[int, int], dict[str, np.ndarray]] = {}   # older referenced versions
        self.refs: dict[int, list[tuple[int, int]]] = {}                   # pid -> non-self (id, version)
        self.counts: dict[str, int] = {}                                   # transfers.<reason> this round

    def count(self, reason: str, n: int = 1) -> None:
        self.counts[f"transfers.{reason}"] = self.counts.get(f"transfers.{reason}", 0) + n

    def flush_counts(self) -> dict[str, int]:
        out, self.counts = dict(self.counts), {}
        return out

    # ---------------------------------------------------------------- pool
    def referenced(self) -> set[tuple[int, int]]:
        return {h for lst in self.refs.values() for h in lst}

    def fetch(self, pid: int, version: int) -> dict[str, np.ndarray]:
        v, st = self.pool[pid]
        if v == version:
            return st
        if (pid, version) in self.archive:
            return self.archive[(pid, version)]
        raise KeyError(f"pool has no version {version} of client {pid} (latest {v})")

    def upload(self, pid: int, version: int, state: dict[str, np.ndarray]) -> None:
        if pid in self.pool:
            old_v, old = self.pool[pid]
            if (pid, old_v) in self.referenced():
                self.archive[(pid, old_v)] = old
        self.pool[pid] = (version, state)

    def gc(self) -> None:
        live = self.referenced()
        for key in [k for k in self.archive if k not in live]:
            del self.archive[key]

    def eval_payload(self, node: int) -> ArrayRecord | None:
        pid = self.partition_of.get(node)
        return numpy_to_record(self.pool[pid][1]) if pid in self.pool else None

    # ---------------------------------------------------------------- phases
    def query(self, grid: Grid, nodes: list[int], op: str, server_round: int, init: bool = False) -> list[Message]:
        msgs = []
        for n in nodes:
            c = self.base_content(server_round, action=op)
            if init:  # the run's initial_arrays: every warm-up starts from them
                c[ARRAYS_KEY] = model_to_record(self.model)
            msgs.append(query(c, n, op, str(server_round)))
        return self.exchange(grid, msgs)

    def warmup(self, grid: Grid) -> dict[str, Any]:
        nodes = sorted(grid.get_node_ids())
        losses = []
        for r in self.query(grid, nodes, "warmup", 0, init=self.initial_given):
            m = r.content.metric_records[METRICS_KEY]
            pid = int(m["partition-id"])
            rec = r.content.array_records[ARRAYS_KEY]
            self.count("warmup-upload")
            self.note_partition(r.metadata.src_node_id, pid)
            self.upload(pid, 0, record_to_numpy(rec))
            self.refs.setdefault(pid, [])
            losses.append(float(m["warmup-loss"]))
        log(INFO, "umpfssl warm-up: %d clients in the pool", len(self.pool))
        return {"warmup-loss": float(np.nanmean(losses)) if losses and not all(map(math.isnan, losses))
                else float("nan")}

    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        """One round: select helpers, train, upload into the pool. The uploads are taken together
        rather than folded: each client's model goes into the pool that every client's
        personalised aggregation reads from (the paper's per-client weighted aggregation over its
        helpers), so the server keeps every participant's model by design."""
        cfg, t = self.cfg, server_round
        out: dict[str, Any] = {}
        if not self.pool:
            out.update(self.warmup(grid))
        nodes = self.sample_nodes(grid, t)
        nodes = self.learn_partitions(grid, nodes)
        directory = {pid: v for pid, (v, _) in self.pool.items()}
        do_refresh = t % cfg.update_period == 0
        lists: dict[int, list[tuple[int, int]]] = {}
        refreshed: dict[int, set[int]] = {}
        select_msgs, swaps = [], 0
        for n in nodes:
            pid = self.partition_of[n]
            cur = list(self.refs.get(pid, []))
            lists[n], refreshed[n] = cur, set()
            held = {pid} | {i for i, _ in cur}
            avail = sorted(i for i in directory if i not in held)
            rng = random.Random(derive_seed(self.task.seed, "umpfssl-candidates", t, pid))
            fill = rng.sample(avail, min(cfg.helpers - 1 - len(cur), len(avail))) if len(cur) < cfg.helpers - 1 else []
            rest = [i for i in avail if i not in set(fill)]
            repl = rng.sample(rest, min(cfg.replace, len(rest))) if (t <= cfg.search_rounds and cfg.replace > 0) else []
            if not fill and not repl and not (do_refresh and cur):
                continue
            content = self.base_content(t, action="select", **{
                "pool-ids": sorted(directory), "pool-versions": [directory[i] for i in sorted(directory)],
                "helper-ids": [i for i, _ in cur], "helper-versions": [v for _, v in cur],
                "cand-ids": fill + repl, "cand-reasons": ["fill"] * len(fill) + ["replace"] * len(repl),
                "do-refresh": do_refresh})
            for i, reason in [(i, "fill") for i in fill] + [(i, "replace") for i in repl]:
                rec = numpy_to_record(self.pool[i][1])
                content[f"cand.{i}"] = rec
                self.count(reason)
            select_msgs.append(query(content, n, "select", str(t)))
        selected = set()
        for r in self.exchange(grid, select_msgs):
            n, c = r.metadata.src_node_id, r.content.config_records[CONFIG_KEY]
            lists[n] = list(zip((int(i) for i in c["helper-ids"]), (int(v) for v in c["helper-versions"])))
            refreshed[n] = {int(i) for i in c["refresh-ids"]}
            swaps += int(r.content.metric_records[METRICS_KEY]["swaps"])
            selected.add(n)
        failed = {m.metadata.dst_node_id for m in select_msgs} - selected
        train_msgs = []
        for n in nodes:
            if n in failed:
                continue
            pid = self.partition_of[n]
            content = self.base_content(t, **{"helper-ids": [i for i, _ in lists[n]],
                                              "helper-versions": [v for _, v in lists[n]]})
            if pid in self.pool:  # else the client warms up first (it missed the warm-up)
                own = numpy_to_record(self.pool[pid][1])
                content[ARRAYS_KEY] = own
            for i, v in lists[n]:
                rec = numpy_to_record(self.fetch(i, v))
                content[f"helper.{i}"] = rec
                if i in refreshed[n]:
                    self.count("refresh")
            train_msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(t)))
        self._refreshed = refreshed   # (record_kind: a helper sent again is a refresh, else the cache)
        replies = self.exchange(grid, train_msgs)
        uploads, mets = [], []
        for r in replies:
            m = r.content.metric_records[METRICS_KEY]
            c = r.content.config_records[CONFIG_KEY]
            pid = int(m["partition-id"])
            self.refs[pid] = list(zip((int(i) for i in c["helper-ids"]), (int(v) for v in c["helper-versions"])))
            rec = r.content.array_records[ARRAYS_KEY]
            self.count("upload")
            uploads.append((pid, record_to_numpy(rec)))
            mets.append(m)
        for pid, st in uploads:   # after every list is updated, so the archive keeps what they reference
            self.upload(pid, t, st)
        self.gc()
        out["participants"] = len(replies)
        slots = sum(len(lists[n]) for n in nodes if n in selected) or 1
        out.update({"helper-swaps": swaps, "helper-churn": swaps / slots, "pool-archive-size": len(self.archive)})
        out["label-metrics-nodes"] = sum("pseudo-label-accuracy" in m for m in mets)  # (records.label_consent)
        for key in ("train-loss", "pseudo-label-accuracy", "pseudo-label-accuracy-self",
                    "pseudo-label-accuracy-helpers", "pseudo-label-from-self", "mu", "self-weight", "corr-self"):
            vals = [float(m[key]) for m in mets if key in m]
            if vals:
                out[key] = float(np.nanmean(vals)) if not all(map(math.isnan, vals)) else float("nan")
        out.update(self.flush_counts())
        return out

    # ---------------------------------------------------------------- checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {**super().extra_state(), "pool": self.pool, "archive": self.archive, "refs": self.refs}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        super().load_extra_state(state)
        self.pool = state.get("pool", {})
        self.archive = state.get("archive", {})
        self.refs = state.get("refs", {})


_HANDLERS = {"train": client_train, "evaluate": client_evaluate, "select": client_select,
             "warmup": client_warmup}
PAPER = "Shi, Chen, Zhang: Uncertainty Minimization for Personalized FSSL (UM-pFSSL)"


def _spec(name: str, cls: type, mode: str, desc: str, client: dict, node_state: tuple[str, ...]) -> AlgorithmSpec:
    """UM-pFSSL's spec (its baselines' are :func:`strategies.umpfssl.fixmatch_baselines.spec`)."""
    return AlgorithmSpec(name=name, paper=PAPER, strategy_cls=cls, config_cls=UMPFSSLConfig, namespace=NS,
                         client=dict(client), description=desc, node_state=node_state,
                         # from the node's labels: its hidden labels (pseudo-label accuracy), its labeled
                         # set's (corr-self, the Corr score of its own model, Eq. of the paper's helper score)
                         label_metrics=("pseudo-label-accuracy", "pseudo-label-accuracy-self",
                                        "pseudo-label-accuracy-helpers", "corr-self"))


ALGORITHMS = register({
    "umpfssl": _spec("umpfssl", UMPFSSLStrategy, "umpfssl",
                     "personalized models; helpers chosen by MC-dropout uncertainty; server = model pool",
                     _HANDLERS, (STATE_HELPERS,)),
})


class UMPFSSLClient(AlgorithmClient):
    """UM-pFSSL's client with a user's model (with dropout, for MC-dropout) and the node's labeled, unlabeled and test data (the test set is the
    node's personalized evaluation). ``query.warmup``, ``query.select`` (helpers' MC-dropout
    uncertainty on the node's data), ``train`` and ``evaluate``."""

    module = __name__
    needs = ('labeled', 'unlabeled', 'test')
