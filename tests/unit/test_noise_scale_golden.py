"""``megatron/logging/noise_scale.py`` equals GPT-NeoX's ``GradientNoiseScale`` on fixed gradients
(``tests/fixtures/gpt-neox/gradient_noise_scale.json``: its estimate after every iteration, non-finite iterations
included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.logging.noise_scale import GradientNoiseScale

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpt-neox" / "gradient_noise_scale.json"
CASES = json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_noise_scale_equals_gpt_neox(case: dict) -> None:
    gns = GradientNoiseScale(case["batch_size_small"], case["n_batches"], case["beta"], case["cpu_offload"])
    got = []
    for step in case["gradients"]:
        gns.update([torch.tensor(t, dtype=torch.float32) for t in step])
        got.append(gns.noise_scale)
    expected = case["noise_scale"]
    assert [g is None for g in got] == [e is None for e in expected]
    assert [g for g in got if g is not None] == pytest.approx([e for e in expected if e is not None], rel=1e-5)
