"""One owner of precision → dtype (``megatron.neox_arguments.precision``): every reader maps through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron.neox_arguments.precision import PRECISION_NAMES, dtype_of_precision

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", torch.float32),
        ("FP16", torch.float16),
        ("half", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
    ],
)
def test_dtype_of_precision(name: str, dtype: torch.dtype) -> None:
    assert dtype_of_precision(name) is dtype


def test_unknown_precision_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'fp8' is not one of fp32, float32"):
        dtype_of_precision("fp8")
    assert set(PRECISION_NAMES) >= {"fp32", "fp16", "bfloat16"}


def test_no_other_precision_to_dtype_table() -> None:
    """A dict literal mapping a precision name to ``torch.float16``/``torch.bfloat16`` outside the owner is a copy."""
    copies = []
    for path in sorted([*REPO.glob("megatron/**/*.py"), *REPO.glob("tools/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Dict):
                continue
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            values = {ast.unparse(v) for v in node.values}
            if keys & set(PRECISION_NAMES) and values & {"torch.float16", "torch.half", "torch.bfloat16"}:
                copies.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not copies, f"precision → dtype tables outside megatron/neox_arguments/precision.py: {copies}"
