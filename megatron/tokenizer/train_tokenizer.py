"""Train a byte-level BPE ``tokenizers`` JSON over JSONL documents (GPT-NeoX's ``train_tokenizer.py``).

CLI (GPT-NeoX's flags, plus ours)::

    python tools/datasets/train_tokenizer.py --json_input_dir DIR --tokenizer_output_path out.json [--vocab_size N]
        [--text_key text] [--preset neox|lossless] [--max_docs N]

``preset neox`` is GPT-NeoX's recipe (NFKC normaliser, ``ByteLevel(add_prefix_space=True)``, specials
``<|endoftext|>`` = 0 and ``<|padding|>`` = 1). ``lossless`` drops the normaliser and the prefix space, so that
``decode(encode(text)) == text`` exactly (better for source code). Both start from the 256 byte symbols, so no
input byte is ever unknown (GPT-NeoX's recipe omits that).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
from collections.abc import Iterator

from megatron.errors import DataError
from megatron.logging.progress import add_quiet_flag, bars_enabled, set_quiet

logger = logging.getLogger(__name__)

PRESETS = ("neox", "lossless")


def iter_json_texts(input_dir: str, text_key: str = "text", max_docs: int | None = None) -> Iterator[str]:
    """Texts of every ``*.jsonl``/``*.json`` file in ``input_dir`` (sorted); errors name file and line.

    ``input_dir`` may also be one file: JSON lines when it ends in ``.jsonl``/``.json``, else plain text with one
    document per non-empty line (GPT-NeoX's own test passes ``enwik8_first100.txt`` here).
    """
    if os.path.isfile(input_dir):
        files = [input_dir]
    else:
        files = sorted(glob.glob(os.path.join(input_dir, "*.jsonl")) + glob.glob(os.path.join(input_dir, "*.json")))
        files = [f for f in files if not f.endswith("tokenizer.json")]  # do not train on a previous output
    if not files:
        raise DataError(f"--json_input_dir {input_dir!r} holds no *.jsonl or *.json files")
    count = 0
    for path in files:
        plain = not path.endswith((".jsonl", ".json"))
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if plain:
                    yield line.rstrip("\r\n")
                    count += 1
                    if max_docs is not None and count >= max_docs:
                        return
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(doc, dict) or text_key not in doc:
                    raise DataError(f"{path}:{lineno}: no key {text_key!r} in the JSON object")
                yield str(doc[text_key])
                count += 1
                if max_docs is not None and count >= max_docs:
                    return


def train_tokenizer(
    input_dir: str,
    save_path: str,
    tokenizer_type: str = "BPE",
    vocab_size: int = 52000,
    text_key: str = "text",
    preset: str = "neox",
    max_docs: int | None = None,
) -> int:
    """Train and save the tokenizer JSON; returns the vocabulary size reached.

    An empty ``save_path`` trains without saving, as GPT-NeoX does (a dry run of the data and settings).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if tokenizer_type != "BPE":
        raise DataError(f"--tokenizer_type {tokenizer_type!r} is not supported; valid: BPE")
    if preset not in PRESETS:
        raise DataError(f"--preset {preset!r} is not one of {', '.join(PRESETS)}")
    tok = Tokenizer(models.BPE())
    neox = preset == "neox"
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=neox)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    if neox:
        tok.normalizer = normalizers.NFKC()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|padding|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=bars_enabled(),  # the tokenizers library draws its own bars on stderr
    )
    tok.train_from_iterator(iter_json_texts(input_dir, text_key, max_docs), trainer)
    if not save_path:
        logger.info("no --tokenizer_output_path: the tokenizer was trained but not saved")
        return tok.get_vocab_size()
    os.makedirs(os.path.dirname(os.path.abspath(save_path)), exist_ok=True)
    tmp = save_path + ".tmp"
    tok.save(tmp, pretty=True)
    os.replace(tmp, save_path)
    return tok.get_vocab_size()


def parse_args(input_args: list[str] | None = None) -> argparse.Namespace:
    """GPT-NeoX's flags (plus ``--text_key``, ``--preset``, ``--max_docs``); ``input_args`` defaults to argv."""
    parser = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer (tokenizers JSON) on JSONL files.")
    parser.add_argument(
        "--json_input_dir", required=True, help="directory with *.jsonl / *.json documents, or one such or text file"
    )
    parser.add_argument("--tokenizer_output_path", required=True, help="output tokenizer file (.json); '': not saved")
    parser.add_argument("--tokenizer_type", default="BPE", choices=["BPE"])
    parser.add_argument("-v", "--vocab_size", type=int, default=52000)
    parser.add_argument("--text_key", default="text", help="JSON key holding the document text")
    parser.add_argument("--preset", default="neox", choices=PRESETS, help="neox: GPT-NeoX recipe; lossless: exact")
    parser.add_argument("--max_docs", type=int, default=None, help="train on at most this many documents")
    add_quiet_flag(parser)
    return parser.parse_args(input_args)


def main(args: argparse.Namespace | None = None) -> None:
    """GPT-NeoX's ``main(args)`` with parsed args (``parse_args()`` when None). Bad input raises ValueError/OSError."""
    args = parse_args() if args is None else args
    set_quiet(getattr(args, "quiet", False))
    size = train_tokenizer(
        args.json_input_dir,
        args.tokenizer_output_path,
        args.tokenizer_type,
        args.vocab_size,
        getattr(args, "text_key", "text"),
        getattr(args, "preset", "neox"),
        getattr(args, "max_docs", None),
    )
    where = f"saved at {args.tokenizer_output_path}" if args.tokenizer_output_path else "trained (not saved)"
    print(f"Tokenizer {where} (vocab size {size}, preset {getattr(args, 'preset', 'neox')})")


def cli(input_args: list[str] | None = None) -> int:
    """The command line: errors in one line, exit code 1."""
    try:
        main(parse_args(input_args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
