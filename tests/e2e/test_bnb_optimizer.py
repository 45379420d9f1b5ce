"""``use_bnb_optimizer``: ``configs/bnb_125M.yml`` with only its size shrunk trains on the CPU with bitsandbytes'
8-bit Adam (its CPU backend): the checkpoint holds Adam's moments as uint8 block-quantized tensors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.checkpoint.safe_load import safe_loading
from tests.distributed.fns_train import deepy_train, make_tiny_data
from tests.e2e.shrink import ITERS, load_raw, shrink

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
bnb = pytest.importorskip("bitsandbytes")


def test_bnb_125m_trains_with_8bit_adam_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_tiny_data(tmp_path / "data")
    raw = {**load_raw([REPO / "configs" / "bnb_125M.yml"]), "tokenizer_type": "HFTokenizer"}  # local_setup's part
    files = dict.fromkeys(("spm_model", "gpt2_vocab", "gpt2_merges"), "") | {**data, "hf_tokenizer": data["vocab_file"]}
    cfg, world = shrink(raw, files, tmp_path)
    assert cfg["use_bnb_optimizer"] is True and cfg["fp16"]["enabled"] is True  # every other key kept
    cfg.update(save=str(tmp_path / "ckpt"), checkpoint_factor=ITERS)
    monkeypatch.setenv("NEOX_FORGE_ALLOW_CPU_FP16", "1")
    out = deepy_train(cfg, tmp_path / "bnb_125M.yml", world)
    assert f"training finished at iteration {ITERS}" in out

    step = tmp_path / "ckpt" / f"global_step{ITERS}"
    with safe_loading():  # ZeRO-1 (fp16 with a pipeline): the optimizer state is in the ZeRO file
        state = torch.load(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=True)
    moments = list(_adam_states(state))
    assert moments, "no Adam state in the checkpoint"
    # the flat fp32 partition ZeRO steps is one tensor over 4096 elements: both moments 8-bit, block-quantized
    assert all(m["state1"].dtype == torch.uint8 and m["state2"].dtype == torch.uint8 for m in moments)
    assert all(m["absmax1"].dtype == torch.float32 and m["absmax1"].numel() > 1 for m in moments)


def _adam_states(obj: Any) -> Iterator[dict[str, Any]]:
    """Every per-parameter state of bitsandbytes' Adam in a checkpoint object (dicts holding ``state1``)."""
    if isinstance(obj, dict):
        if "state1" in obj:
            yield obj
        for value in obj.values():
            yield from _adam_states(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _adam_states(value)
