"""Model sizes that cannot work, refused before any rank builds the model.

A cheap closed-form *lower bound* of the parameter count (no model is built: ``megatron.planner`` counts exactly,
on the meta device, but imports the model and DeepSpeed, which the config layer must not) and the bytes DeepSpeed
keeps per parameter for weights, fp32 master weights and optimizer states (``megatron.planner.memory``'s layout;
tests/unit/test_config_size_checks.py keeps the two in step and checks the bound against the planner's exact count
for every shipped config). Two checks:

* ``tensor_limit_problems`` (a validation rule, every entry point): a model with more than 2**63-1 parameters
  cannot be indexed by PyTorch, whatever the machine.
* ``check_fits_machine`` (deepy.py before launching train.py, and train.py on every rank before building the model):
  the per-rank weights + optimizer state must not exceed twice this machine's memory (GPU memory on CUDA, RAM and
  the cgroup limit on CPU). The margin is deliberate: the bound leaves out activations and gradients and the check
  only exists to turn an impossible allocation into one clear line, never to second-guess a config that may fit.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from megatron.cluster.worker_env import launched_local_rank
from megatron.neox_arguments.errors import ConfigError
from megatron.neox_arguments.sections.model import GATED_ACTIVATIONS

INT64_MAX = 2**63 - 1
MARGIN = 2  # refuse only above MARGIN x the machine's memory
NO_MACHINE = 2**50  # 1 PiB per rank: beyond any single machine (the ceiling when the ranks run elsewhere)
# fp32 optimizer-state tensors per parameter (Adam-family: two moments); as megatron/planner/inputs.py.
STATE_FLOATS = {"lion": 1, "sgd": 1, "madgrad_wd": 3, "sm3": 1}
FP32 = 4


def param_lower_bound(v: Any) -> int:
    """At most the model's parameter count, from the shape keys alone (``v``: resolved values, attribute access).

    Per transformer layer the attention projections (query, key/value for ``num_kv_heads``, output) and the MLP's two
    (plain) or three (gated) matrices before rounding up to ``mlp_multiple_of`` (biases and norms left out); plus the
    word embedding (twice untied) when the padded vocabulary is known, and a learned position table.
    """
    h, layers = int(v.hidden_size or 0), int(v.num_layers or 0)
    heads = max(int(v.num_attention_heads or 1), 1)
    kv_width = h // heads * int(v.num_kv_heads or heads)
    if v.intermediate_size:
        ffn = int(v.intermediate_size)
    elif v.expansion_factor:
        ffn = int(float(v.expansion_factor) * h)
    else:
        ffn = 4 * h
    mlp = 3 * (int(ffn * 2 / 3) // 2) * h if v.activation in GATED_ACTIVATIONS else 2 * ffn * h
    total = layers * (2 * h * h + 2 * h * kv_width + mlp)
    if v.padded_vocab_size:
        total += int(v.padded_vocab_size) * h * (2 if v.no_weight_tying else 1)
    if v.pos_emb == "learned" and v.max_position_embeddings:
        total += int(v.max_position_embeddings) * h
    return total


def bytes_per_param(v: Any) -> tuple[int, int, bool, bool]:
    """(weight bytes, master + optimizer-state bytes, weights sharded over DP, states sharded over DP) per parameter,
    DeepSpeed's layout for the precision, ZeRO stage and optimizer (as ``megatron.planner.memory.bytes_per_param``)."""
    zero, pp = v.zero_stage, v.pipe_parallel_size
    weights = 4 if v.precision == "fp32" else 2
    states = STATE_FLOATS.get(v.optimizer_type, 2) * FP32
    grad_fp32 = str((v.data_types or {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32")
    if v.precision == "bfloat16" and ((zero == 0 and pp >= 1) or (zero == 1 and grad_fp32)):
        return weights, FP32 + states, False, True  # DeepSpeed's BF16_Optimizer
    master = 0 if v.precision == "fp32" and zero in (0, 3) else FP32
    return weights, master + states, zero == 3, zero >= 1


def rank_bytes(v: Any, params: int, on_cpu: bool) -> float:
    """Weights + master weights + optimizer states one rank holds (ZeRO offload to the CPU counts on CPU only)."""
    weights, states, weights_sharded, states_sharded = bytes_per_param(v)
    dp = max(int(v.dp_world_size or 1), 1)
    per_rank = params / (v.model_parallel_size * max(v.pipe_parallel_size, 1))
    zero = v.zero_optimization or {}

    def offloaded(section: str) -> bool:
        block = zero.get(section)
        device = block.get("device", "cpu") if isinstance(block, dict) else "cpu"
        return bool(block) and not on_cpu and str(device).lower() != "none"

    w = 0.0 if offloaded("offload_param") else per_rank * weights / (dp if weights_sharded else 1)
    s = 0.0 if offloaded("offload_optimizer") else per_rank * states / (dp if states_sharded else 1)
    return w + s


def _origin(v: Any, *keys: str) -> str:
    """``a=1, b=2 (set in x.yml)``: the keys with their values, then the files that set them."""
    origins = getattr(v, "origins", {}) or {}
    files = list(dict.fromkeys(origins[k] for k in keys if origins.get(k)))
    text = ", ".join(f"{key}={getattr(v, key)}" for key in keys)
    return text + (f" (set in {', '.join(files)})" if files else "")


def tensor_limit_problems(v: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """A model PyTorch cannot index (more than 2**63-1 parameters), from the resolved values."""
    if not v.get("hidden_size") or not v.get("num_layers"):
        return []
    values = SimpleNamespace(**v, origins=origins)
    params = param_lower_bound(values)
    if params <= INT64_MAX:
        return []
    return [
        f"model too large: {_origin(values, 'num_layers', 'hidden_size')} give at least {params:.2e} parameters, "
        "more than PyTorch can index (2**63-1)"
    ]


def machine_memory() -> tuple[int, str]:
    """(bytes, "GPU"/"CPU") of what one rank on this machine can use: the GPU's memory on CUDA, else the RAM (or the
    cgroup memory limit, when lower)."""
    from megatron.distributed import on_cpu  # imports torch, as LaunchEnv.capture does

    if not on_cpu():
        import torch

        device = launched_local_rank() % max(torch.cuda.device_count(), 1)
        return int(torch.cuda.get_device_properties(device).total_memory), "GPU"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total, "CPU"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits_machine(
    args: Any, *, training: bool = True, local: bool = True, memory: tuple[int, str] | None = None
) -> None:
    """Raise ConfigError when one rank's weights (+ optimizer state when ``training``) exceed ``MARGIN`` x this
    machine's memory (``memory``, default ``machine_memory()``); with ``local`` False (deepy starting ranks on other
    hosts) only a size beyond any machine (``NO_MACHINE``) is refused."""
    if not args.hidden_size or not args.num_layers:
        return
    params = param_lower_bound(args)
    if local:
        available, kind = memory or machine_memory()
    else:
        available, kind = NO_MACHINE // MARGIN, ""
    on_cpu = kind != "GPU"
    need = rank_bytes(args, params, on_cpu) if training else params * bytes_per_param(args)[0]
    if need <= MARGIN * available:
        return
    what = "weights and optimizer state" if training else "weights"
    layout = (
        f"tensor x pipeline parallel {args.model_parallel_size} x {max(args.pipe_parallel_size, 1)}, "
        f"ZeRO stage {args.zero_stage}, {args.precision}"
    )
    machine = f"this machine has {_gib(available)} of {kind} memory" if local else "more than any single machine holds"
    raise ConfigError(
        f"model too large: {_origin(args, 'num_layers', 'hidden_size')} give at least {params:.2e} parameters, about "
        f"{need:.2e} bytes ({_gib(need)}) of {what} per rank ({layout}); {machine}. Use a smaller model, more "
        "tensor/pipeline-parallel ranks or ZeRO sharding"
    )
