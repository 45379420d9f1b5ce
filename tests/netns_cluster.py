"""A simulated cluster of N hosts on this machine, built from Linux network namespaces (``ip netns``), for tests.

Each node is a network namespace with one interface ``eth0`` (10.213.0.1x/24) on a bridge that lives in a namespace
of its own (the "switch"): nodes reach each other over a real network interface, and nothing is added to the
machine's own namespace (no route leaves the cluster). Commands run on a node through ``unshare --mount --uts`` +
``nsenter --net``: like ``ip netns exec`` they see ``/etc/netns/NS/hosts`` bind-mounted over ``/etc/hosts`` (every
node's name and address), and a UTS namespace gives the node its own ``hostname``; daemons started that way (sshd, munged, slurmd) hand both
to everything they start. The filesystem is shared, as on a cluster with a shared filesystem.

Every node runs its own sshd (port 22 of its own address; one user key for all), and on request its own munged
(one key) and slurmd, with slurmctld on the first node. Names are unique per run (``neoxnet-<pid>-<hex>-…``) so a
leftover never collides with the next run, and leftovers of dead runs are removed at the next start. Teardown kills
every process in the namespaces, deletes them (and with them the veth pairs and the bridge) and the
``/etc/netns`` folders, also after a failed test.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.system_tools import program, require_programs

PREFIX = "neoxnet"
SUBNET = "10.213.0"
NETNS_ETC = Path("/etc/netns")
START_TIMEOUT = 60.0


@dataclass(frozen=True)
class Node:
    name: str  # its hostname, also its name in every node's /etc/hosts
    netns: str  # the network namespace
    addr: str  # IPv4 address of its eth0


@dataclass
class NetnsCluster:
    root: Path  # temp folder: keys, daemon configs and logs
    nodes: list[Node]
    switch: str  # namespace holding the bridge
    ssh_key: Path
    slurm_conf: dict[str, Path] = field(default_factory=dict)  # node name -> that node's slurm.conf

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def on(self, name: str) -> list[str]:
        """The argv prefix that runs a command on node ``name`` (its network, /etc/hosts and hostname)."""
        node = self.node(name)
        # Like ``ip netns exec`` (which bind-mounts /etc/netns/NS/hosts over /etc/hosts), but without its fresh
        # /sys mount, which would hide /sys/fs/cgroup from slurmd; plus a UTS namespace of its own for hostname.
        script = 'mount --bind "$2" /etc/hosts && hostname "$0" && ns=$1 && shift 2 && n=$nsenter && unset nsenter && exec "$n" --net="$ns" -- "$@"'
        return [program("unshare"), "--mount", "--uts", "--propagation", "slave", "env", f"nsenter={program('nsenter')}",
                "sh", "-c", script, node.name, f"/run/netns/{node.netns}", str(NETNS_ETC / node.netns / "hosts")]  # fmt: skip

    @property
    def ssh_args(self) -> str:
        """ssh options for logging in to any node as root (the cluster's key, no known-hosts file)."""
        return (
            f"-i {self.ssh_key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
            "-o BatchMode=yes -o ConnectTimeout=10"
        )

    @property
    def env(self) -> dict[str, str]:
        """Variables pdsh (ssh), Open MPI (its ssh agent) and SLURM clients need on the first node."""
        env = {
            "PDSH_SSH_ARGS_APPEND": self.ssh_args,
            "OMPI_MCA_plm_rsh_args": self.ssh_args,
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        }
        if self.slurm_conf:
            env["SLURM_CONF"] = str(self.slurm_conf[self.nodes[0].name])
        return env

    def pids(self, name: str) -> list[int]:
        """Every process whose network namespace is node ``name``'s."""
        out = subprocess.run(
            [program("ip"), "netns", "pids", self.node(name).netns], capture_output=True, text=True, timeout=30
        ).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, name: str) -> None:
        """The node dies: every process in its namespace (ranks, sshd, munged, slurmd) is killed at once."""
        for _ in range(5):  # a process may fork while we kill
            pids = self.pids(name)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*/*.log")):
            lines = path.read_text(errors="replace").splitlines()[-40:]
            parts.append(f"\n----- {path.relative_to(self.root)} (tail) -----\n" + "\n".join(lines))
        return "".join(parts)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([program("ip"), *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _remove_namespace(ns: str) -> None:
    """Kill what runs in ``ns``, delete it and its /etc/netns folder (both may already be gone)."""
    for _ in range(5):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def _sweep_dead_runs() -> None:
    """Remove the namespaces of earlier runs whose test process is gone (a killed pytest cannot clean up)."""
    for ns in _namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-[0-9a-f]+-\w+", ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _remove_namespace(ns)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*"):
        m = re.match(rf"{PREFIX}-(\d+)-", folder.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def require_netns() -> None:
    """Skip (outside CI) or fail (under CI) unless this process can build network namespaces (root, iproute2)."""
    require_programs("ip", "unshare", "nsenter", "mount", "hostname", "sshd", "ssh-keygen")
    reason = ""
    if os.geteuid() != 0:
        reason = "the simulated cluster needs root (ip netns add)"
    else:
        probe = f"{PREFIX}-{os.getpid()}-probe-{secrets.token_hex(3)}"
        res = _ip("netns", "add", probe, check=False)
        if res.returncode != 0:
            reason = f"ip netns add failed: {res.stderr.strip()} (the kernel or the container refuses namespaces)"
        _ip("netns", "del", probe, check=False)
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {reason}")
        pytest.skip(reason)


def _start_sshd(cluster: NetnsCluster, node: Node, host_key: Path) -> None:
    folder = cluster.root / node.name
    conf = folder / "sshd_config"
    conf.write_text(
        f"Port 22\nListenAddress {node.addr}\nHostKey {host_key}\nPidFile {folder / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {cluster.root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nUsePAM no\nStrictModes no\nMaxStartups 100\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    subprocess.run([*cluster.on(node.name), program("sshd"), "-f", str(conf), "-E", str(folder / "sshd.log")],
                   check=True, timeout=30)  # fmt: skip


def _wait_ssh(cluster: NetnsCluster) -> None:
    """Every node logs in to every node (also checks names, addresses and hostnames)."""
    first = cluster.nodes[0].name
    deadline = time.monotonic() + START_TIMEOUT
    for node in cluster.nodes:
        while True:
            res = subprocess.run(
                [*cluster.on(first), "ssh", *cluster.ssh_args.split(), node.name, "hostname"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if res.returncode == 0 and res.stdout.strip() == node.name:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ssh {first} -> {node.name} failed: {res.stdout}{res.stderr}{cluster.logs()}")
            time.sleep(0.5)


@contextlib.contextmanager
def netns_cluster(count: int = 2, *, slurm: bool = False) -> Iterator[NetnsCluster]:
    """Start ``count`` nodes (``node1`` … ``nodeN``) with sshd, and with ``slurm`` munged + slurmd on each and
    slurmctld on node1; tear everything down at exit."""
    require_netns()
    if slurm:
        require_programs("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
    _sweep_dead_runs()
    tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
    root = Path(tempfile.mkdtemp(prefix=f"{tag}-"))  # short: munge's socket path must fit sun_path
    nodes = [Node(f"node{i}", f"{tag}-node{i}", f"{SUBNET}.{10 + i}") for i in range(1, count + 1)]
    switch = f"{tag}-switch"
    cluster = NetnsCluster(root, nodes, switch, root / "user_key")
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip("-n", switch, "link", "set", "lo", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in nodes)
        for i, node in enumerate(nodes, start=1):
            _ip("netns", "add", node.netns)
            (NETNS_ETC / node.netns).mkdir(parents=True)
            (NETNS_ETC / node.netns / "hosts").write_text(hosts)
            # both ends created inside the namespaces: the machine's own namespace never sees them
            _ip("-n", switch, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
            (root / node.name).mkdir()
        keygen = program("ssh-keygen")
        for name in ("host_key", "user_key"):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True, timeout=30)
        shutil.copy(root / "user_key.pub", root / "authorized_keys")
        for node in nodes:
            _start_sshd(cluster, node, root / "host_key")
        _wait_ssh(cluster)
        if slurm:
            from tests.netns_slurm import start_slurm

            start_slurm(cluster)
        yield cluster
    finally:
        for ns in [*(n.netns for n in nodes), switch]:
            _remove_namespace(ns)
        shutil.rmtree(root, ignore_errors=True)


def run_on(cluster: NetnsCluster, name: str, cmd: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
    """Start ``cmd`` on node ``name`` (in its own session, output piped)."""
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [*cluster.on(name), *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, **kwargs,
    )  # fmt: skip
