"""The ``save`` folder lock (one run per folder) and per-run temporary checkpoint folders."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from megatron.checkpoint.commit import clean_partials, commit, partial_tag
from megatron.checkpoint.layout import CheckpointError
from megatron.training.save_lock import LOCK_NAME, acquire


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_second_acquire_is_refused_naming_the_holder_and_release_frees_it(tmp_path: Path) -> None:
    save = tmp_path / "new" / "ck"
    lock = acquire(str(save))  # creates the folder
    holder = json.loads((save / LOCK_NAME).read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid() and holder["run_id"] == lock.run_id
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}, started {holder['started']}") as err:
        acquire(str(save))
    assert f"save folder {save} is in use by another run (host {holder['host']}" in str(err.value)
    assert sorted(p.name for p in save.iterdir()) == [LOCK_NAME]  # no temp file left behind
    lock.release()
    assert not save.exists() and save.parent.is_dir()  # the lock created the folder; nothing was saved in it
    save.mkdir()
    acquire(str(save)).release()
    assert save.is_dir() and not list(save.iterdir())  # a folder that was there before stays


def test_stale_lock_on_this_host_is_taken_over_with_a_warning(tmp_path: Path, caplog) -> None:
    stale = {"host": socket.gethostname(), "pid": _dead_pid(), "process_start": 1.0, "started": "x", "run_id": "old"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
    lock = acquire(str(tmp_path))
    assert "taking over the lock of a run that is gone" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == lock.run_id
    # a live pid whose start time differs is a reused pid: gone as well
    reused = {**stale, "pid": os.getpid(), "run_id": "reused"}
    lock.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps(reused))
    acquire(str(tmp_path)).release()


def test_lock_of_another_host_is_refused(tmp_path: Path) -> None:
    other = {"host": "some-other-node", "pid": _dead_pid(), "process_start": 1.0, "started": "t", "run_id": "r"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="host some-other-node"):
        acquire(str(tmp_path))
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == other  # left alone


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path: Path) -> None:
    lock = acquire(str(tmp_path))
    (tmp_path / LOCK_NAME).write_text(json.dumps({"run_id": "someone-else"}))
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


def test_cleanup_only_touches_this_runs_temporary_folders(tmp_path: Path) -> None:
    mine, theirs = tmp_path / partial_tag("global_step4", "aaaa"), tmp_path / partial_tag("global_step4", "bbbb")
    for folder in (mine, theirs):
        folder.mkdir()
        (folder / "f.pt").write_bytes(b"x")
    assert clean_partials(tmp_path, "aaaa") == [mine] and theirs.exists()
    theirs_final = tmp_path / partial_tag("global_step6", "bbbb")
    theirs_final.mkdir()
    staged = tmp_path / partial_tag("global_step6", "aaaa")
    staged.mkdir()
    assert commit(tmp_path, "global_step6", "aaaa") == tmp_path / "global_step6"
    assert theirs.exists() and theirs_final.exists() and (tmp_path / "latest").read_text() == "global_step6"
    assert set(clean_partials(tmp_path)) == {theirs, theirs_final}  # without a run id (under the lock): all


def _stale(run_id: str = "old", **fields: object) -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": _dead_pid(), "process_start": 1.0, "started": "t", "run_id": run_id,
            **fields}  # fmt: skip


HOSTILE = {
    "pid -1": (json.dumps(_stale(pid=-1)), "pid -1 is not a process id (an integer from 1 to 4194304)"),
    "pid 0": (json.dumps(_stale(pid=0)), "pid 0 is not a process id"),
    "huge pid": (json.dumps(_stale(pid=10**40)), "pid 1000000000000000000000000000000000000... is not"),
    "float pid": (json.dumps(_stale(pid=1.5)), "pid 1.5 is not a process id"),
    "bool pid": (json.dumps(_stale(pid=True)), "pid True is not a process id"),
    "nan start": (json.dumps(_stale(process_start=float("nan"))), "process_start nan is not a time"),
    "no host": (json.dumps({k: v for k, v in _stale().items() if k != "host"}), "host None is not a short printable"),
    "garbage": ("hello, world", "(not JSON)"),
    "empty": ("", "(empty)"),
    "list": ("[1, 2]", "(JSON list, not an object)"),
    "binary": (b"\x00\xff\xfe\x80" * 8, "(not UTF-8 text)"),
    "zero-filled": (b"\x00" * 64, "(not JSON)"),
    "huge": ("x" * 5000, "(larger than 4096 bytes)"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_malformed_lock_is_one_line_naming_the_file_and_is_left_alone(case: str, tmp_path: Path) -> None:
    content, expected = HOSTILE[case]
    lock = tmp_path / LOCK_NAME
    lock.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError) as err:
        acquire(str(tmp_path))
    msg = str(err.value)
    assert msg.startswith(f"lock file {lock} is not a lock this program wrote (") and "\n" not in msg, msg
    assert expected in msg and msg.endswith(f"if no run is using {tmp_path}, delete it and start again"), msg
    assert lock.read_bytes() == (content if isinstance(content, bytes) else content.encode())
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


def test_a_lock_that_is_a_directory_symlink_or_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_NAME
    lock.mkdir()
    with pytest.raises(CheckpointError, match=r"is not a lock this program wrote \(a directory\)"):
        acquire(str(tmp_path))
    lock.rmdir()
    lock.symlink_to("/dev/zero")  # would never end if followed
    with pytest.raises(CheckpointError, match=r"\(a symbolic link\)"):
        acquire(str(tmp_path))
    lock.unlink()
    os.mkfifo(lock)  # would block forever if opened for reading in blocking mode
    with pytest.raises(CheckpointError, match=r"\(not a regular file\)"):
        acquire(str(tmp_path))


def test_a_takeover_guard_left_locked_is_one_line_naming_it(tmp_path: Path, monkeypatch) -> None:
    import fcntl

    from megatron.training import lock_takeover

    monkeypatch.setattr(lock_takeover, "WAIT_S", 0.2)
    (tmp_path / LOCK_NAME).write_text(json.dumps(_stale()))
    guard = tmp_path / (LOCK_NAME + lock_takeover.GUARD_SUFFIX)
    with open(guard, "w") as held:  # another process in the middle of a takeover (flock is per open file)
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(CheckpointError, match=f"its takeover guard {guard} is locked by another process"):
            acquire(str(tmp_path))
    lock = acquire(str(tmp_path))  # the guard is free again (the file left behind is reused and removed)
    assert not guard.exists() and json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == lock.run_id


def test_without_flock_the_guard_file_itself_excludes(tmp_path: Path, monkeypatch) -> None:
    import errno

    from megatron.training import lock_takeover

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_takeover.fcntl, "flock", no_flock)
    monkeypatch.setattr(lock_takeover, "WAIT_S", 0.2)
    (tmp_path / LOCK_NAME).write_text(json.dumps(_stale()))
    guard = tmp_path / (LOCK_NAME + lock_takeover.GUARD_SUFFIX)
    guard.write_text("")  # left by a takeover killed half-way: not removed automatically
    with pytest.raises(CheckpointError, match=f"its takeover guard {guard} is still there after 0.2 s"):
        acquire(str(tmp_path))
    guard.unlink()
    lock = acquire(str(tmp_path))
    assert not guard.exists() and json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] == lock.run_id


def _contender(folder: str, start: Any, done: Any, results: Any, rounds: int) -> None:
    for r in range(rounds):
        start.wait(timeout=60)
        try:
            results.put((r, acquire(folder).run_id))  # held (never released) until the next round's stale lock
        except CheckpointError as e:
            results.put((r, f"refused: {e}"))
        done.wait(timeout=60)


def test_concurrent_takeovers_of_a_stale_lock_leave_exactly_one_holder(tmp_path: Path) -> None:
    """8 processes take over the same stale lock at the same instant, 200 times: each time exactly one holds it."""
    procs, rounds = 8, 200
    ctx = mp.get_context("fork")
    start, done, results = ctx.Barrier(procs + 1), ctx.Barrier(procs + 1), ctx.Queue()
    workers = [ctx.Process(target=_contender, args=(str(tmp_path), start, done, results, rounds)) for _ in range(procs)]
    for w in workers:
        w.start()
    dead = _dead_pid()
    holders: list[list[str]] = []
    try:
        for r in range(rounds):
            stale = {"host": socket.gethostname(), "pid": dead, "process_start": 1.0, "started": "t", "run_id": f"s{r}"}
            (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
            start.wait(timeout=60)
            done.wait(timeout=60)
            outcomes = [results.get(timeout=60) for _ in range(procs)]
            won = [o for _, o in outcomes if not o.startswith("refused: ")]
            refusals = {o.split("(")[0] for _, o in outcomes if o.startswith("refused: ")}
            assert refusals <= {f"refused: save folder {tmp_path} is in use by another run "}, refusals
            assert json.loads((tmp_path / LOCK_NAME).read_text())["run_id"] in won
            holders.append(won)
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    assert [len(h) for h in holders] == [1] * rounds
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no guard or temporary file left
