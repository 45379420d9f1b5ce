"""Test data for post-training: a small local HF tokenizer folder with a chat template, and chat JSONL files.

The tokenizer is a 384-token byte-level BPE trained on the shared tinyshakespeare corpus (tiny models need a tiny
vocabulary), saved as an HF folder whose ``tokenizer_config.json`` carries the Jinja chat template below.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.shared_files import shared_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
USER_TURNS = ["What is the time?", "Say a word.", "Who speaks first?", "Name a king.", "Count to three."]
GOOD = ["It is noon, my lord.", "Peace.", "The citizen speaks.", "Richard, my lord.", "One, two, three."]
BAD = ["zzzz qqqq xxxx.", "no no no no no.", "kkkk jjjj.", "vvvv wwww.", "qq qq qq qq."]


def make_chat_tokenizer(root: Path, vocab_size: int = 384) -> Path:
    """An HF tokenizer folder (``tokenizer.json`` + config with the chat template) under ``root/hf_tok``."""
    from transformers import PreTrainedTokenizerFast

    from megatron.tokenizer.train_tokenizer import train_tokenizer

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    text = shared_file("data", "corpora", "tinyshakespeare.txt").read_text(encoding="utf-8")[:60000]
    extra = " ".join(USER_TURNS + GOOD + BAD + ["<|user|>", "<|assistant|>", "<|system|>"])
    with open(corpus / "c.jsonl", "w", encoding="utf-8") as f:
        for para in [*text.split("\n\n"), extra]:
            f.write(json.dumps({"text": para}) + "\n")
    raw = root / "bpe.json"
    train_tokenizer(str(corpus), str(raw), vocab_size=vocab_size, preset="lossless")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(raw), eos_token="<|endoftext|>", pad_token="<|padding|>")
    tok.chat_template = CHAT_TEMPLATE
    out = root / "hf_tok"
    tok.save_pretrained(str(out))
    return out


def conversation(i: int, good: bool = True) -> list[dict[str, str]]:
    """A two-turn conversation (user, assistant)."""
    k = i % len(USER_TURNS)
    return [{"role": "user", "content": USER_TURNS[k]}, {"role": "assistant", "content": (GOOD if good else BAD)[k]}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sft_rows(n: int) -> list[dict]:
    """SFT conversations with a system turn first."""
    return [{"messages": [{"role": "system", "content": "Be brief."}, *conversation(i)]} for i in range(n)]


def pair_rows(n: int) -> list[dict]:
    """DPO/RM pairs: the chosen answer is the sensible one."""
    return [{"chosen": conversation(i, True), "rejected": conversation(i, False)} for i in range(n)]


def kto_rows(n: int) -> list[dict]:
    """KTO rows: good answers rewarded 1.0, bad ones -1.0 (alternating)."""
    return [{"messages": conversation(i, i % 2 == 0), "reward": 1.0 if i % 2 == 0 else -1.0} for i in range(n)]
