"""Text generation and evaluation keys (GPT-NeoX's ``NeoXArgsTextgen``)."""

# `arg()` returns a dataclasses.field (with the key's docstring); ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.neox_arguments.fields import arg


@dataclass(kw_only=True)
class GenerationKeys:
    """What text generation does and where it writes."""

    text_gen_type: Literal["unconditional", "input-file", "interactive", "precompute"] = arg(
        None, "Generation mode; unset: `input-file` if sample_input_file is set, else `unconditional`.", derived=True
    )
    return_logits: bool = arg(False, "Add each generation step's logits (`logits` field) to the generated records.")
    prompt_end: str = arg("\n", "String that separates prompts in the input file.")
    sample_input_file: str | None = arg(None, "File of prompts, one per line.")
    sample_output_file: str | None = arg(
        "samples.txt",
        "Output file of generated samples (JSONL); null: `<sample_input_file>.output.jsonl` in input-file mode.",
    )
    num_samples: int = arg(1, "Number of unconditional samples.")
    inference_precision: Literal["fp32", "fp16", "bfloat16"] | None = arg(
        None,
        "neox-forge: dtype of generate.py / eval.py; unset: the config's `precision` (bf16/fp16 weights kept, not "
        "upcast); `fp32` upcasts half-precision weights.",
    )


@dataclass(kw_only=True)
class SamplingKeys:
    """How tokens are sampled."""

    temperature: float = arg(0.0, "Sampling temperature; 0 with top_p 0 and top_k 0 means greedy decoding.")
    top_p: float = arg(0.0, "Nucleus sampling: smallest token set whose probability mass exceeds top_p.")
    top_k: int = arg(0, "Sample only among the k most likely tokens (0: off).")
    maximum_tokens: int = arg(64, "Maximum number of generated tokens.")
    recompute: bool = arg(False, "Recompute attention over the whole context at each step (no KV cache).")


@dataclass(kw_only=True)
class PrecomputeKeys:
    """The name of precomputed reference log-probabilities."""

    precompute_model_name: str | None = arg(
        None,
        "Name of the precomputed reference log-probs (`<prefix>_<name>.bin/.idx`): written by `text_gen_type: "
        "precompute`, read by DPO/KTO training instead of a frozen reference model.",
    )


@dataclass(kw_only=True)
class EvalHarnessKeys:
    """lm-eval tasks and settings."""

    eval_results_prefix: str = arg("", "Prefix of the evaluation results file.")
    eval_tasks: list | None = arg(
        None,
        "lm-eval task names, glob patterns, or local task YAML files / folders to evaluate on (eval.py, and during "
        "training every eval_interval as validation/<task>_<metric>).",
    )
    eval_num_fewshot: int | None = arg(
        0,
        "neox-forge: few-shot examples per lm-eval task; default 0 (GPT-NeoX evaluates every task 0-shot), null: "
        "each task's own `num_fewshot`.",
    )
    eval_bootstrap_iters: int = arg(
        0,
        "neox-forge: lm-eval bootstrap iterations for standard errors (`<metric>_stderr` in the results file); 0: "
        "none. GPT-NeoX uses 10000 in eval.py and 2 during training.",
    )


@dataclass(kw_only=True)
class TextgenArgs(GenerationKeys, SamplingKeys, PrecomputeKeys, EvalHarnessKeys):
    """Sampling settings for generate.py and task settings for eval.py."""
