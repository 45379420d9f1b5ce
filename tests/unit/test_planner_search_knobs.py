"""``--search`` with the layout knobs of ``megatron/planner/knobs.py`` held at their configured values: the configured
layout is predicted and sized exactly as ``--plan`` predicts and sizes it, every candidate keeps the knobs (context
parallelism's ranks out of the GPUs, selective recomputation where it does not checkpoint, the interleaved schedule
where its chunk divides the layers per stage), and a config whose knobs conflict is refused in one line."""

from __future__ import annotations

import json

import pytest

import deepy

# configs/20B.yml with 48 layers (stages split into chunks), 32 GPUs, 80 GB: many layouts fit
B20 = ["configs/20B.yml", "--vocab-size", "50277", "--num_layers", "48", "--gpus", "32", "--gpu-type", "A100-80GB"]
KNOBS = {
    "selective": [
        "--checkpoint_activations",
        "false",
        "--recompute_granularity",
        "selective",
        "--sequence_parallel",
        "true",
    ],
    "interleaved": ["--num_layers_per_virtual_pipeline_stage", "3"],  # 12 layers per stage at PP 4: 4 chunks
    "context": ["--context_parallel_size", "2"],
}


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert deepy.main(["--plan", "train.py", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("knob", list(KNOBS))
def test_search_predicts_the_configured_layout_as_plan_does(knob: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*B20, *KNOBS[knob]]
    plan = _json(capsys, *argv)
    found = _json(capsys, *argv, "--search", "--top", "100000")
    rank = found["configured_rank"]
    assert rank is not None, found["configured_rejected_reason"]
    ours = found["layouts"][rank - 1]
    predicted = plan["throughput"]["predicted"]
    assert ours["step_s"] == pytest.approx(predicted["step_s"], rel=1e-12)
    assert ours["tflops_per_gpu"] == pytest.approx(predicted["tflops_per_gpu"], rel=1e-12)
    assert ours["memory_bytes"] == max(r["total"] for r in plan["memory"]["per_rank"])
    cp = 2 if knob == "context" else 1
    assert all(c["tensor_parallel"] * max(c["pipe_parallel_size"], 1) * c["data_parallel"] * cp == 32 for c in
               found["layouts"] + found["rejected_above_best"])  # fmt: skip
    if knob == "selective":  # checkpointing candidates recompute fully; the others selectively
        for c in found["layouts"]:
            assert c.get("recompute_granularity") == (None if c["checkpoint_activations"] else "selective")
    # the plan of the same layout without the knob differs: the knob is modelled, not dropped
    plain = _json(capsys, *B20, *(KNOBS[knob][:2] + KNOBS[knob][4:] if knob == "selective" else []))
    assert plain["throughput"]["predicted"]["step_s"] != pytest.approx(ours["step_s"], rel=1e-6)


def test_interleaved_chunk_that_does_not_divide_a_stage_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    found = _json(capsys, *B20, *KNOBS["interleaved"], "--search", "--top", "100000")
    assert found["rejected_by_reason"].get("layers", 0) > 0  # e.g. 16 stages: 3 layers each, fine; 8: 6; 32: no
    stages = {max(c["pipe_parallel_size"], 1) for c in found["layouts"]}
    assert stages and all(s == 1 or (48 // s) % 3 == 0 for s in stages)
    assert any(s > 1 for s in stages)  # interleaved pipelines are among the layouts


def test_conflicting_knobs_are_refused_by_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*B20, "--recompute_granularity", "selective", "--checkpoint_activations", "true", "--search"]
    assert deepy.main(["--plan", "train.py", *argv]) == 2
    err = capsys.readouterr().err
    assert "recompute_granularity: selective cannot be combined with checkpoint_activations: true" in err
    assert err.count("\n") == 1
