"""GPT-NeoX's Mamba (v1) residual layer: ``x + mixer(norm(x))``, tensor parallel over the inner dimension.

Parameter names are GPT-NeoX's (``norm.*``, ``mixer.in_proj.weight``, ``mixer.conv1d.{weight,bias}``,
``mixer.x_proj.weight``, ``mixer.dt_proj.{weight,bias}``, ``mixer.A_log``, ``mixer.D``, ``mixer.out_proj.weight``;
biases of the three projections with ``mamba_use_bias_in_linears``). Sizes follow GPT-NeoX: ``d_state`` 16, conv
width 4, inner width ``d_inner = intermediate_size`` or ``int((expansion_factor or 2)·h)``, ``dt_rank = ⌈h/16⌉``.

Tensor parallelism splits ``d_inner``: ``in_proj`` is column parallel with the full output ``[x | z]`` split per
half (rank ``r`` holds ``[x_r | z_r]``, GPT-NeoX's per-rank layout), the conv, ``dt_proj``, ``A_log`` and ``D`` hold
the rank's channels, ``x_proj`` and ``out_proj`` are row parallel. ``x_proj``'s partial sums are all-reduced (GPT-NeoX
leaves them unreduced, so its TP>1 model differs from its TP=1 one; here TP=2 equals TP=1). Every weight is drawn in
full from the layer's seed and sharded, so a seed gives the same model under any TP size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.model.config import GPTModelConfig
from megatron.model.init_functions import init_methods
from megatron.model.kv_cache import KVCache
from megatron.model.mamba.kernels import choose_kernels
from megatron.model.mamba.scan import selective_scan, selective_state_step
from megatron.model.mamba.sizes import D_CONV, D_STATE, mamba_dt_rank, mamba_inner_size
from megatron.model.norms import build_norm
from megatron.model.seeding import seeded

DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4
InitMethod = Callable[[torch.Tensor], object]


@dataclass
class MambaState:
    """One layer's recurrent state for decoding: the last ``D_CONV - 1`` conv inputs ``[b, d_inner/tp, 3]`` and the
    SSM state ``[b, d_inner/tp, 16]`` (fp32)."""

    conv: torch.Tensor
    ssm: torch.Tensor


def _sharded(full_shape: tuple[int, ...], init: InitMethod, dtype: torch.dtype) -> nn.Parameter:
    """A parameter split over TP along dim 0 (drawn in full, this rank's rows kept), marked as a TP shard."""
    param = mpu.sharded_master_weight(full_shape, init, 0, dtype)
    mpu.set_tensor_model_parallel_attributes(param, 0)
    return param


def _uniform(bound: float) -> InitMethod:
    return lambda t: nn.init.uniform_(t, -bound, bound)


def _dt_bias_init(t: torch.Tensor) -> torch.Tensor:
    """``softplus⁻¹(dt)`` with ``dt`` log-uniform in [0.001, 0.1], floored at 1e-4 (Mamba's Δ bias init)."""
    dt = torch.exp(torch.rand_like(t) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    dt = dt.clamp(min=DT_INIT_FLOOR)
    return t.copy_(dt + torch.log(-torch.expm1(-dt)))


def _a_log_init(t: torch.Tensor) -> torch.Tensor:
    """S4D-real: ``A_log[d, n] = log(n + 1)``."""
    return t.copy_(torch.log(torch.arange(1, t.shape[1] + 1, dtype=t.dtype)).expand_as(t))


class DtProj(nn.Module):
    """``dt_proj`` (``dt_rank → d_inner/tp``, always with a bias): only its parameters are used; the bias enters the
    scan as ``delta_bias`` (Δ = softplus(W dt + b))."""

    def __init__(self, d_inner: int, dt_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _sharded((d_inner, dt_rank), _uniform(dt_rank**-0.5), dtype)
        self.bias = _sharded((d_inner,), _dt_bias_init, dtype)


class Conv1d(nn.Module):
    """``conv1d``: depthwise causal convolution over time, width 4, weight ``[d_inner/tp, 1, 4]``."""

    def __init__(self, d_inner: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(D_CONV)  # torch's Conv1d default for a depthwise conv (fan-in = width)
        self.weight = _sharded((d_inner, 1, D_CONV), _uniform(bound), dtype)
        self.bias = _sharded((d_inner,), _uniform(bound), dtype) if bias else None


class ParallelMambaBlock(nn.Module):
    """The Mamba mixer: in_proj → causal conv1d → SiLU → x_proj → dt_proj → selective scan (gated by SiLU(z)) →
    out_proj. ``forward`` takes and returns ``[s, b, h]``."""

    NO_WEIGHT_DECAY: ClassVar[tuple[str, ...]] = ("A_log", "D")  # GPT-NeoX's _no_weight_decay parameters

    def __init__(self, cfg: GPTModelConfig, init_method: InitMethod, output_layer_init_method: InitMethod) -> None:
        super().__init__()
        self.cfg = cfg
        d_model, d_inner, dt_rank = cfg.hidden_size, mamba_inner_size(cfg), mamba_dt_rank(cfg)
        self.d_inner, self.dt_rank, self.d_state = d_inner, dt_rank, D_STATE
        dtype = cfg.params_dtype
        linear_bias = cfg.mamba_use_bias_in_linears
        self.in_proj = mpu.ColumnParallelLinear(
            d_model,
            2 * d_inner,
            bias=linear_bias,
            gather_output=False,
            init_method=init_method,
            params_dtype=dtype,
            sequence_parallel=cfg.sequence_parallel,
            seq_dim=0,
            output_sizes=(d_inner, d_inner),
        )
        self.conv1d = Conv1d(d_inner, cfg.mamba_use_bias_in_conv, dtype)
        self.x_proj = mpu.RowParallelLinear(
            d_inner,
            dt_rank + 2 * D_STATE,
            bias=linear_bias,
            input_is_parallel=True,
            init_method=init_method,
            params_dtype=dtype,
        )
        self.dt_proj = DtProj(d_inner, dt_rank, dtype)
        self.A_log = _sharded((d_inner, D_STATE), _a_log_init, dtype)
        self.D = _sharded((d_inner,), nn.init.ones_, dtype)
        self.out_proj = mpu.RowParallelLinear(
            d_inner,
            d_model,
            bias=linear_bias,
            input_is_parallel=True,
            init_method=output_layer_init_method,
            params_dtype=dtype,
            sequence_parallel=cfg.sequence_parallel,
            seq_dim=1,
        )

    def forward(self, hidden: torch.Tensor, state: MambaState | None = None) -> tuple[torch.Tensor, MambaState]:
        """``hidden`` [s(/tp with SP), b, h] → (same shape, the state after the last token).

        ``state``: the state after the previous tokens (decoding); None starts from zeros.
        """
        cfg = self.cfg
        xz, _ = self.in_proj(hidden)  # [s, b, 2·d/tp] = [x_r | z_r]
        x, z = xz.permute(1, 2, 0).chunk(2, dim=1)  # [b, d/tp, s] each
        s = x.shape[-1]
        kernels = choose_kernels(
            cfg.mamba_selective_scan_fusion or cfg.mamba_inner_func_fusion,
            cfg.mamba_causal_conv_fusion or cfg.mamba_inner_func_fusion,
            x.device,
        )
        conv_w = self.conv1d.weight.to(x.dtype)
        conv_b = self.conv1d.bias.to(x.dtype) if self.conv1d.bias is not None else None
        past = state.conv.to(x.dtype) if state is not None else x.new_zeros(*x.shape[:2], D_CONV - 1)
        window = torch.cat([past, x], dim=-1)  # [b, d/tp, 3 + s]
        if kernels.causal_conv1d is not None and state is None:
            x = kernels.causal_conv1d(x, conv_w.squeeze(1), conv_b, activation="silu")
        else:
            x = F.silu(F.conv1d(window, conv_w, conv_b, groups=x.shape[1]))  # causal: the past pads the left
        conv_state = window[..., -(D_CONV - 1) :].detach()

        x_dbl, _ = self.x_proj(x.transpose(1, 2))  # [b, s, dt_rank + 2·16], summed over TP
        # every rank's channels use the full Δ/B/C: their gradient is the sum of the ranks' contributions
        x_dbl = mpu.copy_to_model_parallel_region(x_dbl)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, D_STATE, D_STATE], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)  # [b, d/tp, s]; the bias goes into the scan
        A = -torch.exp(self.A_log.float())
        B, C = B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous()  # [b, 16, s]
        bias = self.dt_proj.bias.float()
        if state is not None and s == 1:
            y1, ssm = selective_state_step(
                state.ssm, x[..., 0], dt[..., 0], A, B[..., 0], C[..., 0], self.D, z[..., 0], bias, True
            )
            y = y1[..., None]
        elif kernels.selective_scan is not None and state is None:
            y, ssm = kernels.selective_scan(x, dt, A, B, C, self.D.float(), z, bias, True, return_last_state=True)
        else:
            y, ssm = selective_scan(
                x, dt, A, B, C, self.D, z, bias, True, initial_state=state.ssm if state is not None else None
            )
        out, _ = self.out_proj(y.transpose(1, 2))  # [b, s(/tp with SP), h]
        return out.transpose(0, 1), MambaState(conv_state, ssm.detach())


class ParallelMambaResidualLayer(nn.Module):
    """Pre-norm residual: ``x + mixer(norm(x))`` (no dropout, as in GPT-NeoX)."""

    def __init__(self, cfg: GPTModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        init_method, output_init = init_methods(cfg)
        self.norm = build_norm(cfg)
        self.mixer = ParallelMambaBlock(cfg, init_method, output_init)

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """``hidden`` [s, b, h] → same shape; with ``kv_cache`` the layer's recurrent state is read and updated."""
        state = kv_cache.layer_states.get(self.layer_index) if kv_cache is not None else None
        out, new_state = self.mixer(self.norm(hidden), state)
        if kv_cache is not None:
            kv_cache.layer_states[self.layer_index] = new_state
        return hidden + out


class ParallelMambaResidualLayerPipe(ParallelMambaResidualLayer):
    """Pipe form: ``(hidden [s,b,h], position_ids, mask)`` → same tuple; built under ``seed + spec_index``."""

    def __init__(self, cfg: GPTModelConfig, layer_index: int, spec_index: int) -> None:
        with seeded(cfg.seed + spec_index):
            super().__init__(cfg, layer_index)

    def forward(self, args: tuple, kv_cache: KVCache | None = None) -> tuple:  # type: ignore[override]
        """Run the layer on a pipe tuple (positions and mask pass through unused)."""
        hidden, position_ids, attention_mask = args
        return super().forward(hidden, kv_cache), position_ids, attention_mask
