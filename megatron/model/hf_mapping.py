"""Full (tp=1) GPT-NeoX state dict ⟷ Hugging Face state dict and config, for ``architecture`` in
``neox`` (``GPTNeoXForCausalLM``), ``llama`` (``LlamaForCausalLM``), ``mistral`` (``MistralForCausalLM``) and
``mixtral`` (``MixtralForCausalLM``, MoE: :mod:`megatron.model.moe.hf_mixtral`) and ``mamba``
(``MambaForCausalLM``, all-Mamba models: :mod:`megatron.model.mamba.hf_mamba`).

NeoX keys are ``sequential.{idx}.<name>`` (``{idx}.<name>`` is accepted on input): embedding ``0``, layer ``i`` at
``i + 2``, final norm ``L + 3``, untied output layer ``L + 4``. A TP-sharded checkpoint must first be merged with
``megatron.model.tp_sharding.merge_state_dicts`` (GQA QKV and gated linear1 are sub-matrix sharded).

Layout facts used here:
* MHA ``query_key_value`` is per-head interleaved ``[heads][q|k|v][hn]`` (identical to HF GPTNeoX); GQA is
  blocked ``[Q | K | V]`` with sizes ``(h, kv·hn, kv·hn)``.
* Gated ``mlp.linear1`` is ``[up | gate]`` (``act(gate)·up``): HF ``up_proj`` = first half, ``gate_proj`` =
  second half; HF ``intermediate_size`` = NeoX ``mlp_sizes[1]``. Going HF → NeoX we emit
  ``intermediate_size = 3·I`` with ``mlp_multiple_of = 1``, which GPT-NeoX's sizing maps back to exactly ``I``.
* ``bias_gelu_fusion`` (tanh GELU) ⟷ HF ``hidden_act = "gelu_pytorch_tanh"``; exact GELU ⟷ ``"gelu"``.
* Row-parallel biases are stored TP-invariant (effective value), so no summing/scaling happens here.
* NeoX ``sliding_window_width = w`` lets a query see ``w + 1`` keys; HF Mistral ``sliding_window = W`` sees ``W``:
  we map ``W = w + 1``.
* HF GPTNeoX's head is ``lm_head.weight`` in memory and ``embed_out.weight`` on disk: both are accepted on input;
  output uses ``lm_head.weight`` (``from_pretrained`` accepts it as well).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megatron.model.config import GPTModelConfig
from megatron.model.mamba.hf_mamba import (
    mamba_config,
    mamba_config_keys,
    mamba_to_neox_state_dict,
    mixed_layers_problem,
    neox_to_mamba_state_dict,
)
from megatron.model.moe.hf_mixtral import (
    mixtral_config,
    mixtral_moe_keys,
    mixtral_to_neox_experts,
    neox_to_mixtral_experts,
)
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES

ARCHITECTURES = ("neox", "llama", "mistral", "mixtral", "mamba")
_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
_GATE_ACT = {"swiglu": "silu", "reglu": "relu", "bilinear": None, "glu": "sigmoid"}


def _check_arch(architecture: str) -> None:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r} is not one of {', '.join(ARCHITECTURES)}")


def normalise_neox_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{idx}.<name>`` / ``sequential.{idx}.<name>`` → ``sequential.{idx}.<name>`` (other keys are dropped)."""
    out = {}
    for key, value in state_dict.items():
        m = re.match(r"^(?:module\.)?(?:sequential\.)?(\d+)\.(.+)$", key)
        if m:
            out[f"sequential.{int(m.group(1))}.{m.group(2)}"] = value
    return out


# --------------------------------------------------------------------------------------------------------------
# configs


def _hf_act(cfg: GPTModelConfig) -> str:
    if cfg.activation in ("gelu", "geglu"):
        return "gelu_pytorch_tanh" if cfg.bias_gelu_fusion else "gelu"
    if cfg.activation in ("relu", "silu", "mish"):
        return cfg.activation
    if cfg.activation == "swish":
        return "silu"
    act = _GATE_ACT.get(cfg.activation)
    if act is None:
        raise ValueError(f"activation={cfg.activation!r} has no Hugging Face equivalent")
    return act


def neox_to_hf_config(cfg: GPTModelConfig, architecture: str = "neox", **extra: Any) -> Any:
    """The HF config (transformers 5.x field names) equivalent to ``cfg``; ``ValueError`` if none is exact."""
    import transformers

    _check_arch(architecture)
    if architecture == "mamba":
        return mamba_config(cfg, **extra)
    mixed = mixed_layers_problem(cfg)
    if mixed:
        raise ValueError(mixed)
    problems = []
    if cfg.pos_emb != "rotary":
        problems.append(f"pos_emb={cfg.pos_emb!r} (HF models here use rotary)")
    for kind in sorted({k for k in cfg.layer_types if k in ("gmlp", "amlp")}):
        problems.append(f"attention_config '{kind}' layers")
    if any(kind == "mamba" for kind in cfg.layer_types):
        problems.append("attention_config 'mamba' layers (use architecture 'mamba': MambaForCausalLM)")
    sparse = sorted({kind for kind in cfg.layer_types if kind in SPARSE_TYPES})
    if sparse:
        problems.append(f"attention_config {', '.join(repr(k) for k in sparse)} layers")
    if any(kind == "rwkv" for kind in cfg.layer_types):
        problems.append("attention_config 'rwkv' layers")
    if cfg.use_qk_layernorm:
        problems.append("use_qk_layernorm")
    if cfg.gpt_j_tied:
        problems.append("gpt_j_tied (HF has no tied-norm parallel residual)")
    if cfg.apply_query_key_layer_scaling and cfg.params_dtype != torch.float32:
        problems.append("apply_query_key_layer_scaling in half precision")
    if cfg.is_moe and architecture != "mixtral":
        problems.append(f"mixture-of-experts layers (moe_num_experts={cfg.moe_num_experts}; {architecture} is dense)")
    rope: dict[str, Any] = {"rope_theta": float(cfg.rotary_emb_base), "rope_type": "default"}
    common: dict[str, Any] = {
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_dropout": cfg.attention_dropout,
        "initializer_range": cfg.init_method_std,
    }
    if architecture == "neox":
        if cfg.norm not in ("layernorm", "te_layernorm"):
            problems.append(f"norm={cfg.norm!r} (GPTNeoX uses layernorm)")
        if cfg.is_gated or cfg.is_gqa:
            problems.append("gated activations / GQA (GPTNeoX has neither)")
        if cfg.sliding_window_width is not None:
            problems.append("sliding_window_width")
        if problems:
            raise ValueError(f"no exact GPTNeoXForCausalLM equivalent: {'; '.join(problems)}")
        rope["partial_rotary_factor"] = cfg.rotary_pct
        hf: transformers.PretrainedConfig = transformers.GPTNeoXConfig(
            **common,
            intermediate_size=cfg.mlp_sizes[0],
            hidden_act=_hf_act(cfg),
            hidden_dropout=cfg.hidden_dropout,
            layer_norm_eps=cfg.layernorm_epsilon,
            use_parallel_residual=cfg.gpt_j_residual,
            rope_parameters=rope,
            attention_bias=cfg.use_bias_in_attn_linear,
            **extra,
        )
        hf.architectures = ["GPTNeoXForCausalLM"]
        return hf
    if cfg.norm not in ("rmsnorm", "te_rmsnorm"):
        problems.append(f"norm={cfg.norm!r} ({architecture} uses rmsnorm)")
    if not cfg.is_gated:
        problems.append(f"activation={cfg.activation!r} ({architecture} needs a gated MLP, e.g. swiglu)")
    if cfg.gpt_j_residual:
        problems.append("gpt_j_residual")
    if cfg.rotary_pct != 1.0:
        problems.append(f"rotary_pct={cfg.rotary_pct} ({architecture} rotates whole heads)")
    if cfg.hidden_dropout:
        problems.append("hidden_dropout (no HF equivalent)")
    kwargs: dict[str, Any] = {
        **common,
        "intermediate_size": cfg.mlp_sizes[1],
        "num_key_value_heads": cfg.kv_heads,
        "hidden_act": _hf_act(cfg),
        "rms_norm_eps": cfg.rms_norm_epsilon,
        "rope_parameters": rope,
        "head_dim": cfg.head_dim,
    }
    if architecture == "llama":
        if cfg.sliding_window_width is not None:
            problems.append("sliding_window_width (use architecture 'mistral')")
        if problems:
            raise ValueError(f"no exact LlamaForCausalLM equivalent: {'; '.join(problems)}")
        hf = transformers.LlamaConfig(
            **kwargs, attention_bias=cfg.use_bias_in_attn_linear, mlp_bias=cfg.use_bias_in_mlp, **extra
        )
        hf.architectures = ["LlamaForCausalLM"]
        return hf
    if cfg.use_bias_in_attn_linear or cfg.use_bias_in_mlp:
        problems.append("biases in attention/MLP (Mistral has none; set use_bias_in_attn_linear/use_bias_in_mlp false)")
    window = None if cfg.sliding_window_width is None else cfg.sliding_window_width + 1
    if architecture == "mixtral":
        return mixtral_config(cfg, kwargs, window, problems, **extra)
    if problems:
        raise ValueError(f"no exact MistralForCausalLM equivalent: {'; '.join(problems)}")
    hf = transformers.MistralConfig(**kwargs, sliding_window=window, **extra)
    hf.architectures = ["MistralForCausalLM"]
    return hf


def hf_config_to_neox(hf_config: Any, **overrides: Any) -> tuple[GPTModelConfig, str]:
    """``(GPTModelConfig, architecture)`` for a HF GPTNeoX/Llama/Mistral/Mixtral/Mamba config (5.x or old-style
    fields)."""
    model_type: str | None = getattr(hf_config, "model_type", None)
    arch = {"gpt_neox": "neox", "llama": "llama", "mistral": "mistral", "mixtral": "mixtral", "mamba": "mamba"}.get(
        model_type or ""
    )
    if arch is None:
        raise ValueError(
            f"unsupported Hugging Face model_type {model_type!r}; supported: gpt_neox, llama, mistral, mixtral, mamba"
        )
    if arch == "mamba":
        return GPTModelConfig(**{**mamba_config_keys(hf_config), **overrides}), arch
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={rope.get('rope_type')!r} (RoPE scaling) is not supported; only 'default'")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", getattr(hf_config, "rotary_emb_base", 10000.0)))
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    if head_dim * heads != h:
        raise ValueError(f"head_dim={head_dim} × heads={heads} != hidden_size={h}: not representable in GPT-NeoX")
    act = hf_config.hidden_act
    kw: dict[str, Any] = {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": h,
        "num_attention_heads": heads,
        "padded_vocab_size": hf_config.vocab_size,
        "max_position_embeddings": hf_config.max_position_embeddings,
        "pos_emb": "rotary",
        "rotary_emb_base": float(theta),
        "no_weight_tying": not getattr(hf_config, "tie_word_embeddings", False),
        "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": float(getattr(hf_config, "initializer_range", 0.02)),
    }
    if arch == "neox":
        if act not in ("gelu", "relu", "silu", "mish", *_TANH_GELUS):
            raise ValueError(f"hidden_act={act!r} is not supported for GPTNeoX")
        kw.update(
            intermediate_size=hf_config.intermediate_size,
            activation="gelu" if act == "gelu" or act in _TANH_GELUS else act,
            bias_gelu_fusion=act in _TANH_GELUS,
            hidden_dropout=float(getattr(hf_config, "hidden_dropout", 0.0) or 0.0),
            norm="layernorm",
            layernorm_epsilon=hf_config.layer_norm_eps,
            rotary_pct=float(rope.get("partial_rotary_factor", getattr(hf_config, "rotary_pct", 1.0))),
            gpt_j_residual=bool(hf_config.use_parallel_residual),
            use_bias_in_attn_linear=bool(getattr(hf_config, "attention_bias", True)),
            use_bias_in_mlp=True,
        )
    else:
        gated = {"silu": "swiglu", "relu": "reglu", "sigmoid": "glu", "gelu": "geglu"}
        if act in _TANH_GELUS:
            kw.update(activation="geglu", bias_gelu_fusion=True)
        elif act in gated:
            kw["activation"] = gated[act]
        else:
            raise ValueError(f"hidden_act={act!r} is not supported for {arch}")
        window = getattr(hf_config, "sliding_window", None) if arch in ("mistral", "mixtral") else None
        kw.update(
            intermediate_size=3 * hf_config.intermediate_size,
            mlp_multiple_of=1,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            norm="rmsnorm",
            rms_norm_epsilon=hf_config.rms_norm_eps,
            rotary_pct=1.0,
            sliding_window_width=None if window is None else int(window) - 1,
            use_bias_in_attn_linear=bool(getattr(hf_config, "attention_bias", False)),
            use_bias_in_mlp=bool(getattr(hf_config, "mlp_bias", False)),
        )
    if arch == "mixtral":
        kw.update(mixtral_moe_keys(hf_config))
    kw.update(overrides)
    return GPTModelConfig(**kw), arch


# --------------------------------------------------------------------------------------------------------------
# state dicts


def _layer_map(architecture: str) -> list[tuple[str, str]]:
    """(NeoX suffix, HF suffix) pairs mapped 1:1 inside a layer."""
    if architecture == "neox":
        return [
            ("input_layernorm.weight", "input_layernorm.weight"),
            ("input_layernorm.bias", "input_layernorm.bias"),
            ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
            ("post_attention_layernorm.bias", "post_attention_layernorm.bias"),
            ("attention.query_key_value.weight", "attention.query_key_value.weight"),
            ("attention.query_key_value.bias", "attention.query_key_value.bias"),
            ("attention.dense.weight", "attention.dense.weight"),
            ("attention.dense.bias", "attention.dense.bias"),
            ("mlp.linear1.weight", "mlp.dense_h_to_4h.weight"),
            ("mlp.linear1.bias", "mlp.dense_h_to_4h.bias"),
            ("mlp.linear2.weight", "mlp.dense_4h_to_h.weight"),
            ("mlp.linear2.bias", "mlp.dense_4h_to_h.bias"),
        ]
    return [
        ("input_layernorm.scale", "input_layernorm.weight"),
        ("post_attention_layernorm.scale", "post_attention_layernorm.weight"),
        ("attention.dense.weight", "self_attn.o_proj.weight"),
        ("attention.dense.bias", "self_attn.o_proj.bias"),
        ("mlp.linear2.weight", "mlp.down_proj.weight"),
        ("mlp.linear2.bias", "mlp.down_proj.bias"),
    ]


def _split_qkv(t: torch.Tensor, cfg: GPTModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NeoX fused QKV (weight rows or bias) → (q, k, v) in HF's head-major order."""
    hn, kv = cfg.head_dim, cfg.kv_heads
    if not cfg.is_gqa:
        per_head = t.reshape(cfg.num_attention_heads, 3, hn, *t.shape[1:])
        q, k, v = (per_head[:, j].reshape(cfg.hidden_size, *t.shape[1:]) for j in range(3))
        return q, k, v
    q, k, v = torch.split(t, [cfg.hidden_size, kv * hn, kv * hn], dim=0)
    return q, k, v


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTModelConfig) -> torch.Tensor:
    """Inverse of ``_split_qkv``."""
    if not cfg.is_gqa:
        hn, heads = cfg.head_dim, cfg.num_attention_heads
        parts = [x.reshape(heads, hn, *x.shape[1:]) for x in (q, k, v)]
        return torch.stack(parts, dim=1).reshape(3 * cfg.hidden_size, *q.shape[1:])
    return torch.cat((q, k, v), dim=0)


def neox_to_hf_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: GPTModelConfig, architecture: str = "neox"
) -> dict[str, torch.Tensor]:
    """Map a full NeoX state dict to HF names for ``architecture`` (tensors are shared, not copied)."""
    _check_arch(architecture)
    sd = normalise_neox_keys(state_dict)
    if architecture == "mamba":
        return neox_to_mamba_state_dict(sd, cfg)
    L = cfg.num_layers
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"NeoX state dict lacks {key!r} (has {len(sd)} keys, e.g. {sorted(sd)[:3]})")
        return sd[key]

    emb = take("sequential.0.word_embeddings.weight")
    head_name, rm_key = "lm_head.weight", f"sequential.{L + 4}.rm_linear.weight"
    if rm_key in sd:  # a reward model (train_impl: rm): HF's *ForSequenceClassification head ``score``
        head_name, head = "score.weight", sd[rm_key]
    else:
        head = emb if cfg.tied_embeddings else take(f"sequential.{L + 4}.final_linear.weight")
    if architecture == "neox":
        prefix = "gpt_neox.layers.{}."
        out["gpt_neox.embed_in.weight"] = emb
        out["gpt_neox.final_layer_norm.weight"] = take(f"sequential.{L + 3}.norm.weight")
        bias = sd.get(f"sequential.{L + 3}.norm.bias")
        out["gpt_neox.final_layer_norm.bias"] = bias if bias is not None else torch.zeros_like(emb[0])
        out[head_name] = head
    else:
        prefix = "model.layers.{}."
        out["model.embed_tokens.weight"] = emb
        out["model.norm.weight"] = take(f"sequential.{L + 3}.norm.scale")
        out[head_name] = head
    for i in range(L):
        src, dst = f"sequential.{i + 2}.", prefix.format(i)
        for neox_name, hf_name in _layer_map(architecture):
            if src + neox_name in sd:
                out[dst + hf_name] = sd[src + neox_name]
            elif architecture == "neox" and neox_name.endswith("bias") and "layernorm" in neox_name:
                out[dst + hf_name] = torch.zeros_like(emb[0])  # use_bias_in_norms: false
            elif architecture == "neox" and neox_name.startswith("mlp.") and neox_name.endswith("bias"):
                width = cfg.hidden_size if "linear2" in neox_name else cfg.mlp_sizes[0]
                out[dst + hf_name] = torch.zeros(width, dtype=emb.dtype)  # HF GPTNeoX MLPs always have bias
        if architecture != "neox":
            for kind in ("weight", "bias"):
                key = f"{src}attention.query_key_value.{kind}"
                if key in sd:
                    q, k, v = _split_qkv(sd[key], cfg)
                    out[f"{dst}self_attn.q_proj.{kind}"] = q
                    out[f"{dst}self_attn.k_proj.{kind}"] = k
                    out[f"{dst}self_attn.v_proj.{kind}"] = v
                key = f"{src}mlp.linear1.{kind}"
                if key in sd:
                    up, gate = torch.chunk(sd[key], 2, dim=0)
                    out[f"{dst}mlp.up_proj.{kind}"] = up
                    out[f"{dst}mlp.gate_proj.{kind}"] = gate
        if architecture == "mixtral":
            out.update(neox_to_mixtral_experts(sd, src, dst, cfg))
    return out


def hf_to_neox_state_dict(
    state_dict: dict[str, torch.Tensor], cfg: GPTModelConfig, architecture: str = "neox"
) -> dict[str, torch.Tensor]:
    """Map a HF state dict (``lm_head``/``embed_out`` both accepted) to full NeoX ``sequential.{idx}.`` keys."""
    _check_arch(architecture)
    sd = dict(state_dict)
    if architecture == "mamba":
        return mamba_to_neox_state_dict(sd, cfg)
    if "embed_out.weight" in sd and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd.pop("embed_out.weight")
    L = cfg.num_layers
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"Hugging Face state dict lacks {key!r}")
        return sd[key]

    if architecture == "neox":
        prefix = "gpt_neox.layers.{}."
        out["sequential.0.word_embeddings.weight"] = take("gpt_neox.embed_in.weight")
        out[f"sequential.{L + 3}.norm.weight"] = take("gpt_neox.final_layer_norm.weight")
        if cfg.use_bias_in_norms:
            out[f"sequential.{L + 3}.norm.bias"] = take("gpt_neox.final_layer_norm.bias")
    else:
        prefix = "model.layers.{}."
        out["sequential.0.word_embeddings.weight"] = take("model.embed_tokens.weight")
        out[f"sequential.{L + 3}.norm.scale"] = take("model.norm.weight")
    if not cfg.tied_embeddings:
        out[f"sequential.{L + 4}.final_linear.weight"] = take("lm_head.weight")
    for i in range(L):
        src, dst = prefix.format(i), f"sequential.{i + 2}."
        for neox_name, hf_name in _layer_map(architecture):
            if src + hf_name in sd:
                if "layernorm.bias" in neox_name and not cfg.use_bias_in_norms:
                    continue
                if neox_name.startswith("mlp.") and neox_name.endswith("bias") and not cfg.use_bias_in_mlp:
                    continue
                out[dst + neox_name] = sd[src + hf_name]
        if architecture != "neox":
            for kind in ("weight", "bias"):
                if f"{src}self_attn.q_proj.{kind}" in sd:
                    q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
                    out[f"{dst}attention.query_key_value.{kind}"] = _fuse_qkv(q, k, v, cfg)
                if f"{src}mlp.up_proj.{kind}" in sd:
                    up, gate = take(f"{src}mlp.up_proj.{kind}"), take(f"{src}mlp.gate_proj.{kind}")
                    out[f"{dst}mlp.linear1.{kind}"] = torch.cat((up, gate), dim=0)
        if architecture == "mixtral":
            out.update(mixtral_to_neox_experts(sd, src, dst, cfg))
    return out
