"""``configs/125M-dmoe.yml`` (GPT-NeoX's 125M-dmoe: 8 experts, Sinkhorn, pipe engine, bf16, ZeRO-1, activation
checkpointing) trains on the CPU with falling loss when only its size, data and iterations shrink."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.fns_train import make_tiny_data, run_pretrain_each
from tests.e2e.shrink import load_raw, shrink
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def test_dmoe_config_trains_with_falling_loss(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    raw = {**load_raw([REPO / "configs" / "125M-dmoe.yml"]), "tokenizer_type": "HFTokenizer"}
    tok = data["vocab_file"]
    files = {"data_path": data["data_path"], "hf_tokenizer": tok, "spm_model": tok, "gpt2_vocab": tok}
    cfg, world = shrink(raw, files, tmp_path)
    assert cfg["moe_num_experts"] == 8 and cfg["pipe_parallel_size"] == 1 and cfg["precision"] == "bfloat16"
    cfg.update(train_iters=12, eval_interval=12, train_micro_batch_size_per_gpu=4)
    [out] = run_distributed(run_pretrain_each, world, [cfg], timeout=600)[0]
    assert not isinstance(out, str), out
    losses, skipped = out
    assert len(losses) == 12 and skipped == 0
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
