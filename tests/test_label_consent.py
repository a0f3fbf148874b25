"""One consent mechanism for everything a node computes from its labels.

Without the node's consent (the default) no reply carries a metric that any algorithm
declares label-derived (``AlgorithmSpec.label_metrics``), and the server reports such a
metric as not reported (absent, with ``label-metrics-nodes`` 0 where the algorithm counts
them), not as 0: checked for every registered algorithm by the conformance matrix's first
condition, and here beside the consenting runs; with node config ``share-label-metrics=true``
the algorithms that compute them send them.
"""
from __future__ import annotations

import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from strategies.core.records import LABEL_CONSENT_ENV, LABEL_CONSENT_KEY, label_consent
from strategies.core.round_policy import RoundPolicy
from split_layer.transport import LocalGrid
from strategies.registry import algorithm_names, get_algorithm
from tests.test_conformance import LABEL_DERIVED_SERVER_SIDE as SERVER_SIDE
from tests.test_conformance import config

LABEL_DERIVED = frozenset(k for a in algorithm_names() for k in get_algorithm(a).label_metrics)
WITH_LABEL_METRICS = [a for a in algorithm_names() if get_algorithm(a).label_metrics]


def one_round(algo: str, node_config: dict | None = None):
    cfg = config(algo)
    p = parse_run_config(cfg)
    replies = []

    def spy(msg, context):
        r = dispatch(msg, context)
        replies.append(r)
        return r

    grid = LocalGrid(3, spy, run_config=cfg, node_config=node_config)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(min_nodes=2, round_timeout=60))
    rows: list[dict] = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    keys = set()
    for r in replies:
        assert not r.has_error(), r.error
        for rec in r.content.metric_records.values():
            keys |= set(rec.keys())
    return rows, keys


def test_the_algorithms_that_compute_label_metrics_declare_them():
    assert {"ssfl", "fedshvr", "umpfssl", "semisfl", "fixavg"} <= set(WITH_LABEL_METRICS)
    assert {"pseudo-correct", "pseudo-hist", "pl-acc", "pl-acc-unseen", "pseudo-label-accuracy",
            "pl-wrong"} <= LABEL_DERIVED


# Without consent, every registered algorithm: the conformance matrix's first condition inspects
# every reply and the round's metrics (tests/test_conformance.py::test_conformance_all_nodes_result).


@pytest.mark.parametrize("algo", ["ssfl", "fedshvr", "umpfssl"])
def test_without_consent_the_same_algorithms_send_none(algo, monkeypatch):
    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    rows, keys = one_round(algo)
    assert not keys & LABEL_DERIVED and not set(rows[0]) & SERVER_SIDE and rows[0]["label-metrics-nodes"] == 0


@pytest.mark.parametrize("algo", ["ssfl", "fedshvr", "umpfssl", "fixavg"])
def test_with_consent_the_node_reports_them(algo, monkeypatch):
    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    rows, keys = one_round(algo, node_config={LABEL_CONSENT_KEY: True})
    assert keys & set(get_algorithm(algo).label_metrics), keys
    (m,) = rows
    if algo != "fixavg":   # (FixAvg's server does not aggregate its nodes' pseudo-label accuracy)
        assert m["label-metrics-nodes"] == 3, m


def test_consent_is_the_nodes_own_decision(monkeypatch):
    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    assert not label_consent({}) and not label_consent({LABEL_CONSENT_KEY: "false"})
    assert label_consent({LABEL_CONSENT_KEY: True}) and label_consent({LABEL_CONSENT_KEY: "yes"})
    monkeypatch.setenv(LABEL_CONSENT_ENV, "1")   # a simulated node's ClientApp environment
    assert label_consent({}) and not label_consent({LABEL_CONSENT_KEY: False})


def test_umpfssl_sends_corr_self_only_with_consent(monkeypatch):
    """``corr-self`` (the Corr score of a node's own model, from its labeled set's labels) is a
    declared label metric: withheld without consent, so the round does not report it."""
    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    assert "corr-self" in get_algorithm("umpfssl").label_metrics
    rows, keys = one_round("umpfssl")
    assert "corr-self" not in keys and "corr-self" not in rows[0]
    rows, keys = one_round("umpfssl", node_config={LABEL_CONSENT_KEY: True})
    assert "corr-self" in keys and "corr-self" in rows[0]


def test_umpfssl_reports_each_pseudo_label_sources_accuracy_only_with_consent(monkeypatch):
    """The client's own model's and its helpers' pseudo-label accuracy (before the per-sample
    choice) are label metrics: absent without consent; with it, in the round's metrics as the
    mean over the nodes, each a fraction."""
    monkeypatch.delenv(LABEL_CONSENT_ENV, raising=False)
    per_source = {"pseudo-label-accuracy-self", "pseudo-label-accuracy-helpers"}
    assert per_source <= set(get_algorithm("umpfssl").label_metrics)
    rows, keys = one_round("umpfssl")
    assert not keys & per_source and not set(rows[0]) & per_source
    rows, keys = one_round("umpfssl", node_config={LABEL_CONSENT_KEY: True})
    assert per_source <= keys and per_source <= set(rows[0])
    assert all(0.0 <= rows[0][k] <= 1.0 for k in per_source)
