"""Checkpoint tensor names and shapes against GPT-NeoX's own model (``tests/fixtures/gpt-neox/model_tensors.json``,
see its README): the Pythia shape, tied embeddings with learned positions, the Llama shape (SwiGLU, RMSNorm, no
biases), grouped-query attention, and MoE layers with a plain and each gated activation; and which initialiser each
tensor gets (``model_init_stats.json``: the mean and std of every tensor of GPT-NeoX's freshly built model)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.model import GPTModelConfig, build_sequential_model
from megatron.neox_arguments import LaunchEnv, NeoXArgs

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpt-neox"
FIXTURE = json.loads((FIXTURES / "model_tensors.json").read_text())
INIT_STATS = json.loads((FIXTURES / "model_init_stats.json").read_text())
NOT_OURS = ("global_num_gpus", "tokenizer_type", "use_cpu_initialization")


def _config(case: dict[str, Any], **more: Any) -> GPTModelConfig:
    values = {k: v for k, v in case["config"].items() if k not in NOT_OURS}
    args = NeoXArgs({**values, **more}, env=LaunchEnv(world_size=1, on_cpu=True))
    args.update_value("padded_vocab_size", case["padded_vocab_size"])
    return GPTModelConfig.from_neox_args(args)


def _ours(cfg: GPTModelConfig) -> dict[str, list[int]]:
    return {k.removeprefix("sequential."): list(v.shape) for k, v in build_sequential_model(cfg).state_dict().items()}


def _theirs(case: dict[str, Any]) -> dict[str, list[int]]:
    """GPT-NeoX's pipeline module keeps tied embeddings under ``tied_modules.embed.``; its checkpoint files and our
    sequential model hold them as layer 0."""
    return {k.replace("tied_modules.embed.", "0."): v for k, v in case["tensors"].items()}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["name"])
def test_tensor_names_and_shapes_match_gpt_neox(case: dict[str, Any]) -> None:
    assert _ours(_config(case)) == _theirs(case)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_experts_are_ours_on_request(activation: str) -> None:
    """``moe_gated_experts: true`` adds ``w3`` and narrows the experts to int(8h/3) rounded up to 256 (Mixtral's
    expert); GPT-NeoX builds w1/w2 at 4h whatever the activation."""
    case = next(c for c in FIXTURE["cases"] if c["name"] == f"moe_{activation}")
    ours, theirs = _ours(_config(case, moe_gated_experts=True)), _theirs(case)
    assert set(ours) - set(theirs) == {f"{i}.mlp.experts.mlp.w3" for i in (2, 3)}
    h, e = case["config"]["hidden_size"], case["config"]["moe_num_experts"]
    assert theirs["2.mlp.experts.mlp.w1"] == [e * 4 * h, h]
    assert ours["2.mlp.experts.mlp.w1"] == ours["2.mlp.experts.mlp.w3"] == [e * 256, h]


@pytest.mark.parametrize("case", INIT_STATS["cases"], ids=lambda c: c["name"])
def test_each_tensor_gets_gpt_neoxs_initialiser(case: dict[str, Any]) -> None:
    """Same std per tensor within sampling error (the draws differ: GPT-NeoX's RNG order is its own); norms and
    biases exactly as GPT-NeoX sets them."""
    torch.manual_seed(0)
    ours = {
        k.removeprefix("sequential."): v.float() for k, v in build_sequential_model(_config(case)).state_dict().items()
    }
    theirs = case["tensors"]
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():
        t = ours[name]
        assert list(t.shape) == want["shape"], name
        if want["std"] == 0.0:
            assert float(t.std()) == 0.0 and float(t.mean()) == want["mean"], name
            continue
        n = t.numel()
        assert float(t.std()) == pytest.approx(want["std"], rel=8 / math.sqrt(n)), name
        assert abs(float(t.mean()) - want["mean"]) <= 8 * want["std"] / math.sqrt(n), name
