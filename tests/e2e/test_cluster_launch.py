"""Real cluster launches of the same tiny 2-rank training: DeepSpeed's runner (deepy.py, the reference), torchrun,
OpenMPI's mpirun with ``deepspeed_mpi``, and a real single-host SLURM (slurmctld + slurmd on loopback) running
``tools/slurm/train.sbatch`` with ``launcher: slurm`` / ``deepspeed_slurm``. Every launch must give the reference's
first losses exactly."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import PYTHON, REPO_ROOT, free_port, run_command
from tests.system_tools import program

pytestmark = pytest.mark.distributed
ITERS = 3
LOGS = {".txt", ".json", ".yml", ".out"}
LOSS_LINE = re.compile(rf"^iteration\s+(\d+)/\s*{ITERS} \|.*lm_loss: ([0-9.E+-]+)", re.MULTILINE)


def losses(text: str) -> list[str]:
    return [m.group(2) for m in LOSS_LINE.finditer(text)]


def write_config(path: Path, data: dict[str, str], **overrides: Any) -> Path:
    cfg = tiny_config(data, world=2, train_iters=ITERS, log_interval=1, eval_interval=100, eval_iters=0)
    cfg.pop("global_num_gpus")  # every launch derives the world size from its own launcher
    cfg.update(num_gpus=2, master_port=free_port(), **overrides)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Any]:
    """Tiny data, and the reference run: ``deepy.py train.py`` through DeepSpeed's runner on 2 CPU ranks."""
    root = tmp_path_factory.mktemp("cluster")
    data = make_tiny_data(root / "data")
    config = write_config(root / "reference.yml", data)
    out = run_command([PYTHON, "deepy.py", "train.py", str(config)], timeout=600).stdout
    reference = losses(out)
    assert len(reference) == ITERS, out
    return {"root": root, "data": data, "reference": reference}


def test_torchrun_two_ranks_match_deepspeed_runner(setup, tmp_path):
    config = write_config(tmp_path / "torchrun.yml", setup["data"])
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", str(config)]
    out = run_command(cmd, timeout=600).stdout
    assert "ranks from launcher: world size 2" in out
    assert losses(out) == setup["reference"]


def test_mpirun_two_ranks_with_deepspeed_mpi_match_deepspeed_runner(setup, tmp_path):
    mpirun = program("mpirun")
    config = write_config(tmp_path / "mpi.yml", setup["data"], deepspeed_mpi=True)
    cmd = [mpirun, "-np", "2", "--allow-run-as-root", "--oversubscribe", PYTHON, "train.py", str(config)]
    out = run_command(cmd, timeout=600).stdout
    assert "ranks from openmpi: world size 2, master 127.0.0.1" in out
    assert losses(out) == setup["reference"]


def test_deepy_openmpi_launcher_runs_mpirun_with_names_only(setup, tmp_path):
    """deepy.py's own mpirun command (launcher: openmpi, hostfile with include) starts the ranks; the HF token
    reaches them through ``-x HF_TOKEN`` (a name) and appears in no output or run-folder file."""
    program("mpirun")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nunused-node slots=2\n")
    config = write_config(
        tmp_path / "ompi.yml", setup["data"], launcher="openmpi", deepspeed_mpi=True, include="localhost"
    )
    secret = "hf_secret_token_for_the_mpirun_test_77"
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "HF_TOKEN": secret}
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "deepy.py", "train.py", str(config), "--hostfile", str(hostfile), "--run_dir", str(run_dir)]
    res = run_command(cmd, timeout=600, env=env)
    out = res.stdout + res.stderr
    assert "ranks from openmpi: world size 2, master localhost" in out
    assert losses(out) == setup["reference"]
    mpirun = shlex.split(next(ln for ln in res.stdout.splitlines() if ln.startswith("mpirun ")))
    assert mpirun[:4] == ["mpirun", "-n", "2", "-hostfile"] and "HF_TOKEN" in mpirun
    assert (run_dir / "hostfile.openmpi").read_text() == "localhost slots=2\n"
    assert secret not in out and not any(secret in p.read_text() for p in run_dir.rglob("*") if p.is_file())


def test_deepy_mvapich_launcher_runs_a_real_hydra_mpirun(setup, tmp_path):
    """``launcher: mvapich`` builds MPICH/MVAPICH's hydra command (``mpirun -np -ppn --hostfile -genvlist``); here
    Debian's MPICH hydra runs it (MVAPICH2 itself is not packaged). Ranks read PMI_RANK/MPI_LOCALRANKID/PMI_SIZE."""
    hydra = shutil.which("mpirun.mpich")
    if hydra is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI: MPICH's mpirun.mpich is missing (scripts/system_packages.sh installs mpich)")
        pytest.skip("MPICH (mpirun.mpich) is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "mpirun"  # deepy runs `mpirun`: here that is hydra, not Open MPI's (exec keeps its path)
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(hydra)} "$@"\n')
    wrapper.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    config = write_config(tmp_path / "mv.yml", setup["data"], launcher="mvapich", deepspeed_mpi=True)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "deepy.py", "train.py", str(config), "--hostfile", str(hostfile), "--run_dir", str(run_dir)]
    res = run_command(cmd, timeout=600, env=env)
    out = res.stdout + res.stderr
    assert "ranks from pmi: world size 2" in out, out[-3000:]
    assert losses(out) == setup["reference"]
    mpirun = shlex.split(next(ln for ln in res.stdout.splitlines() if ln.startswith("mpirun ")))
    assert mpirun[:5] == ["mpirun", "-np", "2", "-ppn", "2"] and "-genvlist" in mpirun
    assert (run_dir / "hostfile.mvapich").read_text() == "localhost\n"


def test_deepy_pdsh_launcher_runs_through_a_real_ssh_login(setup, tmp_path):
    """``launcher: pdsh`` (GPT-NeoX's default): real pdsh logs in to this host through a real sshd, sources the
    0600 env file, and DeepSpeed's per-node launcher starts both ranks; the secret stays out of every log."""
    from tests.ssh_server import loopback_sshd

    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    config = write_config(tmp_path / "pdsh.yml", setup["data"], launcher="pdsh", force_multi=True)
    secret = "wandb-secret-for-the-pdsh-test-0451"
    run_dir = tmp_path / "run"
    cmd = [PYTHON, "deepy.py", "train.py", str(config), "--hostfile", str(hostfile), "--run_dir", str(run_dir)]
    with loopback_sshd() as ssh_env:
        res = run_command(cmd, timeout=600, env={**ssh_env, "WANDB_API_KEY": secret}, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert losses(re.sub(r"^localhost: ", "", out, flags=re.MULTILINE)) == setup["reference"], out[-4000:]
    pdsh = shlex.split(next(ln for ln in res.stdout.splitlines() if ln.startswith("pdsh ")))
    assert pdsh[:2] == ["pdsh", "-S"] and pdsh[pdsh.index("-w") + 1] == "localhost"
    assert secret not in out and not any(secret in p.read_text() for p in run_dir.rglob("*") if p.is_file())
    assert not (run_dir / "launch.env").exists()  # the 0600 env file is removed after the launch


def test_sbatch_template_trains_on_a_real_single_host_slurm(setup, tmp_path):
    from tests.slurm_cluster import job_steps, single_host_slurm

    run = tmp_path / "run"
    config = write_config(
        tmp_path / "slurm run's.yml",  # a quote and a space in the path: quoted all the way to the ranks
        setup["data"],
        launcher="slurm",
        deepspeed_slurm=True,
        comment="neox forge 'test'",
        save=str(run / "ckpt"),
        checkpoint_factor=ITERS,
        log_dir=str(run / "logs"),
    )
    secret = "wandb-secret-for-the-slurm-test-0042"
    job_out = tmp_path / "job.out"
    with single_host_slurm() as cluster:
        env = {
            **cluster.env,
            "PYTHON": PYTHON,
            "NEOX_DIR": str(REPO_ROOT),
            "NEOX_HOSTFILE_DIR": str(tmp_path / "hostfiles"),
            "WANDB_API_KEY": secret,  # reaches the ranks through the environment only
        }
        sbatch = [program("sbatch"), "--wait", "--nodes=1", "--ntasks-per-node=2", f"--output={job_out}"]
        sbatch += [f"--chdir={REPO_ROOT}", str(REPO_ROOT / "tools" / "slurm" / "train.sbatch"), str(config)]
        result = run_command(sbatch, timeout=600, env=env, check=False)
        out = job_out.read_text() if job_out.exists() else "<no job output>"
        assert result.returncode == 0, result.describe() + out + cluster.logs()
    assert not job_steps(cluster.conf)  # the cluster stopped its job steps too (slurmd daemonises them)
    assert f"neox: job {result.stdout.split()[-1]} on {cluster.node}, 2 task(s) per node" in out
    srun = shlex.split(next(ln for ln in out.splitlines() if ln.startswith("srun ")))
    assert srun[:7] == ["srun", "-n", "2", "--nodes", "1", "--ntasks-per-node", "2"]
    assert srun[srun.index("--comment") + 1] == "neox forge 'test'"
    assert secret not in out and not any(secret in p.read_text() for p in run.rglob("*") if p.suffix in LOGS)
    assert "ranks from slurm: world size 2" in out, out
    assert losses(out) == setup["reference"]
    assert (run / "ckpt" / "latest").read_text().strip() == f"global_step{ITERS}"
    rank_logs = sorted((run / "logs").glob("*_stdout.txt"))
    assert len(rank_logs) == 2, rank_logs


def _wait_for(path: Path, pattern: str, timeout: float, logs: Any) -> re.Match[str]:
    """The first match of ``pattern`` in the growing file ``path``; fails with the file and ``logs()`` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        match = re.search(pattern, text, flags=re.MULTILINE)
        if match:
            return match
        time.sleep(0.5)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout} s:\n{text[-4000:]}{logs()}")


def test_scancel_signal_term_saves_requeues_and_resumes(setup, tmp_path):
    """``scancel --signal=TERM`` (what SLURM's preemption sends): every rank agrees, saves the same step and exits
    with the requeue code; the batch script requeues the job, which resumes from that checkpoint."""
    from tests.slurm_cluster import job_steps, single_host_slurm

    run = tmp_path / "run"
    config = write_config(
        tmp_path / "preempt.yml",
        setup["data"],
        launcher="slurm",
        deepspeed_slurm=True,
        train_iters=1_000_000,  # runs until preempted
        save=str(run / "ckpt"),
        load=str(run / "ckpt"),
        checkpoint_factor=1_000_000,
        log_dir=str(run / "logs"),
    )
    job_out = tmp_path / "job.out"
    with single_host_slurm() as cluster:
        env = {**cluster.env, "PYTHON": PYTHON, "NEOX_DIR": str(REPO_ROOT), "NEOX_HOSTFILE_DIR": str(tmp_path / "h")}
        sbatch = [program("sbatch"), "--parsable", "--nodes=1", "--ntasks-per-node=2", f"--output={job_out}"]
        sbatch += [f"--chdir={REPO_ROOT}", str(REPO_ROOT / "tools" / "slurm" / "train.sbatch"), str(config)]
        job = run_command(sbatch, timeout=60, env=env).stdout.strip().split(";")[0]
        _wait_for(job_out, r"^iteration\s+3/", 300, cluster.logs)
        cluster.run("scancel", "--signal=TERM", job)
        _wait_for(job_out, r"exit code 42: requeueing job", 300, cluster.logs)
        deadline = time.monotonic() + 60
        while cluster.run("squeue", "-h", "-j", job, "-o", "%T").strip() != "PENDING" and time.monotonic() < deadline:
            time.sleep(0.5)
        # slurmd revokes the killed job's credential with one-second resolution and refuses a relaunch of the same
        # job id within that second ("already killed, do not launch batch job"); SLURM's own ~2 min requeue hold
        # hides this, so the test waits a few seconds before lifting the hold
        time.sleep(3)
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        loaded = _wait_for(job_out, r"loaded checkpoint \S+ at iteration (\d+)", 300, cluster.logs)
        cluster.run("scancel", "--full", job)  # ends the test's job (its ranks may save once more on the way out)
    assert not job_steps(cluster.conf)  # the cancelled job's steps were stopped with the cluster
    first_run = job_out.read_text().split("requeueing job")[0]
    saved = re.findall(r"saving at iteration (\d+) and exiting with requeue exit code 42", first_run)
    assert len(set(saved)) == 1, first_run[-4000:]  # every rank that reports it saved the same step
    step = int(saved[0])
    assert step >= 3 and int(loaded.group(1)) == step
    assert json.loads((run / "ckpt" / f"global_step{step}" / "manifest.json").read_text())["iteration"] == step
