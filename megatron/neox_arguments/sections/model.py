"""Model shape and architecture keys (GPT-NeoX's ``NeoXArgsModel``)."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from megatron.neox_arguments.fields import arg

PRECISIONS = Literal["fp16", "fp32", "bfloat16"]
# The allowed values of norm, pos_emb and activation: exactly the entries of the model's registries (NORMS in
# megatron/model/norms.py, POSITION_EMBEDDINGS in positional_embeddings.py, ACTIVATIONS in activations.py), which this
# torch-free layer cannot import; tests/unit/test_registries.py checks that both name the same values.
NORMS = Literal["layernorm", "rmsnorm", "non_parametric_layernorm", "scalenorm", "te_rmsnorm", "te_layernorm"]
POS_EMBS = Literal["learned", "rotary", "sinusoidal", "rpe", "alibi", "none"]
# A gated activation's MLP is gated (linear1 gives [x | gate]): the config layer's size and MoE checks read this list,
# and test_registries.py checks the registry marks the same entries `gated`.
GatedActivation = Literal["geglu", "reglu", "swiglu", "bilinear", "glu"]
ACTIVATIONS = Literal["gelu", "relu", "softsign", "swish", "mish", "silu", GatedActivation]
GATED_ACTIVATIONS: tuple[str, ...] = typing.get_args(GatedActivation)
INIT_METHODS = Literal[
    "normal",
    "scaled_normal",
    "orthogonal",
    "scaled_orthogonal",
    "xavier_uniform",
    "xavier_normal",
    "wang_init",
    "small_init",
    "single_residual_scaled_normal",
]
# Per-layer attention types accepted in ``attention_config``.
ATTENTION_TYPES = (
    "global",
    "local",
    "sparse_fixed",
    "sparse_variable",
    "bigbird",
    "bslongformer",
    "gmlp",
    "amlp",
    "flash",
    "rwkv",
    "mamba",
)


@dataclass(kw_only=True)
class PrecisionKeys:
    """The training precision."""

    precision: PRECISIONS = arg(
        None, "Training precision. Derived from the `fp16`/`bf16` dicts when unset; `fp32` otherwise.", derived=True
    )


@dataclass(kw_only=True)
class ShapeKeys:
    """Depth, width and attention heads of the model."""

    num_layers: int = arg(None, "Number of transformer layers (required).", checkpointed=True)
    hidden_size: int = arg(None, "Width of the residual stream (required).", checkpointed=True)
    num_attention_heads: int = arg(None, "Number of attention (query) heads (required).", checkpointed=True)


@dataclass(kw_only=True)
class SequenceKeys:
    """The training sequence length and the longest position."""

    seq_length: int = arg(None, "Training sequence length in tokens.")
    max_position_embeddings: int = arg(
        None,
        "Largest position the model supports (size of a learned position table); >= seq_length (required).",
        checkpointed=True,
    )


@dataclass(kw_only=True)
class VocabPaddingKeys:
    """How the vocabulary is padded."""

    make_vocab_size_divisible_by: int = arg(
        128, "Pad the vocabulary to a multiple of this value times model_parallel_size.", checkpointed=True
    )


@dataclass(kw_only=True)
class ResidualKeys:
    """GPT-J's parallel residual."""

    gpt_j_residual: bool = arg(
        False, "Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)) instead of two sequential residual adds."
    )
    gpt_j_tied: bool = arg(False, "With gpt_j_residual, share one norm between the attention and MLP branches.")


@dataclass(kw_only=True)
class MLPWidthKeys:
    """The width of the MLP."""

    intermediate_size: int | None = arg(
        None, "Width of the MLP's inner projection. Unset: 4 x hidden_size (gated activations: scaled by 2/3)."
    )
    mlp_multiple_of: int = arg(1, "Round the MLP inner width up to a multiple of this value.")
    expansion_factor: float | None = arg(None, "MLP inner width as a multiple of hidden_size (default 4).")


@dataclass(kw_only=True)
class LayerTypeKeys:
    """The kind of each layer."""

    attention_config: list | None = arg(
        None,
        "Attention type per layer, written as a list of [[types...], repeat] pairs, e.g. "
        '`[[["global"], 12]]` or `[[["local", "global"], "all"]]` ("all" tiles the pattern over num_layers). '
        f"Types: {', '.join(ATTENTION_TYPES)}. Unset: global attention in every layer. Expanded to a flat "
        "per-layer list by derive().",
        derived=True,
    )


@dataclass(kw_only=True)
class ModelArgs(PrecisionKeys, ShapeKeys, SequenceKeys, VocabPaddingKeys, ResidualKeys, MLPWidthKeys, LayerTypeKeys):
    """Shape, positional encoding, normalisation, activation, initialisation and kernel-fusion switches."""

    num_kv_heads: int | None = arg(
        None,
        "Number of key/value heads. Unset or equal to num_attention_heads: multi-head attention; fewer: "
        "grouped-query attention; 1: multi-query attention. Must divide num_attention_heads.",
    )
    sliding_window_width: int | None = arg(
        None, "If set, each token attends only to this many previous tokens (sliding-window attention)."
    )
    norm: NORMS = arg("layernorm", "Normalisation layer type.")
    layernorm_fusion: bool = arg(False, "Use a fused LayerNorm kernel where available.")
    rmsnorm_fusion: bool = arg(False, "Use a fused RMSNorm kernel where available.")
    use_qk_layernorm: bool = arg(False, "Normalise queries and keys (per head) before the attention product.")
    layernorm_epsilon: float = arg(1.0e-5, "Epsilon of LayerNorm.")
    rms_norm_epsilon: float = arg(1.0e-8, "Epsilon of RMSNorm.")
    scalenorm_epsilon: float = arg(1.0e-8, "Epsilon of ScaleNorm.")
    pos_emb: POS_EMBS = arg("learned", "Positional encoding type.")
    rpe_num_buckets: int = arg(32, "Number of buckets of T5-style relative position encoding (`pos_emb: rpe`).")
    rpe_max_distance: int = arg(128, "Maximum distance of T5-style relative position encoding.")
    opt_pos_emb_offset: int = arg(0, "Offset added to learned position indices (OPT checkpoints use 2).")
    no_weight_tying: bool = arg(False, "Use a separate output projection instead of the input embedding matrix.")
    sparsity_config: dict | None = arg(
        None,
        "Block layouts of the sparse attention types (local, sparse_fixed, sparse_variable, bigbird, bslongformer), "
        "as GPT-NeoX passes them to DeepSpeed's sparsity configs: `block` (16) and per type `num_local_blocks`, "
        "`num_global_blocks`, `num_different_global_patterns`, `different_layout_per_head`, `num_random_blocks`, "
        "`local_window_blocks`, `global_block_indices`, `global_block_end_indices`, `num_sliding_window_blocks` "
        "(docs/model.md). seq_length must be a multiple of `block`.",
    )
    num_unique_layers: int | None = arg(
        None,
        "Number of distinct transformer layers whose parameters are shared across num_layers (must divide it); "
        "checkpoints still hold every layer, as equal copies.",
    )
    param_sharing_style: str = arg("grouped", "Order of shared layers: `grouped` (1,2,1,2) or `spaced` (1,1,2,2).")
    activation: ACTIVATIONS = arg("gelu", f"MLP activation; gated ones: {', '.join(GATED_ACTIVATIONS)}.")
    use_flashattn_swiglu: bool = arg(False, "Use flash-attn's fused SwiGLU kernel (CUDA only).")
    scaled_upper_triang_masked_softmax_fusion: bool = arg(
        False, "Fused scale + causal mask + softmax kernel (CUDA only; same result as the unfused path)."
    )
    scaled_masked_softmax_fusion: bool = arg(False, "Fused scale + general mask + softmax kernel (CUDA only).")
    bias_gelu_fusion: bool = arg(
        False, "Fused bias + GELU. Note: GPT-NeoX's fused path uses the tanh approximation of GELU, kept here."
    )
    bias_dropout_fusion: bool = arg(False, "Fused bias + dropout + residual add.")
    rope_fusion: bool = arg(False, "Fused rotary-embedding kernel (CUDA only).")
    fp16_lm_cross_entropy: bool = arg(False, "Compute the unreduced language-model loss in fp16 (needs fp16).")
    torch_compile: bool = arg(
        False,
        "neox-forge: compile each transformer layer with `torch.compile` (inductor) for training; the first step "
        "includes the compilation and the log reports its time. Sequential models (pipe_parallel_size 0) at "
        "model_parallel_size 1 with ZeRO stage 0-2 and dense layers (activation checkpointing included); other layouts are refused.",
    )
    init_method_std: float = arg(0.02, "Standard deviation of the normal initialisers.")
    apply_query_key_layer_scaling: bool = arg(
        False, "Scale attention scores by 1/layer_number (forces attention_softmax_in_fp32)."
    )
    use_cpu_initialization: bool = arg(False, "Initialise parallel weights on the CPU (identical across TP sizes).")
    attention_softmax_in_fp32: bool = arg(False, "Run the attention mask + softmax in fp32.")
    rotary_pct: float = arg(1.0, "Fraction of each head's dimensions that rotary embedding rotates.")
    rotary_emb_base: int = arg(10000, "Base (theta) of the rotary frequencies.")
    rotary_save_freqs_buffer: bool = arg(
        False, "Store the rotary `inv_freq` buffer in checkpoints (for checkpoints trained that way)."
    )
    init_method: INIT_METHODS = arg("normal", "Initialiser of all weights except residual-output projections.")
    output_layer_init_method: INIT_METHODS = arg(
        "scaled_normal", "Initialiser of the residual-output projections (attention dense, MLP output)."
    )
    gmlp_attn_dim: int = arg(
        64, "Width of the single-head tiny attention of `amlp` layers (gMLP blocks with attention)."
    )
    use_bias_in_norms: bool = arg(True, "Give norm layers a bias term.")
    use_bias_in_attn_linear: bool = arg(True, "Give the attention projections (QKV, dense) bias terms.")
    use_bias_in_mlp: bool = arg(True, "Give the MLP projections bias terms.")
    soft_prompt_tuning: dict | None = arg(
        None,
        "Soft-prompt tuning settings: enabled (default false), n_tokens (10), init_string ('': uniform init in "
        "[-init_range, init_range], init_range 0.5). Trains only a prefix of n_tokens embeddings "
        "(`sequential.1.soft_embedding_weight`, the pipeline's layer_01); every other parameter is frozen.",
    )
    mamba_selective_scan_fusion: bool = arg(False, "Mamba: fused selective-scan kernel.")
    mamba_causal_conv_fusion: bool = arg(False, "Mamba: fused causal conv1d kernel.")
    mamba_inner_func_fusion: bool = arg(False, "Mamba: fused inner function (needs both kernels above).")
    mamba_selective_fp32_params: bool = arg(True, "Mamba: keep the A and D parameters in fp32.")
    mamba_use_bias_in_conv: bool = arg(True, "Mamba: bias in the conv1d.")
    mamba_use_bias_in_linears: bool = arg(False, "Mamba: bias in the in/out projections.")
    output_layer_parallelism: Literal["column"] = arg(
        "column", "How the output layer is split under tensor parallelism (only `column`: over the vocabulary)."
    )
    dim_att: int | None = arg(None, "RWKV: total attention width (default hidden_size).")
    head_size: int | None = arg(
        None, "RWKV: width of each head, always dim_att // num_attention_heads (a value given must agree)."
    )
    ffn_dim: int | None = arg(
        None,
        "RWKV: channel-mix (feed-forward) width. Unset: intermediate_size, else int(expansion_factor · hidden_size) "
        "with expansion_factor 3.5 by default, rounded down to a multiple of 32 (GPT-NeoX's rule).",
    )
    te_columnparallel: bool = arg(False, "Transformer Engine column-parallel linear layers.")
    te_rowparallel: bool = arg(False, "Transformer Engine row-parallel linear layers.")
    te_layernorm_mlp: bool = arg(False, "Transformer Engine fused LayerNorm + MLP.")
    te_mha: bool = arg(False, "Transformer Engine multi-head attention.")
    te_fp8_format: Literal["e4m3", "hybrid"] = arg("hybrid", "Transformer Engine FP8 format.")
    te_fp8_wgrad: bool = arg(True, "Transformer Engine: compute weight gradients in FP8.")
    te_fp8_amax_history_len: int = arg(1, "Transformer Engine: FP8 amax history length.")
    te_fp8_amax_compute_algo: str = arg("most_recent", "Transformer Engine: FP8 amax algorithm.")
    te_fp8_margin: int = arg(0, "Transformer Engine: FP8 scaling margin.")
    te_fp8_mha: bool = arg(False, "Transformer Engine: FP8 attention.")
