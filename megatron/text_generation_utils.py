"""GPT-NeoX's ``megatron.text_generation_utils.generate_samples_from_prompt`` (its signature) over
``megatron.generation.api``: one record per prompt, ``{context, text, length, finished, message, ...}``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron.generation.api import generate_samples_from_prompt as _generate
from megatron.generation.sampling import SamplingConfig, kv_cache_forward
from megatron.tokenizer import build_neox_args_tokenizer


def generate_samples_from_prompt(
    neox_args: Any,
    model: Any,
    text: list[str] | str,
    eos_token_id: int | None = None,
    maximum_tokens: int = 64,
    recompute: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    stop_tokens: Sequence[Sequence[int] | int | str] | None = None,
) -> list[dict[str, Any]]:
    """Generate from ``text`` with ``model`` (our sequential model, or a DeepSpeed engine wrapping one) and
    ``neox_args.tokenizer`` (``neox_args.build_tokenizer()`` first). ``eos_token_id`` stops like a stop token."""
    module = getattr(model, "module", model)
    if not hasattr(module, "forward") or type(module).__name__ == "PipelineModule":
        raise ValueError("generate_samples_from_prompt needs the sequential model (pipe_parallel_size: 0)")
    tokenizer = neox_args.tokenizer if neox_args.tokenizer is not None else build_neox_args_tokenizer(neox_args)
    cfg = SamplingConfig(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        maximum_tokens=maximum_tokens,
        seq_length=neox_args.seq_length,
        recompute=recompute,
    )
    cfg.validate()
    stops = list(stop_tokens or []) + ([eos_token_id] if eos_token_id is not None else [])
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return _generate(kv_cache_forward(module), tokenizer, text, cfg, stop_tokens=stops or None, device=device)
    finally:
        module.train(was_training)
