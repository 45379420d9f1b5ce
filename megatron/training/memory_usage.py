"""Bytes of parameters, gradients and optimizer state a rank actually holds, read from the DeepSpeed engine.

Every tensor is counted once by its storage (ZeRO keeps parameters as views into flat buffers, and ZeRO-0's
optimizer holds the module's own parameters), in the first category that reaches it: module parameters (with
ZeRO-3 the local partition ``ds_tensor``; gathered full copies of persistent parameters count too), optimizer
master weights (the parameters the wrapped torch optimizer steps, e.g. ZeRO's fp32 partitions), optimizer state
(Adam's moments …), then gradients. ``memory/param_optimizer_bytes`` is parameters + master weights + optimizer
state: what the planner (``deepy.py --plan``) predicts per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from megatron import mpu
from megatron.engine_protocol import Engine

PREFIX = "memory/"
# fp32 master partitions of DeepSpeed's ZeRO-1/2, ZeRO-3 and BF16 optimizers
MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
logger = logging.getLogger("megatron.train")


def _inner_optimizer(engine: Engine) -> Any:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, fp16, bf16) or the engine's own."""
    opt = getattr(engine, "optimizer", None)
    while opt is not None and not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def _module_tensors(engine: Engine) -> Iterator[torch.Tensor]:
    for p in engine.module.parameters():
        yield p.data
        if hasattr(p, "ds_tensor"):
            yield p.ds_tensor


def _master_tensors(engine: Engine, opt: Any) -> Iterator[torch.Tensor]:
    if opt is not None:
        yield from (p for group in opt.param_groups for p in group["params"])
    # ZeRO-3 hands its fp32 partitions to the torch optimizer only while it steps them; read them from the wrapper.
    for name in MASTER_ATTRS:
        value = getattr(getattr(engine, "optimizer", None), name, None)
        for t in [value] if torch.is_tensor(value) else value if isinstance(value, list | tuple) else []:
            if torch.is_tensor(t):
                yield t


def _state_tensors(opt: Any) -> Iterator[torch.Tensor]:
    for state in getattr(opt, "state", {}).values():
        for value in state.values():
            if torch.is_tensor(value):
                yield value


def _grad_tensors(engine: Engine, opt: Any) -> Iterator[torch.Tensor]:
    params = list(engine.module.parameters())
    if opt is not None:
        params += [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        if p.grad is not None:
            yield p.grad
    wrapper = getattr(engine, "optimizer", None)
    for name in ("averaged_gradients", "fp32_partitioned_groups_flat_grad"):
        value = getattr(wrapper, name, None)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        for item in items:
            for t in item if isinstance(item, list | tuple) else [item]:
                if torch.is_tensor(t):
                    yield t


def param_optimizer_bytes(engine: Engine) -> dict[str, float]:
    """``memory/*`` byte counts of what this rank holds now (call after the first optimizer step)."""
    opt = _inner_optimizer(engine)
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            if t.numel() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    params = count(_module_tensors(engine))
    master = count(_master_tensors(engine, opt))
    states = count(_state_tensors(opt))
    grads = count(_grad_tensors(engine, opt))
    return {
        f"{PREFIX}param_bytes": float(params),
        f"{PREFIX}master_param_bytes": float(master),
        f"{PREFIX}optimizer_state_bytes": float(states),
        f"{PREFIX}grad_bytes": float(grads),
        f"{PREFIX}param_optimizer_bytes": float(params + master + states),
    }


def log_param_optimizer_bytes(engine: Engine) -> dict[str, float]:
    """:func:`param_optimizer_bytes`, also written to the console by rank 0 (the loop calls it once)."""
    scalars = param_optimizer_bytes(engine)
    if mpu.world_rank() == 0:
        logger.info("memory held by rank 0: %s", ", ".join(f"{k} {int(v):,}" for k, v in scalars.items()))
    return scalars
