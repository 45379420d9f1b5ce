"""The ``save`` folder lock (one run per folder) and per-run temporary checkpoint folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from megatron.checkpoint.layout import CheckpointError
from megatron.training.checkpoint_commit import clean_partials, commit, partial_tag
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
