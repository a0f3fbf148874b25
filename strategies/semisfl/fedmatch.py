"""FedMatch, labels-at-server scenario: disjoint learning of a decomposed model, with inter-client
consistency (a baseline of the Semi-SFL paper: Sec. V-B, Tables II, IV, V; ``docs/baselines.md``
A2).

Paper: W. Jeong, J. Yoon, E. Yang, S. J. Hwang, "Federated Semi-Supervised Learning with
Inter-Client Consistency & Disjoint Learning", ICLR 2021 (arXiv:2006.12097); authors' code
github.com/wyjeong/FedMatch (TF2: config.py, models/fedmatch/{client,server}.py, modules/train.py,
modules/layers.py, modules/nets.py), tagged [C]; the library's choices where paper and code
are silent or disagree [ours] (``docs/baselines.md`` A2). The rules are in :mod:`tasks.semisfl.fedmatch_decomp`.

Setting: the server holds the labeled set D_S (``server-labels``); the clients hold unlabeled
data only. **Decomposition** [C]: every conv and linear kernel is ``theta = sigma + psi``;
sigma (supervised) is trained on the server only, psi (unsupervised, sparse) on the clients
only. Kernels are found by module type (``nn.Conv*``, ``nn.Linear``), so a user's own model
works; a model without one is a ``ConfigError``. Biases and the normalisation layers' affine
parameters are not decomposed: they belong to sigma and are trained on the server [ours] (or stay
frozen: ``norm-affine='frozen'``, the code-faithful option: the authors' ResNet-9 has no
normalisation layers and no biases). **Initialisation**: the model's own initialisation (or
``start(initial_arrays=...)``) is theta; sigma = theta/(1 + psi_factor), psi = theta - sigma,
i.e. psi = 0.2 sigma [C] and sigma + psi = theta exactly [ours: the authors draw sigma and set
psi = 0.2 sigma, so their theta is 1.2 x a Glorot draw; here the given model is theta].

Round t (:class:`FedMatchStrategy`)
-----------------------------------
1. **Helpers** [C ``get_similar_models``]: in rounds with ``t % helper-interval == 0`` (the
   authors' ``(curr_round + 1) % h_interval == 0``, 0-based rounds; default every 10th), a
   sampled client that has taken part before gets the psi_j of its H (``helpers``) nearest
   clients by model embedding: ``e_k = softmax(f_{sigma+psi_k}(g))``, g one fixed truncated-
   Gaussian image (mean 125, std 125 on the pixel scale, seeded by the run seed; the test
   transform's normalisation), computed by the server when psi_k arrives (with sigma of that
   moment) and kept for every client seen; nearest = Euclidean, the client itself excluded (a
   plain nearest-neighbour search instead of the authors' KD-tree: the same answer). Clients
   are identified by partition id (the ``node-info`` query), so helpers survive a resume.
2. **Broadcast**: the global model theta = sigma + psi (``arrays``, byte kind ``weights``:
   the full state dict, BN buffers included), psi (``fedmatch.psi``, kind ``psi``) and, in
   helper rounds, the helpers' psi_j (``fedmatch.helpers``, kind ``helpers``, dense [ours]).
   The client recovers sigma = theta - psi (to rounding) [ours: the same bytes as sending
   sigma, and ``arrays`` stays the model a user evaluates].
3. **Client** (:func:`tasks.semisfl.fedmatch_decomp.client_steps`), psi only, sigma frozen:
   ``local-steps`` (or ``local-epochs`` passes) on unlabeled batches u of ``batch-size``;
   p = softmax(f_{sigma+psi}(weak(u))) [R: the paper's weak view; the code uses u as it is],
   C = {i: max p_i >= tau}; on C::

       L = lambda_i (1/H) sum_j mean_C KL(p*_j || p) + lambda_a mean_C CE(yhat, f(strong(u)))
         + lambda_l1 ||psi||_1 + lambda_l2 ||sigma - psi||_2^2

   p*_j = helper j's (sigma + psi_j) prediction on the same weak batch (no gradient, train mode
   [ours]); yhat = argmax(onehot(argmax p) + sum_j onehot(argmax p*_j)) (agreement vote, ties to
   the lowest class [C numpy argmax]); without helpers yhat = argmax p and no KL [C]. The
   regularisers apply at every step, confident samples or not [C]. The strong view is the
   library's RandAugment + Cutout (A = RandAugment [C]). SGD with the round's lr and the task's
   momentum, no weight decay on psi [ours: psi has its own L1/L2 terms; the authors use none],
   momentum fresh each round; the client keeps nothing between rounds [ours: the authors'
   client keeps its own value of entries the server changed by < delta_thres].
4. **Upload** [C ``cal_c2s``] (:func:`tasks.semisfl.fedmatch_decomp.encode_upload`): psi sparsified
   (entries with |psi| > ``l1-thres``, the rest 0 [ours: the code sends the raw value of a
   changed entry]) and only the entries that changed by more than ``delta-thres`` from the psi
   it received; each kernel travels as (int32 index, float32 value) pairs or dense, whichever is
   fewer bytes (``fedmatch.psi-up``, kind ``psi-sparse``: the bytes that travel).
5. **Aggregation** [C ``uniform_average``]: psi = uniform mean of the clients' decoded psi_k;
   then each psi_k's embedding (step 1).
6. **Server** [C ``train_global_model``]: ``k-s`` SGD steps (batches of
   ``labeled-batch-size``) of lambda_s CE(y, f_{sigma+psi}(weak(x))) on D_S [ours: the weak
   view, as the library's other servers; the code feeds x unaugmented], sigma only, psi
   fixed (:func:`tasks.semisfl.fedmatch_decomp.server_steps`); optimizer with the task's momentum and
   weight decay, kept across rounds. The server's BN running statistics are the global ones
   (clients' are discarded) [ours].
7. **Evaluation**: theta = sigma + psi (the returned ``arrays``) [ours: the code's test pass
   sparsifies psi first; uploads are sparsified already, the difference is entries <= 1e-5].

Order: the authors' (``server_trains_first``): the server stage (step 6) opens every round,
then steps 1-5 (their round 0's server stage runs ``num_epochs_server_pretrain`` = 1 epoch in
place of ``num_epochs_server`` = 1: no extra stage). A round with fewer than ``min-nodes``
replies keeps its server stage and psi.

Defaults: tau 0.75, H 2, h_interval 10, lambda_s 10, lambda_i = lambda_a = 1e-2, lambda_l1
1e-5, lambda_l2 10, l1_thres = delta_thres = 1e-5, psi_factor 0.2 [C config.py,
labels-at-server]. Budget [ours]: K_s = 50 server steps per round (Semi-SFL's initial K_s;
the authors: 1 epoch) and the run's ``local-steps`` on the clients; Semi-SFL's optimizer (SGD,
momentum 0.9, lr 0.02 decayed by a cosine over the rounds: ``lr-schedule``, one rate per round
for server and clients [ours]; the authors: lr 1e-3 divided by 3 on a validation plateau).
The L2 term's fixed point is psi = sigma (the L1 term shifts it by lambda_l1/(2 lambda_l2) =
5e-7) [C models/fedmatch/client.py line 102, config.py lines 82-83, commit 4947aa2]: a client
step multiplies psi - sigma by 1 - 2 lr lambda_l2 with plain SGD (0.98 at the authors' lr 1e-3,
config.py line 59, modules/train.py line 65) and by about sqrt(0.9) per step with momentum 0.9,
so at the default optimizer psi is a copy of sigma within a few rounds (``psi-sigma-ratio``
1.00; the probe in ``docs/baselines.md`` A2).

Client contract
---------------
``train`` message: ``arrays`` (theta, the full state dict), ``fedmatch.psi`` ({kernel name:
psi}), optionally ``fedmatch.helpers`` ({``<j>/<kernel name>``: psi_j}), ``task``, ``algo``
(:class:`FedMatchConfig`) and ``config`` with ``server-round``, ``fedmatch-lr`` and
``fedmatch-helpers`` (H' sent). Reply: ``fedmatch.psi-up`` (step 4's encoding) and ``metrics``
with ``num-examples``, ``train-loss``, ``mask-rate``, ``pseudo-kept``, ``psi-changed`` and
``psi-entries`` (upload density), and, only with the node's consent (``share-label-metrics``),
``pseudo-correct`` (confident agreement labels equal to the hidden label), from which the
server reports ``impurity``.
"""
from __future__ import annotations

from dataclasses import dataclass
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from strategies.core.records import (
    ARRAYS_KEY,
    CONFIG_KEY,
    METRICS_KEY,
    algo_config,
    client_env,
    consented_share,
    model_to_record,
    numpy_to_record,
    record_to_numpy,
)
from tasks.config import ConfigError, knob
from tasks.semisfl.fedmatch_decomp import (
    client_steps,
    compose_model,
    decode_upload,
    decompose,
    embed,
    encode_upload,
    kernel_names,
    nearest_helpers,
    norm_param_names,
    probe_image,
    server_steps,
)
from tasks.schedules import cosine_decay
from tasks.training import (
    derive_seed,
    load_numpy_state,
    make_sgd,
    num_local_steps,
    set_lr,
)

from ..base import BaseStrategy
from ..client import AlgorithmClient, server_round
from ..registry import AlgorithmSpec, register

__all__ = [
    "ALGORITHMS",
    "HELPERS_KEY",
    "PSI_KEY",
    "UPLOAD_KEY",
    "FedMatchClient",
    "FedMatchConfig",
    "FedMatchStrategy",
    "client_train",
]

PSI_KEY = "fedmatch.psi"          # server -> client: the global psi
HELPERS_KEY = "fedmatch.helpers"  # server -> client: the helpers' psi_j ("<j>/<kernel>")
UPLOAD_KEY = "fedmatch.psi-up"    # client -> server: the sparse psi upload
LABEL_METRICS = ("pseudo-correct",)


@dataclass(frozen=True)
class FedMatchConfig:
    """Run-config keys ``fedmatch.<key>``; defaults: the authors' labels-at-server config [C]
    and, for the step budget, Semi-SFL's (K_s = 50 server steps per round, the same budget)."""

    k_s: int = knob(50, lo=1, help="server steps on sigma per round (lambda_s CE on D_S; authors: 1 epoch)")
    labeled_batch_size: int = knob(0, lo=0, help="server batch size on D_S (0 = batch-size)")
    tau: float = knob(0.75, lo=0.0, hi=1.0, help="confidence threshold: samples with max p >= tau count")
    helpers: int = knob(2, lo=0, help="H: helpers (nearest clients by model embedding); 0 = no inter-client "
                                      "consistency")
    helper_interval: int = knob(10, lo=1, help="helpers are sent in rounds t with t % helper-interval == 0")
    lambda_s: float = knob(10.0, lo=0.0, lo_open=True, help="weight of the server's cross-entropy")
    lambda_i: float = knob(1e-2, lo=0.0, help="weight of the inter-client consistency KL(p*_j || p)")
    lambda_a: float = knob(1e-2, lo=0.0, help="weight of the agreement-label cross-entropy on the strong view")
    lambda_l1: float = knob(1e-5, lo=0.0, help="weight of ||psi||_1 (sparsity of psi)")
    lambda_l2: float = knob(10.0, lo=0.0, help="weight of ||sigma - psi||_2^2")
    l1_thres: float = knob(1e-5, lo=0.0, help="psi entries with |psi| <= l1-thres are uploaded as 0")
    delta_thres: float = knob(1e-5, lo=0.0, help="only psi entries that changed by more than this are uploaded")
    psi_factor: float = knob(0.2, lo=0.0, hi=1.0, help="initial psi = psi-factor x sigma (theta = sigma + psi)")
    norm_affine: str = knob("server", choices=("server", "frozen"),
                            help="normalisation layers' affine parameters: trained with sigma on the server, "
                                 "or frozen")
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"),
                            help="per-round lr: cosine decay over num-rounds, or constant")


def _tensors(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)).to(device) for k, v in arrays.items()}


def _numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().astype(np.float32) for k, v in tensors.items()}


class FedMatchStrategy(BaseStrategy):
    """FedMatch's server (module docstring): sigma trained on D_S, psi the uniform mean of the
    clients' sparse uploads, helpers by model embedding; the result is sigma + psi."""

    label_mode = "server"
    server_trains_first = True   # the server stage (step 6) opens every round, as the authors'
    reply_metrics = ("train-loss", "mask-rate")

    # ------------------------------------------------------------------ setup
    def setup_algorithm(self) -> None:
        if len(self.env.server_labeled()) == 0:
            raise ConfigError("fedmatch needs labeled data on the server: labeled_data=(x, y)"
                              if self.user is not None else
                              "fedmatch needs server-labels > 0 (the labeled set D_S on the server)")
        self.kernels = kernel_names(self.model)
        params = dict(self.model.named_parameters())
        psi: dict[str, torch.Tensor] = {}
        with torch.no_grad():   # theta (the model as given) -> sigma (in the model) + psi
            for k in self.kernels:
                sigma, psi[k] = decompose(params[k].detach().clone(), self.cfg.psi_factor)
                params[k].copy_(sigma)
        self.psi = psi
        frozen = set(norm_param_names(self.model)) if self.cfg.norm_affine == "frozen" else set()
        self.sigma_params = [p for k, p in self.model.named_parameters() if k not in frozen]
        self.optimizer = make_sgd(self.sigma_params, self.task)
        self.probe = self.env.augmenter.test(
            probe_image(self.env.input_shape, derive_seed(self.task.seed, "fedmatch-probe")).to(self.env.device))
        self.client_psi: dict[int, dict[str, np.ndarray]] = {}   # client key -> its last psi
        self.client_vec: dict[int, np.ndarray] = {}              # client key -> its embedding

    def round_lr(self, server_round: int) -> float:
        if self.cfg.lr_schedule == "constant":
            return self.task.lr
        return cosine_decay(server_round - 1, max(self.num_rounds, 1), self.task.lr)

    def record_kind(self, key: str, msg: Message, direction: str) -> str | None:
        kinds = {PSI_KEY: "psi", HELPERS_KEY: "helpers", UPLOAD_KEY: "psi-sparse"}
        return kinds.get(key) or super().record_kind(key, msg, direction)

    def client_key(self, node: int) -> int:
        """The client's identity across rounds (and a resume): its partition id, else (a node
        that does not answer ``node-info``) ``-1 - node id``."""
        pid = self.partition_of.get(node)
        return int(pid) if pid is not None else -1 - int(node)

    # ------------------------------------------------------------------ round
    def run_round(self, server_round: int, grid: Grid) -> dict[str, Any]:
        lr = self.round_lr(server_round)
        t = self.task
        set_lr(self.optimizer, lr)
        out: dict[str, Any] = dict(server_steps(
            self.model, self.psi, self.env.server_labeled(), aug=self.env.augmenter, steps=self.cfg.k_s,
            batch_size=self.cfg.labeled_batch_size or t.batch_size, optimizer=self.optimizer,
            device=self.env.device, seed=derive_seed(t.seed, "fedmatch-server", server_round),
            lambda_s=self.cfg.lambda_s))
        nodes = self.sample_nodes(grid, server_round)
        if self.cfg.helpers > 0:
            self.learn_partitions(grid, nodes, server_round=server_round)
        theta = model_to_record(self.eval_model())
        psi_sent = _numpy(self.psi)
        psi_rec = numpy_to_record(psi_sent)
        helper_round = self.cfg.helpers > 0 and server_round % self.cfg.helper_interval == 0
        msgs, with_helpers = [], 0
        for n in nodes:
            ids = nearest_helpers(self.client_vec, self.client_key(n), self.cfg.helpers) if helper_round else []
            content = self.base_content(server_round, **{"fedmatch-lr": float(lr), "fedmatch-helpers": len(ids)})
            content[ARRAYS_KEY] = theta
            content[PSI_KEY] = psi_rec
            if ids:
                content[HELPERS_KEY] = numpy_to_record(
                    {f"{j}/{k}": v for j, c in enumerate(ids) for k, v in self.client_psi[c].items()})
                with_helpers += 1
            msgs.append(Message(content, dst_node_id=n, message_type="train", group_id=str(server_round)))
        replies = sorted(self.exchange(grid, msgs), key=lambda r: self.client_key(r.metadata.src_node_id))
        out.update({"participants": len(replies), "lr": float(lr), "helped": with_helpers})
        if len(replies) < max(self.policy.min_nodes, 1):
            out["skipped"] = 1
            log(WARNING, "round %s skipped: %s usable replies < min-nodes=%s", server_round, len(replies),
                self.policy.min_nodes)
        else:
            out.update(self.aggregate_psi(replies, psi_sent))
        sig = torch.sqrt(sum((p.detach() ** 2).sum() for k, p in self.model.named_parameters() if k in self.psi))
        out["psi-sigma-ratio"] = float(torch.sqrt(sum((v ** 2).sum() for v in self.psi.values())) / sig)
        return out

    def aggregate_psi(self, replies: list[Message], psi_sent: dict[str, np.ndarray]) -> dict[str, float]:
        """psi = uniform mean of the decoded uploads; each upload's embedding (for helpers).

        Takes the round's replies together rather than folding each as it arrives: the
        server keeps every client's decoded psi anyway (``client_psi``, the helpers it sends to
        other clients, the paper's design), so the replies cost no memory beyond that store."""
        uploads = [decode_upload(record_to_numpy(r.content.array_records[UPLOAD_KEY]), psi_sent) for r in replies]
        dev = self.env.device
        for r, up in zip(replies, uploads):
            key = self.client_key(r.metadata.src_node_id)
            self.client_psi[key] = up
            self.client_vec[key] = embed(self.model, _tensors(up, dev), self.probe)
        self.psi = _tensors({k: np.mean([u[k] for u in uploads], axis=0) for k in psi_sent}, dev)
        mets = [r.content.metric_records[METRICS_KEY] for r in replies]
        seen = np.array([float(m["num-examples"]) for m in mets])
        w = seen if seen.sum() > 0 else np.ones(len(mets))
        out = {k: float(np.average([float(m.get(k, float("nan"))) for m in mets], weights=w))
               for k in self.reply_metrics}
        out["psi-upload-density"] = float(sum(float(m["psi-changed"]) for m in mets)
                                          / max(sum(float(m["psi-entries"]) for m in mets), 1.0))
        out["label-metrics-nodes"], correct = consented_share(mets, "pseudo-correct", "pseudo-kept")
        if correct is not None:
            out["impurity"] = 1.0 - correct
        return out

    # ------------------------------------------------------------------ evaluation
    def eval_model(self) -> torch.nn.Module:
        """theta = sigma + psi (a copy: the model holds sigma)."""
        return compose_model(self.model, self.psi)

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {"psi": {k: v.detach().cpu().clone() for k, v in self.psi.items()},
                "optimizer": self.optimizer.state_dict(),
                "client-psi": {c: {k: torch.from_numpy(v.copy()) for k, v in p.items()}
                               for c, p in self.client_psi.items()},
                "client-vec": {c: torch.from_numpy(v.copy()) for c, v in self.client_vec.items()}}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "psi" in state:
            self.psi = {k: v.to(self.env.device) for k, v in state["psi"].items()}
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.client_psi = {int(c): {k: np.asarray(v.numpy() if torch.is_tensor(v) else v) for k, v in p.items()}
                           for c, p in state.get("client-psi", {}).items()}
        self.client_vec = {int(c): np.asarray(v.numpy() if torch.is_tensor(v) else v)
                           for c, v in state.get("client-vec", {}).items()}


def client_train(msg: Message, context: Context) -> Message:
    """One FedMatch client round (module docstring, "Client contract"); keeps nothing."""
    env = client_env(msg, context, label_mode="server")
    cfg = algo_config(msg, FedMatchConfig)
    conf = msg.content.config_records[CONFIG_KEY]
    if PSI_KEY not in msg.content.array_records:
        raise ValueError(f"fedmatch: the train message carries no '{PSI_KEY}' record (the global psi)")
    rnd = server_round(msg)
    task, dev = env.task, env.device
    model = env.build_model()
    load_numpy_state(model, record_to_numpy(msg.content.array_records[ARRAYS_KEY]))
    psi_sent = {k: np.asarray(v, dtype=np.float32) for k, v in record_to_numpy(msg.content.array_records[PSI_KEY]).items()}
    expected = kernel_names(model)
    if sorted(psi_sent) != sorted(expected):
        raise ValueError(f"fedmatch: psi has kernels {sorted(psi_sent)[:4]}..., this model's are {expected[:4]}...")
    params = dict(model.named_parameters())
    psi = _tensors(psi_sent, dev)
    with torch.no_grad():   # sigma = theta - psi; sigma is frozen
        for k, v in psi.items():
            params[k].sub_(v)
    for p in model.parameters():
        p.requires_grad_(False)
    helpers: list[dict[str, torch.Tensor]] = []
    if HELPERS_KEY in msg.content.array_records:
        flat = record_to_numpy(msg.content.array_records[HELPERS_KEY])
        for j in range(int(conf.get("fedmatch-helpers", 0))):
            helpers.append(_tensors({k: flat[f"{j}/{k}"] for k in expected}, dev))
    for v in psi.values():
        v.requires_grad_(True)
    lr = float(conf.get("fedmatch-lr", task.lr))
    optimizer = torch.optim.SGD(list(psi.values()), lr=lr, momentum=task.momentum)
    data = env.unlabeled()
    metrics = client_steps(
        model, psi, helpers, data, aug=env.augmenter, steps=num_local_steps(task, len(data)),
        batch_size=task.batch_size, optimizer=optimizer, device=dev,
        seed=derive_seed(task.seed, "fedmatch-client", rnd, env.partition_id), tau=cfg.tau,
        lambda_i=cfg.lambda_i, lambda_a=cfg.lambda_a, lambda_l1=cfg.lambda_l1, lambda_l2=cfg.lambda_l2)
    upload, changed, numel = encode_upload(_numpy(psi), psi_sent, cfg.l1_thres, cfg.delta_thres)
    metrics.update({"psi-changed": float(changed), "psi-entries": float(numel), "helpers-used": float(len(helpers))})
    return Message(RecordDict({UPLOAD_KEY: numpy_to_record(upload), METRICS_KEY: MetricRecord(metrics)}),
                   reply_to=msg)


ALGORITHMS = register({
    "fedmatch": AlgorithmSpec(
        name="fedmatch", paper="Jeong et al. 2021 (ICLR), labels-at-server; Semi-SFL baseline",
        strategy_cls=FedMatchStrategy, config_cls=FedMatchConfig, namespace="fedmatch",
        client={"train": client_train}, label_metrics=LABEL_METRICS,
        description="labels on the server, theta = sigma + psi: sigma trained on the server, sparse psi on "
                    "the clients with inter-client consistency (helpers by model embedding)"),
})


class FedMatchClient(AlgorithmClient):
    """FedMatch's client with a user's model and the node's unlabeled data (``unlabeled``;
    labels, if given, only feed the consented ``pseudo-correct`` metric).

    Each ``train`` message: sigma = theta - psi frozen, local steps on psi of the inter-client
    consistency and agreement-label losses on confident samples plus psi's L1/L2 terms; the
    reply is psi, sparsified and delta-coded. Nothing is kept between rounds."""

    module = __name__
    needs = ("unlabeled",)
