"""``--search --search-vary``: the search varies the layout knobs too (sequence parallelism, the recomputation,
interleaved chunks, context parallelism), predicts each candidate as ``--plan`` would, puts each of Korthikanti et
al.'s published layouts in its top 5 when it varies the knobs that run used, and marks what neox-forge cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import deepy
from megatron.planner.published_runs import PUBLISHED_RUNS, PublishedRun
from tests.unit.test_planner_search_fix import TINY, _argv, _config, _run

KORTHIKANTI = [r for r in PUBLISHED_RUNS if r.name.startswith("Korthikanti")]


def _search(capsys: pytest.CaptureFixture[str], run: PublishedRun, tmp: Path, fix: str, vary: str) -> dict:
    argv = _argv(run, _config(run, tmp))
    argv[argv.index("--search-fix") + 1] = fix
    return json.loads(_run(capsys, *argv, "--search-vary", vary, "--json", "--top", "1000"))


def _varied(run: PublishedRun) -> tuple[str, str]:
    """(--search-fix, --search-vary) restricted to the knobs the run used: the selective runs chose sequence
    parallelism, the recomputation and (175B, 530B) interleaving; the full-recomputation runs interleaving only."""
    if run.recompute_granularity:
        return "tp,zero", "sp,recompute,vpp"
    return "tp,zero,ckpt", "vpp"


@pytest.mark.parametrize("run", KORTHIKANTI, ids=[r.name for r in KORTHIKANTI])
def test_korthikanti_layouts_are_top_5_when_their_knobs_vary(
    run: PublishedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fix, vary = _varied(run)
    result = _search(capsys, run, tmp_path, fix, vary)
    assert result["varied_knobs"] == vary.split(",")
    knobs = result["configured_knobs"]
    assert knobs["sequence_parallel"] == run.sequence_parallel
    assert knobs["recompute_granularity"] == run.recompute_granularity
    assert knobs["num_layers_per_virtual_pipeline_stage"] == run.num_layers_per_virtual_pipeline_stage
    assert result["configured_rank"] is not None and result["configured_rank"] <= 5, result["configured_rank"]
    chunks = {c["num_layers_per_virtual_pipeline_stage"] for c in result["layouts"]}
    assert None in chunks and (len(chunks) > 1 or run.pp == 1)  # interleaving varied where there are stages
    if "recompute" in vary:
        kinds = {(c["checkpoint_activations"], c.get("recompute_granularity")) for c in result["layouts"]}
        assert {(True, None), (False, "selective")} <= kinds
        assert {c["sequence_parallel"] for c in result["layouts"]} == {False, True}


def test_a_varied_candidate_is_predicted_as_plan_predicts_that_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 530B full-recomputation run searched with every knob varied: its SP + selective, 1-layer-chunk candidate
    has the predicted step and memory of ``--plan`` on the SP + selective run's own config, and ranks above it."""
    full, selective = (
        next(r for r in KORTHIKANTI if r.name == f"Korthikanti 530B {k}") for k in ("full", "SP+selective")
    )
    result = _search(capsys, full, tmp_path, "tp,zero", "sp,recompute,vpp")
    argv = _argv(selective, _config(selective, tmp_path))
    plan = json.loads(_run(capsys, *argv[: argv.index("--search")], "--json"))
    [candidate] = [
        c
        for c in result["layouts"]
        if c.get("recompute_granularity") == "selective"
        and c["sequence_parallel"]
        and c["num_layers_per_virtual_pipeline_stage"] == 1
        and (c["pipe_parallel_size"], c["micro_batch"]) == (35, 1)
    ]
    assert candidate["step_s"] == pytest.approx(plan["throughput"]["predicted"]["step_s"], rel=1e-9)
    assert candidate["memory_bytes"] == max(r["total"] for r in plan["memory"]["per_rank"])
    ours = result["layouts"][result["configured_rank"] - 1]
    assert candidate["tokens_per_s"] > 1.25 * ours["tokens_per_s"]  # Table 5: 49.05 s -> 37.83 s


def test_context_parallel_sizes_and_the_plan_only_mark(capsys: pytest.CaptureFixture[str]) -> None:
    """``cp`` tries 1, 2, 4, 8 where they divide the GPUs and half the sequence; the table marks the layouts neox-forge
    cannot run with '+' and says so."""
    result = json.loads(_run(capsys, *TINY, "--search", "--search-vary", "cp,recompute", "--json", "--top", "1000"))
    sizes = {c["context_parallel_size"] for c in result["layouts"]}
    assert sizes <= {1, 2, 4, 8} and {1, 2} <= sizes
    for c in result["layouts"]:  # the context-parallel ranks come out of the 8 GPUs
        stages = max(c["pipe_parallel_size"], 1)
        assert c["tensor_parallel"] * stages * c["data_parallel"] * c["context_parallel_size"] == 8
    table = _run(capsys, *TINY, "--search", "--search-vary", "cp,recompute", "--top", "1000")
    assert "varied (--search-vary recompute,cp): recomputation" in table
    assert " x CP 2 x " in table and " +" in table and "+ planned only: neox-forge cannot run" in table


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--search", "--search-vary", "spp"], "--search-vary 'spp': a comma-separated list of sp, recompute, vpp, cp"),
        (["--search", "--search-vary", ","], "--search-vary ',': a comma-separated list of sp, recompute, vpp, cp"),
        (
            ["--search", "--search-vary", "recompute", "--search-fix", "ckpt"],
            "--search-vary recompute varies checkpointing too: drop ckpt from --search-fix",
        ),
        (["--search-vary", "sp"], "--search-vary: only with --search"),
    ],
)
def test_bad_search_vary_is_one_line_exit_2(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert deepy.main(["--plan", "train.py", *TINY, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_varying_knobs_a_run_did_not_use_explains_the_faster_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 175B full-recomputation run (no SP, no selective) searched with both varied: selective + SP layouts rank
    first, the run's own below the top 5, and every layout above it is explained term by term."""
    run = next(r for r in KORTHIKANTI if r.name == "Korthikanti 175B full")
    result = _search(capsys, run, tmp_path, "tp,zero", "sp,recompute,vpp")
    best = result["layouts"][0]
    assert best.get("recompute_granularity") == "selective" and best["sequence_parallel"]
    rank = result["configured_rank"]
    assert rank > 5 and [e["rank"] for e in result["above_configured"]] == list(range(1, rank))
    assert all(e["step_s_delta"] < 0 for e in result["above_configured"])
