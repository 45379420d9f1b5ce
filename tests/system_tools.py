"""System programs some tests need (Debian ``openmpi-bin``, ``mpich``, ``slurm-wlm``, ``munge``, ``pdsh``,
``openssh-server``), for tests only.

Outside CI a missing program skips the test with the package to install; under CI (``CI=true``) it fails, so that
coverage cannot silently shrink (``.ci/run`` installs them first, see ``scripts/system_packages.sh``).
"""

from __future__ import annotations

import os
import shutil

import pytest

PACKAGES = {
    "mpirun": "openmpi-bin",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "scontrol": "slurm-wlm",
    "munged": "munge",
    "mpirun.mpich": "mpich",
    "pdsh": "pdsh",
    "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
    "unshare": "util-linux",
    "hostname": "hostname",
    "nsenter": "util-linux",
    "mount": "mount",
}


def require_programs(*names: str) -> None:
    """Skip (outside CI) or fail (under CI) unless every program in ``names`` is on PATH."""
    missing = [n for n in names if shutil.which(n) is None and shutil.which(n, path="/usr/sbin:/sbin") is None]
    if not missing:
        return
    packages = sorted({PACKAGES.get(n, n) for n in missing})
    reason = f"needs {', '.join(missing)} (apt-get install {' '.join(packages)}; scripts/system_packages.sh)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: {reason}")
    pytest.skip(reason)


def program(name: str) -> str:
    """Absolute path of a required program (also looked up in /usr/sbin, which is not on every user's PATH)."""
    require_programs(name)
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or name
