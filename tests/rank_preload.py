"""Imported once by the fork server that starts :func:`tests.harness.run_distributed`'s ranks.

Every rank needs torch, DeepSpeed and the project; importing them costs several seconds of CPU per process
(PyTorch's optimizers import ``torch._dynamo`` on first use, DeepSpeed's ZeRO checks import a module that applies
``torch.compile``, which imports Inductor). The fork server imports them once, before anything runs a torch op or
starts a thread, and each rank forks from it with the modules already loaded.
"""

from __future__ import annotations

import os

from tests.harness import BASE_ENV

os.environ.update(BASE_ENV)  # what every rank runs with; read by some libraries at import time

import deepspeed  # noqa: F401
import torch
import torch._dynamo
import torch._inductor.compile_fx  # noqa: F401

import megatron.training.pretraining  # noqa: F401
