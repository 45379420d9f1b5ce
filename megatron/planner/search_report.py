"""``--search`` output: the ranked layouts and the rejected ones the upper bound would have put first."""

from __future__ import annotations

from megatron.planner.search import Candidate, SearchResult

GB = 1e9
SHOWN_IN_TABLE = 10


def _layout(c: Candidate) -> str:
    ckpt = "ckpt" if c.checkpoint_activations else "no ckpt"
    return f"TP {c.tp} x PP {c.stages} x DP {c.dp}, ZeRO-{c.zero_stage}, micro {c.micro_batch} x {c.gas}, {ckpt}"


def format_search(result: SearchResult, top: int) -> str:
    """The table ``--search`` prints."""
    hw = result.hardware
    lines = [
        "==================== neox-forge layout search ====================",
        f"{hw.gpus} GPUs ({hw.gpus_per_node} per node, {result.usable_memory_bytes / GB:.1f} of {hw.gpu_memory_bytes / GB:.0f} GB usable, {hw.peak_tflops:g} TFLOP/s "
        f"peak); global batch {result.train_batch} fixed; {len(result.layouts)} layouts fit",
        "",
        f"{'rank':<5}{'layout':<58}{'memory':>10}{'TFLOP/s/GPU':>13}{'MFU':>7}{'tokens/s':>12}",
    ]
    for i, c in enumerate(result.layouts[:top], 1):
        p = c.predicted
        assert p is not None and c.memory_bytes is not None  # fitting layouts carry both
        mark = " *" if c.key == result.configured else ""
        lines.append(
            f"{i:<5}{_layout(c) + mark:<58}{c.memory_bytes / GB:>8.1f}GB{p.tflops_per_gpu:>13.1f}"
            f"{100 * p.mfu:>6.1f}%{p.tokens_per_s:>12,.0f}"
        )
    if result.cut_short:
        lines.append(
            f"search cut short: the {result.budget_seconds:g} s budget (--search-seconds) ran out after "
            f"{result.evaluated} candidate layouts; the ranking covers those only"
        )
    if result.configured_rank is None:
        evaluated = " or was not reached" if result.cut_short else ""
        lines.append(f"* the configured layout does not fit{evaluated} (see the rejections)")
    else:
        lines.append(f"* the configured layout (rank {result.configured_rank})")
    if result.partition_note:
        lines.append(result.partition_note)
    lines += ["", f"rejected although the upper bound ranks them above #1: {len(result.rejected_better_bound)}"]
    for c in result.rejected_better_bound[:SHOWN_IN_TABLE]:
        lines.append(f"  {_layout(c):<58} bound {c.upper_bound_tokens_per_s:>10,.0f} tokens/s: {c.reason}")
    if len(result.rejected_better_bound) > SHOWN_IN_TABLE:
        lines.append(f"  ... {len(result.rejected_better_bound) - SHOWN_IN_TABLE} more (--json lists them)")
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(result.rejected_counts.items()))
    lines.append(f"all rejections by reason: {counts or 'none'}")
    return "\n".join(lines)
