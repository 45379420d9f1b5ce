"""Single-process tests of the GPT model: config, sizing, parameter counts, every architecture option, KV cache,
masks, activation checkpointing, per-layer seeding and the loss."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from megatron import mpu
from megatron.model import (
    GPTModelConfig,
    build_layer_specs,
    build_sequential_model,
    cross_entropy,
    get_ltor_masks_and_position_ids,
    pad_vocab_size,
)
from megatron.model.config import expand_attention_config
from megatron.model.meta import count_parameters, meta_param_shapes
from megatron.neox_arguments import ConfigError, NeoXArgs, neox_namespace
from megatron.neox_arguments.sections.model import ATTENTION_TYPES
from tests.unit.test_neox_args import CPU1, TINY

V = 128


def tiny(**kw) -> GPTModelConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=V,
        max_position_embeddings=64,
        pos_emb="rotary",
        init_method_std=0.2,
        output_layer_init_method="normal",
    )
    base.update(kw)
    return GPTModelConfig(**base)


# ----------------------------------------------------------------------------------------------------------------
# config, sizing, parameter counts

# Model keys of GPT-NeoX's configs/20B.yml, pythia/160M.yml and llama2/7B.yml (vocab padded as the tokenizer would).
NEOX_20B = dict(
    num_layers=44,
    hidden_size=6144,
    num_attention_heads=64,
    seq_length=2048,
    max_position_embeddings=2048,
    norm="layernorm",
    pos_emb="rotary",
    rotary_pct=0.25,
    no_weight_tying=True,
    gpt_j_residual=True,
    output_layer_parallelism="column",
    scaled_upper_triang_masked_softmax_fusion=True,
    bias_gelu_fusion=True,
    init_method="small_init",
    output_layer_init_method="wang_init",
    padded_vocab_size=pad_vocab_size(50277, 128, 2),
    fp16={"enabled": True},
)
PYTHIA_160M = dict(
    num_layers=12,
    hidden_size=768,
    num_attention_heads=12,
    seq_length=2048,
    max_position_embeddings=2048,
    pos_emb="rotary",
    rotary_pct=0.25,
    no_weight_tying=True,
    gpt_j_residual=True,
    bias_gelu_fusion=True,
    attention_config=[[["flash"], 12]],
    init_method="small_init",
    output_layer_init_method="wang_init",
    padded_vocab_size=pad_vocab_size(50277, 128, 1),
)
LLAMA2_7B = dict(
    num_layers=32,
    hidden_size=4096,
    intermediate_size=32768,
    num_attention_heads=32,
    seq_length=4096,
    max_position_embeddings=4096,
    pos_emb="rotary",
    rotary_pct=1,
    no_weight_tying=True,
    norm="rmsnorm",
    rms_norm_epsilon=1.0e-5,
    use_bias_in_norms=False,
    use_bias_in_attn_linear=False,
    activation="swiglu",
    mlp_multiple_of=256,
    padded_vocab_size=32000,
)


def _count_on_meta(args: dict) -> int:
    return count_parameters(meta_param_shapes(GPTModelConfig.from_neox_args(neox_namespace(args))))


def test_parameter_counts_on_meta() -> None:
    assert pad_vocab_size(50277, 128, 2) == 50432
    assert round(_count_on_meta(NEOX_20B) / 1e9, 2) == 20.55
    assert round(_count_on_meta(PYTHIA_160M) / 1e6, 1) == 162.3
    # HF Llama-2-7B has 6.738B; GPT-NeoX's llama2 config keeps the default MLP biases (+0.84M)
    assert round(_count_on_meta(LLAMA2_7B) / 1e9, 2) == 6.74


def test_from_neox_args_reads_flat_keys() -> None:
    cfg = GPTModelConfig.from_neox_args(neox_namespace(**NEOX_20B))
    assert cfg.params_dtype == torch.float16
    assert cfg.fused_kernels == {"scaled_upper_triang_masked_softmax_fusion": True}
    assert cfg.gpt_j_residual and cfg.no_weight_tying and cfg.bias_gelu_fusion
    assert cfg.rotary_ndims == 24 and cfg.mlp_sizes == (24576, 24576)
    pythia = GPTModelConfig.from_neox_args(neox_namespace(**PYTHIA_160M, precision="bfloat16"))
    assert pythia.layer_types == ("flash",) * 12 and pythia.params_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTModelConfig.from_neox_args(neox_namespace(num_layers=2, hidden_size=32, num_attention_heads=4))
    with pytest.raises(ValueError, match=r"missing required key.*hidden_size"):
        GPTModelConfig.from_neox_args(neox_namespace(num_layers=2, num_attention_heads=4, padded_vocab_size=64))


def test_gpt_neox_mlp_sizing() -> None:
    assert GPTModelConfig.from_neox_args(neox_namespace(**LLAMA2_7B)).mlp_sizes == (22016, 11008)
    assert tiny().mlp_sizes == (128, 128)
    assert tiny(expansion_factor=2.5).mlp_sizes == (80, 80)
    assert tiny(intermediate_size=100, mlp_multiple_of=64).mlp_sizes == (128, 128)
    assert tiny(activation="swiglu", intermediate_size=3 * 48).mlp_sizes == (96, 48)  # HF intermediate 48
    assert tiny(activation="geglu").mlp_sizes == (84, 42)  # int(128·2/3)//2 = 42


@pytest.mark.parametrize("kind", ATTENTION_TYPES)
def test_every_gpt_neox_layer_type_builds(kind: str) -> None:
    """No attention_config type GPT-NeoX names is refused any more: each builds a model that runs."""
    cfg = tiny(attention_config=[[[kind], 2]], sparsity_config={"block": 4}, seq_length=32)
    model = build_sequential_model(cfg)
    logits = model(torch.randint(0, cfg.padded_vocab_size, (1, 32)))
    assert logits.shape[:2] == (1, 32) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"norm": "batchnorm"}, "norm='batchnorm'"),
        ({"pos_emb": "xpos"}, "pos_emb"),
        ({"activation": "tanh"}, "activation"),
        ({"attention_config": [[["global"], 3]]}, "num_layers is 2"),
        ({"attention_config": [[["mystery"], 2]]}, "unknown"),
        ({"init_method": "kaiming"}, "init_method"),
        ({"rotary_pct": 0.1}, "rotary_pct"),
    ],
)
def test_bad_config_names_the_key(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny(**changes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_size": 30}, "hidden_size=30 is not divisible by num_attention_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads=3"),
        ({"intermediate_size": 64, "expansion_factor": 2.0}, "intermediate_size and expansion_factor are exclusive"),
        ({"hidden_dropout": 1.0}, r"hidden_dropout=1.0 must be in \[0, 1\)"),
        ({"mlp_multiple_of": 0}, "mlp_multiple_of=0 must be >= 1"),
    ],
)
def test_key_rules_are_the_config_layers_once(changes: dict, match: str) -> None:
    """A key's range and the cross-key rules live once, in the config layer (ranges.py, validate.py), which refuses
    the value before a model config exists; ``GPTModelConfig`` does not repeat them."""
    with pytest.raises(ConfigError, match=match):
        NeoXArgs({**TINY, **changes}, env=CPU1)
    source = inspect.getsource(GPTModelConfig._validate)
    for repeated in ("hidden_size %", "% self.kv_heads", "expansion_factor", "dropout", "mlp_multiple_of >="):
        assert repeated not in source, f"GPTModelConfig._validate repeats the config layer's rule on {repeated!r}"


def test_attention_config_expansion() -> None:
    assert expand_attention_config([[["global", "local"], "all"]], 4) == ("global", "local") * 2
    assert expand_attention_config(["flash", "global"], 2) == ("flash", "global")
    assert expand_attention_config(None, 3) == ("global",) * 3


# ----------------------------------------------------------------------------------------------------------------
# names and specs


def test_state_dict_uses_gpt_neox_names() -> None:
    cfg = tiny(no_weight_tying=True, pos_emb="learned", norm="rmsnorm", num_kv_heads=2, activation="swiglu")
    keys = set(build_sequential_model(cfg).state_dict())
    L = cfg.num_layers
    for key in (
        "sequential.0.word_embeddings.weight",
        "sequential.0.position_embeddings.weight",
        "sequential.2.input_layernorm.scale",
        "sequential.2.attention.query_key_value.weight",
        "sequential.2.attention.dense.weight",
        "sequential.3.post_attention_layernorm.scale",
        "sequential.3.mlp.linear1.weight",
        "sequential.3.mlp.linear2.bias",
        f"sequential.{L + 3}.norm.scale",
        f"sequential.{L + 4}.final_linear.weight",
    ):
        assert key in keys, key
    tied = set(build_sequential_model(tiny(rotary_save_freqs_buffer=True)).state_dict())
    assert not any(k.startswith(f"sequential.{L + 4}.") for k in tied)
    assert "sequential.2.attention.rotary_emb.inv_freq" in tied and "sequential.5.norm.bias" in tied
    assert "sequential.5.norm.bias" not in set(build_sequential_model(tiny(use_bias_in_norms=False)).state_dict())
    assert (
        "sequential.0.position_embeddings.inv_freq" in build_sequential_model(tiny(pos_emb="sinusoidal")).state_dict()
    )
    qk = build_sequential_model(tiny(use_qk_layernorm=True)).state_dict()
    assert qk["sequential.2.attention.qk_layernorm.weight"].shape == (4, 8)  # one [heads, hn] norm for q and k
    assert not any("k_layernorm" in k and "qk_" not in k for k in qk)
    gqa = build_sequential_model(tiny(use_qk_layernorm=True, num_kv_heads=2)).state_dict()
    assert gqa["sequential.2.attention.k_layernorm.weight"].shape == (2, 8)


def test_layer_specs_are_pipe_shaped() -> None:
    cfg = tiny(num_layers=3)
    specs = build_layer_specs(cfg)
    assert len(specs) == cfg.num_layers + 5
    assert isinstance(specs[0], TiedLayerSpec) and specs[0].key == "embed"
    assert specs[0].tied_weight_attr == ["word_embeddings_weight"]
    assert callable(specs[1]) and not isinstance(specs[1], LayerSpec)
    assert all(specs[i].typename.__name__ == "ParallelTransformerLayerPipe" for i in range(2, 5))
    assert specs[-1].key == "embed" and specs[-1].forward_fn is not None
    untied = build_layer_specs(tiny(no_weight_tying=True))
    assert type(untied[0]) is LayerSpec and untied[-1].typename.__name__ == "ParallelLinearPipe"


def test_per_spec_seeding_is_partition_independent_and_leaves_rng_alone() -> None:
    cfg = tiny(num_layers=3, no_weight_tying=True, seed=77)
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    model = build_sequential_model(cfg)
    assert torch.equal(torch.rand(3), before)  # building did not consume the caller's RNG
    again = build_sequential_model(cfg)
    for (k, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    # a pipeline stage that builds only spec 3 (layer 1) gets the same weights
    alone = build_layer_specs(cfg)[3].build()
    for k, v in alone.state_dict().items():
        assert torch.equal(v, model.state_dict()[f"sequential.3.{k}"]), k
    other_seed = build_sequential_model(cfg.replace(seed=78))
    assert not torch.equal(other_seed.sequential[2].attention.dense.weight, model.sequential[2].attention.dense.weight)


# ----------------------------------------------------------------------------------------------------------------
# every option builds, trains and is causal

OPTIONS = {
    "learned": dict(pos_emb="learned"),
    "learned-opt-offset": dict(pos_emb="learned", opt_pos_emb_offset=2),
    "sinusoidal": dict(pos_emb="sinusoidal"),
    "rotary-partial": dict(pos_emb="rotary", rotary_pct=0.5, rotary_emb_base=500.0),
    "alibi": dict(pos_emb="alibi"),
    "rpe": dict(pos_emb="rpe", rpe_num_buckets=8, rpe_max_distance=16),
    "no-pos": dict(pos_emb="none"),
    "rmsnorm": dict(norm="rmsnorm"),
    "scalenorm": dict(norm="scalenorm"),
    "nonparam-ln": dict(norm="non_parametric_layernorm"),
    "ln-no-bias": dict(use_bias_in_norms=False),
    "te-norm-accepted": dict(norm="te_rmsnorm"),
    "gpt-j": dict(gpt_j_residual=True),
    "gpt-j-tied": dict(gpt_j_residual=True, gpt_j_tied=True),
    "gelu-tanh": dict(bias_gelu_fusion=True),
    "onnx-gelu": dict(onnx_safe=True),
    "relu": dict(activation="relu"),
    "silu": dict(activation="silu"),
    "swish": dict(activation="swish"),
    "mish": dict(activation="mish"),
    "softsign": dict(activation="softsign"),
    "geglu": dict(activation="geglu"),
    "reglu": dict(activation="reglu"),
    "swiglu": dict(activation="swiglu", mlp_multiple_of=8),
    "bilinear": dict(activation="bilinear"),
    "glu": dict(activation="glu"),
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "untied-no-bias": dict(no_weight_tying=True, use_bias_in_attn_linear=False, use_bias_in_mlp=False),
    "qk-layernorm": dict(use_qk_layernorm=True),
    "qk-rmsnorm-gqa": dict(use_qk_layernorm=True, norm="rmsnorm", num_kv_heads=2),
    "sliding-window": dict(sliding_window_width=4),
    "flash-and-local": dict(
        attention_config=[[["flash", "local"], "all"]], sparsity_config={"block": 4}, seq_length=64
    ),
    "fusion-keys": dict(fused_kernels={"rope_fusion": True, "scaled_masked_softmax_fusion": True}),
    "qk-layer-scaling-fp32-softmax": dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
    "bf16": dict(params_dtype=torch.bfloat16, attention_softmax_in_fp32=True),
    "bf16-alibi-sdpa-bias": dict(params_dtype=torch.bfloat16, pos_emb="alibi"),
    "fp16": dict(params_dtype=torch.float16),
    "small-wang-init": dict(init_method="small_init", output_layer_init_method="wang_init"),
    "xavier-init": dict(init_method="xavier_uniform", output_layer_init_method="xavier_normal"),
    "orthogonal-init": dict(init_method="orthogonal", output_layer_init_method="scaled_orthogonal"),
    "single-residual-init": dict(output_layer_init_method="single_residual_scaled_normal"),
    "dropouts": dict(hidden_dropout=0.1, attention_dropout=0.1),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_builds_trains_and_is_causal(name: str) -> None:
    cfg = tiny(**OPTIONS[name])
    model = build_sequential_model(cfg)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits = model(ids)
        changed = ids.clone()
        changed[:, 8:] = (changed[:, 8:] + 1) % V
        logits2 = model(changed)
    assert logits.shape == (2, 12, V) and logits.dtype == cfg.params_dtype
    assert torch.isfinite(logits).all()
    assert torch.equal(logits[:, :8], logits2[:, :8]), "a future token changed a past logit"
    assert not torch.equal(logits[:, 8:], logits2[:, 8:])
    model.train()
    labels = torch.roll(ids, -1, dims=1)
    loss = cross_entropy(model(ids), (labels, torch.ones(ids.shape)))
    assert torch.isfinite(loss)
    loss.backward()
    unused = (
        {"sequential.2.post_attention_layernorm", "sequential.3.post_attention_layernorm"} if cfg.gpt_j_tied else set()
    )
    for key, p in model.named_parameters():
        if any(key.startswith(u) for u in unused):
            continue
        if key.endswith("position_embeddings.weight"):
            continue  # rows beyond the sequence get no gradient, the used ones are checked via the loss
        assert p.grad is not None and torch.isfinite(p.grad).all(), key
        assert p.grad.abs().sum() > 0, key


def test_options_change_the_function() -> None:
    """Numerically distinct options must give distinct outputs (guards against ignored keys)."""
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(1))
    base = build_sequential_model(tiny()).eval()
    with torch.no_grad():
        ref = base(ids)
        for changes in (
            dict(bias_gelu_fusion=True),
            dict(rotary_pct=0.5),
            dict(rotary_emb_base=100.0),
            dict(sliding_window_width=3),
            dict(layernorm_epsilon=0.5),
            dict(gpt_j_residual=True),
        ):
            other = build_sequential_model(tiny(**changes)).eval()
            other.load_state_dict(base.state_dict())
            assert not torch.allclose(other(ids), ref, atol=1e-6), changes


def test_mask_paths_agree_sdpa_math_and_explicit_mask() -> None:
    """Implicit causal (is_causal), an explicit NeoX mask and the fp32-softmax math path give the same logits."""
    cfg = tiny(pos_emb="alibi")
    model = build_sequential_model(cfg).eval()
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    mask, _, pos = get_ltor_masks_and_position_ids(ids, eod_token=-1)
    math_model = build_sequential_model(cfg.replace(apply_query_key_layer_scaling=True)).eval()
    math_model.load_state_dict(model.state_dict())
    with torch.no_grad():
        implicit = model(ids)
        explicit = model(ids, pos, mask)
        math = math_model(ids, pos, mask.expand(2, 1, 10, 10))
    assert (implicit - explicit).abs().max() <= 1e-6
    assert (implicit - math).abs().max() <= 1e-5


# ----------------------------------------------------------------------------------------------------------------
# activation checkpointing and loss


@pytest.mark.parametrize("num_layers_per_chunk", [1, 2])
def test_activation_checkpointing_gives_identical_loss_and_grads(num_layers_per_chunk: int) -> None:
    cfg = tiny(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    labels, mask = torch.roll(ids, -1, 1), torch.ones(ids.shape)
    results = []
    for ckpt in (False, True):
        model = build_sequential_model(
            cfg.replace(checkpoint_activations=ckpt, checkpoint_num_layers=num_layers_per_chunk)
        )
        mpu.model_parallel_cuda_manual_seed(11)
        loss = cross_entropy(model(ids), (labels, mask))
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for key, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][key], atol=1e-6, rtol=0), key


def test_cross_entropy_is_masked_mean() -> None:
    logits = torch.randn(2, 5, V, generator=torch.Generator().manual_seed(8))
    labels = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(9))
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.float)
    per_token = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
    expected = (per_token * mask.reshape(-1)).sum() / mask.sum()
    assert torch.allclose(cross_entropy(logits, (labels, mask)), expected, atol=1e-6)
    half = cross_entropy(logits.bfloat16(), (labels, mask), _fp16=True)
    assert abs(half.item() - expected.item()) < 0.05


def test_learned_positions_beyond_the_table_raise() -> None:
    model = build_sequential_model(tiny(pos_emb="learned", max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_row_biases_on_disk_are_gpt_neoxs_shares_and_load_back() -> None:
    """At tp=2 with parallel residual a checkpoint stores half of each row-parallel bias per rank (GPT-NeoX adds it on
    every rank before the reduction); loading such a state dict restores the effective bias. Nothing else changes."""
    from megatron.checkpoint.bias_layout import SPLIT, row_biases_on_disk

    model = build_sequential_model(tiny(gpt_j_residual=True))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    memory = {k: v.clone() for k, v in model.state_dict().items()}
    with row_biases_on_disk(model, SPLIT, 2):
        disk = {k: v.clone() for k, v in model.state_dict().items()}
    for key, value in memory.items():
        row = key.endswith(("attention.dense.bias", "mlp.linear2.bias"))
        assert torch.equal(disk[key], value / 2 if row else value), key
    key = "sequential.2.attention.dense.bias"
    assert torch.equal(model.state_dict()[key], memory[key])  # outside the block: the in-memory value
    fresh = build_sequential_model(tiny(gpt_j_residual=True))
    with row_biases_on_disk(fresh, SPLIT, 2):
        fresh.load_state_dict(disk)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in memory.items())


@pytest.mark.parametrize(
    ("files", "millions"),
    [(["configs/20B.yml"], 20554.6), (["configs/pythia/160M.yml"], 162.3), (["configs/pythia/14M.yml"], 14.1)],
)
def test_shipped_configs_through_neox_args(files: list[str], millions: float) -> None:
    """The real GPT-NeoX YAMLs → NeoXArgs → GPTModelConfig → model on meta with the expected size."""
    from megatron.neox_arguments.neox_args import NeoXArgs

    args = NeoXArgs.from_ymls(files, {"global_num_gpus": 8})
    args.padded_vocab_size = pad_vocab_size(50277, args.make_vocab_size_divisible_by, args.model_parallel_size)
    cfg = GPTModelConfig.from_neox_args(args)
    assert cfg.num_layers == args.num_layers and cfg.rotary_pct == args.rotary_pct
    assert round(count_parameters(meta_param_shapes(cfg)) / 1e6, 1) == millions
