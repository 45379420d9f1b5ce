"""The planner's per-rank parameter + optimizer memory against what real training runs hold (1 and 2 ranks,
ZeRO 0/1/3): the runs report ``memory/param_optimizer_bytes`` (measured from the DeepSpeed engine's tensors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.neox_arguments import NeoXArgs
from megatron.planner import Hardware, PlanInputs, build_plan
from megatron.planner.cli import resolve_vocab
from megatron.tokenizer import TokenizerConfig
from tests.distributed.fns_train import make_tiny_data, run_pretrain_many, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

STAGES = (0, 1, 3)
PIPE = 2  # rank 0 of 2 pipeline stages: stage 0, with the tied embedding
TAGS = ("param_optimizer_bytes", "param_bytes", "master_param_bytes", "optimizer_state_bytes", "grad_bytes")


def _tb_scalars(path: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(path), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [e.value for e in ea.Scalars(f"memory/{tag}")] for tag in TAGS}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("world", [1, 2])
def test_predicted_param_optimizer_memory_matches_training(data: dict[str, str], world: int, tmp_path: Path) -> None:
    cases = [(stage, 0, "fp32") for stage in STAGES]
    if world == 2:  # ZeRO-1 with a pipeline; bf16 ZeRO-3 (fp32 master partitions beside bf16 shards)
        cases += [(1, PIPE, "fp32"), (3, 0, "bfloat16")]
    configs = [
        tiny_config(
            data,
            world=world,
            train_iters=2,
            eval_interval=100,
            eval_iters=0,
            log_interval=1,
            zero_optimization={"stage": stage},
            pipe_parallel_size=pp,
            precision=precision,
            tensorboard_dir=str(tmp_path / f"tb{stage}_{pp}_{precision}"),
        )
        for stage, pp, precision in cases
    ]
    runs = run_distributed(run_pretrain_many, world, configs, timeout=400)[0]
    assert [(r["zero_stage"], r["params_dtype"]) for r in runs] == [(c[0], c[2].replace("fp", "float")) for c in cases]
    for (stage, pp, precision), config in zip(cases, configs, strict=True):
        measured = _tb_scalars(tmp_path / f"tb{stage}_{pp}_{precision}")
        assert all(len(v) == 1 for v in measured.values()), measured  # logged once, after the first step
        args = NeoXArgs.from_dict(config)
        _, padded, notes = resolve_vocab(TokenizerConfig.from_neox_args(args))
        assert notes == []  # the tiny tokenizer is read, no fallback
        plan = build_plan(PlanInputs.from_neox_args(args, padded), Hardware(gpus=world, gpus_per_node=world))
        predicted = plan.ranks[0]
        got = measured["param_optimizer_bytes"][0]
        assert got == sum(measured[t][0] for t in TAGS[1:4])
        assert predicted.param_optimizer == pytest.approx(got, rel=0.15), (
            stage,
            pp,
            precision,
            world,
            predicted,
            measured,
        )
        # The parts agree as well: weights, fp32 master copies and Adam moments.
        assert predicted.parameters == pytest.approx(measured["param_bytes"][0], rel=0.15)
        assert predicted.optimizer_states == pytest.approx(measured["optimizer_state_bytes"][0], rel=0.15)
        assert predicted.master_weights == pytest.approx(measured["master_param_bytes"][0], rel=0.15, abs=64)


def test_offloaded_optimizer_bytes_are_the_runs_host_side(data: dict[str, str], tmp_path: Path) -> None:
    """ZeRO-2 with ``offload_optimizer: {device: cpu}`` on 2 ranks (torch's AdamW stepped on the CPU:
    ``zero_force_ds_cpu_optimizer: false``): the plan moves the fp32 master partition and Adam's moments off the GPU,
    and their bytes are what the run's offloaded optimizer holds."""
    world, tb = 2, tmp_path / "tb_offload"
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    common = {"world": world, "train_iters": 2, "eval_interval": 100, "eval_iters": 0, "log_interval": 1}
    config = tiny_config(
        data,
        **common,
        zero_optimization=zero,
        deepspeed_extra_args={"zero_force_ds_cpu_optimizer": False},
        tensorboard_dir=str(tb),
    )
    runs = run_distributed(run_pretrain_many, world, [config], timeout=400)[0]
    assert runs[0]["zero_stage"] == 2
    measured = _tb_scalars(tb)
    args = NeoXArgs.from_dict(config)
    _, padded, _ = resolve_vocab(TokenizerConfig.from_neox_args(args))
    hw = Hardware(gpus=world, gpus_per_node=world)
    offloaded = build_plan(PlanInputs.from_neox_args(args, padded), hw).ranks[0]
    plain = NeoXArgs.from_dict({**config, "zero_optimization": {"stage": 2}})
    on_gpu = build_plan(PlanInputs.from_neox_args(plain, padded), hw).ranks[0]
    assert offloaded.master_weights == offloaded.optimizer_states == offloaded.gradients == 0
    moved = on_gpu.master_weights + on_gpu.optimizer_states
    got = measured["master_param_bytes"][0] + measured["optimizer_state_bytes"][0]
    assert moved == pytest.approx(got, rel=0.15), (offloaded, measured)
    # beside them the fp32 gradient partition (the run is fp32: the same bytes as its GPU-side partition), which is
    # what the run's gradients hold
    assert offloaded.host_bytes == moved + on_gpu.gradients
    assert on_gpu.gradients == pytest.approx(measured["grad_bytes"][0], rel=0.15)
