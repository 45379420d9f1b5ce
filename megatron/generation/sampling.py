"""Sampling over the model's KV cache: greedy, temperature, top-k, top-p (GPT-NeoX's ``text_gen`` semantics).

Greedy when ``temperature == 0 and top_k == 0 and top_p == 0``; otherwise ``logits / temperature`` → top-k →
top-p (nucleus; the first token over the threshold is kept) → softmax → multinomial. Generation stops at the
end-of-document token, a stop token, ``maximum_tokens`` new tokens, or the context length ``seq_length``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from megatron.config_utils import NeoXValues, neox_overrides, require_keys
from megatron.model.kv_cache import KVCache
from megatron.neox_arguments.sections.model import SequenceKeys
from megatron.neox_arguments.sections.textgen import SamplingKeys

# (tokens [b, s_new], cache) -> logits [b, s_new, V]; None on pipeline stages without logits, whose ForwardFn
# then also has share_tokens / share_logits (megatron.generation.parallel.StageForward)
ForwardFn = Callable[[torch.Tensor, Any], torch.Tensor | None]


@runtime_checkable
class SharesTokens(Protocol):
    """A :data:`ForwardFn` that also shares the last stage's tokens and logits (``StageForward``)."""

    def share_tokens(self, sampled: torch.Tensor | None, batch: int, device: torch.device | str) -> torch.Tensor: ...

    def share_logits(self, logits: torch.Tensor | None, batch: int, device: torch.device | str) -> torch.Tensor: ...


@dataclass(kw_only=True)
class SamplingConfig(SamplingKeys, SequenceKeys):
    """GPT-NeoX text-generation keys."""

    stop_tokens: Sequence[int] = ()

    NOT_NEOX_KEYS: ClassVar[tuple[str, ...]] = ("stop_tokens",)  # callers' stop sequences, not a config key

    def __post_init__(self) -> None:
        require_keys(self, ("seq_length",))  # required: the schema's default is None

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> SamplingConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        values = neox_overrides(cls, args)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the key for values outside their range."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in [0, 1], got {self.top_p}")
        if self.maximum_tokens < 1:
            raise ValueError(f"maximum_tokens must be >= 1, got {self.maximum_tokens}")

    @property
    def greedy(self) -> bool:
        """GPT-NeoX: all three sampling knobs zero means argmax decoding."""
        return self.temperature == 0 and self.top_k == 0 and self.top_p == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to ``-inf``; ``logits`` is ``[b, V]``."""
    logits = logits.clone()
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # keep the first token that crosses the threshold
        remove[..., 0] = False
        mask = torch.zeros_like(remove).scatter(-1, sorted_idx, remove)
        logits[mask] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids ``[b]`` from last-position logits ``[b, V]``."""
    logits = logits.float()
    if cfg.greedy:
        return logits.argmax(dim=-1)
    if cfg.temperature > 0:
        logits = logits / cfg.temperature
    logits = filter_logits(logits, cfg.top_k, cfg.top_p)
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.cpu()  # a seeded CPU generator draws on the CPU, whatever device the model runs on
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


def kv_cache_forward(model: torch.nn.Module) -> ForwardFn:
    """A :data:`ForwardFn` for neox-forge's sequential model (``model(tokens, kv_cache=cache)``)."""

    def forward(tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        return model(tokens, kv_cache=cache)

    return forward


def generate_tokens(
    forward: ForwardFn,
    prompt: Sequence[int],
    cfg: SamplingConfig,
    *,
    eod_token: int,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    stop_fn: Callable[[list[int]], bool] | None = None,
    logits_out: list[torch.Tensor] | None = None,
) -> tuple[list[int], bool]:
    """Continue ``prompt`` (token ids; empty = start from EOD); returns ``(new_tokens, finished)``.

    With ``cfg.recompute`` the whole context is fed at every step instead of using the KV cache.
    ``vocab_size`` masks the padding rows of the output layer. ``stop_fn(new_tokens)`` returning True ends the
    generation after that token (multi-token stop sequences, e.g. lm-eval's ``until`` strings); the tokens are kept.
    ``logits_out`` collects each step's last-position logits ``[V]`` (before sampling filters).
    """
    return generate_tokens_batch(
        forward,
        [prompt],
        cfg,
        eod_token=eod_token,
        vocab_size=vocab_size,
        generator=generator,
        device=device,
        stop_fns=[stop_fn] if stop_fn is not None else None,
        logits_out=[logits_out] if logits_out is not None else None,
    )[0]


@torch.inference_mode()
def generate_tokens_batch(
    forward: ForwardFn,
    prompts: Sequence[Sequence[int]],
    cfg: SamplingConfig,
    *,
    eod_token: int,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    stop_fns: Sequence[Callable[[list[int]], bool] | None] | None = None,
    logits_out: Sequence[list[torch.Tensor] | None] | None = None,
) -> list[tuple[list[int], bool]]:
    """:func:`generate_tokens` for several prompts in one batch (GPT-NeoX's ``stream_tokens`` layout).

    The rows share one token tensor and one causal mask: generation starts at the end of the shortest prompt, and
    a row whose prompt is longer keeps its own prompt token at each position until the prompt is consumed, so no
    padding ever sits inside a row. Each row gets ``maximum_tokens`` new tokens (within ``seq_length``) and its own
    stop rules; the batch ends when every row is done. Greedy rows equal their batch-1 result.
    """
    contexts = [list(p) or [eod_token] for p in prompts]
    lengths = [len(c) for c in contexts]
    if max(lengths) >= cfg.seq_length:
        raise ValueError(f"prompt of {max(lengths)} tokens leaves no room in seq_length {cfg.seq_length}")
    b, width = len(contexts), min(cfg.seq_length, max(lengths) + cfg.maximum_tokens)
    tokens = torch.full((b, width), eod_token, dtype=torch.long)
    for i, c in enumerate(contexts):
        tokens[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    tokens = tokens.to(device)
    stops = {eod_token, *cfg.stop_tokens}
    share = forward if isinstance(forward, SharesTokens) else None  # megatron.generation.parallel.StageForward
    new: list[list[int]] = [[] for _ in range(b)]
    finished, done = [False] * b, [False] * b
    cache = None if cfg.recompute else KVCache(capacity=width)
    pos = min(lengths)
    feed = tokens[:, :pos]
    while pos < width:
        out = forward(feed, cache)  # [b, s, V]; None on pipeline stages other than the last
        logits = None if out is None else out[:, -1, :]  # [b, V]
        if logits is not None and vocab_size is not None and vocab_size < logits.shape[-1]:
            logits[:, vocab_size:] = float("-inf")
        picked = None if logits is None else sample_next(logits, cfg, generator)
        if share is not None:  # under TP/PP: every rank continues with the last stage's tokens (and logits)
            picked = share.share_tokens(picked, b, tokens.device)
            if logits_out is not None:
                logits = share.share_logits(None if logits is None else logits.float(), b, tokens.device)
        if picked is None:
            raise ValueError("the forward returned no logits and cannot share tokens (not a StageForward)")
        sampled = picked.tolist()
        column = None  # this position's tokens, written in one go when a row got a new one
        for i in range(b):
            if done[i] or pos < lengths[i]:
                continue  # finished, or still inside its prompt (the prompt token stays)
            row_logits = None if logits_out is None else logits_out[i]
            if row_logits is not None and logits is not None:  # logits is set whenever logits_out is (see above)
                row_logits.append(logits[i].detach().float().cpu())
            token = int(sampled[i])
            if token in stops:
                done[i] = finished[i] = True
                continue
            new[i].append(token)
            if column is None:
                column = [c[pos] if pos < len(c) else eod_token for c in contexts]
            column[i] = token
            stop_fn = None if stop_fns is None else stop_fns[i]
            if stop_fn is not None and stop_fn(new[i]):
                done[i] = finished[i] = True
            elif len(new[i]) >= cfg.maximum_tokens:
                done[i] = True
        if column is not None:
            tokens[:, pos] = torch.tensor(column, dtype=tokens.dtype, device=tokens.device)
        if all(done):
            break
        pos += 1
        feed = tokens[:, :pos] if cache is None else tokens[:, pos - 1 : pos]
    return list(zip(new, finished, strict=True))
