"""One metrics API in front of the console, TensorBoard, Weights & Biases and Comet.

``Metrics.log(scalars, step)`` sends a dict of scalars (GPT-NeoX's keys: ``train/lm_loss``,
``train/learning_rate``, ``runtime/samples_per_sec``, ``validation/lm_loss_ppl`` …) to every enabled sink.
Only the ranks given ``enabled=True`` (rank 0 by default) write anything.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from megatron.config_utils import NeoXValues, neox_overrides
from megatron.logging.comet import CometSink, check_comet
from megatron.logging.run_observer import format_duration, memory_text
from megatron.neox_arguments.sections.deepspeed import ReportingKeys
from megatron.neox_arguments.sections.logging import LoggingArgs

logger = logging.getLogger("megatron.train")


@dataclass
class LoggingConfig(LoggingArgs, ReportingKeys):
    """GPT-NeoX logging keys."""

    @classmethod
    def from_neox_args(cls, args: NeoXValues) -> LoggingConfig:
        """Read every field strictly under its NeoX key (``None`` means the default)."""
        values = neox_overrides(cls, args)
        return cls(**values)


class Sink(Protocol):
    """Where scalars go."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars into a ``SummaryWriter(tensorboard_dir)`` event file."""

    def __init__(self, log_dir: str, config_text: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=log_dir)
        if config_text:
            self.writer.add_text("neox_args", config_text, 0)

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Write each scalar at ``step``."""
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.flush()
        self.writer.close()


class WandbSink:
    """``wandb.log(step=iteration)``; offline mode (``WANDB_MODE=offline``) needs no network."""

    def __init__(self, cfg: LoggingConfig, run_config: dict[str, Any] | None = None) -> None:
        import wandb

        self.wandb = wandb
        if cfg.wandb_host and cfg.wandb_host != "https://api.wandb.ai":
            os.environ.setdefault("WANDB_BASE_URL", cfg.wandb_host)
        self.run = wandb.init(
            project=cfg.wandb_project,
            group=cfg.wandb_group,
            entity=cfg.wandb_team,
            name=cfg.wandb_run_name,
            dir=cfg.log_dir,
            config=run_config,
            reinit="finish_previous",
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Log one row at ``step``."""
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        """Finish the run (writes the offline run directory)."""
        self.run.finish()


class Metrics:
    """Fan-out of scalars to the enabled sinks; a no-op where ``enabled`` is False."""

    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])

    @classmethod
    def create(
        cls,
        cfg: LoggingConfig,
        *,
        rank: int,
        local_rank: int = 0,
        run_config: dict[str, Any] | None = None,
        config_text: str | None = None,
    ) -> Metrics:
        """Sinks for this rank: TensorBoard and Comet on rank 0, W&B on rank 0 (or all ranks if asked).

        Every rank checks that Comet can start (one ``UserError`` on all ranks, not rank 0 alone)."""
        check_comet(cfg.use_comet)
        sinks: list[Sink] = []
        if rank == 0 and cfg.tensorboard_dir:
            sinks.append(TensorBoardSink(cfg.tensorboard_dir, config_text))
        if cfg.use_wandb and (rank == 0 or (cfg.wandb_init_all_ranks and local_rank >= 0)):
            sinks.append(WandbSink(cfg, run_config))
        if cfg.use_comet and rank == 0:
            sinks.append(CometSink(cfg, run_config))
        return cls(sinks)

    def log(self, scalars: dict[str, float], step: int) -> None:
        """Send ``scalars`` (non-finite values included, as GPT-NeoX) to every sink."""
        if not scalars:
            return
        clean = {k: float(v) for k, v in scalars.items() if v is not None}
        for sink in self.sinks:
            sink.log(clean, step)

    def close(self) -> None:
        """Close every sink (idempotent)."""
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # a sink failing at shutdown must not hide the training result
                logger.exception("closing metrics sink %s failed", type(sink).__name__)
        self.sinks = []


def format_console_line(
    iteration: int, train_iters: int, values: dict[str, float], losses: dict[str, float], counts: dict[str, int]
) -> str:
    """GPT-NeoX-style console line: ``iteration N/T | key: value | ...``."""
    parts = [f"iteration {iteration:8d}/{train_iters:8d}"]
    labels = [
        ("runtime/samples_per_sec", "samples/sec", "{:.3f}"),
        ("runtime/tokens_per_sec", "tokens/sec", "{:.1f}"),
        ("runtime/iteration_time", "elapsed time per iteration (ms)", ""),  # formatted below
        ("train/learning_rate", "learning rate", "{:.3E}"),
        ("runtime/flops_per_sec_per_gpu", "approx flops per device", ""),  # formatted below
        ("runtime/model_flops_utilization", "MFU (%)", "{:.2f}"),
        ("train/loss_scale", "loss scale", "{:.1f}"),
        ("train/grad_norm", "grad norm", "{:.4f}"),
        ("train/param_norm", "param norm", "{:.4f}"),
        ("train/moe_aux_loss", "moe aux loss", "{:.4f}"),
    ]
    for key, label, fmt in labels:
        if key not in values:
            continue
        value = values[key]
        if key == "runtime/iteration_time":
            parts.append(f"{label}: {value * 1000:.1f}")
        elif key == "runtime/flops_per_sec_per_gpu":
            parts.append(f"{label}: {value / 1e12:.4f} TFLOP/s")
        else:
            parts.append(f"{label}: {fmt.format(value)}")
    if "runtime/eta_seconds" in values:
        parts.append(f"ETA: {format_duration(values['runtime/eta_seconds'])}")
    memory = memory_text(values)
    if memory:
        parts.append(memory)
    for key, value in losses.items():
        parts.append(f"{key}: {value:.6E}")
    for key, value in counts.items():
        parts.append(f"{key}: {value:d}")
    return " | ".join(parts)
