"""FedMatch (strategies/semisfl/fedmatch.py, tasks/semisfl/fedmatch_decomp.py): the decomposition theta = sigma +
psi, the disjoint server and client steps, the agreement vote and the KL consistency term, the
sparse psi upload and the helper choice, each against a hand computation; helpers through the
real message path and a resume with helpers. The conformance matrix runs ``fedmatch`` under
every condition (tests/test_conformance.py, from the registry)."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tasks.augment import Augmenter
from tasks.config import ConfigError
from tasks.data import ArrayDataset
from tasks.semisfl.fedmatch_decomp import (
    agreement_labels,
    client_steps,
    compose_model,
    decode_upload,
    decompose,
    encode_upload,
    kernel_names,
    kl_consistency,
    nearest_helpers,
    norm_param_names,
    server_steps,
    unsupervised_loss,
)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _sets(seed: int, n: int = 16, classes: int = 4):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 8, 8), dtype=np.uint8), rng.integers(0, classes, n)


def _psi(model, factor=0.2):
    params = dict(model.named_parameters())
    psi = {}
    with torch.no_grad():
        for k in kernel_names(model):
            sigma, psi[k] = decompose(params[k].detach().clone(), factor)
            params[k].copy_(sigma)
    return psi


# ------------------------------------------------------------------------------ decomposition
def test_kernels_are_found_by_module_type_and_the_split_is_exact():
    torch.manual_seed(0)
    net = _Net()
    assert kernel_names(net) == ["conv.weight", "fc.weight"]          # biases and BN are not decomposed
    assert norm_param_names(net) == ["bn.weight", "bn.bias"]
    theta = torch.randn(10_000) * torch.logspace(-30, 3, 10_000)     # tiny to large magnitudes
    for factor in (0.2, 0.0, 1.0, 0.37):
        sigma, psi = decompose(theta, factor)
        assert torch.equal(sigma + psi, theta)                        # bit for bit: the model given is theta
        assert torch.allclose(psi, factor * sigma, rtol=1e-5, atol=1e-37)
    # the strategy: sigma in the model, psi 0.2 sigma, and the evaluated model is the one given
    from strategies.semisfl.fedmatch import FedMatchStrategy
    s = FedMatchStrategy(model=net, labeled_data=_sets(1), test_data=_sets(2), local_steps=1, batch_size=8)
    given = net.state_dict()
    got = s.eval_model().state_dict()
    assert all(torch.equal(given[k].cpu(), got[k].cpu()) for k in given)
    sig = dict(s.model.named_parameters())
    assert torch.allclose(s.psi["fc.weight"], 0.2 * sig["fc.weight"], rtol=1e-5)
    assert torch.equal(sig["fc.bias"].cpu(), net.fc.bias.cpu())                  # not decomposed: unchanged


def test_a_model_without_conv_or_linear_is_refused_by_the_constructor():
    from strategies.semisfl.fedmatch import FedMatchStrategy

    class NoKernel(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(64, 4))

        def forward(self, x):
            return x.flatten(1) @ self.w

    with pytest.raises(ConfigError, match=r"fedmatch decomposes the kernels of the model's nn.Conv\*/nn.Linear"):
        FedMatchStrategy(model=NoKernel(), labeled_data=_sets(1), test_data=_sets(2), local_steps=1)
    with pytest.raises(ConfigError, match=r"fedmatch needs labeled data on the server: labeled_data=\(x, y\)"):
        FedMatchStrategy(model=_Net(), test_data=_sets(2), local_steps=1)
    with pytest.raises(ConfigError, match="norm_affine='x' is not one of: server, frozen"):
        FedMatchStrategy(model=_Net(), labeled_data=_sets(1), norm_affine="x")


def test_a_server_step_changes_only_sigma_and_a_client_step_only_psi():
    """Server: one plain SGD step of lambda_s CE moves sigma by -lr lambda_s dCE/dtheta (the
    gradient of the composed model, written out with a plain copy), psi bit-identical. Client:
    with no confident sample (tau > 1) one step moves psi by -lr (lambda_l1 sign(psi) +
    2 lambda_l2 (psi - sigma)), and every model parameter (sigma, biases, BN) is bit-identical."""
    torch.manual_seed(1)
    aug = Augmenter(1, 8, flip=False)
    x, y = _sets(3, n=8)
    data = ArrayDataset(x, y)
    net = _Net()
    psi = _psi(net)
    psi0 = {k: v.clone() for k, v in psi.items()}
    before = {k: v.detach().clone() for k, v in net.named_parameters()}
    # the hand side: the composed model's gradient on the same batch (same seeded draws)
    plain = compose_model(net, psi)
    lr, lam = 0.1, 3.0
    server_steps(plain, {}, data, aug=aug, steps=1, batch_size=8, optimizer=torch.optim.SGD(plain.parameters(), lr=1.0),
                 device=torch.device("cpu"), seed=5, lambda_s=lam)
    grads_theta = {k: before[k] + psi0.get(k, 0) - p.detach() for k, p in plain.named_parameters()}
    server_steps(net, psi, data, aug=aug, steps=1, batch_size=8, optimizer=torch.optim.SGD(net.parameters(), lr=lr),
                 device=torch.device("cpu"), seed=5, lambda_s=lam)
    assert all(torch.equal(psi[k], psi0[k]) for k in psi)
    for k, p in net.named_parameters():   # lambda_s dCE/dtheta is what lr = 1 moved theta by
        torch.testing.assert_close(before[k] - p.detach(), lr * grads_theta[k], rtol=1e-4, atol=1e-7)
    assert not torch.equal(before["conv.weight"], dict(net.named_parameters())["conv.weight"])

    # the client: psi only
    sigma = {k: v.detach().clone() for k, v in net.named_parameters()}
    for p in net.parameters():
        p.requires_grad_(False)
    psi_c = {k: v.clone().requires_grad_(True) for k, v in psi.items()}
    start = {k: v.detach().clone() for k, v in psi_c.items()}
    l1, l2, lr = 1e-2, 0.5, 0.05
    m = client_steps(net, psi_c, [], data, aug=aug, steps=1, batch_size=8,
                     optimizer=torch.optim.SGD(list(psi_c.values()), lr=lr), device=torch.device("cpu"), seed=7,
                     tau=1.5, lambda_i=1.0, lambda_a=1.0, lambda_l1=l1, lambda_l2=l2)
    assert m["mask-rate"] == 0.0
    for k, p in net.named_parameters():
        assert torch.equal(p, sigma[k]), k
    for k, v in psi_c.items():
        want = start[k] - lr * (l1 * torch.sign(start[k]) + 2 * l2 * (start[k] - sigma[k]))
        torch.testing.assert_close(v.detach(), want, rtol=1e-5, atol=1e-7)


def _gap_factor(lr: float, lam: float, beta: float, steps: int) -> float:
    """The factor by which heavy-ball SGD (torch's: v = beta v + g, x -= lr v) multiplies x after
    ``steps`` steps on lam x^2 (gradient 2 lam x), from x = 1 and v = 0."""
    x, v = 1.0, 0.0
    for _ in range(steps):
        v = beta * v + 2 * lam * x
        x -= lr * v
    return x


@pytest.mark.parametrize("lr,lam,beta", [(1e-3, 10.0, 0.0), (0.02, 10.0, 0.0), (0.02, 10.0, 0.9), (0.02, 1.0, 0.9)])
def test_without_confident_samples_the_l2_term_pulls_psi_onto_sigma_geometrically(lr, lam, beta):
    """psi's only fixed point without a data term is sigma (lambda_l1 = 0): the client's steps
    shrink the gap psi - sigma of every entry by the heavy-ball factor of lambda_l2 ||sigma -
    psi||^2: (1 - 2 lr lambda_l2)^K with plain SGD (the authors' optimizer: 0.98 per step at lr
    1e-3), and with momentum 0.9 at lr 0.02 by at most sqrt(0.9)^K whatever lambda_l2 (1 or
    10): the collapse of psi onto sigma docs/baselines.md A2 measures."""
    torch.manual_seed(2)
    x, y = _sets(4, n=8)
    net = _Net()
    psi = _psi(net)
    for p in net.parameters():
        p.requires_grad_(False)
    sigma = {k: v.detach().clone() for k, v in net.named_parameters()}
    psi_c = {k: v.clone().requires_grad_(True) for k, v in psi.items()}
    gap0 = {k: (v.detach() - sigma[k]).clone() for k, v in psi_c.items()}
    steps = 20
    client_steps(net, psi_c, [], ArrayDataset(x, y), aug=Augmenter(1, 8, flip=False), steps=steps, batch_size=8,
                 optimizer=torch.optim.SGD(list(psi_c.values()), lr=lr, momentum=beta), device=torch.device("cpu"),
                 seed=3, tau=1.5, lambda_i=1.0, lambda_a=1.0, lambda_l1=0.0, lambda_l2=lam)
    factor = _gap_factor(lr, lam, beta, steps)
    for k, v in psi_c.items():
        torch.testing.assert_close(v.detach() - sigma[k], factor * gap0[k], rtol=1e-4, atol=1e-6)
    if beta == 0.0:
        assert factor == pytest.approx((1 - 2 * lr * lam) ** steps)
    else:
        assert 0.2 < abs(factor) <= math.sqrt(beta) ** steps   # ~0.35: underdamped, the rate is sqrt(beta)


def test_norm_affine_frozen_leaves_the_bn_parameters_out_of_the_server_step():
    from strategies.semisfl.fedmatch import FedMatchStrategy
    s = FedMatchStrategy(model=_Net(), labeled_data=_sets(1), test_data=_sets(2), norm_affine="frozen")
    names = {id(p): k for k, p in s.model.named_parameters()}
    assert sorted(names[id(p)] for p in s.sigma_params) == ["conv.bias", "conv.weight", "fc.bias", "fc.weight"]


# ------------------------------------------------------------------------------ the client's loss
def test_agreement_vote_by_hand():
    p = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [0.5, 0.3, 0.2]])
    h1 = torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.1, 0.1, 0.8], [0.1, 0.1, 0.8]])
    h2 = torch.tensor([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.8, 0.1, 0.1], [0.1, 0.8, 0.1]])
    # votes: row 0 {0:1, 1:2} -> 1; row 1 {1:1, 2:2} -> 2; row 2 {2:2, 0:1} -> 2;
    # row 3 {0:1, 2:1, 1:1}: a three-way tie -> the lowest class, 0 (numpy's argmax in the authors' code)
    assert agreement_labels(p, [h1, h2]).tolist() == [1, 2, 2, 0]
    assert agreement_labels(p, []).tolist() == [0, 1, 2, 0]           # no helpers: argmax p


def test_kl_consistency_and_the_unsupervised_loss_by_hand():
    logits_w = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 3.0]], requires_grad=True)
    logits_s = torch.tensor([[0.5, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 2.0, 1.0]])
    h1 = torch.tensor([[0.6, 0.3, 0.1], [0.3, 0.3, 0.4], [0.0, 0.5, 0.5]])
    h2 = torch.tensor([[0.2, 0.7, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]])
    p = np.exp(logits_w.detach().cpu().numpy())
    p /= p.sum(1, keepdims=True)

    def kl(q, pp):   # sum q (log q - log p), 0 log 0 = 0
        return sum(qc * (math.log(qc) - math.log(pc)) for qc, pc in zip(q, pp) if qc > 0)

    want_kl = np.mean([np.mean([kl(h[i].tolist(), p[i]) for i in range(3)]) for h in (h1, h2)])
    got = kl_consistency([h1, h2], F.log_softmax(logits_w, 1))
    assert float(got.detach()) == pytest.approx(want_kl, rel=1e-5)
    # tau = 0.6: rows 0 (p = 0.787) and 2 (p = 0.910) are confident, row 1 (p = 0.355) is not
    tau, li, la = 0.6, 0.3, 0.7
    conf = [0, 2]
    assert [i for i in range(3) if p[i].max() >= tau] == conf
    votes = [[1, 0, 0], [0, 0, 0], [0, 0, 1]]                          # own argmax 0 and 2
    for h in (h1, h2):
        for i in range(3):
            votes[i][int(np.argmax(h[i].numpy()))] += 1
    yhat = [int(np.argmax(v)) for v in votes]                           # row 0: 0,0,1 -> 0; row 2: 2,1,2 -> 2
    assert yhat[0] == 0 and yhat[2] == 2
    ls = logits_s.numpy()
    ce = [-(ls[i, yhat[i]] - math.log(np.exp(ls[i]).sum())) for i in conf]
    kl_c = np.mean([np.mean([kl(h[i].tolist(), p[i]) for i in conf]) for h in (h1, h2)])
    want = li * kl_c + la * np.mean(ce)
    loss, mask, got_yhat = unsupervised_loss(logits_w, logits_s, [h1, h2], tau=tau, lambda_i=li, lambda_a=la)
    assert mask.tolist() == [True, False, True] and got_yhat[conf].tolist() == [0, 2]
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    assert torch.all(logits_w.grad[1] == 0)                             # the unconfident row has no say
    # nothing confident: a zero loss (the regularisers alone train psi)
    zero, mask, _ = unsupervised_loss(logits_w, logits_s, [h1], tau=0.99, lambda_i=li, lambda_a=la)
    assert float(zero) == 0.0 and not mask.any()


# ------------------------------------------------------------------------------ the upload
def test_psi_upload_is_sparsified_and_delta_coded_by_hand():
    sent = {"a": np.array([0.5, 0.0, 0.2, -0.3, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32),
            "b": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)}
    new = {"a": np.array([0.5, 0.05, 0.4, -0.31, 0.01, 0.0, 0.0, 0.0, 0.0, -0.2], np.float32),
           "b": np.array([[0.0, 0.0], [0.0, 0.0]], np.float32)}
    l1, delta = 0.06, 0.02
    # a: sparsify -> [0.5, 0, 0.4, -0.31, 0, 0, 0, 0, 0, -0.2]; |that - sent| > 0.02 at 2 (0.2),
    #    4 (0.1 -> 0), 9 (0.2); not at 1 (0.05 <= l1 -> 0 = sent) nor 3 (0.01)
    # b: every entry changed: 4 pairs (32 bytes) > 16 dense bytes -> dense
    arrays, changed, numel = encode_upload(new, sent, l1, delta)
    assert sorted(arrays) == ["a/idx", "a/val", "b/dense"]
    assert arrays["a/idx"].tolist() == [2, 4, 9] and arrays["a/idx"].dtype == np.int32
    np.testing.assert_array_equal(arrays["a/val"], np.array([0.4, 0.0, -0.2], np.float32))
    assert (changed, numel) == (3 + 4, 14)
    got = decode_upload(arrays, sent)
    np.testing.assert_array_equal(got["a"], np.array([0.5, 0.0, 0.4, -0.3, 0.0, 0.0, 0.0, 0.0, 0.0, -0.2], np.float32))
    np.testing.assert_array_equal(got["b"], np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="no entry for kernel 'b'"):
        decode_upload({"a/dense": got["a"]}, sent)


# ------------------------------------------------------------------------------ helpers
def test_helpers_are_the_nearest_clients_by_embedding():
    v = {0: np.array([0.0, 0.0]), 1: np.array([3.0, 0.0]), 2: np.array([1.0, 1.0]), 5: np.array([0.0, -1.0]),
         7: np.array([-1.0, 0.0])}
    assert nearest_helpers(v, 0, 2) == [5, 7]            # distances 1, 1 (tie by key), then sqrt 2, 3
    assert nearest_helpers(v, 1, 2) == [2, 0]            # sqrt 5 ~ 2.24, 3
    assert nearest_helpers(v, 0, 9) == [5, 7, 2, 1]      # fewer known than asked
    assert nearest_helpers(v, 3, 2) == [] and nearest_helpers({0: v[0]}, 0, 2) == []


def _build(**over):
    from tests.test_conformance import build
    return build("fedmatch", **{"fedmatch.k-s": 2, "fedmatch.helper-interval": 1, "lr": 0.02, **over})


def test_helpers_travel_in_helper_rounds_and_are_the_nearest_clients(monkeypatch):
    """helper-interval = 1: round 1 knows no embedding (no helpers); in round 2 each node gets
    the psi of its 2 nearest other clients by the embeddings the server computed in round 1,
    counted as ``bytes.helpers.down``; the psi upload is counted as ``psi-sparse``. With the
    nodes' consent their pseudo-label counts reach the server."""
    from strategies.core.records import LABEL_CONSENT_ENV
    from strategies.semisfl.fedmatch import HELPERS_KEY

    monkeypatch.setenv(LABEL_CONSENT_ENV, "1")
    s, grid = _build()
    seen = {}

    def keep(rnd, m):
        seen[rnd] = (dict(m), copy.deepcopy(s.client_vec), copy.deepcopy(s.client_psi))

    s.start(grid, num_rounds=2, on_round_end=keep)
    m1, m2 = seen[1][0], seen[2][0]
    assert m1["helped"] == 0 and m1.get("bytes.helpers.down", 0) == 0
    assert m2["helped"] == 4 and m2["bytes.helpers.down"] > 0
    assert m1["bytes.psi-sparse.up"] > 0 and "bytes.weights.up" not in m1 and m1["bytes.psi.down"] > 0
    assert m1["label-metrics-nodes"] == 4 == m2["label-metrics-nodes"]
    vecs, psis = seen[1][1], seen[1][2]
    assert len(vecs) == 4
    for msg in grid.sent:
        if msg.metadata.message_type != "train" or msg.content.config_records["config"]["server-round"] != 2:
            continue
        key = s.client_key(msg.metadata.dst_node_id)
        rec = msg.content.array_records[HELPERS_KEY]
        for j, c in enumerate(nearest_helpers(vecs, key, 2)):
            assert c != key
            for k, want in psis[c].items():
                np.testing.assert_array_equal(rec[f"{j}/{k}"].numpy(), want)


def test_resume_with_helpers_equals_the_uninterrupted_run(tmp_path):
    """The server's helper state (every client's last psi and embedding) is in the checkpoint:
    round 2 (a helper round) after a restart gives the uninterrupted run's model."""
    from tests.test_conformance import state_of

    s, grid = _build(grid_kw={"node_config": {"state-dir": str(tmp_path / "a")}})
    full = s.start(grid, num_rounds=2)
    s1, g1 = _build(grid_kw={"node_config": {"state-dir": str(tmp_path / "b")}})
    ck = {}

    class Crash(Exception):
        pass

    def crash(rnd, metrics):
        ck["state"] = copy.deepcopy(s1.state_dict())
        raise Crash

    with pytest.raises(Crash):
        s1.start(g1, num_rounds=2, on_round_end=crash)
    s2, g2 = _build(grid_kw={"node_config": {"state-dir": str(tmp_path / "b")}})
    s2.setup(g2)
    s2.load_state_dict(ck["state"])
    rows = []
    resumed = s2.start(g2, num_rounds=2, start_round=2, on_round_end=lambda r, m: rows.append(m))
    assert rows[0]["helped"] == 4
    a, b = state_of(full.arrays), state_of(resumed.arrays)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
