"""FedConcat: cluster the clients by label distribution, train one model per cluster, then
concatenate the cluster encoders and train a new head (SCALA's full-model baseline:
the SCALA paper's Sec. 5.1, Table IV; ``docs/baselines.md`` B4).

Y. Diao, Q. Li, B. He, "Exploiting Label Skews in Federated Learning with Model Concatenation",
AAAI 2024, 38(10):11784-11792 (arXiv:2312.06290); code github.com/sjtudyq/FedConcat
(``experiments.py``, branch ``alg == 'fedconcat'``; ``kmeanslimited.py``).

Algorithm
---------
0. **Label distributions** (round 1, the ``label-histogram`` query to every connected node,
   :mod:`strategies.label_histogram`). Node k replies its class counts ``n_{k,c}`` and ``n_k``,
   plus Laplace noise ``Lap(0, n_k/eps)`` per count when ``fedconcat.label-noise-eps = eps > 0``,
   so that ``p_k = counts / n_k`` carries ``Lap(0, 1/eps)`` per class (the authors' ``--eps``:
   added by the client, not clipped or renormalised). **This discloses each node's label histogram to the
   server** (noised if eps > 0); it is the algorithm's input, not a metric, so it is sent
   without the label-metrics consent (``share-label-metrics``).
1. **K-means** (:func:`tasks.scala.kmeans.kmeans`, seeded) on the ``p_k`` into ``K' = min(K, nodes)``
   clusters (``fedconcat.clusters``, K = 5); with ``fedconcat.constrained`` no cluster holds
   more than ``max(ceil(N/K), floor(size-factor N/K))`` nodes (the authors' choice for
   CIFAR-100/TinyImageNet, size factor 1.2). Empty clusters are dropped. A node first seen
   later (it failed the query, or joined) is asked then and put in the cluster of the nearest
   centre [ours].
2. **Encoder stage**, rounds ``1..E``: each cluster c has a full model ``w_c`` (encoder plus
   head), all starting from the global initial model. The round's participants are sampled
   from all nodes (``fraction-train``), then grouped by cluster; node k trains FedAvg's local
   SGD from ``w_{c(k)}`` and ``w_c <- sum_{k in S_c} n_k w_k / sum n_k`` (every state entry, BN
   buffers included), n_k = |D_k| the node's training-set size (the reply's ``num-examples``;
   the authors' ``experiments.py``, lines 1346-1347, weights each member's model by its share of
   the cluster's data points, ``len(net_dataidx_map[r]) / total_data_points``), over the
   members that replied; ``upload-weight=processed-examples`` (the round policy) weights by the
   samples each processed instead. A cluster without participants keeps its model.
3. **Concatenation.** The model ``f(x) = W e(x) + b`` is split generically: its last
   ``nn.Linear`` is the head, the rest the encoder ``e`` (:mod:`tasks.scala.fedconcat_model`; a
   model whose output is not that layer's is a ``ConfigError``). ``phi(x) = [e_1(x); ...;
   e_K'(x)]`` (``K' d`` features) is frozen: encoders in eval mode, no gradient [ours: the
   authors' code leaves their BatchNorm in train mode while the head trains].
4. **Classifier stage**, rounds ``E+1..T``: a head ``W' (M x K'd), b'`` is trained by FedAvg over
   the sampled nodes, head only, uniform average ``W' <- mean_k W'_k`` (the authors': every
   client takes the same number of steps, ``experiments.py`` line 1433; ``upload-weight``
   does not apply here). It starts from the cluster heads,
   ``W' = [W_1 ... W_K']``, ``b' = sum_c b_c`` (``fedconcat.head-init = concat``, the authors'
   choice for CIFAR-100); ``random`` is a fresh seeded ``nn.Linear``.

``E = fedconcat.encoder-rounds``, or with 0 (default) ``ceil(encoder-share x num-rounds)``,
encoder-share = 1/2 ([ours]: T/2 rounds each; the stage switch scales with the
run). Local work in both stages is the task's ``local-steps``/``local-epochs`` and
``batch-size`` (the authors: 10 epochs in the encoder stage, 3 mini-batches of one epoch in the
classifier stage; SCALA's comparison gives every FL baseline the same I steps).

Evaluation [ours]: before round 1, the initial global model; from round 1 on, the
concatenated model ``head(phi(x))``, with the concatenated cluster heads during the encoder
stage (its logits are the sum of the K' cluster models' logits: the classifier stage's
starting point) and the trained head after. ``Result.arrays`` is that model's state
(``encoders.<c>.<key>``, ``head.weight``, ``head.bias``): the final model is K' times wider.

What travels (byte kinds)
-------------------------
* ``label-histogram``: M floats up per node, once (``histogram``).
* Encoder stage: ``cluster-weights`` down (the node's cluster model) and up (its local model).
* Classifier stage: ``head`` down and up (``M (K'd + 1)`` values), and the K' encoders down:
  ``encoders`` the first time a node (node id) receives them, ``encoders-resent`` after that:
  the clients are stateless [ours], so the encoders travel with every classifier-stage
  message; the authors' client downloads them once (``encoders`` is the paper's traffic,
  ``encoders-resent`` implementation overhead).

Client contract
---------------
* ``query.label_histogram`` (:mod:`strategies.label_histogram`): in ``task``, ``algo``,
  ``config`` (``label-noise-eps``); out ``config`` with ``partition-id``, ``num-examples`` and
  the array record ``label-histogram`` (``counts``, M floats).
* ``train`` with ``config["fedconcat-stage"] = "encoder"``: FedAvg's
  (:mod:`strategies.fedavg`): ``arrays`` (the cluster model) in; ``arrays``, ``metrics``
  (``num-examples`` = |D_k|, ``processed-examples``, ``train-loss``) out.
* ``train`` with ``"classifier"``: ``encoder.<c>`` (cluster c's state without the head's keys,
  ``c = 0..fedconcat-clusters - 1``) and ``head`` (``weight``, ``bias``) in; local SGD on the
  head over the frozen concatenated encoders; ``head`` and ``metrics`` (the same three) out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from torch import nn

from strategies.core.folds import sized_metrics, upload_weight
from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    algo_config,
    client_env,
    model_to_record,
    numpy_to_record,
    record_to_numpy,
)
from tasks.aggregate import RunningWeightedMean
from tasks.config import knob
from tasks.scala.fedconcat_model import ConcatModel, check_split, concat_heads, head_keys, strip_head
from tasks.scala.kmeans import kmeans, nearest, size_cap
from tasks.training import derive_seed, load_numpy_state, make_sgd, num_local_steps, seeded, train_supervised

from ..base import BaseStrategy
from ..client import AlgorithmClient, server_round
from ..fedavg import client_train as fedavg_train
from ..label_histogram import HISTOGRAM, LabelHistograms, client_label_histogram
from ..registry import AlgorithmSpec, register

NS = "fedconcat"
HEAD = "head"
STAGE = "fedconcat-stage"


@dataclass(frozen=True)
class FedConcatConfig:
    """FedConcat knobs (namespace ``fedconcat``); defaults from the authors' run.sh (``docs/baselines.md`` B4)."""

    clusters: int = knob(5, lo=1, help="K: clusters of clients by label distribution (capped by the number of nodes)")
    encoder_rounds: int = knob(0, lo=0, help="rounds of the encoder stage (0 = encoder-share of the run's rounds)")
    encoder_share: float = knob(0.5, lo=0.0, hi=1.0, lo_open=True,
                                help="share of the run's rounds in the encoder stage, rounded up (encoder-rounds = 0)")
    constrained: bool = knob(False, help="constrained K-means: at most max(ceil(N/K), floor(size-factor N/K)) "
                                         "nodes per cluster")
    size_factor: float = knob(1.2, lo=1.0, help="cluster size cap factor of constrained K-means")
    head_init: str = knob("concat", choices=("concat", "random"),
                          help="classifier-stage head: the cluster heads concatenated (bias summed) or random")
    label_noise_eps: float = knob(0.0, lo=0.0, help="eps of the Laplace(0, 1/eps) noise each node adds to its "
                                                    "label distribution (0 = none)")
    kmeans_restarts: int = knob(10, lo=1, help="K-means restarts from k-means++ seeds (the least inertia is kept)")


def _cfg(msg: Message) -> FedConcatConfig:
    return algo_config(msg, FedConcatConfig)


# =============================================================================== client side
def _train_head(msg: Message, context: Context) -> Message:
    env = client_env(msg, context, label_mode="all")
    conf = msg.content.config_records[CONFIG_KEY]
    rnd, k = server_round(msg), int(conf["fedconcat-clusters"])
    recs = msg.content.array_records
    encoders = []
    for c in range(k):
        encoder, _ = strip_head(env.build_model())
        load_numpy_state(encoder, record_to_numpy(recs[f"encoder.{c}"]))
        encoders.append(encoder)
    state = record_to_numpy(recs[HEAD])
    head = nn.Linear(state["weight"].shape[1], state["weight"].shape[0], bias="bias" in state).to(env.device)
    load_numpy_state(head, state)
    model = ConcatModel(encoders, head)
    data, task = env.labeled(), env.task
    metrics = train_supervised(
        model, data, aug=env.augmenter, steps=num_local_steps(task, len(data)), batch_size=task.batch_size,
        optimizer=make_sgd(head.parameters(), task), device=env.device,
        seed=derive_seed(task.seed, "fedconcat-head", rnd, env.partition_id))
    metrics = sized_metrics(metrics, len(data))
    return Message(RecordDict({HEAD: model_to_record(head), METRICS_KEY: MetricRecord(metrics)}), reply_to=msg)


def client_train(msg: Message, context: Context) -> Message:
    """``train``: FedAvg's local SGD on the cluster model (encoder stage) or local SGD on the head
    over the frozen concatenated encoders (classifier stage), as ``config["fedconcat-stage"]`` says."""
    stage = str(msg.content.config_records[CONFIG_KEY].get(STAGE, "encoder"))
    if stage == "classifier":
        return _train_head(msg, context)
    if stage != "encoder":
        raise ValueError(f"fedconcat: unknown stage {stage!r}; expected 'encoder' or 'classifier'")
    return fedavg_train(msg, context)


# =============================================================================== server side
def _arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """A state as arrays (an average of 0-d entries, e.g. BN's ``num_batches_tracked``, is a scalar)."""
    return {k: np.asarray(v) for k, v in state.items()}


class FedConcatStrategy(LabelHistograms, BaseStrategy):
    """Clusters by label distribution, per-cluster FedAvg, then a head over the concatenated
    encoders (module docstring)."""

    label_mode = "all"

    def setup_algorithm(self) -> None:
        self.head_keys = head_keys(self.model)          # ConfigError if the model has no nn.Linear
        sample = next((d for d in (self.env.test, self.env.server_labeled()) if d is not None and len(d)), None)
        if sample is not None and self.env.augmenter is not None:
            x = self.env.augmenter.test(torch.from_numpy(sample.x[:2])).to(self.env.device)
            check_split(self.model, x)
        self.assign: dict[int, int] = {}                # partition id -> cluster
        self.centres: np.ndarray | None = None
        self.cluster_states: list[dict[str, np.ndarray]] = []
        self.head_state: dict[str, np.ndarray] | None = None   # the classifier stage's head
        self.encoders_at: set[int] = set()             # node ids that received the encoders
        self._fresh: set[int] = set()
        self._concat: ConcatModel | None = None

    # ---------------------------------------------------------------- schedule
    def encoder_rounds(self) -> int:
        """E: rounds ``1..E`` are the encoder stage."""
        if self.cfg.encoder_rounds > 0:
            return int(self.cfg.encoder_rounds)
        return max(1, math.ceil(self.cfg.encoder_share * max(self.num_rounds, 1) - 1e-9))

    def stage(self, server_round: int) -> str:
        return "encoder" if server_round <= self.encoder_rounds() else "classifier"

    # ---------------------------------------------------------------- clustering
    def cluster(self, grid: Grid, server_round: int) -> None:
        """Every connected node's label distribution, then K-means (module docstring, steps 0-1)."""
        self.learn_histograms(grid, sorted(grid.get_node_ids()), server_round)
        pids = sorted(self.histograms)
        if not pids:
            return
        x = np.array([self.label_distribution(p) for p in pids])
        k = min(self.cfg.clusters, len(pids))
        cap = size_cap(len(pids), k, self.cfg.size_factor) if self.cfg.constrained else None
        labels, self.centres = kmeans(x, k, derive_seed(self.task.seed, "fedconcat-kmeans"),
                                      restarts=self.cfg.kmeans_restarts, size_max=cap)
        self.assign = {p: int(c) for p, c in zip(pids, labels)}
        base = {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
        self.cluster_states = [{k: v.copy() for k, v in base.items()} for _ in range(len(self.centres))]
        self._concat = None

    def clusters_of(self, grid: Grid, nodes: list[int], server_round: int) -> dict[int, int]:
        """node -> cluster of the nodes given; a node not clustered yet is asked its label
        distribution now and joins the nearest centre."""
        nodes = self.learn_partitions(grid, nodes, server_round=server_round)
        late = [n for n in nodes if self.partition_of[n] not in self.histograms]
        if late:
            self.learn_histograms(grid, late, server_round)
        out = {}
        for n in nodes:
            pid = self.partition_of.get(n)
            if pid is None or pid not in self.histograms:
                continue
            if pid not in self.assign:
                self.assign[pid] = nearest(self.centres, self.label_distribution(pid))
            out[n] = self.assign[pid]
        return out

    # ---------------------------------------------------------------- rounds
    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        nodes = self.sample_nodes(grid, server_round)
        clustered_now = self.centres is None
        if clustered_now:
            self.cluster(grid, server_round)
        if self.centres is None:
            log(WARNING, "round %s skipped: no node reported its label distribution", server_round)
            return {"participants": 0, "skipped": 1}
        stage = self.stage(server_round)
        out = (self.encoder_round if stage == "encoder" else self.classifier_round)(server_round, grid, nodes)
        out.update({"fedconcat-stage": int(stage == "classifier"), "clusters": len(self.cluster_states)})
        if clustered_now:   # (the clustering's outcome, once: nodes per cluster)
            out["cluster-sizes"] = np.bincount(list(self.assign.values()), minlength=len(self.cluster_states)).tolist()
        if out.get("skipped"):
            log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round,
                out["participants"], self.policy.min_nodes)
        return out

    def encoder_round(self, server_round: int, grid: Grid, nodes: list[int]) -> dict[str, Any]:
        of = self.clusters_of(grid, nodes, server_round)
        records = {c: numpy_to_record(s) for c, s in enumerate(self.cluster_states)}
        msgs = []
        for n in nodes:
            if n not in of:
                continue
            content = self.base_content(server_round, **{STAGE: "encoder", "fedconcat-cluster": of[n]})
            content[ARRAYS_KEY] = records[of[n]]
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        # each reply folded into its cluster's running weighted mean as it arrives, then let go
        means: dict[int, RunningWeightedMean] = {}
        told: dict[int, list[tuple[float, float]]] = {}   # cluster -> (loss, weight) per reply

        def fold(r: Message) -> None:
            c = of[r.metadata.src_node_id]
            met = r.content.metric_records[METRICS_KEY]
            n_k = upload_weight(self.policy, met)   # |D_k| (module docstring, step 2)
            means.setdefault(c, RunningWeightedMean()).add(record_to_numpy(r.content.array_records[ARRAYS_KEY]), n_k)
            told.setdefault(c, []).append((float(met["train-loss"]), n_k))

        folded = self.exchange_fold(grid, msgs, fold)
        if folded < self.policy.min_nodes:
            return {"participants": folded, "skipped": 1}
        losses, weights = [], []
        for c, mean in sorted(means.items()):
            if mean.total <= 0:
                continue
            self.cluster_states[c] = _arrays(mean.result())
            losses += [lo for lo, _ in told[c]]
            weights += [n for _, n in told[c]]
        self._concat = None
        out: dict[str, Any] = {"participants": folded, "clusters-trained": len(means)}
        if weights:
            out["train-loss"] = float(np.average(losses, weights=weights))
        return out

    def initial_head(self) -> dict[str, np.ndarray]:
        """The classifier stage's first head (``head-init``)."""
        heads = [{k.rsplit(".", 1)[1]: s[k] for k in self.head_keys} for s in self.cluster_states]
        if self.cfg.head_init == "concat":
            return concat_heads(heads)
        m, d = heads[0]["weight"].shape
        with seeded(derive_seed(self.task.seed, "fedconcat-head-init")):
            layer = nn.Linear(d * len(heads), m, bias="bias" in heads[0])
        return {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}

    def encoder_state(self, c: int) -> dict[str, np.ndarray]:
        keys = set(self.head_keys)
        return {k: v for k, v in self.cluster_states[c].items() if k not in keys}

    def classifier_round(self, server_round: int, grid: Grid, nodes: list[int]) -> dict[str, Any]:
        if self.head_state is None:
            self.head_state = self.initial_head()
            self._concat = None
        k = len(self.cluster_states)
        encoders = [numpy_to_record(self.encoder_state(c)) for c in range(k)]
        head = numpy_to_record(self.head_state)
        msgs = []
        for n in nodes:
            content = self.base_content(server_round, **{STAGE: "classifier", "fedconcat-clusters": k})
            content[HEAD] = head
            for c in range(k):
                content[f"encoder.{c}"] = encoders[c]
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        self._fresh = {n for n in nodes if n not in self.encoders_at}
        mean, losses = RunningWeightedMean(), []   # the heads' uniform mean, folded as they arrive

        def fold(r: Message) -> None:
            mean.add(record_to_numpy(r.content.array_records[HEAD]), 1.0)
            losses.append(float(r.content.metric_records[METRICS_KEY]["train-loss"]))

        folded = self.exchange_fold(grid, msgs, fold)
        self.encoders_at.update(m.metadata.dst_node_id for m in msgs)
        if folded < self.policy.min_nodes:
            return {"participants": folded, "skipped": 1}
        self.head_state = _arrays(mean.result())
        self._concat = None
        return {"participants": folded, "train-loss": float(np.mean(losses))}

    @property
    def label_noise_eps(self) -> float:   # the nodes noise their label histograms (LabelHistograms)
        return float(self.cfg.label_noise_eps)

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        """FedConcat's kinds: ``cluster-weights`` (encoder stage), ``head``, and the encoders
        (``encoders`` the first time a node receives them, ``encoders-resent`` after); the
        label histograms are ``histogram``."""
        if key == ARRAYS_KEY:
            return "cluster-weights"
        if key == HEAD:
            return "head"
        if key.startswith("encoder."):
            return "encoders" if msg.metadata.dst_node_id in self._fresh else "encoders-resent"
        return super().record_kind(key, msg, direction)

    # ---------------------------------------------------------------- the evaluated model
    def eval_model(self) -> torch.nn.Module:
        """The initial model before round 1, then the concatenated model (module docstring)."""
        if not self.cluster_states:
            return self.model
        if self._concat is None:
            encoders = []
            for c in range(len(self.cluster_states)):
                encoder, _ = strip_head(self.env.build_model())
                load_numpy_state(encoder, self.encoder_state(c))
                encoders.append(encoder)
            state = self.head_state if self.head_state is not None else concat_heads(
                [{k.rsplit(".", 1)[1]: s[k] for k in self.head_keys} for s in self.cluster_states])
            head = nn.Linear(state["weight"].shape[1], state["weight"].shape[0], bias="bias" in state)
            head = head.to(self.env.device)
            load_numpy_state(head, state)
            self._concat = ConcatModel(encoders, head)
        return self._concat

    # ---------------------------------------------------------------- checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {**self.histogram_state(),
                "assign-pids": sorted(self.assign), "assign": [self.assign[p] for p in sorted(self.assign)],
                "centres": self.centres, "cluster-states": list(self.cluster_states),
                "head": self.head_state, "encoders-at": sorted(self.encoders_at)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.load_histogram_state(state)
        self.assign = {int(p): int(c) for p, c in zip(state.get("assign-pids", []), state.get("assign", []))}
        centres = state.get("centres")
        self.centres = None if centres is None else np.asarray(centres)
        self.cluster_states = [dict(s) for s in state.get("cluster-states", [])]
        head = state.get("head")
        self.head_state = None if head is None else dict(head)
        self.encoders_at = {int(n) for n in state.get("encoders-at", [])}
        self._concat = None


ALGORITHMS = register({
    "fedconcat": AlgorithmSpec(
        name="fedconcat", paper="Diao, Li, He 2024 (AAAI); SCALA baseline", strategy_cls=FedConcatStrategy,
        config_cls=FedConcatConfig, namespace=NS,
        client={"train": client_train, HISTOGRAM: client_label_histogram},
        description="K-means on label distributions, per-cluster FedAvg, then a head over the concatenated "
                    "encoders; all client data labeled"),
})


class FedConcatClient(AlgorithmClient):
    """FedConcat's client with a user's model (its last ``nn.Linear`` is the head) and the node's
    own labeled data (``labeled``): the label-distribution query, FedAvg's local SGD on its
    cluster's model (encoder stage), and local SGD on the head over the frozen concatenated
    encoders (classifier stage)."""

    module = __name__
    needs = ("labeled",)

