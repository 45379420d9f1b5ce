"""``sparsity_config`` and the sparse ``attention_config`` types at config time: what GPT-NeoX's DeepSpeed classes
would reject is one clear error naming the setting; settings no layer of the config reads are warned about; a
valid config builds a model whose sparse layers hold GPT-NeoX's layouts at ``seq_length``."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from megatron.model import GPTModelConfig
from megatron.model.sparse_attention import SparseAttention
from megatron.neox_arguments.sparse_layouts import gpt_neox_layout, layout_rng
from tests.unit.test_neox_args import build, problems

SPARSE = [[["sparse_fixed", "bigbird"], "all"]]


@pytest.mark.parametrize(
    ("sparsity", "attention", "message"),
    [
        ({"blok": 4}, SPARSE, "sparsity_config: unknown setting(s) blok; valid: block, different_layout_per_head"),
        ({"block": 0}, SPARSE, "sparsity_config.block=0 must be an integer >= 1"),
        ({"block": "16"}, SPARSE, "sparsity_config.block='16' must be an integer >= 1"),
        ({"num_random_blocks": -1}, SPARSE, "sparsity_config.num_random_blocks=-1 must be an integer >= 0"),
        ({"different_layout_per_head": 1}, SPARSE, "sparsity_config.different_layout_per_head=1 must be true or false"),
        ({"local_window_blocks": []}, SPARSE, "sparsity_config.local_window_blocks=[] must be a non-empty list"),
        ({"global_block_indices": [-1]}, SPARSE, "sparsity_config.global_block_indices=[-1] must be a list of"),
        ({"block": 24}, SPARSE, "seq_length=64 must be divisible by sparsity_config.block=24"),
        ({"block": 32}, [[["local"], 2]], "local layers: num_sliding_window_blocks=4 is larger than the 2 blocks"),
        ({"block": 8, "num_local_blocks": 3, "num_global_blocks": 2}, SPARSE, "num_local_blocks=3 must be divisible"),
        ({"block": 8, "num_different_global_patterns": 2}, SPARSE, "needs different_layout_per_head: true"),
        ({"block": 8, "num_random_blocks": 2}, SPARSE, "bigbird layers: num_random_blocks=2: block row 0"),
        (
            {"block": 8, "global_block_indices": [0, 2], "global_block_end_indices": [1]},
            [[["bslongformer"], 2]],
            "global_block_end_indices has 1 entries but global_block_indices has 2",
        ),
    ],
)
def test_bad_sparsity_settings_are_one_clear_error(sparsity: dict, attention: list, message: str) -> None:
    found = problems(sparsity_config=sparsity, attention_config=attention)
    assert len(found) == 1 and message in found[0], found


def test_settings_no_layer_reads_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        build(sparsity_config={"block": 8, "num_random_blocks": 2}, attention_config=[[["local", "global"], 1]])
        build(sparsity_config={"block": 8}, attention_config=[[["global"], 2]])
    text = caplog.text
    assert "sparsity_config.num_random_blocks is ignored: only sparse_variable/bigbird layers read it" in text
    assert "sparsity_config is ignored: no layer of attention_config is sparse" in text


def test_a_config_builds_gpt_neox_layouts_at_seq_length() -> None:
    """seq_length 64 < max_position_embeddings 128: the layouts are made at seq_length (GPT-NeoX's
    ``max_seq_length``): random blocks drawn over 16 blocks a row are not the corner of a 32-block layout."""
    sparsity = {"block": 4, "num_local_blocks": 3, "different_layout_per_head": True, "num_random_blocks": 1}
    args = build(
        sparsity_config=sparsity,
        attention_config=[[["sparse_fixed", "sparse_variable"], 1]],
        max_position_embeddings=128,
        seed=7,
    )
    args.update_value("padded_vocab_size", 128)
    cfg = GPTModelConfig.from_neox_args(args)
    assert cfg.sparse_layout_tokens == 64 and cfg.layer_types == ("sparse_fixed", "sparse_variable")
    for layer, kind in enumerate(cfg.layer_types):
        module = SparseAttention(kind, cfg.sparsity_config, 4, 64, cfg.seed, layer)
        want = gpt_neox_layout(kind, sparsity, 4, 64, layout_rng(7, layer))[1]
        assert torch.equal(module.layout, torch.tensor(want, dtype=torch.bool))
    at_64 = torch.tensor(gpt_neox_layout("sparse_variable", sparsity, 1, 64, random.Random(0))[1])
    at_128 = torch.tensor(gpt_neox_layout("sparse_variable", sparsity, 1, 128, random.Random(0))[1])
    assert not torch.equal(at_64.tril(), at_128[:, :16, :16].tril())


def test_layouts_of_more_than_4096_blocks_are_refused() -> None:
    found = problems(
        sparsity_config={"block": 1}, attention_config=SPARSE, seq_length=8192, max_position_embeddings=8192
    )
    assert any("gives 8192 blocks a row; at most 4096 are supported: use a larger block" in p for p in found), found
