"""Logging, experiment tracking and profiling keys (GPT-NeoX's ``NeoXArgsLogging``)."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass

from megatron.neox_arguments.fields import arg


@dataclass(kw_only=True)
class ProfilingKeys:
    """The profiler and the memory profiler."""

    profile: bool = arg(False, "Run the torch profiler between profile_step_start and profile_step_stop.")
    profile_step_start: int = arg(10, "First profiled iteration.")
    profile_step_stop: int = arg(12, "Last profiled iteration.")
    memory_profiling: bool = arg(False, "Record a memory snapshot.")
    memory_profiling_path: str | None = arg(None, "Where the memory snapshot is written.")


@dataclass(kw_only=True)
class PeakFlopsKeys:
    """The device's peak throughput (for MFU)."""

    peak_theoretical_tflops: float | None = arg(None, "Peak TFLOP/s of one device; enables MFU/HFU logging.")


@dataclass(kw_only=True)
class LoggingArgs(ProfilingKeys, PeakFlopsKeys):
    """Console, TensorBoard, Weights & Biases, Comet and profiler settings."""

    use_wandb: bool | None = arg(None, "Log to Weights & Biases.")
    wandb_group: str | None = arg(None, "W&B group of the run.")
    wandb_run_name: str | None = arg(None, "W&B run name.")
    wandb_team: str | None = arg(None, "W&B team (entity).")
    wandb_project: str = arg("neox", "W&B project.")
    wandb_host: str = arg("https://api.wandb.ai", "W&B server URL.")
    wandb_init_all_ranks: bool = arg(False, "Start a W&B run on every rank, not only rank 0.")
    git_hash: str | None = arg(None, "Git commit of the code, recorded by the loader when available.")
    log_dir: str | None = arg(None, "Directory for text logs.")
    tensorboard_dir: str | None = arg(None, "Directory for TensorBoard event files.")
    use_comet: bool | None = arg(
        None,
        "Log the metrics to a Comet experiment (rank 0, `comet_ml` package): on Comet's server with COMET_API_KEY, "
        "or offline into an archive with COMET_START_ONLINE=false.",
    )
    comet_workspace: str | None = arg(None, "Comet workspace of the experiment (unset: comet_ml's configured default).")
    comet_project: str | None = arg(None, "Comet project of the experiment (unset: comet_ml's configured default).")
    comet_experiment_name: str | None = arg(None, "Name of the Comet experiment (unset: Comet names it).")
    comet_tags: list | None = arg(None, "Tags attached to the Comet experiment.")
    comet_others: dict | None = arg(None, "Metadata (name: value) logged as the Comet experiment's others.")
    comet_experiment: str | None = arg(None, "GPT-NeoX keeps the Comet experiment object it starts here.")
    log_interval: int = arg(100, "Iterations between training log lines.")
    log_grad_pct_zeros: bool = arg(False, "Log the fraction of zero gradient entries per parameter.")
    log_param_norm: bool = arg(False, "Log parameter norms.")
    log_grad_norm: bool = arg(False, "Log gradient norms.")
    log_optimizer_states: bool = arg(False, "Log optimizer-state norms.")
    log_gradient_noise_scale: bool = arg(False, "Estimate and log the gradient noise scale.")
    gradient_noise_scale_n_batches: int = arg(5, "Batches accumulated per gradient-noise-scale estimate.")
    gradient_noise_scale_cpu_offload: bool = arg(False, "Keep the noise-scale gradient buffer on the CPU.")
