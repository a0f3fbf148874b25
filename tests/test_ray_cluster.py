"""Flower's simulation engine on a two-node Ray cluster: a head and a second node on
loopback, each its own ``ray start`` process; a full-model and a split algorithm run on it with
ClientApp actors on both nodes, give the weights the in-process engine gives, and every process
of the cluster is gone afterwards (``bench/ray_cluster.py`` is the same with more options)."""
import shutil

import pytest
import torch

from bench.ray_cluster import LocalRayCluster, run_simulate
from tests.flower_harness import alive, max_diff

pytestmark = [pytest.mark.e2e, pytest.mark.ray_cluster,
              pytest.mark.skipif(shutil.which("ray") is None, reason="Ray's CLI is not installed")]


def _inprocess(algo: str, rounds: int, supernodes: int, results) -> dict:
    from flower_apps.papers import run_one
    from flower_apps.simulate import fused_run_config

    cfg = {**fused_run_config(None), "algo": algo, "num-rounds": rounds, "fraction-train": 1.0,
           "min-nodes": supernodes, "results-dir": str(results), "run-name": f"ref-{algo}"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the cluster's nodes (OMP_NUM_THREADS=1): same kernels, same bits
    try:
        folder = run_one(cfg, {"algo", "num-rounds", "fraction-train", "min-nodes"}, supernodes, "inprocess")
    finally:
        torch.set_num_threads(threads)
    return torch.load(folder / "model.pt", map_location="cpu")


def test_two_node_cluster_runs_full_model_and_split_algorithms(tmp_path):
    rounds, supernodes = 1, 4   # (bench/ray_cluster.py runs more rounds; the suite keeps this short)
    with LocalRayCluster(tmp_path, nodes=2, cpus=1) as cluster:
        assert cluster.alive_nodes() == 2
        runs = {algo: run_simulate(cluster, algo, rounds, supernodes, tmp_path / "results")
                for algo in ("fedavg", "scala")}
        pids = cluster.pids()
        assert len(pids) > 4
    assert not [p for p in pids if alive(p)], "cluster processes left"
    for algo, res in runs.items():
        assert res["rc"] == 0, res.get("error")
        assert res["rounds"] == rounds and res["accuracy"][-1] > 0.5, res
        # one actor per CPU of the cluster: the head's and the second node's both ran ClientApps
        assert sorted(res["actors_per_node"]) == [0, 1] and min(res["actors_per_node"].values()) >= 1, res
        got = torch.load(f"{res['folder']}/model.pt", map_location="cpu")
        assert max_diff(got, _inprocess(algo, rounds, supernodes, tmp_path / "ref")) == 0.0, algo
