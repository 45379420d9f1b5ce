"""``GPTModelConfig``: every architecture knob of the GPT model, under GPT-NeoX's flat key names.

The model never sees the whole ``NeoXArgs``; ``GPTModelConfig.from_neox_args(args)`` copies the keys it needs
(read with ``getattr`` so any object with GPT-NeoX attribute names works) and validates them, raising
``ValueError`` that names the offending key and the valid values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from megatron.config_utils import NeoXValues, neox_values, require_keys
from megatron.model.activations import ACTIVATIONS as ACTIVATION_REGISTRY
from megatron.model.layer_sharing import sharing_problems
from megatron.model.norms import NORMS as NORM_REGISTRY
from megatron.model.positional_embeddings import POSITION_EMBEDDINGS
from megatron.model.soft_prompt import soft_prompt_problems
from megatron.neox_arguments.derive import padded_vocab_size
from megatron.neox_arguments.moe_checks import moe_problems
from megatron.neox_arguments.precision import dtype_of_precision
from megatron.neox_arguments.sections import model as model_keys
from megatron.neox_arguments.sections.model import ATTENTION_TYPES, ModelArgs
from megatron.neox_arguments.sections.optimizer import MoEArgs
from megatron.neox_arguments.sections.other import LayerSplitKeys, OnnxKeys, SeedKeys, VocabKeys
from megatron.neox_arguments.sections.training import DropoutKeys, MupKeys, RecomputeKeys
from megatron.neox_arguments.sparse_layouts import SPARSE_TYPES

logger = logging.getLogger(__name__)

# Norms, activations and position embeddings are their registries' entries (the schema's Literal types are checked
# against them by tests/unit/test_registries.py).
INIT_METHODS: tuple[str, ...] = typing.get_args(model_keys.INIT_METHODS)
# Every layer type GPT-NeoX's attention_config names is built (tests/unit/test_model.py::test_every_gpt_neox_layer_type_builds).
SUPPORTED_ATTENTION = ATTENTION_TYPES
# Fused-kernel switches of GPT-NeoX: accepted, and always mapped to the fastest available equivalent
# (SDPA / plain torch ops that torch.compile can fuse). Only ``bias_gelu_fusion`` changes numerics (tanh GELU).
FUSION_KEYS = (
    "scaled_upper_triang_masked_softmax_fusion",
    "scaled_masked_softmax_fusion",
    "bias_dropout_fusion",
    "rope_fusion",
    "layernorm_fusion",
    "rmsnorm_fusion",
    "use_flashattn_swiglu",
)


def expand_attention_config(attention_config: Any, num_layers: int) -> tuple[str, ...]:
    """Expand GPT-NeoX's ``attention_config`` (``[[[types], count], ...]`` or a flat list) to one type per layer."""
    if attention_config is None:
        return ("global",) * num_layers
    items = list(attention_config)
    if all(isinstance(item, str) for item in items):
        flat = [item.lower() for item in items]
    else:
        flat = []
        for item in items:
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (list, tuple))):
                raise ValueError(
                    f"attention_config: item {item!r} is not of the form [[type, ...], count]; "
                    'example: [[["global"], 12]]'
                )
            pattern, count = [str(t).lower() for t in item[0]], item[1]
            if count == "all":
                if num_layers % len(pattern):
                    raise ValueError(
                        f"attention_config: pattern {pattern} with count 'all' must divide num_layers={num_layers}"
                    )
                count = num_layers // len(pattern)
            if not isinstance(count, int) or count < 0:
                raise ValueError(f"attention_config: count {count!r} must be a non-negative int or 'all'")
            flat.extend(pattern * count)
    if len(flat) != num_layers:
        raise ValueError(f"attention_config expands to {len(flat)} layer types but num_layers is {num_layers}")
    return tuple(flat)


pad_vocab_size = padded_vocab_size  # GPT-NeoX's rule, defined once in megatron.neox_arguments.derive


# Keys the model cannot be built without (their schema default is None: the config layer requires or derives them).
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "max_position_embeddings")


@dataclass(kw_only=True)
class GPTModelConfig(
    ModelArgs, MoEArgs, VocabKeys, SeedKeys, OnnxKeys, DropoutKeys, RecomputeKeys, LayerSplitKeys, MupKeys
):
    """Architecture of the GPT model: every model and MoE key, and the few other keys the model reads (each key's
    type, default and doc: its schema class in megatron/neox_arguments/sections/; semantics: docs/model.md)."""

    params_dtype: torch.dtype = torch.float32
    """Parameter dtype (from ``precision``)."""
    parallel_output: bool = True
    """Return vocab-parallel logits [.., V/tp] (False: gathered [.., V])."""
    fused_kernels: dict = field(default_factory=dict)
    """The GPT-NeoX fusion switches given (recorded; always mapped to SDPA / plain torch)."""
    soft_prompt_init_ids: tuple[int, ...] = ()
    """Token ids of ``soft_prompt_tuning.init_string`` (``soft_prompt.with_prompt_init`` sets them from the run's
    tokenizer; empty: uniform init)."""

    # not config keys: params_dtype comes from precision, fused_kernels from the *_fusion keys, soft_prompt_init_ids
    # from the tokenizer, and parallel_output is the model builder's choice (logits stay split over TP ranks for the parallel loss)
    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = (
        "params_dtype",
        "parallel_output",
        "fused_kernels",
        "soft_prompt_init_ids",
    )

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The attention type of each layer (``attention_config`` expanded by ``__post_init__``)."""
        return tuple(self.attention_config or ())

    def __post_init__(self) -> None:
        require_keys(self, REQUIRED_KEYS)
        # GPT-NeoX's form ([[types], count] items; None: all global) becomes one type per layer: see layer_types
        self.attention_config = list(expand_attention_config(self.attention_config or None, self.num_layers))
        # a direct construction may spell them in any case, as the config layer accepts them
        self.norm = typing.cast(model_keys.NORMS, self.norm.lower())
        self.pos_emb = typing.cast(model_keys.POS_EMBS, self.pos_emb.lower())
        self.activation = typing.cast(model_keys.ACTIVATIONS, self.activation.lower())
        self._validate()

    # ------------------------------------------------------------------------------------------------------
    # derived values

    @property
    def vocab_rows(self) -> int:
        """``padded_vocab_size``, typed without None: a model config requires it (``__post_init__``)."""
        return typing.cast(int, self.padded_vocab_size)

    @property
    def head_dim(self) -> int:
        """Dims per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``num_kv_heads``; unset: MHA, one per query head)."""
        # explicit None: a direct construction's num_kv_heads=0 is refused by _validate, not read as MHA
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def is_gqa(self) -> bool:
        """True when K/V have fewer heads than Q (fused QKV then is per-TP-rank blocked [q|k|v])."""
        return self.kv_heads != self.num_attention_heads

    @property
    def qkv_size(self) -> int:
        """Output width of the fused query_key_value projection."""
        return self.hidden_size + 2 * self.kv_heads * self.head_dim

    @property
    def rotary_ndims(self) -> int:
        """Rotary dims per head."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def is_gated(self) -> bool:
        """Gated MLP (linear1 produces [up | gate])."""
        return ACTIVATION_REGISTRY.get(self.activation).gated

    @property
    def mlp_sizes(self) -> tuple[int, int]:
        """``(linear1 output width, linear2 input width)`` following GPT-NeoX's sizing rule.

        ffn = intermediate_size or int(expansion_factor·h) or 4h. Gated: ffn_in = int(ffn·2/3)//2 rounded up to
        ``mlp_multiple_of`` and linear1 = 2·ffn_in (GPT-NeoX rounds linear1 to 2·m separately; the two agree for
        every config GPT-NeoX can run). Plain: both = ffn rounded up to ``mlp_multiple_of``.
        """
        m = self.mlp_multiple_of
        if self.intermediate_size:
            ffn = self.intermediate_size
        elif self.expansion_factor:
            ffn = int(self.expansion_factor * self.hidden_size)
        else:
            ffn = 4 * self.hidden_size
        if self.is_gated:
            ffn_in = m * math.ceil((int(ffn * 2 / 3) // 2) / m)
            return 2 * ffn_in, ffn_in
        ffn = m * math.ceil(ffn / m)
        return ffn, ffn

    @property
    def tied_embeddings(self) -> bool:
        """The output layer reuses the word embedding."""
        return not self.no_weight_tying

    @property
    def norm_epsilon(self) -> float:
        """The epsilon of the chosen norm."""
        return float(getattr(self, NORM_REGISTRY.get(self.norm).epsilon_key))

    @property
    def is_moe(self) -> bool:
        """True when some layers are mixture-of-experts layers."""
        return self.moe_num_experts > 1

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether transformer layer ``layer_index`` (0-based) has an MoE MLP (GPT-NeoX: ``i % interval == 0``)."""
        return self.is_moe and layer_index % self.moe_expert_interval == 0

    @property
    def num_moe_layers(self) -> int:
        """How many layers are MoE layers."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def moe_experts_gated(self) -> bool:
        """Experts with a gate (``w3``): a gated activation and ``moe_gated_experts``. GPT-NeoX always builds its
        ungated grouped MLP and applies the gated activation's function to ``w1``'s output alone."""
        return self.is_gated and self.moe_gated_experts

    @property
    def moe_ffn_size(self) -> int:
        """Width of one expert: intermediate_size, else 4h (gated experts: int(8h/3)) rounded up to a multiple of
        256 (GPT-NeoX's grouped MLPs)."""
        if self.intermediate_size:
            return self.intermediate_size
        ffn = int(2 * self.hidden_size * 4 / 3) if self.moe_experts_gated else 4 * self.hidden_size
        return 256 * math.ceil(ffn / 256)

    def replace(self, **changes: Any) -> GPTModelConfig:
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------------------------

    def _validate(self) -> None:
        """The rules of what the model builds (registered components, attention kinds, rotary dims). A key's own
        range and the cross-key rules of the config layer (``neox_arguments/ranges.py``, ``validate.py``) are checked
        there once, before a ``GPTModelConfig`` is built from the arguments; a direct construction is trusted."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for key, registry in (
            ("norm", NORM_REGISTRY),
            ("pos_emb", POSITION_EMBEDDINGS),
            ("activation", ACTIVATION_REGISTRY),
        ):
            value = getattr(self, key)
            need(value in registry, registry.unknown(value))
        for key in ("init_method", "output_layer_init_method"):
            value = getattr(self, key)
            need(value in INIT_METHODS, f"{key}={value!r} is not one of {', '.join(INIT_METHODS)}")
        if self.pos_emb == "rotary":
            need(
                self.rotary_ndims >= 2 and self.rotary_ndims % 2 == 0,
                f"rotary_pct={self.rotary_pct} gives {self.rotary_ndims} rotary dims for head_dim={self.head_dim}; "
                "it must be an even number >= 2",
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in SUPPORTED_ATTENTION:
                raise ValueError(
                    f"attention_config: layer {i} type {kind!r} is unknown; supported: {', '.join(SUPPORTED_ATTENTION)}"
                )

        if any(kind in ("gmlp", "amlp") for kind in self.layer_types):
            need(self.seq_length is not None, "gmlp/amlp layers need seq_length (the span of sgu.proj)")
        if any(kind in SPARSE_TYPES for kind in self.layer_types):
            need(self.seq_length is not None, "sparse attention layers need seq_length (their layouts' size)")
        for problem in moe_problems(self):
            raise ValueError(problem)
        if "mamba" in self.layer_types and self.mamba_inner_func_fusion and self.mamba_use_bias_in_linears:
            raise ValueError(
                "mamba_inner_func_fusion and mamba_use_bias_in_linears cannot be combined (GPT-NeoX's fused Mamba "
                "inner function has no projection biases); unset one"
            )
        for problem in sharing_problems(self) + soft_prompt_problems(self):
            raise ValueError(problem)

    # ------------------------------------------------------------------------------------------------------

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> GPTModelConfig:
        """Build from a ``NeoXArgs`` (or ``neox_namespace``): every field is read strictly under its key.

        ``padded_vocab_size`` must be set; ``None`` (a key the config derives or requires) keeps the field's default.
        """
        values = neox_values(cls, args)
        if not values["padded_vocab_size"]:
            raise ValueError("padded_vocab_size is not set: build the tokenizer (or pad the vocab) before the model")
        missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if values[k] is None]
        if missing:
            raise ValueError(f"model config is missing required key(s): {', '.join(missing)}")
        kwargs: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
        kwargs["padded_vocab_size"] = int(values["padded_vocab_size"])
        kwargs["params_dtype"] = dtype_of_precision(args.precision)  # the config layer derived precision
        kwargs["fused_kernels"] = {k: True for k in FUSION_KEYS if getattr(args, k)}
        if args.output_layer_parallelism != "column":
            raise ValueError("output_layer_parallelism must be 'column' (the only value GPT-NeoX supports)")
        if str(kwargs.get("norm", "")).startswith("te_"):
            logger.warning("norm=%s: TransformerEngine is not used; using the plain equivalent", kwargs["norm"])
        return cls(**kwargs)
