"""Hostile datasets through the command users run (``deepy.py train.py``): a ``.idx`` whose pointers all aim at
document 0, token ids past the model's vocabulary and a dataset without documents stop training with one
``error:`` line naming the file, before the model and engine are built; an index-map cache of another split is rebuilt for the new document range instead
of being reused."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron.data.index_format import MMAP_HEADER_BYTES
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, make_dataset
from tests.distributed.fns_train import make_tiny_data, run_pretrain_many, tiny_config
from tests.harness import PYTHON, free_port, run_command, run_distributed

pytestmark = pytest.mark.distributed


def _overlapping(prefix: str) -> str:
    """Every pointer at byte 0: each document would read document 0's tokens (GPT-NeoX trains on that)."""
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    n = int(np.frombuffer(bytes(raw[18:26]), dtype="<u8")[0])
    start = MMAP_HEADER_BYTES + 4 * n
    raw[start : start + 8 * n] = bytes(8 * n)
    Path(prefix + ".idx").write_bytes(bytes(raw))
    return "document 1 starts at byte 0 of the .bin"


def _out_of_vocab(prefix: str) -> str:
    """The documents of the tiny corpus with one id past the padded vocabulary (512) in the last document."""
    ds = make_dataset(prefix)
    docs = [ds[i].copy() for i in range(len(ds))]
    docs[-1][3] = 5000
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return "token id 5000 is outside the model's vocabulary of 512"


def _no_documents(prefix: str) -> str:
    """A dataset with no documents (e.g. a filtering step that dropped everything)."""
    MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16).finalize(prefix + ".idx")
    return "the dataset has no documents"


@pytest.mark.parametrize(
    "damage", [_overlapping, _out_of_vocab, _no_documents], ids=["overlapping_idx", "out_of_vocab", "no_documents"]
)
def test_deepy_train_refuses_hostile_data_in_one_line(tmp_path: Path, damage) -> None:
    data = make_tiny_data(tmp_path / "data")
    message = damage(data["data_path"])
    cfg = tiny_config(data, world=1, master_port=free_port(), train_iters=2)
    cfg.pop("global_num_gpus")
    cfg["num_gpus"] = 1
    cfg["load"] = str(tmp_path / "checkpoints")  # looked for only once the model and engine are built
    config_file = tmp_path / "bad.yml"
    config_file.write_text(yaml.safe_dump(cfg))
    cmd = [PYTHON, "deepy.py", "train.py", str(config_file), "--run_dir", str(tmp_path / "run")]
    result = run_command(cmd, timeout=400, check=False)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]
    assert errors and message in errors[0] and data["data_path"] in errors[0], result.stdout[-3000:] + result.stderr
    assert "Traceback" not in result.stderr
    assert "building train index maps" not in result.stdout  # refused before any sample was drawn
    assert "no checkpoint in" not in result.stdout  # and before the model and engine were built (seconds, not more)


def test_training_with_a_changed_split_rebuilds_the_validation_index_maps(tmp_path: Path) -> None:
    """GPT-NeoX's cache names hold no document range: with ``split`` changed from 50,50,0 to 75,25,0 the valid
    maps of documents 20..39 would be reused, and validation would read documents now in the training range."""
    data = make_tiny_data(tmp_path / "data")
    prefix = data["data_path"]
    first = tiny_config(data, train_iters=4, eval_interval=4, split="50,50,0")
    second = tiny_config(data, train_iters=4, eval_interval=4, split="75,25,0")
    run_distributed(run_pretrain_many, 1, [first], timeout=300)
    valid_maps = sorted(Path(prefix).parent.glob(f"{Path(prefix).name}_valid_indexmap_*_doc_idx.npy"))
    assert len(valid_maps) == 1
    num_docs = len(make_dataset(prefix))
    assert int(np.load(valid_maps[0]).min()) == num_docs // 2  # the first run's valid range starts halfway
    kept = tmp_path / "first_valid_doc_idx.npy"
    shutil.copy(valid_maps[0], kept)
    results = run_distributed(run_pretrain_many, 1, [second], timeout=300)[0]
    assert results[0]["valid"]  # validation ran
    rebuilt = np.load(valid_maps[0])
    assert int(rebuilt.min()) >= round(num_docs * 0.75)  # only documents of the new valid range
    assert not np.array_equal(rebuilt, np.load(kept))
