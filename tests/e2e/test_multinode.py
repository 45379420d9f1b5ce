"""Real multi-node launches on a simulated cluster (tests/netns_cluster.py: 2 network namespaces, each its own IP,
hostname, sshd, and for SLURM its own munged and slurmd): ``deepy.py`` over pdsh/ssh and over Open MPI's ``mpirun``,
and ``sbatch -N 2 tools/slurm/train.sbatch``, 2 nodes x 2 ranks, give the losses of the same layout on one host;
include/exclude and ``slots=`` put the ranks on the right hosts; a node that dies ends the run in bounded time with
an error naming it, and a restart on the remaining node resumes with the losses of the uninterrupted run."""

from __future__ import annotations

import re
import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.distributed.fns_train import make_tiny_data, tiny_config
from tests.harness import PYTHON, REPO_ROOT, CommandResult, kill_tree, run_command, subprocess_env
from tests.netns_cluster import require_netns
from tests.system_tools import require_programs

pytestmark = pytest.mark.distributed
ITERS = 6
NODE_LOSS_BOUND = 120  # seconds from the node's death to the end of the launch
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm_loss: ([0-9.E+-]+)")
RANK_LINE = re.compile(r"rank (\d+) \(local rank (\d+) of (\d+)\) on host (\S+)")
LAYOUTS = {"tp2-dp2": {"model_parallel_size": 2}, "pp2-tp2": {"model_parallel_size": 2, "pipe_parallel_size": 2}}


def losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LOSS_LINE.finditer(text)}


def placement(text: str) -> dict[int, tuple[str, int]]:
    """rank -> (host, local rank), from every rank's start-up line."""
    return {int(m.group(1)): (m.group(4), int(m.group(2))) for m in RANK_LINE.finditer(text)}


def write_config(path: Path, data: dict[str, str], **overrides: Any) -> Path:
    cfg = tiny_config(data, world=4, train_iters=ITERS, log_interval=1, eval_interval=100, eval_iters=0)
    cfg.pop("global_num_gpus")  # every launch derives the world size from its hostfile
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}  # None: derive it (e.g. gradient accumulation)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("multinode") / "data")


@pytest.fixture(scope="module")
def one_host(data, tmp_path_factory) -> dict[str, dict[int, str]]:
    """The reference: each layout on one host, 4 ranks through DeepSpeed's runner (``num_gpus: 4``)."""
    require_netns()  # skip (or fail under CI) before the reference runs when no cluster can be built
    root = tmp_path_factory.mktemp("one_host")
    out = {}
    for name, layout in LAYOUTS.items():
        config = write_config(root / f"{name}.yml", data, num_gpus=4, **layout)
        res = run_command([PYTHON, "deepy.py", "train.py", str(config)], timeout=900)
        out[name] = losses(res.stdout)
        assert len(out[name]) == ITERS, res.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def cluster():
    from tests.netns_cluster import netns_cluster

    require_programs("pdsh", "mpirun")
    with netns_cluster(2) as c:
        yield c


def deepy_on(cluster, node: str, config: Path, hostfile: Path, run_dir: Path, timeout: float = 900) -> CommandResult:
    cmd = [*cluster.on(node), PYTHON, "deepy.py", "train.py", str(config), "--hostfile", str(hostfile)]
    cmd += ["--run_dir", str(run_dir)]
    return run_command(cmd, timeout=timeout, env=cluster.env, check=False, cwd=REPO_ROOT)


def test_pdsh_two_nodes_tp2_dp2_matches_one_host(cluster, data, one_host, tmp_path):
    """pdsh logs in to both nodes over ssh; TP=2 inside a node, DP=2 across the nodes, master on node1."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    config = write_config(tmp_path / "pdsh.yml", data, launcher="pdsh", **LAYOUTS["tp2-dp2"])
    res = deepy_on(cluster, "node1", config, hostfile, tmp_path / "run")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:] + cluster.logs()
    assert placement(out) == {0: ("node1", 0), 1: ("node1", 1), 2: ("node2", 0), 3: ("node2", 1)}, out[-6000:]
    assert "ranks from launcher: world size 4, master node1" in out
    assert losses(out) == one_host["tp2-dp2"]
    pdsh = shlex.split(next(ln for ln in res.stdout.splitlines() if ln.startswith("pdsh ")))
    assert pdsh[pdsh.index("-w") + 1] == "node1,node2"


def test_openmpi_two_nodes_pp2_tp2_matches_one_host(cluster, data, one_host, tmp_path):
    """mpirun starts Open MPI's daemon on node2 over ssh; pipeline stage 0 on node1, stage 1 on node2."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    config = write_config(tmp_path / "ompi.yml", data, launcher="openmpi", deepspeed_mpi=True, **LAYOUTS["pp2-tp2"])
    res = deepy_on(cluster, "node1", config, hostfile, tmp_path / "run")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:] + cluster.logs()
    assert placement(out) == {0: ("node1", 0), 1: ("node1", 1), 2: ("node2", 0), 3: ("node2", 1)}, out[-6000:]
    assert "ranks from openmpi: world size 4, master node1" in out
    assert losses(out) == one_host["pp2-tp2"]


def _watch(proc: subprocess.Popen[str]) -> list[str]:
    """Collect ``proc``'s output lines in a thread (the pipe never fills up while the test waits)."""
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_node_loss_ends_the_run_and_a_smaller_restart_resumes_exactly(data, one_host, tmp_path):
    """node2 dies (every process in its namespace killed) after a checkpoint was committed: the ranks on node1 end
    within a bounded time with an error naming the lost node, the checkpoint stays valid, and a restart on node1
    alone (DP 2 -> 1, gradient accumulation 1 -> 2: the same global batch) continues with the losses of the
    uninterrupted run."""
    from tests.netns_cluster import netns_cluster

    require_programs("pdsh")
    with netns_cluster(2) as cluster:  # a cluster of its own: node2 dies for good
        ckpt = tmp_path / "ckpt"
        hostfile = tmp_path / "hosts"
        hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
        common = {"save": str(ckpt), "load": str(ckpt), "checkpoint_factor": 1, **LAYOUTS["tp2-dp2"]}
        config = write_config(tmp_path / "two.yml", data, launcher="pdsh", **common)
        cmd = [*cluster.on("node1"), PYTHON, "deepy.py", "train.py", str(config), "--hostfile", str(hostfile)]
        cmd += ["--run_dir", str(tmp_path / "run")]
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=subprocess_env(cluster.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        lines = _watch(proc)
        try:
            deadline = time.monotonic() + 600
            while not list(ckpt.glob("global_step*/manifest.json")):  # the first committed checkpoint
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-6000:]
                time.sleep(0.1)
            cluster.kill_node("node2")
            killed = time.monotonic()
            code = proc.wait(timeout=NODE_LOSS_BOUND)
            took = time.monotonic() - killed
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
        out = "".join(lines)
        assert code != 0, out[-6000:]
        assert f"iteration {ITERS}/" not in out, "the run finished before node2 was killed"
        # a survivor's one-line error names the lost host and its ranks (gloo itself only gives an address)
        lost = r"error: rank [01] on node1: lost the connection to host node2 \(10\.213\.0\.12, ranks 2, 3\)"
        assert re.search(lost, out), out[-6000:]
        assert "Traceback" not in out, out[-6000:]
        assert took < NODE_LOSS_BOUND
        # the survivors' view: the last committed checkpoint loads; node1 alone trains on with DP=1, GAS=2
        config = write_config(tmp_path / "one.yml", data, num_gpus=2, gradient_accumulation_steps=2, **common)
        res = run_command([*cluster.on("node1"), PYTHON, "deepy.py", "train.py", str(config)], timeout=900, check=False)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-6000:]
        loaded = int(re.search(r"loaded checkpoint \S+ at iteration (\d+)", out).group(1))  # type: ignore[union-attr]
        resumed = losses(out)
        assert sorted(resumed) == list(range(loaded + 1, ITERS + 1)), out[-6000:]
        reference = one_host["tp2-dp2"]
        for step, loss in resumed.items():
            assert float(loss) == pytest.approx(float(reference[step]), rel=1e-5), (step, resumed, reference)


def test_sbatch_two_nodes_tp2_dp2_matches_one_host(data, one_host, tmp_path):
    """``sbatch -N 2 tools/slurm/train.sbatch`` on the simulated cluster's SLURM (slurmctld on node1, slurmd on
    both): the batch script's hostfile lists both nodes, srun starts 2 ranks on each, master node1."""
    from tests.netns_cluster import netns_cluster

    config = write_config(tmp_path / "slurm.yml", data, launcher="slurm", deepspeed_slurm=True, **LAYOUTS["tp2-dp2"])
    job_out = tmp_path / "job.out"
    with netns_cluster(2, slurm=True) as cluster:
        env = {**cluster.env, "PYTHON": PYTHON, "NEOX_DIR": str(REPO_ROOT), "NEOX_HOSTFILE_DIR": str(tmp_path / "h")}
        sbatch = [*cluster.on("node1"), "sbatch", "--wait", "--nodes=2", "--ntasks-per-node=2", f"--output={job_out}"]
        sbatch += [f"--chdir={REPO_ROOT}", str(REPO_ROOT / "tools" / "slurm" / "train.sbatch"), str(config)]
        res = run_command(sbatch, timeout=900, env=env, check=False)
        out = job_out.read_text() if job_out.exists() else "<no job output>"
        assert res.returncode == 0, res.describe() + out[-6000:] + cluster.logs()
    assert "node1,node2, 2 task(s) per node" in out, out[-4000:]
    assert placement(out) == {0: ("node1", 0), 1: ("node1", 1), 2: ("node2", 0), 3: ("node2", 1)}, out[-6000:]
    assert "ranks from slurm: world size 4, master node1" in out
    assert losses(out) == one_host["tp2-dp2"]


@pytest.mark.parametrize(
    ("launcher", "hosts", "key", "spec", "expected"),
    [
        # pdsh pins slots: slot 1 of node1, slots 0 and 2 of node2 (local ranks count the chosen slots)
        ("pdsh", "node1 slots=2\nnode2 slots=3\nnode9 slots=2\n", "include", "node1:1@node2:0,2",
         {0: ("node1", 0), 1: ("node2", 1), 2: ("node2", 0)}),  # DeepSpeed: local rank = rank % ranks on node
        # mpirun: uneven slots= per host; node9 does not exist, so only a correct exclude lets the run start
        ("openmpi", "node1 slots=1\nnode2 slots=2\nnode9 slots=2\n", "exclude", "node9",
         {0: ("node1", 0), 1: ("node2", 0), 2: ("node2", 1)}),
    ],
)  # fmt: skip
def test_include_exclude_and_slots_place_ranks_on_the_right_nodes(
    cluster, data, tmp_path, launcher, hosts, key, spec, expected
):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    extra = {"deepspeed_mpi": True} if launcher == "openmpi" else {}
    config = write_config(tmp_path / "c.yml", data, launcher=launcher, train_iters=1, **{key: spec}, **extra)
    res = deepy_on(cluster, "node1", config, hostfile, tmp_path / "run")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:] + cluster.logs()
    assert placement(out) == expected, out[-6000:]
    assert len(losses(out)) == 1


def _wait_for(path: Path, pattern: str, timeout: float, logs: Any) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        match = re.search(pattern, text, flags=re.MULTILINE)
        if match:
            return match
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout} s:\n{text[-4000:]}{logs()}")


def test_sbatch_node_loss_requeues_and_resumes_on_the_remaining_node(data, one_host, tmp_path):
    """``sbatch --nodes=1-2 train.sbatch``: node2 dies after a committed checkpoint; the ranks on node1 fail naming
    node2, srun ends the step once slurmctld marks node2 DOWN (SlurmdTimeout, 20 s here), SLURM requeues the job
    (``--requeue``), and the requeued job, given one node's task count, runs on node1 alone (DP 1, gradient accumulation 2 for the same
    train_batch_size) with the losses of the uninterrupted run."""
    from tests.netns_cluster import netns_cluster

    ckpt = tmp_path / "ckpt"
    config = write_config(
        tmp_path / "slurm.yml", data, launcher="slurm", deepspeed_slurm=True, save=str(ckpt), load=str(ckpt),
        checkpoint_factor=1, train_batch_size=8, gradient_accumulation_steps=None, **LAYOUTS["tp2-dp2"],
    )  # fmt: skip
    job_out = tmp_path / "job.out"
    with netns_cluster(2, slurm=True) as cluster:
        env = {**cluster.env, "PYTHON": PYTHON, "NEOX_DIR": str(REPO_ROOT), "NEOX_HOSTFILE_DIR": str(tmp_path / "h")}

        def slurm(*cmd: str) -> str:
            return run_command([*cluster.on("node1"), *cmd], timeout=60, env=env).stdout

        sbatch = ["sbatch", "--parsable", "--nodes=1-2", "--ntasks-per-node=2", f"--output={job_out}"]
        job = slurm(*sbatch, f"--chdir={REPO_ROOT}", str(REPO_ROOT / "tools/slurm/train.sbatch"), str(config))
        job = job.strip().split(";")[0]
        deadline = time.monotonic() + 600
        while not list(ckpt.glob("global_step*/manifest.json")):
            assert time.monotonic() < deadline, job_out.read_text()[-4000:] + cluster.logs()
            time.sleep(0.1)
        cluster.kill_node("node2")
        killed = time.monotonic()
        while slurm("squeue", "-h", "-j", job, "-o", "%T").strip() != "PENDING":  # requeued by SLURM
            assert time.monotonic() - killed < NODE_LOSS_BOUND, job_out.read_text()[-4000:] + cluster.logs()
            time.sleep(0.5)
        assert "down" in slurm("sinfo", "-h", "-n", "node2", "-o", "%T")
        time.sleep(3)  # slurmd refuses a relaunch of the same job id within a second (see test_cluster_launch.py)
        # SLURM 22.05 keeps the first allocation's task count (4) for a requeued job: ask for one node's worth
        slurm("scontrol", "update", f"JobId={job}", "NumNodes=1", "NumTasks=2")
        slurm("scontrol", "update", f"JobId={job}", "StartTime=now")
        _wait_for(job_out, r"training finished at iteration", 600, cluster.logs)
    text = job_out.read_text()
    cut = text.index("neox: job", text.index("neox: job") + 1)  # the requeued job's output starts there
    first, second = text[:cut], text[cut:]
    assert f"iteration {ITERS}/" not in first, "the first run finished before node2 was killed"
    assert re.search(r"lost the connection to host node2 \(10\.213\.0\.12, ranks 2, 3\)", first), first[-4000:]
    assert second.startswith(f"neox: job {job} on node1, 2 task(s) per node"), second[-4000:]
    loaded = int(re.search(r"loaded checkpoint \S+ at iteration (\d+)", second).group(1))  # type: ignore[union-attr]
    resumed = losses(second)
    assert sorted(resumed) == list(range(loaded + 1, ITERS + 1)), second[-6000:]
    for step, loss in resumed.items():
        assert float(loss) == pytest.approx(float(one_host["tp2-dp2"][step]), rel=1e-5), (step, resumed)
