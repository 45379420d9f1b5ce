"""Load a trained checkpoint for generation and run GPT-NeoX's ``text_gen_type`` modes.

Weights are read from the checkpoint directly with ``megatron.checkpoint.reader`` (any TP/PP layout, ZeRO-3 shards
merged) into the sequential model on one process, so generation needs no optimizer, no DeepSpeed engine and no
process group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from megatron import mpu
from megatron.config_utils import NeoXValues
from megatron.generation import parallel as parallel_lib  # called through the module: tests wrap its setup
from megatron.generation.api import generate_samples_from_prompt
from megatron.generation.config import InferenceConfig
from megatron.generation.loading import inference_device, inference_dtype, load_checkpoint_for_inference
from megatron.generation.precompute import precompute_logprobs
from megatron.generation.prompts import read_interactive_prompt, read_prompts
from megatron.generation.sampling import ForwardFn, kv_cache_forward
from megatron.initialize import set_random_seed
from megatron.model import build_sequential_model
from megatron.mpu import broadcast_object
from megatron.mpu.dp_split import DataParallelSplit
from megatron.neox_arguments.errors import ConfigError
from megatron.tokenizer import build_tokenizer

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


def setup_for_inference(config: InferenceConfig) -> tuple[torch.nn.Module, Any]:
    """Tokenizer and the sequential model with the checkpoint's weights (any training layout merged) in
    :func:`inference_dtype` (the model's padded vocabulary is the checkpoint's)."""
    set_random_seed(config.seed)
    tokenizer = build_tokenizer(config.tokenizer)
    ckpt = load_checkpoint_for_inference(config)
    sd, ckpt_cfg, tag = ckpt.state_dict, ckpt.cfg, ckpt.layout.tag
    dtype = inference_dtype(config.inference_precision, ckpt_cfg)
    # no activation checkpointing at inference
    cfg = dataclasses.replace(ckpt_cfg, params_dtype=dtype, checkpoint_activations=False)
    model = build_sequential_model(cfg)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ConfigError(f"checkpoint {tag} does not fit the config: missing {missing}, unexpected {unexpected}")
    model.eval().to(inference_device())
    logger.info("loaded checkpoint %s for generation (%s)", tag, dtype)
    return model, tokenizer


def run_generation(args: NeoXValues) -> list[dict[str, Any]]:
    """``generate.py``'s work (entry level: reads its :class:`InferenceConfig` from the arguments once)."""
    return generate(InferenceConfig.from_neox_args(args))


def generate(config: InferenceConfig) -> list[dict[str, Any]]:
    """Generate per ``text_gen_type`` (unconditional / input-file / interactive; writes JSONL records) or write the
    reference log-probs of ``precompute``."""
    mode = config.text_gen_type
    if mode not in ("unconditional", "input-file", "interactive", "precompute"):
        raise ConfigError(
            f"text_gen_type {mode!r} is not supported (unconditional, input-file, interactive, precompute)"
        )
    if mode == "input-file" and not config.sample_input_file:
        raise ConfigError("text_gen_type input-file needs sample_input_file")
    parallel = parallel_lib.runs_model_parallel(config.model_parallel_size, config.pipe_parallel_size)
    rank = mpu.world_rank()
    if not parallel and rank != 0:
        return []  # one process does the work (a TP/PP checkpoint is merged on read)
    # Read before loading the model: a bad prompt file fails in seconds, not after the checkpoint load.
    prompt_end = config.prompt_end
    file_prompts = (
        read_prompts(config.sample_input_file, prompt_end) if config.sample_input_file and mode == "input-file" else []
    )
    forward: ForwardFn
    if parallel:
        stage, tokenizer = parallel_lib.setup_stage_for_inference(config)
        forward = parallel_lib.StageForward(stage)
        score: Any = forward.score
    else:
        model, tokenizer = setup_for_inference(config)
        forward, score = kv_cache_forward(model), model
    if mode == "precompute":  # every rank scores, rank 0 writes
        dp = DataParallelSplit(mpu.get_data_parallel_group()) if parallel else None
        outputs = precompute_logprobs(score, config.precompute, inference_device(), dp=dp)
        return [{"precomputed": out} for out in outputs] if rank == 0 else []
    cfg = config.sampling
    generator = torch.Generator(device="cpu").manual_seed(config.seed)

    def sample(prompts: list[str]) -> list[dict[str, Any]]:
        return generate_samples_from_prompt(
            forward,
            tokenizer,
            prompts,
            cfg,
            return_logits=config.return_logits,
            generator=generator,
            device=inference_device(),
        )

    if mode == "interactive":  # rank 0 reads the prompts; every rank generates
        records = []
        while True:
            prompt = read_interactive_prompt(sys.stdin, prompt_end) if rank == 0 else None
            prompt = broadcast_object(prompt) if parallel else prompt
            if prompt is None:
                break
            if len(tokenizer.tokenize(prompt)) >= cfg.seq_length - 1:
                if rank == 0:
                    print(f"context of {len(tokenizer.tokenize(prompt))} tokens reached seq_length - 1; stopping")
                break
            record = sample([prompt])[0]
            if rank == 0:
                print(f"Generated Text: {record['text'] or ''}", flush=True)
                records.append(record)
        return records
    if mode == "unconditional":
        prompts = [""] * config.num_samples
    else:
        prompts = file_prompts
    records = sample(prompts)
    if rank != 0:
        return []
    out = config.output_path()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    logger.info("wrote %d samples to %s", len(records), out)
    return records
