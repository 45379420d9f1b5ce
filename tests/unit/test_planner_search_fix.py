"""``--search --search-fix``: each published calibration run's layout is in the top 5 of the search restricted to the
knobs it used, or the search explains, term by term, why every layout above it is predicted faster."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

import deepy
from megatron.planner.explain import TERMS, step_terms
from megatron.planner.published_runs import A100_40GB_HBM, A100_80GB_HBM, PUBLISHED_RUNS, PublishedRun
from megatron.planner.search import KNOBS, MAX_MICRO_BATCH

TOP = 5
GPU_TYPE = {A100_40GB_HBM: "A100-40GB", A100_80GB_HBM: "A100-80GB"}  # the rows' HBM bandwidth names their GPU
TINY = ["configs/cpu/tiny.yml", "--vocab-size", "512", "--gpus", "8", "--gpus-per-node", "4", "--gpu-memory", "2MB"]


def fixed_knobs(run: PublishedRun) -> list[str]:
    """The knobs the run did not choose among: activation checkpointing and the ZeRO stage are its framework's policy
    (every published run recomputes; Megatron-LM has no ZeRO, DeepSpeed's pipeline engine ZeRO-0/1 only), a
    parallelism it did not use stays off. TP, pipeline stages it used and the micro-batch vary."""
    return ["ckpt", "zero", *(["tp"] if run.tp == 1 else []), *(["pp"] if run.pp == 1 else [])]


def _config(run: PublishedRun, tmp_path: Path) -> Path:
    """The run as a config: its shape, layout, batch and precision (GPT-NeoX's architecture for the GPT-NeoX run,
    Megatron's GPT -- learned positions, tied embeddings -- for the others)."""
    neox = run.framework == "gpt-neox"
    cfg = {
        "num_layers": run.num_layers,
        "hidden_size": run.hidden_size,
        "num_attention_heads": run.num_heads,
        "seq_length": run.seq_length,
        "max_position_embeddings": run.seq_length,
        "pos_emb": "rotary" if neox else "learned",
        "no_weight_tying": neox,
        "norm": "layernorm",
        "model_parallel_size": run.tp,
        "pipe_parallel_size": run.pp if run.pp > 1 else 0,
        "train_micro_batch_size_per_gpu": run.micro_batch,
        "gradient_accumulation_steps": run.gas,
        "train_batch_size": run.train_batch,
        "zero_optimization": {
            "stage": run.zero_stage,
            **({"offload_optimizer": {"device": "cpu"}} if run.offload_optimizer else {}),
        },
        # fp16 pipelines run ZeRO-1 in GPT-NeoX; Megatron-LM's ZeRO-0 pipelines are planned in bf16 to keep stage 0
        "precision": "fp16" if neox else "bfloat16",
        "checkpoint_activations": run.checkpoint_activations,
        "checkpoint_in_cpu": run.checkpoint_in_cpu,
        # the layout knobs (megatron/planner/knobs.py): the search keeps them at the run's values
        "sequence_parallel": run.sequence_parallel,
        **({"recompute_granularity": run.recompute_granularity} if run.recompute_granularity else {}),
        **({"num_layers_per_virtual_pipeline_stage": v} if (v := run.num_layers_per_virtual_pipeline_stage) else {}),
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "train_iters": 10,
    }
    path = tmp_path / f"{re.sub(r'[^A-Za-z0-9]+', '_', run.name)}.yml"
    path.write_text(json.dumps(cfg))
    return path


def _argv(run: PublishedRun, config: Path) -> list[str]:
    return [
        *[str(config), "--vocab-size", str(run.padded_vocab_size), "--gpus", str(run.gpus)],
        *["--gpu-type", GPU_TYPE[run.hbm_GBps]],
        *["--inter-node-GBps", str(run.inter_node_GBps), "--hbm-GBps", str(run.hbm_GBps)],
        *["--peak-tflops", str(getattr(run, "peak_tflops", 312.0))],
        *["--intra-node-GBps", str(getattr(run, "nvlink_GBps", 300.0))],
        *["--framework", run.framework, "--search", "--search-fix", ",".join(fixed_knobs(run))],
    ]


def _not_a_candidate(run: PublishedRun) -> str | None:
    """Why the search has no candidate for the run's layout (None: it has)."""
    if run.hbm_GBps not in GPU_TYPE:
        return f"HBM {run.hbm_GBps} GB/s: not an A100 whose memory this test knows"
    if run.tp & (run.tp - 1) or run.tp > 8:
        return f"TP {run.tp}: the search tries powers of two within a node of 8 GPUs"
    if run.pp > 1 and run.zero_stage >= 2:
        return f"ZeRO-{run.zero_stage} with a pipeline: DeepSpeed's pipeline engine runs ZeRO-0/1 only"
    if getattr(run, "kv_heads", 0) or getattr(run, "mlp_widths", (0, 0))[0] or getattr(run, "flash_attention", False):
        return "GQA, a non-4h MLP or flash attention: not expressed by this test's config"
    if run.micro_batch > MAX_MICRO_BATCH:
        return f"micro-batch {run.micro_batch}: the search tries up to {MAX_MICRO_BATCH}"
    return None


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert deepy.main(["--plan", "train.py", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=[r.name for r in PUBLISHED_RUNS])
def test_published_layout_is_top_5_or_explained(
    run: PublishedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    why = _not_a_candidate(run)
    if why:  # rows whose layout the search cannot express are skipped, saying why (any added row runs through here)
        pytest.skip(f"{run.name}: {why}")
    argv = _argv(run, _config(run, tmp_path))
    result = json.loads(_run(capsys, *argv, "--json", "--top", "1000"))
    ours = {"tp": run.tp, "stages": run.pp, "zero_stage": run.zero_stage, "micro_batch": run.micro_batch}
    assert result["configured_layout"] == {**ours, "checkpoint": run.checkpoint_activations}
    assert result["fixed_knobs"] == [k for k in KNOBS if k in fixed_knobs(run)]
    for c in result["layouts"]:  # the fixed knobs stay the run's
        assert c["checkpoint_activations"] == run.checkpoint_activations and c["zero_stage"] == run.zero_stage
        assert (c["tensor_parallel"] == 1 if run.tp == 1 else True) and (c["pipe_parallel_size"] <= 1 or run.pp > 1)
    rank = result["configured_rank"]
    if rank is None and result["configured_rejected_reason"]:  # the search refuses the layout and says why
        table = _run(capsys, *argv)
        assert f"* the configured layout is rejected: {result['configured_rejected_reason']}" in table
        if run.pp > 1 and run.num_layers % run.pp:  # GPT-NeoX would split unevenly; the search requires even stages
            assert "not divisible by" in result["configured_rejected_reason"]
            pytest.skip(f"{run.name}: the search refuses it: {result['configured_rejected_reason']}")
    assert rank is not None, f"{run.name}: rejected: {result['configured_rejected_reason']}"
    if not run.micro_batch_stated:  # the source leaves the micro-batch open: the best of the run's layout counts
        rank = next(
            i
            for i, c in enumerate(result["layouts"], 1)
            if (c["tensor_parallel"], max(c["pipe_parallel_size"], 1)) == (run.tp, run.pp)
        )
    above = result["above_configured"]
    assert len(above) == result["configured_rank"] - 1
    if rank > TOP:  # not in the top 5: every layout above it is explained, in the table too
        table = _run(capsys, *argv)
        assert "why above the configured layout" in table
        for e in above:
            line = next(ln for ln in table.splitlines() if ln.startswith(f"  #{e['rank']:<3} "))
            assert f"{e['step_s_delta']:+.3f} s = " in line
            biggest = max(TERMS, key=lambda t: abs(e["term_deltas_s"][t]))
            assert f"{biggest} {e['term_deltas_s'][biggest]:+.3f} s" in line


def test_explanation_deltas_sum_to_the_step_time_difference(capsys: pytest.CaptureFixture[str]) -> None:
    # 20B unrestricted: the paper's layout ranks in the twenties, so there are many layouts above it
    result = json.loads(_run(capsys, "configs/20B.yml", "--gpus", "96", "--search", "--json", "--top", "1000"))
    rank = result["configured_rank"]
    assert rank is not None and rank > TOP and len(result["above_configured"]) == rank - 1
    ours = result["layouts"][rank - 1]["step_s"]
    kinds = set()
    for e in result["above_configured"]:
        layout, deltas = e["layout"], e["term_deltas_s"]
        assert set(deltas) == set(TERMS)
        assert e["step_s_delta"] == pytest.approx(layout["step_s"] - ours, rel=1e-12)
        assert math.fsum(deltas.values()) == pytest.approx(e["step_s_delta"], rel=1e-9, abs=1e-12)
        assert e["step_s_delta"] < 0  # ranked above: predicted faster
        kinds |= {t for t, d in deltas.items() if d < -0.01}
    assert {"recompute", "bubble"} <= kinds  # dropping checkpointing, fewer stages or smaller micro-batches


def test_step_terms_sum_to_the_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    for run in PUBLISHED_RUNS:  # pipelines, TP only, ZeRO-3 (its hidden traffic), with and without recompute
        for ckpt in (True, False):
            p = run.predict() if ckpt else PublishedRun(**{**run.__dict__, "checkpoint_activations": False}).predict()
            terms = step_terms(p, ckpt)
            assert math.fsum(terms.values()) == pytest.approx(p.step_s, rel=1e-12), run.name
            selective = run.recompute_granularity == "selective"  # recomputes the attention core without ckpt
            assert (terms["recompute"] > 0) == (ckpt or selective) and terms["gemm"] > 0, run.name


def test_a_rejected_configured_layout_is_told_why(capsys: pytest.CaptureFixture[str]) -> None:
    # 20B on 96 GPUs with 6 stages (44 layers) and with too little memory: the reason of the configured layout itself
    argv = ["configs/20B.yml", "--gpus", "96", "--search", "--search-fix", "tp,pp,zero,ckpt"]
    result = json.loads(_run(capsys, *argv, "--pipe_parallel_size", "6", "--json"))
    assert result["configured_rank"] is None and result["layouts_that_fit"] == 0
    assert result["configured_rejected_reason"] == "num_layers 44 not divisible by 6 pipeline stages"
    table = _run(capsys, *argv, "--gpu-memory", "20GB")
    assert "* the configured layout is rejected: does not fit: needs 29.0 GB of 18.0 GB usable (20.0 GB)" in table
    fits = json.loads(_run(capsys, *argv, "--json"))
    assert fits["configured_rank"] is not None and fits["configured_rejected_reason"] is None


def test_search_fix_keeps_the_knobs_and_refuses_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    free = json.loads(_run(capsys, *TINY, "--search", "--json", "--top", "1000"))
    fixed = json.loads(_run(capsys, *TINY, "--search", "--search-fix", "pp, ckpt", "--json", "--top", "1000"))
    assert fixed["fixed_knobs"] == ["pp", "ckpt"] and free["fixed_knobs"] == []
    assert 0 < fixed["layouts_that_fit"] < free["layouts_that_fit"]
    assert all(c["pipe_parallel_size"] <= 1 and c["checkpoint_activations"] is False for c in fixed["layouts"])
    expected = [c for c in free["layouts"] if c["pipe_parallel_size"] <= 1 and not c["checkpoint_activations"]]
    assert fixed["layouts"] == expected  # the same layouts in the same order: only the candidate set is restricted
    table = _run(capsys, *TINY, "--search", "--search-fix", "micro")
    assert "kept at the configured value (--search-fix micro): micro-batch (train_micro_batch_size_per_gpu)" in table
    for bad in ("tp,zero2", ","):
        assert deepy.main(["--plan", "train.py", *TINY, "--search", "--search-fix", bad]) == 2
        assert f"--search-fix '{bad}': a comma-separated list of tp, pp, zero, micro, ckpt" in capsys.readouterr().err
    assert deepy.main(["--plan", "train.py", *TINY, "--search-fix", "tp"]) == 2
    assert "--search-fix: only with --search" in capsys.readouterr().err
