"""Where and how the ServerApp hosts the split stream: :class:`StreamOptions`, the one
statement of each ``split-stream-*`` run-config key's default, allowed values and help.

The run config (``flower_apps.config.AppConfig``) takes these knobs (``knob_of``), and
``pyproject.toml`` lists the keys with these defaults (``tests/test_config.py`` checks it).
Constructing a :class:`StreamOptions` checks every value as the run config does, and the
rules that join several options (a wildcard bind needs an advertised address; plaintext
on or towards a non-loopback address needs consent), raising :class:`tasks.config.ConfigError`
(a ``ValueError``) that names the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.config import ConfigError, check_field, fields_of, key_of, knob

from .stream_security import _is_loopback

__all__ = ["StreamOptions", "TLS_MODES", "SESSION_MODES", "KEY_PREFIX", "stream_knobs"]

TLS_MODES = ("auto", "on", "off")
SESSION_MODES = ("auto", "run", "round")
KEY_PREFIX = "split-stream"   # the run-config key of field ``x_y`` is ``split-stream-x-y``


@dataclass(frozen=True)
class StreamOptions:
    """Where and how the ServerApp hosts the stream (run-config keys ``split-stream-*``)."""

    host: str = knob("127.0.0.1", help="stream transport: address the ServerApp binds ('0.0.0.0' to "
                                       "accept remote SuperNodes; then set split-stream-advertise)")
    advertise: str = knob("", help="stream transport: address SuperNodes connect to ('' = split-stream-host)")
    port: int = knob(0, lo=0, hi=65535, help="stream transport: port (0 = an ephemeral port per run, or per "
                                             "round with one-round sessions)")
    tls: str = knob("auto", choices=TLS_MODES,
                    help="stream transport: TLS with a fresh self-signed certificate (per run, or per round with "
                         "one-round sessions) shipped in the Flower start message; auto = on unless both "
                         "split-stream-host and the address SuperNodes dial (split-stream-advertise, else "
                         "split-stream-host) are loopback addresses")
    session: str = knob("auto", choices=SESSION_MODES,
                        help="stream transport: how long a node's stream session lasts. run = many rounds (one "
                             "Flower message starts it; later rounds start on the stream); round = one round; "
                             "auto = run unless a simulation cannot run every node's ClientApp at once")
    allow_plaintext: bool = knob(False, help="stream transport: accept split-stream-tls='off' when the ServerApp "
                                             "binds, or SuperNodes dial, a non-loopback address (tokens, activations "
                                             "and gradients then cross the network in the clear; a warning is "
                                             "logged every run)")
    # not a split-stream-* key: every wait, both sides (the run's round-timeout)
    timeout: float = field(default=600.0)

    def __post_init__(self) -> None:
        for f, typ in stream_knobs():   # checked (and coerced: 'true' -> True) as the run config checks them
            object.__setattr__(self, f.name, check_field(self.key(f.name), getattr(self, f.name), typ,
                                                         dict(f.metadata)))
        if self.host in ("0.0.0.0", "::", "") and not self.advertise:
            raise ConfigError(f"split-stream-host={self.host!r} binds every interface; set split-stream-advertise "
                         f"to the address SuperNodes reach the ServerApp at")
        if self.tls == "off" and self.exposed and not self.allow_plaintext:
            raise ConfigError(
                f"split-stream-tls='off' with {self.exposure}: each node's session token and every activation and "
                f"gradient would cross the network in the clear. Use split-stream-tls='auto' or 'on', or set "
                f"split-stream-allow-plaintext=true to accept that (e.g. on a network you trust; a warning is "
                f"logged every run)")

    @staticmethod
    def key(name: str) -> str:
        """The run-config key of field ``name`` (``allow_plaintext`` -> ``split-stream-allow-plaintext``)."""
        return f"{KEY_PREFIX}-{key_of(name)}"

    @property
    def address_host(self) -> str:
        return self.advertise or self.host

    @property
    def exposed(self) -> bool:
        """Whether the stream can be reached from the network: the ServerApp binds a host that
        is not a loopback address (a wildcard such as ``0.0.0.0`` listens on every interface),
        or SuperNodes dial one (``split-stream-advertise``, else ``split-stream-host``)."""
        return not (_is_loopback(self.host) and _is_loopback(self.address_host))

    @property
    def exposure(self) -> str:
        """Why the stream is :attr:`exposed`, in words (for errors and warnings)."""
        why = []
        if not _is_loopback(self.host):
            why.append(f"split-stream-host={self.host!r} (" + ("a listener on every interface" if self.host in
                       ("0.0.0.0", "::", "") else "not a loopback address") + ")")
        if not _is_loopback(self.address_host) and self.address_host != self.host:
            why.append(f"SuperNodes dialling {self.address_host!r} (not a loopback address)")
        return " and ".join(why)

    def use_tls(self) -> bool:
        """``auto``: TLS unless both the bound host and the address the clients dial (advertise,
        else host) are loopback addresses, i.e. unless nothing of the stream reaches a network."""
        if self.tls != "auto":
            return self.tls == "on"
        return self.exposed


def stream_knobs() -> list[tuple[Any, type]]:
    """``(field, type)`` of each :class:`StreamOptions` field that is a run-config key."""
    return [(f, typ) for f, typ in fields_of(StreamOptions) if "help" in f.metadata]
