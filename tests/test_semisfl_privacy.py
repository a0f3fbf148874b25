"""What a Semi-SFL node discloses: a default ``semisfl`` run sends no true label.

Every Flower reply of every node and every frame a node writes on the split stream are
recorded (in-process LocalGrid with the library's ClientApp dispatcher, both transports) and
searched for labels: no integer or boolean tensor leaves a node except the all-zero label
histogram of ``split-info`` and BatchNorm's step counter, no stream but the features, no
label-derived metric. A node that consents (node config ``share-label-metrics``) reports
four counts per round and nothing else, and the server turns them into the impurity.
"""
from __future__ import annotations

import numpy as np
import pytest

from flower_apps.client_app import dispatch
from flower_apps.config import parse_run_config
from flower_apps.simulate import fused_run_config
from split_layer import stream as stream_mod
from strategies.core.round_policy import RoundPolicy
from split_layer.stream import StreamOptions
from split_layer.transport import LocalGrid
from strategies.semisfl.semisfl import PL_COUNTS

K = 3
# only sizes are shrunk; every privacy-relevant key keeps its default (semisfl.hidden-label-metrics=true)
SMALL = {"server-labels": 100, "batch-size": 8, "seed": 1, "semisfl.k-s": 2, "semisfl.k-u": 2,
         "semisfl.labeled-batch-size": 16, "semisfl.proj-dim": 16, "semisfl.proj-hidden": 32, "semisfl.tau": 0.5,
         "device": "cpu"}


def run(transport: str, monkeypatch, node_config: dict | None = None):
    cfg = {**fused_run_config(None), **SMALL}
    p = parse_run_config(cfg)
    assert p.spec.name == "semisfl" and p.algo.hidden_label_metrics  # the defaults
    replies, frames = [], []

    def spy(msg, context):
        r = dispatch(msg, context)
        replies.append(r)
        return r

    real_send = stream_mod.StreamClient.send

    def send(self, header, tensors):
        frames.append((dict(header), {k: np.array(v) for k, v in tensors.items()}))
        return real_send(self, header, tensors)

    monkeypatch.setattr(stream_mod.StreamClient, "send", send)
    grid = LocalGrid(K, spy, run_config=cfg, threaded=transport == "stream", node_config=node_config)
    s = p.spec.strategy_cls(p.task, p.algo, p.spec.name, RoundPolicy(
        min_nodes=K, round_timeout=30), split_transport=transport, stream=StreamOptions())
    rows = []
    s.start(grid, num_rounds=1, on_round_end=lambda r, m: rows.append(dict(m)))
    grid.join()
    return rows, replies, frames


def _integer(a: np.ndarray) -> bool:
    return a.dtype.kind in "iub"


@pytest.mark.parametrize("transport", ["message", "stream"])
def test_a_default_semisfl_run_sends_no_true_label(transport, monkeypatch):
    rows, replies, frames = run(transport, monkeypatch)
    (m,) = rows
    assert m["participants"] == K and m["dropped"] == []
    # every split step of every node was seen: K_u = 2 steps + the final reply, per node
    steps = sum(r.metadata.message_type == "query.split" for r in replies)
    assert (steps, len(frames)) == ((K * 3, 0) if transport == "message" else (K, K * 3)), (steps, len(frames))
    for r in replies:
        assert not r.has_error(), r.error
        c = r.content
        for rec_name in c.array_records.keys():
            for k, arr in ((k, c.array_records[rec_name][k].numpy()) for k in c.array_records[rec_name].keys()):
                if not _integer(arr):
                    continue
                if k == "histogram":
                    assert not arr.any(), "a label histogram left a node"
                else:
                    assert k.endswith("num_batches_tracked"), f"integer tensor {rec_name}/{k} left a node"
        for rec_name in c.metric_records.keys():
            keys = set(c.metric_records[rec_name].keys())
            assert not keys & set(PL_COUNTS) and not any("label" in k for k in keys), keys
        for rec_name in c.config_records.keys():
            assert not any("label" in k for k in c.config_records[rec_name].keys())
    for header, tensors in frames:
        if header.get("final"):  # a session that spans rounds returns the final bottom on the stream
            assert set(header) == {"final", "arrays", "metrics", "config"}, header
            for i, (name, key) in enumerate(header["arrays"]):
                assert not _integer(tensors[str(i)]) or key.endswith("num_batches_tracked"), (name, key)
            assert not set(header["metrics"]) & set(PL_COUNTS) and not any("label" in k for k in header["metrics"])
            assert not any("label" in k for k in header["config"])
            continue
        assert set(tensors) <= {"student", "teacher"}, set(tensors)
        assert all(t.dtype == np.float32 for t in tensors.values())
        assert set(header) <= {"step", "node", "error"}, header
    if transport == "stream":
        # every frame of the round was seen (K_u = 2 per node), and each node's final weights
        assert len(frames) == K * 3 and sum(bool(h.get("final")) for h, _ in frames) == K
    assert "impurity" not in m and "pseudo-label-accuracy" not in m and "bytes.metrics.up" not in m
    assert m["bytes.metrics.down"] == K * 2 * 8 * 3  # the pseudo-labels and masks went down, nothing came back


def test_a_consenting_node_reports_counts_only_and_the_server_has_its_impurity(monkeypatch):
    rows, replies, _ = run("message", monkeypatch, node_config={"share-label-metrics": True})
    (m,) = rows
    finals = [r.content.metric_records["metrics"] for r in replies
              if "metrics" in r.content.metric_records and "pl-samples" in r.content.metric_records["metrics"]]
    assert len(finals) == K and m["label-metrics-nodes"] == K
    tot = {k: sum(float(f[k]) for f in finals) for k in PL_COUNTS}
    assert tot["pl-samples"] == K * 2 * 8
    # the nodes counted the server's own mask: their confident share is the server's mask rate
    assert tot["pl-confident"] / tot["pl-samples"] == pytest.approx(m["mask-rate"], abs=1e-12)
    assert m["impurity"] == pytest.approx(tot["pl-wrong-confident"] / tot["pl-confident"]) if tot["pl-confident"] \
        else "impurity" not in m
    assert m["pseudo-label-accuracy"] == pytest.approx(1 - tot["pl-wrong"] / tot["pl-samples"])
    assert "bytes.metrics.up" not in m   # counts travel as reply metrics, not tensors
