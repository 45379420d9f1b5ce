"""Settings inside dict-valued keys (``optimizer.params``, ``zero_optimization`` and its ``offload_*`` blocks,
``fp16``/``bf16``, ``activation_checkpointing``, ``scheduler.params``, and the same inside ``deepspeed_extra_args``)
are type- and range-checked before anything is derived (megatron/neox_arguments/nested_checks.py), every problem in
the one ConfigError. The tables are compared with their judges: the real optimizer constructors and DeepSpeed's own
pydantic config classes (which we are never looser than)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from megatron.neox_arguments import ConfigError, NeoXArgs
from megatron.neox_arguments.nested_checks import NESTED, OPTIMIZER_PARAMS, nested_problems
from megatron.neox_arguments.number_checks import huge_int_problems, walk
from megatron.training.optim_algorithms import MADGRAD, SM3, Lion
from megatron.training.optimizer_config import OptimizerConfig
from tests.unit.test_neox_args import TINY, build, problems

ADAM = {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8}}


def _adam(**params: Any) -> dict[str, Any]:
    return {"optimizer": {"type": "Adam", "params": {**ADAM["params"], **params}}}


def _zero(**block: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": 1, **block}}


def _fp16(**block: Any) -> dict[str, Any]:
    return {"fp16": {"enabled": True, **block}}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # the three the fuzz test found accepted with exit 0
        (_adam(betas="abc"), "optimizer.params.betas='abc' must be two numbers in [0, 1), e.g. [0.9, 0.95]"),
        (_zero(reduce_bucket_size="5e8"), "zero_optimization.reduce_bucket_size='5e8' must be an integer >= 1"),
        (
            {"deepspeed_extra_args": {"zero_optimization": {"stage": "x"}}},
            "deepspeed_extra_args.zero_optimization.stage='x' must be 0, 1, 2 or 3",
        ),
        # optimizer.params
        (_adam(betas=[0.9]), "optimizer.params.betas=[0.9] must be two numbers in [0, 1)"),
        (_adam(betas=[0.9, "x"]), "optimizer.params.betas[1]='x' must be a finite number in [0, 1)"),
        (_adam(betas=[0.9, True]), "optimizer.params.betas[1]=True must be a finite number in [0, 1)"),
        (_adam(betas=None), "optimizer.params.betas=None must be two numbers"),
        (_adam(eps=0), "optimizer.params.eps=0 must be > 0"),
        (_adam(eps="tiny"), "optimizer.params.eps='tiny' must be a finite number > 0"),
        (_adam(eps="1.0e_8"), "optimizer.params.eps='1.0e_8' must be a finite number > 0"),  # gmlp_small.yml's typo
        (_adam(eps=[1e-8]), "optimizer.params.eps=[1e-08] must be a finite number > 0"),
        (_adam(amsgrad="yes"), "optimizer.params.amsgrad='yes' must be true or false"),
        (_adam(fused=1), "optimizer.params.fused=1 must be true or false"),
        (_adam(momentum=0.9), "optimizer.params.momentum: not a parameter of optimizer type 'Adam'; it takes"),
        (
            {"optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": -0.5}}},
            "optimizer.params.momentum=-0.5 must be >= 0",
        ),
        (
            {"optimizer": {"type": "sgd", "params": {"lr": 0.1, "nesterov": "true"}}},
            "optimizer.params.nesterov='true' must be true or false",
        ),
        (
            {"optimizer": {"type": "sgd", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}},
            "optimizer.params.betas: not a parameter of optimizer type 'sgd'; it takes dampening, differentiable",
        ),
        (
            {"optimizer": {"type": "sm3", "params": {"lr": 0.1, "beta": 1.0}}},
            "optimizer.params.beta=1.0 must be in [0, 1)",
        ),
        # zero_optimization and its offload blocks
        (_zero(reduce_bucket_size=5.5e8 + 0.5), "zero_optimization.reduce_bucket_size=550000000.5 must be an integer"),
        (_zero(allgather_bucket_size=True), "zero_optimization.allgather_bucket_size=True must be an integer >= 1"),
        (_zero(allgather_bucket_size=None), "zero_optimization.allgather_bucket_size=None must be an integer >= 1"),
        (_zero(stage3_max_live_parameters=-1), "zero_optimization.stage3_max_live_parameters=-1 must be an integer"),
        (_zero(stage=1.0), "zero_optimization.stage=1.0 must be 0, 1, 2 or 3"),
        (_zero(overlap_comm="yes"), "zero_optimization.overlap_comm='yes' must be true or false"),
        (_zero(contiguous_gradients=1), "zero_optimization.contiguous_gradients=1 must be true or false"),
        (_zero(offload_optimizer={"device": "gpu"}), "zero_optimization.offload_optimizer.device='gpu' must be one of"),
        (_zero(offload_param={"buffer_count": "4"}), "zero_optimization.offload_param.buffer_count='4' must be an"),
        (_zero(offload_optimizer={"ratio": 1.5}), "zero_optimization.offload_optimizer.ratio=1.5 must be between 0"),
        (_zero(offload_param={"pin_memory": "on"}), "zero_optimization.offload_param.pin_memory='on' must be true"),
        # fp16 / bf16
        (_fp16(loss_scale=-1), "fp16.loss_scale=-1 must be >= 0"),
        (_fp16(loss_scale="dynamic"), "fp16.loss_scale='dynamic' must be a finite number >= 0"),
        (_fp16(initial_scale_power=12.5), "fp16.initial_scale_power=12.5 must be an integer >= 0"),
        (_fp16(initial_scale_power="12"), "fp16.initial_scale_power='12' must be an integer >= 0"),
        (_fp16(hysteresis=0), "fp16.hysteresis=0 must be an integer >= 1"),
        (_fp16(loss_scale_window=float("inf")), "fp16.loss_scale_window=inf must be a finite number"),
        (_fp16(min_loss_scale=0), "fp16.min_loss_scale=0 must be an integer >= 1"),
        (_fp16(auto_cast="no"), "fp16.auto_cast='no' must be true or false"),
        ({"bf16": {"enabled": "true"}}, "bf16.enabled='true' must be true or false"),
        # activation checkpointing, scheduler
        (
            {"activation_checkpointing": {"number_checkpoints": 0}},
            "activation_checkpointing.number_checkpoints=0 must be an integer >= 1",
        ),
        (
            {"activation_checkpointing": {"cpu_checkpointing": "y"}},
            "activation_checkpointing.cpu_checkpointing='y' must be true or false",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1.5}}},
            "scheduler.params.warmup_num_steps=1.5 must be an integer >= 0",
        ),
        # the same rules inside deepspeed_extra_args
        (
            {"deepspeed_extra_args": {"zero_optimization": {"reduce_bucket_size": "5e8"}}},
            "deepspeed_extra_args.zero_optimization.reduce_bucket_size='5e8' must be an integer >= 1",
        ),
        (
            {"deepspeed_extra_args": {"bf16": {"enabled": "false"}}},
            "deepspeed_extra_args.bf16.enabled='false' must be true or false",
        ),
        (
            {"deepspeed_extra_args": {"gradient_clipping": "1.0"}},
            "deepspeed_extra_args.gradient_clipping='1.0' must be a finite number >= 0",
        ),
    ],
)
def test_hostile_nested_values_are_refused(overrides: dict[str, Any], expected: str) -> None:
    found = problems(**overrides)
    assert any(p.startswith(expected) for p in found), found


def test_every_problem_is_reported_together() -> None:
    found = problems(**_adam(betas="abc", eps=-1), **_zero(reduce_bucket_size="5e8", overlap_comm="x"))
    assert len(found) == 4, found
    assert all("\n" not in p for p in found)


def test_message_names_the_file(tmp_path: Any) -> None:
    from tests.unit.test_neox_args import write

    text = (
        "".join(f"{k}: {v}\n" for k, v in TINY.items()) + "zero_optimization: {stage: 1, reduce_bucket_size: '5e8'}\n"
    )
    with pytest.raises(ConfigError) as e:
        NeoXArgs.from_ymls([write(tmp_path, "a.yml", text)])
    path = tmp_path / "a.yml"
    assert str(e.value) == f"zero_optimization.reduce_bucket_size='5e8' must be an integer >= 1 (set in {path})"


@pytest.mark.parametrize(
    "overrides",
    [
        _zero(reduce_bucket_size=5.0e8, allgather_bucket_size=500000000),  # an integral float: DeepSpeed converts it
        _zero(overlap_comm=None, offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 0.5}),
        _adam(eps="1e-8", lr="6e-4"),  # numbers written as strings: the optimizer builder converts them
        _fp16(loss_scale=0, initial_scale_power=12, loss_scale_window=1000, hysteresis=2, min_loss_scale=1),
        {"bf16": {"enabled": True, "loss_scale": 0, "hysteresis": 2}},  # GPT-NeoX's bf16 blocks
        {"optimizer": {"type": "lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99]}}},
    ],
)
def test_valid_nested_values_pass(overrides: dict[str, Any]) -> None:
    ds = build(**overrides).deepspeed_config  # accepted, and handed to DeepSpeed as written
    assert all(ds[key][name] == v for key, block in overrides.items() for name, v in block.items()), ds


def test_numbers_written_as_strings_reach_the_optimizer_as_floats() -> None:
    cfg = OptimizerConfig(optimizer=_adam(eps="1e-8", amsgrad=False)["optimizer"], optimizer_type="adam")
    assert cfg.params == {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8, "amsgrad": False}


# ---------------------------------------------------------------- the tables against their judges


def _constructor_params(kind: str) -> set[str]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    constructors: dict[str, Any] = {
        "adam": torch.optim.AdamW,
        "cpu_adam": DeepSpeedCPUAdam,
        "cpu_torch_adam": DeepSpeedCPUAdam,
        "sgd": torch.optim.SGD,
        "sm3": SM3,
        "madgrad_wd": MADGRAD,
        "lion": Lion,
    }
    return set(inspect.signature(constructors[kind]).parameters) - {"params", "model_params"}


@pytest.mark.parametrize("kind", sorted(set(OPTIMIZER_PARAMS) - {"onebitadam"}))  # not in this DeepSpeed version
def test_optimizer_params_are_the_constructors(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every argument the factory's constructor takes, and no other (``adam``: also the two keys that select
    DeepSpeed's FusedAdam, which the factory reads itself)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    expected = _constructor_params(kind) | ({"torch_adam", "adam_w_mode"} if kind == "adam" else set())
    assert set(OPTIMIZER_PARAMS[kind]) == expected
    assert all(("optimizer", "params", name) in NESTED for name in OPTIMIZER_PARAMS[kind])


def test_the_registered_optimizers_all_have_params() -> None:
    from megatron.training.optimizer_registry import OPTIMIZERS

    assert set(OPTIMIZERS.names()) == set(OPTIMIZER_PARAMS)


PROBES: list[Any] = [True, False, None, 0, 1, 4, -1, 1.0, 5.0e8, 0.5, 1.5, "1", "5e8", "yes", "cpu", [1], {}]
# keys of our tables DeepSpeed's classes do not have: DeeperSpeed's spellings GPT-NeoX configs carry (dropped before
# DeepSpeed sees them); and the fp16 keys GPT-NeoX writes into bf16 blocks (below)
NOT_DEEPSPEED = {("fp16", "fp16"), ("fp16", "type")}


def _deepspeed_classes() -> dict[tuple[str, ...], Any]:
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    return {
        ("zero_optimization",): DeepSpeedZeroConfig,
        ("zero_optimization", "offload_param"): DeepSpeedZeroOffloadParamConfig,
        ("zero_optimization", "offload_optimizer"): DeepSpeedZeroOffloadOptimizerConfig,
        ("fp16",): DeepSpeedFP16Config,
        ("bf16",): DeepSpeedBF16Config,
    }


def test_never_looser_than_deepspeeds_own_config_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rule of a DeepSpeed block names a field of DeepSpeed's pydantic class (by name or alias), and every
    probe value the rule accepts, DeepSpeed accepts too: what passes here does not fail on the ranks."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from pydantic import ValidationError

    unknown, looser = [], []
    for block, cls in _deepspeed_classes().items():
        fields = {info.alias or name for name, info in cls.model_fields.items()} | set(cls.model_fields)
        for path, rule in NESTED.items():
            if path[:-1] != block:
                continue
            if path[-1] not in fields:
                unknown.append(path)
                continue
            for probe in PROBES:
                if path[-1] == "stage" and isinstance(probe, list):
                    continue  # autotuning's search space: DeepSpeed's autotuner expands it first
                if rule(".".join(path), probe):
                    continue  # refused by us
                base = {"stage": 1} if block == ("zero_optimization",) else {}  # compute_grad_norm: stage 1/2 only
                try:
                    cls(**{**base, path[-1]: probe})
                except ValidationError:
                    looser.append(f"{'.'.join(path)}={probe!r}")
    bf16_from_fp16 = {p for p in unknown if p[0] == "bf16" and ("fp16", p[1]) in NESTED}
    assert set(unknown) - bf16_from_fp16 == NOT_DEEPSPEED
    assert not looser, looser


def test_the_walk_enters_each_container_once_and_not_where_told() -> None:
    """number_checks.walk, which the nested checks and the 64-bit check both use: a recursive or shared container
    (``from_dict`` takes Python objects) is entered once, and a value a rule checks whole is not entered."""
    loop: list[Any] = [float("nan"), 2**70]
    loop.append(loop)
    shared = {"stage": "x"}
    value = {"zero_optimization": {"extra": loop, "offload_param": shared}, "more": [shared, shared]}
    zo = ("zero_optimization",)
    assert [p for p, _ in walk(value)] == [
        (), zo, (*zo, "extra"), (*zo, "extra", 0), (*zo, "extra", 1), (*zo, "extra", 2),
        (*zo, "offload_param"), (*zo, "offload_param", "stage"), ("more",), ("more", 0), ("more", 1),
    ]  # fmt: skip
    pruned = [p for p, _ in walk(value, enter=lambda path, _: path != zo)]
    assert pruned == [(), zo, ("more",), ("more", 0), ("more", 0, "stage"), ("more", 1)]
    config = {"zero_optimization": value["zero_optimization"], "deepspeed_extra_args": {"zero_optimization": shared}}
    config["deepspeed_extra_args"]["again"] = [shared, loop]
    assert nested_problems(config, {"zero_optimization": "a.yml"}) == [
        "zero_optimization.extra[0]=nan must be a finite number (set in a.yml)",
        "deepspeed_extra_args.zero_optimization.stage='x' must be 0, 1, 2 or 3",
        "deepspeed_extra_args.again[1][0]=nan must be a finite number",
    ]
    assert huge_int_problems(config, {}) == [
        "zero_optimization.extra[1]=<an integer of about 21 digits> is too large: integers must fit in 64 bits "
        f"(at most {2**63 - 1})",
        "deepspeed_extra_args.again[1][1]=<an integer of about 21 digits> is too large: integers must fit in 64 bits "
        f"(at most {2**63 - 1})",
    ]
