"""The one generation API (GPT-NeoX's ``generate_samples_from_prompt``), used by generate.py, eval.py and users.

Records are GPT-NeoX's: ``{context, text, length, finished, message, duration_seconds}`` (+ ``logits`` with
``return_logits``). Quirks kept:

* the end-of-document token and the last token of a stop sequence are not part of ``text`` (earlier tokens of a
  multi-token stop sequence are, as GPT-NeoX's end index stops before the token that completes it);
* when the very first generated token ends the generation, ``text`` is ``null`` and ``message`` is GPT-NeoX's
  ``"WARNING: text generation did not start; try different batching or adjust parameters"``;
* an empty prompt starts from the end-of-document token.

``stop_tokens`` are token-id sequences or strings (tokenised); ``until`` strings end the generation once the
decoded text contains one (lm-eval's semantics; the text is not cut here). ``logits`` is one row of the full
(padded) vocabulary per generation step, the EOD / stop step included (GPT-NeoX returns its whole preallocated
``maximum_tokens`` buffer, partly uninitialised).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from megatron.generation.sampling import ForwardFn, SamplingConfig, generate_tokens_batch
from megatron.logging.progress import progress

DID_NOT_START = "WARNING: text generation did not start; try different batching or adjust parameters"


def stop_sequences(tokenizer: Any, stop_tokens: Sequence[Sequence[int] | int | str] | None) -> list[list[int]]:
    """``stop_tokens`` entries (an id, a list of ids, or a string) as token-id sequences."""
    out: list[list[int]] = []
    for entry in stop_tokens or ():
        if isinstance(entry, str):
            ids = list(tokenizer.tokenize(entry))
        elif isinstance(entry, int):
            ids = [entry]
        else:
            ids = [int(t) for t in entry]
        if not ids:
            raise ValueError(f"stop_tokens: {entry!r} is empty (as token ids)")
        out.append(ids)
    return out


class StopRule:
    """``stop_fn`` of :func:`generate_tokens`: a stop-token sequence ends the new tokens, or an ``until`` string
    appears in their text; remembers whether a token sequence matched."""

    def __init__(self, tokenizer: Any, sequences: list[list[int]], strings: list[str]) -> None:
        self.tokenizer, self.sequences, self.strings = tokenizer, sequences, strings
        self.hit_sequence = False

    def __call__(self, new: list[int]) -> bool:
        if any(new[-len(seq) :] == seq for seq in self.sequences):
            self.hit_sequence = True
            return True
        return bool(self.strings) and any(s in self.tokenizer.detokenize(new) for s in self.strings)


def generate_samples_from_prompt(
    forward: ForwardFn,
    tokenizer: Any,
    text: str | Sequence[str | Sequence[int]],
    cfg: SamplingConfig,
    *,
    stop_tokens: Sequence[Sequence[int] | int | str] | None = None,
    until: Sequence[str] | None = None,
    return_logits: bool = False,
    vocab_size: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    batch_size: int = 1,
) -> list[dict[str, Any]]:
    """One GPT-NeoX record per prompt (a string, or token ids); see the module docstring.

    ``batch_size`` prompts are decoded together (:func:`generate_tokens_batch`; greedy results do not depend on
    it, sampled ones draw in a different order); 1 is GPT-NeoX's one prompt at a time.
    """
    prompts = [text] if isinstance(text, str) else list(text)
    if generator is None and seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    sequences = stop_sequences(tokenizer, stop_tokens)
    strings = [s for s in until or () if s]
    records: list[dict[str, Any]] = []
    starts = range(0, len(prompts), max(1, batch_size))
    for first in progress(starts, desc="generating", unit="batch") if len(starts) > 1 else starts:
        start = time.perf_counter()
        contexts, ids = [], []
        for prompt in prompts[first : first + max(1, batch_size)]:
            if isinstance(prompt, str):
                contexts.append(prompt)
                ids.append(list(tokenizer.tokenize(prompt)) if prompt else [])
            else:  # already token ids (e.g. left-truncated by the lm-eval adapter)
                ids.append([int(t) for t in prompt])
                contexts.append(tokenizer.detokenize(ids[-1]) if ids[-1] else "")
        rules = [StopRule(tokenizer, sequences, strings) for _ in ids]
        rows: list[list[torch.Tensor]] = [[] for _ in ids]
        try:
            results = generate_tokens_batch(
                forward,
                ids,
                cfg,
                eod_token=tokenizer.eod,
                vocab_size=vocab_size or getattr(tokenizer, "vocab_size", None),
                generator=generator,
                device=device,
                stop_fns=rules,
                logits_out=rows if return_logits else None,
            )
            errors: list[str | None] = [None] * len(ids)
        except ValueError as e:  # a prompt does not fit the context
            if len(ids) > 1:  # retry one at a time, so that only the offending prompt fails
                for prompt in prompts[first : first + len(ids)]:
                    records += generate_samples_from_prompt(
                        forward, tokenizer, [prompt], cfg, stop_tokens=stop_tokens, until=until,
                        return_logits=return_logits, vocab_size=vocab_size, generator=generator, device=device,
                    )  # fmt: skip
                continue
            results, errors = [([], False)], [str(e)]
        duration = time.perf_counter() - start
        for context, (new, finished), rule, logits, error in zip(contexts, results, rules, rows, errors, strict=True):
            records.append(_record(tokenizer, context, new, finished, rule, logits, error, duration, return_logits))
    return records


def _record(
    tokenizer: Any,
    context: str,
    new: list[int],
    finished: bool,
    rule: StopRule,
    logits: list[torch.Tensor],
    error: str | None,
    duration: float,
    return_logits: bool,
) -> dict[str, Any]:
    if rule.hit_sequence:
        new = new[:-1]  # the token that completed the stop sequence is not part of the completion
    record: dict[str, Any] = {
        "context": context,
        "text": tokenizer.detokenize(new) if new else None,
        "length": len(new),
        "finished": finished,
        "message": error or (None if new else DID_NOT_START),
        "duration_seconds": duration,
    }
    if return_logits:
        record["logits"] = [row.tolist() for row in logits]
    return record
