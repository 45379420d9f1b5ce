"""Per-rank memory of ZeRO-0, ZeRO-1 and ZeRO-3 at 2 data-parallel ranks, as ratios to ZeRO-0.

    python benchmarks/bench_zero_memory.py [--small] [--bf16] [--steps 2]

Each stage runs ``pretrain()`` on 2 fresh gloo ranks (the Pythia-14M shape of ``bench_train.py`` at seq 64,
micro-batch 2, Adam, fp32; ``--bf16``: DeepSpeed bf16, i.e. bf16 parameters with fp32 master weights and Adam
state, as users train). Measured per rank after the first step: parameter + optimizer bytes actually held
(``megatron.training.memory_usage``: module parameters or their ZeRO-3 partition, master weights, Adam state),
gradient bytes, and the process's peak RSS (``ru_maxrss``, which includes the runtime and activations). Gate: the
first-step losses of the three stages are equal (same data, same initial weights). Prints the per-stage values,
``ratio=<ZeRO-3 / ZeRO-0 parameter+optimizer bytes>`` and a JSON line.

Bytes per parameter and rank at 2 ranks: fp32 ZeRO-0 holds 4 (parameters, stepped in place) + 8 (Adam) = 12,
ZeRO-3 4/2 + 8/2 = 6 (0.5): its optimizer steps the parameter partition itself
(``megatron/training/deepspeed_adapter.py, item 7``; DeepSpeed 0.19.8 alone keeps a second fp32 copy of the partition,
8/12 = 0.67). In bf16 ZeRO-0 holds bf16 parameters + an fp32 master copy + Adam (2 + 4 + 8 = 14 bytes) and ZeRO-3
partitions all three (7 bytes): 0.5 as well. Persistent parameters (below ``stage3_param_persistence_threshold``)
stay whole on every rank and add a little.
bf16 on CPUs without native bf16 (AVX2 only) is ~50x slower than fp32: use ``--bf16`` with ``--small`` there.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import CORPUS, TOKENIZER, neox_config, prepare_data
from common import Report, spawn_ranks

STAGES = (0, 1, 3)


def run_rank(rank: int, world: int, port: int, config: dict, out: Any) -> None:
    """One rank of one stage; rank 0 sends back the memory it measured."""
    import torch

    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update({**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "DS_ACCELERATOR": "cpu"})
    import megatron.training.loop as loop
    from megatron.distributed import shutdown_and_exit
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.pretraining import pretrain

    held: dict[str, float] = {}
    original = loop.log_param_optimizer_bytes

    def recording(engine: Any) -> dict[str, float]:
        held.update(original(engine))
        return held

    loop.log_param_optimizer_bytes = recording
    result = pretrain(NeoXArgs.from_dict(config))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if rank == 0:
        out.put({**held, "peak_rss_bytes": peak_rss, "first_loss": result.train_losses[0]})
        out.close()
        out.join_thread()  # flush before shutdown_and_exit's os._exit
    shutdown_and_exit(0)


def run_stage(config: dict, world: int) -> dict[str, float]:
    return spawn_ranks(run_rank, world, config)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="2 layers, d=64 (quick check)")
    p.add_argument("--bf16", action="store_true", help="DeepSpeed bf16 (bf16 parameters, fp32 master weights)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--corpus", default=CORPUS)
    p.add_argument("--vocab-file", default=TOKENIZER)
    p.add_argument("--save", action="store_true", help="write benchmarks/results/zero_memory*.json")
    args = p.parse_args()
    world = 2
    name = "zero_memory" + ("_small" if args.small else "") + ("_bf16" if args.bf16 else "")
    flags = [f for f, on in (("--small", args.small), ("--bf16", args.bf16)) if on]
    report = Report(name, " ".join(["python benchmarks/bench_zero_memory.py", *flags]), ranks=world, rounds=1,
                    precision="bf16" if args.bf16 else "fp32")  # fmt: skip
    per_stage: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_path = prepare_data(tmp, args.corpus, args.vocab_file)
        shape = argparse.Namespace(small=args.small, bf16=args.bf16, warmup=0, rounds=args.steps, log_interval=10)
        for stage in STAGES:
            config = neox_config(shape, data_path, args.vocab_file)
            config.update(global_num_gpus=world, seq_length=64, train_micro_batch_size_per_gpu=2)
            config["zero_optimization"] = {"stage": stage}
            per_stage[stage] = run_stage(config, world)
    losses = [per_stage[s]["first_loss"] for s in STAGES]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        print(f"GATE FAILED: first-step losses differ across stages: {losses}", file=sys.stderr)
        return 1
    base = per_stage[0]
    rows = {}
    for stage in STAGES:
        m = per_stage[stage]
        rows[f"zero{stage}"] = {
            "param_optimizer_bytes": int(m["memory/param_optimizer_bytes"]),
            "param_bytes": int(m["memory/param_bytes"]),
            "master_param_bytes": int(m["memory/master_param_bytes"]),
            "optimizer_state_bytes": int(m["memory/optimizer_state_bytes"]),
            "grad_bytes": int(m.get("memory/grad_bytes", 0)),
            "peak_rss_bytes": int(m["peak_rss_bytes"]),
            "ratio_param_optimizer": round(m["memory/param_optimizer_bytes"] / base["memory/param_optimizer_bytes"], 3),
            "ratio_peak_rss": round(m["peak_rss_bytes"] / base["peak_rss_bytes"], 3),
        }
        r = rows[f"zero{stage}"]
        print(f"ZeRO-{stage}: param+optimizer {r['param_optimizer_bytes'] / 2**20:.1f} MiB "
              f"(x{r['ratio_param_optimizer']}; params {r['param_bytes'] / 2**20:.1f}, master "
              f"{r['master_param_bytes'] / 2**20:.1f}, optimizer state {r['optimizer_state_bytes'] / 2**20:.1f}), grads {r['grad_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB (x{r['ratio_peak_rss']}) per rank")  # fmt: skip
    report.finish(rows["zero3"]["ratio_param_optimizer"], "ZeRO-3 / ZeRO-0 per-rank parameter+optimizer bytes",
                  args.save, stages=rows, first_losses=losses)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
