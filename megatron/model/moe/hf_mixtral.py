"""MoE models ⟷ Hugging Face ``MixtralForCausalLM`` (transformers 5.x), used by :mod:`megatron.model.hf_mapping`.

Exact only where Mixtral computes the same: every layer an MoE layer (``moe_expert_interval: 1``), the ``topk``
router with ``moe_normalize_expert_weights: true`` (Mixtral divides the top-k probabilities by their sum), a SwiGLU
expert (``w1`` = gate, ``w3`` = up, ``w2`` = down), RMSNorm, no biases, full rotary. Tensors per layer:

* router ``mlp.router.layer.weight`` [E, h] ⟷ ``mlp.gate.weight``;
* in memory (transformers 5.x modules): ``mlp.experts.gate_up_proj`` [E, 2f, h] = per expert ``[w1_e | w3_e]``;
  ``mlp.experts.down_proj`` [E, h, f] = ``w2_e^T``;
* on disk (what ``save_pretrained`` writes and other tools read): ``block_sparse_moe.gate.weight`` and
  ``block_sparse_moe.experts.{e}.w1/w3.weight`` [f, h] (= ``w1_e``/``w3_e``), ``w2.weight`` [h, f] (= ``w2_e^T``).
  Both forms are read on input; exports write the on-disk form.

``moe_jitter_eps`` is a training-time setting and exported as ``router_jitter_noise`` (HF also jitters the experts'
input, so training under HF with it differs); ``moe_loss_weight`` becomes ``router_aux_loss_coef``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.model.config import GPTModelConfig


def mixtral_config(cfg: GPTModelConfig, kwargs: dict[str, Any], window: int | None, problems: list[str], **extra: Any):
    """The ``MixtralConfig`` for ``cfg`` (``kwargs``: the Llama-family fields); ``ValueError`` when not exact."""
    import transformers

    problems = list(problems)
    if not cfg.is_moe:
        problems.append("moe_num_experts=1 (Mixtral is a mixture of experts; use llama or mistral)")
    else:
        if cfg.moe_expert_interval != 1:
            problems.append(f"moe_expert_interval={cfg.moe_expert_interval} (every Mixtral layer is an MoE layer)")
        if cfg.moe_router_type != "topk" or not cfg.moe_normalize_expert_weights:
            problems.append(
                f"moe_router_type={cfg.moe_router_type!r}, moe_normalize_expert_weights="
                f"{cfg.moe_normalize_expert_weights} (Mixtral routes with normalised top-k: set topk and true)"
            )
    if cfg.activation != "swiglu" or (cfg.is_moe and not cfg.moe_gated_experts):
        problems.append(
            f"activation={cfg.activation!r}, moe_gated_experts={cfg.moe_gated_experts} (Mixtral experts are "
            "gated SwiGLU MLPs: set swiglu and true)"
        )
    if problems:
        raise ValueError(f"no exact MixtralForCausalLM equivalent: {'; '.join(problems)}")
    kwargs = {**kwargs, "intermediate_size": cfg.moe_ffn_size}
    hf = transformers.MixtralConfig(
        **kwargs,
        sliding_window=window,
        num_local_experts=cfg.moe_num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        # moe_jitter_eps None: no jitter, which HF spells 0.0
        router_jitter_noise=cfg.moe_jitter_eps if cfg.moe_jitter_eps is not None else 0.0,
        router_aux_loss_coef=cfg.moe_loss_weight,
        **extra,
    )
    hf.architectures = ["MixtralForCausalLM"]
    return hf


def mixtral_moe_keys(hf_config: Any) -> dict[str, Any]:
    """GPT-NeoX MoE keys (and the expert width) of a HF Mixtral config."""
    jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    return {
        "intermediate_size": hf_config.intermediate_size,  # MoE layers use it as the expert width as is
        "moe_num_experts": hf_config.num_local_experts,
        "moe_top_k": hf_config.num_experts_per_tok,
        "moe_router_type": "topk",
        "moe_normalize_expert_weights": True,
        "moe_gated_experts": True,
        "moe_expert_interval": 1,
        "moe_jitter_eps": jitter or None,
        "moe_loss_weight": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
    }


def _experts(w: torch.Tensor, num_experts: int) -> torch.Tensor:
    return w.reshape(num_experts, -1, w.shape[-1])  # [E·f, h] → [E, f, h]


def neox_to_mixtral_experts(
    sd: dict[str, torch.Tensor], src: str, dst: str, cfg: GPTModelConfig
) -> dict[str, torch.Tensor]:
    """One layer's router and experts (NeoX prefix ``src``) under HF Mixtral names (prefix ``dst``)."""
    num_experts = cfg.moe_num_experts
    try:
        w1, w3, w2 = (_experts(sd[f"{src}mlp.experts.mlp.{n}"], num_experts) for n in ("w1", "w3", "w2"))
        gate = sd[f"{src}mlp.router.layer.weight"]
    except KeyError as e:
        raise ValueError(f"NeoX state dict lacks {e.args[0]!r} (an MoE layer with gated experts)") from None
    return {
        f"{dst}mlp.gate.weight": gate,
        f"{dst}mlp.experts.gate_up_proj": torch.cat((w1, w3), dim=1).contiguous(),
        f"{dst}mlp.experts.down_proj": w2.transpose(1, 2).contiguous(),
    }


def mixtral_to_neox_experts(
    sd: dict[str, torch.Tensor], src: str, dst: str, cfg: GPTModelConfig
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`neox_to_mixtral_experts` (also reads HF's older per-expert ``block_sparse_moe`` names)."""
    num_experts, f = cfg.moe_num_experts, cfg.moe_ffn_size
    if f"{src}mlp.experts.gate_up_proj" in sd:
        gate_up = sd[f"{src}mlp.experts.gate_up_proj"]
        w1, w3 = gate_up[:, :f], gate_up[:, f:]
        w2 = sd[f"{src}mlp.experts.down_proj"].transpose(1, 2)
        gate = sd[f"{src}mlp.gate.weight"]
    else:
        old = f"{src}block_sparse_moe."
        try:
            w1, w3, w2t = (
                torch.stack([sd[f"{old}experts.{e}.{n}.weight"] for e in range(num_experts)])
                for n in ("w1", "w3", "w2")
            )
            gate = sd[f"{old}gate.weight"]
        except KeyError as e:
            raise ValueError(f"Hugging Face state dict lacks {e.args[0]!r} (Mixtral experts)") from None
        w2 = w2t.transpose(1, 2)
    return {
        f"{dst}mlp.router.layer.weight": gate,
        f"{dst}mlp.experts.mlp.w1": w1.reshape(num_experts * f, -1).contiguous(),
        f"{dst}mlp.experts.mlp.w3": w3.reshape(num_experts * f, -1).contiguous(),
        f"{dst}mlp.experts.mlp.w2": w2.reshape(num_experts * f, -1).contiguous(),
    }


def mixtral_disk_names(hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The in-memory (fused) Mixtral names of ``hf_sd`` rewritten as HF's on-disk per-expert names."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_sd.items():
        if key.endswith("mlp.gate.weight"):
            out[key.replace("mlp.gate.weight", "block_sparse_moe.gate.weight")] = value
        elif key.endswith("mlp.experts.gate_up_proj"):
            pre = key.removesuffix("mlp.experts.gate_up_proj") + "block_sparse_moe.experts."
            w1, w3 = torch.chunk(value, 2, dim=1)
            for e in range(value.shape[0]):
                out[f"{pre}{e}.w1.weight"], out[f"{pre}{e}.w3.weight"] = w1[e], w3[e]
        elif key.endswith("mlp.experts.down_proj"):
            pre = key.removesuffix("mlp.experts.down_proj") + "block_sparse_moe.experts."
            for e in range(value.shape[0]):
                out[f"{pre}{e}.w2.weight"] = value[e]
        else:
            out[key] = value
    return out
