"""The split stream's wire format: frames, their bounds, the call's method and the gRPC
channel options both ends use.

Frames are :func:`encode` d as ``MAGIC | u32 header length | JSON header | raw tensor
bytes`` (dtype whitelist, sizes checked on :func:`decode`); no pickle ever crosses the wire.
Every message is bounded by the largest frame the round can legitimately carry
(:func:`max_frame_bytes` of the strategy's ``stream_specs``, plus :data:`FRAME_MARGIN`).
"""
from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

__all__ = ["StreamError", "StreamConfigError", "encode", "decode", "max_frame_bytes", "pack_arrays",
           "unpack_arrays", "config_to_json", "config_from_json", "metrics_from_json", "METHOD", "MAGIC",
           "STREAM_KEYS", "FRAME_MARGIN", "DEFAULT_MAX_FRAME"]

METHOD = "/flowerssl.SplitStream/Exchange"
MAGIC = b"FSS1"
# config keys of the start message (client side)
STREAM_KEYS = {"address": "split-stream-address", "token": "split-stream-token", "node": "split-stream-node",
               "cert": "split-stream-cert", "timeout": "split-stream-timeout",
               "max-frame": "split-stream-max-frame", "session": "split-stream-session",
               "idle": "split-stream-idle"}
_DTYPES = {"float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}
FRAME_MARGIN = 64 * 1024          # header, tensor table, error text on top of the tensor bytes
DEFAULT_MAX_FRAME = 64 * 2 ** 20  # a transport whose owner declares no stream specs

# keepalive: the client pings every 30 s (also while it computes and sends nothing); the server
# accepts pings that often, pings every 60 s itself, and closes a connection whose pings go
# unanswered for 20 s, one that has not finished its handshake in 20 s or that holds no call for 60 s.
# Each client has a connection of its own (no subchannel shared with other clients of the process).
_KEEPALIVE_CLIENT = [("grpc.use_local_subchannel_pool", 1),
                     ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 20_000),
                     ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0)]
_KEEPALIVE_SERVER = [("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                     ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                     ("grpc.http2.max_ping_strikes", 3), ("grpc.server_handshake_timeout_ms", 20_000),
                     ("grpc.max_connection_idle_ms", 60_000)]


def _grpc_options(max_receive: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", int(max_receive)),
            ("grpc.so_reuseport", 0)]


class StreamError(RuntimeError):
    """The split stream broke, timed out, or carried a malformed frame."""


class StreamConfigError(RuntimeError):
    """The stream transport cannot work with this run's settings (message says what to change)."""


# --------------------------------------------------------------------------- frames
def encode(header: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """One frame: ``MAGIC | u32 len | JSON header (+ tensor table) | raw tensor bytes``."""
    table, blobs = [], []
    for name, arr in (tensors or {}).items():
        a = np.asarray(arr)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if a.dtype.name not in _DTYPES:
            raise StreamError(f"tensor '{name}' has dtype {a.dtype.name}; allowed: {sorted(_DTYPES)}")
        table.append([name, a.dtype.name, list(a.shape), int(a.nbytes)])
        blobs.append(a.tobytes() if a.ndim == 0 or a.size == 0 else memoryview(a).cast("B"))
    head = json.dumps({"h": header, "t": table}, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *blobs])


def decode(buf: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of :func:`encode`; raises :class:`StreamError` on anything malformed."""
    try:
        if len(buf) < 8 or buf[:4] != MAGIC:
            raise StreamError("not a split-stream frame (bad magic)")
        (n,) = struct.unpack_from("<I", buf, 4)
        if 8 + n > len(buf):
            raise StreamError(f"frame header of {n} bytes runs past the frame ({len(buf)} bytes)")
        meta = json.loads(bytes(buf[8:8 + n]))
        header, table = meta["h"], meta["t"]
        if not isinstance(header, dict) or not isinstance(table, list):
            raise StreamError("frame header is not {'h': {...}, 't': [...]}")
        off, out = 8 + n, {}
        for name, dtype, shape, size in table:
            if dtype not in _DTYPES:
                raise StreamError(f"tensor '{name}': dtype {dtype!r} not allowed; allowed: {sorted(_DTYPES)}")
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape) or int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize != size:
                raise StreamError(f"tensor '{name}': shape {shape} and {size} bytes do not match dtype {dtype}")
            if off + size > len(buf):
                raise StreamError(f"tensor '{name}' runs past the end of the frame")
            out[str(name)] = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)),
                                           offset=off).reshape(shape)
            off += size
        if off != len(buf):
            raise StreamError(f"{len(buf) - off} trailing bytes after the last tensor")
        return header, out
    except StreamError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is a malformed frame
        raise StreamError(f"malformed split-stream frame: {type(e).__name__}: {e}") from None


def max_frame_bytes(specs: dict[str, Any] | None) -> int:
    """The largest frame a node may send: the tensor bytes of its ``stream_specs`` plus
    :data:`FRAME_MARGIN`` (JSON header, tensor table, an error text). ``None``: no specs
    known, :data:`DEFAULT_MAX_FRAME`."""
    if specs is None:
        return DEFAULT_MAX_FRAME
    total = 0
    for spec in specs.values():
        total += int(np.prod(tuple(spec.shape), dtype=np.int64)) * np.dtype(spec.dtype).itemsize
    return int(total + FRAME_MARGIN + 128 * len(specs))


def pack_arrays(arrays: dict[str, dict[str, np.ndarray]]) -> tuple[list[list[str]], dict[str, np.ndarray]]:
    """Named state dicts as one frame's tensors: ``(table, tensors)`` where ``table[i] =
    [name, key]`` names tensor ``str(i)`` (state-dict keys may hold any character)."""
    table, tensors = [], {}
    for name, sd in arrays.items():
        for key, v in sd.items():
            tensors[str(len(table))] = v
            table.append([str(name), str(key)])
    return table, tensors


def unpack_arrays(table: Any, tensors: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Inverse of :func:`pack_arrays`; a table that does not name exactly the frame's tensors
    raises :class:`StreamError`."""
    if not isinstance(table, list) or len(table) != len(tensors):
        raise StreamError(f"arrays table does not match the frame's {len(tensors)} tensor(s)")
    out: dict[str, dict[str, np.ndarray]] = {}
    for i, entry in enumerate(table):
        if (not isinstance(entry, list) or len(entry) != 2 or not all(isinstance(x, str) for x in entry)
                or str(i) not in tensors):
            raise StreamError(f"arrays table entry {i} is not [name, key] of a tensor in the frame")
        out.setdefault(entry[0], {})[entry[1]] = tensors[str(i)]
    return out


def config_to_json(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Flower ConfigRecord's values (numbers, strings, bools, bytes, lists of them) as JSON:
    bytes become ``{"b64": ...}``."""
    import base64

    def enc(v):
        if isinstance(v, (bytes, bytearray)):
            return {"b64": base64.b64encode(bytes(v)).decode()}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        return v
    return {str(k): enc(v) for k, v in cfg.items()}


def config_from_json(obj: Any) -> dict[str, Any]:
    """Inverse of :func:`config_to_json`; anything but such a dict raises :class:`StreamError`."""
    import base64

    def dec(v):
        if isinstance(v, dict):
            if set(v) != {"b64"} or not isinstance(v["b64"], str):
                raise StreamError("a config value is an object other than {'b64': ...}")
            return base64.b64decode(v["b64"])
        if isinstance(v, list):
            return [dec(x) for x in v]
        if v is None:
            raise StreamError("a config value is null")
        return v
    if not isinstance(obj, dict):
        raise StreamError("config is not an object")
    return {str(k): dec(v) for k, v in obj.items()}


def metrics_from_json(obj: Any) -> dict[str, Any]:
    """Reply metrics from a frame header: numbers or lists of numbers only."""
    def num(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if not isinstance(obj, dict) or not all(num(v) or (isinstance(v, list) and all(num(x) for x in v))
                                            for v in obj.values()):
        raise StreamError("metrics are not an object of numbers")
    return {str(k): v for k, v in obj.items()}

