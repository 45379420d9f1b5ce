"""All-Mamba models ⟷ Hugging Face ``MambaForCausalLM`` (transformers 5.x), used by :mod:`megatron.model.hf_mapping`.

Exact only where HF's Mamba computes the same: every layer a Mamba layer (HF has no Mamba+attention class),
``pos_emb: none`` (HF Mamba has no position embedding), RMSNorm (``rms_norm_epsilon`` ⟷ ``layer_norm_epsilon``), no
``mamba_use_bias_in_linears`` (HF's ``x_proj`` has no bias), and ``d_inner`` a multiple of ``hidden_size`` (HF's
``expand`` is an integer). ``residual_in_fp32`` is written false: our residual stays in the parameters' dtype.

Tensors (full, TP-merged: ``in_proj`` is ``[x | z]``, which :func:`megatron.model.tp_sharding.merge_state_dicts`
rebuilds from the per-rank ``[x_r | z_r]`` halves; ``x_proj`` is all-reduced at TP>1, so its merged weight is the
TP=1 one): ``sequential.0.word_embeddings.weight`` ⟷ ``backbone.embeddings.weight``; layer ``i`` at
``sequential.{i+2}.``: ``norm.scale`` ⟷ ``backbone.layers.{i}.norm.weight`` and every ``mixer.*`` tensor under the
same name; ``sequential.{L+3}.norm.scale`` ⟷ ``backbone.norm_f.weight``; the untied ``final_linear`` ⟷
``lm_head.weight``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron.model.config import GPTModelConfig
from megatron.model.mamba.sizes import D_CONV, D_STATE, mamba_dt_rank, mamba_inner_size

MIXER_TENSORS = (
    "in_proj.weight",
    "in_proj.bias",
    "conv1d.weight",
    "conv1d.bias",
    "x_proj.weight",
    "dt_proj.weight",
    "dt_proj.bias",
    "A_log",
    "D",
    "out_proj.weight",
    "out_proj.bias",
)
MIXED = "Hugging Face has no model class mixing Mamba with other layers; only all-Mamba models convert (to mamba)"


def mixed_layers_problem(cfg: GPTModelConfig) -> str | None:
    """The one-line refusal for a model that mixes Mamba and attention layers, or None."""
    kinds = set(cfg.layer_types)
    if "mamba" in kinds and len(kinds) > 1:
        return f"attention_config mixes Mamba and {'/'.join(sorted(kinds - {'mamba'}))} layers: {MIXED}"
    return None


def mamba_config(cfg: GPTModelConfig, **extra: Any) -> Any:
    """The ``MambaConfig`` for ``cfg``; ``ValueError`` naming every key without an exact HF equivalent."""
    import transformers

    problems = []
    mixed = mixed_layers_problem(cfg)
    if mixed:
        raise ValueError(mixed)
    if "mamba" not in cfg.layer_types:
        problems.append("attention_config has no 'mamba' layers (MambaForCausalLM is all-Mamba)")
    if cfg.pos_emb != "none":
        problems.append(f"pos_emb={cfg.pos_emb!r} (MambaForCausalLM has no position embedding; set pos_emb: none)")
    if cfg.norm not in ("rmsnorm", "te_rmsnorm"):
        problems.append(f"norm={cfg.norm!r} (MambaForCausalLM uses rmsnorm)")
    if cfg.mamba_use_bias_in_linears:
        problems.append("mamba_use_bias_in_linears (MambaForCausalLM's x_proj has no bias)")
    d_inner = mamba_inner_size(cfg)
    if d_inner % cfg.hidden_size:
        problems.append(
            f"Mamba inner width {d_inner} (intermediate_size / expansion_factor) is not a multiple of "
            f"hidden_size={cfg.hidden_size} (MambaConfig's expand is an integer)"
        )
    if problems:
        raise ValueError(f"no exact MambaForCausalLM equivalent: {'; '.join(problems)}")
    hf = transformers.MambaConfig(
        vocab_size=cfg.padded_vocab_size,
        hidden_size=cfg.hidden_size,
        state_size=D_STATE,
        num_hidden_layers=cfg.num_layers,
        layer_norm_epsilon=cfg.rms_norm_epsilon,
        expand=d_inner // cfg.hidden_size,
        conv_kernel=D_CONV,
        use_bias=False,
        use_conv_bias=cfg.mamba_use_bias_in_conv,
        hidden_act="silu",
        initializer_range=cfg.init_method_std,
        residual_in_fp32=False,
        time_step_rank=mamba_dt_rank(cfg),
        tie_word_embeddings=cfg.tied_embeddings,
        **extra,
    )
    hf.architectures = ["MambaForCausalLM"]
    return hf


def _hf_int(hf_config: Any, key: str, default: int) -> int:
    value = getattr(hf_config, key, default)
    return default if value == "auto" else int(value)


def mamba_config_keys(hf_config: Any) -> dict[str, Any]:
    """GPT-NeoX model keys of a HF ``MambaConfig``; ``ValueError`` naming the field GPT-NeoX's Mamba cannot hold."""
    h: int = hf_config.hidden_size
    fixed = {
        "state_size": (_hf_int(hf_config, "state_size", D_STATE), D_STATE),
        "conv_kernel": (_hf_int(hf_config, "conv_kernel", D_CONV), D_CONV),
        "time_step_rank": (_hf_int(hf_config, "time_step_rank", math.ceil(h / 16)), math.ceil(h / 16)),
    }
    for key, (got, want) in fixed.items():
        if got != want:
            raise ValueError(f"{key}={got} is not supported: GPT-NeoX's Mamba layer has {key} {want}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported: GPT-NeoX's Mamba layer uses silu")
    if getattr(hf_config, "use_bias", False):
        raise ValueError(
            "use_bias=true is not supported: GPT-NeoX's mamba_use_bias_in_linears also gives x_proj a bias, "
            "which MambaForCausalLM lacks"
        )
    d_inner = int(getattr(hf_config, "intermediate_size", None) or int(hf_config.expand) * h)
    return {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": h,
        "num_attention_heads": math.gcd(h, 16),  # unused by Mamba layers; divides hidden_size and any TP ≤ 16
        "padded_vocab_size": hf_config.vocab_size,
        "max_position_embeddings": 2048,  # no positions in a Mamba model: GPT-NeoX's default for its configs
        "pos_emb": "none",
        "attention_config": [[["mamba"], hf_config.num_hidden_layers]],
        "norm": "rmsnorm",
        "rms_norm_epsilon": float(hf_config.layer_norm_epsilon),
        "intermediate_size": d_inner,
        "mamba_use_bias_in_conv": bool(getattr(hf_config, "use_conv_bias", True)),
        "mamba_use_bias_in_linears": False,
        "no_weight_tying": not getattr(hf_config, "tie_word_embeddings", True),
        "init_method_std": float(getattr(hf_config, "initializer_range", 0.02)),
    }


def neox_to_mamba_state_dict(sd: dict[str, torch.Tensor], cfg: GPTModelConfig) -> dict[str, torch.Tensor]:
    """Full NeoX ``sequential.{idx}.`` state dict → ``MambaForCausalLM`` names (tensors shared, not copied)."""
    L = cfg.num_layers

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"NeoX state dict lacks {key!r} (has {len(sd)} keys, e.g. {sorted(sd)[:3]})")
        return sd[key]

    emb = take("sequential.0.word_embeddings.weight")
    out = {
        "backbone.embeddings.weight": emb,
        "backbone.norm_f.weight": take(f"sequential.{L + 3}.norm.scale"),
        "lm_head.weight": emb if cfg.tied_embeddings else take(f"sequential.{L + 4}.final_linear.weight"),
    }
    for i in range(L):
        src, dst = f"sequential.{i + 2}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = take(src + "norm.scale")
        for name in MIXER_TENSORS:
            if src + "mixer." + name in sd:
                out[dst + "mixer." + name] = sd[src + "mixer." + name]
    return out


def mamba_to_neox_state_dict(sd: dict[str, torch.Tensor], cfg: GPTModelConfig) -> dict[str, torch.Tensor]:
    """``MambaForCausalLM`` state dict → full NeoX ``sequential.{idx}.`` keys."""
    L = cfg.num_layers

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"Hugging Face state dict lacks {key!r}")
        return sd[key]

    out = {
        "sequential.0.word_embeddings.weight": take("backbone.embeddings.weight"),
        f"sequential.{L + 3}.norm.scale": take("backbone.norm_f.weight"),
    }
    if not cfg.tied_embeddings:
        out[f"sequential.{L + 4}.final_linear.weight"] = take("lm_head.weight")
    for i in range(L):
        src, dst = f"backbone.layers.{i}.", f"sequential.{i + 2}."
        out[dst + "norm.scale"] = take(src + "norm.weight")
        for name in MIXER_TENSORS:
            if name == "conv1d.bias" and not cfg.mamba_use_bias_in_conv:
                continue
            if name.endswith(".bias") and name != "dt_proj.bias" and name != "conv1d.bias":
                continue  # use_bias is refused on import
            out[dst + "mixer." + name] = take(src + "mixer." + name)
    return out
