"""The members of DeepSpeed's engine that neox-forge uses, as ``typing.Protocol``s (structural: DeepSpeed's classes
are not subclasses of them, and DeepSpeed ships no type information, so these are what the type checker knows).

:class:`Engine` is what the training step, the loop, ``deepspeed_adapter.py``, the checkpoint save / load, the
post-training objectives and the in-training evaluation use of a ``DeepSpeedEngine``; :class:`PipelineEngine` adds
what they use of DeepSpeed's ``PipelineEngine``. The members under "internals" are DeepSpeed's private state, each
used by the one module named with it. The module sits below ``training``, ``checkpoint``, ``post_training`` and
``evaluation`` (it imports only torch), so each of them can name the engine's type. ``tests/unit/
test_deepspeed_adapter.py::test_deepspeed_engines_have_every_member_of_the_engine_protocol`` checks that DeepSpeed's
engines have every member listed, and that the declared parameters of each method are DeepSpeed's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class Engine(Protocol):
    """A ``deepspeed.DeepSpeedEngine`` as the step, the loop and the adapter use it."""

    module: torch.nn.Module  # the model DeepSpeed wraps
    optimizer: Any  # DeepSpeed's optimizer wrapper (ZeRO, fp16, bf16) or the torch optimizer itself
    lr_scheduler: Any  # None unless the engine was given one (GPT-NeoX's API)
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int
    device: torch.device  # where the engine put the module (pretraining's checkpoint validation logits)
    dp_world_size: int  # data-parallel ranks (checkpoint load: the ZeRO-3 file count)
    seq_dp_world_size: int  # data-parallel ranks times sequence-parallel ranks (checkpoint optimizer carry)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def backward(self, loss: torch.Tensor) -> Any: ...

    def step(self) -> None: ...

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def get_global_grad_norm(self) -> Any: ...

    def was_step_applied(self) -> bool: ...

    def fp16_enabled(self) -> bool: ...

    def bfloat16_enabled(self) -> bool: ...

    def zero_optimization(self) -> bool: ...

    def zero_optimization_stage(self) -> int: ...

    def gradient_clipping(self) -> float: ...

    def load_universal_checkpoint(self) -> bool: ...  # its config's checkpoint.load_universal (load_universal)

    def gradient_accumulation_steps(self) -> int: ...

    def train_batch_size(self) -> int: ...

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] = ...,
        save_latest: bool = True,
    ) -> bool: ...

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]: ...  # (None, None) when there is nothing to load

    # internals: deepspeed_adapter.py only
    _step_applied: bool
    losses: Any
    enable_backward_allreduce: bool
    clip_fp32_gradients: Callable[[], None]
    _take_model_step: Callable[..., None]

    # internals: checkpoint/state_checks.py only (the file a rank's optimizer state is in, named in its errors)
    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: str) -> str: ...

    def _get_ckpt_name(self, checkpoints_path: str, tag: str) -> str: ...


class PipelineEngine(Engine, Protocol):
    """A ``deepspeed.pipe.PipelineEngine``: forward, backward and the optimizer step run inside ``train_batch``."""

    total_loss: Any  # internals (deepspeed_adapter.pipeline_loss_sum): the last stage's loss sum of the iteration

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor: ...

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor: ...

    def reset_activation_shape(self) -> None: ...  # the stages exchange activations of a new shape (curriculum)

    def is_last_stage(self) -> bool: ...
