"""Memory and throughput planner behind ``deepy.py --plan``: will the config fit, and how fast will it run?

Modules: :mod:`~megatron.planner.inputs` (hardware and the config values read), :mod:`~megatron.planner.params`
(exact per-rank parameter counts from the model on the meta device), :mod:`~megatron.planner.memory` (per-rank
bytes), :mod:`~megatron.planner.layout` (which process groups stay inside a node),
:mod:`~megatron.planner.throughput` (FLOPs, the peak-FLOPs upper bound), :mod:`~megatron.planner.calibrated` (the
calibrated step-time prediction) fitted to :mod:`~megatron.planner.published_runs`, :mod:`~megatron.planner.knobs`
(selective recomputation, the interleaved pipeline, context parallelism: planned only), :mod:`~megatron.planner.gpus`
(``--gpu-type`` presets), :mod:`~megatron.planner.plan` (everything together plus warnings),
:mod:`~megatron.planner.report` (table and JSON), :mod:`~megatron.planner.search` and
:mod:`~megatron.planner.search_report` (``--search``), :mod:`~megatron.planner.cli` (the command line).
"""

from megatron.planner.inputs import Hardware, TrainingSetup, parse_bytes
from megatron.planner.plan import Plan, PlanInputs, build_plan

__all__ = ["Hardware", "Plan", "PlanInputs", "TrainingSetup", "build_plan", "parse_bytes"]
