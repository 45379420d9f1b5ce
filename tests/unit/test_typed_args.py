"""mypy sees every config key with its schema type: ``args.train_iters.upper()`` is a type error, not ``Any``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.derive import LaunchEnv
from megatron.neox_arguments.keys import FIELDS, HINTS
from megatron.neox_arguments.neox_args import RUNTIME_ATTRS
from megatron.neox_arguments.sections import SECTIONS, ModelArgs
from tests.harness import REPO_ROOT

_SNIPPET = """
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.sections import ModelArgs


def read(args: NeoXArgs) -> int:
    width: int = args.hidden_size  # a required key: int in every resolved config
    iters = args.train_iters
    heads: int = args.section(ModelArgs).num_attention_heads
    return width + (iters if iters is not None else 0) + args.train_batch_size + heads
"""
_BAD = """
from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.sections import ModelArgs


def read(args: NeoXArgs) -> None:
    args.train_iters.upper()
    args.hiden_size
    args.section(ModelArgs).hidden_size.upper()
"""


def _mypy(tmp_path: Path, source: str) -> tuple[int, str]:
    path = tmp_path / "snippet.py"
    path.write_text(source, encoding="utf-8")
    # the project's settings and its cache (.mypy_cache): warm, this checks one file in seconds
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--no-error-summary", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out.returncode, out.stdout + out.stderr


def test_mypy_checks_each_key_read(tmp_path: Path) -> None:
    rc, out = _mypy(tmp_path, _SNIPPET)
    assert rc == 0, out
    rc, out = _mypy(tmp_path, _BAD)
    assert rc == 1, out
    assert 'snippet.py:7: error: Item "int" of "int | None" has no attribute "upper"' in out, out
    assert 'snippet.py:8: error: "NeoXArgs" has no attribute "hiden_size"' in out, out
    assert 'snippet.py:9: error: "int" has no attribute "upper"' in out, out


def test_the_type_checker_base_has_every_key_once() -> None:
    """NeoXArgs's static type inherits every section dataclass (neox_args._SchemaKeys, seen only by mypy): the list
    of bases there must name every section, so a new section's keys are typed too."""
    source = (REPO_ROOT / "megatron/neox_arguments/neox_args.py").read_text(encoding="utf-8")
    block = source.split("class _SchemaKeys(", 1)[1].split("):", 1)[0]
    bases = [b.strip() for b in block.split(",") if b.strip()]
    assert sorted(bases) == sorted(cls.__name__ for cls in SECTIONS.values())
    typed_block = source.split("class _SchemaKeys(", 1)[1].split("\nelse:", 1)[0]
    assert all(f"{name}: Any" in typed_block for name in RUNTIME_ATTRS)
    assert "if not TYPE_CHECKING:  # hidden from mypy" in source and hasattr(NeoXArgs, "__getattr__")


def _resolved() -> NeoXArgs:
    return NeoXArgs(
        {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "seq_length": 32,
            "max_position_embeddings": 32,
            "train_micro_batch_size_per_gpu": 2,
        },
        env=LaunchEnv(world_size=None, on_cpu=True),
    )


def test_a_key_without_none_in_its_type_is_set_in_every_resolved_config() -> None:
    """A required or derived key whose default is None (unset) is typed with its resolved type (``int``, not
    ``int | None``): validation or derive() give it a value, so reads need no ``int(args.x)`` or ``or default``."""
    args = _resolved()
    unset = []
    for section in SECTIONS.values():
        for f in dataclasses.fields(section):
            hint = HINTS[f.name]
            nullable = hint is typing.Any or type(None) in typing.get_args(hint)
            if not nullable and getattr(args, f.name) is None:
                unset.append(f.name)
    assert not unset, f"keys typed without None but unset in a resolved config: {unset}"
    assert FIELDS["train_batch_size"].default is None and HINTS["train_batch_size"] is int


def test_section_gives_the_live_typed_section() -> None:
    args = _resolved()
    model = args.section(ModelArgs)
    assert isinstance(model, ModelArgs) and model.hidden_size == 64
    args.update_value("hidden_size", 128)
    assert args.section(ModelArgs).hidden_size == 128
    with pytest.raises(TypeError, match="LaunchEnv is not a config section; expected one of ParallelismArgs"):
        args.section(LaunchEnv)


def test_derived_is_a_copy_and_leaves_the_validated_arguments_alone() -> None:
    args = _resolved()
    before = args.to_dict()
    tokenizer = object()
    run = args.derived(tokenizer=tokenizer, padded_vocab_size=50304, train_iters=7)
    assert (run.padded_vocab_size, run.train_iters, run.tokenizer) == (50304, 7, tokenizer)
    assert run.hidden_size == args.hidden_size and run.origins == args.origins
    assert args.to_dict() == before and args.tokenizer is None  # the caller's object is unchanged
    run.update_value("hidden_size", 128)  # and the copy does not share its sections
    assert args.hidden_size == before["hidden_size"]
    with pytest.raises(ValueError, match="update_value: train_iters='x': expected"):
        args.derived(train_iters="x")
    with pytest.raises(ValueError, match="trian_iters"):
        args.derived(trian_iters=1)


def test_null_for_a_derived_or_required_key_means_unset() -> None:
    # GPT-NeoX configs write `gradient_accumulation_steps: null`: derived as if it were not given
    args = NeoXArgs(
        {**_resolved().to_dict(), "train_batch_size": None, "gradient_accumulation_steps": None},
        env=LaunchEnv(world_size=None, on_cpu=True),
    )
    assert (args.train_batch_size, args.gradient_accumulation_steps) == (2, 1)
