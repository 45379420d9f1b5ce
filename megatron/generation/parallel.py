"""Generation and evaluation under the training layout on N ranks (``model_parallel_size`` / ``pipe_parallel_size``).

Each rank builds its :class:`~megatron.model.inference_stage.InferenceStage` (its pipeline stage's layers, as this TP
rank's shards) and keeps only its part of the checkpoint's weights. Every rank runs the same decoding loop: the last
stage computes the logits and samples, TP rank 0's tokens are broadcast over its TP group, then the last stage's
tokens to every stage (:class:`StageForward`), so all ranks extend the same sequences and stop together. Scoring
(lm-eval log-likelihoods) broadcasts the last stage's logits to every stage instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch

from megatron import mpu
from megatron.cluster.worker_env import launched_world_size
from megatron.generation.config import InferenceConfig
from megatron.generation.loading import inference_device, inference_dtype, load_checkpoint_for_inference
from megatron.initialize import start_processes
from megatron.model.inference_stage import InferenceStage
from megatron.model.tp_sharding import shard_state_dict
from megatron.neox_arguments.errors import ConfigError
from megatron.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


def runs_model_parallel(model_parallel_size: int, pipe_parallel_size: int) -> bool:
    """True when this launch generates under the training layout: several ranks and TP or PP in the config
    (``pipe_parallel_size`` 0 counts as one stage).

    On one process a TP/PP checkpoint is merged into the sequential model instead.
    """
    return launched_world_size() > 1 and model_parallel_size * max(pipe_parallel_size, 1) > 1


def stage_key_filter(cfg: Any) -> Callable[[str], bool]:
    """Whether a full-layout key (``sequential.<idx>.…``) belongs to this rank's pipeline stage (its specs, and the
    tied embedding its output layer reuses off the first stage)."""
    with torch.device("meta"):
        prefixes = tuple(f"sequential.{name}." for name, _ in InferenceStage(cfg).sequential.named_children())
    return lambda key: key.startswith(prefixes)


def setup_stage_for_inference(config: InferenceConfig) -> tuple[InferenceStage, Any]:
    """Start the process groups (as training does), build this rank's stage (in ``inference_dtype``) and load its
    weights."""
    start_processes(config.init)
    tokenizer = build_tokenizer(config.tokenizer)
    # this rank reads only its stage's tensors, and only its own TP shards when the checkpoint has the run's TP
    rank, size = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    ckpt = load_checkpoint_for_inference(config, keep_for=stage_key_filter, tp_shard=(rank, size))
    dtype = inference_dtype(config.inference_precision, ckpt.cfg)
    cfg, tag = ckpt.cfg.replace(params_dtype=dtype), ckpt.layout.tag
    stage = InferenceStage(cfg)
    shards = ckpt.state_dict if ckpt.tp_shard else shard_state_dict(ckpt.state_dict, cfg, rank, size)
    missing, unexpected = stage.load_state_dict({k: v.to(dtype) for k, v in shards.items()}, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ConfigError(f"checkpoint {tag} does not fit the config: missing {missing}, unexpected {unexpected}")
    stage.eval().to(inference_device())
    logger.info(
        "loaded checkpoint %s for generation: pipeline stage %d/%d (specs %s), TP rank %d/%d, %s",
        tag, stage.stage, stage.num_stages, stage.indices, mpu.get_model_parallel_rank(),
        mpu.get_model_parallel_world_size(), dtype,
    )  # fmt: skip
    return stage, tokenizer


class LogitsStage(Protocol):
    """What :class:`StageForward` runs: an :class:`InferenceStage` or the training pipeline's
    :class:`~megatron.evaluation.pipe_stage.TrainingPipeStage` (``cfg.padded_vocab_size``; logits or None)."""

    @property
    def cfg(self) -> Any: ...

    def __call__(self, tokens: torch.Tensor, kv_cache: Any = None) -> torch.Tensor | None: ...


class StageForward:
    """The generation loop's forward over an :class:`InferenceStage`: logits on the last stage (None elsewhere),
    and the sharing of what the last stage sampled (see the module docstring)."""

    def __init__(self, stage: LogitsStage) -> None:
        self.stage = stage
        self.vocab = stage.cfg.padded_vocab_size

    def __call__(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor | None:
        return self.stage(tokens, cache)

    def share_tokens(self, sampled: torch.Tensor | None, batch: int, device: torch.device | str) -> torch.Tensor:
        """The last stage's sampled tokens ``[b]`` (TP rank 0's) on every rank."""
        if sampled is not None:
            sampled = mpu.broadcast_from_model_parallel_src(sampled.to(torch.long))
        return mpu.broadcast_from_last_stage(sampled, (batch,), torch.long, device)

    def share_logits(self, logits: torch.Tensor | None, batch: int, device: torch.device | str) -> torch.Tensor:
        """The last stage's last-position logits ``[b, V]`` on every rank (for ``return_logits``)."""
        return mpu.broadcast_from_last_stage(logits, (batch, self.vocab), torch.float32, device)

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, s, V]`` of ``tokens`` on every rank (lm-eval scoring), in fp32."""
        with torch.no_grad():
            logits = self.stage(tokens, None)
        b, s = tokens.shape
        logits = None if logits is None else logits.float()
        return mpu.broadcast_from_last_stage(logits, (b, s, self.vocab), torch.float32, tokens.device)
