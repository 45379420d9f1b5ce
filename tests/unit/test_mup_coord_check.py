"""The muP coordinate check (``megatron/training/coord_check.py``), measured on tiny models: under muP every module's
activation size stays O(1) across widths 64, 128, 256, 512 after a few Adam steps; in standard parametrisation the
output logits and the hidden states grow with width."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from megatron.model import GPTModelConfig, get_ltor_masks_and_position_ids
from megatron.model.mup import MupConfig
from megatron.training.coord_check import coord_data, gpt_neox_widths, run_coord_check

V = 64
WIDTHS = [64, 128, 256, 512]


def tiny(hidden: int = 64, heads: int = 4) -> GPTModelConfig:
    return GPTModelConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=heads, padded_vocab_size=V, max_position_embeddings=64,
        pos_emb="rotary", init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip


def batch() -> tuple:
    text = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(tokens, 0)
    return (tokens, pos, mask), (labels, loss_mask)


def growth(records: list[dict], module: str, t: int) -> tuple[float, float]:
    """(max/min over widths, size at the widest / at the narrowest) of one module's output at step ``t``."""
    size = {r["width"]: r["l1"] for r in records if r["t"] == t and r["module"] == module}
    assert sorted(size) == WIDTHS, module
    return max(size.values()) / min(size.values()), size[512] / size[64]


@pytest.fixture(scope="module")
def records() -> dict[bool, list[dict]]:
    return {
        use_mup: coord_data(tiny(), MupConfig(), WIDTHS, batch(), use_mup=use_mup, optimizer="adam", lr=1e-2)
        for use_mup in (True, False)
    }


@pytest.mark.slow  # the width-512 models: ~40 s for both parametrisations on 2 busy cores
def test_mup_keeps_every_activation_o1_across_widths(records: dict[bool, list[dict]]) -> None:
    up = records[True]
    modules = {r["module"] for r in up}
    logits = "sequential.6"  # the output layer (tied: the embedding's logits helper)
    assert logits in modules and "sequential.3:out[0]" in modules
    assert {r["t"] for r in up} == {1, 2, 3, 4}
    for module in modules:
        spread, _ = growth(up, module, 4)
        assert spread < 2.5, (module, spread)  # measured: at most 1.91 (64..512)
    assert growth(up, logits, 4)[0] < 1.6  # measured 1.34


@pytest.mark.slow
def test_standard_parametrisation_grows_with_width(records: dict[bool, list[dict]]) -> None:
    sp = records[False]
    assert growth(sp, "sequential.6", 4)[1] > 2.5  # the logits: measured 3.8x from width 64 to 512
    assert growth(sp, "sequential.3:out[0]", 4)[1] > 10  # the last layer's output: measured 42x


def test_run_coord_check_writes_gpt_neoxs_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-NeoX's widths (heads · 2^2..2^8) and files: coord_check_{up,sp}.{rank}.jpg, with the data as .csv."""
    assert gpt_neox_widths(12) == [48, 96, 192, 384, 768, 1536, 3072]
    monkeypatch.setattr("megatron.training.coord_check.gpt_neox_widths", lambda heads: [8, 16])
    written = run_coord_check(tiny(hidden=8, heads=1), MupConfig(), batch(), 1, tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["coord_check_sp.1.csv", "coord_check_sp.1.jpg", "coord_check_up.1.csv", "coord_check_up.1.jpg"]
    assert (tmp_path / "coord_check_up.1.jpg").read_bytes()[:2] == b"\xff\xd8"  # a JPEG
    with (tmp_path / "coord_check_up.1.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["width"] for r in rows} == {"8", "16"} and {r["t"] for r in rows} == {"1", "2", "3", "4"}
    assert all(float(r["l1"]) >= 0 for r in rows) and any(
        float(r["l1"]) > 0 for r in rows if r["module"] == "sequential.6"
    )
