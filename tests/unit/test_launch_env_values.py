"""Every rank variable a launcher hands a worker is parsed and range-checked before use: one LaunchEnvError naming
the variable, its value and what is valid (torchrun's/DeepSpeed's names and srun's/mpirun's alike)."""

from __future__ import annotations

import pytest

from megatron.cluster.env_values import LaunchEnvError
from megatron.cluster.worker_env import (
    discover_rank_env,
    expand_nodelist,
    launched_local_rank,
    launched_rank,
    launched_world_size,
)

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}  # fmt: skip
SLURM = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
         "SLURM_STEP_NODELIST": "n[1-2]"}  # fmt: skip
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
PMI = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}

WORLD = "it must be an integer from 1 to 1048576"
BAD = {
    "world abc": (TORCHRUN, {"WORLD_SIZE": "abc"}, f"WORLD_SIZE='abc' is not valid: {WORLD}"),
    "world nan": (TORCHRUN, {"WORLD_SIZE": "nan"}, f"WORLD_SIZE='nan' is not valid: {WORLD}"),
    "world 0": (TORCHRUN, {"WORLD_SIZE": "0"}, f"WORLD_SIZE='0' is not valid: {WORLD}"),
    "world huge": (TORCHRUN, {"WORLD_SIZE": "1" * 5000}, f"WORLD_SIZE='{'1' * 36}... is not valid: {WORLD}"),
    "world spaces": (TORCHRUN, {"WORLD_SIZE": " 2"}, f"WORLD_SIZE=' 2' is not valid: {WORLD}"),
    "rank -1": (TORCHRUN, {"RANK": "-1"}, "RANK='-1' is not valid: it must be an integer from 0 to 1 (WORLD_SIZE is 2)"),
    "rank = world": (TORCHRUN, {"RANK": "2"}, "RANK='2' is not valid: it must be an integer from 0 to 1 (WORLD_SIZE"),
    "rank float": (TORCHRUN, {"RANK": "1.0"}, "RANK='1.0' is not valid"),
    "local rank 1e9": (TORCHRUN, {"LOCAL_RANK": "1e9"}, "LOCAL_RANK='1e9' is not valid: it must be an integer from 0 to 1 "
                       "(the local world size is 2)"),
    "local rank 2": (TORCHRUN, {"LOCAL_RANK": "2"}, "LOCAL_RANK='2' is not valid"),
    "local world > world": (TORCHRUN, {"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE='3' is not valid: it must be an "
                            "integer from 1 to 2 (WORLD_SIZE is 2)"),
    "local size": (TORCHRUN, {"LOCAL_SIZE": "x"}, "LOCAL_SIZE='x' is not valid"),
    "port huge": (TORCHRUN, {"MASTER_PORT": "99999999"}, "MASTER_PORT='99999999' is not valid: it must be an integer "
                  "from 1 to 65535"),
    "port 0": (TORCHRUN, {"MASTER_PORT": "0"}, "MASTER_PORT='0' is not valid"),
    "port empty": (TORCHRUN, {"MASTER_PORT": ""}, "MASTER_PORT='' is not valid"),
    "addr empty": (TORCHRUN, {"MASTER_ADDR": ""}, "MASTER_ADDR='' is not valid: it must be the host name or IP"),
    "addr shell": (TORCHRUN, {"MASTER_ADDR": "h; rm -rf /"}, "MASTER_ADDR='h; rm -rf /' is not valid"),
    "slurm procid": (SLURM, {"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not valid: it must be an integer from 0 to 3 "
                     "(SLURM_STEP_NUM_TASKS is 4)"),
    "slurm tasks": (SLURM, {"SLURM_STEP_NUM_TASKS": "-4"}, f"SLURM_STEP_NUM_TASKS='-4' is not valid: {WORLD}"),
    "slurm localid": (SLURM, {"SLURM_LOCALID": "2"}, "SLURM_LOCALID='2' is not valid: it must be an integer from 0 to "
                      "1 (SLURM_STEP_TASKS_PER_NODE is 2)"),
    "slurm per node": (SLURM, {"SLURM_STEP_TASKS_PER_NODE": "lots"}, "SLURM_STEP_TASKS_PER_NODE='lots' is not valid: "
                       "it must list tasks per node as SLURM writes it"),
    "slurm nodelist": (SLURM, {"SLURM_STEP_NODELIST": "n[0-99999999]"}, "the SLURM node list 'n[0-99999999]' names "
                       "more than 1048576 hosts"),
    "ompi rank": (OMPI, {"OMPI_COMM_WORLD_RANK": "2"}, "OMPI_COMM_WORLD_RANK='2' is not valid: it must be an integer "
                  "from 0 to 1 (OMPI_COMM_WORLD_SIZE is 2)"),
    "ompi local size": (OMPI, {"OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, "OMPI_COMM_WORLD_LOCAL_SIZE='0' is not valid"),
    "pmi size": (PMI, {"PMI_SIZE": "2.5"}, f"PMI_SIZE='2.5' is not valid: {WORLD}"),
    "pmi local rank": (PMI, {"MPI_LOCALRANKID": "-1"}, "MPI_LOCALRANKID='-1' is not valid"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("fill_defaults", [True, False])
def test_a_bad_rank_variable_is_one_line_naming_it(case: str, fill_defaults: bool) -> None:
    base, bad, expected = BAD[case]
    env = {**base, **bad}
    with pytest.raises(LaunchEnvError) as err:
        discover_rank_env(env, fill_defaults=fill_defaults)
    msg = str(err.value)
    assert msg.startswith(("environment variable ", "the SLURM node list ")) and "\n" not in msg, msg
    assert expected in msg, msg


def test_valid_launches_still_resolve() -> None:
    env = dict(TORCHRUN)
    assert discover_rank_env(env) == "launcher" and env["LOCAL_SIZE"] == "2"
    env = dict(SLURM)
    assert discover_rank_env(env, prefer_slurm=True) == "slurm"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "1", "4", "2")
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == "29500"
    for source in (OMPI, PMI):
        env = dict(source)
        discover_rank_env(env)
        assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    env = {**TORCHRUN, "MASTER_ADDR": "[fe80::1%eth0]"}
    discover_rank_env(env)  # an IPv6 address with a zone is an address


def test_the_rank_readers_check_their_variable() -> None:
    assert (launched_rank({}), launched_local_rank({}), launched_world_size({})) == (0, 0, 1)
    assert (launched_rank(TORCHRUN), launched_world_size(TORCHRUN)) == (0, 2)
    with pytest.raises(LaunchEnvError, match=r"^environment variable RANK='-1' is not valid"):
        launched_rank({"RANK": "-1"})
    with pytest.raises(LaunchEnvError, match=r"^environment variable LOCAL_RANK='1e9' is not valid"):
        launched_local_rank({"LOCAL_RANK": "1e9"})
    with pytest.raises(LaunchEnvError, match=r"^environment variable WORLD_SIZE='nan' is not valid"):
        launched_world_size({"WORLD_SIZE": "nan"})
    with pytest.raises(LaunchEnvError, match="range '1-x'"):
        expand_nodelist("n[1-x]")
