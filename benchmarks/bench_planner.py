"""``deepy.py --plan`` and ``--search`` time on a 1T model / 3,072 GPUs (64 pipeline stages): ours vs the slow paths.

    python benchmarks/bench_planner.py [--rounds 3] [--search-rounds 1] [--baseline-search] [--save]
    python benchmarks/bench_planner.py --startup [--startup-rounds 7] [--baseline-ref REF] [--save]
        [--config configs/1T.yml ...] [--gpus 3072] [--gpu-type A100-80GB] [--vocab-size 51200]

Both sides run the planner's CLI entry (``megatron.planner.cli.plan_main``, ``--json``) in this process, interleaved
(round i: ours, then the baseline), each from cold caches (the meta-device model and the stage split are rebuilt
every run; torch's one-off imports are paid by a warm-up run first). The baseline is what the planner ran before
its fast paths, switched back in place: DeepSpeed's own ``partition_balanced`` (a Python loop over
``O(layers² · stages)`` numpy scalars) for the stage split, recomputed on every call (once per stage and per
candidate layout: nothing memoised), and every stage's parameter names parsed separately. Gate: both sides print
the identical plan (JSON text) before a time counts. The ratio is the median over the plan rounds of baseline /
ours in CPU seconds of this process (``time.process_time``): on the shared 2-core box the wall times stretch with
the load, the CPU seconds much less; both are reported.

``--search`` over every candidate layout (the default budget of 60 s, which ours never reaches here) is timed for
ours; the baseline's takes 15+ minutes on the 2-core box, so it runs only with ``--baseline-search`` (once, its
output compared with ours). The command-line figure, ``python deepy.py --plan ...`` in a fresh interpreter with
its imports, is measured too: the CPU seconds (user + system) of that child process.

``--startup`` measures that start-up instead, A/B: ``python deepy.py --plan ...`` in a fresh interpreter from this
tree against the same command from ``--baseline-ref`` (default: the commit before the meta-device model build
stopped importing ``torch._dynamo``; extracted with ``git archive`` into a temporary folder), interleaved (the order
alternates every round), ``--startup-rounds`` rounds. Gate: both print the identical plan. Reported: the median of
the per-round wall-time ratios (baseline / ours), the median wall and CPU seconds (user + system of the child) of
each side, and whether each side's process imported ``torch._dynamo`` (``-X importtime``, one extra run each).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, Report, median, median_ratio
from planner_reference import reference_paths

from megatron.checkpoint import layout as checkpoint_layout
from megatron.model import meta
from megatron.planner.cli import plan_main

DEFAULT_CONFIG = ["configs/1T.yml"]  # Megatron-LM's 1T run: 128 layers, hidden 25600, TP 8 x PP 64 x DP 6
BASELINE_REF = "b74ddbc"  # --startup's baseline: before the meta-device build stopped importing torch._dynamo


def _cold() -> None:
    checkpoint_layout._BOUNDS.clear()
    meta._CACHE.clear()


def run_plan(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, printed JSON) of one in-process plan from cold caches."""
    _cold()
    out = io.StringIO()
    wall, cpu = time.perf_counter(), time.process_time()
    assert plan_main(argv, out=out) == 0
    return time.perf_counter() - wall, time.process_time() - cpu, out.getvalue()


def cli_cpu_seconds(argv: list[str]) -> tuple[float, float]:
    """(wall, user + system CPU seconds) of ``python deepy.py --plan ...`` in a fresh interpreter."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(REPO, "deepy.py"), *argv], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cold_plan(root: str, argv: list[str], importtime: bool = False) -> tuple[float, float, str, str]:
    """(wall, user + system CPU seconds, stdout, stderr) of ``python ROOT/deepy.py ARGV`` run in ``root``."""
    flags = ["-X", "importtime"] if importtime else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *flags, os.path.join(root, "deepy.py"), *argv], cwd=root, check=True,
                          capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout, done.stderr


def startup(args: argparse.Namespace, plan_argv: list[str]) -> int:
    """``--startup``: cold ``deepy.py --plan`` of this tree vs ``--baseline-ref``'s, interleaved."""
    command = f"python benchmarks/bench_planner.py --startup --baseline-ref {args.baseline_ref}"
    report = Report("planner_startup", command, rounds=args.startup_rounds, config=args.config, gpus=args.gpus,
                    gpu_type=args.gpu_type, vocab_size=args.vocab_size, baseline_ref=args.baseline_ref)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_planner_base_") as base_root:
        archive = subprocess.run(["git", "-C", REPO, "archive", args.baseline_ref], check=True, capture_output=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(base_root, filter="data")
        sides = {"ours": REPO, "baseline": base_root}
        imported = re.compile(r"\|\s+torch\._dynamo$", re.MULTILINE)
        dynamo = {n: bool(imported.search(cold_plan(r, plan_argv, importtime=True)[3])) for n, r in sides.items()}
        runs: dict[str, list[tuple[float, float, str, str]]] = {"ours": [], "baseline": []}
        for i in range(args.startup_rounds):
            for name in ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours"):
                runs[name].append(cold_plan(sides[name], plan_argv))
            if runs["ours"][-1][2] != runs["baseline"][-1][2]:
                raise SystemExit(f"gate failed in round {i + 1}: the baseline's plan differs from ours")
            print(f"round {i + 1}: ours {runs['ours'][-1][0]:.2f} s (CPU {runs['ours'][-1][1]:.2f}), baseline "
                  f"{runs['baseline'][-1][0]:.2f} s (CPU {runs['baseline'][-1][1]:.2f}); plans identical", flush=True)  # fmt: skip
    ours, base = runs["ours"], runs["baseline"]
    report.finish(
        median_ratio([b[0] for b in base], [a[0] for a in ours]),
        f"baseline ({args.baseline_ref}) / ours, wall seconds of a fresh `python deepy.py --plan` (imports "
        "included); plans identical",
        save=args.save,
        ours_wall_s=round(median([a[0] for a in ours]), 2),
        ours_cpu_s=round(median([a[1] for a in ours]), 2),
        baseline_wall_s=round(median([b[0] for b in base]), 2),
        baseline_cpu_s=round(median([b[1] for b in base]), 2),
        per_round_ratios=[round(b[0] / a[0], 3) for a, b in zip(ours, base, strict=True)],
        per_round_cpu_ratios=[round(b[1] / a[1], 3) for a, b in zip(ours, base, strict=True)],
        imports_torch_dynamo=dynamo,
    )
    return 0


def _timed_rounds(rounds: int, ours: Callable[[], Any], base: Callable[[], Any]) -> tuple[list[Any], list[Any]]:
    a, b = [], []
    for i in range(rounds):
        a.append(ours())
        with reference_paths():
            b.append(base())
        if a[-1][2] != b[-1][2]:
            raise SystemExit(f"gate failed in round {i + 1}: the baseline's plan differs from ours")
        print(f"round {i + 1}: ours {a[-1][0]:.2f} s (CPU {a[-1][1]:.2f}), baseline {b[-1][0]:.2f} s "
              f"(CPU {b[-1][1]:.2f}); plans identical", flush=True)  # fmt: skip
    return a, b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=DEFAULT_CONFIG, help="config files (repository-relative)")
    p.add_argument("--gpus", type=int, default=3072)
    p.add_argument("--gpu-type", default="A100-80GB")
    p.add_argument("--vocab-size", type=int, default=51200)
    p.add_argument("--rounds", type=int, default=3, help="interleaved plan rounds (the baseline's take ~40 s each)")
    p.add_argument("--search-rounds", type=int, default=1)
    p.add_argument("--baseline-search", action="store_true", help="also time the baseline's search once (slow)")
    p.add_argument("--startup", action="store_true", help="time a cold deepy.py --plan against --baseline-ref's")
    p.add_argument("--startup-rounds", type=int, default=7)
    p.add_argument("--baseline-ref", default=BASELINE_REF, help="git ref of --startup's baseline tree")
    p.add_argument("--save", action="store_true", help="write benchmarks/results/<name>.json (for docs/benchmarks.md)")
    args = p.parse_args()
    os.chdir(REPO)
    plan_argv = ["--plan", "train.py", *args.config, "--gpus", str(args.gpus), "--gpu-type", args.gpu_type,
                 "--vocab-size", str(args.vocab_size), "--json"]  # fmt: skip
    if args.startup:
        return startup(args, plan_argv)
    search_argv = [*plan_argv, "--search", "--top", "1000000", "--search-seconds", "86400"]  # never cut short
    command = "python benchmarks/bench_planner.py" + (" --baseline-search" if args.baseline_search else "")
    report = Report("planner", command, rounds=args.rounds, config=args.config, gpus=args.gpus,
                    gpu_type=args.gpu_type, vocab_size=args.vocab_size)  # fmt: skip
    run_plan(plan_argv)  # warm-up: torch's lazy imports (the meta kernels import torch._dynamo once)
    ours, base = _timed_rounds(args.rounds, lambda: run_plan(plan_argv), lambda: run_plan(plan_argv))
    plan = json.loads(ours[0][2])
    layout = plan["layout"]
    searches = [run_plan(search_argv) for _ in range(args.search_rounds)]
    found = json.loads(searches[-1][2])
    print(f"search: ours {median([s[0] for s in searches]):.2f} s (CPU {median([s[1] for s in searches]):.2f}), "
          f"{found['candidates_evaluated']} candidate layouts, {found['layouts_that_fit']} fit, "
          f"cut short: {found['cut_short']}", flush=True)  # fmt: skip
    results: dict[str, Any] = {}
    if args.baseline_search:
        with reference_paths():
            slow = run_plan(search_argv)
        if slow[2] != searches[-1][2]:
            raise SystemExit("gate failed: the baseline's search differs from ours")
        results["search_baseline_s"] = round(slow[0], 2)
        results["search_baseline_cpu_s"] = round(slow[1], 2)
        print(f"search: baseline {slow[0]:.2f} s (CPU {slow[1]:.2f}); identical", flush=True)
    cli_wall, cli_cpu = cli_cpu_seconds(plan_argv)
    print(f"python deepy.py --plan (fresh interpreter, imports included): {cli_wall:.2f} s, CPU {cli_cpu:.2f} s")
    report.finish(
        median_ratio([b[1] for b in base], [a[1] for a in ours]),
        "baseline / ours, CPU seconds of the in-process plan (slow stage split and per-stage names vs ours); plans "
        "identical",
        save=args.save,
        plan_ours_s=round(median([a[0] for a in ours]), 3),
        plan_ours_cpu_s=round(median([a[1] for a in ours]), 3),
        plan_baseline_s=round(median([b[0] for b in base]), 2),
        plan_baseline_cpu_s=round(median([b[1] for b in base]), 2),
        per_round_ratios=[round(b[1] / a[1], 2) for a, b in zip(ours, base, strict=True)],
        cli_plan_s=round(cli_wall, 2),
        cli_plan_cpu_s=round(cli_cpu, 2),
        search_ours_s=round(median([s[0] for s in searches]), 2),
        search_ours_cpu_s=round(median([s[1] for s in searches]), 2),
        search_candidates=found["candidates_evaluated"],
        search_fit=found["layouts_that_fit"],
        search_cut_short=found["cut_short"],
        layout=f"TP {layout['tensor_parallel']} x PP {layout['pipeline_stages']} x DP {layout['data_parallel']}",
        parameters=plan["parameters"]["total"],
        **results,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
