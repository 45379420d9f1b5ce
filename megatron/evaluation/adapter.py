"""neox-forge models behind lm-evaluation-harness's ``LM`` interface (the installed 0.4.x ``TemplateLM``).

``loglikelihood`` (request encoding from ``TemplateLM``: trailing context spaces move to the continuation, an empty
context is conditioned on the end-of-document token), ``loglikelihood_rolling`` (lm-eval's disjoint rolling windows
of ``max_length`` tokens) and ``generate_until`` (greedy or sampled through :func:`generate_samples_from_prompt`'s
generation API, cut at the ``until`` strings). Requests are sorted by length (longest first), left-truncated to
``max_length + 1`` tokens, right-padded and batched ``micro_batch * dp`` at a time; each data-parallel rank scores
its slice of a batch and the results are gathered, so every rank returns the same answers (GPT-NeoX reports
``rank 0 / world_size 1`` to lm-eval and parallelises inside the model calls, as here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from megatron.generation.api import generate_samples_from_prompt
from megatron.generation.sampling import ForwardFn, SamplingConfig
from megatron.mpu.dp_split import DataParallelSplit

# tokens [b, s] -> logits [b, s, V] (the full, gathered vocabulary)
ScoreFn = Callable[[torch.Tensor], torch.Tensor]
Request = tuple[Any, list[int], list[int]]


class NeoXEvalAdapter(TemplateLM):
    """lm-eval ``LM`` over a neox-forge model: ``score_fn`` for log-likelihoods, ``forward`` for generation."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        score_fn: ScoreFn,
        forward: ForwardFn,
        max_length: int,
        micro_batch_size: int = 1,
        vocab_size: int | None = None,
        max_gen_toks: int = 128,
        device: torch.device | str = "cpu",
        dp: DataParallelSplit | None = None,
        seed: int = 1234,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        self.neox_tokenizer = tokenizer
        self.score_fn = score_fn
        self.forward = forward
        self._max_length = int(max_length)
        self.dp = dp or DataParallelSplit()
        self._batch_size = int(micro_batch_size) * self.dp.size
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self._max_gen_toks = int(max_gen_toks)
        self._device = torch.device(device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.recompute = recompute

    # ---- lm-eval properties -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.neox_tokenizer.eod)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.neox_tokenizer.tokenize(string)) if string else []

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.neox_tokenizer.detokenize(list(tokens)) if tokens else ""

    # ---- scoring ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs: Any) -> list:
        """``(sum of continuation log-probs, continuation is the greedy choice)`` per request, in request order."""
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1] + requests[i][2]), i))
        results: dict[int, tuple[float, bool]] = {}
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            mine = [batch[i] for i in self.dp.my_rows(len(batch))]
            scored = self._score_rows([requests[i] for i in mine]) if mine else []
            for idx, res in zip(batch, self.dp.gather(scored), strict=True):
                results[idx] = res
                key, _, _ = requests[idx]
                if key is not None and key[0] is not None:
                    self.cache_hook.add_partial("loglikelihood", key, res)
        return [results[i] for i in range(len(requests))]

    def _score_rows(self, rows: list[Request]) -> list[tuple[float, bool]]:
        inputs, conts = [], []
        for _, context, continuation in rows:
            if not continuation:
                raise ValueError("lm-eval request with an empty continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :][:-1]
            inputs.append(whole)
            conts.append(list(continuation))
        width = max(len(x) for x in inputs)
        pad = self.eot_token_id
        tokens = torch.tensor([x + [pad] * (width - len(x)) for x in inputs], dtype=torch.long, device=self.device)
        logprobs = F.log_softmax(self.score_fn(tokens).float(), dim=-1)
        out = []
        for i, (inp, cont) in enumerate(zip(inputs, conts, strict=True)):
            target = torch.tensor(cont, dtype=torch.long, device=self.device)
            span = logprobs[i, len(inp) - len(cont) : len(inp)]
            greedy = bool((span.argmax(dim=-1) == target).all())
            out.append((float(span.gather(-1, target.unsqueeze(-1)).sum()), greedy))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each text over disjoint windows of ``max_length`` tokens (lm-eval's split)."""
        windows: list[Request] = []
        counts = []
        for (text,) in [r.args for r in requests]:
            parts = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows += [(None, ctx, cont) for ctx, cont in parts]
            counts.append(len(parts))
        scores = self._loglikelihood_tokens(windows)
        totals, pos = [], 0
        for (text,), n in zip([r.args for r in requests], counts, strict=True):
            total = sum(s for s, _ in scores[pos : pos + n])
            pos += n
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    # ---- generation ---------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continue each context until an ``until`` string, end of document or ``max_gen_toks`` tokens (default 128, GPT-NeoX's)."""
        eos = self.tok_decode([self.eot_token_id])
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen_toks} leaves no context in max_length {self.max_length}")
            cfg = SamplingConfig(
                temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                top_k=int(kwargs.get("top_k") or 0) if kwargs.get("do_sample") else 0,
                top_p=float(kwargs.get("top_p") or 0.0) if kwargs.get("do_sample") else 0.0,
                maximum_tokens=max_gen_toks,
                seq_length=self.max_length,
                recompute=self.recompute,
            )
            prompt = self.tok_encode(context)[-(self.max_length - max_gen_toks) :]
            record = generate_samples_from_prompt(
                self.forward,
                self.neox_tokenizer,
                [prompt],
                cfg,
                until=until,
                vocab_size=self.vocab_size,
                generator=self.generator,
                device=self.device,
            )[0]
            text = postprocess_generated_text(record["text"] or "", until, None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out
