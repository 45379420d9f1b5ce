"""``--search`` output: the ranked layouts and the rejected ones the upper bound would have put first."""

from __future__ import annotations

from typing import Any

from megatron.planner.explain import SHOWN_EXPLANATIONS, explain_above_configured, format_deltas
from megatron.planner.search import KNOBS, VARY, Candidate, SearchResult

GB = 1e9
SHOWN_IN_TABLE = 10


def _layout(c: Candidate) -> str:
    ckpt = "ckpt" if c.checkpoint_activations else "selective" if c.recompute_granularity else "no ckpt"
    cp = f" x CP {c.context_parallel}" if c.context_parallel > 1 else ""
    knobs = (", SP" if c.sequence_parallel and c.tp > 1 else "") + (
        f", {c.layers_per_chunk} layers/chunk" if c.layers_per_chunk else ""
    )
    # PP 0: pipe_parallel_size 0, one stage without DeepSpeed's PipelineModule
    return f"TP {c.tp}{cp} x PP {c.pp} x DP {c.dp}, ZeRO-{c.zero_stage}, micro {c.micro_batch} x {c.gas}, {ckpt}{knobs}"


def _row(rank: int, c: Candidate, mark: str, width: int = 58) -> str:
    p = c.predicted
    assert p is not None and c.memory_bytes is not None  # fitting layouts carry both
    return (
        f"{rank:<5}{_layout(c) + mark:<{width}}{c.memory_bytes / GB:>8.1f}GB{p.tflops_per_gpu:>13.1f}"
        f"{100 * p.mfu:>6.1f}%{p.tokens_per_s:>12,.0f}"
    )


def search_to_json(result: SearchResult, top: int) -> dict[str, Any]:
    """``--search --json``: the result's plain data and every layout ranked above the configured one, explained."""
    explained = explain_above_configured(result)
    return {**result.to_json(top), "above_configured": [e.to_dict() for e in explained]}


def _why_above(result: SearchResult) -> list[str]:
    explained = explain_above_configured(result)
    if not explained:
        return []
    ours = result.layouts[len(explained)].predicted
    assert ours is not None  # the configured layout fits
    lines = [
        "",
        f"why above the configured layout: each one's predicted step time minus the configured layout's "
        f"({ours.step_s:.3f} s), by term",
    ]
    for e in explained[:SHOWN_EXPLANATIONS]:
        lines.append(f"  #{e.rank:<3} {_layout(e.layout)}: {format_deltas(e)}")
    if len(explained) > SHOWN_EXPLANATIONS:
        lines.append(f"  ... {len(explained) - SHOWN_EXPLANATIONS} more (--json: above_configured)")
    return lines


def format_search(result: SearchResult, top: int) -> str:
    """The table ``--search`` prints."""
    hw = result.hardware
    shown = result.layouts[:top] + result.layouts[max(result.configured_rank or 0, top + 1) - 1 :][:1]
    width = max([58, *(len(_layout(c)) + 3 for c in shown)])
    lines = [
        "==================== neox-forge layout search ====================",
        f"{hw.gpus} GPUs ({hw.gpus_per_node} per node, {result.usable_memory_bytes / GB:.1f} of {hw.gpu_memory_bytes / GB:.0f} GB usable, {hw.peak_tflops:g} TFLOP/s "
        f"peak); global batch {result.train_batch} fixed; {len(result.layouts)} layouts fit",
        "",
        f"{'rank':<5}{'layout':<{width}}{'memory':>10}{'TFLOP/s/GPU':>13}{'MFU':>7}{'tokens/s':>12}",
    ]
    if result.fixed:
        kept = "; ".join(KNOBS[k] for k in result.fixed)
        lines.insert(2, f"kept at the configured value (--search-fix {','.join(result.fixed)}): {kept}")
    if result.varied:
        varied = "; ".join(VARY[k] for k in result.varied)
        lines.insert(2, f"varied (--search-vary {','.join(result.varied)}): {varied}")
    for i, c in enumerate(result.layouts[:top], 1):
        lines.append(_row(i, c, " *" if c.key == result.configured else " +" if c.plan_only else "", width))
    rank = result.configured_rank
    if rank is not None and rank > top:
        lines += ["...", _row(rank, result.layouts[rank - 1], " *", width)]
    if result.cut_short:
        lines.append(
            f"search cut short: the {result.budget_seconds:g} s budget (--search-seconds) ran out after "
            f"{result.evaluated} candidate layouts; the ranking covers those only"
        )
    if result.configured_rank is None and result.configured_reason:
        lines.append(f"* the configured layout is rejected: {result.configured_reason}")
    elif result.configured_rank is None:
        evaluated = " or was not reached" if result.cut_short else ""
        lines.append(f"* the configured layout does not fit{evaluated} (see the rejections)")
    else:
        lines.append(f"* the configured layout (rank {result.configured_rank})")
    if any(c.plan_only for c in result.layouts[:top]):
        lines.append("+ planned only: neox-forge cannot run these knobs yet (selective, layers/chunk, CP)")
    if result.partition_note:
        lines.append(result.partition_note)
    lines += _why_above(result)
    lines += ["", f"rejected although the upper bound ranks them above #1: {len(result.rejected_better_bound)}"]
    for c in result.rejected_better_bound[:SHOWN_IN_TABLE]:
        lines.append(f"  {_layout(c):<58} bound {c.upper_bound_tokens_per_s:>10,.0f} tokens/s: {c.reason}")
    if len(result.rejected_better_bound) > SHOWN_IN_TABLE:
        lines.append(f"  ... {len(result.rejected_better_bound) - SHOWN_IN_TABLE} more (--json lists them)")
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(result.rejected_counts.items()))
    lines.append(f"all rejections by reason: {counts or 'none'}")
    return "\n".join(lines)
