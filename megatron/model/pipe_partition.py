"""Which ``pipe_partition_method`` a ``GPT2ModelPipe`` runs (the checkpoint code and the planner use the same)."""

from __future__ import annotations

from megatron.model.config import GPTModelConfig

DEFAULT_PARTITION = "type:transformerlayer|mlp"  # the schema default: weighs the layers only
GPT_NEOX_PARTITION = "type:transformer|mlp"  # GPT-NeoX's default: also weighs _pre/_post_transformer_block


def resolve_partition_method(cfg: GPTModelConfig, pp: int, partition_method: str | None = None) -> str:
    """The method the pipeline runs: the configured one, except that the default falls back to GPT-NeoX's
    ``type:transformer|mlp`` when it cannot keep every stage's input a tuple or does not weigh every layer.

    DeepSpeed's pipeline engine treats a ``GPT2ModelPipe``'s activations as ``(..., mask)`` tuples, so no stage may
    start after ``_post_transformer_block`` (its output is a tensor). The default weighs the layers only: with at
    least as many layers as stages every stage holds a layer and the norm and head stay with the last one; with
    fewer, layer-less stages would hold the norm or the head alone. Mamba and RWKV layers it does not weigh.
    """
    method = partition_method or cfg.pipe_partition_method
    unweighed = any(kind in ("mamba", "rwkv") for kind in cfg.layer_types)
    if method.lower() == DEFAULT_PARTITION and (cfg.num_layers < pp or unweighed):
        return GPT_NEOX_PARTITION
    return method
