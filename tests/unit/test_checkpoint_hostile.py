"""Unit checks of the hostile-checkpoint guards: the non-finite test (no false positive on a finite overflow of the
fast sum) and the checkpoint folder names ``latest`` may hold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpoint.finite import nonfinite_message, nonfinite_tensor
from megatron.checkpoint.layout import CheckpointError, checkpoint_folder


def test_nonfinite_tensor_finds_nan_and_inf_but_not_a_large_finite_sum() -> None:
    big = torch.full((4,), 3.0e38)  # its fp32 sum overflows to inf, yet every value is finite
    assert nonfinite_tensor([("big", big), ("half", torch.full((8,), 60000.0, dtype=torch.float16))]) is None
    assert (
        nonfinite_tensor([("ints", torch.tensor([1, 2])), ("x.rotary_emb.inv_freq", torch.tensor([float("inf")]))])
        is None
    )
    nan = torch.zeros(3, 3, dtype=torch.bfloat16)
    nan[1, 1] = float("nan")
    assert nonfinite_tensor([("ok", big), ("w", nan)]) == ("w", 1, 9)
    found = nonfinite_tensor([("w", torch.tensor([float("inf"), -float("inf")]))])
    assert found is not None and nonfinite_message("f.pt", found).startswith(
        "f.pt: tensor w holds 2 NaN/inf value(s) of 2; "
    )


@pytest.mark.parametrize("tag", ["", ".", "..", "a/b", "a\\b", "../x"])
def test_checkpoint_folder_refuses_names_that_are_not_one_folder(tmp_path: Path, tag: str) -> None:
    with pytest.raises(CheckpointError, match="is not a checkpoint folder name"):
        checkpoint_folder(tmp_path, tag, "latest")


def test_checkpoint_folder_follows_symlinks_only_inside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "global_step1").mkdir(parents=True)
    outside.mkdir()
    (root / "global_step2").symlink_to(root / "global_step1")  # inside: allowed
    (root / "global_step3").symlink_to(outside)
    assert checkpoint_folder(root, "global_step2", "latest") == root / "global_step2"
    with pytest.raises(CheckpointError, match=f"is a symlink to {outside}, outside {root}"):
        checkpoint_folder(root, "global_step3", "latest")


@pytest.mark.parametrize("tag", ["global_step1\0", "g" * 300])
def test_latest_with_a_nul_byte_or_an_overlong_name_is_one_line(tmp_path: Path, tag: str) -> None:
    from megatron.checkpoint.layout import read_latest

    (tmp_path / "latest").write_text(tag)
    with pytest.raises(CheckpointError, match="is not a checkpoint folder name") as raised:
        read_latest(tmp_path)
    assert len(str(raised.value)) < 400 and "\n" not in str(raised.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"num_layers": 2'])
def test_unreadable_resolved_config_is_one_line_naming_it(tmp_path: Path, text: str) -> None:
    from megatron.checkpoint.config_io import RESOLVED, checkpoint_config_args

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / RESOLVED).write_text(text)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'configs' / RESOLVED}"):
        checkpoint_config_args(tmp_path)


def test_a_pickled_value_of_another_type_is_one_line_naming_the_checkpoint(tmp_path: Path) -> None:
    """What the fuzz test found: a ZeRO shard whose fragment address is a string ended in an AttributeError."""
    from megatron.checkpoint.structure import checkpoint_structure

    expected = r"^ckpt/global_step2 does not hold the structure of a DeepSpeed .*\(AttributeError: 'str' object has"
    with pytest.raises(CheckpointError, match=expected), checkpoint_structure("ckpt/global_step2"):
        _ = "../../etc/passwd".start  # type: ignore[attr-defined]
    with pytest.raises(CheckpointError, match=r"^as it was$"), checkpoint_structure("ckpt"):
        raise CheckpointError("as it was")  # one-line errors pass unchanged
