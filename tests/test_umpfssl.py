"""UM-pFSSL: formulas on hand-made predictions, the helper rules, and the transfer count vs Cost2.

The server-side runs here use an in-process fake Grid that calls the real ClientApp
dispatch with one persistent Context per node (no Ray): the messages, records,
``context.state`` and byte meter are the real ones.
"""
import math

import numpy as np
import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

from flower_apps.client_app import dispatch
from strategies.core.round_policy import RoundPolicy
from strategies.registry import get_algorithm
from strategies.umpfssl.umpfssl import UMPFSSLConfig
from tasks.config import ConfigError, TaskConfig
from tasks.umpfssl.helper_selection import cost2, refresh_ids, replace_helpers
from tasks.mc_dropout import CORR_FLOOR, mc_dropout_predict, normalized_entropy, relation_score, select_pseudo_labels
from tests.faulty_grid import RecordingGrid

LOG10 = math.log(10)


# ------------------------------------------------------------------------------ formulas
def H(p):
    p = torch.as_tensor(p, dtype=torch.float64)
    return -(p * torch.log(p.clamp_min(1e-300))).sum(-1)


def test_normalized_entropy_is_mean_over_log_c_and_clamped():
    uniform = torch.full((3, 10), 0.1)
    assert normalized_entropy(H(uniform), 10) == pytest.approx(1.0)          # unrelated: Hbar = 1
    onehot = torch.eye(10)[:4]
    assert normalized_entropy(H(onehot), 10, floor=1e-3) == 1e-3             # identical: clamped
    p = torch.tensor([[0.5, 0.5] + [0.0] * 8, [0.25] * 4 + [0.0] * 6])
    # mean of log 2 and log 4, over log 10 (the mean, not the paper's sum)
    assert normalized_entropy(H(p), 10) == pytest.approx((math.log(2) + math.log(4)) / 2 / LOG10)


def test_mc_dropout_entropy_lies_in_0_log_c():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                              torch.nn.Linear(16, 10))
    p, h = mc_dropout_predict(net, torch.randn(32, 4) * 5, T=7)
    assert torch.all(h >= 0) and torch.all(h <= LOG10 + 1e-6)
    assert 0 < normalized_entropy(h, 10) <= 1


def test_corr_by_hand():
    # client with mu = 0.25; helper's mean entropy log 2 on D_u; 3 of 4 labeled right
    hu = torch.tensor([math.log(2), math.log(2)])
    pl = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.7, 0.3]])
    yl = torch.tensor([0, 1, 0, 1])
    want = 0.75 / (math.log(2) / LOG10) + 0.25 * 0.75
    assert relation_score(0.25, hu, pl, yl, 10) == pytest.approx(want)
    # edge cases: no unlabeled data -> only mu*Acc; no labels -> only (1-mu)/Hbar
    assert relation_score(1.0, None, pl, yl, 10) == pytest.approx(0.75)
    assert relation_score(0.0, hu, None, None, 10) == pytest.approx(LOG10 / math.log(2))
    # a confident helper: Hbar clamped at the floor -> (1-mu)/1e-3
    assert relation_score(0.0, torch.zeros(5), None, None, 10, floor=1e-3) == pytest.approx(1000.0)
    # all terms zero -> floor (aggregation weights stay defined)
    assert relation_score(1.0, None, pl, torch.tensor([1, 0, 1, 1]), 10) == CORR_FLOOR


def test_more_related_helper_scores_higher_and_weights_normalise():
    yl = torch.tensor([0, 1])
    sharp = relation_score(0.5, torch.tensor([0.1, 0.2]), torch.tensor([[0.9, 0.1], [0.1, 0.9]]), yl, 10)
    vague = relation_score(0.5, torch.tensor([2.0, 2.2]), torch.tensor([[0.4, 0.6], [0.6, 0.4]]), yl, 10)
    assert sharp > vague > 0
    w = np.array([sharp, vague]) / (sharp + vague)
    assert np.all(w > 0) and w.sum() == pytest.approx(1.0)


def test_pseudo_label_comes_from_min_entropy_helper():
    pa = torch.tensor([[0.9, 0.05, 0.05], [0.4, 0.3, 0.3], [0.34, 0.33, 0.33]])
    pb = torch.tensor([[0.5, 0.25, 0.25], [0.05, 0.9, 0.05], [0.2, 0.2, 0.6]])
    pc = torch.tensor([[0.6, 0.2, 0.2], [0.3, 0.4, 0.3], [0.0, 0.0, 1.0]])
    yhat, j = select_pseudo_labels([pa, pb, pc], [H(pa), H(pb), H(pc)])
    assert j.tolist() == [0, 1, 2]
    assert torch.equal(yhat, torch.stack([pa[0], pb[1], pc[2]]))   # soft: the MC mean itself


# ------------------------------------------------------------------------------ helper rules
def test_replace_rule_scripted_sequence():
    # members (id, version, corr); R = 2 -> Re = {7 (0.1), 3 (0.2)}
    members = [(3, 1, 0.2), (5, 1, 0.9), (7, 0, 0.1), (9, 2, 0.5)]
    # best candidate 4 (0.8) beats worst 7 (0.1); next 6 (0.15) does not beat 3 (0.2) -> stop
    new, swaps = replace_helpers(members, [(6, 3, 0.15), (4, 3, 0.8)], R=2)
    assert new == [(3, 1, 0.2), (5, 1, 0.9), (4, 3, 0.8), (9, 2, 0.5)] and swaps == 1
    # both candidates better than both of Re: two swaps, best into the worst's slot
    new, swaps = replace_helpers(members, [(6, 3, 0.3), (4, 3, 0.8)], R=2)
    assert new == [(6, 3, 0.3), (5, 1, 0.9), (4, 3, 0.8), (9, 2, 0.5)] and swaps == 2
    # no candidate better than the worst member: nothing changes
    assert replace_helpers(members, [(4, 3, 0.05)], R=2) == (members, 0)
    # R = 0 never replaces
    assert replace_helpers(members, [(4, 3, 9.0)], R=0) == (members, 0)
    # next round: refresh (nu) downloads changed members outside the lowest R only
    latest = {3: 5, 5: 5, 4: 3, 9: 2, 6: 4}
    after, _ = replace_helpers(members, [(4, 3, 0.8)], R=1)          # 7 -> 4
    assert after == [(3, 1, 0.2), (5, 1, 0.9), (4, 3, 0.8), (9, 2, 0.5)]
    # lowest R=1 is 3 (changed, but not refreshed); 5 changed -> refresh; 4, 9 unchanged
    assert refresh_ids(after, latest, R=1) == [5]
    assert refresh_ids(after, latest, R=0) == [3, 5]


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="umpfssl.replace=5 must be <= umpfssl.helpers - 1"):
        UMPFSSLConfig(helpers=5, replace=5).validate()
    from flower_apps.config import parse_run_config
    from tests.test_config import pyproject_config
    with pytest.raises(ConfigError, match="umpfssl.update-period=0 is out of range"):
        parse_run_config({**pyproject_config(), "algo": "umpfssl", "umpfssl.update-period": 0})
    # the baselines are classes, not modes of UM-pFSSL's config; their knobs are their own
    with pytest.raises(ConfigError, match="unknown run-config key 'umpfssl.mode'"):
        parse_run_config({**pyproject_config(), "umpfssl.mode": "x"})
    with pytest.raises(ConfigError, match="fixmatch.tau=2.0 is out of range"):
        parse_run_config({**pyproject_config(), "algo": "fixavg", "fixmatch.tau": 2.0})


# ------------------------------------------------------------------------------ fake grid runs


@pytest.fixture(autouse=True)
def _task_identity():
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: extra threads only fight the other test processes
    yield
    torch.set_num_threads(threads)


def small_task(**over):
    base = dict(seed=3, partition="dirichlet", partition_alpha=0.5, model="mlp", norm="none", test_fraction=0.9,
                dropout=0.5, batch_size=32, local_epochs=1, local_steps=2, lr=0.05, device="cpu")
    base.update(over)
    return TaskConfig(**base)


def run_fake(algo, task, num_nodes, rounds, fraction=1.0, eval_every=1, **cfg_over):
    spec = get_algorithm(algo)
    cfg = spec.parse_config({f"umpfssl.{k.replace('_', '-')}": v for k, v in cfg_over.items()})
    strat = spec.strategy_cls(task, cfg, algo, RoundPolicy(fraction_train=fraction, min_nodes=1,
                                                           round_timeout=60, eval_every=eval_every))
    grid = RecordingGrid(num_nodes, dispatch, first_node_id=101)
    rows = []
    strat.start(grid, num_rounds=rounds, on_round_end=lambda r, m: rows.append(dict(m)))
    return strat, grid, rows


def test_counted_downloads_match_cost_formula_scripted_run():
    """K = 4 clients, all sampled (K_bar = 4), n = 4 rounds, M = 3, R = 1, F = 1, nu = 2.

    Scripted expectation per round (every client uploads every round, so every pool copy
    changes every round and every cached helper is stale at a refresh):
      round 1: fill M-1 = 2 each (8); replace R = 1 each (4; exactly 1 model is left outside
               H); no refresh (1 mod 2 != 0); 4 uploads
      round 2: no replace (t > F); refresh: the M-1-R = 1 member outside the lowest R,
               stale -> 1 each (4); 4 uploads
      round 3: 4 uploads only
      round 4: refresh 1 each (4); 4 uploads
    Cost2 = (M n/nu + n + F R) K_bar = (3*4/2 + 4 + 1) * 4 = 44 bounds
    replace + refresh + upload = 4 + 8 + 16 = 28. Term by term: F R K_bar = 4 and
    n K_bar = 16 are met exactly; refresh 8 <= M (n/nu) K_bar = 24 because the lowest R
    and self are never downloaded (Algorithm 2), the bound assumes all M. The fill (8) is
    not in Eq. 27 and is reported apart.
    """
    task = small_task()
    strat, grid, rows = run_fake("umpfssl", task, 4, 4, helpers=3, replace=1, search_rounds=1,
                                 update_period=2, mc_samples=2, warmup_epochs=1, eval_every=4)
    tr = lambda key: [r.get(f"transfers.{key}", 0) for r in rows]  # noqa: E731
    assert tr("fill") == [8, 0, 0, 0]
    assert tr("replace") == [4, 0, 0, 0]
    assert tr("refresh") == [0, 4, 0, 4]
    assert tr("upload") == [4, 4, 4, 4]
    assert tr("warmup-upload") == [4, 0, 0, 0]
    M, n, nu, F_, R, kb = 3, 4, 2, 1, 1, 4
    paper = sum(tr("replace")) + sum(tr("refresh")) + sum(tr("upload"))
    assert sum(tr("replace")) == F_ * R * kb and sum(tr("upload")) == n * kb
    assert sum(tr("refresh")) == (M - 1 - R) * (n // nu) * kb <= M * n / nu * kb
    assert paper == 28 <= cost2(M, n, nu, F_, R, kb) == 44
    # bytes: every counted transfer is one model in helper-weights down / weights up
    w = rows[0]["bytes.weights.up"] // 8          # 4 warm-up + 4 round uploads in round 1
    assert all(r["bytes.weights.up"] == 4 * w for r in rows[1:])
    for r, k in zip(rows, [12, 4, 0, 4]):
        assert r.get("bytes.helper-weights.down", 0) == k * w
    # implementation overhead is reported apart: own model every participation, cached helpers
    assert all(r["bytes.own-weights.down"] == 4 * w for r in rows)
    # helper lists live in context.state as ids + versions (+ Corr), never weights
    for n_id, ctx in grid.contexts.items():
        rec = ctx.state.config_records["umpfssl.helpers"]
        assert len(rec["ids"]) == 2 and len(rec["versions"]) == 2 and len(ctx.state.array_records) == 0
    # and the server's reference table equals the clients' lists; archive keeps only referenced versions
    for n_id, ctx in grid.contexts.items():
        pid = ctx.node_config["partition-id"]
        rec = ctx.state.config_records["umpfssl.helpers"]
        assert strat.refs[pid] == list(zip(rec["ids"], rec["versions"]))
    assert set(strat.archive) <= {h for lst in strat.refs.values() for h in lst}
    last = rows[-1]
    assert len(last["client-accuracies"]) == 4 and last["accuracy"] == pytest.approx(np.mean(last["client-accuracies"]))
    assert last["client-accuracy-var"] == pytest.approx(np.var(last["client-accuracies"]))


def test_partial_participation_keeps_pool_versions_consistent():
    """K = 6 at 50%: a client's cached helper may be several versions old; the pool's archive
    must serve exactly the cached version, and a refresh must bring the latest."""
    task = small_task(seed=5)
    strat, grid, rows = run_fake("umpfssl", task, 6, 4, fraction=0.5, helpers=3, replace=1,
                                 search_rounds=1, update_period=3, mc_samples=2, warmup_epochs=0,
                                 eval_every=10)
    # every train message's helper.<id> payload equals the pool version it names
    assert sum(r.get("transfers.upload", 0) for r in rows) == 3 * 4
    for m in grid.sent:
        if m.metadata.message_type == "train":
            c = m.content.config_records["config"]
            assert len(c["helper-ids"]) == len(c["helper-versions"]) <= 2
            assert all(f"helper.{i}" in m.content.array_records for i in c["helper-ids"])
    assert rows[-1]["participants"] == 3 and "accuracy" in rows[-1]


def test_umpfssl_requires_dropout():
    with pytest.raises(ConfigError, match="dropout > 0"):
        run_fake("umpfssl", small_task(dropout=0.0), 2, 1)


@pytest.mark.parametrize("algo", ["fixavg", "fixprox", "fedper-fix", "local-only"])
def test_baselines_run_and_evaluate_per_client(algo):
    strat, grid, rows = run_fake(algo, small_task(local_steps=1), 3, 1)
    r = rows[-1]
    assert len(r["client-accuracies"]) == 3 and 0 <= r["accuracy"] <= 1
    if algo == "local-only":
        assert r.get("bytes.weights.down", 0) == 0 and r.get("bytes.eval-weights.down", 0) == 0
        assert all("umpfssl.model" in c.state.array_records for c in grid.contexts.values())
    elif algo == "fedper-fix":
        heads = [c.state.array_records["umpfssl.head"] for c in grid.contexts.values()]
        assert all(set(h.keys()) == {"stages.head.0.weight", "stages.head.0.bias"} for h in heads)
        from strategies.core.records import model_to_record
        from strategies.core.byte_meter import array_bytes
        body = [k for k in strat.model.state_dict() if not k.startswith("stages.head.")]
        assert r["bytes.weights.up"] == 3 * array_bytes(model_to_record(strat.model, body))  # head stays
    else:
        assert r["bytes.weights.down"] == r["bytes.weights.up"] > 0


@pytest.mark.parametrize("self_labels", ["aggregated", "own"])
def test_self_labels_picks_the_self_model_whose_predictions_compete_for_the_pseudo_labels(monkeypatch, self_labels):
    """``umpfssl.self-labels``: the self source of the per-sample min-entropy choice is the MC
    prediction of the freshly aggregated w_k (default), or of the client's model as uploaded,
    scored before the aggregation like every helper."""
    import strategies.umpfssl.umpfssl as um
    from tasks.umpfssl.helper_selection import HelperScorer

    scores, predictions, chosen = [], [], []
    score, predict, select = HelperScorer.score, HelperScorer.predict, um.select_pseudo_labels

    def record_score(self, model, tag):
        out = score(self, model, tag)
        scores.append((tag, out[1]))
        return out

    def record_predict(self, model, x, tag):
        out = predict(self, model, x, tag)
        predictions.append((tag, out[0]))
        return out

    def record_select(probs, entropies):
        chosen.append(probs[0])
        return select(probs, entropies)

    monkeypatch.setattr(HelperScorer, "score", record_score)
    monkeypatch.setattr(HelperScorer, "predict", record_predict)
    monkeypatch.setattr(um, "select_pseudo_labels", record_select)
    run_fake("umpfssl", small_task(), 3, 1, helpers=3, replace=1, search_rounds=1, mc_samples=2,
             warmup_epochs=1, eval_every=2, self_labels=self_labels)
    own = [p for tag, p in scores if tag == "self"]
    aggregated = [p for tag, p in predictions if tag == ("u", "aggregated")]
    assert len(chosen) == len(own) == 3   # one training message per client
    if self_labels == "own":
        assert aggregated == [] and all(torch.equal(c, o) for c, o in zip(chosen, own))
    else:
        assert len(aggregated) == 3 and all(torch.equal(c, a) for c, a in zip(chosen, aggregated))
        assert not any(torch.equal(c, o) for c, o in zip(chosen, own))   # aggregation moved the model
