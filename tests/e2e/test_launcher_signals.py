"""``python deepy.py train.py`` under the signals, clashes and faults of real operation, each fed through deepy:
SIGTERM to deepy's process group (the ranks save, deepy waits and returns 42, the restart continues exactly), a
double Ctrl-C (stop now), two runs on one ``save`` folder (the second refused, on an ASCII-only console with a
non-ASCII path), a disk filling up during a save (tmpfs, root only), a taken ``master_port`` and ``--plan --json``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

import psutil
import pytest
import yaml

from megatron.checkpoint.manifest import verify_checkpoint
from megatron.training.preemption import REQUEUE_EXIT_CODE
from megatron.training.save_lock import LOCK_NAME
from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import PYTHON, REPO_ROOT, kill_tree, run_command, subprocess_env

pytestmark = pytest.mark.distributed

COMMON = dict(world=2, train_iters=30, eval_iters=0, log_interval=1, zero_optimization={"stage": 1})
LOSS_RE = re.compile(r"^iteration\s+(\d+)/\s*\d+ \|.*lm_loss: ([0-9.E+-]+)", re.M)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _no_leftover_runs() -> Any:
    yield
    for run in Deepy.started:
        for rank in run.ranks():
            with contextlib.suppress(psutil.Error):
                rank.kill()
        kill_tree(run.proc.pid)
    Deepy.started.clear()


def write_config(data: dict[str, str], path: Path, **overrides: Any) -> Path:
    cfg = tiny_config(data, **{**COMMON, **overrides})
    cfg.pop("global_num_gpus", None)
    cfg["num_gpus"] = 2
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    return path


class Deepy:
    """``python deepy.py train.py CONFIG`` in its own process group, output to files."""

    started: ClassVar[list[Deepy]] = []  # killed at the end of each test, whatever happened

    def __init__(self, config: Path, folder: Path, env: dict[str, str] | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.run_dir = folder / "run"
        self.out_path, self.err_path = folder / "stdout.txt", folder / "stderr.txt"
        cmd = [PYTHON, "deepy.py", "train.py", str(config), "--run_dir", str(self.run_dir)]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=subprocess_env(env), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        Deepy.started.append(self)

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace") + self.err_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output, re.M):
            assert self.proc.poll() is None, f"deepy exited {self.proc.returncode} early:\n{self.output[-8000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout}s:\n{self.output[-8000:]}"
            time.sleep(0.02)

    def ranks(self) -> list[psutil.Process]:
        """The train.py processes of this launch (found by their resolved-config path)."""
        marker = str(self.run_dir / "neox_config.json")
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmdline = p.info["cmdline"] or []
            if marker in cmdline and any(a.startswith("--local_rank=") for a in cmdline):
                found.append(p)
        return found

    def signal_group(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 400) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                kill_tree(self.proc.pid)

    def losses(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in LOSS_RE.findall(self.out_path.read_text(errors="replace"))}


def assert_committed(step_dir: Path) -> None:
    """A complete checkpoint: its manifest exists and every file matches it (sizes and sha256)."""
    assert (step_dir / "manifest.json").is_file(), step_dir
    assert verify_checkpoint(step_dir, checksums=True) is None


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has ended: a container's PID 1 may never reap it)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def assert_gone(procs: list[psutil.Process]) -> None:
    alive = _alive(procs)
    assert not alive, f"ranks outlived deepy.py: {[p.pid for p in alive]}"


def test_sigterm_to_process_group_saves_waits_for_ranks_and_resumes_exactly(
    data: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM to the process group of a 2-rank deepy run after a few steps: deepy returns 42 only once the
    checkpoint is committed, no rank outlives it, and the same command resumes with the uninterrupted run's losses."""
    reference = Deepy(write_config(data, tmp_path / "ref.yml"), tmp_path / "ref")
    assert reference.wait() == 0, reference.output[-8000:]
    full = reference.losses()
    assert sorted(full) == list(range(1, 31))

    ck = tmp_path / "ck"
    config = write_config(data, tmp_path / "c.yml", save=str(ck), load=str(ck), checkpoint_factor=1000)
    run = Deepy(config, tmp_path / "run1")
    run.wait_for(r"^iteration\s+3/")
    ranks = run.ranks()
    assert len(ranks) == 2
    run.signal_group(signal.SIGTERM)
    assert run.wait() == REQUEUE_EXIT_CODE, run.output[-8000:]
    # at the moment deepy returned: the checkpoint is committed and every rank has ended
    latest = (ck / "latest").read_text()
    assert_committed(ck / latest)
    assert_gone(ranks)
    stop = int(latest.removeprefix("global_step"))
    assert 3 <= stop < 30 and "training stopped at iteration" in run.output
    assert not (ck / LOCK_NAME).exists()  # the lock was released

    resumed = Deepy(config, tmp_path / "run2")
    assert resumed.wait() == 0, resumed.output[-8000:]
    stitched = {**{i: v for i, v in run.losses().items() if i <= stop}, **resumed.losses()}
    assert min(resumed.losses()) == stop + 1 and sorted(stitched) == list(range(1, 31))
    for i in range(1, 31):
        assert stitched[i] == pytest.approx(full[i], rel=1e-5), (i, stitched[i], full[i])


def test_second_interrupt_stops_now(data: dict[str, str], tmp_path: Path) -> None:
    """Ctrl-C twice (SIGINT to the group, twice within a second): deepy says it stops now, kills the ranks and
    returns 130; no rank survives it, and no partial checkpoint is left."""
    ck = tmp_path / "ck"
    config = write_config(data, tmp_path / "c.yml", train_iters=100000, save=str(ck), checkpoint_factor=10**6)
    run = Deepy(config, tmp_path / "run")
    run.wait_for(r"^iteration\s+2/")
    ranks = run.ranks()
    assert len(ranks) == 2
    run.signal_group(signal.SIGINT)
    time.sleep(0.01)
    run.signal_group(signal.SIGINT)
    assert run.wait(timeout=120) == 128 + signal.SIGINT, run.output[-8000:]
    assert_gone(ranks)
    err = run.err_path.read_text()
    assert "interrupt: asking the ranks to save and stop" in err
    assert "second interrupt: stopping now, killing the ranks" in err
    # The first interrupt asked for a save; a tiny model's save may commit in the moment before the second one
    # lands (seen under load), so what must hold is that nothing half-written is left behind.
    if (ck / "latest").exists():
        assert_committed(ck / (ck / "latest").read_text())


def test_sigkill_of_deepy_takes_the_ranks_along(data: dict[str, str], tmp_path: Path) -> None:
    """SIGKILL to deepy's pid alone (it cannot be relayed): the launch's process group dies with deepy."""
    config = write_config(data, tmp_path / "c.yml", train_iters=100000)
    run = Deepy(config, tmp_path / "run")
    run.wait_for(r"^iteration\s+2/")
    ranks = run.ranks()
    assert len(ranks) == 2
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while _alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert_gone(ranks)


def test_second_run_on_the_same_save_folder_is_refused(data: dict[str, str], tmp_path: Path) -> None:
    """Run A holds the save folder (taking over a stale lock left by a dead process); run B on the same folder is
    refused with one line naming A (host, pid, start) before it writes anything; A then stops and commits its
    checkpoint unharmed. Both print the folder's non-ASCII name on an ASCII-only console without an error."""
    ck = tmp_path / "ckpt-é-中"
    ck.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "process_start": 1.0, "started": "long ago", "run_id": "x"}
    (ck / LOCK_NAME).write_text(json.dumps(stale))
    ascii_console = {"LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
    config = write_config(
        data, tmp_path / "c.yml", train_iters=100000, save=str(ck), load=str(ck), checkpoint_factor=10**6
    )
    first = Deepy(config, tmp_path / "a", ascii_console)
    first.wait_for(r"^iteration\s+1/")
    assert "taking over the lock of a run that is gone" in first.output
    holder = json.loads((ck / LOCK_NAME).read_text())
    before = sorted(p.name for p in ck.iterdir())

    second = Deepy(config, tmp_path / "b", ascii_console)
    code = second.wait()
    assert code != 0 and "Traceback" not in second.output, second.output[-8000:]
    errors = [ln for ln in second.output.splitlines() if "is in use by another run" in ln]
    assert errors, second.output[-8000:]
    assert f"host {holder['host']}, pid {holder['pid']}, started {holder['started']}" in errors[0]
    assert "ckpt-\\xe9-\\u4e2d" in errors[0]  # the non-ASCII folder name, escaped for the ASCII console
    assert sorted(p.name for p in ck.iterdir()) == before  # the refused run wrote nothing

    first.signal_group(signal.SIGTERM)
    assert first.wait() == REQUEUE_EXIT_CODE, first.output[-8000:]
    latest = (ck / "latest").read_text()
    assert_committed(ck / latest)
    assert not (ck / LOCK_NAME).exists()
    for run in (first, second):
        assert "UnicodeEncodeError" not in run.output and "Logging error" not in run.output


def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    data: dict[str, str], tmp_path: Path
) -> None:
    """``save`` on a 3 MiB tmpfs: the first checkpoint fits, the second does not. deepy exits non-zero with one
    error line naming the folder, no traceback, and the first checkpoint stays valid and named by ``latest``."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must run this test as root (it mounts a tmpfs)")
        pytest.skip("needs root to mount a tmpfs")
    ck = tmp_path / "small"
    ck.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(ck)], check=True)
    try:
        save = ck / "ck"
        config = write_config(
            data, tmp_path / "c.yml", train_iters=6, save=str(save), load=str(save), checkpoint_factor=2
        )
        run = Deepy(config, tmp_path / "run")
        code = run.wait()
        assert code not in (0, REQUEUE_EXIT_CODE), run.output[-8000:]
        assert "Traceback" not in run.output, run.output[-8000:]
        errors = [ln for ln in run.output.splitlines() if "cannot write checkpoint global_step4" in ln]
        assert errors and f"save {save}:" in errors[0] and "no space left on device" in errors[0], run.output[-8000:]
        assert (save / "latest").read_text() == "global_step2"
        assert_committed(save / "global_step2")
    finally:
        subprocess.run(["umount", str(ck)], check=False)


def test_master_port_in_use_is_one_line(data: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(data, tmp_path / "c.yml")
        cmd = [
            PYTHON,
            "deepy.py",
            "train.py",
            str(config),
            "--master_port",
            str(port),
            "--run_dir",
            str(tmp_path / "r"),
        ]
        res = run_command(cmd, check=False, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.describe()
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("deepy.py: error:")]
    assert len(lines) == 1 and f"master_port {port} is already in use" in lines[0], res.describe()


@pytest.mark.parametrize("search", [False, True], ids=["plan", "search"])
def test_plan_json_stdout_is_only_json(search: bool) -> None:
    """The planner's ``--json`` goes to machines: stdout parses as JSON, DeepSpeed's log lines go to stderr (run
    without DS_ACCELERATOR, as a user would, so DeepSpeed logs its accelerator choice)."""
    env = {k: v for k, v in subprocess_env().items() if k != "DS_ACCELERATOR"}
    cmd = [PYTHON, "deepy.py", "--plan", "train.py", "configs/20B.yml", "--gpus", "96", "--json"]
    res = subprocess.run(
        cmd + ["--search"] * search, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output: not strict JSON"))
    assert (plan["gpus"] if search else plan["hardware"]["gpus"]) == 96
