"""Training throughput: a real 1-rank ``pretrain()`` run vs Hugging Face ``GPTNeoXForCausalLM`` + AdamW.

    python benchmarks/bench_train.py [--shape pythia-14m|pythia-160m|small] [--bf16] [--compile] [--rounds 8]
        [--warmup 2] [--threads N] [--peer litgpt|litgpt-compiled|...]

Ours: ``megatron.training.pretraining.pretrain`` on one gloo rank — DeepSpeed engine, the mmap data loader over
tinyshakespeare tokenised with the 20B tokenizer, the training loop with console logging every
``--log-interval`` iterations. Baseline: ``GPTNeoXForCausalLM`` built from the same shape with the SAME initial
weights (our initial model converted with ``hf_mapping``), a plain loop of forward, ``F.cross_entropy``,
``backward``, ``AdamW.step``, ``zero_grad`` on the same batches. One HF step runs right after each of our
iterations (interleaved in one process); our time per iteration includes the loop's bookkeeping between steps.
Gate: the first-step losses are equal (fp32: 1e-4 relative). Default shape: Pythia-14M (6 layers, d=128, 4 heads,
rotary 0.25, parallel residual, untied, vocab 50304), seq 256, micro-batch 8, Adam without weight decay or
clipping, no ZeRO. ``--small`` is a 2-layer d=64 seq-64 model for quick checks.

bf16 on CPUs without native bf16 (AVX2 only) is ~50x slower than fp32 for any framework: use ``--bf16`` with
``--small`` there. HF's bf16 side runs under ``torch.autocast`` (fp32 master weights), ours under DeepSpeed bf16.
``--compile`` sets ``torch_compile: true`` on our side (transformer layers compiled with inductor; HF stays eager)
and reports the compile time: our first (untimed warm-up) iteration minus the median of the timed ones.
Prints the medians, ``ratio=<ours tokens/s / HF tokens/s>`` and a JSON line.

``--peer NAME`` replaces the in-process HF loop with another framework run its own default way in its own venv
(benchmarks/peers/README.md: the protocol, the peers, their setup): our initial model is exported as a GPTNeoX
checkpoint, the peer's runner builds its model from it, and after each of our iterations it does one training step
on the same batch. The ratio uses the step time the runner measures (the protocol's pipe is not counted against
it). ``--shape pythia-160m``: 12 layers, d=768, 12 heads, seq 512, micro-batch 4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import SHARED_DIR, Report, free_port, median, median_ratio, now, spawn_ranks

# layers, hidden, heads, seq, micro-batch, max positions (rotary 0.25, parallel residual, untied, vocab 50304)
SHAPES = {
    "small": (2, 64, 4, 64, 4, 64),
    "pythia-14m": (6, 128, 4, 256, 8, 2048),
    "pythia-160m": (12, 768, 12, 512, 4, 2048),
}

CORPUS = os.path.join(SHARED_DIR, "data", "corpora", "tinyshakespeare.txt")
TOKENIZER = os.path.join(SHARED_DIR, "data", "tokenizers", "20B_tokenizer.json")


def prepare_data(tmp: str, corpus: str, vocab: str) -> str:
    """tinyshakespeare → JSONL (one document per ~4 KB paragraph group) → ``.bin/.idx`` with our preprocessor."""
    from megatron.data.preprocess import PreprocessConfig, preprocess

    with open(corpus, encoding="utf-8") as f:
        text = f.read()
    jsonl = os.path.join(tmp, "corpus.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for start in range(0, len(text), 4096):
            f.write(json.dumps({"text": text[start : start + 4096]}) + "\n")
    prefix = os.path.join(tmp, "shakespeare")
    cfg = PreprocessConfig(
        inputs=[jsonl], output_prefix=prefix, tokenizer_type="HFTokenizer", vocab_file=vocab, append_eod=True, workers=1
    )
    preprocess(cfg)
    return prefix + "_text_document"


def neox_config(args: argparse.Namespace, data_path: str, vocab: str) -> dict:
    layers, hidden, heads, seq, micro_batch, positions = SHAPES[args.shape]
    config = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "seq_length": seq,
        "max_position_embeddings": positions,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "norm": "layernorm",
        "activation": "gelu",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "pipe_parallel_size": 0,
        "model_parallel_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "weight_decay": 0.0,
        "gradient_clipping": 0.0,
        "lr_decay_style": "constant",
        "warmup": 0.0,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": bool(args.bf16)},
        "precision": "bfloat16" if args.bf16 else "fp32",
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_iters": args.warmup + args.rounds,
        "eval_interval": 100000,
        "eval_iters": 0,
        "log_interval": args.log_interval,
        "split": "100,0,0",
        "data_impl": "mmap",
        "num_workers": 0,
        "data_path": data_path,
        "vocab_file": vocab,
        "tokenizer_type": "HFTokenizer",
        "make_vocab_size_divisible_by": 128,
        "global_num_gpus": 1,
        "seed": 1234,
        "torch_compile": bool(getattr(args, "compile", False)),
    }
    return {**config, **getattr(args, "ours_overrides", {})}


@contextlib.contextmanager
def profiled(active: bool, label: str) -> Iterator[None]:
    """torch.profiler around one side's step; prints the ops that took the most self CPU time."""
    if not active:
        yield
        return
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    print(f"---- profile: {label} ----")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)


class Interleaver:
    """Wraps our step: after each of our iterations, one HF step on the same batch; times both."""

    def __init__(self, bf16: bool, log_interval: int, ddp: bool = False, peer: Any = None) -> None:
        self.bf16, self.log_interval, self.ddp = bf16, log_interval, ddp
        self.peer = peer  # a PeerRun (peers.driver) instead of the in-process HF loop
        self.hf = self.opt = None
        self.batch = None
        self.ours_times: list[float] = []
        self.hf_times: list[float] = []
        self.ours_losses: list[float] = []
        self.hf_losses: list[float] = []
        self.last_exit: float | None = None
        self.tokens_per_step = 0
        self.profile_iteration = 0  # > 0: torch.profiler tables of both sides at that iteration

    def make_hf(self, engine, lr: float) -> None:
        import torch
        import transformers

        from megatron.model import GPTModelConfig  # noqa: F401  (the engine's module carries its config)
        from megatron.model.hf_mapping import neox_to_hf_config, neox_to_hf_state_dict

        module = engine.module
        cfg = module.cfg if hasattr(module, "cfg") else module.config
        hf_cfg = neox_to_hf_config(cfg.replace(params_dtype=torch.float32))
        hf_cfg.hidden_dropout = 0.0
        hf_cfg.attention_dropout = 0.0
        sd = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
        hf = transformers.GPTNeoXForCausalLM(hf_cfg).float()
        missing, unexpected = hf.load_state_dict(neox_to_hf_state_dict(sd, cfg), strict=False)
        if unexpected or [k for k in missing if "rotary" not in k and "masked_bias" not in k]:
            raise RuntimeError(f"weight transfer to HF failed: missing {missing}, unexpected {unexpected}")
        hf.train()
        self.hf = torch.nn.parallel.DistributedDataParallel(hf) if self.ddp else hf
        self.opt = torch.optim.AdamW(hf.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def hf_step(self, iteration: int) -> float | None:
        import torch
        import torch.nn.functional as F

        (tokens, _, _), (labels, _) = self.batch
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else torch.autocast("cpu", enabled=False)
        with ctx:
            logits = self.hf(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # a plain loop reads the loss only when it prints it (as our loop logs every log_interval)
        if iteration != 1 and iteration % self.log_interval:
            return None
        value = loss.detach().reshape(1)
        if self.ddp:  # what our loop logs: the mean over the data-parallel ranks
            torch.distributed.all_reduce(value)
            value /= torch.distributed.get_world_size()
        return float(value)

    def install(self) -> None:
        import megatron.training.step as step_mod

        original_get_batch, original_train = step_mod.get_batch, step_mod.SequentialStep.train
        me = self

        def recording_get_batch(data, cfg):
            me.batch = original_get_batch(data, cfg)
            return me.batch

        def interleaved_train(step_self, data_iter):
            if me.peer is not None:
                me.peer.start(step_self.engine)
            elif me.hf is None:
                me.make_hf(step_self.engine, float(step_self.engine.optimizer.param_groups[0]["lr"]))
            iteration = len(me.ours_losses) + 1
            profiling = me.profile_iteration == iteration
            start = me.last_exit if me.last_exit is not None else now()
            with profiled(profiling, "ours"):
                result = original_train(step_self, data_iter)
            mid = now()
            me.ours_losses.append(result.lm_loss)
            if me.peer is not None:
                (tokens, _, _), (labels, _) = me.batch
                hf_loss = me.peer.step(tokens, labels, profiling)
            else:
                with profiled(profiling, "HF"):
                    hf_loss = me.hf_step(iteration)
            end = now()
            if hf_loss is not None:
                me.hf_losses.append(hf_loss)
            me.tokens_per_step = int(me.batch[0][0].numel())
            me.ours_times.append(mid - start)
            me.hf_times.append(end - mid)
            me.last_exit = end
            return result

        step_mod.get_batch = recording_get_batch
        step_mod.SequentialStep.train = interleaved_train


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, data_path: str, out: Any) -> None:
    """One rank: our ``pretrain()`` with an HF step (under DDP when ``world > 1``) after each iteration."""
    import torch

    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // world)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    os.environ.update({**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "DS_ACCELERATOR": "cpu"})
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    for noisy in ("DeepSpeed", "deepspeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.pretraining import pretrain

    config = neox_config(args, data_path, args.vocab_file)
    config["global_num_gpus"] = world
    peer_run = None
    if args.peer:
        from peers.driver import PeerRun

        seq, micro_batch = config["seq_length"], config["train_micro_batch_size_per_gpu"]
        peer_run = PeerRun(args.peer, args.shape, seq, micro_batch, threads, args.peer_arg)
    inter = Interleaver(args.bf16, args.log_interval, ddp=world > 1, peer=peer_run)
    inter.profile_iteration = args.profile if rank == 0 else 0
    inter.install()
    try:
        pretrain(NeoXArgs.from_dict(config))
    finally:
        if peer_run is not None:
            peer_run.close()
    result = {
        "ours_times": inter.ours_times, "hf_times": inter.hf_times, "ours_losses": inter.ours_losses,
        "hf_losses": inter.hf_losses, "tokens": inter.tokens_per_step * world, "threads": threads, "config": config,
    }  # fmt: skip
    if peer_run is not None:  # the runner's own step times (the pipe not counted) and its facts
        result.update(hf_times=peer_run.seconds, hf_losses=peer_run.losses, peer_wall=peer_run.walls)
        result["peer_ready"] = peer_run.ready
    if out is None:
        return result
    if rank == 0:
        out.put(result)
        out.close()
        out.join_thread()  # flush before shutdown_and_exit's os._exit
    from megatron.distributed import shutdown_and_exit

    shutdown_and_exit(0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="pythia-14m", help="model shape, seq and micro-batch")
    p.add_argument("--small", action="store_true", help="same as --shape small (2 layers, d=64, seq 64, mb 4)")
    p.add_argument("--bf16", action="store_true", help="bf16 on both sides (slow on CPUs without native bf16)")
    p.add_argument("--compile", action="store_true", help="torch_compile: true on our side (compile time reported)")
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (2: vs HF under DDP)")
    p.add_argument("--rounds", type=int, default=5, help="timed interleaved iterations")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--profile", type=int, default=0, help="print torch.profiler tables of iteration N (both sides)")
    p.add_argument("--peer", default=None, help="compare with a peer framework (benchmarks/peers/registry.py)")
    p.add_argument("--peer-arg", action="append", default=[], help="extra flag for the peer's runner (repeatable)")
    p.add_argument("--corpus", default=CORPUS)
    p.add_argument("--vocab-file", default=TOKENIZER)
    p.add_argument("--save", action="store_true", help="write benchmarks/results/train*.json (for docs/benchmarks.md)")
    args = p.parse_args(argv)
    if args.small:
        args.shape = "small"
    args.small = args.shape == "small"
    args.ours_overrides = {}
    if args.peer:
        from peers.driver import lookup, missing_venv

        try:
            peer = lookup(args.peer)
        except ValueError as exc:
            p.error(str(exc))
        hint = missing_venv(peer)
        if hint:
            print(hint, file=sys.stderr)
            sys.exit(2)
        if args.ranks > 1:
            p.error("--peer runs one rank (--ranks 1)")
        if args.bf16:
            p.error("--peer compares fp32 (the peers' bf16 recipes differ from ours)")
        if peer.compile and not args.compile:
            print(f"peer {args.peer} compiles: our side gets torch_compile: true as well (--compile)")
            args.compile = True
        args.ours_overrides = dict(peer.ours)
    if args.compile and args.warmup < 1:
        p.error("--compile needs --warmup >= 1 (the first iteration compiles)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    other = args.peer or "HF"
    shape_suffix = {"small": "_small", "pythia-14m": "", "pythia-160m": "_160m"}[args.shape]
    name = (
        ("train_bf16" if args.bf16 else "train")
        + ("_compile" if args.compile else "")
        + ("_dp2" if args.ranks > 1 else "")
        + (f"_vs_{args.peer}" if args.peer else "")
        + shape_suffix
    )
    flags = [f"--shape {args.shape}"] if args.shape != "pythia-14m" else []
    flags += [f for f, on in (("--bf16", args.bf16), ("--compile", args.compile)) if on]
    flags += [f"--ranks {args.ranks}"] if args.ranks > 1 else []
    flags += [f"--peer {args.peer}"] if args.peer else []
    report = Report(name, " ".join(["python benchmarks/bench_train.py", *flags]), precision="bf16" if args.bf16 else
                    "fp32", rounds=args.rounds, warmup=args.warmup, ranks=args.ranks)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data_path = prepare_data(tmp, args.corpus, args.vocab_file)
        if args.ranks == 1:
            res = run_rank(0, 1, free_port(), args, data_path, None)
        else:
            res = spawn_ranks(run_rank, args.ranks, args, data_path)
    report.data["threads"] = res["threads"]
    ours_loss, hf_loss = res["ours_losses"][0], res["hf_losses"][0]
    tol = 2e-2 if args.bf16 else 1e-4
    same_model = True
    if args.peer:
        from peers.driver import lookup

        same_model = lookup(args.peer).same_model
    if same_model and abs(ours_loss - hf_loss) > tol * abs(hf_loss):
        print(f"GATE FAILED: first-step losses differ: ours {ours_loss:.6f} vs {other} {hf_loss:.6f}", file=sys.stderr)
        return 1
    ours_t, hf_t = res["ours_times"][args.warmup :], res["hf_times"][args.warmup :]
    tokens, config = res["tokens"], res["config"]
    ratio = median_ratio(hf_t, ours_t)  # time_other / time_ours == ours tokens/s / other tokens/s
    extra: dict[str, Any] = {}
    if args.compile:  # the first iteration compiled the layers (forward and backward)
        extra["compile_seconds"] = round(res["ours_times"][0] - median(ours_t), 2)
        print(f"torch_compile: first iteration {res['ours_times'][0]:.2f} s, compile ≈ {extra['compile_seconds']} s")
    if args.peer:
        extra.update(peer=args.peer, peer_ready=res["peer_ready"], peer_first_step_s=round(res["hf_times"][0], 2))
        extra["median_peer_wall_s"] = round(median(res["peer_wall"][args.warmup :]), 4)
        extra["ours_overrides"] = args.ours_overrides
        extra["gate"] = "first losses equal (fp32 rel 1e-4)" if same_model else "none: the peer's model differs"
        # every step's loss on both sides (ours where it was logged): equal batches keep them close for a while
        extra["losses_ours"] = [None if x is None else round(float(x), 6) for x in res["ours_losses"]]
        extra["losses_peer"] = [round(x, 6) for x in res["hf_losses"]]
    print(
        f"first-step loss ours {ours_loss:.6f} {other} {hf_loss:.6f} ({'equal' if same_model else 'not gated'}); "
        f"{tokens} tokens/iteration; "
        f"ours {tokens / median(ours_t):.0f} tok/s (median {median(ours_t):.3f} s) vs "
        f"{other} {tokens / median(hf_t):.0f} tok/s (median {median(hf_t):.3f} s); load {os.getloadavg()[0]:.2f}"
    )
    report.finish(
        ratio,
        f"ours tokens/s / {other} tokens/s (median of per-round ratios)",
        save=args.save,
        shape=args.shape,
        layers=config["num_layers"],
        hidden=config["hidden_size"],
        seq=config["seq_length"],
        micro_batch=config["train_micro_batch_size_per_gpu"],
        tokens_per_iteration=tokens,
        median_ours_s=round(median(ours_t), 4),
        median_hf_s=round(median(hf_t), 4),
        ours_tokens_per_s=round(tokens / median(ours_t), 1),
        hf_tokens_per_s=round(tokens / median(hf_t), 1),
        first_loss_ours=ours_loss,
        first_loss_hf=hf_loss,
        per_round_ratios=[round(h / o, 3) for h, o in zip(hf_t, ours_t, strict=True)],
        **extra,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
