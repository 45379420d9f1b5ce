"""Index-map build time for GPT-NeoX's packed sample order: vectorised numpy vs the sequential algorithm.

    python benchmarks/bench_index_maps.py [--num-samples 10000000] [--seq-length 2048] [--loop-samples 200000]

Builds doc_idx / sample_idx / shuffle_idx for ``--num-samples`` samples with :mod:`megatron.data.index_maps`.
The baseline is GPT-NeoX's sample-index algorithm run as a plain Python loop (what runs when its C++ helper is
not compiled); being linear, it is timed on ``--loop-samples`` samples and extrapolated. Both are checked to give
identical arrays. Prints the medians, the ratios and a JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report

from megatron.data import index_maps


def loop_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """GPT-NeoX's sample-index walk, one sample at a time."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    d = offset = 0
    for k in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d += 1
                offset = 0
        out[k] = (d, offset)
    return out


def timed(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=10_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-docs", type=int, default=200_000)
    p.add_argument("--mean-doc-tokens", type=int, default=1000)
    p.add_argument("--loop-samples", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--save", action="store_true", help="write benchmarks/results/index_maps.json (for docs/benchmarks.md)"
    )
    args = p.parse_args()
    report = Report("index_maps", "python benchmarks/bench_index_maps.py", rounds=args.repeats)
    rng = np.random.RandomState(0)
    sizes = np.maximum(1, rng.exponential(args.mean_doc_tokens, size=args.num_docs)).astype(np.int32)
    documents = np.arange(args.num_docs, dtype=np.int32)

    np_rng = np.random.RandomState(1234)
    tokens = index_maps.num_tokens(documents, sizes)
    epochs = index_maps.num_epochs_for(tokens, args.seq_length, args.num_samples)
    t0 = time.perf_counter()
    doc_idx = index_maps.build_doc_idx(documents, epochs, np_rng)
    t_doc = time.perf_counter() - t0
    t_sample, sample_idx = timed(
        lambda: index_maps.build_sample_idx(sizes, doc_idx, args.seq_length, epochs, tokens), args.repeats
    )
    t0 = time.perf_counter()
    index_maps.build_shuffle_idx(sample_idx.shape[0] - 1, np_rng)
    t_shuffle = time.perf_counter() - t0
    ours_total = t_doc + t_sample + t_shuffle

    # The loop is linear in the number of samples: time it on the first --loop-samples samples and check equality.
    n = min(args.loop_samples, args.num_samples)
    loop_small, ref = timed(lambda: loop_sample_idx(sizes, doc_idx, args.seq_length, n), 1)
    if not np.array_equal(sample_idx[: n + 1], ref):
        print("error: vectorised and loop sample_idx differ", file=sys.stderr)
        return 1
    rows = sample_idx.shape[0] - 1
    loop_full = loop_small * rows / n
    baseline_total = t_doc + loop_full + t_shuffle  # doc_idx and shuffle_idx are the same numpy calls in both
    result = {
        "benchmark": "index_maps",
        "num_samples": args.num_samples,
        "sample_rows": rows,
        "seq_length": args.seq_length,
        "doc_idx_entries": len(doc_idx),
        "doc_idx_s": round(t_doc, 3),
        "sample_idx_vectorised_s": round(t_sample, 3),
        "shuffle_idx_s": round(t_shuffle, 3),
        "total_vectorised_s": round(ours_total, 3),
        "loop_timed_samples": n,
        "sample_idx_loop_extrapolated_s": round(loop_full, 2),
        "ratio_sample_idx": round(loop_full / t_sample, 1),
        "ratio_total": round(baseline_total / ours_total, 2),
    }
    print(f"{args.num_samples:,} samples of {args.seq_length} tokens ({len(doc_idx):,} doc_idx entries):")
    print(f"  vectorised: doc_idx {t_doc:.2f} s + sample_idx {t_sample:.2f} s (median) + shuffle_idx {t_shuffle:.2f} s")
    print(f"  loop sample_idx: {loop_small:.2f} s for {n:,} samples -> {loop_full:.1f} s extrapolated")
    print(f"ratio sample_idx (loop / vectorised): {result['ratio_sample_idx']}x")
    print(f"ratio whole build (loop-based / vectorised): {result['ratio_total']}x")
    result.pop("benchmark")
    report.finish(result["ratio_total"], "whole build: loop-based sample_idx baseline time / ours; arrays identical",
                  args.save, **result)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
