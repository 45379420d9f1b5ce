"""``RunPlan``: the run's shape is decided once from the validated NeoXArgs, and ``pretrain()`` reads only it."""

from __future__ import annotations

import ast
import dataclasses
import logging
from typing import Any

import pytest
import torch

from megatron.neox_arguments import LaunchEnv, NeoXArgs
from megatron.training.run_plan import RunPlan
from tests.harness import REPO_ROOT

BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "train_iters": 4,
    "train_micro_batch_size_per_gpu": 2,
    "global_num_gpus": 2,
}


def _plan(**values: Any) -> RunPlan:
    return RunPlan.from_neox_args(NeoXArgs({**BASE, **values}, env=LaunchEnv(world_size=None, on_cpu=True)))


def test_sequential_fp32_defaults() -> None:
    plan = _plan()
    assert (plan.pipeline, plan.step_variant, plan.precision) == (False, "sequential", "fp32")
    assert plan.params_dtype == torch.float32 and plan.train_impl == "normal" and not plan.reward_head
    assert (plan.train_batch_size, plan.gradient_accumulation_steps, plan.seq_length) == (4, 1, 32)


def test_pipeline_precision_and_zero_come_from_the_derived_keys() -> None:
    plan = _plan(pipe_parallel_size=2, fp16={"enabled": True}, gradient_accumulation_steps=2)
    assert plan.pipeline and plan.step_variant == "pipe"
    assert plan.precision == "fp16" and plan.params_dtype == torch.float16
    fp16_pipe = {**BASE, "pipe_parallel_size": 2, "fp16": {"enabled": True}}
    assert NeoXArgs(fp16_pipe, env=LaunchEnv(world_size=None, on_cpu=True)).zero_stage == 1  # derive.py (GPT-NeoX)
    assert plan.gradient_accumulation_steps == 2 and plan.train_batch_size == 4  # 2 micro x 2 gas x 1 DP rank
    assert _plan(pipe_parallel_size=1).pipeline  # one stage still runs the pipeline engine
    assert _plan(bf16={"enabled": True}, zero_optimization={"stage": 2}).params_dtype == torch.bfloat16


@pytest.mark.parametrize("impl", ["dpo", "kto", "rm"])
def test_post_training_objectives(impl: str) -> None:
    data = {"pos_train_data_paths": ["pos"], "neg_train_data_paths": ["neg"], "dataset_impl": "pairwise"}
    if impl == "kto":
        data = {f"{split}_data_paths": ["docs"] for split in ("train", "valid", "test")}
        data["train_reward_data_paths"] = ["rewards"]
    plan = _plan(train_impl=impl, pack_impl="unpacked", **data)
    assert plan.step_variant == "post_training" and plan.train_impl == impl
    assert plan.reward_head == (impl == "rm")


def test_forward_validation_is_off_under_pipelines(caplog: pytest.LogCaptureFixture) -> None:
    assert _plan(checkpoint_validation_with_forward_pass=True).validate_with_forward
    with caplog.at_level(logging.WARNING, logger="megatron.train"):
        assert not _plan(checkpoint_validation_with_forward_pass=True, pipe_parallel_size=1).validate_with_forward
    assert "not supported with pipe_parallel_size" in caplog.text


def test_pretrain_decides_the_shape_only_through_the_plan() -> None:
    """pretraining.py reads none of the keys the plan decides from ``args``: each decision lives in run_plan.py."""
    decided = {"pipe_parallel_size", "is_pipe_parallel", "train_impl", "precision", "zero_stage", "fp16", "bf16"}
    decided |= {"checkpoint_validation_with_forward_pass", "gradient_accumulation_steps", "train_batch_size"}
    tree = ast.parse((REPO_ROOT / "megatron" / "training" / "pretraining.py").read_text())
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "args"}
    read |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not decided & read, f"pretraining.py decides {sorted(decided & read)} itself instead of reading the RunPlan"


def plan_reads(source: str, *, self_is_plan: bool = False) -> set[str]:
    """Attributes read from a ``RunPlan``: a parameter annotated ``RunPlan`` or a name bound to
    ``RunPlan.from_neox_args(...)``, per function (and ``self`` in run_plan.py: what its properties derive from)."""
    read: set[str] = set()
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = fn.args
        names = {
            p.arg
            for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]
            if p.annotation is not None and ast.unparse(p.annotation) == "RunPlan"
        }
        names |= {"self"} if self_is_plan else set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and ast.unparse(node.value).startswith("RunPlan.from_neox_args("):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        read |= {
            n.attr
            for n in ast.walk(fn)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in names
        }
    return read


def test_every_field_of_the_plan_has_a_reader() -> None:
    """A decision nobody reads is not a decision: each field and property of RunPlan is read in megatron/."""
    # keys RunPlan carries only because the key group it inherits holds them (SequenceKeys, BatchSizeKeys)
    carried = {"max_position_embeddings", "train_micro_batch_size_per_gpu"}
    members = {f.name for f in dataclasses.fields(RunPlan)} - carried | {
        n for n, v in vars(RunPlan).items() if isinstance(v, property)
    }
    read: set[str] = set()
    for path in (REPO_ROOT / "megatron").rglob("*.py"):
        read |= plan_reads(path.read_text(), self_is_plan=path.name == "run_plan.py")
    assert members <= read, f"RunPlan members nobody reads: {sorted(members - read)}"
    sample = "def f(plan: RunPlan, cfg: X):\n    plan.pipeline, cfg.zero_stage\ndef g(args):\n    p = RunPlan.from_neox_args(args)\n    p.seq_length"
    assert plan_reads(sample) == {"pipeline", "seq_length"}
