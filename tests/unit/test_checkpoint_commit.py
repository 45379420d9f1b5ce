"""Crash-safe checkpoint commit: manifest with sizes/checksums, fallback to the newest valid checkpoint, partial
folders ignored and cleaned, retention by iteration that keeps ``latest`` and the newest valid checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron.checkpoint.commit import (
    clean_partials,
    commit,
    delete_old_checkpoints,
    partial_tag,
    select_checkpoint,
)
from megatron.checkpoint.manifest import MANIFEST, verify_checkpoint, write_manifest
from megatron.neox_arguments import neox_namespace


def _save(root: Path, step: int, payload: bytes = b"weights" * 100) -> Path:
    """What save_checkpoint does on disk: write into the partial folder, manifest last, commit."""
    staged = root / partial_tag(f"global_step{step}")
    staged.mkdir(parents=True)
    (staged / "mp_rank_00_model_states.pt").write_bytes(payload)
    (staged / "configs").mkdir()
    (staged / "configs" / "a.yml").write_text("x: 1")
    write_manifest(staged, tag=f"global_step{step}", iteration=step)
    return commit(root, f"global_step{step}")


def test_manifest_records_sizes_and_checksums(tmp_path: Path) -> None:
    directory = _save(tmp_path, 4)
    manifest = json.loads((directory / MANIFEST).read_text())
    entry = manifest["files"]["mp_rank_00_model_states.pt"]
    assert entry["size"] == 700 and len(entry["sha256"]) == 64 and manifest["iteration"] == 4
    assert (tmp_path / "latest").read_text() == "global_step4" and verify_checkpoint(directory) is None
    (directory / "mp_rank_00_model_states.pt").write_bytes(b"X" * 700)  # same size, other bytes
    assert verify_checkpoint(directory) is None
    assert "sha256" in (verify_checkpoint(directory, checksums=True) or "")


def test_inspect_verify_checks_checksums(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron.checkpoint import cli
    from tests.harness import load_tool

    tool = load_tool("tools/ckpts/inspect_checkpoints.py")
    directory = _save(tmp_path, 4)
    assert cli.run(lambda: tool.main([str(tmp_path), "--verify"])) == 0
    (directory / "configs" / "a.yml").write_text("x: 2")  # same size, other content
    assert cli.run(lambda: tool.main([str(tmp_path), "--verify"])) == 1
    assert "a.yml does not match its sha256" in capsys.readouterr().err


def test_truncated_newest_falls_back_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 4)
    newest = _save(tmp_path, 8)
    bad = newest / "mp_rank_00_model_states.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert select_checkpoint(tmp_path) == "global_step4"
    assert str(bad) in caplog.text and "truncated" in caplog.text


def test_interrupted_save_is_ignored_and_cleaned(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    partial = tmp_path / partial_tag("global_step8")
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"half")
    assert select_checkpoint(tmp_path) == "global_step4"
    assert clean_partials(tmp_path) == [partial] and not partial.exists()
    # killed after the rename but before `latest` moved: latest still names the previous, complete checkpoint
    (tmp_path / "global_step8").mkdir()
    assert select_checkpoint(tmp_path) == "global_step4"


def test_saving_an_existing_iteration_again_replaces_it(tmp_path: Path) -> None:
    _save(tmp_path, 4, b"old")
    directory = _save(tmp_path, 4, b"new!")
    assert (directory / "mp_rank_00_model_states.pt").read_bytes() == b"new!"
    assert verify_checkpoint(directory) is None and not list(tmp_path.glob(".trash-*"))


def test_retention_by_iteration_keeps_latest_and_newest_valid(tmp_path: Path) -> None:
    for step in (2, 4, 10, 20):
        _save(tmp_path, step)
    (tmp_path / "latest").write_text("global_step4")  # resumed from step 4 in a folder with newer checkpoints
    deleted = delete_old_checkpoints(tmp_path, 1)
    assert [p.name for p in deleted] == ["global_step2", "global_step10"]
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step20", "global_step4"]
    # the newest checkpoint is truncated: the newest *valid* one survives as well
    for step in (30, 40):
        _save(tmp_path, step)
    bad = tmp_path / "global_step40" / "mp_rank_00_model_states.pt"
    bad.write_bytes(b"")
    (tmp_path / "latest").write_text("global_step40")
    delete_old_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step30", "global_step40"]
    assert select_checkpoint(tmp_path) == "global_step30"


def test_load_verify_checksums_skips_a_corrupted_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``load_verify_checksums``: a same-size corruption passes the size check but not the sha256 one; the load
    falls back to the previous checkpoint naming the file, and a requested iteration is refused."""
    from megatron.checkpoint import CheckpointConfig
    from megatron.checkpoint.layout import CheckpointError
    from megatron.checkpoint.resume import resolve_tag

    _save(tmp_path, 4)
    bad = _save(tmp_path, 8) / "mp_rank_00_model_states.pt"
    bad.write_bytes(b"X" * bad.stat().st_size)
    assert resolve_tag(CheckpointConfig(load=str(tmp_path))) == "global_step8"  # sizes only: not noticed
    cfg = CheckpointConfig.from_neox_args(neox_namespace(load=str(tmp_path), load_verify_checksums=True))
    with caplog.at_level(logging.WARNING):
        assert resolve_tag(cfg) == "global_step4"
    assert f"{bad} does not match its sha256" in caplog.text
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt does not match its sha256"):
        resolve_tag(CheckpointConfig(load=str(tmp_path), iteration=8, load_verify_checksums=True))
