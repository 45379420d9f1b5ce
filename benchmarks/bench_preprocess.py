"""Preprocessing throughput: our pipeline (fast encoder, and forced-plain ``tokenizers``) vs GPT-NeoX's approach.

    python benchmarks/bench_preprocess.py [--input corpus.jsonl] [--vocab-file tokenizer.json] [--workers 2]
        [--gpt-neox /path/to/gpt-neox [--gpt-neox-python /path/to/python]]

Without ``--input`` the stdlib corpus is built (``tools/datasets/corpora.py``); without ``--vocab-file`` GPT-NeoX's
``20B_tokenizer.json`` from the shared files is used, else a 4096-token lossless byte-level BPE is trained on the
corpus. The default baseline reproduces GPT-NeoX's approach in process: ``Pool(workers).imap(encode, docs,
chunksize=25)`` where each call tokenises one document, and one ``add_item`` + ``end_document`` per document. With
``--gpt-neox`` the baseline is GPT-NeoX's own ``tools/datasets/preprocess_data.py`` from that checkout (run as a
command with ``PYTHONPATH`` set to it, by ``--gpt-neox-python``, whose environment needs its imports, e.g.
``lm_dataformat``), and ours run as commands too (``tools/datasets/preprocess_data.py``), so that both sides'
start-up is counted. Sides run interleaved each round: baseline, ours with ``--no-fast-encoder``, ours (the fast
encoder when its merge check and sample check pass; the ``encoder:`` line is reported). All ``.bin/.idx`` are checked to be
byte-identical. Prints median times, tokens/s, the ratio (baseline time / ours) and a JSON line.
"""

from __future__ import annotations

import argparse
import io
import logging
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, SHARED_DIR, Report, median_ratio

from megatron.data.document_reader import read_documents
from megatron.data.indexed_dataset import make_builder, make_dataset
from megatron.data.preprocess import PreprocessConfig, preprocess
from megatron.tokenizer import TokenizerConfig, build_tokenizer

_TOK = {}


def _baseline_init(vocab_file: str) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    _TOK["tok"] = build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=vocab_file))


def _baseline_encode(doc: dict) -> list[int]:
    tok = _TOK["tok"]
    return [*tok.tokenize(doc["text"]), tok.eod]


def run_baseline(inputs: list[str], vocab_file: str, prefix: str, workers: int) -> int:
    """GPT-NeoX's loop: per-document encode through Pool.imap (chunksize 25), one item per document."""
    vocab_size = build_tokenizer(TokenizerConfig(tokenizer_type="HFTokenizer", vocab_file=vocab_file)).vocab_size
    builder = make_builder(prefix + ".bin", "mmap", vocab_size=vocab_size)
    tokens = 0
    with mp.get_context("fork").Pool(workers, initializer=_baseline_init, initargs=(vocab_file,)) as pool:
        for ids in pool.imap(_baseline_encode, read_documents(inputs, ["text"]), chunksize=25):
            builder.add_item(np.array(ids, dtype=builder.dtype))
            builder.end_document()
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return tokens


def run_ours(inputs: list[str], vocab_file: str, prefix: str, workers: int, fast: bool = True) -> tuple[int, str]:
    """Our engine in process; returns the tokens and the ``encoder:`` line."""
    cfg = PreprocessConfig(
        inputs=inputs,
        output_prefix=prefix,
        tokenizer_type="HFTokenizer",
        vocab_file=vocab_file,
        append_eod=True,
        workers=workers,
        log_interval=10**9,
        fast_encoder=fast,
    )
    result = preprocess(cfg, progress_stream=io.StringIO())
    return result.tokens, result.encoder


def _command(cmd: list[str], env: dict[str, str], cwd: str) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}): {' | '.join(tail)}")
    return proc.stderr


def run_ours_cli(inputs: list[str], vocab_file: str, prefix: str, workers: int, fast: bool = True) -> tuple[int, str]:
    """Our ``tools/datasets/preprocess_data.py`` as a command (start-up counted, like GPT-NeoX's script)."""
    cmd = [sys.executable, os.path.join(REPO, "tools", "datasets", "preprocess_data.py"), "--input", ",".join(inputs),
           "--output-prefix", prefix, "--tokenizer-type", "HFTokenizer", "--vocab-file", vocab_file, "--append-eod",
           "--workers", str(workers), "--quiet", *([] if fast else ["--no-fast-encoder"])]  # fmt: skip
    err = _command(cmd, {**os.environ, "PYTHONPATH": REPO}, REPO)
    line = next((x for x in err.splitlines() if x.startswith("encoder:")), "encoder: ?")
    return 0, line


def run_gpt_neox(checkout: str, python: str, inputs: list[str], vocab_file: str, prefix: str, workers: int) -> None:
    """GPT-NeoX's own ``tools/datasets/preprocess_data.py`` from ``checkout`` (its code stays there)."""
    cmd = [python, os.path.join(checkout, "tools", "datasets", "preprocess_data.py"), "--input", ",".join(inputs),
           "--output-prefix", prefix, "--tokenizer-type", "HFTokenizer", "--vocab-file", vocab_file, "--append-eod",
           "--workers", str(workers)]  # fmt: skip
    _command(cmd, {**os.environ, "PYTHONPATH": checkout}, checkout)


def _same_outputs(tmp: str, names: list[str]) -> str | None:
    """The first output that differs from the first name's (None: all byte-identical)."""
    for ext in (".bin", ".idx"):
        with open(os.path.join(tmp, names[0] + ext), "rb") as f:
            ref = f.read()
        for name in names[1:]:
            with open(os.path.join(tmp, name + ext), "rb") as f:
                if f.read() != ref:
                    return name + ext
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", default=None, help="JSONL corpus (default: build the stdlib corpus)")
    p.add_argument("--vocab-file", default=None, help="tokenizers JSON (default: the shared 20B tokenizer, else train)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpt-neox", default=None, help="a GPT-NeoX checkout: run its preprocess_data.py as the baseline")
    p.add_argument("--gpt-neox-python", default=sys.executable, help="the Python that runs GPT-NeoX's script")
    p.add_argument(
        "--save", action="store_true", help="write benchmarks/results/preprocess.json (for docs/benchmarks.md)"
    )
    args = p.parse_args()
    logging.getLogger("megatron.data.preprocess").setLevel(logging.WARNING)
    baseline_name = "GPT-NeoX preprocess_data.py" if args.gpt_neox else "GPT-NeoX-style Pool.imap per document"
    report = Report("preprocess", "python benchmarks/bench_preprocess.py", workers=args.workers, rounds=args.repeats,
                    baseline=baseline_name)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        corpus = args.input
        if corpus is None:
            from tools.datasets.corpora import build_stdlib_corpus

            corpus = os.path.join(tmp, "stdlib.jsonl")
            build_stdlib_corpus(corpus)
        vocab = args.vocab_file
        shared_20b = os.path.join(SHARED_DIR, "data", "tokenizers", "20B_tokenizer.json")
        if vocab is None and os.path.isfile(shared_20b):
            vocab = shared_20b
        if vocab is None:
            from megatron.tokenizer.train_tokenizer import train_tokenizer

            vocab = os.path.join(tmp, "tokenizer.json")
            train_tokenizer(os.path.dirname(corpus) if args.input is None else tmp, vocab, vocab_size=4096,
                            preset="lossless")  # fmt: skip
        mbytes = os.path.getsize(corpus) / 1e6
        sides = ("baseline", "plain", "fast")
        times: dict[str, list[float]] = {k: [] for k in sides}
        ours = run_ours_cli if args.gpt_neox else run_ours
        tokens = 0
        encoder = ""
        for r in range(args.repeats):
            for name in sides:
                prefix = os.path.join(tmp, f"{name}{r}")
                start = time.perf_counter()
                if name == "baseline" and args.gpt_neox:
                    run_gpt_neox(args.gpt_neox, args.gpt_neox_python, [corpus], vocab, prefix, args.workers)
                elif name == "baseline":
                    run_baseline([corpus], vocab, prefix, args.workers)
                else:
                    n, line = ours([corpus], vocab, prefix, args.workers, fast=name == "fast")
                    tokens, encoder = (n or tokens), (line if name == "fast" else encoder)
                times[name].append(time.perf_counter() - start)
        names = ["baseline0_text_document" if args.gpt_neox else "baseline0", "plain0_text_document",
                 "fast0_text_document"]  # fmt: skip
        differs = _same_outputs(tmp, names)
        if differs is not None:
            print(f"error: outputs differ ({differs} vs {names[0]})", file=sys.stderr)
            return 1
        if not tokens:
            tokens = int(make_dataset(os.path.join(tmp, names[0])).sizes.sum())
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "corpus_mb": round(mbytes, 2),
        "tokens": tokens,
        "workers": args.workers,
        "encoder": encoder,
        "baseline_s": round(med["baseline"], 3),
        "ours_plain_s": round(med["plain"], 3),
        "ours_s": round(med["fast"], 3),
        "baseline_tokens_per_s": round(tokens / med["baseline"]),
        "ours_plain_tokens_per_s": round(tokens / med["plain"]),
        "ours_tokens_per_s": round(tokens / med["fast"]),
        "ratio_of_medians": round(med["baseline"] / med["fast"], 2),
        "ratio_plain": round(median_ratio(times["baseline"], times["plain"]), 3),
        "times_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
    }
    print(f"corpus {mbytes:.1f} MB, {tokens:,} tokens, {args.workers} workers, median of {args.repeats}")
    print(f"  {baseline_name + ':':<40}{med['baseline']:.2f} s ({result['baseline_tokens_per_s']:,} tokens/s)")
    print(f"  {'ours, tokenizers (--no-fast-encoder):':<40}{med['plain']:.2f} s "
          f"({result['ours_plain_tokens_per_s']:,} tokens/s)")  # fmt: skip
    print(f"  {'ours (default):':<40}{med['fast']:.2f} s ({result['ours_tokens_per_s']:,} tokens/s); {encoder}")
    print(f"ratio (baseline / ours): {result['ratio_of_medians']}x; outputs byte-identical")
    ratio = median_ratio(times["baseline"], times["fast"])
    report.finish(ratio, "baseline time / ours (median of per-round ratios); .bin/.idx identical", args.save,
                  **result)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
