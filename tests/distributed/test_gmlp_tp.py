"""gMLP / aMLP at tensor parallel size 2 on 2 gloo ranks equal GPT-NeoX's TP-2 block computed in one process
(``tests/fixtures/gpt-neox/gmlp_block.json``: GPT-NeoX's ``GMLPBlock`` built as each TP rank, its row-parallel
partial sums added). GPT-NeoX's gMLP is not TP-invariant (each rank normalises and mixes its own slice of the gate,
and has its own tiny attention), so the TP-1 function it must equal is that one-process TP-2 computation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.distributed import fns_gmlp
from tests.distributed.fns_train import make_tiny_data, run_pretrain_many, tiny_config
from tests.harness import run_distributed
from tests.unit.test_gmlp_gpt_neox_golden import CASES, close

pytestmark = pytest.mark.distributed

TP2 = [c for c in CASES if c["tp"] == 2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[dict, list[dict]]], Path, list[float]]:
    """One start of 2 ranks: GPT-NeoX's TP-2 cases, then a model mixing amlp, global attention and gmlp layers
    trained at TP 2 (sequential; saved, then resumed) and at PP 2 (pipeline engine, gMLP specs on both stages), both
    recomputing layers in backward (activation checkpointing: GPT-NeoX's checkpointable ``GMLPBlock``); and the PP-2
    model's single-process (sequential) losses."""
    root = tmp_path_factory.mktemp("gmlp_tp")
    data = make_tiny_data(root / "data")
    mixed = {"num_layers": 3, "attention_config": [[["amlp", "global", "gmlp"], 1]], "gmlp_attn_dim": 8}
    save = root / "tp2"
    recompute = {"checkpoint_activations": True, "checkpoint_num_layers": 2}  # chunks [amlp, global], [gmlp]
    tp2 = tiny_config(data, world=2, model_parallel_size=2, train_iters=2, lr_decay_iters=3, save=str(save),
                      checkpoint_factor=2, eval_interval=2, **mixed, **recompute)  # fmt: skip
    resumed = {**tp2, "train_iters": 3, "eval_interval": 3, "load": str(save)}
    pp2 = tiny_config(data, world=2, pipe_parallel_size=2, train_iters=2, eval_interval=2, **mixed, **recompute)
    one = {**pp2, "pipe_parallel_size": 0, "global_num_gpus": 1}
    reference = run_distributed(run_pretrain_many, 1, [one], timeout=400)[0][0]["train_losses"]
    return run_distributed(fns_gmlp.run_cases_and_training, 2, [tp2, resumed, pp2], timeout=400), save, reference


@pytest.fixture(scope="module")
def ranks(run) -> list[dict]:
    return [cases for cases, _ in run[0]]


@pytest.mark.parametrize("case", TP2, ids=lambda c: c["name"])
def test_two_ranks_give_gpt_neoxs_tp2_block(case: dict, ranks: list[dict]) -> None:
    import torch

    for result in ranks:
        got = result[case["name"]]
        close(torch.from_numpy(got["output"]), case["output"])  # every rank holds the reduced output
        close(torch.from_numpy(got["x_grad"]), case["x_grad"])  # and the full input gradient


@pytest.mark.parametrize("case", TP2, ids=lambda c: c["name"])
def test_gradient_norm_counts_each_ranks_gating_unit(case: dict, ranks: list[dict]) -> None:
    """The sgu parameters are each rank's own (not replicas): the norm sums both ranks' squares; replicated ones
    (the block's input norm) count once; the two unused biases have no gradient."""
    r0, r1 = (r[case["name"]] for r in ranks)
    assert r0["unused"] == r1["unused"] == ["input_linear.bias", "output_linear.bias"]
    want = sum(v for n, v in r0["squares"].items()) + sum(
        v for n, v in r1["squares"].items() if not n.startswith("norm.")
    )
    assert r0["squares"]["norm.weight"] == pytest.approx(r1["squares"]["norm.weight"], rel=1e-6)
    assert r0["grad_norm"] == r1["grad_norm"] == pytest.approx(math.sqrt(want), rel=1e-5)
    assert not np.isclose(r0["squares"]["sgu.proj.weight"], r1["squares"]["sgu.proj.weight"])


@pytest.mark.parametrize("case", TP2, ids=lambda c: c["name"])
def test_both_ranks_flops_are_the_planners_tp2_count(case: dict, ranks: list[dict]) -> None:
    """The two ranks' measured matrix-multiply FLOPs (FlopCounterMode) sum to the planner's count of a TP-2 block
    (``megatron/planner/layer_flops.py``: aMLP's tiny attention is one per rank), backward twice the forward."""
    from megatron.planner.layer_flops import gmlp_layer_forward

    s, b, h = len(case["x"]), len(case["x"][0]), case["hidden_size"]
    attn = case["gmlp_attn_dim"] if case["layer_type"] == "amlp" else 0
    forward = sum(r[case["name"]]["flops"][0] for r in ranks)
    backward = sum(r[case["name"]]["flops"][1] for r in ranks)
    assert forward == b * gmlp_layer_forward(s, h, tp=2, attn_dim=attn)
    assert backward == 2 * forward


def test_tp2_and_pp2_training_saves_and_resumes(run) -> None:
    """Both layouts train (the PP-2 one with the single-process losses); the TP-2 run resumes from its own checkpoint, whose per-rank gMLP tensors are GPT-NeoX's
    (``ff/tp`` = 128 features per rank, each rank its own gating unit)."""
    import torch

    results, save, reference = run
    pipe_losses = [pipe["train_losses"] for _, (_, _, pipe) in results if pipe["train_losses"]]
    assert pipe_losses and pipe_losses[0] == pytest.approx(reference, rel=1e-5)  # 2 stages = one process
    for _, (first, second, pipe) in results:
        assert first["iteration"] == 2 and len(first["train_losses"]) == 2
        assert second["start_iteration"] == 2 and len(second["train_losses"]) == 1
        assert len(pipe["train_losses"]) == 2
        assert all(math.isfinite(x) for x in first["train_losses"] + second["train_losses"] + pipe["train_losses"])
    from megatron.checkpoint.safe_load import safe_loading

    files = [save / "global_step2" / f"mp_rank_0{r}_model_states.pt" for r in (0, 1)]
    with safe_loading():  # DeepSpeed's own types in the file: the allow-list of weights_only loading
        modules = [torch.load(f, weights_only=True)["module"] for f in files]
    assert tuple(modules[1]["sequential.2.sgu.attn.proj_ffn.weight"].shape) == (128, 8)
    assert tuple(modules[1]["sequential.4.sgu.norm.weight"].shape) == (128,)
    assert not torch.equal(modules[0]["sequential.2.sgu.proj.weight"], modules[1]["sequential.2.sgu.proj.weight"])
