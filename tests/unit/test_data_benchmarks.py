"""The data benchmarks run end to end on tiny inputs (their own equality checks pass and a ratio is printed)."""

from __future__ import annotations

import json

import pytest

from tests import shared_files
from tests.harness import PYTHON, REPO_ROOT, run_command

GPT2_JSON = shared_files.SHARED / "data" / "tokenizers" / "gpt2.json"


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_index_map_benchmark_small():
    out = run_command(
        [
            PYTHON,
            str(REPO_ROOT / "benchmarks" / "bench_index_maps.py"),
            "--num-samples",
            "20000",
            "--seq-length",
            "64",
            "--num-docs",
            "2000",
            "--mean-doc-tokens",
            "50",
            "--loop-samples",
            "5000",
            "--repeats",
            "1",
        ],
        timeout=180,
    )
    result = last_json(out.stdout)
    assert "ratio sample_idx" in out.stdout and result["ratio_sample_idx"] > 0 and result["sample_rows"] >= 20000


@pytest.mark.skipif(not GPT2_JSON.exists(), reason="shared gpt2.json not on this machine")
def test_preprocess_benchmark_small(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 20}) + "\n" for i in range(40))
    )
    out = run_command(
        [
            PYTHON,
            str(REPO_ROOT / "benchmarks" / "bench_preprocess.py"),
            "--input",
            str(corpus),
            "--vocab-file",
            str(GPT2_JSON),
            "--repeats",
            "1",
        ],
        timeout=180,
    )
    result = last_json(out.stdout)
    assert "outputs byte-identical" in out.stdout and result["ratio"] > 0 and result["tokens"] > 0
