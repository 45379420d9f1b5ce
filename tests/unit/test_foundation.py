"""The installed environment and the subprocess half of the harness."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.harness import PYTHON, DistributedTestError, run_command


def test_megatron_deepspeed_torch_import_and_one_torch() -> None:
    import deepspeed
    import torch

    import megatron

    assert megatron.__version__
    assert deepspeed.__version__.startswith("0.19")
    assert torch.__version__.split("+")[0] == "2.13.0"
    listing = subprocess.run([sys.executable, "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    torch_lines = [line for line in listing.splitlines() if line.split() and line.split()[0].lower() == "torch"]
    assert len(torch_lines) == 1, torch_lines


def test_run_command_kills_the_whole_tree_on_timeout() -> None:
    # A child that starts a grandchild which would outlive it: both must be gone after the timeout.
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out") as info:
        run_command([PYTHON, "-c", script], timeout=3)
    assert time.monotonic() - start < 30
    grandchild = int(str(info.value).split("----- stdout -----\n")[1].split()[0])
    time.sleep(0.5)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_run_command_reports_output_on_failure() -> None:
    with pytest.raises(DistributedTestError, match="exit code 3") as info:
        run_command([PYTHON, "-c", "import sys; print('hello-out'); sys.exit(3)"])
    assert "hello-out" in str(info.value)
