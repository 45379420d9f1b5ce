"""The block layouts of ``megatron/neox_arguments/sparse_layouts.py`` equal those DeepSpeed's ``sparsity_config.py`` classes
make (``tests/fixtures/deepspeed/sparse_layouts.json``: DeepSpeed's own code run by hand over a grid of options,
random blocks included), and GPT-NeoX's per-type settings are read from ``sparsity_config``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron.neox_arguments import sparse_layouts as sl

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "deepspeed" / "sparse_layouts.json").read_text())


def _ours(case: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(_build(case), dtype=torch.int64)


def _build(case: dict[str, Any]) -> sl.Layout:
    kw = dict(case["kwargs"])
    h, n = case["num_heads"], case["num_blocks"]
    rng = random.Random(case.get("seed"))
    match case["class"]:
        case "FixedSparsityConfig":
            return sl.fixed_layout(h, n, **kw)
        case "VariableSparsityConfig":
            return sl.variable_layout(h, n, rng, **kw)
        case "BigBirdSparsityConfig":
            return sl.bigbird_layout(h, n, rng, **kw)
        case "BSLongformerSparsityConfig":
            return sl.bslongformer_layout(h, n, **kw)
        case "LocalSlidingWindowSparsityConfig":
            return sl.local_layout(h, n, **kw)
    raise AssertionError(case["class"])


def _unpack(hexes: list[str], n: int) -> torch.Tensor:
    bits = [np.unpackbits(np.frombuffer(bytes.fromhex(x), dtype=np.uint8))[: n * n].reshape(n, n) for x in hexes]
    return torch.from_numpy(np.stack(bits).astype(np.int64))


def test_fixture_covers_every_class_with_random_blocks_and_errors() -> None:
    cases = FIXTURE["cases"]
    classes = {c["class"] for c in cases}
    assert len(classes) == 5 and len(cases) > 400
    for cls in classes:
        assert sum("error" in c for c in cases if c["class"] == cls) >= 10
        assert sum("layout" in c for c in cases if c["class"] == cls) >= 60
    with_random = [c for c in cases if "layout" in c and c["kwargs"].get("num_random_blocks", 0) > 0]
    assert len(with_random) > 80


def test_layouts_equal_deepspeeds() -> None:
    """Every fixture case: the same 0/1 layout, or a ValueError where DeepSpeed raised."""
    wrong = []
    for i, case in enumerate(FIXTURE["cases"]):
        if "error" in case:
            try:
                _ours(case)
                wrong.append((i, "no error"))
            except ValueError:
                pass
            continue
        ours = _ours(case)
        if not torch.equal(ours, _unpack(case["layout"], case["num_blocks"])):
            wrong.append((i, case["class"], case["num_blocks"], case["kwargs"]))
    assert not wrong, wrong[:5]


def test_random_blocks_follow_the_generator() -> None:
    """Same seed, same blocks; another seed, other blocks (so the fixture's random cases test the draws)."""
    kw: dict[str, Any] = dict(num_random_blocks=2, attention="bidirectional", different_layout_per_head=True)
    a = sl.bigbird_layout(4, 16, random.Random(1), **kw)
    assert a == sl.bigbird_layout(4, 16, random.Random(1), **kw)
    assert a != sl.bigbird_layout(4, 16, random.Random(2), **kw)
    assert a[0] != a[1]  # a layout per head


def test_gpt_neox_settings_per_type() -> None:
    assert sl.gpt_neox_settings("local", {"num_local_blocks": 32, "block": 8}) == (
        8,
        {"num_sliding_window_blocks": 32, "attention": "unidirectional"},
    )
    assert sl.gpt_neox_settings("local", {"num_sliding_window_blocks": 5})[1]["num_sliding_window_blocks"] == 5
    assert sl.gpt_neox_settings("local", None) == (16, {"num_sliding_window_blocks": 4, "attention": "unidirectional"})
    block, fixed = sl.gpt_neox_settings("sparse_fixed", {})
    assert block == 16 and fixed == {
        "different_layout_per_head": False,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "num_different_global_patterns": 1,
        "horizontal_global_attention": False,
        "attention": "unidirectional",
    }
    assert sl.gpt_neox_settings("bigbird", {"num_random_blocks": 0})[1]["num_random_blocks"] == 0
    assert "horizontal_global_attention" not in sl.gpt_neox_settings("bslongformer", {})[1]


def test_gpt_neox_layout_shapes_and_errors() -> None:
    block, layout = sl.gpt_neox_layout("sparse_fixed", {"block": 4}, 3, 32, random.Random(0))
    assert block == 4 and torch.tensor(layout).shape == (3, 8, 8)
    assert layout[0] == sl.fixed_layout(1, 8, num_local_blocks=4, attention="unidirectional")[0]
    with pytest.raises(ValueError, match=r"divisible by sparsity_config\.block=16"):
        sl.gpt_neox_layout("bigbird", None, 2, 40, random.Random(0))
    with pytest.raises(ValueError, match="num_sliding_window_blocks=4 is larger than the 2 blocks"):
        sl.gpt_neox_layout("local", {"block": 16}, 2, 32, random.Random(0))
    with pytest.raises(ValueError, match="earlier blocks"):  # DeepSpeed's BigBird cannot draw 2 at row 0 either
        sl.gpt_neox_layout("bigbird", {"block": 4, "num_random_blocks": 2}, 2, 32, random.Random(0))
