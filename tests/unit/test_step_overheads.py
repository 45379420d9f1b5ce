"""The training step's per-step work that changes no value: the causal mask checked once per forward instead of
once per layer, the rotary tables computed once per forward under autograd too, the non-finite check in one
``aminmax`` pass (benchmarks/README.md, "Where the time goes at Pythia-160M")."""

from __future__ import annotations

import ast

import torch

from megatron.model.gpt2_model import is_plain_causal
from megatron.model.positional_embeddings import RotaryEmbedding
from megatron.model.utils import get_ltor_masks_and_position_ids
from megatron.training.nonfinite import nonfinite_flag
from tests.harness import REPO_ROOT

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "reduce", "barrier", "gather", "scatter")


def test_only_the_exact_causal_mask_counts_as_plain_causal() -> None:
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9], [1, 2, 0, 3, 4, 5]])
    causal, _, _ = get_ltor_masks_and_position_ids(tokens, eod_token=0)
    assert is_plain_causal(causal, 6) and is_plain_causal(causal.float(), 6)
    reset, _, _ = get_ltor_masks_and_position_ids(tokens, eod_token=0, reset_attention_mask=True)
    window, _, _ = get_ltor_masks_and_position_ids(tokens, eod_token=0, sliding_window_width=2)
    assert not is_plain_causal(reset, 6) and not is_plain_causal(window, 6)
    assert not is_plain_causal(causal, 5) and not is_plain_causal(causal[0], 6)
    assert not is_plain_causal(~causal, 6)


def test_rotary_tables_are_shared_by_the_layers_under_autograd_and_recomputed_for_new_positions() -> None:
    layers = [RotaryEmbedding(16), RotaryEmbedding(16)]  # every layer has its own (equal) inv_freq buffer
    positions = torch.arange(8).expand(2, 8).clone()
    with torch.enable_grad():
        first = layers[0](positions, torch.float32)
        second = layers[1](positions, torch.float32)
        assert second[0] is first[0] and second[1] is first[1] and not first[0].requires_grad
        fresh = layers[0](positions.clone(), torch.float32)  # a new batch's positions: computed again, same values
        assert fresh[0] is not first[0] and torch.equal(fresh[0], first[0]) and torch.equal(fresh[1], first[1])
        positions.add_(1)  # changed in place: not reused
        moved = layers[0](positions, torch.float32)
        assert not torch.equal(moved[0], first[0])
    other = RotaryEmbedding(16, base=500.0)  # different inv_freq values: not reused
    assert not torch.equal(other(positions, torch.float32)[0], moved[0])


def test_nonfinite_flag_sees_nan_and_both_infinities_in_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ok = [torch.ones(3, dtype=dtype), torch.full((2, 2), -1000.0, dtype=dtype)]
        assert float(nonfinite_flag(ok, "cpu")) == 0.0
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = torch.ones(4, dtype=dtype)
            t[2] = bad
            assert float(nonfinite_flag([*ok, t], "cpu")) == 1.0


def test_the_step_decision_makes_one_reduction_and_one_host_read() -> None:
    """docs/training.md: ``StepGuard.decide`` packs losses, metrics, the non-finite and stop flags into one tensor,
    all-reduces it once and reads it back once (the run-time count of host reads: tests/e2e/test_step_host_reads.py)."""
    tree = ast.parse((REPO_ROOT / "megatron" / "training" / "nonfinite.py").read_text())
    (decide,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "decide"]
    calls = [ast.unparse(n.func) for n in ast.walk(decide) if isinstance(n, ast.Call)]
    collectives = [c for c in calls if c.startswith("mpu.") and c.split(".")[1].startswith(COLLECTIVES)]
    host_reads = [c for c in calls if c.rsplit(".", 1)[-1] in ("tolist", "item", "cpu", "numpy")]
    assert collectives == ["mpu.all_reduce_sum"], collectives
    assert len(host_reads) == 1 and host_reads[0].endswith(".tolist"), host_reads
