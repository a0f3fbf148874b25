"""Run the app in Flower's simulation engine from one Python process (no SuperLink).

``flwr run .`` is the way to run the app; this entry point runs the same ServerApp
logic and the same ClientApp in the same simulation engine (Ray backend) from a
script, which suits sweeps, notebooks and CI::

    python -m flower_apps.simulate --num-supernodes 10 --run-config "algo='ssfl' num-rounds=20"
    python -m flower_apps.simulate --num-supernodes 10 --run-config conf/ssfl-mnist5k.toml

Run-config overrides use ``flwr run``'s syntax and are fused with the defaults in
``pyproject.toml`` exactly as ``flwr run`` does; relative ``results-dir`` is taken
from the current directory.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

PROJECT_DIR = Path(__file__).resolve().parents[1]


def fused_run_config(overrides: list[str] | None, project_dir: Path = PROJECT_DIR) -> dict[str, Any]:
    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    try:
        return dict(get_fused_config_from_dir(project_dir, parse_config_args(overrides)))
    except ValueError as e:  # "Key 'x' is not present in the main dictionary"
        from tasks.config import ConfigError

        raise ConfigError(f"{e}; see [tool.flwr.app.config] in {project_dir / 'pyproject.toml'}") from e


def override_keys(overrides: list[str] | None) -> set[str]:
    """The keys a list of ``--run-config`` overrides sets (files included)."""
    from flwr.common.config import parse_config_args

    return set(parse_config_args(overrides))


def run_simulation_inprocess(run_config: dict[str, Any], num_supernodes: int = 3,
                             client_cpus: float = 1.0, client_gpus: float = 0.0,
                             logging_level: str = "ERROR", explicit: set[str] | None = None) -> Path:
    """Run ``run_config`` (a complete, fused run config) on ``num_supernodes`` simulated
    SuperNodes; return the run folder. ``explicit``: the keys the user set (a variant's
    fixed switch set to anything is then an error, see ``parse_run_config``)."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from flower_apps.client_app import app as client_app
    from flower_apps.config import parse_run_config, preflight
    from flower_apps.server_app import run

    preflight(parse_run_config(run_config, explicit), num_supernodes)  # fail before starting Ray
    # Ray workers import the ClientApp: make this checkout importable for them
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PROJECT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    out: dict[str, Path] = {}
    server = ServerApp()

    @server.main()
    def _main(grid, context):  # noqa: ANN001
        out["folder"] = run(grid, run_config, explicit=explicit)

    run_simulation(server_app=server, client_app=client_app, num_supernodes=num_supernodes,
                   backend_config={"client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus},
                                   "init_args": {"logging_level": logging_level}})
    if "folder" not in out:
        raise RuntimeError("the ServerApp did not finish (see the log above)")
    return out["folder"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flower_apps.simulate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-config", "-c", action="append", default=None,
                    help="overrides like flwr run: \"key=value key2='str'\" or a .toml file")
    ap.add_argument("--num-supernodes", type=int, default=10)
    ap.add_argument("--client-cpus", type=float, default=1.0, help="CPUs per simulated ClientApp")
    ap.add_argument("--client-gpus", type=float, default=0.0, help="GPUs per simulated ClientApp")
    args = ap.parse_args(argv)
    from tasks.config import ConfigError

    try:
        cfg = fused_run_config(args.run_config)
        folder = run_simulation_inprocess(cfg, args.num_supernodes, args.client_cpus, args.client_gpus,
                                          explicit=override_keys(args.run_config))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    from flower_apps.cli import run

    run(main)
