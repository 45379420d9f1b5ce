"""``train.py`` started as torchrun starts it (rank variables in the environment, no deepy) with hostile rank
variables, or on a MASTER_PORT another process holds: one ``error:`` line naming the variable or port, exit 1, no
traceback and no hang. Through deepy.py, a port taken after deepy checked it (between check and bind) is reported
the same way by the rank that fails to listen on it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from tests.harness import PYTHON, REPO_ROOT, CommandResult, free_port, run_command

TINY = str(REPO_ROOT / "configs" / "cpu" / "tiny.yml")


def _train(**env: str) -> CommandResult:
    rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **env}  # fmt: skip
    return run_command([PYTHON, "train.py", TINY], env=rank_env, timeout=120, check=False)


def _one_error_line(res: CommandResult) -> str:
    assert res.returncode == 1, res.describe()
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in res.stdout + res.stderr, res.describe()
    return lines[0].removeprefix("error: ")


BAD = {
    "WORLD_SIZE=abc": ({"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE='abc' is not valid: it must be an integer"),
    "WORLD_SIZE=nan": ({"WORLD_SIZE": "nan"}, "environment variable WORLD_SIZE='nan' is not valid"),
    "LOCAL_RANK=1e9": ({"LOCAL_RANK": "1e9"}, "environment variable LOCAL_RANK='1e9' is not valid: it must be 0"),
    "MASTER_PORT=99999999": ({"MASTER_PORT": "99999999"}, "environment variable MASTER_PORT='99999999' is not valid: "
                             "it must be an integer from 1 to 65535"),
    "RANK=-1": ({"RANK": "-1"}, "environment variable RANK='-1' is not valid: it must be 0 (WORLD_SIZE is 1)"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_train_refuses_a_hostile_rank_variable(case: str) -> None:
    env, expected = BAD[case]
    msg = _one_error_line(_train(**env))
    assert msg.startswith(expected), msg


@contextlib.contextmanager
def _held_port() -> Iterator[int]:
    """A port another process (here: this one) listens on."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def _port_in_use(port: int) -> str:
    return (
        f"MASTER_PORT {port} is already in use on this machine (rank 0 cannot listen there for the ranks meeting at "
        "MASTER_ADDR 127.0.0.1): another run or service holds it; set MASTER_PORT (master_port with deepy.py) to a "
        "free port"
    )


def test_train_on_a_master_port_in_use_is_one_line_naming_it() -> None:
    with _held_port() as port:
        assert _one_error_line(_train(MASTER_PORT=str(port))) == _port_in_use(port)


@pytest.mark.slow  # DeepSpeed's runner, then a rank: about 30 s on a busy 2-core machine
def test_deepy_reports_a_port_taken_between_its_check_and_the_bind(tmp_path) -> None:
    """deepy's own check (launch.check_master_port) ran while the port was free; it is taken before rank 0's store
    binds it (here: the check is skipped, the port held throughout). Two ranks: one error line, from rank 0."""
    run_dir = tmp_path / "run"
    with _held_port() as port:
        code = (
            "import sys, deepy, megatron.launcher.launch as launch\n"
            "launch.check_master_port = lambda plan: None\n"
            f"argv = ['train.py', {TINY!r}, '--num_gpus', '2', '--master_port', '{port}', '--run_dir', {str(run_dir)!r}]\n"
            "sys.exit(deepy.main(argv))\n"
        )
        res = run_command([PYTHON, "-c", code], timeout=180, check=False)
    assert res.returncode == 1, res.describe()  # DeepSpeed's launcher stops the other rank and passes the code on
    out = res.stdout + res.stderr
    assert [ln for ln in out.splitlines() if ln.startswith("error: ")] == [f"error: {_port_in_use(port)}"], out
    assert "Traceback" not in out, res.describe()


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("MASTER_ADDR", "a;b", "environment variable MASTER_ADDR='a;b' is not valid: it must be the host name or IP"),
        ("WORLD_SIZE", "abc", "environment variable WORLD_SIZE='abc' is not valid: it must be an integer from 1 to"),
    ],
)
def test_deepy_refuses_a_hostile_launch_variable(
    name: str, value: str, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import deepy

    monkeypatch.setenv(name, value)
    assert deepy.main(["train.py", TINY, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"deepy.py: error: {expected}") and err.count("\n") == 1 and "Traceback" not in out + err
