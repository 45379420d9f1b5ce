"""Activation checkpointing is configured once, outside the model constructors, from one config class."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron import mpu
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.activation_checkpointing import ActivationCheckpointConfig
from tests.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
OWNER = "megatron/model/activation_checkpointing.py"
# the one model-setup call (pretrain's setup_model_and_optimizer, before the model is built)
CALLERS = {"megatron/training/pretraining.py"}
STORAGE_KEYS = {
    "partition_activations",
    "contiguous_checkpointing",
    "checkpoint_in_cpu",
    "synchronize_each_layer",
    "profile_backward",
}


def _calls(path: Path) -> list[int]:
    """Lines calling ``configure_activation_checkpointing`` or DeepSpeed's ``checkpointing.configure``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.endswith("configure_activation_checkpointing") or name.endswith("checkpointing.configure"):
                lines.append(node.lineno)
    return lines


def test_configured_only_at_model_setup() -> None:
    found = {}
    for path in sorted(REPO.glob("megatron/**/*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel != OWNER and (lines := _calls(path)):
            found[rel] = lines
    assert set(found) == CALLERS, f"activation checkpointing configured outside model setup: {found}"
    assert len(found["megatron/training/pretraining.py"]) == 1


def test_storage_keys_declared_once() -> None:
    """The model config keeps what the model itself recomputes; DeepSpeed's storage keys live in one class."""
    model_fields = {f.name for f in dataclasses.fields(GPTModelConfig)}
    ckpt_fields = {f.name for f in dataclasses.fields(ActivationCheckpointConfig)}
    assert ckpt_fields >= STORAGE_KEYS
    assert not STORAGE_KEYS & model_fields, STORAGE_KEYS & model_fields
    assert {"checkpoint_activations", "checkpoint_num_layers"} <= model_fields


def _build_checkpointing_models() -> tuple[tuple, tuple]:
    """On a gloo rank (where the old constructors did configure DeepSpeed): the state before and after building."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    from megatron.model import build_pipeline_model

    mpu.initialize_model_parallel(1, 1)

    def state() -> tuple:
        return (ds_ckpt.PARTITION_ACTIVATIONS, ds_ckpt.CONTIGUOUS_CHECKPOINTING, ds_ckpt.num_layers, ds_ckpt.mpu)

    before = state()
    cfg = GPTModelConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        padded_vocab_size=32,
        max_position_embeddings=8,
        checkpoint_activations=True,
    )
    build_sequential_model(cfg)
    build_pipeline_model(cfg)
    return before, state()


def test_building_a_checkpointing_model_leaves_deepspeed_state_alone() -> None:
    [(before, after)] = run_distributed(_build_checkpointing_models, 1, timeout=240)
    assert after == before
