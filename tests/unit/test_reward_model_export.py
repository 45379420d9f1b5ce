"""A reward model (``rm_linear`` head) exports as HF ``*ForSequenceClassification`` with the same scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from megatron.checkpoint.hf_io import export_hf
from megatron.model import build_sequential_model
from megatron.model.hf_mapping import hf_config_to_neox
from megatron.post_training.reward_head import with_reward_head

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
CASES = {
    "neox": transformers.GPTNeoXConfig(**COMMON, intermediate_size=128, rotary_pct=1.0, tie_word_embeddings=True),
    "llama": transformers.LlamaConfig(**COMMON, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reward_model_scores_equal_hf_sequence_classification(name: str, tmp_path: Path) -> None:
    cfg, arch = hf_config_to_neox(CASES[name])
    torch.manual_seed(0)
    ours = with_reward_head(build_sequential_model(cfg), cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.1)
    sd = ours.state_dict()
    assert f"sequential.{cfg.num_layers + 4}.rm_linear.weight" in sd
    export_hf(sd, cfg, tmp_path / "hf", architecture=arch, precision="fp32")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "hf")).eval()
    expected_cls = {"neox": "GPTNeoXForSequenceClassification", "llama": "LlamaForSequenceClassification"}[name]
    assert type(hf).__name__ == expected_cls and hf.config.num_labels == 1
    tokens = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        score_ours = ours(tokens)[0, -1, 0]
        score_hf = hf(tokens).logits[0, 0]
    assert score_hf.item() == pytest.approx(score_ours.item(), abs=1e-5)
