"""Derived values (pure): world and data-parallel size, the batch triple, precision, ZeRO, attention layout...

``derive(values, explicit, env)`` returns the updates to apply and the problems found; it reads nothing but its
arguments. ``LaunchEnv.capture`` gathers the few facts about the machine it needs.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from megatron.cluster.hostfile import count_ranks, read_hostfile
from megatron.cluster.worker_env import launched_world_size
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.model import ATTENTION_TYPES
from megatron.neox_arguments.sections.optimizer import OPTIMIZER_TYPES, OptimizerArgs

logger = logging.getLogger(__name__)

ZERO_DEFAULTS: dict[str, Any] = {
    "stage": 0,
    "allgather_partitions": True,
    "reduce_scatter": True,
    "allgather_bucket_size": 500000000,
    "overlap_comm": False,
    "reduce_bucket_size": 500000000,
    "contiguous_gradients": False,
}
DEFAULT_LR: float = OptimizerArgs.lr  # the schema's default
MAX_LAYERS = 100_000  # far beyond any real model; guards the per-layer attention list


@dataclass(frozen=True)
class LaunchEnv:
    """What derive() needs to know about the machine: launcher-provided world size, devices, hostfile."""

    world_size: int | None = None  # WORLD_SIZE of a launched rank
    on_cpu: bool = True
    gpu_count: int = 0
    hosts: dict[str, int] | None = None  # parsed hostfile, when one exists

    @classmethod
    def capture(cls, hostfile: str | None) -> LaunchEnv:
        """Read WORLD_SIZE, the accelerator and the hostfile (``hostfile`` or $DLTS_HOSTFILE if it exists)."""
        ws = launched_world_size() if "WORLD_SIZE" in os.environ else None
        # DS_ACCELERATOR=cpu (deepy sets it for CPU ranks) answers without torch, so a rank can refuse bad input
        # before importing it; else megatron.distributed.on_cpu asks torch (imported here: the config layer and the
        # launcher do not load torch)
        cpu = os.environ.get("DS_ACCELERATOR") == "cpu"
        if not cpu:
            from megatron.distributed import on_cpu

            cpu = on_cpu()
        gpus = 0
        if not cpu:
            import torch

            gpus = torch.cuda.device_count()
        path = hostfile or os.environ.get("DLTS_HOSTFILE")
        try:
            hosts = read_hostfile(path) if path and os.path.isfile(path) else None
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"bad hostfile: {e}") from None
        return cls(world_size=ws, on_cpu=cpu, gpu_count=gpus, hosts=hosts)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, model_parallel_size: int = 1) -> int:
    """GPT-NeoX's vocabulary padding: the smallest size ``>= vocab_size`` divisible by
    ``make_vocab_size_divisible_by * model_parallel_size`` (the one definition; the tokenizer, the model config and
    the checkpoint tools use it)."""
    multiple = make_vocab_size_divisible_by * max(model_parallel_size, 1)
    if multiple <= 0:
        raise ConfigError(
            f"make_vocab_size_divisible_by ({make_vocab_size_divisible_by}) x model_parallel_size "
            f"({model_parallel_size}) must be positive"
        )
    return -(-vocab_size // multiple) * multiple


def expand_attention_config(config: list | None, num_layers: int) -> list[str]:
    """``[[["local", "global"], 6]]`` -> one attention type per layer. Raises ValueError on a bad layout."""
    if config is None:
        return ["global"] * num_layers
    if all(isinstance(t, str) for t in config):
        layers = list(config)
    else:
        layers = []
        for item in config:
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], (list, tuple))):
                raise ValueError(f"attention_config: each item must be [[types...], count], got {item!r}")
            pattern, count = list(item[0]), item[1]
            if count == "all":
                if num_layers % len(pattern):
                    raise ValueError(
                        f"attention_config: pattern {pattern} (length {len(pattern)}) with 'all' must divide "
                        f"num_layers={num_layers}"
                    )
                layers += pattern * (num_layers // len(pattern))
            elif isinstance(count, int) and not isinstance(count, bool) and count > 0:
                layers += pattern * count
            else:
                raise ValueError(f"attention_config: count must be a positive int or 'all', got {count!r}")
    bad = sorted({t for t in layers if t not in ATTENTION_TYPES})
    if bad:
        raise ValueError(f"attention_config: unknown attention type(s) {bad}; valid: {', '.join(ATTENTION_TYPES)}")
    if len(layers) != num_layers:
        raise ValueError(f"attention_config describes {len(layers)} layers but num_layers={num_layers}")
    return layers


def _world_size(v: dict[str, Any], env: LaunchEnv) -> int:
    if v["global_num_gpus"] is not None:
        return v["global_num_gpus"]
    if env.world_size is not None:
        return env.world_size
    if env.hosts:
        return count_ranks(env.hosts, v["include"], v["exclude"], v["num_nodes"], v["num_gpus"])  # ValueError
    nodes = v["num_nodes"] if v["num_nodes"] and v["num_nodes"] > 0 else 1
    if not env.on_cpu:
        return (v["num_gpus"] or env.gpu_count) * nodes
    return (v["num_gpus"] or 1) * nodes


def _batch(v: dict[str, Any], explicit: set[str], dp: int, out: dict[str, Any], problems: list[str]) -> None:
    """Any two of (train_batch_size, micro batch, gradient accumulation) give the third; three are checked."""
    tb, mb = v["train_batch_size"], v["train_micro_batch_size_per_gpu"]
    gas = v["gradient_accumulation_steps"] if "gradient_accumulation_steps" in explicit else None
    for name, val in (
        ("train_batch_size", tb),
        ("train_micro_batch_size_per_gpu", mb),
        ("gradient_accumulation_steps", gas),
    ):
        if val is not None and val <= 0:
            problems.append(f"{name}={val} must be > 0")
            return
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            problems.append(
                f"inconsistent batch sizes: train_batch_size={tb} != train_micro_batch_size_per_gpu={mb} x "
                f"gradient_accumulation_steps={gas} x data-parallel size {dp} (= {mb * gas * dp}); set only two of them"
            )
            return
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            problems.append(
                f"train_batch_size={tb} is not divisible by train_micro_batch_size_per_gpu={mb} x data-parallel "
                f"size {dp}"
            )
            return
        gas = tb // (mb * dp)
    elif tb is not None:
        gas = gas or 1
        if tb % (gas * dp):
            problems.append(
                f"train_batch_size={tb} is not divisible by gradient_accumulation_steps={gas} x data-parallel size {dp}"
            )
            return
        mb = tb // (gas * dp)
    elif mb is not None:
        gas = gas or 1
        tb = mb * gas * dp
    else:
        problems.append("missing batch size: set train_micro_batch_size_per_gpu (or train_batch_size)")
        return
    out.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas, batch_size=mb)


def _enabled(block: Any) -> bool:
    return isinstance(block, dict) and bool(block.get("enabled", False))


def _precision(v: dict[str, Any], out: dict[str, Any], problems: list[str]) -> None:
    extra = v["deepspeed_extra_args"] or {}
    fp16_on = _enabled(v["fp16"])
    bf16_on = _enabled(v["bf16"]) or _enabled(extra.get("bf16"))
    precision = v["precision"]
    if fp16_on and bf16_on:
        problems.append("fp16.enabled and bf16.enabled are both true; enable one precision")
        return
    if fp16_on:
        if precision not in (None, "fp16"):
            problems.append(f"precision={precision!r} conflicts with fp16.enabled: true")
        precision = "fp16"
    elif bf16_on:
        if precision not in (None, "bfloat16"):
            problems.append(f"precision={precision!r} conflicts with bf16.enabled: true")
        precision = "bfloat16"
    precision = precision or "fp32"
    out["precision"] = precision
    if precision == "fp16" and not fp16_on:
        fp16 = dict(v["fp16"] or {})
        fp16["enabled"] = True
        out["fp16"] = fp16
    if precision == "bfloat16" and not bf16_on:
        out["bf16"] = {**(v["bf16"] or {}), "enabled": True}
    _static_loss_scale(v, precision, out, problems)


def _static_loss_scale(v: dict[str, Any], precision: str, out: dict[str, Any], problems: list[str]) -> None:
    """The top-level ``loss_scale`` goes into the fp16 block, where DeepSpeed reads it. GPT-NeoX drops it (DeepSpeed
    then scales dynamically); docs/gpt-neox-differences.md."""
    scale = v["loss_scale"]
    if scale is None:
        return
    if precision != "fp16":
        logger.warning(
            "loss_scale=%s is ignored: a static loss scale applies to fp16 only (precision %s)", scale, precision
        )
        return
    fp16 = dict(out.get("fp16") or v["fp16"] or {})
    if fp16.get("loss_scale") is not None and float(fp16["loss_scale"]) != float(scale):
        problems.append(f"loss_scale={scale} conflicts with fp16.loss_scale={fp16['loss_scale']}; set one of them")
        return
    fp16["loss_scale"] = scale
    out["fp16"] = fp16


PIPE_FP16_ZERO_NOTE = (
    "fp16 with pipe_parallel_size >= 1 and zero_optimization.stage 0: DeepSpeed 0.19's pipeline engine applies the "
    "fp16 loss scale only through a ZeRO optimizer, so stage 1 is used (the same updates; optimizer state sharded "
    "over the data-parallel ranks)"
)

ONEBITADAM_SCHEDULE_NOTE = (
    "optimizer.type onebitadam: GPT-NeoX replaces the learning-rate schedule by DeepSpeed's WarmupDecayLR "
    "(log warmup to lr over train_iters*warmup steps, then linear decay to 0 at lr_decay_iters); neox-forge keeps "
    "its own schedule for every optimizer (lr_decay_style, warmup, min_lr), so the learning rates differ"
)


def _mirror_problem(key: str, explicit: set[str], given: Any, source: str, value: Any, fix: str) -> str | None:
    """A key that only mirrors another (``derived``, read by nothing else) set to a different value: it would be
    overwritten, so it is refused rather than silently dropped."""
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (given, value))
    if key not in explicit or not numbers or float(given) == float(value):
        return None
    return f"{key}={given!r} differs from {source}={value!r}: {key} only mirrors {source}; set {fix} instead"


def _clip_grad(v: dict[str, Any], explicit: set[str], out: dict[str, Any], problems: list[str]) -> None:
    """``clip_grad`` mirrors ``gradient_clipping`` (as in GPT-NeoX, which sets ``clip_grad = gradient_clipping``);
    the clipping itself reads ``gradient_clipping`` (DeepSpeed's key)."""
    clip = v["gradient_clipping"]
    fix = f"gradient_clipping: {v['clip_grad']!r} and remove clip_grad"
    problem = _mirror_problem("clip_grad", explicit, v["clip_grad"], "gradient_clipping", clip, fix)
    problems.extend([problem] if problem else [])
    out["clip_grad"] = clip


def _zero(v: dict[str, Any], explicit: set[str], out: dict[str, Any], problems: list[str]) -> None:
    zero = copy.deepcopy(v["zero_optimization"]) if v["zero_optimization"] is not None else copy.deepcopy(ZERO_DEFAULTS)
    stage = zero.get("stage", 0)
    fix = f"zero_optimization: {{stage: {v['zero_stage']!r}}} and remove zero_stage"
    mirror = _mirror_problem("zero_stage", explicit, v["zero_stage"], "zero_optimization.stage", stage, fix)
    problems.extend([mirror] if mirror else [])
    if v["autotuning_run"] is None and (
        not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3)
    ):
        search = " (a list or 'all' is DeepSpeed autotuning's search space: deepy.py --autotuning tune|run only)"
        problems.append(f"zero_optimization.stage={stage!r}: expected 0, 1, 2 or 3{search if v['autotuning'] else ''}")
    if stage == 0 and out.get("precision") == "fp16" and v["pipe_parallel_size"] >= 1:
        stage = zero["stage"] = 1  # see PIPE_FP16_ZERO_NOTE
    out["zero_optimization"] = zero
    out["zero_stage"] = stage
    out["zero_reduce_scatter"] = zero.get("reduce_scatter", ZERO_DEFAULTS["reduce_scatter"])
    out["zero_contiguous_gradients"] = zero.get("contiguous_gradients", ZERO_DEFAULTS["contiguous_gradients"])
    out["zero_reduce_bucket_size"] = zero.get("reduce_bucket_size", ZERO_DEFAULTS["reduce_bucket_size"])
    out["zero_allgather_bucket_size"] = zero.get("allgather_bucket_size", ZERO_DEFAULTS["allgather_bucket_size"])


def _optimizer(v: dict[str, Any], out: dict[str, Any], problems: list[str]) -> None:
    opt = v["optimizer"]
    if opt is None:
        out["lr"] = v["lr"] if v["lr"] is not None else DEFAULT_LR
        return
    if not isinstance(opt.get("type"), str) or not isinstance(opt.get("params", {}), dict):
        problems.append("optimizer must be a mapping with 'type' (a string) and 'params' (a mapping)")
        return
    kind = opt["type"].lower()
    if kind not in OPTIMIZER_TYPES:
        problems.append(f"optimizer.type={opt['type']!r}: expected one of {', '.join(OPTIMIZER_TYPES)}")
        return
    out["optimizer_type"] = kind
    lr = opt.get("params", {}).get("lr", DEFAULT_LR)
    try:
        if isinstance(lr, bool) or not isinstance(lr, (int, float, str)):
            raise ValueError
        out["lr"] = float(lr)
    except ValueError:
        problems.append(f"optimizer.params.lr={lr!r}: expected a number")
        return
    if not (math.isfinite(out["lr"]) and out["lr"] >= 0):  # e.g. the string "inf", which float() reads
        problems.append(f"optimizer.params.lr={lr!r} must be a finite number >= 0")


def derive(values: dict[str, Any], explicit: set[str], env: LaunchEnv) -> tuple[dict[str, Any], list[str]]:
    """Compute the derived keys from ``values`` (all keys, defaults filled); returns (updates, problems)."""
    v, problems = values, list[str]()
    out: dict[str, Any] = {}
    try:
        world = _world_size(v, env)
    except ValueError as e:  # a bad include/exclude against the hostfile
        problems.append(f"hostfile resources: {e}")
        world = 0
    out["global_num_gpus"] = world or None
    pp, mp = max(v["pipe_parallel_size"], 1), v["model_parallel_size"]
    out["is_pipe_parallel"] = v["pipe_parallel_size"] >= 1
    if world <= 0:
        if not problems:
            problems.append("no ranks to run on: set num_gpus or global_num_gpus")
    elif world % (pp * mp):
        problems.append(
            f"world size {world} is not divisible by max(pipe_parallel_size, 1) x model_parallel_size = {pp * mp}"
        )
    else:
        out["dp_world_size"] = world // (pp * mp)
        _batch(v, explicit, out["dp_world_size"], out, problems)
    _clip_grad(v, explicit, out, problems)
    _precision(v, out, problems)
    _zero(v, explicit, out, problems)
    _optimizer(v, out, problems)
    out["dynamic_loss_scale"] = v["loss_scale"] is None
    if v["apply_query_key_layer_scaling"]:
        out["attention_softmax_in_fp32"] = True
    if isinstance(v["num_layers"], int) and v["num_layers"] > MAX_LAYERS:
        problems.append(f"num_layers={v['num_layers']} is larger than {MAX_LAYERS}")
    elif isinstance(v["num_layers"], int) and v["num_layers"] > 0:
        try:
            out["attention_config"] = expand_attention_config(v["attention_config"], v["num_layers"])
        except ValueError as e:
            problems.append(str(e))
    if v["lr_decay_fraction"] is not None and v["train_iters"] is not None and v["lr_decay_iters"] is None:
        out["lr_decay_iters"] = int(v["lr_decay_fraction"] * v["train_iters"])
    for split in ("train", "valid", "test"):
        paths, weights = v[f"{split}_data_paths"], v[f"{split}_data_weights"]
        if paths is not None and weights is None:
            out[f"{split}_data_weights"] = [1.0] * len(paths)
    if v["text_gen_type"] is None:
        out["text_gen_type"] = "input-file" if v["sample_input_file"] else "unconditional"
    return out, problems
