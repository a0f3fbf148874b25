"""An aarch64 SuperNode beside x86-64 ones, under user-mode emulation (a benchmark, not a test).

What a Jetson user does, run on this machine: an arm64 Debian 12 root (Python 3.11) built with
``debootstrap`` and run through ``qemu-user-static`` (binfmt_misc), the library installed in it
as docs/deployment.md tells an aarch64 user (torch's aarch64 wheel from PyPI, then
``pip install -e`` of the project), then a real deployment on loopback with TLS and SuperNode
authentication (``tests/deploy_harness.py``): a SuperLink and two SuperNodes on the host
(x86-64, this interpreter's environment) and one SuperNode inside the arm64 root (``chroot``
shares the host's network namespace, so 127.0.0.1 is the same). It runs ``fedavg`` and ``scala``
(split, ``split-transport='stream'``) for 2 rounds each through ``flwr run``, once with all
three nodes on x86-64 (the reference) and once with node 2 on aarch64, and prints side by side:

* each node's ClientApp start-up per message, measured inside the real run: every SuperNode
  runs with ``PYTHONPROFILEIMPORTTIME=1``, so each ``flwr-clientapp`` process it starts writes
  its import times to the node's log (importing flwr, torch, the ClientApp module); the
  lifetime of every ``flwr-clientapp`` process (start to exit, polled every 0.2 s);
* the start-up step by step (import torch, import the ClientApp module, dataset, partition plan,
  model), timed in fresh processes in each environment (the steps of ``bench/fixed_cost.py``);
* whether the final weights (``model.pt``) of each algorithm equal the all-x86-64 run's, bit
  for bit, or their largest absolute difference.

The aarch64 node runs on qemu's ``neoverse-n1`` CPU model (``--qemu-cpu``; Armv8.2-A without SVE,
like a Jetson Orin's Cortex-A78AE). qemu-user's default model, ``max``, gives wrong float32
matrix products with torch 2.14.1's aarch64 wheel (the bench prints the check), and
``cortex-a72`` (Armv8.0) stops the wheel with an illegal instruction.

Needs root (binfmt_misc, debootstrap, chroot, mounts), ``apt-get``-able ``qemu-user-static
debootstrap binfmt-support``, and network access to deb.debian.org and PyPI the first time.
The root is cached (``--root``, default /work/arm64-root) and reused; the project's sources are
copied into it on every start. Two things this host needs that a Jetson does not: its local CA
certificates in the root (a TLS-inspecting proxy in front of PyPI) and arm64 CPU identification
registers in the root's sysfs (torch's aarch64 import crashes without them under qemu-user;
:meth:`Arm64Root.fake_cpu_ids`). Every process is stopped by PID and every mount undone on exit,
also on failure and Ctrl-C. Emulation is slow: run it niced::

    nice -n 10 python bench/aarch64_supernode.py
    python bench/aarch64_supernode.py --setup-only      # build/install the root, nothing else
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.deploy_harness import Deployment  # noqa: E402

SUITE = "bookworm"                      # Debian 12: Python 3.11, as flwr 1.42 requires
MIRROR = "http://deb.debian.org/debian"
VENV = "/opt/flower-ssl-venv"           # inside the root
SRC = "/opt/flower-ssl"                 # the project's sources inside the root
SOURCES = ("flower_apps", "strategies", "split_layer", "tasks", "conf", "README.md", "pyproject.toml")
COMMON = {"num-rounds": 2, "seed": 1, "round-timeout": 1800.0}
RUNS = {
    "fedavg": {"algo": "fedavg", "local-steps": 3},
    # the settings tests/test_deploy.py runs scala with over the TLS stream
    "scala": {"algo": "scala", "scala.local-iterations": 3, "scala.total-batch": 48,
              "split-transport": "stream", "split-stream-tls": "on"},
}


def say(msg: str) -> None:
    print(msg, flush=True)


def sh(args: list[str], log: Path | None = None, timeout: float | None = None, **kw: Any) -> float:
    """Run ``args`` (output to ``log`` if given), raise on failure; returns the seconds it took."""
    t0 = time.time()
    if log is None:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
        out = res.stdout + res.stderr
    else:
        with open(log, "a") as fh:
            fh.write(f"\n$ {' '.join(args)}\n")
            fh.flush()
            res = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, **kw)
        out = log.read_text(errors="replace")[-3000:]
    if res.returncode:
        raise RuntimeError(f"`{' '.join(args)}` exited {res.returncode}:\n{out[-3000:]}")
    return time.time() - t0


# ----------------------------------------------------------------------------- the arm64 root
class Arm64Root:
    """An arm64 Debian root at ``path``, run through qemu-aarch64 (binfmt_misc), with /proc,
    /sys, /dev and the bench's work folder mounted while in use (``with root.mounted(work):``)."""

    def __init__(self, path: Path, log: Path, qemu_cpu: str = "neoverse-n1") -> None:
        self.path, self.log, self.qemu_cpu = path, log, qemu_cpu
        self.mounts: list[Path] = []
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ emulation
    def ensure_emulation(self) -> None:
        missing = [p for p, exe in (("qemu-user-static", "qemu-aarch64-static"), ("debootstrap", "debootstrap"),
                                    ("binfmt-support", "update-binfmts")) if shutil.which(exe) is None]
        if missing:
            say(f"installing {' '.join(missing)} (apt-get)")
            sh(["apt-get", "install", "-y", *missing], self.log)
        binfmt = Path("/proc/sys/fs/binfmt_misc")
        if not (binfmt / "register").exists():
            sh(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)])
        if not (binfmt / "qemu-aarch64").exists():
            try:
                sh(["update-binfmts", "--enable", "qemu-aarch64"])
            except RuntimeError as err:
                say(f"update-binfmts failed ({err}); registering qemu-aarch64 directly")
                magic = r"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
                mask = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
                (binfmt / "register").write_text(
                    f":qemu-aarch64:M::{magic}:{mask}:{shutil.which('qemu-aarch64-static')}:F\n")
        state = (binfmt / "qemu-aarch64").read_text()
        if not state.startswith("enabled") or "F" not in state.split("flags:")[1].split("\n")[0]:
            raise RuntimeError(f"qemu-aarch64 is registered but not enabled with the F (fix binary) flag, "
                               f"which chroot needs:\n{state}")

    # ------------------------------------------------------------------ build and install
    def ensure_built(self) -> None:
        if (self.path / "usr/bin/python3.11").exists() and (self.path / "usr/bin/python3").exists():
            say(f"arm64 root: reusing {self.path}")
            return
        say(f"arm64 root: debootstrap --arch=arm64 {SUITE} into {self.path} (log {self.log})")
        self.path.mkdir(parents=True, exist_ok=True)
        self.timings["debootstrap"] = sh(
            ["debootstrap", "--arch=arm64", "--include=python3,python3-venv,python3-pip,ca-certificates",
             SUITE, str(self.path), MIRROR], self.log, timeout=3600)

    def copy_sources(self) -> None:
        """The project's sources (what the sdist holds) into ``SRC``: an editable install there
        follows them, so the node always runs this checkout."""
        dst = self.path / SRC.lstrip("/")
        dst.mkdir(parents=True, exist_ok=True)
        for name in SOURCES:
            src, out = ROOT / name, dst / name
            if out.is_dir():
                shutil.rmtree(out)
            if src.is_dir():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, out)

    def install(self, torch: str, torchvision: str) -> list[str]:
        """docs/deployment.md's aarch64 steps in the root; returns the commands (as a user types
        them). Skipped when the root already holds this install (a marker file)."""
        cmds = [f"python3 -m venv {VENV}", f". {VENV}/bin/activate",
                f"pip install torch=={torch} torchvision=={torchvision}",
                f"pip install -e {SRC}"]
        marker = self.path / VENV.lstrip("/") / "flower-ssl-bench.json"
        want = {"torch": torch, "torchvision": torchvision}
        if marker.exists() and json.loads(marker.read_text()).get("want") == want:
            say(f"arm64 root: reusing the install in {VENV} ({json.loads(marker.read_text())['versions']})")
            return cmds
        say(f"arm64 root: installing (log {self.log}): " + "; ".join(cmds))
        resolv = self.path / "etc/resolv.conf"
        if Path("/etc/resolv.conf").exists():
            resolv.unlink(missing_ok=True)
            shutil.copy2("/etc/resolv.conf", resolv)
        self.trust_host_cas()
        self.timings["venv"] = self.chroot(f"python3 -m venv {VENV}")
        self.timings["pip torch"] = self.chroot(
            f". {VENV}/bin/activate && pip install --progress-bar off torch=={torch} torchvision=={torchvision}")
        self.timings["pip library"] = self.chroot(f". {VENV}/bin/activate && pip install --progress-bar off -e {SRC}")
        versions = self.output(f"{VENV}/bin/python -c \"import sys, platform, torch, flwr, torchvision; "
                               f"print(platform.machine(), sys.version.split()[0], torch.__version__, "
                               f"torchvision.__version__, flwr.__version__)\"").split()
        marker.write_text(json.dumps({"want": want, "versions": versions}))
        return cmds

    def trust_host_cas(self) -> None:
        """The host's local CAs (/usr/local/share/ca-certificates, e.g. a TLS-inspecting proxy's)
        appended to the root's bundle, as update-ca-certificates would (which is slow emulated);
        without them pip in the root fails with CERTIFICATE_VERIFY_FAILED behind such a proxy."""
        local = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
        bundle = self.path / "etc/ssl/certs/ca-certificates.crt"
        if not local or not bundle.exists():
            return
        text = bundle.read_text()
        extra = [c.read_text() for c in local if c.read_text().strip() not in text]
        if extra:
            bundle.write_text(text.rstrip("\n") + "\n" + "\n".join(x.strip() + "\n" for x in extra))
            say(f"arm64 root: added {len(extra)} host CA certificate(s) from /usr/local/share/ca-certificates")

    # ------------------------------------------------------------------ running inside
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": "/root", "LANG": "C.UTF-8", "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",
                "QEMU_CPU": self.qemu_cpu, **(extra or {})}   # qemu-user reads it; children inherit it

    def argv(self, *args: str) -> list[str]:
        return ["chroot", str(self.path), *args]

    def chroot(self, script: str, timeout: float = 7200) -> float:
        return sh(self.argv("/bin/sh", "-c", script), self.log, timeout=timeout, env=self.env())

    def output(self, script: str, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
        res = subprocess.run(self.argv("/bin/sh", "-c", script), capture_output=True, text=True,
                             env=env or self.env(), timeout=timeout)
        if res.returncode:
            raise RuntimeError(f"in the arm64 root, `{script}` exited {res.returncode}:\n{res.stderr[-3000:]}")
        return res.stdout.strip()

    def mount(self, work: Path) -> None:
        """/proc, /sys, /dev (+ /dev/pts, /dev/shm) and ``work`` at the same path inside; on a
        host without arm64 CPU identification in sysfs, :meth:`fake_cpu_ids` over its CPU folder."""
        plan = [(["-t", "proc", "proc"], "proc"), (["-t", "sysfs", "sysfs"], "sys"), (["--bind", "/dev"], "dev"),
                (["--bind", "/dev/pts"], "dev/pts"), (["--bind", "/dev/shm"], "dev/shm"),
                (["--bind", str(work)], str(work).lstrip("/"))]
        cpus = Path("/sys/devices/system/cpu")
        if not (cpus / "cpu0/regs/identification/midr_el1").exists():
            plan.insert(2, (["--bind", str(self.fake_cpu_ids(work / "fake-sys-cpu"))], "sys/devices/system/cpu"))
        for opts, rel in plan:
            target = self.path / rel
            target.mkdir(parents=True, exist_ok=True)
            sh(["mount", *opts, str(target)])
            self.mounts.append(target)

    @staticmethod
    def fake_cpu_ids(folder: Path) -> Path:
        """A copy of the host's /sys/devices/system/cpu (the CPU lists and each CPU's topology)
        plus the arm64 identification registers an arm64 kernel exports there.

        torch's aarch64 wheel reads ``cpuN/regs/identification/midr_el1`` while it is imported
        (oneDNN's xbyak_aarch64 CPU detection); an x86-64 host's sysfs has no such entry and the
        import dies under qemu-user: "xbyak_aarch64/src/util_impl_linux.h, 444: Can't open
        MIDR_EL1 sysfs entry", then "qemu: uncaught target signal 11 (Segmentation fault)".
        The value given is a Cortex-A78AE's (Jetson AGX Orin's cores): implementer 0x41, part 0xd42."""
        host = Path("/sys/devices/system/cpu")
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("online", "possible", "present", "kernel_max", "offline"):
            if (host / name).exists():
                (folder / name).write_text((host / name).read_text())
        for cpu in sorted(host.glob("cpu[0-9]*")):
            ident = folder / cpu.name / "regs/identification"
            ident.mkdir(parents=True, exist_ok=True)
            (ident / "midr_el1").write_text("0x00000000410fd421\n")
            (ident / "revidr_el1").write_text("0x0000000000000000\n")
            (folder / cpu.name / "topology").mkdir(exist_ok=True)
            for attr in (cpu / "topology").glob("*"):
                try:
                    (folder / cpu.name / "topology" / attr.name).write_text(attr.read_text())
                except OSError:
                    pass
        return folder

    def umount(self) -> list[str]:
        """Undo every mount (reverse order; a lazy unmount if one is busy); returns what failed."""
        failed = []
        for target in reversed(self.mounts):
            r = subprocess.run(["umount", str(target)], capture_output=True, text=True)
            if r.returncode:
                r = subprocess.run(["umount", "-l", str(target)], capture_output=True, text=True)
                if r.returncode:
                    failed.append(f"{target}: {r.stderr.strip()}")
        self.mounts.clear()
        return failed


# ----------------------------------------------------------------------------- the deployment
class MixedDeployment(Deployment):
    """``Deployment`` whose SuperNodes in ``arm_nodes`` run inside the arm64 root (same
    arguments, certificates and keys: the work folder is mounted at the same path there), and
    whose every SuperNode runs with ``PYTHONPROFILEIMPORTTIME=1`` and ``FLWR_LOG_LEVEL=DEBUG``: its
    ClientApp processes log their import times, and Flower's lines carry timestamps."""

    def __init__(self, workdir: Path, root: Arm64Root | None, arm_nodes: tuple[int, ...] = (), **kw: Any) -> None:
        super().__init__(workdir, **kw)
        self.root, self.arm_nodes = root, set(arm_nodes)
        self._starting: int | None = None

    def start_node(self, i: int, node_config: str | None = None) -> subprocess.Popen:
        self._starting = i
        try:
            return super().start_node(i, node_config)
        finally:
            self._starting = None

    def _popen(self, args: list[str], log_name: str, **kw: Any) -> subprocess.Popen:
        if self._starting is None:
            return super()._popen(args, log_name, **kw)
        node_env = {"PYTHONPROFILEIMPORTTIME": "1", "FLWR_LOG_LEVEL": "DEBUG",  # DEBUG: timestamped lines
                    "FLOWER_SSL_DATA_CACHE": str(self.workdir / f"data-cache-{self._starting}")}
        if self._starting not in self.arm_nodes:
            saved = self.env
            self.env = {**saved, **node_env}
            try:
                return super()._popen(args, log_name, **kw)
            finally:
                self.env = saved
        assert self.root is not None
        keep = {k: v for k, v in self.env.items() if k.startswith("FLWR_") or k in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")}
        fh = open(self.logs / log_name, "ab")
        self._files.append(fh)
        p = subprocess.Popen(self.root.argv(f"{VENV}/bin/flower-supernode", *args[1:]), stdout=fh,
                             stderr=subprocess.STDOUT, env=self.root.env({**keep, **node_env}), cwd=self.workdir, **kw)
        self.started.append(p.pid)
        return p

    def clientapps(self, i: int) -> list[dict[str, Any]]:
        """Every ClientApp process node ``i`` started, read from its log (seconds): ``flwr``, the
        ``flwr-clientapp`` entry point's import (``-X importtime``, cumulative); ``pulled``, its
        ``Start `flwr-clientapp` process`` line (logged once flwr is imported) to its ``Start
        FAB installation`` (connected, message pulled); ``app``, every top-level import after
        flwr's (the ClientApp module with torch and the library, and the handler's lazy imports);
        ``torch``, the first ``import torch`` in it; ``on_node``, the SuperNode's ``Receiving: <type>
        message`` to its ``Sending: <type> message`` (everything the node did for that message);
        ``type``; ``token_failed``: Flower refused it (``Runtime task-token authentication
        failed``: it started later than Flower's 30-s window) and the SuperNode starts another."""
        procs: list[dict[str, Any]] = []
        stamp = re.compile(r"(?:INFO|DEBUG|WARNING|ERROR)\s+(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")
        imp_line = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)\s*$")
        for path in sorted(self.logs.glob(f"supernode{i}*.out")):
            cur: dict[str, Any] | None = None
            imports: dict[str, float] = {}
            received: float | None = None
            for raw in path.read_text(errors="replace").splitlines():
                line = re.sub(r"\x1b\[[0-9;]*m", "", raw)
                if line.startswith("import time: self [us]"):
                    imports = {}                       # a new Python process starts
                    continue
                m = imp_line.match(line)
                if m:
                    sec, top, name = int(m.group(1)) / 1e6, len(m.group(2)) == 1, m.group(3)
                    if top and name == "flwr.supernode.cli":
                        if "flwr" in imports:              # another process's import lines interleaved
                            imports = {}
                        imports.update(flwr=sec, app=0.0)
                    elif top and "app" in imports:
                        imports["app"] += sec
                    if name == "torch" and "torch" not in imports:
                        imports["torch"] = sec
                    continue
                t = stamp.search(line)
                if not t:
                    continue
                when = time.mktime(time.strptime(t.group(1), "%Y-%m-%d %H:%M:%S")) + int(t.group(2)) / 1e3
                if re.search(r"Receiving: \S+ message", line):
                    received = when
                elif "Start `flwr-clientapp` process" in line:
                    cur = {"started": when, "received": received, "imports": imports}
                    procs.append(cur)
                elif cur is None:
                    continue
                elif "task-token authentication failed" in line:
                    cur["token_failed"] = True
                elif "Start FAB installation" in line and "pulled" not in cur:
                    cur["pulled"] = when - cur["started"]
                elif (sm := re.search(r"Sending: (\S+) message", line)) and "type" not in cur:
                    cur["type"] = sm.group(1)
                    if cur["received"] is not None:
                        cur["on_node"] = when - cur["received"]
        for p in procs:
            p.update(p.pop("imports"))
            p.pop("started", None)
            p.pop("received", None)
        return procs


# ----------------------------------------------------------------------------- measurements
# what a node's ClientApp process does before its handler computes, step by step: bench/fixed_cost.py's probe
from bench.fixed_cost import PROBE  # noqa: E402


def probe(argv: list[str], env: dict[str, str], reps: int) -> dict[str, float]:
    """Median seconds of :data:`PROBE`'s steps over ``reps`` fresh processes (dataset
    cache warm: the first process fills it and is not counted)."""
    runs = []
    for _ in range(reps + 1):
        res = subprocess.run([*argv, "-c", PROBE], env=env, capture_output=True, text=True, timeout=3600)
        if res.returncode:
            raise RuntimeError(f"the probe failed:\n{res.stderr[-3000:]}")
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}


def compare(a: Path, b: Path) -> tuple[bool, float, int]:
    """(bit-identical?, largest absolute difference, tensors that differ) of two model.pt."""
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if set(x) != set(y):
        raise RuntimeError(f"{a} and {b} hold different tensors: {sorted(set(x) ^ set(y))[:5]}")
    diff = [float((x[k].double() - y[k].double()).abs().max()) if x[k].numel() else 0.0 for k in x]
    same = all(torch.equal(x[k], y[k]) for k in x)
    return same, max(diff), sum(1 for k in x if not torch.equal(x[k], y[k]))


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f}" if xs else "    n/a"


def run_deployment(work: Path, root: Arm64Root | None, arm: tuple[int, ...], label: str) -> dict[str, Any]:
    """fedavg and scala, 2 rounds each, on a TLS + SuperNode-auth deployment of 3 nodes."""
    out: dict[str, Any] = {"runs": {}}
    t0 = time.time()
    with MixedDeployment(work, root, arm, num_nodes=3, tls=True, supernode_auth=True) as dep:
        out["online_s"] = time.time() - t0
        say(f"[{label}] SuperLink + 3 SuperNodes online in {out['online_s']:.0f} s "
            f"(aarch64 node(s): {sorted(arm) or 'none'})")
        for name, cfg in RUNS.items():
            res = dep.run({**COMMON, **cfg}, name, timeout=3600)
            rows = res.metrics()
            ok = (res.proc.returncode == 0 and [r["round"] for r in rows] == [1, 2]
                  and all(r["participants"] == 3 and not r["dropped"] and not r.get("skipped") for r in rows))
            starts = {i: dep.log(f"supernode{i}.out").count("Start `flwr-clientapp` process") for i in range(3)}
            say(f"[{label}] {name}: rc {res.proc.returncode}, {res.seconds:.0f} s, rounds "
                + ", ".join(f"{r['round']}: {r['participants']} nodes, dropped {r['dropped']}, "
                            f"acc {r['accuracy']:.4f}, {r['round-seconds']:.1f} s" for r in rows)
                + f"; ClientApp processes so far per node {starts}")
            if not ok:
                raise RuntimeError(f"[{label}] {name} did not complete 2 rounds with 3 nodes:\n{res.output[-4000:]}\n"
                                   f"{dep.diagnose()}; logs in {dep.logs}")
            out["runs"][name] = {"folder": str(res.folder), "seconds": res.seconds,
                                 "round_seconds": [r["round-seconds"] for r in rows],
                                 "accuracy": [r["accuracy"] for r in rows]}
        out["clientapps"] = {i: dep.clientapps(i) for i in range(3)}
        out["load"] = os.getloadavg()
    return out


def report(ref: dict[str, Any], mixed: dict[str, Any], probes: dict[str, dict[str, float]], reps: int) -> dict[str, Any]:
    say("\n== ClientApp start-up per message, inside the runs (every flwr-clientapp process of the fedavg and "
        "scala runs; medians, s) ==")
    say(f"{'run, node':30s} {'procs':>5s} {'refused':>7s} {'flwr':>6s} {'pulled':>6s} {'torch':>6s} {'library':>7s} "
        f"{'start-up':>8s} {'train msg':>9s}")
    summary: dict[str, Any] = {}
    for label, res in (("all x86-64", ref), ("mixed", mixed)):
        for i in range(3):
            arch = "aarch64 (qemu)" if label == "mixed" and i == 2 else "x86-64"
            allp = res["clientapps"][i]
            procs = [p for p in allp if "pulled" in p and "torch" in p and "flwr" in p]
            refused = sum(1 for p in allp if p.get("token_failed"))
            col = {k: [p[k] for p in procs] for k in ("flwr", "pulled", "torch")}
            col["library"] = [p["app"] - p["torch"] for p in procs]
            col["start-up"] = [p["flwr"] + p["pulled"] + p["app"] for p in procs]
            col["train msg"] = [p["on_node"] for p in procs if p.get("type") == "train" and "on_node" in p]
            say(f"{label + ', node ' + str(i) + ' ' + arch:30s} {len(procs):5d} {refused:7d} {med(col['flwr'])[1:]} "
                f"{med(col['pulled'])[1:]} {med(col['torch'])[1:]} {med(col['library'])} {med(col['start-up']):>8s} "
                f"{med(col['train msg']):>9s}")
            summary[f"{label}/node{i}"] = {"arch": arch, "procs": len(procs), "refused": refused, **col}
        say(f"  (load average at the end of the {label} runs: {', '.join(f'{x:.1f}' for x in res['load'])} "
            f"on {os.cpu_count()} CPUs)")
    say("  procs: ClientApp processes that ran (one per message; scala's stream session is one); refused: "
        "processes Flower refused because they started after its 30-s task-token window (the node starts "
        "another); flwr: importing flwr-clientapp's entry point; pulled: connecting and pulling the message; "
        "torch: `import torch`; library: the ClientApp module and the handler's lazy imports, torch excluded; "
        "start-up: flwr + pulled + torch + library; train msg: a fedavg train message on the node, "
        "received to reply sent (start-up, dataset, model, 3 local steps).")
    say(f"\n== The start-up step by step, in fresh processes outside Flower (medians of {reps}, s; data cache warm) ==")
    say(f"{'environment':22s} {'import torch':>12s} {'import app':>10s} {'dataset':>8s} {'plan':>6s} {'model':>6s} {'total':>6s}")
    for name, p in probes.items():
        say(f"{name:22s} {p['torch']:12.3f} {p['app']:10.3f} {p['data']:8.3f} {p['plan']:6.3f} {p['model']:6.3f} "
            f"{sum(p.values()):6.3f}")
    say("\n== Rounds (round-seconds) and final weights: mixed run vs the all-x86-64 run, same seed ==")
    for name in RUNS:
        a, b = ref["runs"][name], mixed["runs"][name]
        same, diff, n = compare(Path(a["folder"]) / "model.pt", Path(b["folder"]) / "model.pt")
        say(f"{name:7s} all x86-64: rounds {', '.join(f'{s:.1f}' for s in a['round_seconds'])} s, acc {a['accuracy'][-1]:.4f}"
            f" | mixed: rounds {', '.join(f'{s:.1f}' for s in b['round_seconds'])} s, acc {b['accuracy'][-1]:.4f}"
            f" | weights {'bit-identical' if same else f'differ: max |diff| {diff:.3e} in {n} tensor(s)'}")
        summary[f"weights/{name}"] = {"identical": same, "max_abs_diff": diff, "tensors_differing": n}
    return summary


# a small matrix product against float64: the classifier head's shape (32 x 512 by 512 x 10)
MATMUL_CHECK = r"""
import torch
torch.manual_seed(0)
x, w = torch.randn(32, 512), torch.randn(10, 512) * 0.04
print(f"{(x @ w.T).double().sub(x.double() @ w.double().T).abs().max().item():.2e}")
"""


# ----------------------------------------------------------------------------- main
def interrupted(signum: int, _frame: Any) -> None:
    """SIGTERM as Ctrl-C: unwind, so every process is stopped and every mount undone."""
    raise KeyboardInterrupt(f"signal {signum}")


VERSIONS = r"""
import platform, re, sys, torch, flwr
cfg = torch.__config__.show()
blas = re.search(r"BLAS_INFO=([^,\s]+)", cfg)
cpu = re.search(r"CPU capability usage: (\S+)", cfg)
print(platform.machine(), "Python", sys.version.split()[0], "torch", torch.__version__, "flwr", flwr.__version__,
      "BLAS", blas.group(1) if blas else "?", "CPU capability", cpu.group(1) if cpu else "?")
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/work/arm64-root", help="the arm64 root (built if absent, else reused)")
    ap.add_argument("--torch", default="2.14.1", help="torch version for the aarch64 node (PyPI's aarch64 wheel)")
    ap.add_argument("--torchvision", default="0.29.1")
    ap.add_argument("--probe-reps", type=int, default=2, help="fresh processes per probe (after one warm-up)")
    ap.add_argument("--qemu-cpu", default="neoverse-n1",
                    help="qemu's CPU model for the aarch64 node (QEMU_CPU). neoverse-n1: Armv8.2-A without SVE, "
                         "like a Jetson Orin's Cortex-A78AE. qemu-user's default, max, gives wrong float32 "
                         "matrix products with this torch (see the check the bench prints)")
    ap.add_argument("--out", default="", help="work folder (default: a new temp folder)")
    ap.add_argument("--setup-only", action="store_true", help="build and install the root, then stop")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("needs root (binfmt_misc, debootstrap, chroot, mount)")
    signal.signal(signal.SIGTERM, interrupted)
    work = Path(args.out or tempfile.mkdtemp(prefix="aarch64-supernode-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    root = Arm64Root(Path(args.root), work / "arm64-root.log", args.qemu_cpu)
    root.ensure_emulation()
    root.ensure_built()
    say("arm64 root: " + root.output("uname -m; /usr/bin/python3 --version").replace("\n", ", "))
    root.copy_sources()
    host_env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWER_SSL_DATA_CACHE": str(work / "probe-cache-x86")}
    try:
        root.mount(work)
        cmds = root.install(args.torch, args.torchvision)
        arm = subprocess.run(root.argv(f"{VENV}/bin/python", "-c", VERSIONS), env=root.env(), capture_output=True,
                             text=True, timeout=1800)
        host = subprocess.run([sys.executable, "-c", VERSIONS], capture_output=True, text=True, timeout=600)
        say(f"aarch64 node environment: {(arm.stdout + arm.stderr).strip()} (QEMU_CPU={root.qemu_cpu})")
        say(f"x86-64 environment:       {(host.stdout + host.stderr).strip()}")
        for k, v in root.timings.items():
            say(f"  {k}: {v:.0f} s")
        say("float32 (32x512)@(512x10) against float64, max |error|:")
        host = subprocess.run([sys.executable, "-c", MATMUL_CHECK], capture_output=True, text=True, timeout=600)
        say(f"  x86-64: {(host.stdout + host.stderr).strip()}")
        for cpu in dict.fromkeys([root.qemu_cpu, "max"]):   # max: qemu-user's default CPU model
            res = subprocess.run(root.argv(f"{VENV}/bin/python", "-c", MATMUL_CHECK), env={**root.env(), "QEMU_CPU": cpu},
                                 capture_output=True, text=True, timeout=1800)
            say(f"  aarch64, QEMU_CPU={cpu}: {(res.stdout + res.stderr).strip()[-300:]}")
        if args.setup_only:
            return 0
        say("\naarch64 install commands that ran: " + " && ".join(cmds))
        probes = {
            "x86-64 (native)": probe([sys.executable], host_env, args.probe_reps),
            "aarch64 (qemu-user)": probe(root.argv(f"{VENV}/bin/python"),
                                         root.env({"OMP_NUM_THREADS": "1",
                                                   "FLOWER_SSL_DATA_CACHE": str(work / "probe-cache-arm64")}),
                                         args.probe_reps),
        }
        ref = run_deployment(work / "all-x86", None, (), "all x86-64")
        mixed = run_deployment(work / "mixed", root, (2,), "mixed")
        summary = report(ref, mixed, probes, args.probe_reps)
        (work / "aarch64_supernode.json").write_text(json.dumps(
            {"probes": probes, "ref": ref, "mixed": mixed, "summary": summary}, indent=1, default=str))
    finally:
        failed = root.umount()
        if failed:
            say(f"could not unmount: {failed}")
    say(f"\nbench wall time {time.time() - t_start:.0f} s; logs and raw numbers in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
