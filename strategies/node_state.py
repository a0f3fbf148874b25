"""Node-side state that survives a SuperNode restart and a resumed run.

Some algorithms keep state on the node from one round to the next (SSFL: the user's
BatchNorm statistics; Fed-SHVR: the drift-correction carry and the previous global;
UM-pFSSL: the helper list, FedPer's head, local-only's model). Flower keeps
``context.state`` only while the SuperNode process lives, and a resumed run starts new
contexts, so without more the algorithm would silently change from round k+1 on.

Each :class:`~strategies.registry.AlgorithmSpec` names its round-persistent keys
(``node_state``); :func:`handle` runs a client handler between a restore and a save:

* **where**: ``<state-dir>/<state-key>/partition-<id>/round-<r>.npz``. ``state-dir`` is the
  node config key (``--node-config "... state-dir='/var/lib/flower-ssl'"``), else the
  ``FLOWER_SSL_STATE_DIR`` environment variable, else, in Flower's simulation engine only,
  ``<system temp dir>/flower-ssl-node-state``; otherwise (a SuperNode without either) the
  state lives only in ``context.state``, and a restart of that node starts its state afresh. ``state-key`` is chosen by the server when a run starts and
  kept in its checkpoint, so a resumed run finds its nodes' state and a new run never does.
* **what**: the named records of ``context.state`` after each handler call of round r
  (arrays as ``.npz`` entries, config records as JSON; loaded with ``allow_pickle=False``:
  a file can hold data, never code). Two rounds are kept per node (the last one, and the
  one before, which a server resumed from its last checkpoint needs); about the size of
  the records: Fed-SHVR two trainable-parameter copies, SSFL the BN buffers, UM-pFSSL the
  helper ids (plus one model for local-only, one head for fedper-fix).
* **when it is read**: a message of round r from a server *session* (one ``start()``) the
  node has not seen, or a context without the keys (a restarted SuperNode), restores the
  newest saved round < r: exactly the state the server's checkpoint of round r-1 assumes.
* **missing or corrupt**: a logged warning and a fresh start of that node's state (as a
  node that joins late), never a crash.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from logging import WARNING
from pathlib import Path
from typing import Callable

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.common import log

from strategies.core.records import numpy_to_record
from strategies.core.simulation import in_simulation

STATE_DIR_KEY = "state-dir"            # node config
STATE_DIR_ENV = "FLOWER_SSL_STATE_DIR"
META = "node-state.meta"               # ConfigRecord in context.state: session and round of the state
KEEP_ROUNDS = 2
_ROUND_FILE = re.compile(r"^round-(\d+)\.npz$")


def state_root(context: Context) -> Path | None:
    """Node config ``state-dir``, else ``$FLOWER_SSL_STATE_DIR``, else in Flower's simulation
    engine ``<system temp dir>/flower-ssl-node-state`` (server and nodes share the machine, so
    a resumed simulation finds its nodes' state); else None (``context.state`` only)."""
    d = str(context.node_config.get(STATE_DIR_KEY, "") or os.environ.get(STATE_DIR_ENV, ""))
    if d:
        return Path(os.path.expanduser(d))
    if in_simulation():
        return Path(tempfile.gettempdir()) / "flower-ssl-node-state"
    return None


def _folder(root: Path, state_key: str, partition: int) -> Path:
    if not re.fullmatch(r"[0-9a-f]{8,64}", state_key):  # a server-chosen name: never a path
        raise ValueError(f"state-key {state_key!r} is not a hex id")
    return root / state_key / f"partition-{int(partition)}"


def save(folder: Path, rnd: int, context: Context, keys: tuple[str, ...]) -> None:
    """Write the named records of ``context.state`` as round ``rnd`` (atomically), keep two rounds."""
    entries: dict[str, np.ndarray] = {}
    for k in keys:
        if k not in context.state:
            continue
        if k in context.state.array_records:
            for name in context.state.array_records[k].keys():
                entries[f"a|{k}|{name}"] = context.state.array_records[k][name].numpy()
        elif k in context.state.config_records:
            entries[f"c|{k}"] = np.array(json.dumps(dict(context.state.config_records[k])))
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".round-", suffix=".npz")
    os.close(fd)
    try:
        np.savez(tmp, **entries)
        os.replace(tmp, folder / f"round-{rnd}.npz")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    rounds = sorted((int(m.group(1)) for p in folder.iterdir() if (m := _ROUND_FILE.match(p.name))), reverse=True)
    for r in rounds[KEEP_ROUNDS:]:
        (folder / f"round-{r}.npz").unlink(missing_ok=True)


def restore(folder: Path, before: int, context: Context, keys: tuple[str, ...]) -> int | None:
    """Load the newest saved round < ``before`` into ``context.state``; return it (None: none usable)."""
    for k in keys:
        if k in context.state:
            del context.state[k]
    if not folder.is_dir():
        return None
    rounds = sorted((int(m.group(1)) for p in folder.iterdir() if (m := _ROUND_FILE.match(p.name))), reverse=True)
    for r in (r for r in rounds if r < before):
        path = folder / f"round-{r}.npz"
        try:
            arrays: dict[str, dict[str, np.ndarray]] = {}
            configs: dict[str, dict] = {}
            with np.load(path, allow_pickle=False) as z:
                for name in z.files:
                    kind, _, rest = name.partition("|")
                    if kind == "a":
                        key, _, arr = rest.partition("|")
                        arrays.setdefault(key, {})[arr] = z[name]
                    elif kind == "c":
                        configs[rest] = json.loads(str(z[name]))
            for key, d in arrays.items():
                if key in keys:
                    context.state[key] = numpy_to_record(d)
            for key, d in configs.items():
                if key in keys:
                    context.state[key] = ConfigRecord(d)
            return r
        except Exception as e:  # noqa: BLE001 - a torn or tampered file: start fresh, say so
            log(WARNING, "node state %s is unreadable (%s: %s); this node starts its state afresh",
                path, type(e).__name__, e)
            for k in keys:
                if k in context.state:
                    del context.state[k]
            return None
    return None


def handle(handler: Callable[[Message, Context], Message], msg: Message, context: Context,
           keys: tuple[str, ...], persist: bool = True) -> Message:
    """Run ``handler`` with the node's round-persistent ``keys`` restored before and saved after.

    ``persist=False`` (information and evaluation queries): restore only. The message's
    config gives ``server-round``, ``state-key`` and ``state-session`` (set by
    :meth:`strategies.base.BaseStrategy.base_content`); without them the handler runs as is.
    """
    cfg = msg.content.config_records.get("config")
    if not keys or cfg is None or "state-session" not in cfg:
        return handler(msg, context)
    rnd, session = int(cfg.get("server-round", 0)), str(cfg["state-session"])
    meta = dict(context.state.config_records[META]) if META in context.state.config_records else {}
    root = state_root(context)
    folder = None
    if root is not None:
        try:
            pid = int(context.node_config["partition-id"])
            folder = _folder(root, str(cfg.get("state-key", "")), pid)
        except (KeyError, ValueError, TypeError) as e:
            log(WARNING, "node state not persisted: %s", e)
    fresh_session = meta.get("session") != session
    if fresh_session or int(meta.get("round", -1)) > rnd:
        # a new server session (a resumed run) or a restarted node: the state the server's
        # checkpoint assumes is the newest saved round before this one
        have = any(k in context.state for k in keys)
        if folder is not None:
            got = restore(folder, rnd, context, keys)
            if got is None and have:
                log(WARNING, "no saved node state before round %d in %s; this node starts its state afresh",
                    rnd, folder)
        elif have and int(meta.get("round", -1)) >= rnd:
            for k in keys:  # ahead of the server and nothing on disk: the only safe state is none
                if k in context.state:
                    del context.state[k]
            log(WARNING, "node state is from round %s, the server resumes at round %d, and no state-dir is "
                         "set: this node starts its state afresh", meta.get("round"), rnd)
    out = handler(msg, context)
    context.state[META] = ConfigRecord({"session": session, "round": rnd})
    if persist and folder is not None and rnd >= 1 and any(k in context.state for k in keys):
        try:
            save(folder, rnd, context, keys)
        except OSError as e:
            log(WARNING, "node state not saved to %s: %s", folder, e)
    return out
