"""Data loaders: GPT-NeoX sample counts, per-DP-rank slices, epoch restart, resume, blending by config."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from megatron.data.data_utils import DataConfig, build_train_valid_test_data_loaders, build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.data.samplers import iterate_forever
from megatron.neox_arguments import neox_namespace
from tests.harness import run_distributed


def write_corpus(prefix: str, num_docs: int, seed: int = 0, base: int = 1) -> None:
    rng = np.random.RandomState(seed)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        builder.add_item(base + rng.randint(0, 900, size=rng.randint(1, 30)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def config(**overrides) -> DataConfig:
    values = dict(
        seq_length=16,
        train_batch_size=4,
        micro_batch_size=2,
        train_iters=5,
        eval_interval=2,
        eval_iters=1,
        seed=1234,
        split="80,10,10",
        data_impl="mmap",
        num_workers=0,
    )
    values.update(overrides)
    return DataConfig(**values)


def test_from_neox_args_reads_flat_names():
    args = neox_namespace(
        seq_length=32,
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        train_iters=10,
        data_path="data/x_text_document",
        split="949,50,1",
        pack_impl="packed",
        data_impl="mmap",
        eval_interval=None,
    )
    cfg = DataConfig.from_neox_args(args)
    assert (cfg.seq_length, cfg.train_batch_size, cfg.micro_batch_size, cfg.train_iters) == (32, 8, 2, 10)
    assert cfg.data_path == "data/x_text_document" and cfg.split == "949,50,1"
    assert cfg.eval_interval == 1000 and cfg.eval_iters == 100 and cfg.seed == 1234
    assert cfg.num_samples() == (80, (10 // 1000 + 1) * 100 * 8, 800)


def test_loaders_give_each_dp_rank_its_slice_and_restart_per_epoch(tmp_path):
    prefix = str(tmp_path / "x_text_document")
    write_corpus(prefix, 60)
    cfg = config(data_path=prefix)
    train_ds, valid_ds, test_ds = build_train_valid_test_datasets(cfg)
    # GPT-NeoX's length is at least the requested count minus one (its min(len(shuffle) - 1, rows - 1)).
    assert len(train_ds) >= 20 - 1 and len(valid_ds) >= 12 - 1 and len(test_ds) >= 4 - 1
    loaders = [build_train_valid_test_data_loaders(cfg, dp_rank=r, dp_size=2)[0] for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == len(train_ds) // 4
    for step, (b0, b1) in enumerate(zip(*loaders)):
        assert set(b0) == {"text"}
        assert b0["text"].dtype == torch.int64 and b0["text"].shape == (2, 17)
        expected = np.stack([train_ds[i]["text"] for i in range(step * 4, step * 4 + 4)])
        np.testing.assert_array_equal(torch.cat([b0["text"], b1["text"]]).numpy(), expected)
    first = [b["text"].clone() for b in loaders[0]]
    second = [b["text"].clone() for b in loaders[0]]  # a new epoch restarts from sample 0
    assert len(first) == len(second) == len(loaders[0])
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    stream = list(itertools.islice(iterate_forever(loaders[0]), len(first) + 2))
    assert torch.equal(stream[len(first)]["text"], first[0]) and torch.equal(stream[-1]["text"], first[1])


def test_resume_from_consumed_samples(tmp_path):
    prefix = str(tmp_path / "x_text_document")
    write_corpus(prefix, 60)
    cfg = config(data_path=prefix)
    full = list(build_train_valid_test_data_loaders(cfg, dp_rank=1, dp_size=2)[0])
    train, valid, _ = build_train_valid_test_data_loaders(
        cfg, dp_rank=1, dp_size=2, consumed_train_samples=8, consumed_valid_samples=4
    )
    resumed = list(train)
    assert len(resumed) == len(full) - 2
    assert all(torch.equal(a["text"], b["text"]) for a, b in zip(resumed, full[2:]))
    assert len(list(train)) == len(full)  # the next epoch is whole again
    # The same samples for another batch split: micro 1 x dp 4 resumes at the same global sample.
    other = build_train_valid_test_data_loaders(
        config(data_path=prefix, micro_batch_size=1), dp_rank=0, dp_size=4, consumed_train_samples=8
    )[0]
    train_ds = build_train_valid_test_datasets(cfg)[0]
    np.testing.assert_array_equal(next(iter(other))["text"][0].numpy(), train_ds[8]["text"])
    np.testing.assert_array_equal(full[2]["text"].numpy(), np.stack([train_ds[10]["text"], train_ds[11]["text"]]))
    assert valid is not None


def test_blended_train_paths_with_weights(tmp_path):
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_corpus(a, 40, seed=1, base=1)
    write_corpus(b, 40, seed=2, base=2000)
    cfg = config(
        train_data_paths=[a, b],
        valid_data_paths=[b],
        test_data_paths=[a],
        train_data_weights=[3.0, 1.0],
        data_impl="infer",  # GPT-NeoX's default, which works here
    )
    train, valid, test = build_train_valid_test_datasets(cfg)
    assert len(train) == sum(len(d) for d in train.datasets)
    assert [d.name for d in train.datasets] == ["train_0", "train_1"]
    assert len(train.datasets[0].shuffle_idx) >= int(np.ceil(20 * 0.75 * 1.005))
    sources = np.array([int(train[i]["text"].max() >= 2000) for i in range(40)])
    assert abs(sources.mean() - 0.25) <= 0.05
    assert valid.datasets[0].name == "valid_0" and test.datasets[0].name == "test_0"
    weighted = build_train_valid_test_datasets(config(train_data_paths=[a, b], weight_by_num_documents=True))[0]
    np.testing.assert_allclose(weighted.weights, [0.5, 0.5])


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="data_path"):
        build_train_valid_test_datasets(config())
    with pytest.raises(ValueError, match="train_data_weights"):
        config(train_data_paths=["a", "b"], train_data_weights=[1.0]).validate()
    with pytest.raises(ValueError, match=r"missing_text_document\.idx"):
        build_train_valid_test_datasets(config(data_path=str(tmp_path / "missing_text_document")))


def _rank_loader(prefix: str) -> list[list[int]]:
    """Runs on each gloo rank: index maps are built by rank 0 while rank 1 waits."""
    rank = torch.distributed.get_rank()
    cfg = config(data_path=prefix)
    train = build_train_valid_test_data_loaders(cfg, dp_rank=rank, dp_size=2)[0]
    return [b["text"][:, 0].tolist() for b in train]


@pytest.mark.distributed
def test_two_ranks_share_index_maps(tmp_path):
    prefix = str(tmp_path / "x_text_document")
    write_corpus(prefix, 60)
    per_rank = run_distributed(_rank_loader, 2, prefix, timeout=240)
    single = [
        b["text"][:, 0].tolist()
        for b in build_train_valid_test_data_loaders(config(data_path=prefix), dp_rank=0, dp_size=2)[0]
    ]
    assert per_rank[0] == single
    assert per_rank[0] != per_rank[1] and len(per_rank[1]) == len(single)


def test_train_epochs_builds_one_epoch_per_split(tmp_path):
    prefix = str(tmp_path / "x_text_document")
    write_corpus(prefix, 60)
    cfg = config(data_path=prefix, train_iters=None, train_epochs=2)
    train, valid, _ = build_train_valid_test_datasets(cfg)
    tokens = int(train.indexed_dataset.sizes[:48].sum())  # split 80,10,10 of 60 documents -> 48 train documents
    rows = (tokens - 1) // 16 + 1
    assert len(train) == rows - 2  # one epoch, GPT-NeoX's length
    assert sorted(np.asarray(train.doc_idx).tolist()) == list(range(48))  # every train document exactly once
    assert (tmp_path / "x_text_document_train_indexmap_Nonens_16sl_1234s_packedpi_ac_doc_idx.npy").exists()
    assert valid is not None
    with pytest.raises(ValueError, match="train_epochs with several train_data_paths needs train_data_weights"):
        config(train_data_paths=["a", "b"], train_data_weights=[1.0, 2.0], train_epochs=1).validate()


def test_train_epochs_reads_each_of_several_datasets_once(tmp_path):
    """GPT-NeoX allows train_epochs with several train paths (weights all 1) but blends them equally, repeating the
    smaller; we blend in proportion to their lengths, so an epoch is every sample of every dataset exactly once."""
    prefixes = [str(tmp_path / f"d{i}_text_document") for i in range(2)]
    write_corpus(prefixes[0], 12, seed=1)
    write_corpus(prefixes[1], 40, seed=2)
    paths = {"train_data_paths": prefixes, "valid_data_paths": prefixes[:1], "test_data_paths": prefixes[:1]}
    train, _, _ = build_train_valid_test_datasets(config(data_path=None, **paths, train_iters=None, train_epochs=1))
    assert len(train) == sum(len(d) for d in train.datasets)
    for i, ds in enumerate(train.datasets):
        drawn = sorted(int(j) for d, j in zip(train.dataset_index, train.dataset_sample_index) if d == i)
        assert drawn == list(range(len(ds))), i


def test_starting_an_epoch_leaves_the_global_torch_rng_alone(tmp_path):
    # Dropout draws from the global RNG; an epoch start that consumed it would make resumed runs diverge.
    prefix = str(tmp_path / "x_text_document")
    write_corpus(prefix, 60)
    loader = build_train_valid_test_data_loaders(config(data_path=prefix), dp_rank=0, dp_size=1)[0]
    torch.manual_seed(7)
    before = torch.get_rng_state()
    stream = iterate_forever(loader)
    for _ in range(len(loader) + 1):  # crosses an epoch boundary
        next(stream)
    assert torch.equal(torch.get_rng_state(), before)
