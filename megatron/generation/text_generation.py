"""Load a trained checkpoint for generation and run GPT-NeoX's ``text_gen_type`` modes.

Weights are read from the checkpoint directly (``mp_rank_00_model_states.pt["module"]``, or the merged fp32
ZeRO-3 shards), so generation needs no optimizer and no DeepSpeed engine. Supported: ``pipe_parallel_size 0``
checkpoints at ``model_parallel_size 1``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from megatron.generation.sampling import SamplingConfig, generate_samples, kv_cache_forward

logger = logging.getLogger(__name__)


def _is_placeholder(sd: dict[str, Any]) -> bool:
    return not sd or any(torch.is_tensor(v) and v.numel() == 0 for v in sd.values())


def load_module_state(load_dir: str, iteration: int | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The model's full state dict from a neox-forge/GPT-NeoX sequential checkpoint; returns ``(sd, tag)``."""
    from megatron.training.checkpointing import CheckpointConfig, resolve_tag

    tag = resolve_tag(CheckpointConfig(load=load_dir, iteration=iteration))
    if tag is None:
        raise ValueError(f"load: no checkpoint in {load_dir} (no 'latest' file); train first or set iteration")
    directory = Path(load_dir) / tag
    path = directory / "mp_rank_00_model_states.pt"
    if (directory / "layer_00-model_00-model_states.pt").exists() or (directory / "layer_00-model_states.pt").exists():
        raise ValueError(f"{directory} is a pipeline (pipe_parallel_size >= 1) checkpoint; generation needs pp=0")
    sd: dict[str, Any] = {}
    if path.exists():
        sd = torch.load(path, map_location="cpu", weights_only=False).get("module") or {}
    if _is_placeholder(sd):  # ZeRO-3: the weights live in the optimizer shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(load_dir, tag=tag)
    if not sd:
        raise ValueError(f"{directory}: no model weights found")
    return {k: v for k, v in sd.items() if torch.is_tensor(v)}, tag


def setup_for_inference(args: Any) -> tuple[torch.nn.Module, Any]:
    """Tokenizer (sets ``padded_vocab_size``) and the fp32 sequential model with the checkpoint's weights."""
    from megatron.initialize import set_random_seed
    from megatron.model import GPTModelConfig, build_sequential_model
    from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size

    if int(getattr(args, "pipe_parallel_size", 0) or 0) >= 1 or int(args.model_parallel_size or 1) != 1:
        raise ValueError("generation supports pipe_parallel_size: 0 and model_parallel_size: 1 checkpoints")
    set_random_seed(int(args.seed))
    tokenizer = build_tokenizer(TokenizerConfig.from_neox_args(args))
    args.update_value(
        "padded_vocab_size",
        padded_vocab_size(tokenizer.vocab_size, int(args.make_vocab_size_divisible_by), 1),
    )
    load = args.to_dict().get("load")
    if not load:
        raise ValueError("load: generation needs the checkpoint directory to load")
    # fp32 on any device (bf16/fp16 checkpoints are upcast), no activation checkpointing at inference
    cfg = dataclasses.replace(
        GPTModelConfig.from_neox_args(args), params_dtype=torch.float32, checkpoint_activations=False
    )
    model = build_sequential_model(cfg)
    sd, tag = load_module_state(load, getattr(args, "iteration", None))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"checkpoint {load}/{tag} does not fit the config: missing {missing}, unexpected {unexpected}")
    model.eval().to(inference_device())
    logger.info("loaded %s/%s for generation", load, tag)
    return model, tokenizer


def inference_device() -> torch.device:
    """CUDA when a GPU is used, else the CPU."""
    from megatron.distributed import on_cpu

    return torch.device("cpu") if on_cpu() else torch.device("cuda", torch.cuda.current_device())


def read_prompts(path: str, prompt_end: str = "\n") -> list[str]:
    """Prompts of ``sample_input_file`` separated by ``prompt_end`` (empty ones dropped)."""
    if not os.path.isfile(path):
        raise ValueError(f"sample_input_file {path} does not exist")
    text = Path(path).read_text(encoding="utf-8")
    return [p for p in text.split(prompt_end) if p.strip()]


def run_generation(args: Any) -> list[dict[str, Any]]:
    """Generate per ``text_gen_type`` (unconditional / input-file / interactive); writes JSONL records."""
    model, tokenizer = setup_for_inference(args)
    cfg = SamplingConfig.from_neox_args(args)
    mode = args.text_gen_type or ("input-file" if args.sample_input_file else "unconditional")
    seed = int(args.seed)
    forward = kv_cache_forward(model)
    device = inference_device()
    if mode == "unconditional":
        prompts = [""] * int(args.num_samples or 1)
    elif mode == "input-file":
        if not args.sample_input_file:
            raise ValueError("text_gen_type input-file needs sample_input_file")
        prompts = read_prompts(args.sample_input_file, args.prompt_end or "\n")
    elif mode == "interactive":
        records = []
        for line in sys.stdin:
            record = generate_samples(forward, tokenizer, [line.rstrip("\n")], cfg, seed=seed, device=device)[0]
            print(record["context"] + record["text"], flush=True)
            records.append(record)
        return records
    else:
        raise ValueError(f"text_gen_type {mode!r} is not supported (unconditional, input-file, interactive)")
    records = generate_samples(forward, tokenizer, prompts, cfg, seed=seed, device=device)
    out = args.sample_output_file or "samples.txt"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    logger.info("wrote %d samples to %s", len(records), out)
    return records
