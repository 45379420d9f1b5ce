"""Parity matrix: every (tp, pp, dp) layout trains the tiny GPT exactly like one process.

For each layout, one ``run_distributed`` call trains all variants of ``fns_parallel.VARIANTS`` for 5 steps on
fixed data and gathers the full weights in GPT-NeoX names. They must equal the (1,1,1) run: initial weights bit
for bit (layout-invariant initialisation), the 5 losses, the eval loss and the final weights to <= 1e-5 in fp32
(bf16: within bf16 rounding). Variants: tied/untied embeddings, ZeRO-1/ZeRO-3 (ZeRO-1 under a pipeline, where
DeepSpeed refuses 2/3), activation checkpointing (every layer; 2 layers per chunk with partitioned, contiguous,
CPU and synchronised checkpoints), sequence parallelism, bf16, and the single-stage pipe engine. Under every
pipeline, each step's loss as the training step decided on it equals what ``train_batch`` returns, bit for bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.distributed import fns_parallel as fp
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-5
# bf16/fp16: one bf16 ulp at 1.0 is 7.8e-3 (fp16: 9.8e-4), and summation order differs between layouts.
HALF_LOSS_TOL, HALF_WEIGHT_TOL = 1e-2, 2e-2
LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 4, 1), (4, 1, 1)]
PARTITION_METHODS = ["type:transformerlayer|mlp", "type:transformer|mlp", "uniform", "parameters"]


def _variants(pp: int) -> list[str]:
    """Every variant; the single-stage pipe engine only where the layout has one stage."""
    return [name for name, spec in fp.VARIANTS.items() if pp == 1 or not spec.get("pipe1")]


@pytest.fixture(scope="module")
def reference() -> dict:
    ref = run_distributed(fp.run_layout, 1, 1, 1, _variants(1), timeout=300)[0]
    for name, result in ref.items():
        if name in ("layout", "coord"):
            continue
        losses = result["losses"]
        assert len(losses) == fp.STEPS and all(np.isfinite(losses)), (name, losses)
        assert losses[-1] < losses[0] - 0.02, f"{name}: the reference does not learn: {losses}"
        assert min(result["grad_norms"]) > 1.0, f"{name}: gradient clipping is not active"
        assert result["zero"] == fp.VARIANTS[name]["zero"], name
        assert result["engine"] == ("PipelineEngine" if fp.VARIANTS[name].get("pipe1") else "DeepSpeedEngine")
    # pipe_parallel_size: 1 (single-stage pipe engine) computes what the sequential model computes.
    seq, pipe1 = ref["tied-z1"], ref["tied-z1-pipe1"]
    assert pipe1["losses"] == pytest.approx(seq["losses"], abs=TOL)
    assert fp.max_abs_diff(pipe1["init"], seq["init"]) == 0.0
    assert fp.max_abs_diff(pipe1["final"], seq["final"]) <= TOL
    return ref


def _check_variant(name: str, got: dict, ref: dict, layout: tuple[int, int, int]) -> list[str]:
    problems = []
    half = fp.VARIANTS[name].get("bf16") or fp.VARIANTS[name].get("fp16")
    loss_tol, weight_tol = (HALF_LOSS_TOL, HALF_WEIGHT_TOL) if half else (TOL, TOL)
    pp = layout[1]
    pipe = pp > 1 or fp.VARIANTS[name].get("pipe1")
    want_zero = 1 if pipe and fp.VARIANTS[name]["zero"] >= 2 else fp.VARIANTS[name]["zero"]
    if got["zero"] != want_zero:
        problems.append(f"{name}: ZeRO stage {got['zero']} != {want_zero}")
    if got["engine"] != ("PipelineEngine" if pipe else "DeepSpeedEngine"):
        problems.append(f"{name}: engine {got['engine']}")
    init_diff = fp.max_abs_diff(got["init"], ref["init"])
    if init_diff != 0.0:
        problems.append(f"{name}: initial weights differ by {init_diff} (layout-invariant init broken)")
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    if loss_diff > loss_tol:
        problems.append(f"{name}: losses {got['losses']} vs {ref['losses']} (max diff {loss_diff:.2e})")
    # Gradient norms before clipping (clipping at 1.0 is active): each TP shard and each stage counted once.
    norm_tol = 1e-2 if half else 1e-6
    if got["grad_norms"] != pytest.approx(ref["grad_norms"], rel=norm_tol):
        problems.append(f"{name}: gradient norms {got['grad_norms']} vs {ref['grad_norms']}")
    if abs(got["eval"] - ref["eval"]) > loss_tol:
        problems.append(f"{name}: eval loss {got['eval']} vs {ref['eval']}")
    final_diff = fp.max_abs_diff(got["final"], ref["final"])
    if final_diff > weight_tol:
        worst = max(ref["final"], key=lambda k: float(np.max(np.abs(got["final"][k] - ref["final"][k]))))
        problems.append(f"{name}: final weights differ by {final_diff:.2e} (worst: {worst})")
    return problems


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "tp{}-pp{}-dp{}".format(*lay))
def test_layout_matches_one_process(reference: dict, layout: tuple[int, int, int], tmp_path) -> None:
    tp, pp, dp = layout
    methods = PARTITION_METHODS if pp == 4 else []
    resume_dir = str(tmp_path / "ckpt")
    results = run_distributed(
        fp.run_layout, tp * pp * dp, tp, pp, _variants(pp), fp.STEPS, methods, resume_dir, timeout=300
    )
    assert results[0]["layout"] == layout
    # rank = pipe·(dp·tp) + data·tp + model
    coords = [r["coord"] for r in results]
    assert coords == [(p, d, m) for p in range(pp) for d in range(dp) for m in range(tp)]
    problems = []
    for name in _variants(pp):
        problems += _check_variant(name, results[0][name], reference[name], layout)
        # Every rank reports the same (global-batch) losses.
        for rank, result in enumerate(results):
            if result[name]["losses"] != pytest.approx(results[0][name]["losses"], abs=1e-7):
                problems.append(f"{name}: rank {rank} losses {result[name]['losses']}")
            if rank > 0 and result[name]["final"] is not None:
                problems.append(f"{name}: rank {rank} returned weights (only rank 0 should)")
    # Save at step 3 and resume in a fresh engine (other seed): exact continuation in this layout.
    for rank, result in enumerate(results):
        resume = result["resume"]
        if resume["resumed"] != resume["uninterrupted"]:
            problems.append(f"rank {rank}: resumed losses {resume['resumed']} != {resume['uninterrupted']}")
    resume = results[0]["resume"]
    if resume["zero"] != (1 if pp > 1 else 3):
        problems.append(f"resume ran with ZeRO {resume['zero']}")
    if fp.max_abs_diff(resume["full_a"], resume["full_b"]) != 0.0:
        problems.append("resumed weights differ from the uninterrupted run")
    assert not problems, "\n".join(problems)
    if methods:
        parts = results[0]["partitions"]
        n_specs = fp.LAYERS + 5
        # Specs: 0 embed · 1 fn · 2..L+1 layers · L+2 fn · L+3 norm · L+4 head.
        # As in GPT-NeoX, the regex also matches the functions _pre/_post_transformer_block: weights [0,1,1,1,1,0,0].
        assert parts["type:transformer|mlp"] == [0, 2, 3, 4, n_specs]
        # The default weighs the layers only; with fewer layers than stages it runs GPT-NeoX's split instead (a
        # stage holding only the norm or the head would receive a tensor where DeepSpeed's engine expects a tuple).
        assert parts["type:transformerlayer|mlp"] == parts["type:transformer|mlp"]
        assert parts["uniform"] == [0, 2, 4, 6, n_specs]
        # Parameter counts [4096, 0, 12704, 12704, 0, 64, 4096 (tied head)]: one transformer layer per middle stage.
        assert parts["parameters"] == [0, 2, 3, 5, n_specs]
        for method, bounds in parts.items():
            assert bounds[0] == 0 and bounds[-1] == n_specs, (method, bounds)
            assert all(a < b for a, b in itertools.pairwise(bounds)), f"{method}: an empty stage {bounds}"
