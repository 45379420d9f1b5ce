"""Golden GPT-NeoX generation records: EOD first (text null + message), stop sequences as ids / strings, until
strings, return_logits, prompt stripping with \\r\\n, multi-line interactive prompts."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.generation.api import DID_NOT_START, generate_samples_from_prompt
from megatron.generation.sampling import SamplingConfig
from megatron.generation.text_generation import read_interactive_prompt, read_prompts

WORDS = ["<|endoftext|>", "a", "b", "c", "d", "e", "f", "g"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real HFTokenizer over a word-level vocabulary (ids: EOD 0, a 1, b 2, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from megatron.tokenizer import TokenizerConfig, build_tokenizer

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|endoftext|>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=str(path)))


def scripted(tokens: list[int], vocab: int = len(WORDS)) -> Any:
    """A forward function that emits ``tokens`` one per step (logits = 5 * one-hot + step index / 100)."""
    step = {"i": 0}

    def forward(feed: torch.Tensor, cache: Any) -> torch.Tensor:
        i = step["i"]
        step["i"] += 1
        logits = torch.full((1, feed.shape[1], vocab), i / 100.0)
        logits[0, -1, tokens[min(i, len(tokens) - 1)]] = 5.0
        return logits

    return forward


CFG = SamplingConfig(maximum_tokens=6, seq_length=32)


def test_eod_as_first_token_gives_null_text_and_message(tokenizer: Any) -> None:
    (record,) = generate_samples_from_prompt(scripted([0]), tokenizer, ["a b"], CFG)
    assert {k: record[k] for k in ("context", "text", "length", "finished", "message")} == {
        "context": "a b",
        "text": None,
        "length": 0,
        "finished": True,
        "message": DID_NOT_START,
    }
    assert record["duration_seconds"] >= 0 and "logits" not in record


def test_eod_later_and_budget(tokenizer: Any) -> None:
    done, budget = generate_samples_from_prompt(scripted([3, 4, 0]), tokenizer, ["a"], CFG) + (
        generate_samples_from_prompt(scripted([3]), tokenizer, [""], CFG)
    )
    assert (done["text"], done["length"], done["finished"], done["message"]) == ("c d", 2, True, None)
    assert (budget["context"], budget["text"], budget["length"], budget["finished"]) == ("", "c c c c c c", 6, False)


def test_stop_sequences_ids_and_strings(tokenizer: Any) -> None:
    emits = [5, 2, 3, 4, 6]  # e b c d f
    by_ids = generate_samples_from_prompt(scripted(emits), tokenizer, "a", CFG, stop_tokens=[[2, 3]])[0]
    # GPT-NeoX's end index stops before the token completing the sequence: "b" stays, "c" goes
    assert (by_ids["text"], by_ids["length"], by_ids["finished"]) == ("e b", 2, True)
    by_text = generate_samples_from_prompt(scripted(emits), tokenizer, "a", CFG, stop_tokens=["c d", 7])[0]
    assert (by_text["text"], by_text["finished"]) == ("e b c", True)
    single = generate_samples_from_prompt(scripted(emits), tokenizer, "a", CFG, stop_tokens=[5])[0]
    assert (single["text"], single["message"]) == (None, DID_NOT_START)
    until = generate_samples_from_prompt(scripted(emits), tokenizer, "a", CFG, until=["b c"])[0]
    assert (until["text"], until["finished"]) == ("e b c", True)  # until strings end generation, text kept


def test_return_logits(tokenizer: Any) -> None:
    record = generate_samples_from_prompt(scripted([3, 4, 0]), tokenizer, "a", CFG, return_logits=True)[0]
    logits = torch.tensor(record["logits"])
    assert logits.shape == (3, len(WORDS))  # one row per step, the EOD step included
    assert logits.argmax(-1).tolist() == [3, 4, 0] and logits[1, 1].item() == pytest.approx(0.01)


def test_prompt_file_stripping_and_interactive_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"  a b \r\n\r\nc\t\r\n   \r\nd")
    assert read_prompts(str(path)) == ["a b", "c", "d"]
    path.write_text("a\nb###c\n###\n", encoding="utf-8")
    assert read_prompts(str(path), "###") == ["a\nb", "c"]
    stream = io.StringIO("first line\nsecond ### ignored\nthird###\n")
    assert read_interactive_prompt(stream, "###") == "first line\nsecond "
    assert read_interactive_prompt(stream, "###") == "third"
    assert read_interactive_prompt(stream, "###") is None
    lines = io.StringIO("one\r\ntwo\n")
    assert [read_interactive_prompt(lines), read_interactive_prompt(lines), read_interactive_prompt(lines)] == [
        "one",
        "two",
        None,
    ]


def test_undecodable_prompt_file_names_file_and_line(tmp_path) -> None:
    from megatron.errors import UserError

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"first prompt\r\nsecond\n\xff\xfe broken third\nfourth\n")
    with pytest.raises(UserError) as err:
        read_prompts(str(path))
    assert str(err.value).startswith(f"sample_input_file {path}:3: invalid UTF-8") and "\n" not in str(err.value)
    path.write_bytes(b"first prompt\r\nsecond\rthird\n")  # universal newlines are kept
    assert read_prompts(str(path)) == ["first prompt", "second", "third"]
