"""Run code on N gloo ranks from pytest.

Two entry points:

* ``run_distributed(fn, world, *args)`` runs ``fn(*args)`` on ``world`` ranks (forked from a preloaded server)
  with an initialised process group and returns every rank's result (``fn`` must live in an importable module).
* ``run_command(cmd)`` / ``run_ranks(cmd, world)`` run CLI programs (``deepy.py``, ``train.py`` …) as
  subprocesses in their own session, so that the whole process tree is killed at the end.

Both use a fresh free MASTER_PORT, ``OMP_NUM_THREADS=1``, a hard timeout, and show every rank's output when
something fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent

BASE_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}


class DistributedTestError(AssertionError):
    """A rank failed, died, or the run timed out; the message holds every rank's output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """Kill a process and all its descendants (children first collected, then killed)."""
    try:  # the process may exit between the two calls: then there is nothing left to collect from it
        parent = psutil.Process(pid)
        procs = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


# ---------------------------------------------------------------------------------------------------------------
# run_distributed: functions on forked ranks


def _rank_main(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    log_dir: str,
    parent: tuple[dict[str, str], str],
) -> None:
    # A forked rank starts with the fork server's environment and directory: take the caller's, as spawn would.
    parent_env, parent_cwd = parent
    os.environ.clear()
    os.environ.update(parent_env)
    os.chdir(parent_cwd)
    env = {
        **BASE_ENV,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "LOCAL_SIZE": str(world),
    }
    os.environ.update(env)
    # Each rank's output goes to its own file, shown by the parent if anything fails.
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    code = 0
    try:
        import torch

        # A spawned child inherits "spawn" as its start method; a launched rank forks its DataLoader workers
        # (Linux's default), and spawning them would re-import torch in every worker.
        mp.set_start_method("fork", force=True)
        torch.set_num_threads(1)
        from megatron.distributed import init_distributed

        init_distributed("gloo")
        # Plain pickle copies tensor data; the queue's own pickler would pass tensors through shared memory that
        # disappears when this rank exits.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:
        traceback.print_exc()
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()  # the queue's feeder thread must flush before os._exit
        from megatron.distributed import shutdown_and_exit

        shutdown_and_exit(code)


def _rank_context() -> Any:
    """Ranks fork from a server that has imported torch, DeepSpeed and the project but never ran a torch op
    (:mod:`tests.rank_preload`); pytest itself is never forked. ``NEOX_TEST_SPAWN=1`` spawns fresh interpreters."""
    if os.environ.get("NEOX_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.rank_preload"])
    return ctx


def _rank_logs(log_dir: str, world: int) -> str:
    parts = []
    for rank in range(world):
        path = Path(log_dir) / f"rank{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else "<no output>"
        parts.append(f"----- rank {rank} -----\n{text[-8000:]}")
    return "\n".join(parts)


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` gloo ranks; return the per-rank results in rank order."""
    ctx = _rank_context()
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="neox-dist-") as log_dir:
        # not daemonic: a rank may start DataLoader workers; the `finally` below kills whatever is left
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, port, fn, args, results, log_dir, (dict(os.environ), os.getcwd())),
                daemon=False,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        collected: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < world:
                if time.monotonic() > deadline:
                    raise DistributedTestError(
                        f"timed out after {timeout}s; finished ranks {sorted(collected)}\n{_rank_logs(log_dir, world)}"
                    )
                try:
                    rank, status, payload = results.get(timeout=0.5)
                except queue.Empty:
                    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and not any(r in collected for r, _ in dead):
                        time.sleep(0.5)  # let a last message arrive before declaring the rank dead
                        if results.empty():
                            raise DistributedTestError(f"rank(s) died: {dead}\n{_rank_logs(log_dir, world)}") from None
                    continue
                if status == "error":
                    raise DistributedTestError(f"rank {rank} failed:\n{payload}\n{_rank_logs(log_dir, world)}")
                collected[rank] = pickle.loads(payload)
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    kill_tree(p.pid)
                    p.join()
    return [collected[r] for r in range(world)]


# ---------------------------------------------------------------------------------------------------------------
# run_command / run_ranks: programs in subprocesses


@dataclass
class CommandResult:
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"exit code {self.returncode}\n----- stdout -----\n{self.stdout[-12000:]}\n----- stderr -----\n{self.stderr[-12000:]}"


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **BASE_ENV, "PYTHONPATH": str(REPO_ROOT)}
    env.update(extra or {})
    return env


def run_command(
    cmd: Sequence[str],
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    check: bool = True,
    input_text: str | None = None,
) -> CommandResult:
    """Run ``cmd`` in its own session; kill the whole tree on timeout. ``check`` asserts exit code 0."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=str(cwd or REPO_ROOT),
        env=subprocess_env(env),
        stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input=input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise DistributedTestError(
            f"command timed out after {timeout}s: {' '.join(cmd)}\n" + CommandResult(-9, out, err).describe()
        ) from None
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    result = CommandResult(proc.returncode, out, err)
    if check and result.returncode != 0:
        raise DistributedTestError(f"command failed: {' '.join(cmd)}\n{result.describe()}")
    return result


def run_ranks(
    cmd: Sequence[str], world: int, *, timeout: float = 300, env: dict[str, str] | None = None
) -> list[CommandResult]:
    """Start ``cmd`` once per rank with RANK/WORLD_SIZE/MASTER_PORT set (as torchrun would) and wait for all."""
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = subprocess_env(env)
        rank_env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            LOCAL_SIZE=str(world),
        )
        procs.append(
            subprocess.Popen(
                list(cmd),
                cwd=str(REPO_ROOT),
                env=rank_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    results: list[CommandResult] = []
    try:
        for p in procs:
            remaining = max(1.0, deadline - time.monotonic())
            try:
                out, err = p.communicate(timeout=remaining)
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_tree(q.pid)
                outputs = [CommandResult(-9, *q.communicate()).describe() for q in procs]
                raise DistributedTestError(f"ranks timed out after {timeout}s\n" + "\n".join(outputs)) from None
            results.append(CommandResult(p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    if any(r.returncode != 0 for r in results):
        report = "\n".join(f"===== rank {i} =====\n{r.describe()}" for i, r in enumerate(results))
        raise DistributedTestError(f"a rank failed: {' '.join(cmd)}\n{report}")
    return results


PYTHON = sys.executable


def load_tool(relative: str) -> ModuleType:
    """Import a CLI script (e.g. ``tools/ckpts/reshard_checkpoint.py``) as a module, to call its ``main(argv)``."""
    import importlib.util

    path = REPO_ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
