#!/usr/bin/env bash
# Debian packages the cluster-launch tests need: a real mpirun (openmpi-bin), MPICH's hydra mpirun (mpich, for
# launcher: mvapich), pdsh over a loopback sshd (pdsh, openssh-server), a single-host SLURM (slurm-wlm, munge) and
# the network-namespace cluster of the multi-node tests (iproute2, util-linux).
# Cheap when they are present; installs them with apt-get when run as root (CI), else says what is missing.
set -euo pipefail
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpirun.mpich >/dev/null || missing+=(mpich)
command -v pdsh >/dev/null || missing+=(pdsh)
{ command -v sshd || [ -x /usr/sbin/sshd ]; } >/dev/null || missing+=(openssh-server)
command -v ssh-keygen >/dev/null || missing+=(openssh-client)
{ command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null || missing+=(slurm-wlm)
{ command -v munged || [ -x /usr/sbin/munged ]; } >/dev/null || missing+=(munge)
# the simulated multi-node cluster (tests/netns_cluster.py): ip netns (iproute2), unshare/nsenter (util-linux)
{ command -v ip || [ -x /usr/sbin/ip ]; } >/dev/null || missing+=(iproute2)
{ command -v nsenter && command -v unshare; } >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "[system-packages] missing ${missing[*]}: the cluster-launch tests will skip (install as root to run them)" >&2
    exit 0
fi
echo "[system-packages] installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
