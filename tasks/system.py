"""A simulated system clock: how long a round would take on the papers' fleets.

Every run counts its bytes exactly (by kind, direction and node) and, with a system model
chosen, its work: each node counts the FLOPs it executes and the optimizer steps it takes
while answering a message (:func:`count_work`, torch's own ``FlopCounterMode``), and the
server counts its own training FLOPs between exchanges. Work a node runs again only because
its process could not keep a result (a split node's forward pass recomputed with a graph
when the gradient arrives, :func:`recomputation`) is not the algorithm's: it is left out of
the billed compute and reported apart (``sim-recompute-flops``); data preparation (the
augmentations) is counted nowhere (:func:`not_billed`): the papers' cost models bill the
model's passes. The counting itself lives in :mod:`tasks.work`. :class:`RoundClock` turns that
measured work into the seconds it would take on the simulated system:

* a **stage** is one exchange as the round loop sequences it (a full-model round: one
  stage, the model down, local training, the model up; a split round: message 1 and every
  fused exchange of the ``I + 1``, one group after another). A node's time in a stage is
  ``down_bytes / down_rate + compute + up_bytes / up_rate``; the stage ends with its slowest
  node (synchronous: the server waits for every reply), or at the round timeout where a
  node never replied, as the real server waits;
* the server's own work (its training steps, a split round's server part) runs between
  stages, one after the other: ``server_flops / server_rate``;
* a round is the sum of its stages and its server time; ``sim-seconds-total`` adds rounds.

Compute: ``flops`` (a node runs at a FLOP/s rate: ``compute = flops / rate``) or
``iteration-seconds`` (a time per local iteration: ``compute = steps * t``). Links:
``range`` (uplink and downlink Mbps drawn in ranges) or ``cell`` (SCALA's cell: a node's
distance to the server, the path loss, its transmit power, an orthogonal uplink band shared
by the stage's transmitters and white noise give a Shannon rate). Every draw is seeded by
the run seed, the node's key (its partition id) and, for what fluctuates, the round.

Presets (:data:`PRESETS`) are the two papers' systems; a user's own is a TOML file
(:func:`load_system`; the format is in ``docs/config.md``). Nothing here knows Flower.
"""
from __future__ import annotations

import contextlib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from tasks.config import ConfigError
from tasks.training import derive_seed
from tasks.work import Work, count_work, flop_counter, not_billed, recomputation

__all__ = ["Dist", "Compute", "RangeLink", "CellLink", "SystemModel", "RoundClock", "PRESETS",
           "load_system", "count_work", "recomputation", "not_billed", "Work", "shannon_rate", "cell_path_loss_db", "SYSTEM_CHOICES"]

SYSTEM_CHOICES = "none, semisfl, scala, or the path of a .toml file (docs/config.md)"

SYSTEM_DOC = """## The simulated system (`system`)

`system='none'` (default) records real wall time only. A preset or a TOML file adds a simulated
clock: every node counts the FLOPs (torch's `FlopCounterMode`) and optimizer steps of each
message it answers, the server counts its own training FLOPs between exchanges, and each round's
`metrics.jsonl` line gets `sim-seconds` (the round), `sim-seconds-total` (the run, kept across a
resume), `sim-server-seconds`, `sim-node-compute-seconds` (the slowest nodes' compute; the rest of
the stages is transfers), `sim-client-flops`, `sim-server-flops` and `sim-stages`, beside
`wall-seconds`. A split node that recomputes a forward pass with a graph when its gradient arrives
(a ClientApp process does not outlive a message: docs/split.md) does work the algorithm does not:
those FLOPs are not billed, and `sim-recompute-flops` reports them apart. Data augmentation is data
preparation, as in the papers' cost models: it runs outside the count (counted, it is 7e-5 of a
FixMatch step's FLOPs on the `cnn` and makes the step up to 1.6x slower: `bench/clock_overhead.py`).
A stage is one exchange: each node's `down bytes / down rate + compute + up bytes /
up rate`, the stage ending with its slowest node (a node that never replies holds it until
`round-timeout`); the server's work runs between stages. Training is unchanged (the conformance
matrix checks every algorithm's weights with and without a clock). `split-transport='stream'` is
not timed (its per-exchange work is not reported): a `ConfigError` says so.

| preset | nodes compute | links | server |
|---|---|---|---|
| `semisfl` | Semi-SFL Sec. V-A: half Jetson Xavier NX, half AGX; FLOP/s Gaussian per node and round, N(0.21, 0.04) and N(0.35, 0.07) TFLOP/s [ours: 25% of the FP32 peaks] | node to server 2-8 Mbit/s, server to node 10-20 Mbit/s, uniform per node and round | 8.9 TFLOP/s [ours: 25% of an RTX 3090] |
| `scala` | SCALA Sec. VI: uniform in [1e9, 5e9] FLOP/s per node | 1000 m cell, nodes uniform over its area, path loss 128.1 + 37.6 log10(r_km) dB, 0.2 W, 10 MHz orthogonal uplink shared by the stage's transmitters, -174 dBm/Hz; Shannon rate; downlink the same rate [ours] | 10 TFLOP/s [ours] |

A user's own system, `--run-config "system='/path/fleet.toml'"`:

```toml
description = "phones and a gateway"
[compute]
unit = "flops"                      # or "iteration-seconds": a time per local iteration (optimizer step)
[[compute.devices]]                 # device classes; a node's class is drawn once, by its partition id
name = "old-phone"
share = 1
rate = {kind = "gaussian", mean = 2e9, std = 2e8, per = "round"}
[[compute.devices]]
name = "new-phone"
share = 3
rate = [4e9, 6e9]                   # uniform (per node for FLOP/s unless per = "round")
[link]
kind = "range"                      # or "cell" with radius-m, path-loss-a, path-loss-b, tx-power-w,
up-mbps = [1, 3]                    #   bandwidth-hz, noise-dbm-hz, share (SCALA's values by default)
down-mbps = 20                      # a number is fixed
[server]
flops = 5e12
```

A single class is `rate = ...` directly under `[compute]`. Every draw is seeded by the run seed,
the node's partition id and (for what fluctuates) the round. Compare runs by time and bytes to a
target: `python -m flower_apps.report <run folders> --by-seed --target 0.95` (a table, and
`report-cost.png`: accuracy against simulated minutes and against MB).
"""


# --------------------------------------------------------------------------- distributions
@dataclass(frozen=True)
class Dist:
    """A positive random quantity: ``fixed`` (``a``), ``uniform`` in ``[a, b]`` or ``gaussian``
    (mean ``a``, std ``b``, truncated below at ``floor``). ``per``: drawn once per ``node``
    (a device's capacity, a node's place in the cell) or per node and ``round`` (a
    fluctuating link, a busy device)."""

    kind: str
    a: float
    b: float = 0.0
    per: str = "round"
    floor: float = 1e-12

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "gaussian"):
            raise ConfigError(f"system: distribution kind={self.kind!r} is not one of fixed, uniform, gaussian")
        if self.per not in ("node", "round"):
            raise ConfigError(f"system: per={self.per!r} is not one of node, round")
        if not (self.a > 0 and math.isfinite(self.a)) or self.b < 0 or not math.isfinite(self.b):
            raise ConfigError(f"system: {self.kind} distribution needs a > 0 and b >= 0, got a={self.a}, b={self.b}")
        if self.kind == "uniform" and self.b < self.a:
            raise ConfigError(f"system: uniform distribution needs lo <= hi, got [{self.a}, {self.b}]")

    def draw(self, rng: np.random.Generator) -> float:
        if self.kind == "fixed":
            return float(self.a)
        if self.kind == "uniform":
            return float(rng.uniform(self.a, self.b))
        return float(max(rng.normal(self.a, self.b), self.floor))


@dataclass(frozen=True)
class Compute:
    """How fast a node computes: ``unit`` ``flops`` (FLOP/s) or ``iteration-seconds`` (seconds per
    local iteration), from a mixture of device classes ``(share, Dist)`` (a node's class is
    drawn once, by its key)."""

    unit: str
    devices: tuple[tuple[float, Dist], ...]
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.unit not in ("flops", "iteration-seconds"):
            raise ConfigError(f"system: compute unit={self.unit!r} is not one of flops, iteration-seconds")
        if not self.devices or any(s <= 0 for s, _ in self.devices):
            raise ConfigError("system: compute needs at least one device class with a positive share")

    def device_of(self, seed: int, key: int) -> int:
        shares = np.array([s for s, _ in self.devices], dtype=float)
        rng = np.random.default_rng(derive_seed(seed, "system-device", key))
        return int(rng.choice(len(shares), p=shares / shares.sum()))

    def rate(self, seed: int, key: int, rnd: int) -> float:
        dist = self.devices[self.device_of(seed, key)][1]
        return dist.draw(np.random.default_rng(derive_seed(seed, "system-compute", key,
                                                           rnd if dist.per == "round" else -1)))


# --------------------------------------------------------------------------- links
def cell_path_loss_db(distance_m: float, a: float = 128.1, b: float = 37.6) -> float:
    """SCALA's path loss ``a + b * log10(r_km)`` in dB (3GPP's urban macro cell)."""
    return a + b * math.log10(max(distance_m, 1.0) / 1000.0)


def shannon_rate(bandwidth_hz: float, tx_power_w: float, path_loss_db: float, noise_dbm_hz: float) -> float:
    """``B log2(1 + P g / (N0 B))`` bits/s, ``g = 10^(-PL/10)``, ``N0`` from dBm/Hz."""
    n0_w_hz = 10.0 ** ((noise_dbm_hz - 30.0) / 10.0)
    snr = tx_power_w * 10.0 ** (-path_loss_db / 10.0) / (n0_w_hz * bandwidth_hz)
    return bandwidth_hz * math.log2(1.0 + snr)


@dataclass(frozen=True)
class RangeLink:
    """Uplink (node -> server) and downlink rates in Mbit/s, each a :class:`Dist`."""

    up_mbps: Dist
    down_mbps: Dist

    def rates(self, seed: int, key: int, rnd: int, sharing: int) -> tuple[float, float]:
        def bps(d: Dist, what: str) -> float:
            rng = np.random.default_rng(derive_seed(seed, "system-link", what, key, rnd if d.per == "round" else -1))
            return d.draw(rng) * 1e6
        return bps(self.up_mbps, "up"), bps(self.down_mbps, "down")


@dataclass(frozen=True)
class CellLink:
    """SCALA's cell: nodes uniformly in a disk of ``radius_m`` around the server (a node's
    distance drawn once, by its key), path loss ``a + b log10(r_km)`` dB, transmit power
    ``tx_power_w``, an orthogonal uplink band of ``bandwidth_hz`` in total, shared equally by
    the nodes that transmit in the same stage (``share``), white noise ``noise_dbm_hz``. The
    downlink is not given by the paper: [ours] the same Shannon rate (the server's band and
    power taken equal to the nodes')."""

    radius_m: float = 1000.0
    path_loss_a: float = 128.1
    path_loss_b: float = 37.6
    tx_power_w: float = 0.2
    bandwidth_hz: float = 10e6
    noise_dbm_hz: float = -174.0
    share: bool = True

    def __post_init__(self) -> None:
        for name in ("radius_m", "tx_power_w", "bandwidth_hz"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"system: cell {name.replace('_', '-')}={v!r} must be a positive number")
        for name in ("path_loss_a", "path_loss_b", "noise_dbm_hz"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"system: cell {name.replace('_', '-')}={v!r} must be a finite number")
        if not isinstance(self.share, bool):
            raise ConfigError(f"system: cell share={self.share!r} must be true or false")

    def distance(self, seed: int, key: int) -> float:
        u = np.random.default_rng(derive_seed(seed, "system-cell", key)).uniform()
        return float(self.radius_m * math.sqrt(u))   # uniform over the disk's area

    def rates(self, seed: int, key: int, rnd: int, sharing: int) -> tuple[float, float]:
        band = self.bandwidth_hz / max(sharing, 1) if self.share else self.bandwidth_hz
        r = shannon_rate(band, self.tx_power_w, cell_path_loss_db(self.distance(seed, key), self.path_loss_a,
                                                                   self.path_loss_b), self.noise_dbm_hz)
        return r, r


@dataclass(frozen=True)
class SystemModel:
    """A simulated fleet: the nodes' compute, their links, the server's FLOP/s."""

    name: str
    compute: Compute
    link: RangeLink | CellLink
    server_flops: float = 1e13
    description: str = ""

    def node_rates(self, seed: int, key: int, rnd: int, sharing: int) -> dict[str, float]:
        up, down = self.link.rates(seed, key, rnd, sharing)
        return {"compute": self.compute.rate(seed, key, rnd), "up": up, "down": down}


# --------------------------------------------------------------------------- presets
_NX = Dist("gaussian", 0.21e12, 0.04e12)    # [ours] 25% of the Jetson Xavier NX's 0.85 TFLOP/s FP32 peak
_AGX = Dist("gaussian", 0.35e12, 0.07e12)   # [ours] 25% of the Jetson AGX Xavier's 1.41 TFLOP/s FP32 peak

PRESETS: dict[str, SystemModel] = {
    "semisfl": SystemModel(
        "semisfl",
        Compute("flops", ((0.5, _NX), (0.5, _AGX)), ("jetson-nx", "jetson-agx")),
        RangeLink(Dist("uniform", 2.0, 8.0), Dist("uniform", 10.0, 20.0)),
        server_flops=8.9e12,   # [ours] 25% of an RTX 3090's 35.6 TFLOP/s FP32 peak (the paper's PS)
        description="Semi-SFL Sec. V-A: per-iteration compute Gaussian from Jetson NX/AGX records (here a "
                    "Gaussian FLOP/s per device class, drawn per node and round), node-to-server 2-8 Mbit/s "
                    "and server-to-node 10-20 Mbit/s, fluctuating per round"),
    "scala": SystemModel(
        "scala",
        Compute("flops", ((1.0, Dist("uniform", 1e9, 5e9, per="node")),)),
        CellLink(),
        server_flops=1e13,     # [ours] not stated by the paper
        description="SCALA Sec. VI: 1000 m cell, path loss 128.1 + 37.6 log10(r_km) dB, 0.2 W, 10 MHz "
                    "orthogonal uplink, -174 dBm/Hz, node compute uniform in [1e9, 5e9] FLOP/s"),
}


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ConfigError(f"system: {where} = {v!r} must be a finite number")
    return float(v)


def _dist(d: Any, where: str, default_per: str) -> Dist:
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        return Dist("fixed", _number(d, where), per=default_per)
    if isinstance(d, list) and len(d) == 2:
        return Dist("uniform", _number(d[0], where), _number(d[1], where), per=default_per)
    if isinstance(d, dict):
        kind = d.get("kind", "gaussian" if "mean" in d else "uniform")
        if kind == "gaussian":
            a, b = d.get("mean"), d.get("std", 0.0)
        elif kind == "uniform":
            a, b = d.get("lo"), d.get("hi")
        else:
            a, b = d.get("value"), 0.0
        if a is None or b is None:
            raise ConfigError(f"system: {where} = {d!r}: a {kind} distribution needs "
                              + {"gaussian": "mean (and std)", "uniform": "lo and hi"}.get(kind, "value"))
        return Dist(str(kind), _number(a, where), _number(b, where), per=str(d.get("per", default_per)))
    raise ConfigError(f"system: {where} = {d!r} must be a number, [lo, hi], or a table "
                      "{kind, mean/std | lo/hi | value, per}")


def system_from_dict(doc: dict[str, Any], name: str = "custom") -> SystemModel:
    """A :class:`SystemModel` from a parsed TOML document (format in ``docs/config.md``)."""
    unknown = sorted(set(doc) - {"compute", "link", "server", "description"})
    if unknown:
        raise ConfigError(f"system: unknown table(s) {', '.join(unknown)}; allowed: compute, link, server")
    comp = doc.get("compute")
    if not isinstance(comp, dict):
        raise ConfigError("system: a [compute] table is required (unit = 'flops' | 'iteration-seconds', "
                          "rate = ... or [[compute.devices]])")
    unit = str(comp.get("unit", "flops"))
    per = "node" if unit == "flops" else "round"
    if "devices" in comp:
        devs = comp["devices"]
        if not isinstance(devs, list) or not devs:
            raise ConfigError("system: compute.devices must be a non-empty array of tables")
        if not all(isinstance(d, dict) for d in devs):
            raise ConfigError("system: compute.devices must be an array of tables ([[compute.devices]])")
        devices = tuple((_number(d.get("share", 1.0), "compute.devices.share"),
                         _dist(d.get("rate"), "compute.devices.rate", per)) for d in devs)
        names = tuple(str(d.get("name", f"device{i}")) for i, d in enumerate(devs))
    elif "rate" in comp:
        devices, names = ((1.0, _dist(comp["rate"], "compute.rate", per)),), ()
    else:
        raise ConfigError("system: [compute] needs rate = ... or [[compute.devices]]")
    link = doc.get("link", {})
    if not isinstance(link, dict):
        raise ConfigError("system: [link] must be a table")
    kind = str(link.get("kind", "range"))
    if kind == "range":
        if "up-mbps" not in link or "down-mbps" not in link:
            raise ConfigError("system: a range link needs up-mbps and down-mbps")
        lk: RangeLink | CellLink = RangeLink(_dist(link["up-mbps"], "link.up-mbps", "round"),
                                              _dist(link["down-mbps"], "link.down-mbps", "round"))
    elif kind == "cell":
        keys = {"radius-m": "radius_m", "path-loss-a": "path_loss_a", "path-loss-b": "path_loss_b",
                "tx-power-w": "tx_power_w", "bandwidth-hz": "bandwidth_hz", "noise-dbm-hz": "noise_dbm_hz",
                "share": "share"}
        bad = sorted(set(link) - set(keys) - {"kind"})
        if bad:
            raise ConfigError(f"system: unknown cell key(s) {', '.join(bad)}; allowed: {', '.join(keys)}")
        lk = CellLink(**{keys[k]: (v if k == "share" else _number(v, f"link.{k}")) for k, v in link.items()
                         if k in keys})
    else:
        raise ConfigError(f"system: link kind={kind!r} is not one of range, cell")
    if not isinstance(doc.get("server", {}), dict):
        raise ConfigError("system: [server] must be a table")
    server = _number(doc.get("server", {}).get("flops", 1e13), "server.flops")
    if not server > 0:
        raise ConfigError(f"system: server.flops={server} must be > 0")
    return SystemModel(name, Compute(unit, devices, names), lk, server, str(doc.get("description", "")))


def load_system(spec: str) -> SystemModel | None:
    """The run-config key ``system``: ``none`` (no clock), a preset name (:data:`PRESETS`), or the
    path of a TOML file describing a user's own system. Anything else is a :class:`ConfigError`."""
    spec = str(spec).strip()
    if spec in ("", "none"):
        return None
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec).expanduser()
    if path.suffix == ".toml":
        if not path.is_file():
            raise ConfigError(f"system={spec!r}: no such file; system is one of {SYSTEM_CHOICES}")
        try:
            doc = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"system={spec!r} is not valid TOML: {e}") from None
        try:
            return system_from_dict(doc, path.stem)
        except (TypeError, ValueError, AttributeError) as e:   # (ConfigError is a ValueError)
            raise ConfigError(f"system={spec!r}: {e}") from None
    raise ConfigError(f"system={spec!r} is not one of {SYSTEM_CHOICES}")


# --------------------------------------------------------------------------- the clock
@dataclass
class _Stage:
    nodes: dict[int, dict[str, float]] = field(default_factory=dict)
    missing: bool = False

    def node(self, key: int) -> dict[str, float]:
        return self.nodes.setdefault(key, {"down": 0.0, "up": 0.0, "flops": 0.0, "steps": 0.0,
                                           "recompute-flops": 0.0})


class RoundClock:
    """Simulated seconds of the rounds of one run on ``system`` (see the module docstring).

    The round loop calls :meth:`begin_round`, then for every exchange :meth:`stage` (a
    re-entrant context: nested exchanges are one stage) with :meth:`add_bytes`,
    :meth:`add_work` and :meth:`missing` inside it, runs the server's own work inside
    :meth:`server_work` (paused during stages), and ends with :meth:`end_round`, whose metrics
    go into the round's record. ``timeout``: what a node that never replies costs a stage.
    """

    def __init__(self, system: SystemModel, seed: int, timeout: float) -> None:
        self.system, self.seed, self.timeout = system, int(seed), float(timeout)
        self.total = 0.0
        self.round: int | None = None
        self._stages: list[_Stage] = []
        self._depth = 0
        self._server_flops = 0.0
        self._server_counter: Any = None
        self._serving = False

    # -- round -------------------------------------------------------------
    def begin_round(self, rnd: int) -> None:
        self.round, self._stages, self._server_flops = int(rnd), [], 0.0

    @contextlib.contextmanager
    def stage(self) -> Iterator[None]:
        """One exchange (a no-op outside a round, e.g. evaluation after it)."""
        if self.round is None:
            yield
            return
        if self._depth == 0:
            self._pause_server()
            self._stages.append(_Stage())
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._resume_server()

    def _current(self) -> _Stage | None:
        return self._stages[-1] if self.round is not None and self._depth > 0 and self._stages else None

    def add_bytes(self, key: int, direction: str, nbytes: float) -> None:
        st = self._current()
        if st is not None:
            st.node(int(key))[direction] += float(nbytes)

    def add_work(self, key: int, flops: float, steps: float, recompute_flops: float = 0.0) -> None:
        """Node ``key``'s work in this stage: ``flops`` of the algorithm's (billed) and, apart,
        ``recompute_flops`` run again only to rebuild a graph (not billed)."""
        st = self._current()
        if st is not None:
            n = st.node(int(key))
            n["flops"] += float(flops)
            n["steps"] += float(steps)
            n["recompute-flops"] += float(recompute_flops)

    def missing(self, key: int) -> None:
        """``key`` never replied in this stage: the server waited until its timeout."""
        st = self._current()
        if st is not None:
            st.node(int(key))
            st.missing = True

    # -- the server's own work ---------------------------------------------------
    @contextlib.contextmanager
    def server_work(self) -> Iterator[None]:
        """Count the server's FLOPs in this block (paused during stages)."""
        self._serving = True
        self._resume_server()
        try:
            yield
        finally:
            self._pause_server()
            self._serving = False

    def _pause_server(self) -> None:
        if self._server_counter is not None:
            c, self._server_counter = self._server_counter, None
            c.__exit__(None, None, None)
            self._server_flops += float(c.get_total_flops())

    def _resume_server(self) -> None:
        if self._serving and self._server_counter is None:
            self._server_counter = flop_counter()
            self._server_counter.__enter__()

    def add_server_flops(self, flops: float) -> None:
        self._server_flops += float(flops)

    # -- time --------------------------------------------------------------
    def stage_seconds(self, st: _Stage, rnd: int) -> tuple[float, float]:
        """(the stage's seconds, the slowest node's compute seconds in it)."""
        sharing = len(st.nodes)
        worst, worst_compute = 0.0, 0.0
        for key, w in st.nodes.items():
            r = self.system.node_rates(self.seed, key, rnd, sharing)
            if self.system.compute.unit == "flops":
                compute = w["flops"] / r["compute"]
            else:
                compute = w["steps"] * r["compute"]
            t = w["down"] * 8.0 / r["down"] + compute + w["up"] * 8.0 / r["up"]
            if t > worst:
                worst, worst_compute = t, compute
        if st.missing:
            worst = max(worst, self.timeout)
        return worst, worst_compute

    def end_round(self) -> dict[str, float]:
        """The round's simulated metrics: ``sim-seconds`` (this round), ``sim-seconds-total``,
        ``sim-server-seconds``, ``sim-node-compute-seconds`` (the compute of each stage's slowest
        node: the rest of the stages' time is transfers), ``sim-client-flops`` (all nodes),
        ``sim-server-flops``, ``sim-stages``, and apart ``sim-recompute-flops`` (all nodes' FLOPs run
        again only to rebuild a graph: not in ``sim-client-flops``, not billed)."""
        self._pause_server()
        rnd = self.round if self.round is not None else 0
        stages = [self.stage_seconds(st, rnd) for st in self._stages]
        server_s = self._server_flops / self.system.server_flops
        seconds = sum(s for s, _ in stages) + server_s
        self.total += seconds
        out = {"sim-seconds": seconds, "sim-seconds-total": self.total, "sim-server-seconds": server_s,
               # of the stages' time, the slowest nodes' compute (the rest: their transfers, timeouts)
               "sim-node-compute-seconds": float(sum(c for _, c in stages)),
               "sim-client-flops": float(sum(w["flops"] for st in self._stages for w in st.nodes.values())),
               "sim-recompute-flops": float(sum(w["recompute-flops"] for st in self._stages
                                                for w in st.nodes.values())),
               "sim-server-flops": self._server_flops, "sim-stages": float(len(stages))}
        self.round, self._stages, self._depth = None, [], 0
        return out


# --------------------------------------------------------------------------- a model's cost
def module_flops(module: torch.nn.Module, x: torch.Tensor, train: bool = False) -> tuple[float, torch.Tensor]:
    """FLOPs of one pass of ``module`` on ``x`` (torch's counter): forward only, or with
    ``train`` forward + backward (the gradient of the parameters and of ``x`` where it needs
    one). Returns ``(flops, output)``; the module's BatchNorm statistics are left as they were."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    counter = flop_counter()
    try:
        with counter:
            if train:
                out = module(x)
                out.float().sum().backward()
            else:
                with torch.no_grad():
                    out = module(x)
    finally:
        module.load_state_dict(state)
        module.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()), out.detach()

