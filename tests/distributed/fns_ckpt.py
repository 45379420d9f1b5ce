"""Rank functions for the checkpoint-tool tests: our model's logits under a (tp, pp) layout from a checkpoint."""

from __future__ import annotations

import os
from typing import Any

import torch


def logits_at_layout(config: dict[str, Any], text: torch.Tensor) -> torch.Tensor | None:
    """Load ``config['load']`` through the training code and run ``text[:, :-1]``.

    Weights only (``finetune``) unless the config says ``finetune: false`` (a ZeRO-3 load with TP > 1 needs the
    full load: DeepSpeed's weights-only ZeRO-3 path consolidates the shards of every TP rank together).

    Returns the full-vocabulary fp32 logits ``[b, s, V]`` on the rank that holds them (TP rank 0 of the last pipe
    stage), None elsewhere.
    """
    import torch.distributed as dist

    from megatron import checkpoint as ckpt
    from megatron import mpu
    from megatron.initialize import initialize_megatron
    from megatron.neox_arguments import NeoXArgs
    from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size
    from megatron.training.pretraining import ModelSetup, setup_model_and_optimizer
    from megatron.training.run_plan import RunPlan
    from megatron.training.step import BatchConfig, get_batch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args = NeoXArgs.from_dict({"finetune": True, **config})
    initialize_megatron(args)
    tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(args))
    args.update_value(
        "padded_vocab_size",
        padded_vocab_size(tokenizer.vocab_size, int(args.make_vocab_size_divisible_by), int(args.model_parallel_size)),
    )
    engine, _, _, loaded = setup_model_and_optimizer(
        ModelSetup.from_neox_args(args), RunPlan.from_neox_args(args), ckpt.CheckpointConfig.from_neox_args(args)
    )
    assert loaded.path is not None, "nothing was loaded"
    batch = get_batch({"text": text}, BatchConfig(eod_token=tokenizer.eod))
    engine.eval()
    with torch.no_grad():
        if int(args.pipe_parallel_size) >= 1:
            _, logits = engine.eval_batch(iter([batch] * engine.gradient_accumulation_steps()), return_logits=True)
            if isinstance(logits, (list, tuple)):
                logits = logits[0]
        else:
            logits = engine.module(*batch[0])
        if logits is not None:
            logits = mpu.gather_from_model_parallel_region(logits.float().contiguous())
    is_last = mpu.get_pipe_parallel_rank() == mpu.get_pipe_parallel_world_size() - 1
    keep = logits is not None and is_last and mpu.get_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0
    out = logits.clone() if keep else None
    dist.barrier()
    mpu.destroy_model_parallel()
    return out


def logits_many(jobs: list[tuple[dict[str, Any], torch.Tensor]]) -> list[torch.Tensor | None]:
    """:func:`logits_at_layout` for several configs one after the other on the same ranks."""
    return [logits_at_layout(config, text) for config, text in jobs]


def train_then_logits(jobs: list[tuple[dict[str, Any], torch.Tensor]]) -> list[dict[str, Any]]:
    """For each ``(config, text)``: train and save with ``run_pretrain``, then our logits from the saved checkpoint
    under the same layout."""
    from tests.distributed.fns_train import run_pretrain

    out = []
    for config, text in jobs:
        result = run_pretrain(config)
        result["logits"] = logits_at_layout({**config, "load": config["save"]}, text)
        out.append(result)
    return out
