"""``configs/rwkv/170M.yml`` (GPT-NeoX's RWKV-6 170M: ``rwkv`` blocks, bf16, ZeRO-1, the pipe engine, activation
checkpointing) trains on 2 CPU ranks when only its size shrinks: with its own one pipeline stage over 2 data-parallel
ranks, and over 2 pipeline stages (the same first loss: the initial weights do not depend on the layout), saving and
resuming in both; then greedy generation from the 2-stage checkpoint on 2 pipeline ranks (each stage's blocks keep
their recurrent state) gives the tokens and logits of one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from tests.distributed import fns_inference
from tests.distributed.fns_train import make_tiny_data, run_pretrain_many
from tests.e2e.shrink import load_raw, shrink
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]


def test_rwkv_170m_trains_saves_and_resumes_with_one_and_two_pipeline_stages(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    raw = {**load_raw([REPO / "configs" / "rwkv" / "170M.yml"]), "tokenizer_type": "HFTokenizer"}
    tok = data["vocab_file"]
    files = {"data_path": data["data_path"], "hf_tokenizer": tok, "spm_model": tok, "gpt2_vocab": tok}
    cfg, world = shrink(raw, files, tmp_path)
    assert cfg["attention_config"] == [[["rwkv"], 1], [["rwkv"], 1]] and cfg["bf16"]["enabled"]
    assert cfg["pipe_parallel_size"] == 1 and cfg["checkpoint_activations"] and world == 1
    runs = []
    for pp, gas in ((1, 1), (2, 2)):  # 4 samples per step either way: 2 data-parallel ranks, or 2 micro-batches
        save = str(tmp_path / f"pp{pp}")
        layout = dict(pipe_parallel_size=pp, gradient_accumulation_steps=gas, global_num_gpus=2, save=save, load=save)
        # with 2 stages DeepSpeed's own breakdown timers fail (ParallelConfig.apply turns them off): kept on here
        layout["wall_clock_breakdown"] = True
        common = {
            **cfg,
            **layout,
            "checkpoint_factor": 2,
            "eval_interval": 100,
            "train_batch_size": 4,
            "lr_decay_iters": 4,
        }
        runs += [{**common, "train_iters": 2}, {**common, "train_iters": 4}]
    results = run_distributed(run_pretrain_many, 2, runs, timeout=600)
    first, resumed, pipe_first, pipe_resumed = results[0]  # rank 0: pp=1 carries the loss; pp=2 stage 0 too
    for out in (first, pipe_first):
        assert out["iteration"] == 2 and out["saved"] and out["start_iteration"] == 0
        assert len(out["train_losses"]) == 2 and all(math.isfinite(x) for x in out["train_losses"])
        assert out["skipped_iters"] == 0
    for out in (resumed, pipe_resumed):
        assert out["start_iteration"] == 2 and out["iteration"] == 4
        assert len(out["train_losses"]) == 2 and all(math.isfinite(x) for x in out["train_losses"])
    assert (tmp_path / "pp1" / "latest").read_text().strip() == "global_step4"
    stage_files = sorted(p.name for p in (tmp_path / "pp2" / "global_step4").glob("layer_*-model_states.pt"))
    assert stage_files == [f"layer_{i:02d}-model_00-model_states.pt" for i in (0, 2, 3, 5, 6)]
    assert first["train_losses"][0] == pytest.approx(pipe_first["train_losses"][0], abs=2e-2)
    # the single-process reference: the same 4 samples per step as 2 micro-batches (measured: equal losses)
    single = {**runs[0], "global_num_gpus": 1, "gradient_accumulation_steps": 2, "save": None, "load": None}
    ref = run_distributed(run_pretrain_many, 1, [single], timeout=600)[0][0]["train_losses"]
    assert first["train_losses"] == pytest.approx(ref, rel=1e-4)
    assert pipe_first["train_losses"] == pytest.approx(ref, rel=1e-4)

    # generation: the pp=2 checkpoint on one process (merged) and on its 2 pipeline stages
    config = tmp_path / "rwkv.yml"
    config.write_text(
        yaml.safe_dump({k: v for k, v in runs[3].items() if k != "global_num_gpus"} | {"pipe_parallel_size": 0})
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown\nTo be, or not\n")
    gen = {"text_gen_type": "input-file", "sample_input_file": str(prompts), "maximum_tokens": 5,
           "sample_output_file": str(tmp_path / "out.jsonl"), "return_logits": True, "precision": "fp32",
           "bf16": {"enabled": False}}  # fmt: skip
    from megatron.generation.text_generation import run_generation
    from megatron.neox_arguments import NeoXArgs

    one = run_generation(NeoXArgs.from_ymls([str(config)], overwrite_values=gen))
    assert sum(r["length"] for r in one) >= 5
    [layouts, _] = run_distributed(fns_inference.generate_layouts, 2, [str(config)], gen, [(1, 2, "fp32")], timeout=300)
    two = layouts["tp1_pp2_fp32"]["records"]
    assert [(r["context"], r["text"], r["length"]) for r in two] == [
        (r["context"], r["text"], r["length"]) for r in one
    ]
    for a, b in zip(one, two, strict=True):
        assert torch.allclose(torch.tensor(a["logits"]), torch.tensor(b["logits"]), atol=1e-4)
