"""Parameter sharing and soft prompt tuning through ``pretrain()``: checkpoints, exact resume, the pipeline engine
(shared layers on two stages train like the sequential model), and a prompt that alone lowers the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron.checkpoint.reader import load_torch
from tests.distributed.fns_train import make_tiny_data, run_pretrain_each, run_pretrain_many, tiny_config
from tests.harness import run_distributed

pytestmark = pytest.mark.distributed

QUIET = {
    "lr_decay_iters": 10,
    "eval_interval": 100,
    "eval_iters": 0,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "log_interval": 1,
}


def module_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return load_torch(ckpt_dir / "mp_rank_00_model_states.pt")["module"]


def test_shared_layers_save_resume_and_train_on_two_pipeline_stages(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    shared = {**QUIET, "num_unique_layers": 1, "checkpoint_factor": 2}
    first = tiny_config(data, train_iters=2, save=str(tmp_path / "a"), **shared)
    resumed = tiny_config(data, train_iters=4, load=str(tmp_path / "a"), save=str(tmp_path / "a"), **shared)
    whole = tiny_config(data, train_iters=4, save=str(tmp_path / "b"), **shared)
    unshared = tiny_config(data, train_iters=4, **QUIET)
    r_first, r_resumed, r_whole, r_unshared = run_distributed(
        run_pretrain_many, 1, [first, resumed, whole, unshared], timeout=600
    )[0]
    assert r_resumed["start_iteration"] == 2
    assert r_resumed["train_losses"] == pytest.approx(r_whole["train_losses"][2:], rel=1e-6)
    assert r_first["train_losses"] == pytest.approx(r_whole["train_losses"][:2], rel=1e-6)
    assert r_whole["train_losses"] != pytest.approx(r_unshared["train_losses"], rel=1e-3)  # sharing changes training
    # the checkpoint names both positions (GPT-NeoX's layout), equal copies of the one trained layer
    a, b = module_state(tmp_path / "a" / "global_step4"), module_state(tmp_path / "b" / "global_step4")
    layer_keys = [k for k in b if k.startswith("sequential.2.")]
    assert layer_keys
    for key in layer_keys:
        assert torch.equal(b[key], b[key.replace("sequential.2.", "sequential.3.")])
    for key in b:
        assert torch.equal(a[key], b[key]), key

    # two pipeline stages, one use of the shared layer on each: DeepSpeed's tied all-reduce sums the gradients
    pipe = tiny_config(data, world=2, train_iters=4, pipe_parallel_size=2, save=str(tmp_path / "p"), **shared)
    ranks = run_distributed(run_pretrain_many, 2, [pipe], timeout=600)
    losses = [r[0]["train_losses"] for r in ranks if r[0]["train_losses"]]
    assert losses and losses[0] == pytest.approx(r_whole["train_losses"], rel=1e-4)
    files = tmp_path / "p" / "global_step4"
    l2 = load_torch(files / "layer_02-model_00-model_states.pt")
    l3 = load_torch(files / "layer_03-model_00-model_states.pt")
    for key, tensor in l2.items():
        assert torch.equal(tensor, l3[key]), key
        torch.testing.assert_close(tensor, b[f"sequential.2.{key}"], rtol=1e-4, atol=1e-5)

    # carrying the optimizer state of shared layers to another layout or optimizer form is refused, naming the fix;
    # weights alone load (no_load_optim)
    other = {"train_iters": 6, "save": str(tmp_path / "c"), **shared}
    from_pipe = tiny_config(data, load=str(tmp_path / "p"), **other)
    zero1 = tiny_config(data, load=str(tmp_path / "b"), zero_optimization={"stage": 1}, **other)
    weights = tiny_config(data, load=str(tmp_path / "p"), no_load_optim=True, **other)
    refused_pipe, refused_zero1, loaded = run_distributed(
        run_pretrain_each, 1, [from_pipe, zero1, weights], timeout=600
    )[0]
    for refused in (refused_pipe, refused_zero1):
        assert (
            isinstance(refused, str) and "not supported yet: carrying the optimizer state of shared layers" in refused
        )
        assert "no_load_optim: true" in refused
    assert not isinstance(loaded, str) and len(loaded[0]) == 2


def test_soft_prompt_trains_only_the_prefix_resumes_and_lowers_the_loss(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    soft = {
        **QUIET,
        "soft_prompt_tuning": {"enabled": True, "n_tokens": 4, "init_string": "def main"},
        "optimizer": {"type": "Adam", "params": {"lr": 0.5, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "min_lr": 0.05,
        "weight_decay": 0.0,
        "init_method_std": 0.3,  # a frozen model whose attention is not near-uniform, so the prefix can matter
    }
    first = tiny_config(
        data, train_iters=3, save=str(tmp_path / "a"), extra_save_iters=[0], checkpoint_factor=3, **soft
    )
    resumed = tiny_config(
        data, train_iters=10, load=str(tmp_path / "a"), save=str(tmp_path / "a"), checkpoint_factor=10, **soft
    )
    whole = tiny_config(data, train_iters=10, save=str(tmp_path / "b"), checkpoint_factor=10, **soft)
    frozen_prompt = {**soft, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-9}}, "min_lr": 0.0}
    control = tiny_config(data, train_iters=10, **frozen_prompt)  # the same batches, the prefix (nearly) untrained
    r_first, r_resumed, r_whole, r_control = run_distributed(
        run_pretrain_many, 1, [first, resumed, whole, control], timeout=600
    )[0]
    # after 3 steps only the prefix changed; every other tensor is bit-identical
    before, after = module_state(tmp_path / "a" / "global_step0"), module_state(tmp_path / "a" / "global_step3")
    assert set(before) == set(after) and "sequential.1.soft_embedding_weight" in before
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["sequential.1.soft_embedding_weight"]
    # init_string: the prefix starts as the word embeddings of its tokens (repeated up to n_tokens)
    prefix, table = before["sequential.1.soft_embedding_weight"], before["sequential.0.word_embeddings.weight"]
    assert all(any(torch.equal(row, t) for t in table) for row in prefix)
    # exact resume, the prefix restored from the checkpoint
    assert r_resumed["start_iteration"] == 3
    assert r_resumed["train_losses"] == pytest.approx(r_whole["train_losses"][3:], rel=1e-6)
    end_a, end_b = module_state(tmp_path / "a" / "global_step10"), module_state(tmp_path / "b" / "global_step10")
    assert all(torch.equal(end_a[k], end_b[k]) for k in end_b)
    # the prompt alone lowers the loss of the frozen model: on the same batches, below the untrained prompt's loss
    losses, untrained = r_whole["train_losses"], r_control["train_losses"]
    assert len(losses) == len(untrained) == 10 and losses[0] == pytest.approx(untrained[0], rel=1e-6)
    gaps = [u - t for t, u in zip(losses[5:], untrained[5:], strict=True)]
    assert all(g > 0 for g in gaps) and sum(gaps) / len(gaps) > 0.1, (losses, untrained)
    assert r_first["train_losses"] == pytest.approx(losses[:3], rel=1e-6)
    check_generation_uses_the_prompt(whole, tmp_path)


def test_soft_prompt_on_the_pipeline_engine_trains_only_the_prefix_and_resumes(tmp_path: Path) -> None:
    """Pipeline engine, 1 and 2 stages: the sequential model's losses; only the prefix (``layer_01``) changes; a
    resume from the 2-stage checkpoint continues exactly."""
    data = make_tiny_data(tmp_path / "data")
    soft = {
        **QUIET,
        "soft_prompt_tuning": {"enabled": True, "n_tokens": 4, "init_string": "def main"},
        "optimizer": {"type": "Adam", "params": {"lr": 0.5, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "min_lr": 0.05,
        "weight_decay": 0.01,  # the second stage has nothing to train: no param group at all
        "init_method_std": 0.3,
    }
    seq = tiny_config(data, train_iters=4, save=str(tmp_path / "s"), checkpoint_factor=4, **soft)
    pp1 = tiny_config(data, train_iters=4, pipe_parallel_size=1, **soft)
    # a pipeline checkpoint without a prefix (layer_01) is refused, naming the way that works
    plain = tiny_config(
        data, train_iters=1, pipe_parallel_size=1, save=str(tmp_path / "plain"), checkpoint_factor=1, **QUIET
    )
    tuned = {**pp1, "load": str(tmp_path / "plain"), "finetune": True}
    r_seq, r_pp1, _, refused = run_distributed(run_pretrain_each, 1, [seq, pp1, plain, tuned], timeout=600)[0]
    assert not isinstance(r_seq, str) and not isinstance(r_pp1, str) and len(r_seq[0]) == 4
    assert r_pp1[0] == pytest.approx(r_seq[0], rel=1e-5)
    assert isinstance(refused, str) and "not supported yet: soft_prompt_tuning on the pipeline engine" in refused

    save = {"save": str(tmp_path / "p"), "pipe_parallel_size": 2}
    first = tiny_config(data, world=2, train_iters=2, extra_save_iters=[0], checkpoint_factor=2, **save, **soft)
    resumed = tiny_config(data, world=2, train_iters=4, load=str(tmp_path / "p"), checkpoint_factor=4, **save, **soft)
    ranks = run_distributed(run_pretrain_many, 2, [first, resumed], timeout=600)
    r_first, r_resumed = next(r for r in ranks if r[0]["train_losses"])  # the last stage's losses
    assert r_resumed["start_iteration"] == 2
    assert r_first["train_losses"] + r_resumed["train_losses"] == pytest.approx(r_seq[0], rel=1e-5)
    # after 2 steps only the prefix changed (layer 1's file); every other layer file is bit-identical
    step0, step2 = tmp_path / "p" / "global_step0", tmp_path / "p" / "global_step2"
    files = sorted(p.name for p in step0.glob("layer_*-model_states.pt"))
    assert "layer_01-model_00-model_states.pt" in files and len(files) >= 5
    changed = []
    for name in files:
        before, after = load_torch(step0 / name), load_torch(step2 / name)
        assert set(before) == set(after)
        changed += [f"{name}:{k}" for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["layer_01-model_00-model_states.pt:soft_embedding_weight"]
    # the prefix the two stages trained is the sequential model's
    prefix = load_torch(tmp_path / "p" / "global_step4" / "layer_01-model_00-model_states.pt")["soft_embedding_weight"]
    reference = module_state(tmp_path / "s" / "global_step4")["sequential.1.soft_embedding_weight"]
    torch.testing.assert_close(prefix, reference, rtol=1e-4, atol=1e-5)
    assert not torch.equal(prefix, load_torch(step0 / "layer_01-model_00-model_states.pt")["soft_embedding_weight"])


def check_generation_uses_the_prompt(train_config: dict, tmp_path: Path) -> None:
    """generate.py's path (KV cache) on the prompt-tuned checkpoint equals greedy decoding by full recomputation with
    the prefix, and the prefix changes the logits."""
    from megatron.generation.config import InferenceConfig
    from megatron.generation.text_generation import run_generation, setup_for_inference
    from megatron.neox_arguments import NeoXArgs

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nimport os\n")
    args = NeoXArgs.from_dict(
        {
            **train_config,
            "load": train_config["save"],
            "text_gen_type": "input-file",
            "sample_input_file": str(prompts),
            "sample_output_file": str(tmp_path / "samples.jsonl"),
            "maximum_tokens": 6,
            "temperature": 0.0,
        }
    )
    records = run_generation(args)
    model, tokenizer = setup_for_inference(InferenceConfig.from_neox_args(args))
    assert model.sequential[1].soft_embedding_weight.abs().sum() > 0
    with torch.no_grad():
        for record in records:
            ids = list(tokenizer.tokenize(record["context"]))
            new: list[int] = []
            for _ in range(6):
                nxt = int(model(torch.tensor([ids + new]))[0, -1, : tokenizer.vocab_size].argmax())
                if nxt == tokenizer.eod:
                    break
                new.append(nxt)
            assert record["text"] == tokenizer.detokenize(new)
        with_prefix = model(torch.tensor([ids]))
        model.sequential[1].soft_embedding_weight.zero_()
        assert not torch.allclose(model(torch.tensor([ids])), with_prefix, atol=1e-3)


def test_soft_prompt_tuning_starts_from_a_checkpoint_without_a_prefix(tmp_path: Path) -> None:
    data = make_tiny_data(tmp_path / "data")
    base = tiny_config(data, train_iters=4, save=str(tmp_path / "base"), checkpoint_factor=4, **QUIET)
    soft = {"enabled": True, "n_tokens": 2}
    tuned = tiny_config(
        data,
        train_iters=2,
        load=str(tmp_path / "base"),
        finetune=True,
        save=str(tmp_path / "tuned"),
        checkpoint_factor=2,
        soft_prompt_tuning=soft,
        **QUIET,
    )
    _, r_tuned = run_distributed(run_pretrain_many, 1, [base, tuned], timeout=600)[0]
    assert r_tuned["start_iteration"] == 0 and len(r_tuned["train_losses"]) == 2
    before = module_state(tmp_path / "base" / "global_step4")
    after = module_state(tmp_path / "tuned" / "global_step2")
    assert set(after) == set(before) | {"sequential.1.soft_embedding_weight"}
    assert all(torch.equal(before[k], after[k]) for k in before)
