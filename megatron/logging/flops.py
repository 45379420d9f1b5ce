"""Model FLOPs per iteration and utilisation, with GPT-NeoX's transformer formula.

``flops_per_iteration = 24 · K · B · s · l · h² · (1 + s/(6h) + V/(16·l·h))`` where ``B`` is the global batch
(samples per iteration), ``s`` the sequence length, ``l`` layers, ``h`` hidden size, ``V`` the padded vocab;
``K = 3`` counts forward + backward (model FLOPs, MFU) and ``K = 4`` adds the recomputed forward of activation
checkpointing (hardware FLOPs, HFU). Per device: divide by ``iteration_time · world_size``.

Mamba layers (``attention_config`` type ``mamba``) count GPT-NeoX's Mamba formula per layer,
``K·B·s·(d·(11·16 + 4·r + 1) + 6·d·h + 2·d·4)`` (selective scan, projections, conv; ``d`` the inner width
``expansion_factor·h`` or ``intermediate_size`` or ``2h``, ``r = ⌈h/16⌉``), and a model made only of them GPT-NeoX's
output-layer term ``6·B·s·h·V``; in a mixed model the other layers keep the transformer formula's terms.

With ``rwkv`` layers GPT-NeoX uses its RWKV formula for the whole model (``a`` attention heads), the same for MFU and
HFU: ``B · s · (78·l·h² + 84·l·h + 16·h + 12·h·V + 18·l·h²/a)``.

gMLP/aMLP layers and block-sparse attention layers count as transformer layers (dense scores), as GPT-NeoX counts
them: the logged figures compare with a GPT-NeoX run's. The planner's step time uses their real FLOPs
(:mod:`megatron.planner.layer_flops`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron.config_utils import NeoXValues, neox_values, require_keys
from megatron.neox_arguments.sections.deepspeed import BatchSizeKeys
from megatron.neox_arguments.sections.logging import PeakFlopsKeys
from megatron.neox_arguments.sections.model import LayerTypeKeys, MLPWidthKeys, SequenceKeys, ShapeKeys
from megatron.neox_arguments.sections.other import VocabKeys
from megatron.neox_arguments.sections.training import RecomputeKeys

FLOPS_FORMULA = "24·K·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), K=3 (MFU) or 4 with activation checkpointing (HFU)"
RWKV_FLOPS_FORMULA = "B·s·(78·l·h² + 84·l·h + 16·h + 12·h·V + 18·l·h²/heads) (GPT-NeoX's RWKV formula)"


@dataclass
class FlopsConfig(
    BatchSizeKeys, SequenceKeys, ShapeKeys, VocabKeys, RecomputeKeys, PeakFlopsKeys, MLPWidthKeys, LayerTypeKeys
):
    """Shape and batch values the formula needs."""

    def __post_init__(self) -> None:
        # required: the schema's default is None
        require_keys(self, ("train_batch_size", "seq_length", "num_layers", "hidden_size", "padded_vocab_size"))

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> FlopsConfig:
        """Read every field strictly under its NeoX key (``padded_vocab_size`` set)."""
        if args.padded_vocab_size is None:
            raise ValueError("FlopsConfig.from_neox_args: padded_vocab_size is not set (build the tokenizer first)")
        return cls(**neox_values(cls, args))


def flops_formula(cfg: FlopsConfig) -> str:
    """The formula :func:`flops_per_iteration` uses for ``cfg``, as logged."""
    return RWKV_FLOPS_FORMULA if cfg.attention_config and "rwkv" in cfg.attention_config else FLOPS_FORMULA


def flops_per_iteration(cfg: FlopsConfig, k: int = 3) -> float:
    """FLOPs of one training iteration over the whole global batch."""
    b, s, layers, h, v = cfg.train_batch_size, cfg.seq_length, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size
    assert v is not None, "from_neox_args refuses padded_vocab_size unset"
    if cfg.attention_config and "rwkv" in cfg.attention_config:
        a = cfg.num_attention_heads
        return b * s * (78.0 * layers * h * h + 84.0 * layers * h + 16.0 * h + 12.0 * h * v + 18.0 * layers * h * h / a)
    mamba = sum(1 for t in cfg.attention_config or () if t == "mamba")
    if not mamba:
        return 24.0 * k * b * s * layers * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * layers * h))
    if cfg.expansion_factor:
        inner = h * cfg.expansion_factor
    elif cfg.intermediate_size:
        inner = float(cfg.intermediate_size)
    else:
        inner = 2.0 * h
    d_state, conv, dt_rank = 16, 4, math.ceil(h / 16)
    per_mamba = k * b * s * (inner * (11 * d_state + 4 * dt_rank + 1) + 6 * inner * h + 2 * inner * conv)
    others = layers - mamba
    per_transformer = 24.0 * k * b * s * h * h * (1.0 + s / (6.0 * h))
    head = 6.0 * b * s * h * v if others == 0 else 1.5 * k * b * s * h * v
    return mamba * per_mamba + others * per_transformer + head


def throughput_metrics(
    cfg: FlopsConfig, iteration_time: float, world_size: int, seq_lengths: list[int] | None = None
) -> dict[str, float]:
    """``runtime/*`` metrics for one iteration of ``iteration_time`` seconds on ``world_size`` devices.

    ``seq_lengths``: the sequence length of each iteration of the interval when curriculum learning cut the batches
    (the FLOPs and tokens are their mean over these iterations); None: ``seq_length``."""
    t = max(iteration_time, 1e-12)
    samples_per_sec = cfg.train_batch_size / t
    actual_k = 4 if cfg.checkpoint_activations else 3
    shapes = [replace(cfg, seq_length=s) for s in seq_lengths] if seq_lengths else [cfg]

    def mean_flops(k: int) -> float:
        return sum(flops_per_iteration(c, k) for c in shapes) / len(shapes)

    flops_per_sec_per_gpu = mean_flops(actual_k) / (t * world_size)
    out = {
        "runtime/iteration_time": iteration_time,
        "runtime/steps_per_sec": 1.0 / t,
        "runtime/samples_per_sec": samples_per_sec,
        "runtime/tokens_per_sec": samples_per_sec * sum(c.seq_length for c in shapes) / len(shapes),
        "runtime/flops_per_sec_per_gpu": flops_per_sec_per_gpu,
    }
    if cfg.peak_theoretical_tflops:
        peak = float(cfg.peak_theoretical_tflops) * 1e12
        model_flops = mean_flops(3) / (t * world_size)
        out["runtime/model_flops_utilization"] = 100.0 * model_flops / peak
        out["runtime/hardware_flops_utilization"] = 100.0 * flops_per_sec_per_gpu / peak
    return out
