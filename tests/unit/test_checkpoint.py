"""Checkpoint schedule, naming, retention and tag resolution (no engine needed)."""

from __future__ import annotations

import pytest

from megatron.checkpoint import CheckpointConfig, checkpoint_tag, is_save_iter
from megatron.checkpoint.commit import delete_old_checkpoints
from megatron.checkpoint.load import check_checkpoint_args
from megatron.checkpoint.resume import resolve_tag
from megatron.checkpoint.tags import checkpoint_dirs
from megatron.neox_arguments import neox_namespace


def test_tag_and_linear_schedule() -> None:
    assert checkpoint_tag(120) == "global_step120"
    cfg = CheckpointConfig(save="x", checkpoint_factor=50, extra_save_iters=[7])
    assert [i for i in range(0, 201) if is_save_iter(i, cfg)] == [7, 50, 100, 150, 200]


def test_log_schedule() -> None:
    cfg = CheckpointConfig(save="x", checkpoint_factor=2, checkpoint_scale="log")
    assert [i for i in range(0, 70) if is_save_iter(i, cfg)] == [1, 2, 4, 8, 16, 32, 64]
    cfg = CheckpointConfig(save="x", checkpoint_factor=3.5, checkpoint_scale="log")
    assert [i for i in range(0, 200) if is_save_iter(i, cfg)] == [1, 3, 12, 42, 150]  # int(3.5**k)


def test_extra_save_iters_only_and_step_zero() -> None:
    cfg = CheckpointConfig(save="x", extra_save_iters=[0, 5])
    assert is_save_iter(0, cfg) and is_save_iter(5, cfg) and not is_save_iter(10, cfg)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="checkpoint_factor nor extra_save_iters"):
        CheckpointConfig.from_neox_args(neox_namespace(save="ckpt"))
    with pytest.raises(ValueError, match="positive integer"):
        CheckpointConfig.from_neox_args(neox_namespace(save="ckpt", checkpoint_factor=2.5))
    with pytest.raises(ValueError, match="> 1 with log"):
        CheckpointConfig.from_neox_args(neox_namespace(save="c", checkpoint_factor=1, checkpoint_scale="log"))
    with pytest.raises(ValueError, match="checkpoint_scale"):
        CheckpointConfig.from_neox_args(neox_namespace(checkpoint_scale="exp"))
    cfg = CheckpointConfig.from_neox_args(neox_namespace(save="c", checkpoint_factor=10, extra_save_iters=None))
    assert cfg.extra_save_iters == [] and cfg.checkpoint_scale == "linear"


def test_retention_keeps_newest_in_natural_order(tmp_path) -> None:
    for step in (5, 10, 50, 100, 1000):
        (tmp_path / f"global_step{step}").mkdir()
    (tmp_path / "latest").write_text("global_step1000")
    assert [p.name for p in checkpoint_dirs(tmp_path)][-2:] == ["global_step100", "global_step1000"]
    deleted = delete_old_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["global_step5", "global_step10", "global_step50"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step100", "global_step1000", "latest"]


def test_resolve_tag(tmp_path) -> None:
    cfg = CheckpointConfig(load=str(tmp_path))
    assert resolve_tag(cfg) is None  # empty dir → fresh start
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step8").mkdir()
    (tmp_path / "latest").write_text("global_step8\n")
    assert resolve_tag(cfg) == "global_step8"
    assert resolve_tag(CheckpointConfig(load=str(tmp_path), iteration=4)) == "global_step4"
    with pytest.raises(ValueError, match="available: global_step4, global_step8"):
        resolve_tag(CheckpointConfig(load=str(tmp_path), iteration=6))
    (tmp_path / "latest").write_text("global_step12")  # names a missing folder: the newest older one is used
    assert resolve_tag(cfg) == "global_step8"
    (tmp_path / "global_step4").rmdir()
    (tmp_path / "global_step8").rmdir()
    with pytest.raises(ValueError, match="neither it nor an older checkpoint is valid"):
        resolve_tag(cfg)


def test_check_checkpoint_args() -> None:
    saved = {"num_layers": 2, "hidden_size": 64, "padded_vocab_size": 512}
    check_checkpoint_args(saved, dict(saved), "p")
    with pytest.raises(ValueError, match="hidden_size: checkpoint 64 vs config 128"):
        check_checkpoint_args(saved, {**saved, "hidden_size": 128}, "p")


def test_verify_manifest(tmp_path) -> None:
    import json

    from megatron.checkpoint.resume import verify_manifest

    verify_manifest(tmp_path)  # no manifest (e.g. a GPT-NeoX checkpoint): nothing to check
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"x")
    files = ["configs/a.yml", "manifest.json", "mp_rank_00_model_states.pt"]
    (tmp_path / "manifest.json").write_text(json.dumps({"tag": "global_step1", "iteration": 1, "files": files}))
    with pytest.raises(ValueError, match=r"incomplete: .*configs/a\.yml is missing"):
        verify_manifest(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yml").write_text("{}")
    verify_manifest(tmp_path)
