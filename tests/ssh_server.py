"""A real sshd on loopback for tests (pdsh's remote shell), with its own host and user keys in a temp dir.

Only key login to 127.0.0.1 on a free port; ssh clients are pointed at it through ``PDSH_SSH_ARGS_APPEND`` (port,
key, no known-hosts file), so nothing in ~/.ssh or /etc/ssh is read or changed. The daemon is stopped at exit.
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
from pathlib import Path

import pytest

from tests.harness import free_port, kill_tree
from tests.system_tools import program


@contextlib.contextmanager
def loopback_sshd() -> Iterator[dict[str, str]]:
    """Start sshd on 127.0.0.1; yields the environment a pdsh/ssh client needs to log in as this user."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI: the pdsh test runs sshd as root")
        pytest.skip("the loopback sshd needs root (it logs this user in)")
    sshd, keygen = program("sshd"), program("ssh-keygen")
    program("pdsh")
    root = Path(tempfile.mkdtemp(prefix="neox-ssh-"))
    port = free_port()
    try:
        for name in ("host_key", "user_key"):
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True, timeout=30)
        shutil.copy(root / "user_key.pub", root / "authorized_keys")
        (root / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\nPidFile {root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {root / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nUsePAM no\nStrictModes no\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        subprocess.run([sshd, "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log")], check=True, timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"sshd did not listen on {port}: {(root / 'sshd.log').read_text()}")
        ssh_args = f"-p {port} -i {root / 'user_key'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
        yield {"PDSH_SSH_ARGS_APPEND": f"{ssh_args} -o LogLevel=ERROR"}
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError):
            kill_tree(int((root / "sshd.pid").read_text().strip()))
        shutil.rmtree(root, ignore_errors=True)
