"""A real single-host SLURM cluster for tests: munged, slurmctld and slurmd on loopback, everything in a temp dir.

The slurm.conf is cgroup-free (proctrack/linuxproc, task/none) so it runs in a container. Daemons run as root
(slurmd must, to start job steps); outside CI a non-root run skips. Every daemon started here is stopped at exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import free_port, kill_tree
from tests.system_tools import program, require_programs

START_TIMEOUT = 30.0


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str

    @property
    def env(self) -> dict[str, str]:
        """Variables a client (sbatch, squeue, scancel) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 30) -> str:
        """Run a SLURM client command against this cluster; returns stdout, raises with stderr on failure."""
        res = subprocess.run(
            [program(cmd[0]), *cmd[1:]],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr}{self.logs()}")
        return res.stdout

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"\n----- {name} (tail) -----\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "".join(parts)


# slurm.conf settings that run without cgroups or accounting (in a container, or in network namespaces)
CONTAINER_SETTINGS = {
    "ProctrackType": "proctrack/linuxproc",
    "TaskPlugin": "task/none",
    "JobAcctGatherType": "jobacct_gather/none",
    "AccountingStorageType": "accounting_storage/none",
    "JobCompType": "jobcomp/none",
    "SwitchType": "switch/none",
    "MpiDefault": "none",
    "SelectType": "select/cons_tres",
    "SelectTypeParameters": "CR_CPU",
    "ReturnToService": "2",
    "SlurmdParameters": "config_overrides",
    "KillWait": "5",
}


def _conf(root: Path, node: str, munge_socket: Path) -> str:
    cpus = max(2, os.cpu_count() or 2)
    lines = {
        "ClusterName": "neoxtest",
        "SlurmctldHost": f"{node}(127.0.0.1)",
        "SlurmctldPort": str(free_port()),
        "SlurmdPort": str(free_port()),
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={munge_socket}",
        "CredType": "cred/munge",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "StateSaveLocation": str(root / "state"),
        "SlurmdSpoolDir": str(root / "spool"),
        "SlurmctldPidFile": str(root / "slurmctld.pid"),
        "SlurmdPidFile": str(root / "slurmd.pid"),
        "SlurmctldLogFile": str(root / "slurmctld.log"),
        "SlurmdLogFile": str(root / "slurmd.log"),
        **CONTAINER_SETTINGS,
    }
    text = "".join(f"{k}={v}\n" for k, v in lines.items())
    text += f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"
    text += f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n"
    return text


def _stop(pid_file: Path) -> None:
    """Kill a daemon this fixture started that is still running after ``scontrol shutdown``."""
    import psutil

    with contextlib.suppress(FileNotFoundError, ValueError, psutil.NoSuchProcess):
        pid = int(pid_file.read_text().strip())
        if any(n in psutil.Process(pid).name() for n in ("slurm", "munge")):
            kill_tree(pid)


def job_steps(conf: Path) -> list[int]:
    """The pids of the ``slurmstepd`` processes of the cluster configured by ``conf``. slurmd daemonises them, so they
    are not in its process tree; they carry the cluster's ``SLURM_CONF`` in their environment, read raw: slurmstepd
    retitles itself over the start of that memory (psutil's ``environ()`` then parses nothing)."""
    import psutil

    mark = f"SLURM_CONF={conf}".encode()
    pids = []
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] != "slurmstepd":
            continue
        with contextlib.suppress(OSError):
            if mark in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0"):
                pids.append(proc.pid)
    return pids


@contextlib.contextmanager
def single_host_slurm() -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd for this host; stop them (and any job) at exit."""
    require_programs("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI: the single-host SLURM test must run as root (slurmd starts job steps)")
        pytest.skip("single-host SLURM needs root (slurmd starts job steps as the submitting user)")
    root = Path(tempfile.mkdtemp(prefix="neox-slurm-"))  # short: the munge socket path must fit sun_path
    node = socket.gethostname().split(".")[0]
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o700)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    key = munge_dir / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    sock = munge_dir / "munge.sock"
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, node, sock))
    cluster = SlurmCluster(root, conf, node)
    env = {**os.environ, **cluster.env}
    try:
        subprocess.run(
            [program("munged"), "--force", f"--key-file={key}", f"--socket={sock}", f"--pid-file={munge_dir}/pid",
             f"--log-file={munge_dir}/log", f"--seed-file={munge_dir}/seed"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        subprocess.run([program("slurmctld"), "-c", "-f", str(conf)], check=True, env=env, timeout=30)
        subprocess.run([program("slurmd"), "-c", "-N", node, "-f", str(conf)], check=True, env=env, timeout=30)
        deadline = time.monotonic() + START_TIMEOUT
        state = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                state = cluster.run("sinfo", "-h", "-N", "-o", "%T", timeout=10).strip()
                if state in ("idle", "mixed", "allocated"):
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"slurmd did not come up (node state {state!r}){cluster.logs()}")
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.run("scancel", "--full", "--user", "root", timeout=10)
        with contextlib.suppress(Exception):
            cluster.run("scontrol", "shutdown", timeout=10)
        time.sleep(0.5)
        for pid_file in (root / "slurmd.pid", root / "slurmctld.pid", munge_dir / "pid"):
            _stop(pid_file)
        for pid in job_steps(conf):  # missed by slurmd's process tree
            kill_tree(pid)
        shutil.rmtree(root, ignore_errors=True)
