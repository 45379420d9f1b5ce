"""REINFORCE against GPT-NeoX's own outputs (``tests/fixtures/gpt-neox/reinforce.json``, see its README): the
samples its ``OnlineDataset`` built from rollouts it fetched over a socket (leave-one-out and moving-average
baselines), and the loss, metrics and gradients of its ``forward_step`` for every ``kl_impl``, with and without a KL
penalty and ``fp32_reinforce``, on fp32 and bf16 logits."""

from __future__ import annotations

import json
import pickle
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.post_training.config import PostTrainingConfig
from megatron.post_training.online_data import OnlineRollouts
from megatron.post_training.reinforce import ReinforceObjective

GOLDEN = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "gpt-neox" / "reinforce.json").read_text())
EOD, SEQ, VOCAB = GOLDEN["eod"], GOLDEN["seq_length"], GOLDEN["vocab"]


def serve(payloads: list[Any]) -> tuple[int, list[str], threading.Thread]:
    """A data server on 127.0.0.1 answering one request per payload (GPT-NeoX's protocol); records the splits."""
    srv = socket.create_server(("127.0.0.1", 0))
    splits: list[str] = []

    def run() -> None:
        with srv:
            for p in payloads:
                conn, _ = srv.accept()
                with conn:
                    splits.append(conn.recv(4096).decode())
                    conn.sendall(p if isinstance(p, bytes) else pickle.dumps(p))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], splits, t


@pytest.mark.parametrize("case", GOLDEN["online_dataset"], ids=lambda c: c["name"])
def test_online_samples_match_gpt_neox(case: dict[str, Any]) -> None:
    port, splits, t = serve(case["sent"])
    rollouts = OnlineRollouts(
        "127.0.0.1", port, "train", seq_length=case["seq_length"], vocab_size=VOCAB,
        leave_one_out=case["leave_one_out"], timeout=10,
    )  # fmt: skip
    it = iter(rollouts)
    got = [next(it) for _ in case["samples"]]
    t.join(timeout=10)
    assert splits == case["split_sent"] == ["train"] * len(case["sent"])
    for ours, theirs in zip(got, case["samples"], strict=True):
        assert sorted(ours) == sorted(theirs)
        for k, v in theirs.items():
            assert ours[k].dtype == (np.float32 if "reward" in k else np.int64)
            np.testing.assert_array_equal(ours[k], np.asarray(v, dtype=ours[k].dtype), err_msg=k)


def _cfg(case: dict[str, Any]) -> PostTrainingConfig:
    return PostTrainingConfig(
        train_impl="reinforce", dataset_impl="online", kl_impl=case["kl_impl"], kl_div_beta=case["kl_div_beta"],
        fp32_reinforce=case["fp32_reinforce"],
    )  # fmt: skip


@pytest.mark.parametrize(
    "case",
    GOLDEN["losses"],
    ids=lambda c: f"{c['kl_impl']}-beta{c['kl_div_beta']}-fp32{c['fp32_reinforce']}-{c['dtype']}",
)
def test_loss_metrics_and_gradients_match_gpt_neox(case: dict[str, Any]) -> None:
    dtype = getattr(torch, case["dtype"])
    logits = torch.tensor(case["logits"]).to(dtype).requires_grad_(True)
    reference = None
    if case["ref_logits"] is not None:
        ref = torch.tensor(case["ref_logits"]).to(dtype)
        reference = lambda inputs: ref  # noqa: E731 - the reference model's outputs
    objective = ReinforceObjective(_cfg(case), EOD, reference)  # type: ignore[arg-type]
    data = {k: torch.tensor(v) for k, v in case["data"].items()}
    b = objective.batch(data)
    assert b.inputs[0].tolist() == case["batch"]["tokens"]
    assert b.targets.tolist() == case["batch"]["labels"]
    assert b.mask.tolist() == case["batch"]["loss_mask"]
    loss, metrics = objective.loss(lambda inputs: logits, b)  # type: ignore[arg-type]
    loss.backward()
    assert str(loss.dtype).removeprefix("torch.") == case["loss_dtype"]
    assert float(loss) == pytest.approx(case["loss"], rel=1e-6, abs=1e-6)
    assert sorted(metrics) == sorted(case["metrics"])
    for k, v in case["metrics"].items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-6, abs=1e-6), k
    assert logits.grad is not None
    assert float(logits.grad.float().abs().sum()) == pytest.approx(case["grad_abs_sum"], rel=1e-5)
