"""Generation under the training layout: TP=2, PP=2 and TP=2 x PP=2 on 4 gloo ranks give the 1-rank tokens.

The tiny checkpoint is saved TP=2 / PP=2 (convert_hf_to_neox.py); each rank builds only its pipeline stage's
layers as its TP shards (the same layer classes as training) and the last stage's tokens drive every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import fns_inference
from tests.e2e.eval_fixture import build_tiny_model
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

PROMPTS = ["The quick brown", "To be, or not", "Q: What is 2 plus 2?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), tp=2, pp=2)


def test_generation_on_tp_and_pp_ranks_matches_one_rank(tiny, tmp_path: Path) -> None:
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    overrides = {"text_gen_type": "input-file", "sample_input_file": str(prompts), "maximum_tokens": 6,
                 "sample_output_file": str(tmp_path / "out.jsonl"), "return_logits": True}  # fmt: skip
    reference = run_generation(NeoXArgs.from_ymls(tiny.configs, overwrite_values=overrides))
    assert [r["context"] for r in reference] == PROMPTS and sum(r["length"] for r in reference) >= 6
    layouts = [(2, 1), (1, 2), (2, 2)]
    results = run_distributed(fns_inference.generate_layouts, 4, tiny.configs, overrides, layouts, timeout=300)
    for tp, pp in layouts:
        name = f"tp{tp}_pp{pp}"
        assert sorted((r[name]["stage"], r[name]["tp_rank"]) for r in results) == sorted(
            (rank // tp % pp if pp > 1 else 0, rank % tp) for rank in range(4)
        ), name
        got = results[0][name]["records"]
        assert all(r[name]["records"] == [] for r in results[1:]), name  # only rank 0 returns / writes records
        for mine, want in zip(got, reference, strict=True):
            assert (mine["context"], mine["text"], mine["length"], mine["finished"]) == (
                want["context"], want["text"], want["length"], want["finished"]
            ), name  # fmt: skip
            assert len(mine["logits"]) == len(want["logits"])
            for a, b in zip(mine["logits"], want["logits"], strict=True):
                assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, name
