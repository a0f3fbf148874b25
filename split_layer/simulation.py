"""How many ClientApps Flower's simulation engine runs at once (:func:`simulation_concurrency`),
seen from inside a ClientApp (whether it runs in the engine at all is the core's one test,
:mod:`strategies.core.simulation`).

The stream transport needs all sampled clients of a round running at once (they wait on one
another at every iteration). Each node reports in its one-time ``split-info`` reply how many
ClientApps the simulation runs concurrently (Ray actor pool and Flower's worker threads,
:func:`simulation_concurrency`); if fewer than the sampled nodes, the round fails at once with
:class:`split_layer.stream.StreamConfigError` saying which federation setting to change
(:func:`concurrency_error`).
"""
from __future__ import annotations

import os

from strategies.core.simulation import ray_module

__all__ = ["simulation_concurrency", "concurrency_error"]


def simulation_concurrency() -> tuple[int, int]:
    """``(actors, threads)`` of Flower's simulation, seen from inside a ClientApp; ``(0, 0)`` if not simulated.

    Flower's Ray backend builds ``sum over Ray nodes of int(node CPUs / client num_cpus)``
    actors (GPUs likewise) and feeds them from ``ThreadPoolExecutor()`` workers, at most
    ``min(32, os.cpu_count() + 4)`` of them: at most ``min(actors, threads)`` ClientApps run
    at once.
    """
    ray = ray_module()
    if ray is None:
        return 0, 0
    try:
        res = ray.get_runtime_context().get_assigned_resources()
        cpu, gpu = float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))
        actors = 0
        for node in ray.nodes():
            have = node.get("Resources") or {}
            if not have or cpu <= 0:
                continue
            n = int(have.get("CPU", 0) / cpu)
            if gpu > 0:
                n = min(n, int(have.get("GPU", 0) / gpu))
            actors += n
        if actors <= 0:
            return 0, 0
        return actors, min(32, (os.cpu_count() or 1) + 4)
    except Exception:  # noqa: BLE001 - an unknown runtime imposes no check
        return 0, 0


def concurrency_error(sampled: int, actors: int, threads: int) -> str:
    """What to change when a simulation runs fewer ClientApps at once than a round samples."""
    most = min(actors, threads)
    msg = (f"split-transport='stream' needs all {sampled} sampled clients of a round running at once, but this "
           f"simulation runs at most {most} ClientApps concurrently ({actors} Ray actors, {threads} Flower worker "
           f"threads). ")
    if sampled <= threads:
        msg += (f"Give Ray more logical CPUs per real core, e.g. `flwr run . --federation-config \"num-supernodes=... "
                f"init-args-num-cpus={sampled} client-resources-num-cpus=1\"` (the clients then share the real "
                f"cores; `flwr run` takes whole CPUs only; `run_simulation` also takes fractions such as "
                f"client_resources={{'num_cpus': {max(0.01, (os.cpu_count() or 1) / sampled):.2g}}}), ")
    else:
        msg += (f"Flower's simulation runs at most {threads} ClientApps at once on this machine "
                f"(min(32, CPUs + 4)), so sample at most {threads} nodes per round (fraction-train), ")
    return msg + "or use split-transport='message'."

