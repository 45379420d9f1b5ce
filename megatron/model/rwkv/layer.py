"""GPT-NeoX's RWKV-6 block (``attention_config`` type ``rwkv``): time-mix and channel-mix with GPT-NeoX's
parameter names, shapes and initialisation.

Block ``i``: ``x = ln1(x)`` first in block 0 only (GPT-NeoX reuses ``ln1`` where RWKV has ``ln0``); then
``x = x + att(ln1(x))`` and ``x = x + ffn(ln2(x))``, with ``ln1``/``ln2`` plain ``LayerNorm(hidden_size)`` whatever
``norm`` says (the key shapes only the final norm). Linear layers keep PyTorch's default initialisation (GPT-NeoX's
``init_method`` keys do not reach them). Blocks work batch-first ``[b, s, h]``; the token shift and the WKV recurrence
run along the sequence (GPT-NeoX hands them its ``[s, b, h]`` activations, so there they run along the batch axis:
docs/gpt-neox-differences.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.config import GPTModelConfig
from megatron.model.kv_cache import KVCache
from megatron.model.rwkv.state import RWKVLayerState
from megatron.model.rwkv.wkv import DEFAULT_CHUNK, wkv_chunked, wkv_step
from megatron.model.seeding import seeded
from megatron.neox_arguments.rwkv_checks import rwkv_sizes

TIME_MIX_EXTRA_DIM = 32  # LoRA width of the five data-dependent token-shift mixes (w, k, v, r, g)
TIME_DECAY_EXTRA_DIM = 64  # LoRA width of the data-dependent decay
GROUP_NORM_EPS = 1e-5 * 8**2  # RWKV's head_size_divisor 8


def _shift(x: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """``x`` [b, s, h] moved one token later: position t holds x[t-1], position 0 ``last`` (zeros if None)."""
    first = torch.zeros_like(x[:, :1]) if last is None else last.unsqueeze(1).to(x.dtype)
    return torch.cat([first, x[:, :-1]], dim=1)


def _ddd(hidden: int) -> torch.Tensor:
    """``[1, 1, h]`` with entry ``i`` = ``i / h`` (fp32, as GPT-NeoX fills it), on the CPU (:func:`_here`)."""
    return (torch.arange(hidden, dtype=torch.float64, device="cpu") / hidden).float().view(1, 1, hidden)


def _here() -> torch.device:
    """The device the model is being built on. The layers' constant tables are computed on the CPU and moved there:
    on the meta device (the planner counting parameters) that arithmetic would run Python decompositions that import
    ``torch._dynamo``; on the CPU the move is a no-op."""
    return torch.empty(0).device


class RWKV_TimeMix(nn.Module):  # GPT-NeoX's class name
    """RWKV-6 time mixing (the attention substitute); parameters as GPT-NeoX's ``att.*``."""

    def __init__(self, cfg: GPTModelConfig, layer_number: int) -> None:
        super().__init__()
        sizes = rwkv_sizes(cfg)
        h, d = cfg.hidden_size, sizes.dim_att
        self.num_heads, self.head_size = sizes.num_heads, sizes.head_size
        self.chunk = DEFAULT_CHUNK
        ratio_0_to_1 = layer_number / (cfg.num_layers - 1)
        ratio_1_to_almost0 = 1.0 - layer_number / cfg.num_layers
        here = _here()
        with torch.no_grad():
            ddd = _ddd(h)
            self.time_maa_x = nn.Parameter((1.0 - torch.pow(ddd, ratio_1_to_almost0)).to(here))
            self.time_maa_w = nn.Parameter((1.0 - torch.pow(ddd, ratio_1_to_almost0)).to(here))
            self.time_maa_k = nn.Parameter((1.0 - torch.pow(ddd, ratio_1_to_almost0)).to(here))
            self.time_maa_v = nn.Parameter((1.0 - (torch.pow(ddd, ratio_1_to_almost0) + 0.3 * ratio_0_to_1)).to(here))
            self.time_maa_r = nn.Parameter((1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0)).to(here))
            self.time_maa_g = nn.Parameter((1.0 - torch.pow(ddd, 0.5 * ratio_1_to_almost0)).to(here))
            self.time_maa_w1 = nn.Parameter(torch.zeros(h, TIME_MIX_EXTRA_DIM * 5).uniform_(-1e-4, 1e-4))
            self.time_maa_w2 = nn.Parameter(torch.zeros(5, TIME_MIX_EXTRA_DIM, h).uniform_(-1e-4, 1e-4))
            n = torch.arange(d, dtype=torch.float64, device="cpu")
            decay_speed = -6 + 5 * (n / (d - 1)) ** (0.7 + 1.3 * ratio_0_to_1)
            self.time_decay = nn.Parameter(decay_speed.float().reshape(1, 1, d).to(here))
            self.time_decay_w1 = nn.Parameter(torch.zeros(h, TIME_DECAY_EXTRA_DIM).uniform_(-1e-4, 1e-4))
            self.time_decay_w2 = nn.Parameter(torch.zeros(TIME_DECAY_EXTRA_DIM, d).uniform_(-1e-4, 1e-4))
            zigzag = ((n + 1) % 3 - 1) * 0.1
            bonus = ratio_0_to_1 * (1 - n / (d - 1)) + zigzag
            self.time_faaaa = nn.Parameter(bonus.float().reshape(self.num_heads, self.head_size).to(here))
        self.receptance = nn.Linear(h, d, bias=False)
        self.key = nn.Linear(h, d, bias=False)
        self.value = nn.Linear(h, d, bias=False)
        self.output = nn.Linear(d, h, bias=False)
        self.gate = nn.Linear(h, d, bias=False)
        self.ln_x = nn.GroupNorm(self.num_heads, d, eps=GROUP_NORM_EPS)

    def forward(self, x: torch.Tensor, state: RWKVLayerState | None = None) -> torch.Tensor:
        """``x`` [b, s, h] → [b, s, h]; ``state`` (generation) supplies and receives the last token and WKV state."""
        b, s, h = x.shape
        xx = _shift(x, state.att_shift if state is not None else None) - x
        xxx = x + xx * self.time_maa_x
        xxx = torch.tanh(xxx @ self.time_maa_w1).view(b * s, 5, -1).transpose(0, 1)
        xxx = torch.bmm(xxx, self.time_maa_w2).view(5, b, s, h)
        mw, mk, mv, mr, mg = xxx.unbind(dim=0)
        xw = x + xx * (self.time_maa_w + mw)
        xk = x + xx * (self.time_maa_k + mk)
        xv = x + xx * (self.time_maa_v + mv)
        xr = x + xx * (self.time_maa_r + mr)
        xg = x + xx * (self.time_maa_g + mg)
        heads = (b, s, self.num_heads, self.head_size)
        r = self.receptance(xr).view(heads)
        k = self.key(xk).view(heads)
        v = self.value(xv).view(heads)
        g = F.silu(self.gate(xg))
        w = (self.time_decay + torch.tanh(xw @ self.time_decay_w1) @ self.time_decay_w2).view(heads)
        if state is None:
            y, _ = wkv_chunked(r, k, v, w, self.time_faaaa, chunk=self.chunk)
        else:
            if s == 1 and state.wkv is not None:  # one new token: the per-token step
                y1, state.wkv = wkv_step(r[:, 0], k[:, 0], v[:, 0], w[:, 0], self.time_faaaa, state.wkv)
                y = y1.unsqueeze(1)
            else:  # a prompt (or the first token): chunked, carrying the state out
                y, state.wkv = wkv_chunked(r, k, v, w, self.time_faaaa, state.wkv, chunk=self.chunk)
            state.att_shift = x[:, -1].detach()
        y = self.ln_x(y.reshape(b * s, -1)).view(b, s, -1)
        return self.output(y * g)


class RWKV_ChannelMix(nn.Module):  # GPT-NeoX's class name
    """RWKV-6 channel mixing (the MLP substitute); parameters as GPT-NeoX's ``ffn.*``."""

    def __init__(self, cfg: GPTModelConfig, layer_number: int) -> None:
        super().__init__()
        h, ffn = cfg.hidden_size, rwkv_sizes(cfg).ffn_dim
        with torch.no_grad():
            ddd = _ddd(h)
            ratio_1_to_almost0 = 1.0 - layer_number / cfg.num_layers
            self.time_maa_k = nn.Parameter((1.0 - torch.pow(ddd, ratio_1_to_almost0)).to(_here()))
            self.time_maa_r = nn.Parameter((1.0 - torch.pow(ddd, ratio_1_to_almost0)).to(_here()))
        self.key = nn.Linear(h, ffn, bias=False)
        self.receptance = nn.Linear(h, h, bias=False)
        self.value = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor, state: RWKVLayerState | None = None) -> torch.Tensor:
        """``x`` [b, s, h] → ``sigmoid(receptance(xr)) · value(relu(key(xk))²)``."""
        xx = _shift(x, state.ffn_shift if state is not None else None) - x
        if state is not None:
            state.ffn_shift = x[:, -1].detach()
        xk = x + xx * self.time_maa_k
        xr = x + xx * self.time_maa_r
        k = torch.relu(self.key(xk)) ** 2
        return torch.sigmoid(self.receptance(xr)) * self.value(k)


class RWKVResidualLayer(nn.Module):
    """One RWKV block (see the module docstring): ``ln1``, ``ln2``, ``att``, ``ffn``."""

    def __init__(self, cfg: GPTModelConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.attention_dropout, self.hidden_dropout = cfg.attention_dropout, cfg.hidden_dropout
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.att = RWKV_TimeMix(cfg, layer_number)
        self.ffn = RWKV_ChannelMix(cfg, layer_number)

    def forward(self, x: torch.Tensor, state: RWKVLayerState | None = None) -> torch.Tensor:
        """``x`` [b, s, h] → [b, s, h]. GPT-NeoX's dropouts (``attention_dropout`` after the time-mix residual
        sum, ``hidden_dropout`` after the channel-mix one) apply to the whole sum."""
        if self.layer_number == 0:
            x = self.ln1(x)
        x = x + self.att(self.ln1(x), state)
        if self.attention_dropout > 0:
            x = F.dropout(x, self.attention_dropout, self.training)
        x = x + self.ffn(self.ln2(x), state)
        if self.hidden_dropout > 0:
            x = F.dropout(x, self.hidden_dropout, self.training)
        return x


class RWKVResidualLayerPipe(RWKVResidualLayer):
    """Pipe form: ``(hidden [s, b, h], position_ids, mask)`` → same tuple (positions and mask pass through unused);
    built under ``seed + spec_index`` in fp32 and cast to ``params_dtype``."""

    def __init__(self, cfg: GPTModelConfig, layer_number: int, spec_index: int) -> None:
        with seeded(cfg.seed + spec_index):
            super().__init__(cfg, layer_number)
        self.to(cfg.params_dtype)

    def forward(self, args: tuple, kv_cache: KVCache | None = None) -> tuple:  # type: ignore[override]
        """Run the block on a pipe tuple (batch-first inside); with ``kv_cache`` (generation) the block's recurrent
        state lives there and carries on from the tokens of earlier calls."""
        hidden, position_ids, attention_mask = args
        state = kv_cache.layer_states.setdefault(self.layer_number, RWKVLayerState()) if kv_cache is not None else None
        out = super().forward(hidden.transpose(0, 1), state).transpose(0, 1).contiguous()
        return out, position_ids, attention_mask
