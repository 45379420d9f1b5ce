"""muP through the real training path (``pretrain``): ``save_base_shapes`` writes one base shapes file per rank and
stops, as GPT-NeoX; a run with ``base_shapes_file`` reads them back and trains (at TP=2 and with the pipe engine)
with the losses of a single-process run; ``coord_check`` writes its data and plots and stops."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from megatron.model.mup import read_base_shapes
from tests.distributed.fns_train import make_tiny_data, run_pretrain_many, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

COMMON = {"train_iters": 4, "eval_interval": 100, "eval_iters": 1, "train_micro_batch_size_per_gpu": 2}


@pytest.mark.parametrize(("tp", "pp"), [(2, 0), (1, 2)])
def test_save_base_shapes_then_train_with_them(tmp_path: Path, tp: int, pp: int) -> None:
    data = make_tiny_data(tmp_path / "data")
    bsh = str(tmp_path / "shapes" / "model.bsh")
    layout = {"model_parallel_size": tp, "pipe_parallel_size": pp, **COMMON}
    mup = {"use_mup": True, "base_shapes_file": bsh, "mup_embedding_mult": 2.0, "mup_output_temp": 0.5}
    configs = [
        tiny_config(data, world=2, save_base_shapes=True, **mup, **layout),
        tiny_config(data, world=2, **mup, **layout),
        tiny_config(data, world=2, **layout),
    ]
    save, up, sp = zip(*run_distributed(run_pretrain_many, 2, configs), strict=True)
    # the single-process reference: its own base shapes (one rank: the whole vocabulary), the same batches
    one = {**mup, "base_shapes_file": str(tmp_path / "one" / "model.bsh"), **COMMON}
    ref = run_distributed(
        run_pretrain_many, 1, [tiny_config(data, save_base_shapes=True, **one), tiny_config(data, **one)]
    )[0][1]
    losses = next(r["train_losses"] for r in up if r["train_losses"])  # the last stage's (PP) or any rank's (TP)
    assert losses == pytest.approx(ref["train_losses"], rel=1e-4)
    assert [r["iteration"] for r in save] == [0, 0] and all(not r["train_losses"] for r in save)
    for rank in (0, 1):
        shapes = read_base_shapes(Path(f"{bsh}.{rank}"))
        embedding = [dims for name, dims in shapes.items() if name.endswith("word_embeddings.weight")]
        assert embedding == [[None, 64]]  # this rank's vocabulary shard is finite, hidden_size 64 a width
    assert up[0]["iteration"] == 4 and len(up[0]["train_losses"]) == 4
    assert all(loss == loss and loss < 20 for loss in up[0]["train_losses"])  # finite
    assert up[0]["train_losses"] != pytest.approx(sp[0]["train_losses"], rel=1e-3)  # muP changed the run


def test_coord_check_writes_its_plots_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_tiny_data(tmp_path / "data")
    bsh = str(tmp_path / "model.bsh")
    mup = {"use_mup": True, "base_shapes_file": bsh, "num_attention_heads": 1, "pos_emb": "learned", **COMMON}
    monkeypatch.chdir(tmp_path)  # GPT-NeoX writes the plots to the working directory
    configs = [tiny_config(data, save_base_shapes=True, **mup), tiny_config(data, coord_check=True, **mup)]
    _, check = run_distributed(run_pretrain_many, 1, configs)[0]
    assert check["iteration"] == 0 and not check["train_losses"]
    for tag in ("up", "sp"):
        assert (tmp_path / f"coord_check_{tag}.0.jpg").stat().st_size > 0
        with (tmp_path / f"coord_check_{tag}.0.csv").open(encoding="utf-8") as f:
            widths = {int(r["width"]) for r in csv.DictReader(f)}
        assert widths == {4, 8, 16, 32, 64, 128, 256}  # num_attention_heads · 2^2..2^8
