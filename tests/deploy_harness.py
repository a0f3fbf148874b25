"""A real Flower deployment on 127.0.0.1 for tests: one SuperLink, N SuperNodes, ``flwr run``.

``Deployment`` starts ``flower-superlink`` and ``flower-supernode`` processes (insecure or
TLS with certificates made by ``openssl`` in a temp dir), gives every node its own
partition through ``--node-config "partition-id=i num-partitions=N"``, writes a private
``$FLWR_HOME/config.toml`` with a ``[superlink.<name>]`` connection, and runs
``flwr run <project> <name> --stream -c "..."``. Every process it starts is killed by PID
(with its descendants: superexec, flwr-serverapp, flwr-clientapp) in ``stop()``, which
also checks that none is left; use it as a context manager or from a fixture.

SuperNode authentication (``supernode_auth=True``, TLS only): the SuperLink runs with
``--enable-supernode-auth``; each SuperNode gets an EC (P-384) key pair made here, its public
key is registered with ``flwr supernode register`` before the node starts, and the node
signs its requests with ``--auth-supernode-private-key``. :meth:`start_unregistered_node`
starts a node with a key the SuperLink never saw (it must be refused).

Usable outside pytest too::

    with Deployment(Path("/tmp/dep"), num_nodes=3, tls=True) as dep:
        folder = dep.run({"algo": "fedavg", "num-rounds": 1}).folder
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.flower_harness import (ROOT, Managed, alive, cmdline, descendants, free_port,  # noqa: F401
                                  kill_pids, pids_with_env)

BIN = Path(sys.executable).parent


# ----------------------------------------------------------------------------- helpers
def toml_value(v: Any) -> str:
    """A run-config value in ``flwr run -c`` syntax (TOML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + str(v).replace("'", "") + "'"


def config_arg(cfg: dict[str, Any]) -> str:
    return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair in OpenSSH format (what ``flower-supernode`` and ``flwr supernode
    register`` read): (private key file, public key file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = folder / name, folder / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    priv.chmod(0o600)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b" flower-ssl-test\n")
    return priv, pub


def make_certificates(folder: Path) -> dict[str, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1/localhost (the commands of docs/deployment.md, "Start the SuperLink")."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    key, csr, crt, ext = folder / "server.key", folder / "server.csr", folder / "server.crt", folder / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(ca_key),
        "-out", str(ca_crt), "-subj", "/CN=flower-ssl-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
        "-subj", "/CN=127.0.0.1")
    ssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-out", str(crt), "-extfile", str(ext))
    return {"ca": ca_crt, "cert": crt, "key": key}


@dataclass
class RunResult:
    proc: subprocess.CompletedProcess
    folder: Path
    seconds: float

    @property
    def output(self) -> str:
        return (self.proc.stdout or "") + (self.proc.stderr or "")

    def metrics(self) -> list[dict[str, Any]]:
        p = self.folder / "metrics.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


# ----------------------------------------------------------------------------- deployment
class Deployment(Managed):
    """One SuperLink and ``num_nodes`` SuperNodes on 127.0.0.1, insecure or TLS."""

    def __init__(self, workdir: Path, num_nodes: int = 3, tls: bool = False, name: str = "deploy",
                 poll_interval: float = 0.5, project: Path = ROOT, supernode_auth: bool = False) -> None:
        if supernode_auth and not tls:
            raise ValueError("Flower's SuperNode authentication needs TLS")
        self.supernode_auth = supernode_auth
        self.keys: dict[int, tuple[Path, Path]] = {}   # node index -> (private, public) key files
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.num_nodes, self.tls, self.name, self.project = num_nodes, tls, name, project
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.results = self.workdir / "results"
        for d in (self.home, self.logs, self.results):
            d.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update({
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(poll_interval),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",   # several Flower processes share the CPUs
        })
        self.env.pop("FLOWER_SSL_HOME", None)
        self.certs: dict[str, Path] = {}
        self.port = 0
        self.superlink: subprocess.Popen | None = None
        self.nodes: dict[int, subprocess.Popen] = {}
        self.started: list[int] = []       # every pid we launched (for the final check)
        self.known: set[int] = set()       # + descendants seen while running
        self._restarts: dict[int, int] = {}
        self._files: list[Any] = []

    # ------------------------------------------------------------------ lifecycle (Managed)
    def _popen(self, args: list[str], log_name: str, **kw: Any) -> subprocess.Popen:
        fh = open(self.logs / log_name, "ab")
        self._files.append(fh)
        p = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                             cwd=self.workdir, **kw)
        self.started.append(p.pid)
        return p

    def start(self) -> None:
        if self.tls:
            self.certs = make_certificates(self.workdir / "certs")
        self.port = free_port()
        args = [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port),
                "--disable-runtime-dependency-installation",
                "--database", str(self.workdir / "state.db"),
                "--log-file", str(self.logs / "superlink.log")]
        args += (["--ssl-ca-certfile", str(self.certs["ca"]), "--ssl-certfile", str(self.certs["cert"]),
                  "--ssl-keyfile", str(self.certs["key"])] if self.tls else ["--insecure"])
        args += ["--enable-supernode-auth"] if self.supernode_auth else []
        self.superlink = self._popen(args, "superlink.out")
        self.write_connection()
        for i in range(self.num_nodes):
            if self.supernode_auth:
                self.keys[i] = make_node_key(self.workdir / "node-keys", f"node{i}")
                self.register(self.keys[i][1])
            self.start_node(i)
        self.wait_online(self.num_nodes)

    def register(self, public_key: Path, timeout: float = 120.0) -> None:
        """``flwr supernode register <public key> <connection>`` (retried while the SuperLink starts)."""
        deadline = time.time() + timeout
        while True:
            self._check_up()
            res = self.cli(["supernode", "register", str(public_key), self.name], timeout=60)
            if res.returncode == 0:
                return
            if time.time() > deadline:
                raise RuntimeError(f"flwr supernode register failed: {(res.stdout + res.stderr)[-2000:]}")
            time.sleep(1.0)

    def start_unregistered_node(self, i: int, node_config: str | None = None) -> subprocess.Popen:
        """SuperNode ``i`` with a key pair that was never registered (``node_config`` as in
        :meth:`start_node`)."""
        self.keys[i] = make_node_key(self.workdir / "node-keys", f"stranger{i}")
        return self.start_node(i, node_config)

    def write_connection(self) -> None:
        lines = ["[superlink]", f'default = "{self.name}"', "", f"[superlink.{self.name}]",
                 f'address = "127.0.0.1:{self.port}"']
        lines.append(f'root-certificates = "{self.certs["ca"]}"' if self.tls else "insecure = true")
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def start_node(self, i: int, node_config: str | None = None) -> subprocess.Popen:
        """Start (or restart) SuperNode ``i`` with partition ``i`` of ``num_nodes``."""
        if i in self.nodes and alive(self.nodes[i].pid):
            raise RuntimeError(f"SuperNode {i} is already running")
        n = self._restarts[i] = self._restarts.get(i, -1) + 1
        nc = node_config or f"partition-id={i} num-partitions={self.num_nodes}"
        args = [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
                "--host", "127.0.0.1", "--port", str(free_port()), "--node-config", nc]
        args += ["--root-certificates", str(self.certs["ca"])] if self.tls else ["--insecure"]
        if i in self.keys:
            args += ["--auth-supernode-private-key", str(self.keys[i][0])]
        self.nodes[i] = self._popen(args, f"supernode{i}.out" if n == 0 else f"supernode{i}.{n}.out")
        return self.nodes[i]

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill SuperNode ``i`` and its children (superexec, clientapps) by PID: a crash."""
        p = self.nodes[i]
        pids = [p.pid, *descendants(p.pid)]
        self.known.update(pids)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        p.wait(timeout=10)
        left = kill_pids(pids, grace=2.0)
        assert not left, f"SuperNode {i} processes survived: {left}"

    def cli(self, args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        p = subprocess.Popen([str(BIN / "flwr"), *args], cwd=self.workdir, env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.started.append(p.pid)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.known.update(descendants(p.pid))
            kill_pids([p.pid, *descendants(p.pid)], grace=1.0)
            out, err = p.communicate()
            err += f"\n[deploy_harness] flwr {' '.join(args[:2])} timed out after {timeout:.0f} s"
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def online_nodes(self) -> int:
        res = self.cli(["supernode", "list", self.name, "--format", "json"], timeout=60)
        try:
            data = json.loads(res.stdout)
        except json.JSONDecodeError:
            return 0
        nodes = data.get("nodes", []) if isinstance(data, dict) else []
        return sum(1 for n in nodes if str(n.get("status", "")).lower() == "online")

    def wait_online(self, n: int, timeout: float = 300.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._check_up()
            if self.online_nodes() >= n:
                return
            time.sleep(1.0)
        raise RuntimeError(f"fewer than {n} SuperNodes online after {timeout:.0f} s; logs in {self.logs}")

    def _check_up(self) -> None:
        if self.superlink is not None and self.superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited: {self.log('superlink.out')[-2000:]}")

    def diagnose(self) -> str:
        """Known failure signatures in the SuperNode logs, for assertion messages."""
        notes = []
        token = sum(self.log(p.name).count("task-token authentication failed") for p in self.logs.glob("supernode*.out"))
        if token:
            notes.append(f"{token} ClientApp process(es) missed Flower's 30-s task-token window "
                         f"(they could not start in time: the machine is overloaded; load average "
                         f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        return "; ".join(notes) or "no known failure signature in the SuperNode logs"

    def log(self, name: str) -> str:
        p = self.logs / name
        return p.read_text(errors="replace") if p.exists() else ""

    # ------------------------------------------------------------------ runs
    def submit(self, run_config: dict[str, Any], run_name: str) -> tuple[subprocess.Popen, dict[str, Any]]:
        """Start ``flwr run --stream`` in the background (for tests that act mid-run)."""
        cfg = {"results-dir": str(self.results), "run-name": run_name, **run_config}
        log = open(self.logs / f"flwr-run-{run_name}.out", "ab")
        self._files.append(log)
        p = subprocess.Popen([str(BIN / "flwr"), "run", str(self.project), self.name, "--stream",
                              "-c", config_arg(cfg)], cwd=self.workdir, env=self.env,
                             stdout=log, stderr=subprocess.STDOUT)
        self.started.append(p.pid)
        return p, cfg

    def run(self, run_config: dict[str, Any], run_name: str, timeout: float = 240) -> RunResult:
        """``flwr run <project> <connection> --stream -c ...``; returns the run folder."""
        cfg = {"results-dir": str(self.results), "run-name": run_name, **run_config}
        t0 = time.time()
        proc = self.cli(["run", str(self.project), self.name, "--stream", "-c", config_arg(cfg)], timeout)
        (self.logs / f"flwr-run-{run_name}.out").write_text(proc.stdout + proc.stderr)
        return RunResult(proc, self.results / run_name, time.time() - t0)

    def serverapp_pids(self) -> list[int]:
        if self.superlink is None:
            return []
        return [p for p in descendants(self.superlink.pid) if "flwr-serverapp" in cmdline(p)]

    # ------------------------------------------------------------------ teardown
    def all_pids(self) -> list[int]:
        pids = list(self.started)
        for p in list(self.started):
            pids += descendants(p)
        self.known.update(pids)
        return pids

    def stop(self) -> None:
        """Kill every process this deployment started (and their descendants) by PID,
        then check that none is left."""
        pids = self.all_pids()
        # nodes first (they deactivate at the SuperLink), then the rest
        node_pids = [p.pid for p in self.nodes.values()]
        kill_pids([p for p in pids if p in node_pids], grace=3.0)
        left = kill_pids(self.all_pids() + pids, grace=5.0)
        for fh in self._files:
            fh.close()
        self._files.clear()
        for p in [self.superlink, *self.nodes.values()]:
            if p is not None:
                try:
                    p.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
        # descendants re-parented before we saw them still carry our private FLWR_HOME
        orphans = pids_with_env("FLWR_HOME", str(self.home))
        left = kill_pids(left + orphans, grace=3.0) if (left or orphans) else []
        left += [p for p in pids_with_env("FLWR_HOME", str(self.home)) if p not in left]
        if left:
            raise RuntimeError(f"processes left after stop(): {sorted(set(left))}")
