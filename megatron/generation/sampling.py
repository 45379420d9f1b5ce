"""Sampling over the model's KV cache: greedy, temperature, top-k, top-p (GPT-NeoX's ``text_gen`` semantics).

Greedy when ``temperature == 0 and top_k == 0 and top_p == 0``; otherwise ``logits / temperature`` → top-k →
top-p (nucleus; the first token over the threshold is kept) → softmax → multinomial. Generation stops at the
end-of-document token, a stop token, ``maximum_tokens`` new tokens, or the context length ``seq_length``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron.config_utils import neox_overrides
from megatron.logging.progress import progress

# (tokens [b, s_new], cache) -> logits [b, s_new, V]
ForwardFn = Callable[[torch.Tensor, Any], torch.Tensor]


@dataclass
class SamplingConfig:
    """GPT-NeoX text-generation keys."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    maximum_tokens: int = 64
    seq_length: int = 2048
    stop_tokens: Sequence[int] = ()
    recompute: bool = False

    @classmethod
    def from_neox_args(cls, args: Any) -> SamplingConfig:
        """Read the flat GPT-NeoX attribute names (None means the default)."""
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


@torch.no_grad()
def generate_tokens(
    forward: ForwardFn,
    prompt: Sequence[int],
    cfg: SamplingConfig,
    *,
    eod_token: int,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[list[int], bool]:
    """Continue ``prompt`` (token ids; empty = start from EOD); returns ``(new_tokens, finished)``.

    With ``cfg.recompute`` the whole context is fed at every step instead of using the KV cache.
    ``vocab_size`` masks the padding rows of the output layer.
    """
    from megatron.model.kv_cache import KVCache

    context = list(prompt) or [eod_token]
    if len(context) >= cfg.seq_length:
        raise ValueError(f"prompt of {len(context)} tokens leaves no room in seq_length {cfg.seq_length}")
    budget = min(cfg.maximum_tokens, cfg.seq_length - len(context))
    cache = None if cfg.recompute else KVCache()
    new: list[int] = []
    feed = torch.tensor([context], dtype=torch.long, device=device)
    stops = {eod_token, *cfg.stop_tokens}
    finished = False
    for _ in range(budget):
        logits = forward(feed, cache)[:, -1, :]  # [1, V]
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits[:, vocab_size:] = float("-inf")
        token = int(sample_next(logits, cfg, generator)[0])
        if token in stops:
            finished = True
            break
        new.append(token)
        if cache is None:
            feed = torch.tensor([context + new], dtype=torch.long, device=device)
        else:
            feed = torch.tensor([[token]], dtype=torch.long, device=device)
    return new, finished


def generate_samples(
    forward: ForwardFn,
    tokenizer: Any,
    prompts: Sequence[str],
    cfg: SamplingConfig,
    *,
    vocab_size: int | None = None,
    seed: int | None = None,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """GPT-NeoX output records ``{context, text, length, finished, message, duration_seconds}`` per prompt."""
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    records = []
    bar = progress(prompts, desc="generating", unit="prompt") if len(prompts) > 1 else prompts
    for prompt in bar:
        start = time.perf_counter()
        ids = tokenizer.tokenize(prompt) if prompt else []
        message = None
        try:
            new, finished = generate_tokens(
                forward,
                ids,
                cfg,
                eod_token=tokenizer.eod,
                vocab_size=vocab_size or getattr(tokenizer, "vocab_size", None),
                generator=generator,
                device=device,
            )
        except ValueError as e:
            new, finished, message = [], False, str(e)
        records.append(
            {
                "context": prompt,
                "text": tokenizer.detokenize(new) if new else "",
                "length": len(new),
                "finished": finished,
                "message": message,
                "duration_seconds": time.perf_counter() - start,
            }
        )
    return records
