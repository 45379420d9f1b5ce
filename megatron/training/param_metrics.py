"""GPT-NeoX's per-parameter training metrics: ``pct_grad_zeros/<name>`` (``log_grad_pct_zeros``),
``gradient_norms/<name>`` (``log_grad_norm``), ``parameter_norms/<name>`` (``log_param_norm``) and
``optimizer_state_norms/<index>_<state>`` (``log_optimizer_states``), logged every iteration as GPT-NeoX does.

The gradients are read after the last backward of an iteration and before clipping and the optimizer step, through
DeepSpeed's public ``deepspeed.utils.safe_get_full_grad`` / ``safe_get_full_optimizer_state`` (which assemble a
ZeRO-1/2/3 partitioned gradient or state over the data-parallel ranks). A tensor-parallel parameter's shards are
summed over the model-parallel group, so every value is that of the whole parameter, on every rank.
"""

from __future__ import annotations

import math

import torch
from deepspeed.utils import safe_get_full_grad

from megatron import mpu
from megatron.engine_protocol import Engine
from megatron.errors import UserError
from megatron.logging.noise_scale import GradientNoiseScale
from megatron.neox_arguments.sections.logging import LoggingArgs
from megatron.training.deepspeed_adapter import optimizer_state_fragment
from megatron.training.optimizers import weight_decay_param_groups


def _tp_partitioned(p: torch.Tensor) -> bool:
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def _reduce_over_shards(rows: torch.Tensor, partitioned: list[bool]) -> torch.Tensor:
    """Sum per-parameter statistics (one row each) over the model-parallel group: a TP shard counts on every rank,
    a replicated parameter once (model-parallel rank 0)."""
    if mpu.get_model_parallel_world_size() == 1 or not len(rows):
        return rows
    keep = torch.tensor([1.0 if part or mpu.get_model_parallel_rank() == 0 else 0.0 for part in partitioned])
    rows = rows * keep.to(rows.dtype).unsqueeze(1)
    mpu.all_reduce_sum(rows, group="model")
    return rows


def gradient_metrics(engine: Engine, pct_zeros: bool, norms: bool) -> dict[str, float]:
    """``pct_grad_zeros/<name>`` (percent of exactly-zero entries) and ``gradient_norms/<name>`` (L2) of every
    parameter with a gradient; call on every rank between the last backward and the optimizer step."""
    if not (pct_zeros or norms):
        return {}
    names, rows, partitioned = [], [], []
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is None:
            continue
        g = grad.detach().double()
        rows.append(torch.stack([g.pow(2).sum(), (g == 0).sum().double(), torch.tensor(float(g.numel()))]).cpu())
        names.append(name)
        partitioned.append(_tp_partitioned(p))
    stats = _reduce_over_shards(torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64), partitioned)
    out: dict[str, float] = {}
    for name, (sumsq, zeros, numel) in zip(names, stats.tolist(), strict=True):
        if pct_zeros:
            out[f"pct_grad_zeros/{name}"] = zeros / numel * 100.0
        if norms:
            out[f"gradient_norms/{name}"] = math.sqrt(sumsq)
    return out


def parameter_norms(engine: Engine) -> dict[str, float]:
    """``parameter_norms/<name>``: the L2 norm of every parameter (ZeRO-3 partitions gathered by DeepSpeed's
    ``GatheredParameters``)."""
    params = list(engine.module.named_parameters())
    zero3 = [p for _, p in params if hasattr(p, "ds_id")]
    if not zero3:
        return _norms_of(params)
    from deepspeed.zero import GatheredParameters

    with GatheredParameters(zero3):
        return _norms_of(params)


def _norms_of(params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, float]:
    if not params:
        return {}
    rows = torch.stack([p.detach().double().pow(2).sum().reshape(1).cpu() for _, p in params])
    stats = _reduce_over_shards(rows, [_tp_partitioned(p) for _, p in params])
    return {f"parameter_norms/{n}": math.sqrt(v[0]) for (n, _), v in zip(params, stats.tolist(), strict=True)}


def _optimizer_params(engine: Engine) -> list[torch.nn.Parameter]:
    """The parameters in the optimizer's order (its param groups, as ``optimizers.build_optimizer`` made them): the
    index of a parameter here is its key in a torch optimizer's ``state_dict()["state"]``."""
    return [p for group in weight_decay_param_groups(engine.module, 0.0) for p in group["params"]]


def optimizer_state_norms(engine: Engine) -> dict[str, float]:
    """``optimizer_state_norms/<index>_<key>``: the L2 norm of every tensor state (``exp_avg``, ``exp_avg_sq``, ...)
    of every parameter, ``step`` left out. Under ZeRO-1/2 (and the BF16 optimizer) every data-parallel rank holds a
    disjoint slice: the squares are summed over the data-parallel group, then over TP shards."""
    opt = engine.optimizer
    if opt is None:
        return {}
    torch_state = getattr(opt, "state", None)
    flat = optimizer_state_fragment(engine, next(engine.module.parameters()), "") is not None
    keys = _state_keys(opt.optimizer if flat else opt)
    tags, rows, partitioned = [], [], []
    for index, p in enumerate(_optimizer_params(engine)):
        for key in keys:
            if flat:
                value = optimizer_state_fragment(engine, p, key)
            else:
                value = (torch_state or {}).get(p, {}).get(key) if isinstance(torch_state, dict) else None
            if value is None:
                continue
            tags.append(f"optimizer_state_norms/{index}_{key}")
            rows.append(value.detach().double().pow(2).sum().reshape(1).cpu())
            partitioned.append(_tp_partitioned(p))
    if not rows:
        return {}
    stats = torch.stack(rows)
    if flat and mpu.get_data_parallel_world_size() > 1:
        mpu.all_reduce_sum(stats, group="data")
    stats = _reduce_over_shards(stats, partitioned)
    return {tag: math.sqrt(v[0]) for tag, v in zip(tags, stats.tolist(), strict=True)}


def _state_keys(base: object) -> list[str]:
    """The tensor state keys of the wrapped torch optimizer (``exp_avg``, ``exp_avg_sq`` for Adam), ``step`` left
    out."""
    state = getattr(base, "state", None)
    if not isinstance(state, dict):
        return []
    keys: list[str] = []
    for per_param in state.values():
        for k, v in per_param.items():
            if k != "step" and torch.is_tensor(v) and k not in keys:
                keys.append(k)
    return keys


def full_gradients(engine: Engine) -> list[torch.Tensor]:
    """Every gradient as the optimizer will read it (ZeRO partitions assembled), a replicated parameter's only on
    model-parallel rank 0: summing squared norms over the model-parallel group then counts each entry once."""
    tp_rank = mpu.get_model_parallel_rank()
    out = []
    for p in engine.module.parameters():
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is not None and (_tp_partitioned(p) or tp_rank == 0):
            out.append(grad)
    return out


def _sum_over_model_group(value: torch.Tensor) -> torch.Tensor:
    if mpu.get_model_parallel_world_size() > 1:
        mpu.all_reduce_sum(value, group="model")
    return value


class ParamMetrics:
    """The per-parameter metrics ``log_cfg`` asks for and the gradient noise scale: :meth:`capture_gradients` runs
    in the step (every rank, after the last backward, before clipping and the optimizer step), :meth:`collect`
    after it returns everything of the iteration."""

    def __init__(self, engine: Engine, log_cfg: LoggingArgs, train_batch_size: int) -> None:
        self.engine = engine
        self.grad_pct_zeros, self.grad_norms = log_cfg.log_grad_pct_zeros, log_cfg.log_grad_norm
        self.param_norms, self.opt_states = log_cfg.log_param_norm, log_cfg.log_optimizer_states
        self.noise_scale: GradientNoiseScale | None = None
        if log_cfg.log_gradient_noise_scale:
            if log_cfg.gradient_noise_scale_n_batches < 2:
                raise UserError(
                    f"gradient_noise_scale_n_batches={log_cfg.gradient_noise_scale_n_batches}: the noise scale "
                    "compares one batch with the mean of n_batches of them; set it to 2 or more"
                )
            self.noise_scale = GradientNoiseScale(
                train_batch_size,
                log_cfg.gradient_noise_scale_n_batches,
                cpu_offload=log_cfg.gradient_noise_scale_cpu_offload,
                reduce=_sum_over_model_group,
            )
        self._gradients: dict[str, float] = {}

    @property
    def wants_gradients(self) -> bool:
        return self.grad_pct_zeros or self.grad_norms or self.noise_scale is not None

    def capture_gradients(self) -> None:
        self._gradients = gradient_metrics(self.engine, self.grad_pct_zeros, self.grad_norms)
        if self.noise_scale is not None:
            grads = full_gradients(self.engine)
            bad = torch.tensor([0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0])
            if mpu.world_size() > 1:
                mpu.all_reduce_max(bad)
            self.noise_scale.update(grads, finite=not bool(bad.item()))

    def collect(self) -> dict[str, float]:
        out, self._gradients = self._gradients, {}
        if self.noise_scale is not None and self.noise_scale.noise_scale is not None:
            out["train/noise_scale"] = self.noise_scale.noise_scale
        if self.param_norms:
            out.update(parameter_norms(self.engine))
        if self.opt_states:
            out.update(optimizer_state_norms(self.engine))
        return out
