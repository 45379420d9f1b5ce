"""The valid range of every numeric config key, checked on the user's values before anything is derived.

``RANGES`` maps each key whose type holds a number to its :class:`Range`; ``NO_RANGE`` lists the numeric keys
for which no number is wrong, with the reason. tests/unit/test_config_value_checks.py fails for a numeric key
in neither table, so a new key gets a range when it is added. Float values must also be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """``lo``/``hi`` bounds (None: unbounded), open or closed, plus sentinel values that are valid too."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float, ...] = ()

    def contains(self, x: float) -> bool:
        """True when ``x`` is valid (NaN and inf never are)."""
        if x in self.also:
            return True
        if not math.isfinite(x):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)

    def describe(self) -> str:
        """``>= 1``, ``> 0``, ``between 0 and 1``, ``in (0, 1]``, with sentinels: ``-1 or >= 1``."""
        lo, hi = _num(self.lo), _num(self.hi)
        if self.lo is not None and self.hi is not None:
            text = (
                f"between {lo} and {hi}"
                if not (self.lo_open or self.hi_open)
                else f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
            )
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo}"
        else:
            text = f"{'<' if self.hi_open else '<='} {hi}"
        return " or ".join([*(_num(a) for a in self.also), text])


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


POSITIVE = Range(0, lo_open=True)  # > 0
AT_LEAST_ONE = Range(1)  # counts, sizes, intervals
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1)  # probabilities, fractions
PORT = Range(1, 65535)

RANGES: dict[str, Range] = {
    # parallelism and launch
    "pipe_parallel_size": NON_NEGATIVE,
    "model_parallel_size": AT_LEAST_ONE,
    **dict.fromkeys(("num_layers_per_virtual_pipeline_stage", "context_parallel_size"), AT_LEAST_ONE),
    "world_size": AT_LEAST_ONE,
    "dp_world_size": AT_LEAST_ONE,
    "global_num_gpus": AT_LEAST_ONE,
    "num_gpus": AT_LEAST_ONE,
    "num_nodes": Range(1, also=(-1,)),
    "master_port": PORT,
    # 0.001 minutes is a 60 ms socket timeout (torch needs >= 1 ms); 7 days fits any timedelta and socket timeout
    "distributed_timeout_minutes": Range(0.001, 7 * 24 * 60),
    "local_rank": NON_NEGATIVE,
    "rank": NON_NEGATIVE,
    "online_dataserver_ports": PORT,
    "weight_server_port": PORT,
    "online_dataserver_timeout": POSITIVE,
    # model shape
    **dict.fromkeys(("num_layers", "hidden_size", "num_attention_heads", "seq_length"), AT_LEAST_ONE),
    **dict.fromkeys(("max_position_embeddings", "intermediate_size", "mlp_multiple_of", "num_kv_heads"), AT_LEAST_ONE),
    **dict.fromkeys(("sliding_window_width", "rpe_num_buckets", "rpe_max_distance", "num_unique_layers"), AT_LEAST_ONE),
    **dict.fromkeys(("make_vocab_size_divisible_by", "rotary_emb_base", "gmlp_attn_dim"), AT_LEAST_ONE),
    **dict.fromkeys(("dim_att", "head_size", "ffn_dim", "padded_vocab_size", "checkpoint_num_layers"), AT_LEAST_ONE),
    "expansion_factor": POSITIVE,
    **dict.fromkeys(("layernorm_epsilon", "rms_norm_epsilon", "scalenorm_epsilon", "init_method_std"), POSITIVE),
    "rotary_pct": Range(0, 1, lo_open=True),
    "opt_pos_emb_offset": NON_NEGATIVE,
    "te_fp8_amax_history_len": AT_LEAST_ONE,
    "te_fp8_margin": NON_NEGATIVE,
    **dict.fromkeys(("moe_num_experts", "moe_expert_interval", "moe_top_k"), AT_LEAST_ONE),
    "moe_jitter_eps": Range(0, 1, hi_open=True),
    "moe_loss_weight": NON_NEGATIVE,
    **dict.fromkeys(("attention_dropout", "hidden_dropout"), Range(0, 1, hi_open=True)),
    # optimizer, schedule, precision
    "zero_stage": Range(0, 3),
    **dict.fromkeys(("zero_reduce_bucket_size", "zero_allgather_bucket_size"), AT_LEAST_ONE),
    "lr": NON_NEGATIVE,
    "min_lr": NON_NEGATIVE,
    "lr_decay_iters": AT_LEAST_ONE,
    "lr_decay_fraction": Range(0, 1, lo_open=True),
    "warmup": FRACTION,
    "weight_decay": NON_NEGATIVE,
    **dict.fromkeys(("clip_grad", "gradient_clipping", "loss_scale"), NON_NEGATIVE),
    "hysteresis": AT_LEAST_ONE,
    "loss_scale_window": Range(1),
    "min_scale": POSITIVE,
    "gradient_predivide_factor": POSITIVE,
    **dict.fromkeys(("mup_init_scale", "mup_attn_temp", "mup_output_temp", "mup_embedding_mult"), POSITIVE),
    "mup_rp_embedding_mult": POSITIVE,
    "mup_width_scale": AT_LEAST_ONE,
    # post-training
    **dict.fromkeys(("dpo_beta", "kto_beta"), POSITIVE),
    **dict.fromkeys(("kl_div_beta", "kto_desirable_weight", "kto_undesirable_weight", "z_loss"), NON_NEGATIVE),
    # data and batches
    "weighted_sampler_alpha": NON_NEGATIVE,
    "short_seq_prob": FRACTION,
    "seed": Range(1, 2**31 - 1),
    **dict.fromkeys(("batch_size", "train_batch_size", "train_micro_batch_size_per_gpu"), AT_LEAST_ONE),
    "gradient_accumulation_steps": AT_LEAST_ONE,
    "num_workers": NON_NEGATIVE,
    "curriculum_seqlen": NON_NEGATIVE,
    # training length, intervals, checkpoints
    "train_iters": NON_NEGATIVE,  # 0: GPT-NeoX's way to save the initial model (with extra_save_iters: [0])
    **dict.fromkeys(("train_epochs", "exit_interval", "keep_last_n_checkpoints"), AT_LEAST_ONE),
    **dict.fromkeys(("eval_interval", "log_interval", "steps_per_print", "adlr_autoresume_interval"), AT_LEAST_ONE),
    "eval_iters": NON_NEGATIVE,
    "iteration": NON_NEGATIVE,
    "checkpoint_factor": POSITIVE,
    "s3_chunk_size": Range(5 * 2**20, 5 * 2**30),  # S3's part sizes: 5 MiB to 5 GiB
    "s3_upload_attempts": Range(1, 100),
    "s3_timeout": POSITIVE,
    "s3_flush_timeout": NON_NEGATIVE,
    "gradient_noise_scale_n_batches": AT_LEAST_ONE,
    **dict.fromkeys(("profile_step_start", "profile_step_stop"), NON_NEGATIVE),
    "peak_theoretical_tflops": POSITIVE,
    # reliability
    "exit_duration_in_mins": POSITIVE,
    "max_consecutive_nonfinite_steps": AT_LEAST_ONE,
    "loss_spike_skip_window": Range(2, also=(0,)),
    "loss_spike_skip_zscore": POSITIVE,
    # evaluation and generation
    "eval_limit": AT_LEAST_ONE,
    "eval_num_fewshot": NON_NEGATIVE,
    "eval_bootstrap_iters": NON_NEGATIVE,
    "temperature": NON_NEGATIVE,
    "top_p": FRACTION,
    "top_k": NON_NEGATIVE,
    "maximum_tokens": AT_LEAST_ONE,
    "num_samples": AT_LEAST_ONE,
}

# Numeric keys where no number is wrong (none today): key -> why.
NO_RANGE: dict[str, str] = {}


def _numbers(value: Any) -> list[float]:
    """The numbers a value holds (a port list holds several); bools are not numbers."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for x in value if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return []


def range_problems(values: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """``key=value must be <range> (set in file)`` for every given value outside its key's range."""
    out = []
    for key, value in values.items():
        rng = RANGES.get(key)
        if rng is None or value is None:
            continue
        bad = [x for x in _numbers(value) if not rng.contains(float(x))]
        if bad:
            where = origins.get(key)
            shown = value if not isinstance(value, list) else bad[0]
            suffix = f" (set in {where})" if where else ""
            finite = " and finite" if not all(math.isfinite(float(x)) for x in bad) else ""
            out.append(f"{key}={shown!r} must be {rng.describe()}{finite}{suffix}")
    return out
