"""A real deployment: ``flower-superlink`` + 3 ``flower-supernode`` processes + ``flwr run``.

One deployment, the one a careful user runs on devices: TLS (certificates made here by
openssl) and SuperNode authentication (``--enable-supernode-auth``: the three nodes' public
keys registered with ``flwr supernode register``; a fourth, unregistered node is refused and
the runs go on without it). On it: ``scala`` over the TLS-encrypted gRPC stream (a split
algorithm: one Flower message per node starts a stream session that carries every round's
iterations and weights), and a bad
run config as ``flwr run`` reports it. Every process is killed by PID at the end, also on
failure, and the fixture checks that none is left.

What the other deployment variants would prove is proven here or elsewhere
once: the insecure SuperLink and a full-model algorithm (``fedavg``) in
``tests/test_faults.py``'s deployment; ``scala`` over Flower messages and ``ssfl`` through the
simulation engine (``tests/test_split_equivalence.py``, ``tests/test_ssfl_e2e.py``), whose
ClientApp contract (state only in ``context.state``) is the deployment's.
"""
from __future__ import annotations

import json
import math
import time

import pytest

from tests.deploy_harness import Deployment, config_arg

pytestmark = pytest.mark.e2e

COMMON = {"num-rounds": 1, "round-timeout": 600.0, "seed": 1}
SCALA_STREAM = {"algo": "scala", "scala.local-iterations": 3, "scala.total-batch": 48,
                "split-transport": "stream", "split-stream-tls": "on"}  # loopback: 'auto' would be plaintext


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("deploy"), num_nodes=3, tls=True, supernode_auth=True)
    dep.env["FLOWER_SSL_HOME"] = str(dep.workdir / "ssl-home")  # a relative results-dir resolves here
    with dep:
        yield dep
    # leaving the with-block killed every process by PID and checked none is left


def test_an_unregistered_supernode_is_refused(deployment):
    """A node whose key was never registered, posing as partition 0, is refused at activation
    (SuperLink: "No SuperNode found with the given public key"; the node exits reporting
    Flower's exit code 305); the registered three stay online."""
    dep = deployment
    stranger = dep.start_unregistered_node(3, "partition-id=0 num-partitions=3")
    t_end = time.time() + 120
    while stranger.poll() is None and time.time() < t_end:
        time.sleep(0.5)
    assert stranger.returncode not in (None, 0), "the unregistered SuperNode is still running"
    assert "Exit Code: 305" in dep.log("supernode3.out"), dep.log("supernode3.out")[-2000:]
    assert "No SuperNode found with the given public key" in dep.log("superlink.out")
    assert dep.online_nodes() == 3


def test_split_rounds_over_the_tls_stream_in_one_session(deployment):
    """Two rounds of ``scala`` over the TLS stream with the default ``split-stream-session='auto'``
    (a deployment: sessions span the run): each SuperNode starts two ClientApp processes for
    the whole run (``split-info``, then the session), round 2 starts on the stream."""
    dep = deployment
    case = "scala-stream"
    before = {i: dep.log(f"supernode{i}.out").count("Start `flwr-clientapp` process") for i in range(3)}
    cfg = {**COMMON, **SCALA_STREAM, "num-rounds": 2, "results-dir": "results"}  # relative on purpose
    res = dep.run(cfg, case, timeout=900)
    assert res.proc.returncode == 0, (res.output[-4000:], dep.diagnose())
    # where a relative results-dir lands: $FLOWER_SSL_HOME if the SuperLink has it, else
    # the SuperLink's working directory (NOT the project dir, NOT where `flwr run` ran)
    folder = dep.workdir / "ssl-home" / "results" / case
    assert folder.is_dir(), f"no run folder at {folder}\n{res.output[-3000:]}"
    assert "results written to" in res.output, res.output[-3000:]
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["participants"] == 3 and r["dropped"] == [] and not r.get("skipped") for r in rows), \
        (rows, dep.diagnose())
    r = rows[0]
    after = {i: dep.log(f"supernode{i}.out").count("Start `flwr-clientapp` process") for i in range(3)}
    assert {i: after[i] - before[i] for i in range(3)} == {0: 2, 1: 2, 2: 2}, (before, after)
    assert "round 2: split stream, 3 node(s): 0 new session(s) by Flower message, 3 over the stream" in res.output
    assert r["bytes.total"] > 0 and math.isfinite(r["accuracy"]) and 0.0 <= r["accuracy"] <= 1.0
    # the stream carried the iterations (TLS); Flower started the sessions
    assert r["split-exchanges"] == 4 and r["split-inner-exchanges"] == 2, r
    assert "split stream on 127.0.0.1:" in res.output and "(TLS)" in res.output, res.output[-3000:]
    kinds = {k.split(".")[1] for k in r if k.startswith("bytes.") and r[k] > 0 and k != "bytes.total"}
    assert {"labels"} <= kinds and any("act" in k for k in kinds), kinds  # activations, labels up
    for name in ("config.json", "checkpoint.pt", "model.pt", "partition.json"):
        assert (folder / name).stat().st_size > 0, name
    saved = json.loads((folder / "config.json").read_text())
    assert saved["algo"] == "scala" and saved["num-rounds"] == 2
    print(f"[deploy tls+auth] {case}: 2 rounds in {res.seconds:.0f} s (round 2: {rows[1]['round-seconds']:.2f} s), "
          f"acc {rows[1]['accuracy']:.3f}, bytes {r['bytes.total']}")


def test_bad_run_config_is_reported_by_flwr_run(deployment):
    """What a user sees from ``flwr run`` for a wrong value and for an unknown key."""
    dep = deployment
    bad = dep.run({**COMMON, "algo": "fedavg", "num-rounds": 0}, "bad-value", timeout=300)
    assert "num-rounds=0 is out of range; allowed [1, inf]" in bad.output, bad.output[-3000:]
    for base in (dep.results, dep.workdir / "ssl-home" / "results"):  # nothing written, no round started
        assert not (base / "bad-value").exists()
    # an unknown key never reaches our code: Flower rejects it at submit
    proc = dep.cli(["run", str(dep.project), dep.name, "-c", config_arg({"num-round": 2})], timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Invalid run configuration" in out, out[-2000:]
