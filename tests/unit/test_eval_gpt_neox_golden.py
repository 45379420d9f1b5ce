"""eval.py's lm-eval adapter against GPT-NeoX's own ``EvalHarnessAdapter`` (tests/fixtures/gpt-neox/eval_requests.json):
the token ids of every loglikelihood request (lm-eval's context / continuation split on the GPT-NeoX 20B
tokenizer, empty contexts, trailing spaces), left truncation to ``max_length + 1``, the batch shapes, the summed
log-probs and greedy flags, and loglikelihood_rolling's windows and totals, over the same causal scoring function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import shared_files

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpt-neox" / "eval_requests.json"
TOKENIZER = shared_files.SHARED / "data" / "tokenizers" / "20B_tokenizer.json"
pytestmark = pytest.mark.skipif(not TOKENIZER.exists(), reason="shared tokenizer files not on this machine")


def causal_logits(tokens: torch.Tensor, padded: int) -> torch.Tensor:
    """The fixture's scoring function: position t sees tokens t and t-1; a token's own id gets +12."""
    v = torch.arange(padded, dtype=torch.float64)
    cur = tokens.to(torch.float64).unsqueeze(-1)
    prev = torch.cat([torch.full_like(tokens[:, :1], -1), tokens[:, :-1]], dim=1).to(torch.float64).unsqueeze(-1)
    out = 3 * torch.sin(0.001 * (v + 1) * (cur + 1)) + 1.5 * torch.cos(0.0007 * (v + 3) * (prev + 2))
    out.scatter_add_(-1, tokens.unsqueeze(-1), torch.full((*tokens.shape, 1), 12.0, dtype=torch.float64))
    return out.to(torch.float32)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def adapter(golden: dict[str, Any]) -> tuple[Any, list[list[list[list[int]]]], list[list[int]]]:
    """Our adapter on the fixture's settings, recording each call's requests and each batch's shape."""
    from megatron.evaluation.adapter import NeoXEvalAdapter
    from megatron.tokenizer import TokenizerConfig, build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(TOKENIZER)))
    shapes: list[list[int]] = []

    def score(tokens: torch.Tensor) -> torch.Tensor:
        shapes.append(list(tokens.shape))
        return causal_logits(tokens, golden["padded_vocab_size"])

    ours = NeoXEvalAdapter(
        tokenizer=tokenizer,
        score_fn=score,
        forward=lambda feed, cache: causal_logits(feed, golden["padded_vocab_size"]),
        max_length=golden["max_length"],
        micro_batch_size=golden["batch_size"],
    )
    calls: list[list[list[list[int]]]] = []
    scorer = ours._loglikelihood_tokens

    def recording(requests: list[Any], disable_tqdm: bool = False, **kwargs: Any) -> list:
        calls.append([[list(c), list(k)] for _, c, k in requests])
        return scorer(requests, disable_tqdm=disable_tqdm, **kwargs)

    ours._loglikelihood_tokens = recording  # type: ignore[method-assign]
    return ours, calls, shapes


def test_loglikelihood_requests_match_gpt_neox(golden: dict[str, Any]) -> None:
    from lm_eval.api.instance import Instance

    want = golden["loglikelihood"]
    ours, calls, shapes = adapter(golden)
    got = ours.loglikelihood([Instance("loglikelihood", {}, tuple(pair), i) for i, pair in enumerate(want["requests"])])
    assert calls == [want["encoded"]]
    assert shapes == want["batch_shapes"]  # longest first, left-truncated to max_length, batch_size rows
    for (score, greedy), (ref, ref_greedy) in zip(got, want["answers"], strict=True):
        assert score == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy
    assert any(g for _, g in got) and not all(g for _, g in got)


def test_loglikelihood_rolling_matches_gpt_neox(golden: dict[str, Any]) -> None:
    """Windows and totals equal; we score every text's windows in one call (GPT-NeoX one call per text)."""
    from lm_eval.api.instance import Instance

    want = golden["loglikelihood_rolling"]
    ours, calls, _ = adapter(golden)
    got = ours.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(want["texts"])]
    )
    assert calls == [[w for text_windows in want["windows"] for w in text_windows]]
    assert len(want["windows"][0]) == 2  # the long text spans two windows of max_length tokens
    assert got == pytest.approx(want["totals"], abs=1e-3)
