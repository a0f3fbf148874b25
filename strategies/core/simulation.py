"""Whether a run's nodes are simulated on this machine: the one test the library makes.

* Server side, :func:`simulated`: ``grid``'s nodes run on this machine, in Flower's simulation
  engine (its ``InMemoryGrid``) or in a grid that says so with ``in_process = True`` (the
  library's in-process ``LocalGrid``); any other grid is a deployment.
* Node side, :func:`in_simulation`: this process is one of the simulation engine's Ray workers.
  Ray is never imported here: the engine has imported and initialised it in every process it
  runs a ClientApp (or the ServerApp) in, so its presence in ``sys.modules`` is the test
  (:func:`ray_module`).
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["simulated", "in_simulation", "ray_module"]


def simulated(grid: Any) -> bool:
    """Whether ``grid``'s nodes run on this machine (see the module docstring)."""
    if getattr(grid, "in_process", False) is True:
        return True
    # the engine's grid module is never imported here (it pulls in the SuperLink's): a grid of
    # that class exists only where the engine has imported it
    engine = sys.modules.get("flwr.superlink.grid.inmemory_grid")
    return engine is not None and isinstance(grid, engine.InMemoryGrid)


def ray_module() -> Any:
    """The Ray module when this process runs in Flower's simulation engine (Ray imported and
    initialised), else None; never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return None
    return ray


def in_simulation() -> bool:
    """True inside Flower's simulation engine (a Ray worker); never imports Ray itself."""
    return ray_module() is not None
