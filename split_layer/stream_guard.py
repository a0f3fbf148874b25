"""The split stream server's connection budget and refusal accounting.

The stream endpoint is an open port: anyone who reaches it can connect and make calls.
An unauthenticated call is refused before any frame is read (``split_layer.stream_server``), but a
refused call alone leaves its connection open, and gRPC's own limits do not bound what a
hostile peer can hold: the idle timeout restarts with every call, and nothing caps the
number of connections or the descriptors they take. This module adds the budget:

* **A hard cap** on open connections (gRPC's ``grpc.max_allowed_incoming_connections``:
  a connection over it is closed at accept): :data:`MIN_CAP`, or more for many nodes, but
  never more than :data:`FD_SHARE` of the descriptors the process has left at start
  (:func:`descriptor_room`, which raises the soft limit towards the hard one first), and
  never so many that fewer than :data:`FD_RESERVE` stay free, so that the ServerApp's own
  files (results, checkpoints, logs) and gRPC's short-lived descriptors (a connection over
  the cap is accepted before it is closed) have room even while an attacker holds the cap.
  The cap only absorbs bursts: the budgets below keep what an attacker holds far under it.
* **A connection must authenticate** (start a call with a valid node id and token)
  within :data:`AUTH_DEADLINE_S` of being first seen, counted from the connection's first
  sighting, so calls cannot refresh it; one that does not is closed.
* **A refused call closes its connection** (after :data:`REFUSED_GRACE_S`, so that the
  refusal's status still reaches the caller): a peer that wants to keep trying must pay
  for a new connection every time.
* **A flood is banned**: an address refused more than :data:`FLOOD_CALLS` times within
  :data:`FLOOD_WINDOW_S` is banned for :data:`BAN_S`; so is every address at once when all
  of them together (those already banned not counted) are refused more than
  :data:`GLOBAL_FLOOD_CALLS` times within the window (a flood spread over many source
  addresses, none of which alone reaches the per-address count). While a ban lasts, a
  refused call's connection is cut within :data:`FAST_SWEEP_S`, with no grace for its
  status, and the call is held until then (``split_layer.stream_server``), so
  every call costs the flooder a new connection and a wait. A ban never cuts a connection
  whose call was not refused: a call with a valid token is admitted from a banned address
  as from any other, so genuine nodes behind the flooder's address (the same host, a shared
  NAT) start their sessions during the ban. (Cutting the connections of a banned address
  before their call is seen would also cut those nodes' new connections, which look the
  same until their call arrives.) Bans are kept for the whole run (:class:`FloodBans`, which
  the transport hands to each round's server), so a flooder gets no fresh count when a
  one-round session's server is replaced by the next round's.
* **Unauthenticated connections are budgeted** per peer address
  (:data:`UNAUTH_PER_PEER`) and in all (:data:`UNAUTH_TOTAL`); over the budget the oldest
  are closed first (a genuine node authenticates within milliseconds of connecting, so the
  ones left waiting longest are the attacker's; none younger than :data:`YOUNG_S` is closed
  for a budget). Authenticated connections, the genuine
  sessions, are never counted against these budgets or closed by the guard.

The guard sees connections through the process's descriptor table (the accepted sockets
whose local port is the server's) and closes one by shutting its socket down, which gRPC
handles as a peer that went away; the data path is untouched. Where the descriptor table
cannot be read (no ``/proc/self/fd`` or ``/dev/fd``), only the hard cap and gRPC's idle and
handshake limits apply, and that is logged.

Refusals are counted by a fixed set of reasons (:data:`REASONS`) and by caller address in
a table of bounded size that keeps the busiest addresses (:class:`TopCallers`); the first few
of each reason in every period are logged one by one, and a summary of bounded length, naming
the busiest callers, follows each period that had more (:class:`RefusalLog`).

Time is read from one clock, :attr:`FloodBans.clock` (``time.monotonic`` unless a test drives
it): the bans' window and duration and every age the sweep compares are counted in it.
"""
from __future__ import annotations

import collections
import math
import os
import socket
import stat
import threading
import time
from logging import INFO, WARNING
from typing import Callable
from urllib.parse import unquote

from flwr.common import log

__all__ = ["RefusalLog", "TopCallers", "FloodBans", "ConnectionGuard", "descriptor_room", "REASONS"]

AUTH_DEADLINE_S = 10.0     # a connection authenticates within this (from its first sighting)
REFUSED_GRACE_S = 0.05     # a refused call's status reaches the caller before its connection closes
YOUNG_S = 0.5              # a connection this new is not closed for the budgets (a genuine node's call is on its way)
UNAUTH_PER_PEER = 8        # unauthenticated connections one peer address may hold
UNAUTH_TOTAL = 64          # unauthenticated connections every peer together may hold
FD_RESERVE = 64            # descriptors always kept free for the ServerApp's own files
FD_SHARE = 0.75            # connections take at most this share of the descriptors left at start
MIN_CAP = 1024             # the hard cap on open connections, unless the descriptor limit allows fewer
SWEEP_S = 0.25             # how often the guard looks at the connections
FAST_SWEEP_S = 0.01        # ... while an address is banned
FLOOD_CALLS = 200          # refusals from one address within FLOOD_WINDOW_S that make it a flooder
FLOOD_WINDOW_S = 2.0
GLOBAL_FLOOD_CALLS = 400   # refusals from all addresses together within FLOOD_WINDOW_S that ban every address
BAN_S = 30.0               # how long a ban lasts
ALL = "*"                  # the key of a ban of every address
MAX_WATCHED = 1024         # addresses whose recent refusals are counted (the least recent are forgotten)
SUMMARY_S = 60.0           # a refusal summary at most this often
LOG_PER_REASON = 3         # refusals logged one by one per reason and period
MAX_CALLERS = 16           # caller addresses counted one by one (the busiest kept; the rest: "others")

# Every reason a call or connection is refused (the keys of the counts: a fixed set)
REASONS = {
    "no-credentials": "no node id or token in the call metadata",
    "unknown-node": "the node is not in this session",
    "wrong-token": "wrong token for the node",
    "unknown-method": "a method this server does not serve",
    "already-connected": "the node already streams (a second stream with its token)",
    "already-dropped": "the node was already dropped from this session",
    "auth-deadline": f"connection did not authenticate within {AUTH_DEADLINE_S:.0f} s",
    "after-refusal": "connection closed after a refused call",
    "peer-budget": f"more than {UNAUTH_PER_PEER} unauthenticated connections from one address",
    "total-budget": f"more than {UNAUTH_TOTAL} unauthenticated connections in all",
    "banned": f"an address refused more than {FLOOD_CALLS} times in {FLOOD_WINDOW_S:.0f} s, or all addresses together "
              f"more than {GLOBAL_FLOOD_CALLS} times (banned for {BAN_S:.0f} s)",
}


def peer_key(peer: str) -> tuple[str, int] | None:
    """``(host, port)`` of a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, URL-encoded
    or not); ``None`` for anything else (a unix socket)."""
    p = unquote(peer or "")
    kind, _, rest = p.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return _host(host.strip("[]")), int(port)
    except ValueError:
        return None


def _host(h: str) -> str:
    """An address as one string for both socket families (IPv4-mapped IPv6 -> IPv4)."""
    if h.startswith("::ffff:") and "." in h:
        return h[7:]
    return h


def descriptor_room(want: int, reserve: int = FD_RESERVE, share: float = FD_SHARE) -> int:
    """How many more descriptors the process may give to connections: at most ``share`` of
    those it has left, and never so many that fewer than ``reserve`` stay free. Raises the
    soft limit (``ulimit -n``) towards the hard one first when ``want`` more do not fit."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to check
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = _open_descriptors()
    need = used + max(want + reserve, math.ceil(want / share))
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(hard, need)
        if new > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
    if soft == resource.RLIM_INFINITY:
        return want
    left = soft - used
    return max(0, min(left - reserve, int(left * share)))


def _fd_dir() -> str | None:
    for d in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(d):
            return d
    return None


def _open_descriptors() -> int:
    d = _fd_dir()
    try:
        return len(os.listdir(d)) if d else 0
    except OSError:
        return 0


class TopCallers:
    """The busiest callers in a table of at most ``size`` addresses, by the Space-Saving
    algorithm (Metwally, Agrawal and El Abbadi, "Efficient computation of frequent and top-k
    elements in data streams", ICDT 2005): an address not in the full table takes the place
    of the least counted one and inherits its count, so an entry's count is an upper bound,
    over by at most what it inherited, and any address with more than ``total / size``
    refusals is in the table whatever arrived before or after it (decoys cannot hide a flooder)."""

    def __init__(self, size: int = MAX_CALLERS) -> None:
        self.size = int(size)
        self.counts: dict[str, int] = {}      # address -> refusals (an upper bound)
        self.inherited: dict[str, int] = {}   # address -> the part of its count it inherited

    def add(self, addr: str) -> None:
        if addr in self.counts:
            self.counts[addr] += 1
            return
        n = 0
        if len(self.counts) >= self.size:
            low = min(self.counts, key=self.counts.__getitem__)
            n = self.counts.pop(low)
            del self.inherited[low]
        self.counts[addr], self.inherited[addr] = n + 1, n

    def top(self, k: int) -> list[tuple[str, int, int]]:
        """The ``k`` busiest addresses, busiest first: ``(address, at least, at most)`` refusals."""
        rows = [(a, c - self.inherited[a], c) for a, c in self.counts.items()]
        return sorted(rows, key=lambda x: (-x[1], -x[2]))[:k]

    @property
    def others(self) -> int:
        """At most this many of the counted refusals came from addresses no longer in the table."""
        return sum(self.inherited.values())


class RefusalLog:
    """Bounded refusal accounting: counts per reason (:data:`REASONS`), the busiest callers
    (:class:`TopCallers`, at most :data:`MAX_CALLERS` addresses), the first
    :data:`LOG_PER_REASON` of each reason in each period logged with their detail, and one
    summary line per period that had more, naming the busiest callers."""

    def __init__(self, period: float = SUMMARY_S) -> None:
        self._lock = threading.Lock()
        self.period = float(period)
        self.total: collections.Counter = collections.Counter()    # reason -> count, whole life
        self.window: collections.Counter = collections.Counter()   # reason -> count, this period
        self.top = TopCallers()                                     # the busiest addresses, whole life
        self._logged: collections.Counter = collections.Counter()  # reason -> logged this period
        self._window_start = time.monotonic()

    @property
    def callers(self) -> dict[str, int]:
        """Address -> refusals, for the (at most :data:`MAX_CALLERS`) busiest addresses."""
        return self.top.counts

    @property
    def other_callers(self) -> int:
        """Refusals (at most) from addresses not among :attr:`callers`."""
        return self.top.others

    def add(self, reason: str, detail: str = "", peer: str = "", addr: str | None = None) -> None:
        """Count one refusal; ``peer``: gRPC's peer string of the caller (or ``addr``, its address)."""
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}; one of {sorted(REASONS)}")
        if addr is None:
            key = peer_key(peer)
            addr = key[0] if key else (peer[:60] or "?")
        with self._lock:
            self.total[reason] += 1
            self.window[reason] += 1
            self.top.add(addr)
            show = self._logged[reason] < LOG_PER_REASON
            if show:
                self._logged[reason] += 1
        if show:
            log(WARNING, "split stream: refused %s: %s", peer or "a call", (detail or REASONS[reason])[:300])

    def tick(self, now: float | None = None) -> None:
        """Close the period if it is over: one summary line when refusals went unlogged."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._window_start < self.period:
                return
            unlogged = sum(self.window.values()) - sum(self._logged.values())
            line = self._line(self.window, "in the last %.0f s" % (now - self._window_start)) if unlogged else ""
            self.window, self._logged, self._window_start = collections.Counter(), collections.Counter(), now
        if line:
            log(WARNING, "%s", line)

    def _line(self, counts: collections.Counter, when: str) -> str:
        reasons = ", ".join(f"{r} {c}" for r, c in sorted(counts.items(), key=lambda x: -x[1]))
        top = self.top.top(4)
        callers = ", ".join(f"{a} ({lo})" if lo == hi else f"{a} ({lo}-{hi})" for a, lo, hi in top)
        others = len(self.top.counts) - len(top)
        more = f" and {others} more address(es)" if others > 0 else ""
        more += f", up to {self.top.others} call(s) from further addresses" if self.top.others else ""
        return f"split stream: {sum(counts.values())} refusal(s) {when}: {reasons}; busiest callers {callers}{more}"

    def final(self) -> None:
        """The whole life's summary (at the server's stop), if anything was refused."""
        with self._lock:
            line = self._line(self.total, "in all") if self.total else ""
        if line:
            log(WARNING, "%s", line)

    @property
    def size(self) -> int:
        """Entries held (bounded: reasons + callers)."""
        return len(self.total) + len(self.window) + len(self._logged) + len(self.top.counts)


class FloodBans:
    """Which addresses are banned for flooding (module docstring), counted in ``clock``.

    Kept for a whole run by the stream transport and handed to each of its servers: with
    one-round sessions a server lives for one round, a ban outlives it (a flooder does not
    get a fresh count with every round's server)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: collections.OrderedDict = collections.OrderedDict()  # host -> (window start, refusals)
        self._everyone = (0.0, 0)                                           # all hosts: (window start, refusals)
        self._banned: dict[str, float] = {}                                 # host (or ALL) -> ban ends

    @staticmethod
    def _count(start: float, n: int, now: float) -> tuple[float, int]:
        """One more refusal in a window that started at ``start`` with ``n`` (a new window when it is over)."""
        return (start, n + 1) if now - start <= FLOOD_WINDOW_S else (now, 1)

    def refused(self, host: str) -> str:
        """Count one refusal of ``host``; returns what it banned: ``host``, :data:`ALL` or ``""``.
        A refusal of an address already banned counts towards nothing more."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            if self._hostile(host):
                return ""
            start, n = self._count(*self._recent.pop(host, (now, 0)), now)
            self._recent[host] = (start, n)
            if len(self._recent) > MAX_WATCHED:
                self._recent.popitem(last=False)
            self._everyone = self._count(*self._everyone, now)
            ban = host if n > FLOOD_CALLS else ALL if self._everyone[1] > GLOBAL_FLOOD_CALLS else ""
            if ban:
                self._banned[ban] = now + BAN_S
            return ban

    def _expire(self, now: float) -> None:
        for host in [h for h, t in self._banned.items() if t <= now]:
            del self._banned[host]

    def _hostile(self, host: str) -> bool:
        return bool(self._banned) and (host in self._banned or ALL in self._banned)

    def banned(self, host: str) -> bool:
        """Whether ``host`` is banned now (on its own, or with every address)."""
        with self._lock:
            self._expire(self.clock())
            return self._hostile(host)

    @property
    def active(self) -> bool:
        """Whether a ban lasts now (a guard then cuts refused calls' connections at once)."""
        with self._lock:
            self._expire(self.clock())
            return bool(self._banned)


class ConnectionGuard:
    """Closes the server's connections that are over the budget (module docstring).

    ``port``: the server's port (accepted sockets have it as their local port);
    ``refusals``: where closed connections are counted. :meth:`authenticated` /
    :meth:`released` mark a connection that carries a genuine call, :meth:`refused` one
    whose call was refused.
    """

    def __init__(self, port: int, refusals: RefusalLog, *, auth_deadline: float = AUTH_DEADLINE_S,
                 per_peer: int = UNAUTH_PER_PEER, total: int = UNAUTH_TOTAL, bans: FloodBans | None = None) -> None:
        self.port, self.refusals = int(port), refusals
        self.auth_deadline, self.per_peer, self.total = float(auth_deadline), int(per_peer), int(total)
        self.bans = bans if bans is not None else FloodBans()
        self._lock = threading.Lock()
        self._authed: collections.Counter = collections.Counter()   # (host, port) -> live genuine calls
        self._refused: dict[tuple[str, int], float] = {}             # (host, port) -> when refused
        self._seen: dict[tuple[str, int], float] = {}                # (host, port) -> first sighting
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.fd_dir = _fd_dir()
        self.closed = 0

    # ------------------------------------------------------------------ marks from the handlers
    def authenticated(self, peer: str) -> None:
        key = peer_key(peer)
        if key is not None:
            with self._lock:
                self._authed[key] += 1

    def released(self, peer: str) -> None:
        key = peer_key(peer)
        if key is not None:
            with self._lock:
                self._authed[key] -= 1
                if self._authed[key] <= 0:
                    del self._authed[key]

    def refused(self, peer: str) -> None:
        """A call on ``peer``'s connection was refused: the connection is closed (after
        :data:`REFUSED_GRACE_S`, or within :data:`FAST_SWEEP_S` while its address is banned),
        and the refusal counts towards the bans (:class:`FloodBans`)."""
        key = peer_key(peer)
        if key is None:
            return
        with self._lock:
            self._refused.setdefault(key, self.bans.clock())
        host = key[0]
        ban = self.bans.refused(host)
        if ban:
            what = (f"{host}: more than {FLOOD_CALLS} refusals in {FLOOD_WINDOW_S:.0f} s" if ban != ALL else
                    f"every address: more than {GLOBAL_FLOOD_CALLS} refusals from all addresses together in "
                    f"{FLOOD_WINDOW_S:.0f} s (the last from {host})")
            self.refusals.add("banned", f"{what}; banned for {BAN_S:.0f} s (refused calls' connections cut at "
                              f"once; calls with a valid token still admitted)", addr=host)
        self._wake.set()   # closed within REFUSED_GRACE_S, not at the next regular sweep

    def is_banned(self, peer: str) -> bool:
        """Whether ``peer``'s address is banned now (on its own, or with every address)."""
        key = peer_key(peer)
        return key is not None and self.bans.banned(key[0])

    # ------------------------------------------------------------------ the sweep
    def connections(self) -> dict[tuple[str, int], int]:
        """The server's open connections: peer ``(host, port)`` -> descriptor."""
        out: dict[tuple[str, int], int] = {}
        if self.fd_dir is None:
            return out
        try:
            fds = [int(f) for f in os.listdir(self.fd_dir)]
        except OSError:
            return out
        proc = self.fd_dir.startswith("/proc")
        for fd in fds:
            try:
                if proc:
                    if not os.readlink(f"{self.fd_dir}/{fd}").startswith("socket:"):
                        continue
                elif not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                dup = os.dup(fd)
            except OSError:
                continue
            try:
                s = socket.socket(fileno=dup)
            except OSError:
                os.close(dup)
                continue
            try:
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.getsockname()[1] == self.port:
                    peer = s.getpeername()
                    out[(_host(peer[0]), int(peer[1]))] = fd
            except OSError:
                pass   # the listening socket (no peer), or gone meanwhile
            finally:
                s.close()
        return out

    def sweep(self, now: float | None = None) -> list[tuple[tuple[str, int], str]]:
        """Close what is over the budget now; returns ``[(peer, reason)]`` of the closed ones."""
        now = self.bans.clock() if now is None else now
        conns = self.connections()
        close: dict[tuple[str, int], str] = {}
        with self._lock:
            for key in conns:
                self._seen.setdefault(key, now)
            for d in (self._seen, self._refused):
                for key in [k for k in d if k not in conns]:
                    del d[key]
            for key, t in self._refused.items():
                if self.bans.banned(key[0]):
                    close[key] = "banned"          # at once: no grace for a banned address's status
                elif now - t >= REFUSED_GRACE_S:
                    close[key] = "after-refusal"
            # connections that have not authenticated yet; a ban closes none of them (a genuine
            # node's call may be on its way): only the deadline and the budgets do
            waiting = [k for k in conns if k not in self._authed and k not in close]
            for key in waiting:
                if now - self._seen[key] > self.auth_deadline:
                    close[key] = "auth-deadline"
            waiting = sorted((k for k in waiting if k not in close and now - self._seen[k] >= YOUNG_S),
                             key=lambda k: self._seen[k], reverse=True)
            per_host: collections.Counter = collections.Counter()
            kept = []
            for key in waiting:   # newest first: the oldest over a budget are closed
                per_host[key[0]] += 1
                if per_host[key[0]] > self.per_peer:
                    close[key] = "peer-budget"
                else:
                    kept.append(key)
            for key in kept[self.total:]:
                close[key] = "total-budget"
        done = []
        for key, reason in close.items():
            if self._shutdown(conns[key]):
                self.closed += 1
                with self._lock:
                    self._refused.pop(key, None)
                if reason not in ("after-refusal", "banned"):   # (counted when refused)
                    self.refusals.add(reason, f"{REASONS[reason]}: closed", f"{key[0]} port {key[1]}", addr=key[0])
                done.append((key, reason))
        return done

    @staticmethod
    def _shutdown(fd: int) -> bool:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            s.close()

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        if self.fd_dir is None:
            log(INFO, "split stream: this platform shows no descriptor table; only the connection cap and "
                "gRPC's idle limits guard the stream port")
        self._thread = threading.Thread(target=self._run, name="split-stream-guard", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.bans.active:   # a refused call's connection is cut within FAST_SWEEP_S
                if self._wake.wait(SWEEP_S):
                    self._stop.wait(FAST_SWEEP_S)   # (the refusals that come meanwhile in the same sweep)
            elif self._wake.wait(SWEEP_S):
                time.sleep(REFUSED_GRACE_S)   # a refused call: its status first, then its connection goes
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if self.fd_dir is not None:
                    self.sweep()
                self.refusals.tick()
            except Exception as e:  # noqa: BLE001 - the guard must not die on one bad sweep
                log(WARNING, "split stream: connection sweep failed: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
