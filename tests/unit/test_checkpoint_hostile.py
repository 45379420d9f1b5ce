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
