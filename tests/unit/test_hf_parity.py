"""Parity with Hugging Face models built from a config (no downloads): logits, loss and gradients ≤ 1e-5 (fp32).

The HF model's weights go through the project's own mapping (``megatron.model.hf_mapping``) into our model.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron.model import build_sequential_model, cross_entropy
from megatron.model.hf_mapping import hf_config_to_neox, hf_to_neox_state_dict, neox_to_hf_config, neox_to_hf_state_dict

TOL = 1e-5
VOCAB = 96


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights (norm gains around 1, biases non-zero) so that every tensor matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def _neox(**kw) -> transformers.GPTNeoXConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        hidden_act="gelu",
    )
    base.update(kw)
    return transformers.GPTNeoXConfig(**base)


def _llama(kind: str = "llama", **kw) -> transformers.PretrainedConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        tie_word_embeddings=False,
    )
    base.update(kw)
    if kind == "mistral":
        return transformers.MistralConfig(**base)
    if kind == "mixtral":
        return transformers.MixtralConfig(**base)
    return transformers.LlamaConfig(**base)


def _pair(hf_config: transformers.PretrainedConfig, seed: int = 0):
    hf_cls = {
        "gpt_neox": transformers.GPTNeoXForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[hf_config.model_type]
    torch.manual_seed(seed)
    hf = hf_cls(hf_config).float().eval()
    _randomise(hf, seed)
    cfg, arch = hf_config_to_neox(hf_config)
    ours = build_sequential_model(cfg).eval()
    missing, unexpected = ours.load_state_dict(hf_to_neox_state_dict(hf.state_dict(), cfg, arch), strict=True)
    assert not missing and not unexpected
    return hf, ours, cfg, arch


NEOX_CASES = {
    "parallel-pct0.25-untied-erf": _neox(),
    "sequential-pct0.25-untied-erf": _neox(use_parallel_residual=False),
    "parallel-pct1.0-tied-erf": _neox(rotary_pct=1.0, tie_word_embeddings=True),
    "sequential-pct1.0-tied-tanh": _neox(
        rotary_pct=1.0, tie_word_embeddings=True, use_parallel_residual=False, hidden_act="gelu_pytorch_tanh"
    ),
    "parallel-pct0.25-untied-tanh-nobias-theta": _neox(
        hidden_act="gelu_pytorch_tanh", attention_bias=False, rotary_emb_base=500
    ),
}
LLAMA_CASES = {
    "llama-gqa": _llama(),
    "llama-mqa-tied": _llama(num_key_value_heads=1, tie_word_embeddings=True),
    "llama-mha-bias": _llama(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "mistral-window": _llama("mistral", sliding_window=6),
}
SHAPES = [(2, 16), (1, 33), (3, 7)]


@pytest.mark.parametrize("name", list(NEOX_CASES) + list(LLAMA_CASES))
def test_logits_match_hf(name: str) -> None:
    hf_config = {**NEOX_CASES, **LLAMA_CASES}[name]
    hf, ours, _, _ = _pair(hf_config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b, s in SHAPES:
            ids = torch.randint(0, VOCAB, (b, s), generator=g)
            expected = hf(ids).logits
            got = ours(ids)
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= TOL, name


@pytest.mark.parametrize("name", ["parallel-pct0.25-untied-erf", "sequential-pct1.0-tied-tanh", "llama-gqa"])
def test_loss_and_gradients_match_hf(name: str) -> None:
    hf_config = {**NEOX_CASES, **LLAMA_CASES}[name]
    hf, ours, cfg, arch = _pair(hf_config, seed=3)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    hf_loss = hf(ids, labels=ids).loss
    hf_loss.backward()
    labels = torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), dim=1)
    loss_mask = torch.ones(ids.shape, dtype=torch.float)
    loss_mask[:, -1] = 0.0
    loss = cross_entropy(ours(ids), (labels, loss_mask))
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= TOL
    grads = {k: p.grad for k, p in ours.named_parameters()}
    mapped = neox_to_hf_state_dict(grads, cfg, arch)
    hf_params = dict(hf.named_parameters())
    compared = 0
    for key, grad in mapped.items():
        if key not in hf_params:
            continue
        assert hf_params[key].grad is not None, key
        assert (grad - hf_params[key].grad).abs().max().item() <= TOL, key
        compared += 1
    assert compared == len(hf_params)


@pytest.mark.parametrize("name", list(NEOX_CASES) + list(LLAMA_CASES))
def test_mapping_round_trip(name: str) -> None:
    hf_config = {**NEOX_CASES, **LLAMA_CASES}[name]
    hf, ours, cfg, arch = _pair(hf_config)
    back = neox_to_hf_state_dict(ours.state_dict(), cfg, arch)
    hf_sd = hf.state_dict()
    assert set(back) == set(hf_sd)
    for key, value in back.items():
        assert torch.equal(value, hf_sd[key]), key
    regenerated = neox_to_hf_config(cfg, arch)
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "tie_word_embeddings"):
        assert getattr(regenerated, field) == getattr(hf_config, field), field
    assert regenerated.hidden_act == hf_config.hidden_act
    assert regenerated.rope_parameters == hf_config.rope_parameters
    if arch == "mistral":
        assert regenerated.sliding_window == hf_config.sliding_window


def test_on_disk_embed_out_name_is_accepted() -> None:
    hf, _, cfg, arch = _pair(NEOX_CASES["parallel-pct0.25-untied-erf"])
    sd = dict(hf.state_dict())
    sd["embed_out.weight"] = sd.pop("lm_head.weight")
    neox = hf_to_neox_state_dict(sd, cfg, arch)
    assert torch.equal(neox[f"sequential.{cfg.num_layers + 4}.final_linear.weight"], hf.lm_head.weight)


def test_unsupported_exports_raise() -> None:
    _, _, cfg, _ = _pair(NEOX_CASES["parallel-pct0.25-untied-erf"])
    with pytest.raises(ValueError, match="gpt_j_tied"):
        neox_to_hf_config(cfg.replace(gpt_j_tied=True), "neox")
    with pytest.raises(ValueError, match="rmsnorm"):
        neox_to_hf_config(cfg, "llama")
    with pytest.raises(ValueError, match="architecture"):
        neox_to_hf_config(cfg, "gpt2")


EXPORT_CASES = {
    "neox-no-norm-mlp-bias-tanh": (
        "neox",
        dict(gpt_j_residual=True, use_bias_in_norms=False, use_bias_in_mlp=False, bias_gelu_fusion=True),
    ),
    "neox-sequential-tied-relu": ("neox", dict(activation="relu", rotary_pct=0.5, intermediate_size=72)),
    "llama-swiglu-multiple-of": (
        "llama",
        dict(norm="rmsnorm", activation="swiglu", num_kv_heads=2, mlp_multiple_of=16, no_weight_tying=True),
    ),
    "llama-geglu-biases": ("llama", dict(norm="rmsnorm", activation="geglu", use_bias_in_attn_linear=True)),
    "mistral-window": (
        "mistral",
        dict(
            norm="rmsnorm",
            activation="swiglu",
            num_kv_heads=1,
            sliding_window_width=4,
            use_bias_in_attn_linear=False,
            use_bias_in_mlp=False,
        ),
    ),
}


@pytest.mark.parametrize("name", list(EXPORT_CASES))
def test_export_to_hf_gives_same_logits(name: str) -> None:
    """NeoX → HF: a model configured the GPT-NeoX way, exported, loads strictly into HF with equal logits."""
    from megatron.model import GPTModelConfig

    arch, changes = EXPORT_CASES[name]
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        padded_vocab_size=VOCAB,
        max_position_embeddings=64,
        pos_emb="rotary",
        init_method_std=0.1,
        output_layer_init_method="normal",
    )
    if arch != "neox":
        base["use_bias_in_mlp"] = changes.get("use_bias_in_attn_linear", False)
        base["use_bias_in_attn_linear"] = False
    cfg = GPTModelConfig(**{**base, **changes})
    ours = build_sequential_model(cfg).eval()
    _randomise(ours, 11)
    hf_config = neox_to_hf_config(cfg, arch)
    hf_cls = {"neox": transformers.GPTNeoXForCausalLM, "llama": transformers.LlamaForCausalLM}.get(
        arch, transformers.MistralForCausalLM
    )
    hf = hf_cls(hf_config).float().eval()
    hf.load_state_dict(neox_to_hf_state_dict(ours.state_dict(), cfg, arch), strict=True)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["parallel-pct0.25-untied-erf", "llama-gqa"])
def test_bf16_error_is_comparable_to_hf(name: str) -> None:
    """In bf16 our logits stay as close to the fp32 reference as HF's own bf16 model does."""
    hf, ours, cfg, _ = _pair({**NEOX_CASES, **LLAMA_CASES}[name])
    ours_bf16 = build_sequential_model(cfg.replace(params_dtype=torch.bfloat16)).eval()
    ours_bf16.load_state_dict(ours.state_dict())
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = ours(ids)
        got = ours_bf16(ids)
        hf_bf16 = hf.to(torch.bfloat16)(ids).logits
    assert got.dtype == torch.bfloat16
    err_ours = (got.float() - reference).abs().max().item()
    err_hf = (hf_bf16.float() - reference).abs().max().item()
    assert err_ours <= 2 * err_hf + 1e-2, (err_ours, err_hf)
    assert (got.float() - hf_bf16.float()).abs().max().item() <= 0.1
