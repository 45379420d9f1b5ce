"""gMLP / aMLP blocks against GPT-NeoX's own ``GMLPBlock`` (``tests/fixtures/gpt-neox/gmlp_block.json``, see its
README): the same weights, loaded by GPT-NeoX's parameter names, give GPT-NeoX's output and input gradient, at
TP 1 and (rank by rank, the partial sums added as the row-parallel reduction does) at TP 2; and our block's tensor
names and shapes are GPT-NeoX's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron import mpu
from megatron.model import GPTModelConfig, build_sequential_model
from megatron.model.activations import gelu_tanh
from megatron.model.gmlp import GMLPBlock

FIXTURE = json.loads((Path(__file__).resolve().parent.parent / "fixtures/gpt-neox/gmlp_block.json").read_text())
CASES = FIXTURE["cases"]


def config(case: dict[str, Any], **more: Any) -> GPTModelConfig:
    """A one-layer model config with the case's block settings."""
    values: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=case["hidden_size"],
        num_attention_heads=2,
        padded_vocab_size=16,
        max_position_embeddings=case["seq_length"],
        gmlp_seq_length=case["seq_length"],
        gmlp_attn_dim=case["gmlp_attn_dim"],
        attention_config=[case["layer_type"]],
        norm=case["norm"],
        layernorm_epsilon=case["layernorm_epsilon"],
        rms_norm_epsilon=case["rms_norm_epsilon"],
        activation=case["activation"],
        pos_emb="none",
    )
    values.update(more)
    return GPTModelConfig(**values)


def load(block: GMLPBlock, weights: dict[str, list]) -> None:
    """Every tensor of the block by GPT-NeoX's name; the two sets of names must be equal."""
    state = {name: torch.tensor(value) for name, value in weights.items()}
    assert sorted(block.state_dict()) == sorted(state)
    block.load_state_dict(state)


def close(got: torch.Tensor, want: list) -> None:
    """Equal up to float32 rounding of different op orders (values reach ~20: 1e-5 of the largest)."""
    expected = torch.tensor(want)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def run_block(case: dict[str, Any], rank_weights: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, grad of x)`` of one (TP-rank) block on the case's inputs."""
    block = GMLPBlock(config(case), 0, 2)
    load(block, rank_weights)
    x = torch.tensor(case["x"], requires_grad=True)
    mask = torch.tensor(case["attention_mask"])
    out, _, mask_out = block((x, None, mask))
    assert mask_out is mask
    (out * torch.tensor(case["output_grad"])).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


@pytest.mark.parametrize("case", [c for c in CASES if c["tp"] == 1], ids=lambda c: c["name"])
def test_block_matches_gpt_neox(case: dict[str, Any]) -> None:
    out, grad = run_block(case, case["rank_weights"][0])
    close(out, case["output"])
    close(grad, case["x_grad"])


def test_unused_biases_and_causal_mixing() -> None:
    """GPT-NeoX adds neither linear's bias and mixes token i only with tokens <= i: changing the biases or a later
    token's input leaves the earlier outputs exactly as they were."""
    case = next(c for c in CASES if c["name"] == "amlp")
    block = GMLPBlock(config(case), 0, 2)
    load(block, case["rank_weights"][0])
    x = torch.tensor(case["x"])
    with torch.no_grad():
        before = block((x, None, None))[0]
        block.input_linear.bias.fill_(3.0)
        block.output_linear.bias.fill_(-2.0)
        x2 = x.clone()
        x2[4:] += 1.0
        after = block((x2, None, None))[0]
    assert torch.equal(after[:4], before[:4])
    assert not torch.equal(after[4:], before[4:])
    # the causal mask of the fixture is what None means
    close(before, case["output"])


@pytest.mark.parametrize("case", [c for c in CASES if c["tp"] == 2], ids=lambda c: c["name"])
def test_block_matches_gpt_neox_at_tp2_rank_by_rank(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's block built as TP rank r of 2 (its shapes), run on its own weights; the sum of the ranks' partial
    outputs is GPT-NeoX's TP=2 output (tests/distributed/test_gmlp_tp.py runs the same on 2 real ranks)."""
    outs, grads = [], []
    for rank in range(2):
        monkeypatch.setattr(mpu, "get_model_parallel_world_size", lambda: 2)
        monkeypatch.setattr(mpu, "get_model_parallel_rank", lambda r=rank: r)
        monkeypatch.setattr(mpu, "reduce_from_model_parallel_region", lambda t: t)  # the partial sum
        monkeypatch.setattr("megatron.mpu.layers.get_model_parallel_world_size", lambda: 2)
        monkeypatch.setattr("megatron.mpu.layers.get_model_parallel_rank", lambda r=rank: r)
        out, grad = run_block(case, case["rank_weights"][rank])
        outs.append(out)
        grads.append(grad)
    close(outs[0] + outs[1], case["output"])
    close(grads[0] + grads[1], case["x_grad"])


def test_gpt_neox_needs_batch_equal_to_sequence_and_we_do_not() -> None:
    """GPT-NeoX's gating unit takes the batch size for the token count (``x.shape[1]`` of ``[s, b, d]``) and fails
    unless they are equal (the fixture's cases have b == s, where it computes the sequence mixing meant); ours takes
    the sequence length: a batch of 2 rows gives each row what a batch of that row alone gives."""
    assert FIXTURE["batch_not_seq_error"].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    case = next(c for c in CASES if c["name"] == "amlp")
    block = GMLPBlock(config(case), 0, 2)
    load(block, case["rank_weights"][0])
    x = torch.tensor(case["x"])[:, :2]  # [6 tokens, 2 rows, h]
    with torch.no_grad():
        both = block((x, None, None))[0]
        one = block((x[:, 1:], None, None))[0]
    torch.testing.assert_close(both[:, 1:], one)
    close(both, torch.tensor(case["output"])[:, :2].tolist())


def test_model_layer_files_hold_gpt_neoxs_names() -> None:
    """In a model, a gMLP layer is spec 2 + i with GPT-NeoX's names and shapes (``sequential.{2+i}.sgu.proj.weight``, ...),
    mixed with attention layers per ``attention_config``; the ``sgu.proj`` spans ``seq_length``."""
    case = next(c for c in CASES if c["name"] == "amlp")
    # ff = 4h whatever the MLP width keys say (GPT-NeoX's GMLPBlock ignores them)
    cfg = config(case, num_layers=3, attention_config=["gmlp", "global", "amlp"], intermediate_size=48)
    names = {k: tuple(v.shape) for k, v in build_sequential_model(cfg).state_dict().items()}
    amlp = {k.removeprefix("sequential.4."): v for k, v in names.items() if k.startswith("sequential.4.")}
    want = {k: tuple(torch.tensor(v).shape) for k, v in case["rank_weights"][0].items()}
    assert amlp == want
    gmlp = {k.removeprefix("sequential.2.") for k in names if k.startswith("sequential.2.")}
    assert gmlp == {k for k in want if ".attn." not in k}
    assert "sequential.3.attention.query_key_value.weight" in names
    assert names["sequential.2.sgu.proj.weight"] == (case["seq_length"], case["seq_length"])


def test_fresh_block_is_gpt_neoxs_initial_gating() -> None:
    """GPT-NeoX starts ``sgu.proj`` at weight 0, bias 1 (the gate is 1: the block starts as an MLP)."""
    case = next(c for c in CASES if c["name"] == "gmlp")
    block = GMLPBlock(config(case), 0, 2)
    assert torch.count_nonzero(block.sgu.proj.weight) == 0
    assert torch.equal(block.sgu.proj.bias, torch.ones(case["seq_length"]))
    assert torch.count_nonzero(block.input_linear.bias) == 0 and torch.count_nonzero(block.output_linear.bias) == 0


def test_bias_gelu_fusion_is_the_tanh_gelu_where_gpt_neox_fails() -> None:
    """GPT-NeoX's gMLP calls the fused bias-GELU (which takes ``(x, bias)``) with ``x`` alone and fails; ours applies
    what ``bias_gelu_fusion`` means everywhere else, the tanh-approximate GELU."""
    assert FIXTURE["bias_gelu_fusion_error"].startswith("TypeError: GeLUFunction.forward() missing 1 required")
    case = next(c for c in CASES if c["name"] == "gmlp")
    assert GMLPBlock(config(case, bias_gelu_fusion=True), 0, 2).activation is gelu_tanh
    assert GMLPBlock(config(case), 0, 2).activation is torch.nn.functional.gelu


def test_no_dropout_in_the_block() -> None:
    """GPT-NeoX's block has no dropout: training mode with both dropout keys set gives the same output."""
    case = next(c for c in CASES if c["name"] == "amlp_documents")
    block = GMLPBlock(config(case, hidden_dropout=0.5, attention_dropout=0.5), 0, 2)
    load(block, case["rank_weights"][0])
    block.train()
    with torch.no_grad():
        out = block((torch.tensor(case["x"]), None, torch.tensor(case["attention_mask"])))[0]
    close(out, case["output"])
