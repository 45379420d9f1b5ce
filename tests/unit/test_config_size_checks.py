"""The model-size checks of the config layer (megatron/neox_arguments/size_checks.py) against the planner's exact
arithmetic: the closed-form parameter count is a lower bound of the meta-device count (and close to it), the bytes
per parameter are the planner's layout, every shipped config passes at its own layout, an impossible one is refused
with the numbers in the message."""

from __future__ import annotations

import dataclasses
import glob
import itertools
import logging

import pytest

from megatron.model.config import GPTModelConfig
from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.size_checks import (
    NO_MACHINE,
    bytes_per_param,
    check_fits_machine,
    machine_memory,
    param_lower_bound,
    rank_bytes,
)
from megatron.planner import TrainingSetup
from megatron.planner.memory import bytes_per_param as planner_bytes_per_param
from megatron.planner.memory import rank_memory
from megatron.planner.params import count_params
from tests.unit.test_neox_args import CPU1, TINY

GiB = 2**30
EXACT = [
    "configs/125M.yml",
    "configs/125M-dmoe.yml",
    "configs/20B.yml",
    "configs/llama2/70B.yml",
    "configs/cpu/tiny.yml",
]
EXACT += ["configs/mistral/7B.yml", "configs/pythia/14M.yml"]


def _load(path: str, **overrides: object) -> NeoXArgs:
    logging.disable(logging.WARNING)
    try:
        return NeoXArgs.from_ymls([path], {"train_micro_batch_size_per_gpu": 1, **overrides})
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("path", EXACT)
def test_parameter_bound_is_below_the_planners_exact_count(path: str) -> None:
    args = _load(path, global_num_gpus=64)
    args.update_value("padded_vocab_size", 50304)
    exact = count_params(GPTModelConfig.from_neox_args(args), 1, 0).total
    bound = param_lower_bound(args)
    assert bound <= exact
    if not args.moe_num_experts > 1:  # MoE: one expert's MLP counted
        assert bound >= 0.98 * exact, (bound, exact)


def test_bytes_per_param_are_the_planners() -> None:
    args = NeoXArgs({**TINY, "global_num_gpus": 2}, env=CPU1)
    args.update_value("padded_vocab_size", 512)
    base = TrainingSetup.from_neox_args(args)
    grid = itertools.product(
        ("fp32", "fp16", "bfloat16"), range(4), (0, 2), (False, True), ("adam", "sgd", "madgrad_wd")
    )
    for precision, zero, pp, fp32_grads, optimizer in grid:
        setup = dataclasses.replace(
            base, precision=precision, zero_stage=zero, pp=pp, grad_accum_fp32=fp32_grads, optimizer_type=optimizer
        )
        ref = planner_bytes_per_param(setup)
        values = {"precision": precision, "zero_stage": zero, "pipe_parallel_size": pp, "optimizer_type": optimizer}
        values["data_types"] = {"grad_accum_dtype": "fp32" if fp32_grads else "bf16"}
        ours = bytes_per_param(type("V", (), values)())
        assert ours == (ref.weights, ref.master + ref.states, zero == 3, ref.master_sharded), (setup, ours)


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yml") + glob.glob("configs/*/*.yml")))
def test_shipped_configs_are_refused_only_when_the_planner_agrees(path: str) -> None:
    """Each shipped config at its own layout, 8-way data parallel, on 40 GB GPUs (GPT-NeoX's A100 defaults): refused
    only where the planner's exact per-rank weights + optimizer state exceed the GPU too (e.g. 175B.yml at TP 1). The
    CPU configs also fit this machine."""
    try:
        probe = _load(path, global_num_gpus=64)
    except ConfigError:
        pytest.skip("not a complete config on its own (a setup file)")
    if not probe.hidden_size:
        pytest.skip("no model")
    world = 8 * probe.model_parallel_size * max(probe.pipe_parallel_size, 1)
    args = _load(path, global_num_gpus=world)
    gpu = 40 * 10**9
    try:
        check_fits_machine(args, memory=(gpu, "GPU"))
    except ConfigError:
        args.update_value("padded_vocab_size", 50304)
        setup = TrainingSetup.from_neox_args(args)
        counts = count_params(GPTModelConfig.from_neox_args(args), setup.tp, setup.pp, args.pipe_partition_method)
        exact = max(rank_memory(setup, i, stage).param_optimizer for i, stage in enumerate(counts.stages))
        assert exact > gpu, f"{path}: refused although the planner gives {exact:.3e} bytes per rank"
    if path.startswith("configs/cpu/"):
        check_fits_machine(args)


def test_a_model_beyond_the_machine_is_refused_with_the_numbers() -> None:
    args = NeoXArgs({**TINY, "hidden_size": 2**20}, env=CPU1)
    with pytest.raises(ConfigError) as e:
        check_fits_machine(args, memory=(24 * GiB, "CPU"))
    assert str(e.value) == (
        "model too large: num_layers=2, hidden_size=1048576 give at least 2.64e+13 parameters, about 3.17e+14 bytes "
        "(294912.8 GiB) of weights and optimizer state per rank (tensor x pipeline parallel 1 x 1, ZeRO stage 0, "
        "fp32); this machine has 24.0 GiB of CPU memory. Use a smaller model, more tensor/pipeline-parallel ranks or "
        "ZeRO sharding"
    )
    # only the weights for generation; ranks started elsewhere: only beyond any machine
    with pytest.raises(ConfigError, match=r"of weights per rank"):
        check_fits_machine(args, training=False, memory=(24 * GiB, "CPU"))
    check_fits_machine(args, local=False)
    with pytest.raises(ConfigError, match="more than any single machine holds"):
        check_fits_machine(NeoXArgs({**TINY, "hidden_size": 2**24}, env=CPU1), local=False)


def test_margin_sharding_and_offload() -> None:
    args = NeoXArgs({**TINY, "hidden_size": 4096, "num_attention_heads": 32}, env=CPU1)
    need = rank_bytes(args, param_lower_bound(args), on_cpu=True)
    check_fits_machine(args, memory=(int(need / 2) + 1, "CPU"))  # up to twice the memory: allowed
    with pytest.raises(ConfigError):
        check_fits_machine(args, memory=(int(need / 2) - 1024, "CPU"))
    zero3 = NeoXArgs({**TINY, "zero_optimization": {"stage": 3}, "global_num_gpus": 4}, env=CPU1)
    plain = NeoXArgs({**TINY, "global_num_gpus": 4}, env=CPU1)
    assert rank_bytes(zero3, 10**6, on_cpu=True) == 10**6 * (4 + 8) / 4
    assert rank_bytes(plain, 10**6, on_cpu=True) == 10**6 * (4 + 8)
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    off = NeoXArgs({**TINY, "zero_optimization": offload, "precision": "bfloat16"}, env=CPU1)
    assert rank_bytes(off, 10**6, on_cpu=False) == 10**6 * 2  # on a GPU only the 16-bit weights stay
    assert rank_bytes(off, 10**6, on_cpu=True) == 10**6 * (2 + 4 + 8)


def test_machine_memory_on_cpu() -> None:
    available, kind = machine_memory()
    assert kind == "CPU" and GiB <= available < NO_MACHINE
