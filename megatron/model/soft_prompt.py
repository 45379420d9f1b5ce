"""Soft prompt tuning (``soft_prompt_tuning``): a trained prefix of ``n_tokens`` embeddings before every sequence,
the rest of the model frozen.

The prefix is the parameter ``soft_embedding_weight`` ``[n_tokens, h]`` of spec 1 (GPT-NeoX inserts its
``SoftEmbedding`` right after the word embeddings, as layer 1, so its tensor is ``sequential.1.soft_embedding_weight``
and, under a pipeline, the file ``layer_01-…``). Here spec 1 is otherwise the parameter-free
``_pre_transformer_block``, so the prefix takes its place and every other layer keeps its index: a checkpoint
without a prefix loads into a prompt-tuned model (the prefix then keeps its initialisation).

Initialisation as GPT-NeoX's: the word embeddings of the tokens of ``init_string`` (cut to ``n_tokens`` or repeated
up to it), else uniform in ``[-init_range, init_range]``. The prefix goes before the tokens and is not truncated
away: the transformer sees ``n_tokens + s`` positions (prefix positions 0..n-1, tokens n..n+s-1), and the prefix's
outputs are dropped, so the logits stay ``[b, s, V]``, each against its own token's label.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from megatron.model.seeding import seeded
from megatron.neox_arguments.soft_prompt_keys import soft_prompt_problem, soft_prompt_settings


class PromptConfig(Protocol):
    """What the soft prompt reads of ``GPTModelConfig`` (which imports this module for its checks)."""

    soft_prompt_tuning: dict | None
    soft_prompt_init_ids: tuple[int, ...]
    sequence_parallel: bool
    hidden_size: int
    params_dtype: torch.dtype
    seed: int

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed."""
        ...


C = TypeVar("C", bound=PromptConfig)

SOFT_PROMPT_PARAMETER = "soft_embedding_weight"


def soft_prompt_tokens(cfg: PromptConfig) -> int:
    """Prefix length (0 without soft prompt tuning)."""
    settings = soft_prompt_settings(cfg.soft_prompt_tuning)
    return 0 if settings is None else int(settings["n_tokens"])


def soft_prompt_problems(cfg: PromptConfig) -> list[str]:
    """Why the soft prompt settings cannot be built (empty when they can)."""
    if cfg.soft_prompt_tuning is None:
        return []
    problem = soft_prompt_problem(cfg.soft_prompt_tuning)
    if problem:
        return [f"soft_prompt_tuning: {problem}"]
    if soft_prompt_tokens(cfg) and cfg.sequence_parallel:
        return ["not supported yet: soft_prompt_tuning with sequence_parallel"]
    return []


def with_prompt_init(cfg: C, tokenizer: Any) -> C:
    """``cfg`` with ``soft_prompt_init_ids``: the run's tokenizer's ids of ``init_string`` (unchanged without one)."""
    settings = soft_prompt_settings(cfg.soft_prompt_tuning)
    if settings is None or not settings["init_string"] or tokenizer is None:
        return cfg
    ids = tuple(int(t) for t in tokenizer.tokenize(settings["init_string"]))
    if not ids:
        raise ValueError(f"soft_prompt_tuning.init_string={settings['init_string']!r} gives no tokens")
    return cfg.replace(soft_prompt_init_ids=ids)


def extend_mask(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``[.., s, s]`` bool mask (True = masked) → ``[.., n+s, n+s]``: the prefix attends causally within itself and
    sees no token; every token also sees the whole prefix. None (causal) stays None."""
    if mask is None:
        return None
    s = mask.shape[-1]
    out = torch.ones(*mask.shape[:-2], n + s, n + s, dtype=mask.dtype, device=mask.device)
    idx = torch.arange(n, device=mask.device)
    out[..., :n, :n] = (idx[None, :] > idx[:, None]).to(mask.dtype)
    out[..., n:, :n] = False
    out[..., n:, n:] = mask
    return out


class SoftPromptPipe(nn.Module):
    """Spec 1 with soft prompt tuning: ``(hidden [b,s,h], position_ids [b,s], mask)`` → ``(hidden [n+s,b,h],
    position_ids [b,n+s], mask)``, the prefix before the tokens (and the sequence-first transpose of
    ``_pre_transformer_block``). In incremental decoding (a KV cache that already holds the prefix) only the
    positions move by ``n``."""

    def __init__(self, cfg: PromptConfig, spec_index: int = 1) -> None:
        super().__init__()
        settings = soft_prompt_settings(cfg.soft_prompt_tuning)
        assert settings is not None, "SoftPromptPipe needs soft_prompt_tuning.enabled"
        self.n_tokens = int(settings["n_tokens"])
        self.init_string: str = settings["init_string"]
        r = float(settings["init_range"])
        with seeded(cfg.seed + spec_index):
            weight = torch.empty(self.n_tokens, cfg.hidden_size, dtype=cfg.params_dtype).uniform_(-r, r)
        self.soft_embedding_weight = nn.Parameter(weight)

    def prepends(self, kv_cache: Any) -> bool:
        """Whether this forward puts the prefix in (always, except after the first step of incremental decoding)."""
        return kv_cache is None or kv_cache.seq_len == 0

    def forward(self, args: tuple, kv_cache: Any = None) -> tuple:
        """Prepend the prefix (see the class docstring)."""
        hidden, position_ids, mask = args
        n = self.n_tokens
        position_ids = position_ids + n
        if self.prepends(kv_cache):
            b = hidden.shape[0]
            prefix = self.soft_embedding_weight.to(hidden.dtype).unsqueeze(0).expand(b, n, -1)
            hidden = torch.cat([prefix, hidden], dim=1)  # [b, n+s, h]
            first = torch.arange(n, device=position_ids.device, dtype=position_ids.dtype).expand(b, n)
            position_ids = torch.cat([first, position_ids.expand(b, -1)], dim=1)
        return hidden.transpose(0, 1).contiguous(), position_ids, extend_mask(mask, n)

    @torch.no_grad()
    def init_from_tokens(self, word_embeddings: nn.Module, token_ids: list[int]) -> None:
        """GPT-NeoX's ``init_string`` initialisation: the tokens' word embeddings, cut or repeated to n_tokens."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.soft_embedding_weight.device)
        embeds = word_embeddings(ids.unsqueeze(0))[0]  # [len, h]
        embeds = embeds.repeat(math.ceil(self.n_tokens / embeds.shape[0]), 1)[: self.n_tokens]
        self.soft_embedding_weight.copy_(embeds.to(self.soft_embedding_weight.dtype))


def prepare_soft_prompt(model: nn.Module, word_embeddings: nn.Module, token_ids: tuple[int, ...]) -> None:
    """Initialise the prefix from ``init_string``'s token ids (when given; looked up in ``word_embeddings``) and
    freeze every other parameter, so the optimizer sees only the prefix."""
    prompt = next((m for m in model.modules() if isinstance(m, SoftPromptPipe)), None)
    if prompt is None:
        return
    if token_ids and prompt.soft_embedding_weight.device.type != "meta":
        prompt.init_from_tokens(word_embeddings, list(token_ids))
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(SOFT_PROMPT_PARAMETER))


class PromptOutputDrop:
    """``_post_transformer_block`` of a prompt-tuned ``PipelineModule``: also drops the prefix's ``n`` outputs, so the
    last stages see ``[b, s, h]``. Keeps the wrapped function's ``__name__``, so the pipeline partitions (which
    weigh specs by name) the same as without a prompt."""

    def __init__(self, fn: Callable[[tuple], torch.Tensor], n: int) -> None:
        self.fn, self.n = fn, n
        self.__name__ = fn.__name__

    def __call__(self, args: tuple) -> torch.Tensor:
        """The wrapped block, then the positions after the prefix."""
        return self.fn(args)[:, self.n :]


def prepare_stage_soft_prompt(pipe: Any, token_ids: tuple[int, ...]) -> None:
    """:func:`prepare_soft_prompt` on one pipeline stage (a DeepSpeed ``PipelineModule``): every parameter of the
    stage but the prefix is frozen; ``init_string``'s embeddings need the word embeddings on the prefix's stage."""
    prompt = next((m for m in pipe.modules() if isinstance(m, SoftPromptPipe)), None)
    if prompt is None:  # no prefix on this stage: nothing of it trains
        for param in pipe.parameters():
            param.requires_grad_(False)
        return
    embedding = next((m for m in pipe.modules() if hasattr(m, "word_embeddings")), None)
    if token_ids and embedding is None:
        raise ValueError(
            "soft_prompt_tuning.init_string needs the word embeddings on the prefix's pipeline stage; "
            "set pipe_partition_method so that the first stage holds layers 0 and 1, or drop init_string"
        )
    prepare_soft_prompt(pipe, embedding.word_embeddings if embedding is not None else pipe, token_ids)


def check_prompt_checkpoint(saved: set[str], model: nn.Module, path: str) -> None:
    """After a non-strict load into a prompt-tuned model: every parameter but the prefix must have come from the
    checkpoint (its tensor names ``saved``); a checkpoint without the prefix (the model being prompt-tuned) leaves
    the prefix at its initialisation, which is logged."""
    import logging

    expected = set(model.state_dict())
    missing = sorted(k for k in expected - saved if not k.endswith(SOFT_PROMPT_PARAMETER))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} lacks model tensors: {shown}")
    if not any(k.endswith(SOFT_PROMPT_PARAMETER) for k in saved):
        logging.getLogger(__name__).info("checkpoint %s has no soft prompt: the prefix starts from its init", path)
