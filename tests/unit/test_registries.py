"""The registries of optimizers, activations, norms, position embeddings and LR schedules (``megatron/registry.py``).

The config schema's ``Literal`` types (the config layer cannot import torch-level code) must name exactly the
registered entries; an unknown name is refused with the valid ones listed, at config validation and below it; a
toy activation, a toy optimizer and a toy LR schedule registered by a test train for real through the DeepSpeed
engine; and the
optimizer's param groups and the checkpoint resharder agree on which parameters get no weight decay.
"""

from __future__ import annotations

import typing
from typing import Any

import pytest
import torch

from megatron import mpu
from megatron.checkpoint.optimizer_state import _grouped, model_param_names
from megatron.model import GPTModelConfig, build_sequential_model, cross_entropy
from megatron.model.activations import ACTIVATIONS, ActivationSpec
from megatron.model.norms import NORMS
from megatron.model.positional_embeddings import POSITION_EMBEDDINGS
from megatron.model.weight_decay import model_no_weight_decay_names
from megatron.neox_arguments import ConfigError, NeoXArgs, size_checks
from megatron.neox_arguments.sections import model as model_keys
from megatron.neox_arguments.sections import optimizer as optimizer_keys
from megatron.planner import TrainingSetup
from megatron.planner.memory import bytes_per_param
from megatron.registry import Registry
from megatron.training.learning_rates import AnnealingLR, LRScheduleConfig
from megatron.training.lr_schedules import LR_SCHEDULES, DecayPoint
from megatron.training.optimizer_registry import OPTIMIZERS, OptimizerSpec
from megatron.training.optimizers import (
    OptimizerConfig,
    build_optimizer,
    deepspeed_config_for,
    weight_decay_param_groups,
)
from tests.harness import run_distributed
from tests.unit.test_neox_args import CPU1, TINY

V = 64
SCHEMA: list[tuple[str, Any, Registry[Any]]] = [
    ("activation", model_keys.ACTIVATIONS, ACTIVATIONS),
    ("norm", model_keys.NORMS, NORMS),
    ("pos_emb", model_keys.POS_EMBS, POSITION_EMBEDDINGS),
    ("optimizer.type", optimizer_keys.OptimizerType, OPTIMIZERS),
    ("lr_decay_style", optimizer_keys.LR_DECAY_STYLES, LR_SCHEDULES),
]


@pytest.mark.parametrize(("key", "literal", "registry"), SCHEMA, ids=[k for k, _, _ in SCHEMA])
def test_schema_allowed_values_are_the_registry(key: str, literal: Any, registry: Registry[Any]) -> None:
    """The schema (which the config validation and docs/neox_arguments.md use) names exactly the registered ones."""
    allowed = set(typing.get_args(literal))
    assert allowed == set(registry.names()), (
        f"{key}: the schema's Literal and the registry differ (only in the schema: {sorted(allowed - set(registry.names()))}, "
        f"only registered: {sorted(set(registry.names()) - allowed)}); add the name to both, then regenerate "
        "docs/neox_arguments.md with python -m megatron.neox_arguments.gen_docs"
    )


def _cfg(**kw: Any) -> GPTModelConfig:
    base: dict[str, Any] = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=V, max_position_embeddings=16, seed=7
    )
    return GPTModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("key", "value"), [("activation", "swoosh"), ("norm", "batchnorm"), ("pos_emb", "xpos")], ids=str
)
def test_unknown_model_names_are_refused_with_the_valid_ones(key: str, value: str) -> None:
    registry = {"activation": ACTIVATIONS, "norm": NORMS, "pos_emb": POSITION_EMBEDDINGS}[key]
    with pytest.raises(ValueError) as model_error:
        _cfg(**{key: value})
    assert str(model_error.value) == f"{key}={value!r} is not one of {', '.join(registry.names())}"
    with pytest.raises(ConfigError) as config_error:  # the config layer: one line, the key and every valid value
        NeoXArgs({**TINY, key: value}, env=CPU1)
    message = str(config_error.value)
    assert "\n" not in message and key in message and all(repr(name) in message for name in registry.names())


def test_unknown_optimizer_is_refused_with_the_valid_ones() -> None:
    valid = ", ".join(OPTIMIZERS.names())
    with pytest.raises(ConfigError, match=f"optimizer.type='adagrad' is not one of {valid}$"):
        build_optimizer(torch.nn.Linear(2, 2), OptimizerConfig(optimizer={"type": "adagrad", "params": {}}))
    with pytest.raises(ConfigError) as config_error:
        NeoXArgs({**TINY, "optimizer": {"type": "adagrad", "params": {"lr": 1e-3}}}, env=CPU1)
    assert str(config_error.value) == f"optimizer.type='adagrad': expected one of {valid}"
    setup = TrainingSetup.from_neox_args(NeoXArgs({**TINY, "padded_vocab_size": 512}, env=CPU1))
    bogus = TrainingSetup(**{**setup.__dict__, "optimizer_type": "adagrad"})
    with pytest.raises(ConfigError, match=f"is not one of {valid}"):  # the planner has no default of its own
        bytes_per_param(bogus)


class ToySGD(torch.optim.Optimizer):
    """Plain SGD that counts its steps (the test's own optimizer)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _halving(p: DecayPoint) -> float:
    """A toy LR schedule: the learning rate halves every scheduler step."""
    return p.lr_max * 0.5**p.n


def _toy_run() -> dict[str, Any]:
    """On one rank: register a toy activation, a toy optimizer and a toy LR schedule, train two steps with the
    DeepSpeed engine (which moves the schedule, as through GPT-NeoX's API)."""
    import deepspeed

    calls = {"activation": 0}

    def toy_activation(cfg: GPTModelConfig) -> Any:
        def fn(x: torch.Tensor) -> torch.Tensor:
            calls["activation"] += 1
            return torch.tanh(x) * x

        return fn

    toy_optimizer = OptimizerSpec(lambda groups, lr, params, cfg: ToySGD(groups, lr=lr, **params), state_floats=0)
    toy_act = ActivationSpec(toy_activation, gated=True)
    with (
        ACTIVATIONS.temporarily("toy_gated", toy_act),
        OPTIMIZERS.temporarily("toy_sgd", toy_optimizer),
        LR_SCHEDULES.temporarily("toy_halving", _halving),
    ):
        mpu.initialize_model_parallel(1)
        cfg = _cfg(activation="toy_gated", pos_emb="rotary")
        model = build_sequential_model(cfg)
        opt_cfg = OptimizerConfig(optimizer={"type": "toy_sgd", "params": {"lr": 0.5}}, lr=0.5, weight_decay=0.0)
        optimizer, _ = build_optimizer(model, opt_cfg)
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
        style = typing.cast(optimizer_keys.LR_DECAY_STYLES, "toy_halving")  # registered, not a schema name
        schedule = AnnealingLR(
            optimizer, LRScheduleConfig(lr=0.5, min_lr=0.0, lr_decay_style=style, train_iters=10, warmup=0.0)
        )
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=deepspeed_config_for(ds, opt_cfg)
        )
        lrs = []
        ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(3):  # two steps, then the loss they lead to
            loss = cross_entropy(engine(ids[:, :-1]), (ids[:, 1:], torch.ones(2, 8)))
            losses.append(loss.item())
            if len(losses) < 3:
                engine.backward(loss)
                engine.step()
                lrs.append(optimizer.param_groups[0]["lr"])
        linear1 = model.get_submodule("sequential.2.mlp.linear1").weight
        return {
            "losses": losses,
            "activation_calls": calls["activation"],
            "optimizer_steps": optimizer.steps if isinstance(optimizer, ToySGD) else -1,
            "gated_width": (tuple(linear1.shape), cfg.mlp_sizes),
            "registered_after": ("toy_gated" in ACTIVATIONS, "toy_sgd" in OPTIMIZERS, "toy_halving" in LR_SCHEDULES),
            "lrs": lrs,
        }


@pytest.mark.distributed
def test_toy_activation_optimizer_and_lr_schedule_train_through_their_registries() -> None:
    (out,) = run_distributed(_toy_run, 1, timeout=300)
    first, after_one, after_two = out["losses"]
    assert after_two < after_one < first, out["losses"]  # the toy optimizer's steps lowered the loss
    assert out["optimizer_steps"] == 2
    assert out["activation_calls"] >= 3 * 2  # every forward ran the toy activation in both layers
    (shape, (linear1_out, linear2_in)) = out["gated_width"]
    assert shape[0] == linear1_out == 2 * linear2_in  # the registry's gated flag sized the MLP ([x | gate])
    assert out["registered_after"] == (True, True, True)  # still registered inside the block
    assert "toy_gated" not in ACTIVATIONS and "toy_sgd" not in OPTIMIZERS and "toy_halving" not in LR_SCHEDULES
    assert out["lrs"] == [0.25, 0.125]  # the engine stepped the toy schedule after each optimizer step


def test_an_unknown_lr_decay_style_is_refused_with_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as config_error:
        NeoXArgs({**TINY, "lr_decay_style": "stepwise"}, env=CPU1)
    assert "lr_decay_style" in str(config_error.value) and all(
        repr(name) in str(config_error.value) for name in LR_SCHEDULES.names()
    )
    style = typing.cast(optimizer_keys.LR_DECAY_STYLES, "stepwise")
    with pytest.raises(ConfigError) as schedule_error:
        AnnealingLR(None, LRScheduleConfig(lr=0.1, min_lr=0.0, lr_decay_style=style, train_iters=10))
    assert str(schedule_error.value) == f"lr_decay_style='stepwise' is not one of {', '.join(LR_SCHEDULES.names())}"


def test_registries_refuse_duplicates_and_clean_up() -> None:
    with pytest.raises(ValueError, match="'adam' is already registered"):
        OPTIMIZERS.register("Adam", OPTIMIZERS.get("adam"))
    before = ACTIVATIONS.names()
    with pytest.raises(RuntimeError), ACTIVATIONS.temporarily("toy", ACTIVATIONS.get("gelu")):
        raise RuntimeError("the block fails")
    assert ACTIVATIONS.names() == before


def test_planner_reads_optimizer_state_floats_from_the_registry() -> None:
    setup = TrainingSetup.from_neox_args(NeoXArgs({**TINY, "padded_vocab_size": 512}, env=CPU1))
    for name, spec in OPTIMIZERS.items():
        layout = bytes_per_param(TrainingSetup(**{**setup.__dict__, "optimizer_type": name}))
        assert layout.states == 4 * spec.state_floats, name
        # the config layer's size check (torch-free, so it keeps its own copy) agrees with the registry
        assert size_checks.STATE_FLOATS.get(name, 2) == spec.state_floats, name


def test_gated_activations_of_the_config_layer_are_the_registry() -> None:
    """The config layer's size and MoE checks know the gated activations from ``GatedActivation`` (sections/model.py)."""
    gated = {name for name, spec in ACTIVATIONS.items() if spec.gated}
    declared = set(model_keys.GATED_ACTIVATIONS)
    assert declared == gated, (
        f"gated in the registry only: {sorted(gated - declared)}, in GatedActivation only: {sorted(declared - gated)}; "
        "a gated activation goes into GatedActivation in megatron/neox_arguments/sections/model.py"
    )


WEIGHT_DECAY_CASES = {
    "layernorm-biases-qknorm-untied": dict(use_qk_layernorm=True, no_weight_tying=True, pos_emb="learned"),
    "rmsnorm-gqa-qknorm-nobias": dict(
        norm="rmsnorm", num_kv_heads=2, use_qk_layernorm=True, use_bias_in_attn_linear=False, use_bias_in_mlp=False
    ),
    "scalenorm-rpe-swiglu": dict(norm="scalenorm", pos_emb="rpe", activation="swiglu"),
    "moe": dict(moe_num_experts=2, activation="swiglu", moe_gated_experts=True, norm="rmsnorm"),
}


@pytest.mark.parametrize("case", WEIGHT_DECAY_CASES)
def test_optimizer_and_checkpoint_agree_on_weight_decay(case: str) -> None:
    cfg = _cfg(**WEIGHT_DECAY_CASES[case])
    model = build_sequential_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = weight_decay_param_groups(model, 0.1)
    trained = [[names[id(p)] for p in g["params"]] for g in (decay, no_decay)]
    resharded = [group for _, group in _grouped(model_param_names(cfg), False, cfg)]
    assert trained == resharded  # the same two groups in the same order: optimizer state positions line up
    # The layout checkpoints were written with: norms' parameters (by module name) and biases, nothing else.
    by_name = {n for n in model_param_names(cfg) if "norm" in n.rsplit(".", 2)[-2].lower() or n.endswith(".bias")}
    assert model_no_weight_decay_names(cfg) == by_name
    assert no_decay["params"] and decay["params"]


def test_deepspeed_builds_only_the_optimizers_whose_entry_names_its_type() -> None:
    ds = {"train_batch_size": 4, "optimizer": {"type": "Adam"}}
    for name, spec in OPTIMIZERS.items():
        out = deepspeed_config_for(ds, OptimizerConfig(optimizer={"type": name, "params": {"lr": 0.1}}))
        expected = None if spec.deepspeed_type is None else {"type": spec.deepspeed_type, "params": {"lr": 0.1}}
        assert out.get("optimizer") == expected, name
    assert OPTIMIZERS.get("onebitadam").deepspeed_type == "OneBitAdam"


def test_learned_positions_beyond_the_table_are_refused() -> None:
    model = build_sequential_model(_cfg(pos_emb="learned", opt_pos_emb_offset=2))
    assert "sequential.0.position_embeddings.weight" in dict(model.named_parameters())
    model(torch.zeros(1, 14, dtype=torch.long))  # positions 0..13 + offset 2 fill the 16-row table
    with pytest.raises(ValueError, match="position 16 is beyond max_position_embeddings=16"):
        model(torch.zeros(1, 15, dtype=torch.long))
