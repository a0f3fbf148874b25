"""SCALA's split-learning baselines (``docs/baselines.md`` B5-B6): SFLLocalLoss
(``sfl-local-loss``), CS-SFL (``cs-sfl``) and Minibatch-SFL (``minibatch-sfl`` = ``ca-sfl``)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from split_layer.cut import bottom_state, bottom_state_keys, feature_shape, load_bottom_state, split_model
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from split_layer.worker import batch_seed, forward_seed
from strategies.registry import get_algorithm
from strategies.scala.scala import AUX_HEAD, CSSFLStrategy, ScalaStrategy, SFLLocalLossStrategy, batch_shares, make_aux_head
from tasks.aggregate import weighted_mean
from tasks.config import ConfigError
from tasks.env import library_env
from tasks.training import batch_at, derive_seed, make_sgd, seeded, seeded_perms, to_device_batch
from tests.flower_harness import max_diff, split_reference

K, ROUNDS, ITERS = 3, 2, 3


def _overrides(algo: str, extra: str = "") -> str:
    return (f"algo='{algo}' model='mlp' norm='bn' dropout=0.3 partition='quantity' "
            f"partition-classes-per-client=4 seed=3 scala.local-iterations={ITERS} scala.total-batch=40 "
            f"lr=0.05 momentum=0.9 num-rounds={ROUNDS} fraction-train=1.0 min-nodes=2 {extra}")


def _parsed(algo: str, extra: str = ""):
    return parse_run_config(fused_run_config([_overrides(algo, extra)]))


def _run(algo: str, transport: str = "message", strategy_cls=None, extra: str = "", fraction: float = 1.0,
         nodes: int = K, rounds: int = ROUNDS):
    p = _parsed(algo, extra)
    grid = LocalGrid(nodes, dispatch, threaded=transport == "stream")
    s = (strategy_cls or p.spec.strategy_cls)(p.task, p.algo, p.spec.name, RoundPolicy(
        min_nodes=2, round_timeout=30, fraction_train=fraction), split_transport=transport)
    rows: list[dict] = []
    s.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    grid.join()
    return s, rows


def _bottom(s) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in bottom_state(s.model, s.cut).items()}


# --------------------------------------------------------------------------- SFLLocalLoss
def _perturbed(cls):
    class OtherTop(cls):
        """The same algorithm with another server part from the start."""

        def setup_split(self) -> None:
            super().setup_split()
            with torch.no_grad():
                for p in self.top.parameters():
                    p.mul_(-3.0).add_(0.05)

    return OtherTop


def test_sfl_local_loss_client_update_uses_no_server_gradient():
    """Two runs whose server parts differ from the start: the clients' bottoms and auxiliary
    heads come out bit-identical (they never see the server), the server parts do not. The
    same perturbation changes CA-SFL's bottoms (the check can fail)."""
    a, rows_a = _run("sfl-local-loss")
    b, rows_b = _run("sfl-local-loss", strategy_cls=_perturbed(SFLLocalLossStrategy))
    assert all(r["participants"] == K and r["dropped"] == [] for r in rows_a + rows_b)
    assert max_diff(_bottom(a), _bottom(b)) == 0.0
    assert all(np.array_equal(a.aux_state[k], b.aux_state[k]) for k in a.aux_state)
    top_a = {k: v for k, v in a.model.state_dict().items() if k not in _bottom(a)}
    top_b = {k: v for k, v in b.model.state_dict().items() if k not in _bottom(b)}
    assert max_diff(top_a, top_b) > 1e-2
    c, _ = _run("ca-sfl")
    d, _ = _run("ca-sfl", strategy_cls=_perturbed(ScalaStrategy))
    assert max_diff(_bottom(c), _bottom(d)) > 1e-4
    # no gradient crossed: no gradient bytes, the head travels as weights both ways
    for r in rows_a:
        assert r.get("bytes.gradients.down", 0) == 0
        assert r["bytes.activations.up"] > 0 and np.isfinite(r["client-loss"]) and np.isfinite(r["server-loss"])


def _local_loss_reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SFLLocalLoss in one process, written without the split runtime (B5): per client, a copy of
    the global bottom and head; each iteration A = bottom(x), one SGD step of bottom + head on
    CE(head(A), y), then the server part takes one CE step per client on (A.detach(), y), the
    clients in the seeded order; bottoms and heads |D_k|-averaged. Returns (model state, head)."""
    p = _parsed("sfl-local-loss")
    task, cfg = p.task, p.algo
    env, model, cut, top, datas = split_reference(task, K)
    tparams = list(top.parameters())
    opt_top = make_sgd(tparams, task)
    sizes = [len(d) for d in datas]
    act_shape = feature_shape(split_model(model, cut)[0], env.input_shape)   # (eval mode: no BN update)
    with seeded(derive_seed(task.seed, "sfl-aux-head")):
        head = make_aux_head(act_shape, env.num_classes).to(env.device)
    for rnd in range(1, ROUNDS + 1):
        shares = batch_shares(sizes, cfg.total_batch, min_share=2)
        copies = [copy.deepcopy(model) for _ in range(K)]
        heads = [copy.deepcopy(head) for _ in range(K)]
        bottoms = [split_model(c, cut)[0] for c in copies]
        opts = [make_sgd(list(b.parameters()) + list(h.parameters()), task) for b, h in zip(bottoms, heads)]
        for i in range(1, cfg.local_iterations + 1):
            acts, ys = [], []
            for k in range(K):
                idx = batch_at(sizes[k], shares[k], i - 1, seeded_perms(sizes[k], batch_seed(task.seed, rnd, k)),
                               fixed=True)
                xb, yb = to_device_batch(datas[k], idx, env.device)
                with seeded(forward_seed(task.seed, rnd, k, i)):
                    act = bottoms[k](env.augmenter.weak(xb))
                loss = F.cross_entropy(heads[k](act), yb)
                opts[k].zero_grad()
                loss.backward()
                opts[k].step()
                acts.append(act.detach())
                ys.append(yb)
            order = np.random.default_rng(derive_seed(task.seed, "sfl-local-loss-order", rnd, i)).permutation(K)
            for k in (int(x) for x in order):
                with seeded(derive_seed(task.seed, "split-srv", rnd, i, k)):
                    logits = top(acts[k])
                opt_top.zero_grad()
                F.cross_entropy(logits, ys[k]).backward()
                opt_top.step()
        keys = bottom_state_keys(model, cut)
        new = weighted_mean([{kk: c.state_dict()[kk].detach().cpu().numpy() for kk in keys} for c in copies],
                            [float(s) for s in sizes])
        load_bottom_state(model, {kk: torch.from_numpy(np.ascontiguousarray(v)) for kk, v in new.items()}, cut)
        hnew = weighted_mean([{kk: v.detach().cpu().numpy() for kk, v in h.state_dict().items()} for h in heads],
                             [float(s) for s in sizes])
        head.load_state_dict({kk: torch.from_numpy(np.ascontiguousarray(v)) for kk, v in hnew.items()})
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: v.detach().clone() for k, v in head.state_dict().items()})


@pytest.mark.parametrize("transport", ["message", "stream"])
def test_sfl_local_loss_equals_the_in_process_reference(transport):
    """Both transports (BN + dropout bottom, momentum 0.9 kept across messages for the bottom
    and the head, 2 rounds) == the in-process reference; an untrained model is far off."""
    s, rows = _run("sfl-local-loss", transport)
    assert all(r["participants"] == K and r["dropped"] == [] for r in rows)
    ref, ref_head = _local_loss_reference()
    assert max_diff({k: v.detach() for k, v in s.model.state_dict().items()}, ref) <= 1e-5
    assert max_diff({k: torch.from_numpy(v) for k, v in s.aux_state.items()}, ref_head) <= 1e-5
    fresh = library_env(_parsed("sfl-local-loss").task, K, "all").build_model().state_dict()
    assert max_diff(fresh, ref) > 1e-3


def test_sfl_local_loss_transports_give_identical_weights_and_bytes():
    a, rows_a = _run("sfl-local-loss", "message")
    b, rows_b = _run("sfl-local-loss", "stream")
    assert max_diff(a.model.state_dict(), b.model.state_dict()) == 0.0
    assert all(np.array_equal(a.aux_state[k], b.aux_state[k]) for k in a.aux_state)
    for ra, rb in zip(rows_a, rows_b):
        assert {k: v for k, v in ra.items() if k.startswith("bytes.")} == \
            {k: v for k, v in rb.items() if k.startswith("bytes.")}
        # weights down/up = K x (bottom + head); nothing but activations and labels otherwise
        assert set(k for k in ra if k.startswith("bytes.")) <= {
            "bytes.weights.down", "bytes.weights.up", "bytes.activations.up", "bytes.labels.up", "bytes.histogram.up",
            "bytes.total"}
    head = sum(v.nbytes for v in a.aux_state.values())
    bottom = sum(v.numel() * v.element_size() for v in bottom_state(a.model, a.cut).values())
    assert rows_a[1]["bytes.weights.down"] == K * (bottom + head)


def test_local_loss_mode_belongs_to_sfl_local_loss():
    with pytest.raises(ConfigError, match="scala.server-mode"):
        parse_run_config(fused_run_config(["algo='scala' scala.server-mode='local-loss'"]))
    assert get_algorithm("sfl-local-loss").strategy_cls is SFLLocalLossStrategy


# --------------------------------------------------------------------------- CS-SFL
def _cs(extra: str = "") -> CSSFLStrategy:
    raw = fused_run_config([f"algo='cs-sfl' model='cnn' norm='bn' scala.total-batch=12 {extra}"])
    p = parse_run_config(raw)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=1))
    s.setup(None)
    return s


H1 = [10] + [0] * 9                      # one class: QCID = 0.9^2 + 9 x 0.1^2 = 0.9
H2 = [2] * 5 + [0] * 5                   # classes 0-4: QCID = 5 x 0.1^2 + 5 x 0.1^2 = 0.1
H3 = [0] * 5 + [2] * 5                   # classes 5-9: QCID = 0.1


def _nodes(s, hists):
    nodes = [101, 102, 103][:len(hists)]
    for i, (n, h) in enumerate(zip(nodes, hists)):
        s.directory.note(n, i, n=int(sum(h)), hist=np.asarray(h, dtype=np.int64))
    return nodes


def test_cs_sfl_selection_probabilities_by_hand():
    s = _cs()
    assert (s.cfg.server_mode, s.cfg.logit_adjust, s.cfg.balanced_selection) == ("per-client", False, True)
    nodes = _nodes(s, [H1, H2, H3])
    # round 1 (t = 0: no exploration bonus): P_1 ~ 1/QCID = 10/9, 10, 10 -> 1/19, 9/19, 9/19
    np.testing.assert_allclose(s.selection_probabilities(nodes, [], 1), [1 / 19, 9 / 19, 9 / 19], rtol=1e-12)
    # step 2 after node 1: P_2 ~ QCID({1, n})^-2 / (10/9 or 10); QCID({1,2}) = 0.5^2 + 5 x 0.1^2 = 0.30,
    # QCID({1,3}) = 0.4^2 + 4 x 0.1^2 = 0.20 -> (1/0.09)/10 : (1/0.04)/10 = 10/9 : 5/2 -> 4/13, 9/13
    np.testing.assert_allclose(s.selection_probabilities(nodes, [101], 1), [0, 4 / 13, 9 / 13], rtol=1e-9)
    # round 2, node 2 selected once before (T = 1, 2, 1): bonus 10 sqrt(3 ln 2 / (2 T))
    s.selections = {1: 1}
    b1, b2 = 10 * np.sqrt(3 * np.log(2) / 2), 10 * np.sqrt(3 * np.log(2) / 4)
    w = np.array([10 / 9 + b1, 10 + b2, 10 + b1])
    np.testing.assert_allclose(s.selection_probabilities(nodes, [], 2), w / w.sum(), rtol=1e-12)


def test_cs_sfl_draws_and_greedy_rule():
    s = _cs()
    nodes = _nodes(s, [H1, H2, H3])
    # cbs: the picks are draws from the step probabilities with the round's seeded generator
    rng = np.random.default_rng(derive_seed(s.task.seed, "cs-sfl-sample", 1))
    first = int(rng.choice(3, p=s.selection_probabilities(nodes, [], 1)))
    second = int(rng.choice(3, p=s.selection_probabilities(nodes, [nodes[first]], 1)))
    assert s.choose_balanced(nodes, 2, 1) == [nodes[first], nodes[second]]
    assert s.round_qcid == pytest.approx({frozenset({0, 1}): 0.3, frozenset({0, 2}): 0.2,
                                          frozenset({1, 2}): 0.0}[frozenset({first, second})], abs=1e-12)
    # greedy: the most probable first pick (node 2, 9/19, the lowest index of the tie), then the
    # node that makes the set most balanced (node 3: QCID({2, 3}) = 0 < QCID({1, 2}) = 0.3)
    g = _cs("scala.selection-rule='greedy'")
    nodes = _nodes(g, [H1, H2, H3])
    assert g.choose_balanced(nodes, 2, 1) == [102, 103] and g.round_qcid == pytest.approx(0.0, abs=1e-12)


def test_cs_sfl_run_samples_balanced_sets_and_resumes_its_counts():
    """4 nodes, half sampled: the rounds pick by the rule, count T_n by partition, and the
    counts survive a checkpoint (extra state)."""
    s, rows = _run("cs-sfl", fraction=0.5, nodes=4, rounds=2)
    assert all(r["participants"] == 2 and "sampled-qcid" in r for r in rows)
    assert sum(s.selections.values()) == 4
    state = s.extra_state()
    t = _run("cs-sfl", fraction=0.5, nodes=4, rounds=1)[0]
    t.load_extra_state(state)
    assert t.selections == s.selections
    with pytest.raises(ConfigError, match="scala.balanced-selection"):
        get_algorithm("cs-sfl").parse_config({"scala.balanced-selection": False}, ["scala.balanced-selection"])
    # the switch also works on the other variants (CS-SFL on SplitFedV2, B6: "expose both")
    v2 = parse_run_config(fused_run_config(["algo='splitfed-v2' scala.balanced-selection=true"]))
    assert v2.algo.balanced_selection and v2.algo.server_mode == "sequential"


# --------------------------------------------------------------------------- Minibatch-SFL
def test_minibatch_sfl_is_ca_sfl():
    assert get_algorithm("minibatch-sfl").overrides == get_algorithm("ca-sfl").overrides
    assert get_algorithm("minibatch-sfl").strategy_cls is ScalaStrategy
    a, rows_a = _run("minibatch-sfl")
    b, rows_b = _run("ca-sfl")
    assert max_diff(a.model.state_dict(), b.model.state_dict()) == 0.0
    assert [r["accuracy"] for r in rows_a] == [r["accuracy"] for r in rows_b]
    assert ScalaStrategy(algo="minibatch-sfl").cfg == ScalaStrategy(algo="ca-sfl").cfg
    assert AUX_HEAD == "aux-head"
