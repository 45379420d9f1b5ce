"""DeepSpeed universal checkpoints: the metadata a save writes for DeepSpeed's converter, and ``load_universal``.

DeepSpeed's ``ds_to_universal`` (``tools/ckpts/convert_to_universal.py`` wraps it) turns a checkpoint's ZeRO
shards into one folder per parameter (``<out>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, the full tensor of
every TP shard merged) and names that folder in ``<load>/latest_universal``. It merges TP shards by the patterns
of ``universal_checkpoint_info`` in the model-states files, which every save writes (:func:`universal_info`):

| our tensor (``megatron.model.tp_sharding.partition_spec``) | DeepSpeed's category                         |
|-------------------------------------------------------------|----------------------------------------------|
| word embedding, untied output layer                         | ``vocabulary_parameter_patterns`` (dim 0)    |
| column-parallel (MHA ``query_key_value``, plain ``linear1``)| none: cat dim 0                              |
| row-parallel weights (``dense``, ``linear2``)               | ``parameter_with_row_parallelism_patterns``  |
| gated ``linear1`` ``[up_r|gate_r]``, Mamba ``in_proj``      | ``parameter_with_2_sub_params_cat_dim_0``    |
| GQA ``query_key_value`` ``[Q_r|K_r|V_r]``                   | ``parameter_with_sub_params`` + shard widths |
| replicated (norms, row-parallel biases, position embeddings)| ``parameter_to_average_patterns``            |
| the tied embedding of a pipeline (first and last stage)     | ``pipeline_replicated_parameter_patterns``   |

``original_vocab_size`` is the saving run's *padded* vocabulary, so the padding rows (which take part in the
softmax) come back unchanged; a run with a larger padded vocabulary gets zero rows appended by DeepSpeed's loader,
one with a smaller one is refused.

Loading (``load_universal: true``): DeepSpeed restores each parameter's fp32 master copy and Adam moments from
``zero/`` through the ZeRO-1/2/3 or bf16 optimizer (it never reads the module weights of the model-states files),
slicing every tensor for the run's TP rank and ZeRO partition, so the run may have another TP, PP, DP size or ZeRO
stage than the saved one. What it cannot do is refused with one line (:func:`check_universal_load`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.rules import VOCAB_ROWS
from megatron.checkpoint.safe_load import safe_torch_load
from megatron.engine_protocol import Engine
from megatron.model.config import GPTModelConfig
from megatron.model.tp_sharding import GMLP_TENSOR, partition_spec

UNIVERSAL_INFO_KEY = "universal_checkpoint_info"  # deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_INFO
UNIVERSAL_VERSION = 0.4  # deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE (0.19.8)
LATEST_UNIVERSAL = "latest_universal"  # the file DeepSpeed's converter writes and its engine reads
TIED_PREFIX = "tied_modules."  # DeepSpeed's PipelineModule names the tied embedding so on the first and last stage
UNIVERSAL_TOOL = "tools/ckpts/convert_to_universal.py"


def _pattern(name: str) -> str:
    return re.escape(name) + "$"  # DeepSpeed matches with re.match: anchored at the start already


def universal_info(shapes: dict[str, tuple[int, ...]], model: GPTModelConfig, tp: int) -> dict[str, Any]:
    """``universal_checkpoint_info`` for the parameters ``shapes`` (every rank's names with this TP rank's shard
    shape) of a model saved at tensor-parallel size ``tp``.

    Every pattern names one parameter exactly: DeepSpeed's converter (strict mode) fails on a pattern nothing matches.
    """
    average: list[str] = []
    vocab: list[str] = []
    rows: list[str] = []
    two_subs: list[str] = []
    subs_list: list[dict[str, Any]] = []
    widths: dict[str, list[list[int]]] = {}
    tied: list[str] = []
    for name in sorted(shapes):
        pattern = _pattern(name)
        if name.startswith(TIED_PREFIX):
            tied.append(pattern)
        dim, subs = partition_spec(name, model)
        if dim is None:
            average.append(pattern)
        elif name.endswith(VOCAB_ROWS):
            vocab.append(pattern)
        elif dim == 1:
            rows.append(pattern)
        elif subs is not None and len(subs) == 2 and subs[0] == subs[1]:
            two_subs.append(pattern)
        elif subs is not None:
            shape = shapes[name]
            subs_list.append({"patterns": [pattern], "shape": (tuple(subs), *shape[1:]), "partition_dim": 0})
            widths[pattern] = [[size // tp] * tp for size in subs]
    return {
        "universal_checkpoint_version": UNIVERSAL_VERSION,
        "original_vocab_size": model.vocab_rows,
        "vocabulary_parameter_patterns": vocab,
        "pipeline_replicated_parameter_patterns": tied,
        "parameter_to_average_patterns": average,
        "parameter_with_row_parallelism_patterns": rows,
        "parameter_with_2_sub_params_cat_dim_0": two_subs,
        "parameter_with_sub_params": subs_list,
        "sub_param_shard_widths": widths,
    }


def read_latest_universal(root: str | Path) -> str:
    """The folder ``<root>/latest_universal`` names (one line when it is missing or points outside ``root``)."""
    latest = Path(root) / LATEST_UNIVERSAL
    if not latest.is_file():
        raise CheckpointError(
            f"load_universal: {latest} does not exist; convert a checkpoint with {UNIVERSAL_TOOL} "
            f"--input_dir <checkpoint> (it writes {LATEST_UNIVERSAL} next to its output)"
        )
    tag = latest.read_text().strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
        raise CheckpointError(f"load_universal: {latest} must name a folder inside {root}, got {tag!r}")
    if not (Path(root) / tag / "zero").is_dir():
        raise CheckpointError(
            f"load_universal: {Path(root) / tag} is not a universal checkpoint (no zero/ folder); "
            f"convert one with {UNIVERSAL_TOOL}"
        )
    return tag


def _source_tp(directory: Path) -> int | None:
    """The tensor-parallel size the checkpoint was saved at (DeepSpeed's ``checkpoint_parallel_dimensions``)."""
    for path in sorted(directory.glob("*model_states.pt")):
        dims = safe_torch_load(path, mmap=True).get("checkpoint_parallel_dimensions")
        if isinstance(dims, dict) and isinstance(dims.get("tp_degree"), int):
            return int(dims["tp_degree"])
    return None


def check_universal_load(
    engine: Engine, directory: Path, model: GPTModelConfig | None, *, tp: int, weights_only: bool
) -> None:
    """Refuse, with one line, what DeepSpeed's universal load cannot do for this engine."""
    if not engine.load_universal_checkpoint():
        raise CheckpointError(
            "load_universal: the DeepSpeed engine was built without checkpoint.load_universal (set load_universal: "
            "true in the config, not only in the load call)"
        )
    if weights_only:
        raise CheckpointError(
            "load_universal with no_load_optim or finetune is not supported: DeepSpeed's universal load restores "
            "the optimizer state with the weights; load the original checkpoint instead"
        )
    if not engine.zero_optimization():
        raise CheckpointError(
            "load_universal needs zero_optimization.stage >= 1: DeepSpeed restores universal checkpoints through its "
            "ZeRO optimizer (a ZeRO-0 run, fp32 or bf16, would keep its fresh weights)"
        )
    source_stage = int(safe_torch_load(directory / "zero" / "optimizer_state.pt").get("zero_stage", 0))
    stage = int(engine.zero_optimization_stage())
    if (source_stage >= 3) != (stage >= 3):
        raise CheckpointError(
            f"load_universal: {directory} was converted from a ZeRO-{source_stage} checkpoint and this run uses "
            f"ZeRO-{stage}: DeepSpeed writes and reads ZeRO-3 universal checkpoints in their own format, so a "
            "ZeRO-3 checkpoint loads only into ZeRO-3 and a ZeRO-1/2 one only into ZeRO-1/2"
        )
    if stage >= 3 and tp > 1:
        raise CheckpointError(
            "load_universal into ZeRO-3 needs model_parallel_size 1: DeepSpeed's ZeRO-3 universal load does not "
            "split tensors across tensor-parallel ranks (use ZeRO-3 at TP 1, or ZeRO-1/2 from a ZeRO-1/2 checkpoint)"
        )
    zero = directory / "zero"
    names = [name for name, p in engine.module.named_parameters() if p.requires_grad]
    missing = [name for name in names if not (zero / name / "fp32.pt").is_file()]
    if missing:
        have = sorted(p.name for p in zero.iterdir())[:3]
        raise CheckpointError(
            f"load_universal: {directory} has no parameter {missing[0]!r} (and {len(missing) - 1} more); its names "
            f"look like {have}: it holds another model's parameters (compare the model keys with the checkpoint's "
            "configs), or was converted by DeepSpeed's ds_to_universal directly (convert with "
            f"{UNIVERSAL_TOOL}, which also names every parameter as pipeline and sequential models do)"
        )
    if model is None:
        return
    if any(GMLP_TENSOR.search(name) for name in names) and _source_tp(directory) not in (None, tp):
        raise CheckpointError(
            f"load_universal: {directory} was saved at model_parallel_size {_source_tp(directory)}: gmlp/amlp layers "
            "cannot change tensor parallel size; keep model_parallel_size as the checkpoint has it"
        )
    for name in names:
        if name.endswith(VOCAB_ROWS):
            state = safe_torch_load(zero / name / "fp32.pt")
            if not isinstance(state, dict):  # a ZeRO-3 source at TP 1: flat tensors, checked by DeepSpeed
                continue
            rows = int(state["param"].shape[0])
            if rows > model.vocab_rows:
                raise CheckpointError(
                    f"load_universal: {name} has {rows} vocabulary rows, more than this run's padded vocabulary "
                    f"{model.vocab_rows}; raise make_vocab_size_divisible_by so the padded size is at least {rows}"
                )
