"""Preprocessing throughput: our batched pipeline vs GPT-NeoX's per-document ``multiprocessing.Pool.imap``.

    python benchmarks/bench_preprocess.py [--input corpus.jsonl] [--vocab-file tokenizer.json] [--workers 2]

Without ``--input`` the stdlib corpus is built (``tools/datasets/corpora.py``); without ``--vocab-file`` a 4096-token
BPE is trained on it first. The baseline reproduces GPT-NeoX's approach: ``Pool(workers).imap(encode, docs,
chunksize=25)`` where each call tokenises one document, and one ``add_item`` + ``end_document`` per document. Both
write ``.bin/.idx`` for the same documents; the outputs are checked to be byte-identical. Prints median times,
tokens/s, the ratio (baseline time / ours) and a JSON line.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, median_ratio

from megatron.data.document_reader import read_documents
from megatron.data.indexed_dataset import make_builder
from megatron.data.preprocess import PreprocessConfig, preprocess
from megatron.tokenizer import TokenizerConfig, build_tokenizer

_TOK = {}


def _baseline_init(vocab_file: str) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    _TOK["tok"] = build_tokenizer(TokenizerConfig("HFTokenizer", vocab_file))


def _baseline_encode(doc: dict) -> list[int]:
    tok = _TOK["tok"]
    return [*tok.tokenize(doc["text"]), tok.eod]


def run_baseline(inputs: list[str], vocab_file: str, prefix: str, workers: int) -> int:
    """GPT-NeoX's loop: per-document encode through Pool.imap (chunksize 25), one item per document."""
    vocab_size = build_tokenizer(TokenizerConfig("HFTokenizer", vocab_file)).vocab_size
    builder = make_builder(prefix + ".bin", "mmap", vocab_size=vocab_size)
    tokens = 0
    with mp.get_context("fork").Pool(workers, initializer=_baseline_init, initargs=(vocab_file,)) as pool:
        for ids in pool.imap(_baseline_encode, read_documents(inputs, ["text"]), chunksize=25):
            builder.add_item(np.array(ids, dtype=builder.dtype))
            builder.end_document()
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return tokens


def run_ours(inputs: list[str], vocab_file: str, prefix: str, workers: int) -> int:
    cfg = PreprocessConfig(
        inputs=inputs,
        output_prefix=prefix,
        tokenizer_type="HFTokenizer",
        vocab_file=vocab_file,
        append_eod=True,
        workers=workers,
        log_interval=10**9,
    )
    with open(os.devnull, "w") as sink:
        return preprocess(cfg, progress_stream=sink).tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", default=None, help="JSONL corpus (default: build the stdlib corpus)")
    p.add_argument("--vocab-file", default=None, help="tokenizers JSON (default: train one on the corpus)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--save", action="store_true", help="write benchmarks/results/preprocess.json (for docs/benchmarks.md)"
    )
    args = p.parse_args()
    report = Report("preprocess", "python benchmarks/bench_preprocess.py", workers=args.workers, rounds=args.repeats)
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        corpus = args.input
        if corpus is None:
            from tools.datasets.corpora import build_stdlib_corpus

            corpus = os.path.join(tmp, "stdlib.jsonl")
            build_stdlib_corpus(corpus)
        vocab = args.vocab_file
        if vocab is None:
            from megatron.tokenizer.train_tokenizer import train_tokenizer

            vocab = os.path.join(tmp, "tokenizer.json")
            train_tokenizer(os.path.dirname(corpus) if args.input is None else tmp, vocab, vocab_size=4096)
        mbytes = os.path.getsize(corpus) / 1e6
        times = {"baseline": [], "ours": []}
        tokens = {}
        for r in range(args.repeats):
            for name, fn in (("baseline", run_baseline), ("ours", run_ours)):
                start = time.perf_counter()
                tokens[name] = fn([corpus], vocab, os.path.join(tmp, f"{name}{r}"), args.workers)
                times[name].append(time.perf_counter() - start)
        for ext in (".bin", ".idx"):
            with (
                open(os.path.join(tmp, "baseline0" + ext), "rb") as a,
                open(os.path.join(tmp, "ours0_text_document" + ext), "rb") as b,
            ):
                if a.read() != b.read():
                    print(f"error: outputs differ ({ext})", file=sys.stderr)
                    return 1
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "preprocess",
        "corpus_mb": round(mbytes, 2),
        "tokens": tokens["ours"],
        "workers": args.workers,
        "baseline_s": round(med["baseline"], 3),
        "ours_s": round(med["ours"], 3),
        "baseline_tokens_per_s": round(tokens["baseline"] / med["baseline"]),
        "ours_tokens_per_s": round(tokens["ours"] / med["ours"]),
        "ratio": round(med["baseline"] / med["ours"], 2),
    }
    print(f"corpus {mbytes:.1f} MB, {tokens['ours']:,} tokens, {args.workers} workers, median of {args.repeats}")
    print(
        f"  GPT-NeoX-style Pool.imap per document: {med['baseline']:.2f} s ({result['baseline_tokens_per_s']:,} tokens/s)"
    )
    print(f"  ours (batched):                        {med['ours']:.2f} s ({result['ours_tokens_per_s']:,} tokens/s)")
    print(f"ratio (baseline / ours): {result['ratio']}x; outputs byte-identical")
    result.pop("benchmark")
    result["ratio_of_medians"] = result.pop("ratio")
    ratio = median_ratio(times["baseline"], times["ours"])
    report.finish(ratio, "baseline time / ours (median of per-round ratios); .bin/.idx identical", args.save,
                  **result)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
