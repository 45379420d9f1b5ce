"""The training benchmark runs end to end on the small shape (its first-step-loss gate passes, it prints ratio= and
one JSON line with the load averages), and docs/benchmarks.md is what benchmarks/gen_docs.py makes of the saved
results. No timing is asserted."""

from __future__ import annotations

import json

from tests.harness import PYTHON, REPO_ROOT, run_command
from tests.shared_files import shared_file


def test_train_benchmark_small_gate_and_json():
    shared_file("data", "corpora", "tinyshakespeare.txt")  # bench_train.py's corpus and tokenizer
    shared_file("data", "tokenizers", "20B_tokenizer.json")
    out = run_command(
        [PYTHON, str(REPO_ROOT / "benchmarks" / "bench_train.py"), "--small", "--rounds", "1", "--warmup", "0"],
        timeout=400,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "(equal)" in out.stdout and f"ratio={result['ratio']}" in out.stdout
    assert result["benchmark"] == "train_small" and result["ratio"] > 0 and result["rounds"] == 1
    assert abs(result["first_loss_ours"] - result["first_loss_hf"]) <= 1e-4 * result["first_loss_hf"]
    assert len(result["load_before"]) == 3 and len(result["load_after"]) == 3
    assert {"torch", "deepspeed", "transformers"} <= set(result["versions"]) and result["threads"] >= 1


def test_benchmarks_doc_is_generated_from_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    record = {"benchmark": "train", "command": "python benchmarks/bench_train.py", "date": "2026-11-30 18:00 UTC",
              "machine": "test cpu, 2 cores", "threads": 2, "load_before": [1.0, 1, 1], "load_after": [2.0, 2, 2],
              "ratio": 1.234, "median_ours_s": 1.0, "versions": {"torch": "x"}}  # fmt: skip
    (results / "train.json").write_text(json.dumps(record) + "\n")
    page = tmp_path / "benchmarks.md"
    gen = [PYTHON, str(REPO_ROOT / "benchmarks" / "gen_docs.py"), "--results", str(results), "--output", str(page)]
    run_command(gen)
    text = page.read_text()
    assert "| `train` | `python benchmarks/bench_train.py` | 2026-11-30 18:00 UTC | test cpu, 2 cores | 2 | 1.0 → 2.0 " \
           "| **1.234** | ≥ 1.3 |" in text  # fmt: skip
    assert '"median_ours_s": 1.0' in text
    assert run_command([*gen, "--check"]).returncode == 0
    page.write_text(text + "edited\n")
    assert run_command([*gen, "--check"], check=False).returncode == 1
    # the committed page is up to date with the committed results
    assert run_command([PYTHON, str(REPO_ROOT / "benchmarks" / "gen_docs.py"), "--check"], check=False).returncode == 0


def test_decode_benchmark_gate_and_json_fp32_and_bf16():
    """Greedy tokens identical to HF generate at batch 1 and 8 (the gate), in fp32 and in bf16."""
    tiny = ["--layers", "2", "--hidden", "64", "--vocab", "256", "--new-tokens", "4", "--rounds", "1"]
    for flags, name in (([], "decode"), (["--bf16"], "decode_bf16")):
        out = run_command([PYTHON, str(REPO_ROOT / "benchmarks" / "bench_decode.py"), *tiny, *flags], timeout=300)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert out.stdout.count("identical)") == 2 and f"ratio={result['ratio']}" in out.stdout
        assert result["benchmark"] == name and result["precision"] == ("bf16" if flags else "fp32")
        assert result["ratio"] == min(result["batch1"]["ratio"], result["batch8"]["ratio"]) > 0
        assert result["batch8"]["tokens"] > result["batch1"]["tokens"] > 0
        assert len(result["batch1"]["per_round_ratios"]) == 1 and len(result["load_after"]) == 3
        assert ("batch1_vs_hf_fp32" in result) == bool(flags)


def test_planner_benchmark_gate_and_json():
    """bench_planner.py on GPT-NeoX-20B (96 GPUs, 4 stages): both sides print the same plan, the search completes."""
    argv = ["--config", "configs/20B.yml", "--gpus", "96", "--gpu-type", "A100-40GB", "--vocab-size", "50277"]
    out = run_command([PYTHON, str(REPO_ROOT / "benchmarks" / "bench_planner.py"), *argv, "--rounds", "1"], timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "round 1:" in out.stdout and "plans identical" in out.stdout and f"ratio={result['ratio']}" in out.stdout
    assert result["benchmark"] == "planner" and result["ratio"] > 0 and len(result["per_round_ratios"]) == 1
    assert result["layout"] == "TP 2 x PP 4 x DP 12" and result["parameters"] == 20_554_567_680
    assert not result["search_cut_short"] and result["search_candidates"] >= result["search_fit"] > 0
    assert result["cli_plan_cpu_s"] > 0 and len(result["load_after"]) == 3
