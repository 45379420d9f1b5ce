"""SIGTERM to ``deepy.py``'s process group through every launcher, at the moments that matter: while the ranks start
(their interpreters exist, their process group does not) and mid-training (a checkpoint is saved after every step, so
the signal usually lands in a save). deepy must return 42 with the stop iteration committed, or, with nothing to save
yet, 143 with one line saying so; no process of the launch may outlive it.

Launchers on this host: DeepSpeed's runner (local), Open MPI's mpirun (``launcher: openmpi``), MPICH's hydra
(``launcher: mvapich``), pdsh over a loopback sshd, and srun on a single-host SLURM (``launcher: slurm``); and pdsh
and mpirun across the two nodes of the simulated cluster (``tests/netns_cluster.py``), where the signal must cross an
ssh connection to reach node2's ranks."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from megatron.launcher.exit_reports import ExitReports
from megatron.launcher.signal_ranks import catches
from megatron.training.preemption import REQUEUE_EXIT_CODE
from megatron.training.save_lock import LOCK_NAME
from megatron.training.startup_signals import STOPPED_EXIT_CODE
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.e2e.test_launcher_signals import assert_committed
from tests.harness import PYTHON, REPO_ROOT, free_port, kill_tree, subprocess_env
from tests.system_tools import program

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LAUNCH_TIMEOUT = 300  # seconds for one whole launch on a loaded 2-core machine
STOP_BOUND = 60  # seconds from the signal to deepy's exit when nothing is to be saved


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@dataclass
class Launcher:
    """How deepy starts the ranks here: config keys, hostfile text, environment."""

    keys: dict[str, Any]
    hosts: str | None  # hostfile text (None: local launch)
    env: dict[str, str]


@contextlib.contextmanager
def launcher(name: str, tmp_path: Path) -> Iterator[Launcher]:
    """The launcher ``name`` set up on this host (skips, or fails under CI, when its programs are missing)."""
    if name == "local":
        yield Launcher({"num_gpus": 2}, None, {})
    elif name == "openmpi":
        program("mpirun")
        ompi = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        yield Launcher({"launcher": "openmpi", "deepspeed_mpi": True, "force_multi": True}, "localhost slots=2\n", ompi)
    elif name == "mvapich":
        hydra = program("mpirun.mpich")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "mpirun").write_text(f'#!/bin/sh\nexec {shlex.quote(hydra)} "$@"\n')  # deepy runs `mpirun`
        (bin_dir / "mpirun").chmod(0o755)
        keys = {"launcher": "mvapich", "deepspeed_mpi": True, "force_multi": True}
        yield Launcher(keys, "localhost slots=2\n", {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    elif name == "pdsh":
        from tests.ssh_server import loopback_sshd

        with loopback_sshd() as ssh_env:
            yield Launcher({"launcher": "pdsh", "force_multi": True}, "localhost slots=2\n", ssh_env)
    else:
        from tests.slurm_cluster import single_host_slurm

        with single_host_slurm() as cluster:
            keys = {"launcher": "slurm", "deepspeed_slurm": True}
            yield Launcher(keys, f"{cluster.node} slots=2\n", cluster.env)


class Run:
    """``python deepy.py train.py CONFIG [--hostfile H]`` in its own process group; output to a file."""

    def __init__(
        self, setup: Launcher, data: dict[str, str], folder: Path, prefix: tuple[str, ...] = (), **overrides: Any
    ) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        cfg = tiny_config(data, world=2, eval_iters=0, log_interval=1, **overrides)
        cfg.pop("global_num_gpus")
        cfg.update(master_port=free_port(), **setup.keys)
        config = folder / "c.yml"
        config.write_text(yaml.safe_dump(cfg))
        self.run_dir = folder / "run"
        cmd = [*prefix, PYTHON, "deepy.py", "train.py", str(config), "--run_dir", str(self.run_dir)]
        if setup.hosts is not None:
            (folder / "hosts").write_text(setup.hosts)
            cmd += ["--hostfile", str(folder / "hosts")]
        self.log = folder / "out.txt"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=subprocess_env(setup.env), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.seen: dict[int, psutil.Process] = {}  # every process of the launch seen (ranks and launchers)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def ranks(self) -> list[psutil.Process]:
        """This run's rank processes (``train.py … --neox_config <run>/neox_config.json``), recorded in ``seen``."""
        marker = str(self.run_dir / "neox_config.json")
        found = []
        for p in psutil.process_iter(["cmdline"]):
            args = p.info["cmdline"] or []
            if marker in args:
                self.seen.setdefault(p.pid, p)
                rank = os.path.basename(args[0]).startswith("python") and "train.py" in args
                if rank and "deepspeed.launcher.launch" not in args:
                    found.append(p)
        return found

    def wait_until(self, ready: Any, what: str, timeout: float = LAUNCH_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, (
                f"deepy exited {self.proc.returncode} before {what}:\n{self.output[-6000:]}"
            )
            assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{self.output[-6000:]}"
            time.sleep(0.02)

    def stop(self, timeout: float = LAUNCH_TIMEOUT) -> tuple[int, float]:
        """SIGTERM to deepy's process group; (deepy's exit status, seconds it took)."""
        self.ranks()
        start = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                kill_tree(self.proc.pid)
        return code, time.monotonic() - start

    def leftovers(self) -> list[int]:
        """Processes of the launch still running a few seconds after deepy returned (zombies have ended)."""
        deadline = time.monotonic() + 5
        while True:
            alive = []
            for p in [*self.seen.values(), *self.ranks()]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(p.pid)
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def cleanup(self) -> None:
        for p in [*self.seen.values(), *self.ranks()]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        kill_tree(self.proc.pid)

    def stop_when(
        self, ready: Any, what: str, timeout: float = LAUNCH_TIMEOUT, stop_timeout: float = LAUNCH_TIMEOUT
    ) -> tuple[int, float, list[int]]:
        """Wait until ``ready()``, SIGTERM deepy's process group: (deepy's exit status, seconds it took, processes of
        the launch left); whatever happens, nothing of the launch is left running afterwards."""
        try:
            self.wait_until(ready, what, timeout)
            code, took = self.stop(stop_timeout)
            return code, took, self.leftovers()
        finally:
            self.cleanup()


LAUNCHERS = ["local", "openmpi", "mvapich", "pdsh", "slurm"]


def _started(run: Run) -> bool:
    """Both ranks exist and run train.py's own code (a stop handler is installed, or 3 s passed since they appeared:
    without the start-up handlers they never catch SIGTERM before training)."""
    ranks = run.ranks()
    if len(ranks) < 2:
        return False
    first = min(r.create_time() for r in ranks)
    return all(catches(r.pid, signal.SIGTERM) or catches(r.pid, signal.SIGUSR1) for r in ranks) or (
        time.time() - first > 3
    )


def _iteration_3(run: Run) -> bool:
    return re.search(r"^(\S+: )?iteration\s+3/", run.output, re.M) is not None


def _saved_at_one_step(ck: Path, out: str) -> int:
    """Asserts that the ``latest`` step is committed and that the ranks said they saved that step and no other;
    returns the step."""
    latest = (ck / "latest").read_text()
    assert_committed(ck / latest)
    stop = int(latest.removeprefix("global_step"))
    saved = set(re.findall(r"saving at iteration (\d+) and exiting with requeue exit code 42", out))
    assert saved == {str(stop)}, out[-6000:]
    return stop


@pytest.mark.parametrize("name", LAUNCHERS)
def test_sigterm_while_the_ranks_start_stops_them_with_one_line(name: str, data: dict[str, str], tmp_path: Path):
    """The signal reaches the ranks before their process group exists: no traceback, no stray status (it was 241
    locally), one line from deepy and status 143, promptly; no process of the launch is left."""
    with launcher(name, tmp_path) as setup:
        run = Run(setup, data, tmp_path / "a", train_iters=1000, save=str(tmp_path / "ck"), checkpoint_factor=1000)
        code, took, left = run.stop_when(lambda: _started(run), "rank processes", stop_timeout=STOP_BOUND * 2)
    out = run.output
    assert code == STOPPED_EXIT_CODE, f"{name}: exit {code}\n{out[-6000:]}"
    assert took < STOP_BOUND, (took, out[-4000:])
    lines = [ln for ln in out.splitlines() if "stopped before the first training step: nothing to save" in ln]
    assert len(lines) == 1 and lines[0].startswith("deepy.py: "), out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    assert not (tmp_path / "ck" / "latest").exists()  # nothing trained: nothing saved
    # a rank that caught the signal reported 143; one ended by it before train.py ran could not report
    assert set(ExitReports(str(run.run_dir), 2).codes().values()) <= {STOPPED_EXIT_CODE}, out[-6000:]
    assert not left, f"{name}: processes outlived deepy: {left}"


@pytest.mark.parametrize("name", LAUNCHERS)
def test_sigterm_mid_training_saves_and_returns_42(name: str, data: dict[str, str], tmp_path: Path):
    """SIGTERM after step 3, with a checkpoint saved after every step (the signal often lands in one): every rank
    stops at the same step, that step is committed, deepy returns 42 and no process of the launch is left."""
    ck = tmp_path / "ck"
    with launcher(name, tmp_path) as setup:
        run = Run(setup, data, tmp_path / "a", train_iters=100000, save=str(ck), load=str(ck), checkpoint_factor=1)
        code, _, left = run.stop_when(lambda: _iteration_3(run), "iteration 3")
    out = run.output
    assert code == REQUEUE_EXIT_CODE, f"{name}: exit {code}\n{out[-6000:]}"
    # every rank reported its own status into the run folder (deepy's check of a launcher's 0: hydra's, at times)
    assert ExitReports(str(run.run_dir), 2).codes() == {"rank-0": 42, "rank-1": 42}, out[-6000:]
    assert _saved_at_one_step(ck, out) >= 3, out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    assert not left, f"{name}: processes outlived deepy: {left}"
    assert not (ck / LOCK_NAME).exists(), f"{name}: the save lock was left behind"  # rank 0 was not cut short


def test_sigterm_before_the_launch_starts_nothing(data: dict[str, str], tmp_path: Path):
    """A signal while deepy itself still reads the configs: nothing is started, one line, status 143."""
    with launcher("local", tmp_path) as setup:
        run = Run(setup, data, tmp_path / "a", train_iters=1000)
        # deepy's handlers are installed (before it reads the configs); without them SIGTERM's default action would
        # end it with 143 as well, but without the line
        code, took, left = run.stop_when(
            lambda: catches(run.proc.pid, signal.SIGTERM), "deepy's handlers", timeout=60, stop_timeout=STOP_BOUND
        )
    assert code == STOPPED_EXIT_CODE, run.output[-4000:]
    lines = [ln for ln in run.output.splitlines() if "before the launch: no rank was started, nothing to save" in ln]
    assert len(lines) == 1 and lines[0].startswith("deepy.py: SIGTERM"), run.output[-4000:]
    assert not run.run_dir.exists()  # nothing was written either
    assert "Traceback" not in run.output and not left and took < STOP_BOUND


@pytest.mark.parametrize("name", ["pdsh", "openmpi"])
def test_sigterm_mid_training_across_two_nodes(name: str, data: dict[str, str], tmp_path: Path):
    """deepy on node1, one rank on each of node1 and node2: SIGTERM after step 3 reaches node2's rank too (pdsh: the
    relay over ssh; mpirun: SIGUSR1 through its daemon on node2); both save the same step, deepy returns 42."""
    from tests.netns_cluster import netns_cluster, require_netns

    require_netns()
    ck = tmp_path / "ck"
    keys = {"launcher": name, "deepspeed_mpi": name == "openmpi"}
    with netns_cluster(2) as cluster:
        setup = Launcher(keys, "node1 slots=1\nnode2 slots=1\n", cluster.env)
        on = tuple(cluster.on("node1"))
        run = Run(setup, data, tmp_path / "a", on, train_iters=100000, save=str(ck), load=str(ck), checkpoint_factor=1)
        code, _, left = run.stop_when(lambda: _iteration_3(run), "iteration 3")
    out = run.output
    assert code == REQUEUE_EXIT_CODE, f"{name}: exit {code}\n{out[-6000:]}"
    _saved_at_one_step(ck, out)
    assert "Traceback" not in out and not left, (left, out[-6000:])
    # node2's rank reported into the run folder too (the folder the ranks read their config from)
    assert ExitReports(str(run.run_dir), 2).codes() == {"rank-0": 42, "rank-1": 42}, out[-6000:]


def test_sigterm_after_the_group_formed_before_the_first_step(data: dict[str, str], tmp_path: Path):
    """Locally, SIGTERM once the ranks' process group exists (model, data and engine still being built): the ranks
    agree on it in one all-reduce before the first step and end with 143 without a save (or, when the first step had
    begun, save it and end with 42)."""
    ck = tmp_path / "ck"
    with launcher("local", tmp_path) as setup:
        run = Run(setup, data, tmp_path / "a", train_iters=1000, save=str(ck), checkpoint_factor=1000)
        code, took, left = run.stop_when(lambda: "model parallel initialised" in run.output, "the process group")
    out = run.output
    assert code in (STOPPED_EXIT_CODE, REQUEUE_EXIT_CODE), out[-6000:]
    if code == STOPPED_EXIT_CODE:
        assert "a preemption signal before the first training step: nothing to save" in out, out[-6000:]
        assert out.count("deepy.py: stopped before the first training step") == 1 and not (ck / "latest").exists()
    else:
        assert_committed(ck / (ck / "latest").read_text())
    assert "Traceback" not in out and not left and took < STOP_BOUND, (left, took, out[-6000:])
