"""DeepSpeed's runner (``deepspeed.launcher.runner``) as deepy.py starts it locally, with one-line errors.

Run by file path (``python .../ds_runner.py RUNNER_ARGS...``) so it needs nothing but DeepSpeed: the runner's own
resource errors (a bad include/exclude, no devices) become ``deepy.py: error: launcher: ...`` and exit status 2
instead of a traceback; everything else is the runner's behaviour, exit status included. With ``--node-launch`` first
it runs DeepSpeed's per-node launcher (``deepspeed.launcher.launch``) instead: what the runner's local branch starts,
for a one-node CPU launch whose arguments deepy computed (``megatron/launcher/launch.py``, ``node_launch_argv``).

It leads the process group of the launch (deepy starts it with ``process_group=0``). If deepy itself is killed
(SIGKILL cannot be relayed), Linux's parent-death signal wakes this process, which then kills the whole group: no
rank outlives deepy.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
NODE_LAUNCH = "--node-launch"  # first argument: run DeepSpeed's per-node launcher instead of its runner


def _kill_group(_signum: int = 0, _frame: object = None) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def die_with_parent() -> None:
    """Kill the launch's process group when deepy (the parent) dies; a no-op off Linux."""
    if not sys.platform.startswith("linux") or os.getpgrp() != os.getpid():
        return  # only as the leader of the launch's own process group (as deepy starts it)
    parent = os.getppid()
    signal.signal(signal.SIGUSR2, _kill_group)
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGUSR2)) != 0:
        return
    if os.getppid() != parent:  # deepy died before the request took effect
        _kill_group()


def main(argv: list[str]) -> int:
    """Run DeepSpeed's runner on ``argv`` (or, after :data:`NODE_LAUNCH`, its per-node launcher, as the runner's
    local branch would); returns its exit status."""
    die_with_parent()
    if argv[:1] == [NODE_LAUNCH]:
        sys.argv = ["deepspeed.launcher.launch", *argv[1:]]
        try:
            runpy.run_module("deepspeed.launcher.launch", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0
    from deepspeed.launcher import runner

    try:
        runner.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except (ValueError, RuntimeError) as e:  # bad resources, unreachable hosts
        print(f"deepy.py: error: launcher: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
