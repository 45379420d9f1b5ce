"""Post-training against GPT-NeoX's own outputs (``tests/fixtures/gpt-neox/``, see its README): the batch functions
(tokens, labels, loss masks, KTO reward rows, ``eod_mask_loss``), the DPO, KTO and RM losses with their logged
metrics, and the sample order of pairwise and KTO data. Where we differ on purpose the test says so, and
docs/gpt-neox-differences.md names it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path, make_dataset
from megatron.post_training.data import AlignedDocumentsDataset
from megatron.post_training.losses import dpo_loss, kto_loss, rm_loss, sequence_logprobs, token_logprobs
from megatron.post_training.objectives import kto_reward_rows, last_trained_position, sequence_batch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "gpt-neox"
LOSSES = json.loads((FIXTURES / "post_training_losses.json").read_text())
SAMPLES = json.loads((FIXTURES / "post_training_samples.json").read_text())
EOD = LOSSES["eod"]


def _cases(kind: str) -> list[dict[str, Any]]:
    return [c for c in LOSSES["cases"] if c["kind"] == kind]


def _t(x: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def _batch(case: dict[str, Any]) -> Any:
    d = case["data"]
    if case["kind"] == "kto":
        text, label = _t(d["text"], torch.int64), _t(d["label"], torch.int64)
    else:
        text = torch.cat([_t(d["pos"], torch.int64), _t(d["neg"], torch.int64)])
        label = torch.cat([_t(d["pos_label"], torch.int64), _t(d["neg_label"], torch.int64)])
    return sequence_batch(text, label, EOD, case["eod_mask_loss"])


def _assert_metrics(ours: dict[str, torch.Tensor], theirs: dict[str, float]) -> None:
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert float(ours[k]) == pytest.approx(v, rel=1e-5, abs=1e-5), k


@pytest.mark.parametrize("case", LOSSES["cases"], ids=lambda c: f"{c['kind']}-{c.get('name', '')}-{c['eod_mask_loss']}")
def test_batch_matches_gpt_neox(case: dict[str, Any]) -> None:
    """Inputs, targets and loss mask (labels >= 0 and, with ``eod_mask_loss``, input token != EOD)."""
    b = _batch(case)
    want = case["batch"]
    assert b.inputs[0].tolist() == want["tokens"]
    assert b.targets.tolist() == want["labels"]
    assert b.mask.tolist() == want["loss_mask"]
    if case["kind"] == "kto":
        assert kto_reward_rows(_t(case["data"]["reward"])).tolist() == want["rewards"]


@pytest.mark.parametrize("case", _cases("dpo"), ids=lambda c: f"free={c['reference_free']}-eod={c['eod_mask_loss']}")
def test_dpo_loss_and_metrics_match_gpt_neox(case: dict[str, Any]) -> None:
    b = _batch(case)
    chosen, rejected = sequence_logprobs(token_logprobs(_t(case["logits"]), b.targets), b.mask).chunk(2)
    ref_c = ref_r = None
    if not case["reference_free"]:
        ref_c, ref_r = sequence_logprobs(token_logprobs(_t(case["ref_logits"]), b.targets), b.mask).chunk(2)
    loss, metrics = dpo_loss(chosen, rejected, ref_c, ref_r, case["beta"])
    assert float(loss) == pytest.approx(case["loss"], rel=1e-5)
    _assert_metrics(metrics, case["metrics"])


@pytest.mark.parametrize("case", _cases("rm"), ids=lambda c: f"eod={c['eod_mask_loss']}")
def test_rm_loss_and_metrics_match_gpt_neox(case: dict[str, Any]) -> None:
    """GPT-NeoX reads each row's score at its one trained position (what ``--for-rm`` writes); we read it at the
    last trained position, the same position here."""
    b = _batch(case)
    scores = _t(case["scores"])[..., 0]
    rewards = scores.gather(1, last_trained_position(b.mask).unsqueeze(1)).squeeze(1)
    loss, metrics = rm_loss(*rewards.chunk(2), z_loss=case["z_loss"])
    assert float(loss) == pytest.approx(case["loss"], rel=1e-5)
    _assert_metrics(metrics, case["metrics"])


@pytest.mark.parametrize("case", _cases("kto"), ids=lambda c: c["name"])
def test_kto_loss_and_metrics_match_gpt_neox(case: dict[str, Any]) -> None:
    """β scaled by each row's mean reward, KL clamped per sequence then averaged per half, weights averaged per
    half, a zero reward weighted 0, odd batch of 3 — as GPT-NeoX computes them."""
    b = _batch(case)
    policy = token_logprobs(_t(case["logits"]), b.targets) * b.mask
    ref = token_logprobs(_t(case["ref_logits"]), b.targets) * b.mask
    rewards = kto_reward_rows(_t(case["data"]["reward"]))
    loss, metrics = kto_loss(
        policy, ref, rewards, b.mask, case["beta"], case["desirable_weight"], case["undesirable_weight"]
    )
    assert float(loss) == pytest.approx(case["loss"], rel=1e-5)
    _assert_metrics(metrics, case["metrics"])


def _write(prefix: Path, docs: list[list[int]]) -> Any:
    b = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for d in docs:
        b.add_item(np.asarray(d, dtype=np.int32))
        b.end_document()
    b.finalize(index_file_path(str(prefix)))
    return make_dataset(str(prefix), "mmap")


def _without_next_document_token(sample: dict[str, list], docs: dict[str, list[list[int]]], doc: int) -> dict:
    """GPT-NeoX appends the first token of the next document after each unpacked sample (a boundary slip of its
    index mapping); we pad there instead (docs/gpt-neox-differences.md). Its sample with that value padded."""
    out = {}
    for name, values in sample.items():
        n = len(docs["pos" if name.startswith("pos") else "neg" if name.startswith("neg") else "text"][doc])
        v = list(values)
        if n < len(v):
            v[n] = -100 if name.endswith("label") else 0
        out[name] = v
    return out


@pytest.mark.parametrize("case", SAMPLES["cases"], ids=lambda c: f"{c['kind']}-{c['seed']}-{c['chopped']}")
def test_sample_order_and_samples_match_gpt_neox(case: dict[str, Any], tmp_path: Path) -> None:
    names = ("pos", "neg", "pos_label", "neg_label") if case["kind"] == "pairwise" else ("text", "label", "reward")
    streams = {n: _write(tmp_path / n, case[n]) for n in names}
    ds = AlignedDocumentsDataset(
        streams, {n: n for n in names}, len(case["samples"]), case["seq"], case["seed"], allow_chopped=case["chopped"]
    )
    theirs = [case["doc_idx"][j] for j in case["shuffle_idx"]]
    skipped = bool(case.get("all_masked_pos_label_docs"))
    if case["kind"] == "pairwise" and skipped:
        # GPT-NeoX's pairwise shuffle draws i mod <all documents> and indexes the cyclic list of kept documents with
        # it, over-sampling the first kept ones; we draw as its KTO data does: i mod <kept documents>.
        kept = sorted(set(case["doc_idx"]))
        perm = np.random.RandomState(case["seed"]).permutation(len(case["samples"]))
        assert ds.order.tolist() == [kept[p % len(kept)] for p in perm]
        assert ds.order.tolist() != theirs
        return
    assert ds.order.tolist() == theirs
    for i, doc in enumerate(theirs):
        want = _without_next_document_token(case["samples"][i], case, doc)
        if case["kind"] == "kto":  # GPT-NeoX's per-document reward file: the value over the document's positions
            n = min(len(case["text"][doc]), case["seq"] + 1)
            want["reward"] = [float(case["reward"][doc][0])] * n + [0.0] * (case["seq"] + 1 - n)
        assert {k: v.tolist() for k, v in ds[i].items()} == want, i
