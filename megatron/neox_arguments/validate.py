"""Cross-field rules, as a table. ``validate()`` runs them all and returns every violation.

Single values (ranges, syntax) are checked earlier, before deriving: ``value_checks.py``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from megatron.neox_arguments.compile_checks import torch_compile_problems
from megatron.neox_arguments.curriculum_checks import curriculum_problems
from megatron.neox_arguments.moe_checks import moe_layout_problems, moe_problems
from megatron.neox_arguments.post_training_checks import SPLITS, post_training_problems
from megatron.neox_arguments.ranges import range_problems
from megatron.neox_arguments.rwkv_checks import rwkv_problems
from megatron.neox_arguments.s3_checks import s3_problems
from megatron.neox_arguments.size_checks import tensor_limit_problems
from megatron.neox_arguments.sparsity_checks import sparsity_problems
from megatron.neox_arguments.value_checks import check_preemption_keys
from megatron.neox_arguments.zero_offload import deprecated_flag_problems

logger = logging.getLogger(__name__)

REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings")


@dataclass
class Ctx:
    """Resolved values plus where each key came from, for messages that name the file."""

    v: dict[str, Any]
    origins: dict[str, str]
    defaults: dict[str, Any]

    def at(self, key: str) -> str:
        """``key=value (set in file.yml)``, or ``(default)`` for an untouched default."""
        where = self.origins.get(key)
        if where:
            return f"{key}={self.v[key]!r} (set in {where})"
        return f"{key}={self.v[key]!r}" + (" (default)" if self.v[key] == self.defaults.get(key) else "")


def _required(c: Ctx) -> list[str]:
    sources = ", ".join(dict.fromkeys(c.origins.values())) or "the configuration"
    return [f"missing required key {k!r}: not set in {sources}" for k in REQUIRED if c.v[k] is None]


def _deepspeed(c: Ctx) -> list[str]:
    return [] if c.v["deepspeed"] else [f"{c.at('deepspeed')}: neox-forge always runs on DeepSpeed; remove it"]


def _heads(c: Ctx) -> list[str]:
    v, out = c.v, []
    h, heads, mp = v["hidden_size"], v["num_attention_heads"], v["model_parallel_size"]
    types = v["attention_config"] or []
    if types and all(t == "mamba" for t in types):  # no attention layer: the heads are unused (as in GPT-NeoX)
        return []
    if h and heads and h % heads:
        out.append(f"{c.at('hidden_size')} is not divisible by {c.at('num_attention_heads')}")
    if heads and mp and heads % mp:
        out.append(
            f"{c.at('num_attention_heads')} is not divisible by {c.at('model_parallel_size')}: tensor parallelism "
            "splits whole heads across ranks"
        )
    return out


def _kv_heads(c: Ctx) -> list[str]:
    v, out = c.v, list[str]()
    kv, heads, mp = v["num_kv_heads"], v["num_attention_heads"], v["model_parallel_size"]
    if kv is None or not heads:
        return out
    if kv <= 0 or kv > heads or heads % kv:
        out.append(f"{c.at('num_kv_heads')} must be between 1 and num_attention_heads={heads} and divide it")
    elif mp and kv % mp:
        out.append(f"{c.at('num_kv_heads')} is not divisible by {c.at('model_parallel_size')}")
    types = set(v["attention_config"] or [])
    if kv != heads and types - {"global", "flash"}:
        out.append(f"grouped-query attention (num_kv_heads={kv}) needs global or flash attention, got {sorted(types)}")
    return out


def _seq(c: Ctx) -> list[str]:
    s, m = c.v["seq_length"], c.v["max_position_embeddings"]
    if s and m and s > m:
        return [f"{c.at('seq_length')} exceeds {c.at('max_position_embeddings')}"]
    return []


def _parallel(c: Ctx) -> list[str]:
    v, out = c.v, []
    stage = v["zero_stage"]
    if isinstance(stage, int) and stage >= 2 and v["pipe_parallel_size"] >= 1:
        out.append(
            f"zero_optimization.stage={stage} cannot be combined with {c.at('pipe_parallel_size')}: DeepSpeed's "
            "pipeline engine supports ZeRO stages 0 and 1 only; use stage 1, or pipe_parallel_size: 0"
        )
    return out


def _optimizer(c: Ctx) -> list[str]:
    v, out = c.v, []
    if v["lr"] is not None and v["min_lr"] is not None and v["min_lr"] > v["lr"]:
        out.append(f"{c.at('min_lr')} is larger than the learning rate lr={v['lr']!r} (optimizer.params.lr)")
    if isinstance(v["optimizer"], dict) and "weight_decay" in (v["optimizer"].get("params") or {}):
        out.append("optimizer.params.weight_decay: set the top-level key weight_decay instead")
    return out


def _precision(c: Ctx) -> list[str]:
    v, out = c.v, []
    if v["fp16_lm_cross_entropy"] and v["precision"] != "fp16":
        out.append(f"{c.at('fp16_lm_cross_entropy')} needs fp16 precision")
    return out


def _data(c: Ctx) -> list[str]:
    v, out = c.v, []
    given = [v[f"{s}_data_paths"] is not None for s in SPLITS]
    if any(given) and v["data_path"] is not None:
        out.append("data_path and train/valid/test_data_paths are exclusive: use one single dataset or the three lists")
    elif any(given) and not all(given):
        missing = [f"{s}_data_paths" for s, g in zip(SPLITS, given) if not g]
        out.append(f"train_data_paths, valid_data_paths and test_data_paths go together; missing {', '.join(missing)}")
    for s in SPLITS:
        paths = v[f"{s}_data_paths"]
        for kind in ("data_weights", "label_data_paths", "reward_data_paths"):
            other = v[f"{s}_{kind}"]
            if other is not None and (paths is None or len(other) != len(paths)):
                n = "no" if paths is None else len(paths)
                out.append(f"{s}_{kind} has {len(other)} entries but {s}_data_paths has {n}")
    if v["train_label_data_paths"] is not None and v["data_path"] is not None:
        out.append("train_label_data_paths needs train_data_paths, not data_path")
    if v["train_iters"] is not None and v["train_epochs"] is not None:
        out.append("set train_iters or train_epochs, not both")
    return out


def _checkpoints(c: Ctx) -> list[str]:
    v, out = c.v, []
    if v["save"] is not None and v["checkpoint_factor"] is None and v["extra_save_iters"] is None:
        out.append(f"{c.at('save')} needs checkpoint_factor or extra_save_iters to know when to save")
    iters, extra = v["train_iters"], v["extra_save_iters"] or []
    late = [i for i in extra if type(i) is int and iters is not None and i > iters]
    if late:  # iterations the run never reaches: the save would silently never happen
        where = c.origins.get("extra_save_iters")
        out.append(
            f"extra_save_iters {late} lie beyond {c.at('train_iters')}: the run never reaches them; use iterations "
            f"between 0 (the initial model) and {iters}" + (f" (set in {where})" if where else "")
        )
    return out


def _layers(c: Ctx) -> list[str]:
    v, out = c.v, []
    if v["num_unique_layers"] is not None and v["num_layers"] and v["num_layers"] % v["num_unique_layers"]:
        out.append(f"{c.at('num_unique_layers')} does not divide {c.at('num_layers')}")
    if v["intermediate_size"] is not None and v["expansion_factor"] is not None:
        out.append("intermediate_size and expansion_factor are exclusive; set one")
    if v["sequence_parallel"] and v["model_parallel_size"] == 1:
        logger.warning("sequence_parallel has no effect with model_parallel_size 1")
    return out + mamba_problems(c)


def mamba_problems(c: Ctx) -> list[str]:
    """Rules of Mamba layers (``attention_config`` type ``mamba``; the list is expanded by then)."""
    v = c.v
    if "mamba" not in (v["attention_config"] or []):
        return []
    out: list[str] = []
    if v["mamba_inner_func_fusion"] and v["mamba_use_bias_in_linears"]:
        out.append(
            f"{c.at('mamba_inner_func_fusion')} cannot be combined with {c.at('mamba_use_bias_in_linears')} "
            "(GPT-NeoX's fused Mamba inner function has no projection biases); unset one"
        )
    h, tp = v["hidden_size"], v["model_parallel_size"]
    if not (isinstance(tp, int) and tp > 0):
        pass  # the range rule reports it
    elif isinstance(h, int) and h > 0 and v["intermediate_size"] is None:
        inner = int((v["expansion_factor"] or 2) * h)
        if inner % tp:
            out.append(
                f"Mamba's inner width int(expansion_factor·hidden_size) = {inner} is not divisible by "
                f"{c.at('model_parallel_size')}"
            )
    elif isinstance(v["intermediate_size"], int) and v["intermediate_size"] % tp:
        out.append(f"Mamba's inner width {c.at('intermediate_size')} is not divisible by {c.at('model_parallel_size')}")
    method = str(v["pipe_partition_method"])
    if v["pipe_parallel_size"] >= 2 and method.lower().startswith("type:"):
        try:
            counted = re.search(method.split(":", 1)[1], "ParallelMambaResidualLayerPipe", re.IGNORECASE)
        except re.error:
            counted = None  # an invalid pattern matches nothing
        if not counted and all(t == "mamba" for t in v["attention_config"]):
            out.append(
                f"{c.at('pipe_partition_method')} matches no layer of this all-Mamba model (its layers are "
                "ParallelMambaResidualLayerPipe): use 'type:transformerlayer|mlp|mamba', 'uniform' or 'parameters'"
            )
    if v["precision"] in ("fp16", "bfloat16", "bf16") and v["mamba_selective_fp32_params"]:
        logger.warning(
            "mamba_selective_fp32_params: DeepSpeed keeps every parameter in %s (A_log and D included; their fp32 "
            "master copies live in the optimizer); the selective scan computes in fp32",
            v["precision"],
        )
    return out


def _gmlp(c: Ctx) -> list[str]:
    """gMLP/aMLP blocks: what GPT-NeoX refuses with them, and what their TP-local sequence mixing cannot do."""
    v, out = c.v, list[str]()
    types = v["attention_config"] if isinstance(v["attention_config"], list) else []
    if not any(t in ("gmlp", "amlp") for t in types):
        return out
    if v["partition_activations"]:
        out.append(f"{c.at('partition_activations')} cannot be combined with gmlp/amlp layers (as in GPT-NeoX)")
    if v["sequence_parallel"] and v["model_parallel_size"] > 1:
        out.append(f"{c.at('sequence_parallel')} cannot be combined with gmlp/amlp layers: they mix the whole sequence")
    if v["moe_num_experts"] > 1:
        out.append(f"not supported yet: {c.at('moe_num_experts')} with gmlp/amlp layers (MoE in gMLP models)")
    return out


def _post_training(c: Ctx) -> list[str]:
    v, out = c.v, []
    impl = v["train_impl"]
    if impl in ("dpo", "rm", "kto", "reinforce") and v["pipe_parallel_size"] >= 1:
        out.append(f"{c.at('train_impl')} does not run on the pipeline engine; set pipe_parallel_size: 0")
    out += post_training_problems(v)
    if impl == "dpo" and v["dpo_reference_free"] and v["precompute_model_name"] and v["text_gen_type"] != "precompute":
        logger.warning("precompute_model_name is ignored: train_impl dpo with dpo_reference_free uses no reference")
    if impl == "kto" and v["train_micro_batch_size_per_gpu"] is not None and v["train_micro_batch_size_per_gpu"] < 2:
        out.append("train_impl kto needs train_micro_batch_size_per_gpu >= 2 (half of each batch estimates the KL)")
    return out


def _moe(c: Ctx) -> list[str]:
    keys: tuple[str, ...] = ("moe_num_experts", "moe_expert_interval", "moe_top_k", "moe_router_type", "moe_jitter_eps")
    keys += ("moe_loss_weight", "moe_normalize_expert_weights", "moe_gated_experts", "activation")
    cfg = SimpleNamespace(**{k: c.v[k] for k in keys})
    cfg.sequence_parallel = c.v["sequence_parallel"]
    out = moe_problems(cfg) + moe_layout_problems(c.v)
    unique, layers = c.v["num_unique_layers"], c.v["num_layers"]
    if unique is not None and layers and unique < layers and c.v["moe_num_experts"] > 1:
        out.append(f"not supported yet: {c.at('num_unique_layers')} with MoE layers ({c.at('moe_num_experts')})")
    return out


def _ranges(c: Ctx) -> list[str]:
    """Combinations of ranges (single-key ranges are checked before deriving: ranges.py)."""
    v, out = c.v, []
    if v["train_epochs"] is not None and (v["pack_impl"] != "packed" or v["dataset_impl"] != "gpt2"):
        out.append("train_epochs needs pack_impl: packed and dataset_impl: gpt2 (use train_iters otherwise)")
    if v["checkpoint_scale"] == "log" and v["checkpoint_factor"] is not None and v["checkpoint_factor"] <= 1:
        out.append(f"{c.at('checkpoint_factor')} must be > 1 with checkpoint_scale: log")
    factor = v["checkpoint_factor"]
    if v["checkpoint_scale"] == "linear" and factor is not None and float(factor) != int(factor):
        out.append(f"{c.at('checkpoint_factor')} must be a whole number of iterations with checkpoint_scale: linear")
    if v["profile"] and v["profile_step_stop"] < v["profile_step_start"]:
        out.append(f"{c.at('profile_step_stop')} is before {c.at('profile_step_start')}")
    return out


def _generation(c: Ctx) -> list[str]:
    v = c.v
    if v["text_gen_type"] == "input-file" and not v["sample_input_file"]:
        return ["text_gen_type: input-file needs sample_input_file (a file with one prompt per line)"]
    return []


def _reliability(c: Ctx) -> list[str]:
    v = c.v
    out = check_preemption_keys(v["preemption_signals"], v["exit_duration_in_mins"])
    if v["load"] == "auto" and not v["save"]:
        out.append(f"{c.at('load')} resumes from save, but save is not set")
    return out


# (name, rule): each rule returns its violations as readable lines.
RULES: list[tuple[str, Callable[[Ctx], list[str]]]] = [
    ("required keys", _required),
    ("deepspeed", _deepspeed),
    ("attention heads", _heads),
    ("key/value heads", _kv_heads),
    ("sequence length", _seq),
    ("parallelism", _parallel),
    ("optimizer", _optimizer),
    ("precision", _precision),
    ("data paths", _data),
    ("checkpoints", _checkpoints),
    ("layers", _layers),
    ("gmlp", _gmlp),
    ("post-training", _post_training),
    ("mixture of experts", _moe),
    ("sparse attention", lambda c: sparsity_problems(c.v)),
    ("rwkv", lambda c: rwkv_problems(c.v)),
    ("ranges", _ranges),
    ("generation", _generation),
    ("reliability", _reliability),
    ("s3", lambda c: s3_problems(c.v, c.at)),
    ("curriculum learning", lambda c: curriculum_problems(c.v, c.origins)),
    ("torch_compile", lambda c: torch_compile_problems(c.v)),
    ("model size", lambda c: tensor_limit_problems(c.v, c.origins)),
    ("ZeRO-Offload", lambda c: deprecated_flag_problems(c.v["zero_optimization"])),
]


MODEL_RULES = ("attention heads", "key/value heads", "sequence length", "layers", "sparse attention", "rwkv")
"""The rules on the model's shape alone (``GPTModelConfig`` does not repeat them; it checks MoE itself)."""


def model_problems(values: dict[str, Any], keys: set[str]) -> list[str]:
    """The ranges (``ranges.py``) of ``keys`` and the model-shape rules of the table, for offline readers of a model
    config (checkpoint tools), which build a ``GPTModelConfig`` without a validated ``NeoXArgs``."""
    ctx = Ctx(values, {}, {})
    problems = range_problems({k: values[k] for k in keys if k in values}, {})
    for name, rule in RULES:
        if name in MODEL_RULES:
            problems.extend(rule(ctx))
    return problems


def validate(values: dict[str, Any], origins: dict[str, str], defaults: dict[str, Any] | None = None) -> list[str]:
    """Run every rule on the resolved ``values``; returns all violations (empty when valid)."""
    ctx = Ctx(values, origins, defaults or {})
    problems: list[str] = []
    for _name, rule in RULES:
        problems.extend(rule(ctx))
    return problems
