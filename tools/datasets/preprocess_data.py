"""Tokenise JSONL (or .jsonl.zst/.jsonl.gz/.txt) documents into GPT-NeoX ``.bin``/``.idx`` datasets.

    python tools/datasets/preprocess_data.py --input a.jsonl,b.jsonl.zst --output-prefix data/x \\
        --tokenizer-type HFTokenizer --vocab-file tokenizer.json --append-eod --workers 2

writes ``data/x_text_document.bin`` / ``.idx`` (one per ``--jsonl-keys`` key).
"""

import argparse
import logging
import os
import sys
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.data.preprocess import PreprocessConfig, preprocess
from megatron.data.staged_output import clean_exit_on_sigterm
from megatron.logging.progress import add_quiet_flag, set_quiet
from megatron.tokenizer import TOKENIZER_TYPES


def get_args(input_args: list[str] | None = None) -> argparse.Namespace:
    """GPT-NeoX's flags (plus ``--skip-invalid``); ``input_args`` defaults to ``sys.argv[1:]``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="comma-separated .jsonl/.jsonl.zst/.jsonl.gz/.txt files")
    g.add_argument("--jsonl-keys", nargs="+", default=["text"], help="JSON keys to extract (default: text)")
    g.add_argument("--num-docs", type=int, default=None, help="number of documents, if known (progress bar total)")
    g.add_argument("--skip-invalid", action="store_true", help="skip and count invalid lines instead of failing")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="tokenizer file (JSON, vocab.json, .model, .tiktoken, ...)")
    g.add_argument("--merge-file", default=None, help="merges.txt for GPT2BPETokenizer")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g.add_argument("--ftfy", action="store_true", help="fix text with ftfy before tokenising")
    g.add_argument(
        "--no-fast-encoder",
        action="store_true",
        help="always encode with the tokenizer itself (by default a byte-level BPE tokenizer.json runs on tiktoken "
        "when both give the same ids on a sample of the input; the output is identical either way)",
    )
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="output prefix (no suffix)")
    g.add_argument("--dataset-impl", default="mmap", choices=["lazy", "cached", "mmap"])
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenising processes")
    g.add_argument("--log-interval", type=int, default=100, help="refresh the progress bar's rates every N documents")
    add_quiet_flag(g)
    return p.parse_args(input_args)


parse_args = get_args


def main(input_args: list[str] | None = None) -> None:
    """GPT-NeoX's ``main(input_args)``: preprocess and print what was written. Bad input raises ValueError/OSError
    (naming the file and line), so a calling script sees the failure; the command line prints it in one line."""
    args = get_args(input_args)
    set_quiet(args.quiet)
    cfg = PreprocessConfig(
        inputs=[s for s in args.input.split(",") if s],
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        jsonl_keys=args.jsonl_keys,
        append_eod=args.append_eod,
        ftfy=args.ftfy,
        dataset_impl=args.dataset_impl,
        workers=args.workers,
        log_interval=args.log_interval,
        num_docs=args.num_docs,
        skip_invalid=args.skip_invalid,
        fast_encoder=not args.no_fast_encoder,
    )
    _show_encoder_line()
    result = preprocess(cfg)
    rate = result.tokens / max(result.seconds, 1e-9)
    print(
        f"Processed {result.documents} documents, {result.tokens} tokens in {result.seconds:.2f} s ({rate:,.0f} tokens/s)"
    )
    if result.skipped:
        print(f"Skipped {result.skipped} invalid lines, e.g. {result.skipped_examples[0]}")
    for prefix in result.outputs.values():
        print(f"Wrote {prefix}.bin and {prefix}.idx")


class _CurrentStderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is emitted: a caller that runs ``cli()`` in process may have
    replaced (and closed) the stream that was current when the handler was added."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ and setStream assign it; sys.stderr wins
        del value


def _show_encoder_line() -> None:
    """The engine's ``encoder: ...`` line (which encoder ran and why) on stderr."""
    log = logging.getLogger("megatron.data.preprocess")
    if not any(getattr(h, "_encoder_line", False) for h in log.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._encoder_line = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def cli() -> int:
    """The command line: errors in one line, exit code 1."""
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    clean_exit_on_sigterm()
    raise SystemExit(cli())
