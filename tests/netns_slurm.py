"""SLURM on the simulated cluster (tests/netns_cluster.py): munged and slurmd on every node, slurmctld on node1.

As in tests/slurm_cluster.py the slurm.conf is cgroup-free (proctrack/linuxproc, task/none). Every node has its own
munged (one shared key, as on a real cluster) with its socket in its own folder, hence its own slurm.conf that
differs only in ``AuthInfo``; SLURM's usual ports suffice because every node has its own network stack. The daemons
live in the nodes' namespaces and die with them (``NetnsCluster.kill_node``, teardown).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

from tests.netns_cluster import START_TIMEOUT, NetnsCluster
from tests.slurm_cluster import CONTAINER_SETTINGS
from tests.system_tools import program


def _conf(cluster: NetnsCluster, munge_socket: str) -> str:
    head = cluster.nodes[0]
    root = cluster.root
    lines = {
        "ClusterName": "neoxnet",
        "SlurmctldHost": f"{head.name}({head.addr})",
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={munge_socket}",
        "CredType": "cred/munge",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "StateSaveLocation": str(root / "state"),
        "SlurmdSpoolDir": str(root / "%n" / "spool"),
        "SlurmctldPidFile": str(root / head.name / "slurmctld.pid"),
        "SlurmdPidFile": str(root / "%n" / "slurmd.pid"),
        "SlurmctldLogFile": str(root / head.name / "slurmctld.log"),
        "SlurmdLogFile": str(root / "%n" / "slurmd.log"),
        **CONTAINER_SETTINGS,
        "SlurmdTimeout": "20",  # a dead node is marked DOWN after this long
        "DebugFlags": "NO_CONF_HASH",  # the confs differ in the munge socket only
    }
    text = "".join(f"{k}={v}\n" for k, v in lines.items())
    names = ",".join(n.name for n in cluster.nodes)
    for node in cluster.nodes:
        text += f"NodeName={node.name} NodeAddr={node.addr} CPUs=2 RealMemory=1000 State=UNKNOWN\n"
    text += f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n"
    return text


def start_slurm(cluster: NetnsCluster) -> None:
    """munged + slurmd on every node, slurmctld on node1; returns once every node is idle."""
    root = cluster.root
    (root / "state").mkdir()
    key = root / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    for node in cluster.nodes:
        folder = root / node.name
        (folder / "spool").mkdir()
        munge = folder / "munge"
        munge.mkdir(mode=0o700)
        sock = munge / "munge.sock"
        conf = folder / "slurm.conf"
        conf.write_text(_conf(cluster, str(sock)))
        cluster.slurm_conf[node.name] = conf
        subprocess.run(
            [*cluster.on(node.name), program("munged"), "--force", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={munge}/pid", f"--log-file={folder}/munged.log", f"--seed-file={munge}/seed"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
    head = cluster.nodes[0].name
    env = {**os.environ, "SLURM_CONF": str(cluster.slurm_conf[head])}
    subprocess.run([*cluster.on(head), program("slurmctld"), "-c", "-f", str(cluster.slurm_conf[head])],
                   check=True, env=env, timeout=30)  # fmt: skip
    for node in cluster.nodes:
        conf = str(cluster.slurm_conf[node.name])
        subprocess.run([*cluster.on(node.name), program("slurmd"), "-c", "-N", node.name, "-f", conf],
                       check=True, env={**os.environ, "SLURM_CONF": conf}, timeout=30)  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT
    states = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            res = subprocess.run([*cluster.on(head), program("sinfo"), "-h", "-N", "-o", "%N %T"],
                                 capture_output=True, text=True, env=env, timeout=30)  # fmt: skip
            states = res.stdout.strip()
            lines = states.splitlines()
            if res.returncode == 0 and len(lines) == len(cluster.nodes) and all(" idle" in ln for ln in lines):
                return
        time.sleep(0.5)
    raise RuntimeError(f"SLURM did not come up (sinfo: {states!r}){cluster.logs()}")
