"""eval_tasks during training (TP=2, and PP=2 through the training PipelineModule's stages, also with DP=2):
validation/<task>_<metric> at every eval_interval in TensorBoard, equal to eval.py on one process on the checkpoint
saved at the same iteration; char_level_ppl adds validation/lm_loss_char_lvl_ppl."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.distributed.fns_train import make_tiny_data, run_pretrain, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed
TASKS = str(Path(__file__).resolve().parents[2] / "configs" / "eval")


@pytest.mark.parametrize(
    ("layout", "world"),
    [({"model_parallel_size": 2}, 2), ({"pipe_parallel_size": 2}, 2), ({"pipe_parallel_size": 2}, 4)],
    ids=["tp2", "pp2", "pp2-dp2"],
)
def test_eval_tasks_every_eval_interval(
    layout: dict, world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.evaluation.standalone import evaluate_checkpoint
    from megatron.neox_arguments import NeoXArgs

    env = {"HF_HOME": str(tmp_path / "hf_home")}
    monkeypatch.setenv("HF_HOME", env["HF_HOME"])
    data = make_tiny_data(tmp_path / "data")
    cfg = tiny_config(
        data,
        world=world,
        **layout,
        eval_tasks=[TASKS],
        eval_limit=3,
        char_level_ppl=True,
        save=str(tmp_path / "ckpt"),
        checkpoint_factor=100,
        tensorboard_dir=str(tmp_path / "tb"),
    )
    runs = run_distributed(run_pretrain, world, cfg, env, timeout=400)
    valid = runs[0]["valid"]
    assert all(r["valid"] == valid for r in runs[1:])  # every rank (every stage and replica) has the same results
    assert {
        "validation/forge_mc_acc",
        "validation/forge_ppl_word_perplexity",
        "validation/lm_loss_char_lvl_ppl",
    } <= set(valid)
    tokens_per_char = math.log(valid["validation/lm_loss_char_lvl_ppl"]) / valid["validation/lm_loss"]
    assert 0.05 < tokens_per_char < 1.0  # BPE tokens span several characters

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("validation/forge_mc_acc")]
    assert steps[:2] == [4, 8]  # every eval_interval (then the final evaluation at 8)
    assert "validation/forge_gen_exact_match_strip" in acc.Tags()["scalars"]

    # the same numbers from eval.py's path on the checkpoint saved at iteration 8 (merged to one process)
    monkeypatch.chdir(tmp_path)
    one = {"load": str(tmp_path / "ckpt"), "global_num_gpus": 1, "model_parallel_size": 1, "pipe_parallel_size": 1}
    args = NeoXArgs.from_dict({**cfg, **one})
    _, metrics = evaluate_checkpoint(args)
    for key, value in metrics.items():
        assert math.isclose(valid[f"validation/{key}"], value, rel_tol=1e-5, abs_tol=1e-5), key
