"""Parameter sharing across layers (``num_unique_layers``, ``param_sharing_style``): the order of the shared layers,
gradients summed over their uses, the KV cache per position, checkpoint names, and the planner's count."""

from __future__ import annotations

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.kv_cache import KVCache
from megatron.model.layer_sharing import unique_layer
from megatron.model.meta import count_parameters, meta_param_shapes
from megatron.neox_arguments import ConfigError
from tests.unit.test_neox_args import build

V = 64


def cfg(**kw) -> GPTModelConfig:
    base = dict(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=V,
        max_position_embeddings=64,
        pos_emb="rotary",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModelConfig(**{**base, **kw})


@pytest.mark.parametrize(("style", "order"), [("grouped", [0, 1, 0, 1]), ("spaced", [0, 0, 1, 1])])
def test_styles_follow_gpt_neox_documented_order(style: str, order: list[int]) -> None:
    c = cfg(num_unique_layers=2, param_sharing_style=style)
    assert [unique_layer(c, i) for i in range(4)] == order
    model = build_sequential_model(c)
    layers = [model.sequential[i + 2] for i in range(4)]
    assert [next(j for j in range(4) if layers[j] is layers[i]) for i in range(4)] == [order.index(u) for u in order]
    # parameters named after each unique layer's first position, counted once
    first = sorted({order.index(u) + 2 for u in order})
    assert sorted({int(n.split(".")[1]) for n, _ in model.named_parameters() if n.split(".")[1] not in "07"}) == first
    unshared = build_sequential_model(cfg())
    per_layer = sum(p.numel() for p in unshared.sequential[2].parameters())
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(p.numel() for p in unshared.parameters()) - 2 * per_layer
    # the planner counts from the meta model: shared layers once
    assert count_parameters(meta_param_shapes(c)) == total
    # the state dict (what checkpoints hold) names every position, equal copies
    sd = model.state_dict()
    for i, u in enumerate(order):
        j = order.index(u)
        assert torch.equal(
            sd[f"sequential.{i + 2}.attention.dense.weight"], sd[f"sequential.{j + 2}.attention.dense.weight"]
        )


@pytest.mark.parametrize("style", ["grouped", "spaced"])
def test_gradient_of_a_shared_layer_is_the_sum_over_its_uses(style: str) -> None:
    shared_cfg = cfg(num_unique_layers=2, param_sharing_style=style)
    shared = build_sequential_model(shared_cfg)
    reference = build_sequential_model(cfg())
    reference.load_state_dict(shared.state_dict())  # the unshared model with every copy equal to its unique layer
    tokens = torch.randint(0, V, (2, 12))
    for model in (shared, reference):
        model(tokens).float().pow(2).mean().backward()
    shared_params = dict(shared.named_parameters())
    ref_params = dict(reference.named_parameters())
    for name, param in shared_params.items():
        idx = int(name.split(".")[1])
        if not 2 <= idx < 6:
            torch.testing.assert_close(param.grad, ref_params[name].grad)
            continue
        rest = name.split(".", 2)[2]
        u = unique_layer(shared_cfg, idx - 2)
        uses = [i + 2 for i in range(4) if unique_layer(shared_cfg, i) == u]
        assert len(uses) == 2
        summed = sum(ref_params[f"sequential.{i}.{rest}"].grad for i in uses)
        torch.testing.assert_close(param.grad, summed, rtol=1e-5, atol=1e-6)
        # and not merely one use's gradient
        assert not torch.allclose(param.grad, ref_params[f"sequential.{uses[0]}.{rest}"].grad)


def test_kv_cache_keeps_one_entry_per_position() -> None:
    model = build_sequential_model(cfg(num_unique_layers=1)).eval()
    tokens = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        first = model(tokens[:, :7], kv_cache=cache)
        steps = [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(7, 10)]
    torch.testing.assert_close(first, full[:, :7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 7:], rtol=1e-5, atol=1e-5)


def test_bad_sharing_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_unique_layers=3 .*does not divide"):
        build(num_layers=4, num_unique_layers=3)
    with pytest.raises(ConfigError, match=r"param_sharing_style='zigzag'.*must be one of"):
        build(num_unique_layers=1, param_sharing_style="zigzag")
    mixed = [[["global", "local"], "all"]]
    with pytest.raises(ValueError, match="layers 0 and 1 share parameters but attention_config"):
        cfg(num_unique_layers=2, param_sharing_style="spaced", attention_config=mixed, seq_length=64)
    cfg(num_unique_layers=2, param_sharing_style="grouped", attention_config=mixed, seq_length=64)  # types line up


def test_inference_stage_decodes_shared_layers_with_one_cache_entry_per_position() -> None:
    from megatron import mpu
    from megatron.model.inference_stage import InferenceStage

    c = cfg(num_unique_layers=2, param_sharing_style="grouped")
    reference = build_sequential_model(c).eval()
    mpu.initialize_model_parallel(1, 1)
    try:
        stage = InferenceStage(c).eval()
        missing, _ = stage.load_state_dict(reference.state_dict(), strict=False)
        assert not missing
        tokens = torch.randint(0, V, (1, 9))
        with torch.no_grad():
            full = reference(tokens)
            cache = KVCache()
            first = stage(tokens[:, :5], cache)
            steps = [stage(tokens[:, i : i + 1], cache) for i in range(5, 9)]
    finally:
        mpu.destroy_model_parallel()
    torch.testing.assert_close(first, full[:, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 5:], rtol=1e-5, atol=1e-5)


def test_planner_counts_a_shared_layer_on_every_stage_that_runs_it() -> None:
    from megatron.planner.params import count_params

    c = cfg(num_layers=2, num_unique_layers=1)
    plain = count_params(cfg(num_layers=2), tp=1, pp=2, partition_method="type:transformer")
    shared = count_params(c, tp=1, pp=2, partition_method="type:transformer")
    per_layer = sum(p.numel() for p in build_sequential_model(c).sequential[2].parameters())
    assert shared.total == plain.total - per_layer  # the model holds the layer once
    # each of the two stages runs one use of the layer and holds a copy, as an unshared stage holds its own layer
    assert [s.total for s in shared.stages] == [s.total for s in plain.stages]
    assert [s.num_layers for s in shared.stages] == [1, 1]
    whole = count_params(c, tp=1, pp=0)
    assert whole.stages[0].total == shared.total


def test_moe_layers_are_not_shared_yet() -> None:
    with pytest.raises(ValueError, match="not supported yet: num_unique_layers=1 with MoE layers"):
        cfg(num_unique_layers=1, moe_num_experts=2)
    with pytest.raises(ConfigError, match=r"not supported yet: num_unique_layers=1 .*with MoE layers"):
        build(num_unique_layers=1, moe_num_experts=2)


@pytest.mark.parametrize("kind", ["mamba", "gmlp", "amlp"])
def test_only_transformer_layers_are_shared(kind: str) -> None:
    with pytest.raises(ValueError, match=f"not supported yet: num_unique_layers=1 with {kind} layers"):
        cfg(num_unique_layers=1, attention_config=[[[kind], "all"]], seq_length=16)
