"""Training runs on gloo ranks (for tests/e2e/test_train_*.py) and the tiny real dataset they train on."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def tensorboard_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar event under a TensorBoard folder, as logged (a step logged twice appears twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(path), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def deepy_train(
    cfg: dict[str, Any], config_file: Path, world: int, timeout: float = 600, env: dict[str, str] | None = None
) -> str:
    """Write ``cfg`` (a ``tiny_config``) as ``config_file`` for ``world`` local CPU ranks and run
    ``deepy.py train.py`` on it (``env``: variables added to the test's environment); returns its stdout (a failed
    run fails the test with every rank's output)."""
    import yaml

    from tests.harness import PYTHON, run_command

    cfg.pop("global_num_gpus", None)
    cfg["num_gpus"] = world
    config_file.write_text(yaml.safe_dump(cfg))
    return run_command([PYTHON, "deepy.py", "train.py", str(config_file)], timeout=timeout, env=env).stdout


# (max_docs, vocab_size) -> a folder holding the built corpus: built once per test process and copied to each test
_TINY_CORPORA: dict[tuple[int, int], Path] = {}


def _build_tiny_corpus(corpus: Path, max_docs: int, vocab_size: int) -> None:
    """Stdlib corpus → BPE tokenizer → mmap dataset in ``corpus``, with the project's own tools."""
    corpus.mkdir(parents=True, exist_ok=True)
    prefix = corpus / "tiny"
    tokenizer = corpus / "tokenizer.json"
    py = sys.executable
    tools = REPO / "tools" / "datasets"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    jsonl = corpus / "tiny.jsonl"
    tok_args = ["--tokenizer_output_path", tokenizer, "--vocab_size", str(vocab_size)]
    pre_args = ["--tokenizer-type", "HFTokenizer", "--vocab-file", tokenizer, "--append-eod", "--workers", "1"]
    for cmd in (
        [py, tools / "corpora.py", "--output", jsonl, "--max-docs", str(max_docs)],
        [py, tools / "train_tokenizer.py", "--json_input_dir", corpus, *tok_args],
        [py, tools / "preprocess_data.py", "--input", jsonl, "--output-prefix", prefix, *pre_args],
    ):
        subprocess.run([str(c) for c in cmd], check=True, env=env, capture_output=True, timeout=300)


def _tiny_corpus(max_docs: int, vocab_size: int) -> Path:
    """The corpus for these sizes, built on the first call in this process (the tools are deterministic: the
    same files byte for byte every time) and removed when the process exits."""
    key = (max_docs, vocab_size)
    if key not in _TINY_CORPORA:
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="neox-tiny-corpus-"))
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
        _build_tiny_corpus(folder / "corpus", max_docs, vocab_size)
        _TINY_CORPORA[key] = folder / "corpus"
    return _TINY_CORPORA[key]


def make_tiny_data(root: str | Path, max_docs: int = 40, vocab_size: int = 512) -> dict[str, str]:
    """Stdlib corpus → BPE tokenizer → mmap dataset, with the project's own tools (about 4 s, paid once per test
    process and size: later calls copy the built files into ``root``)."""
    import shutil

    corpus = Path(root) / "corpus"
    prefix = corpus / "tiny"
    if not Path(f"{prefix}_text_document.idx").exists():
        corpus.mkdir(parents=True, exist_ok=True)
        for built in sorted(_tiny_corpus(max_docs, vocab_size).iterdir()):
            shutil.copy2(built, corpus / built.name)
    return {"data_path": f"{prefix}_text_document", "vocab_file": str(corpus / "tokenizer.json")}


def tiny_config(data: dict[str, str], world: int = 1, **overrides: Any) -> dict[str, Any]:
    """A 2-layer, hidden-64 GPT on the tiny dataset: a few ms per step on one core."""
    cfg: dict[str, Any] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 32,
        "max_position_embeddings": 32,
        "pos_emb": "rotary",
        "norm": "layernorm",
        "pipe_parallel_size": 0,
        "model_parallel_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        "weight_decay": 0.01,
        "min_lr": 0.0003,
        "lr_decay_style": "cosine",
        "warmup": 0.1,
        "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "train_iters": 8,
        "eval_interval": 4,
        "eval_iters": 2,
        "log_interval": 4,
        "split": "90,5,5",
        "data_impl": "mmap",
        "num_workers": 0,
        "tokenizer_type": "HFTokenizer",
        "make_vocab_size_divisible_by": 64,
        "global_num_gpus": world,
        "seed": 1234,
        # MFU against a given peak: no 0.25 s GEMM calibration in every rank of every run (the calibration itself
        # runs in the runs of shipped and real configs, and in tests/unit/test_threads_and_peak.py)
        "peak_theoretical_tflops": 1.0,
        **data,
    }
    cfg.update(overrides)
    return cfg


def run_pretrain(
    config: dict[str, Any], env: dict[str, str] | None = None, on_step: Callable[[int, Any], None] | None = None
) -> dict[str, Any]:
    """Build NeoXArgs from ``config`` and run ``pretrain`` on this rank (``on_step``: called after every training
    step); returns plain data for the test."""
    import torch.distributed as dist

    os.environ.update(env or {})
    from megatron import mpu
    from megatron.neox_arguments import NeoXArgs
    from megatron.training.pretraining import pretrain

    args = NeoXArgs.from_dict(config)
    result = pretrain(args, on_step=on_step)
    out = {
        "rank": dist.get_rank(),
        "iteration": result.iteration,
        "start_iteration": result.start_iteration,
        "train_losses": result.train_losses,
        "valid": result.valid,
        "test": result.test,
        "saved": result.saved,
        "dp": mpu.get_data_parallel_world_size(),
        "optimizer_class": result.optimizer_class,
        "zero_stage": result.zero_stage,
        "params_dtype": result.params_dtype,
        "skipped_iters": result.skipped_iters,
    }
    mpu.destroy_model_parallel()
    return out


def run_pretrain_many(configs: list[dict[str, Any]], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Several runs one after the other on the same ranks (saves the process start-up of each)."""
    return [run_pretrain(config, env) for config in configs]


def run_pretrain_each(
    configs: list[dict[str, Any]], env: dict[str, str] | None = None
) -> list[tuple[list[float], int] | str]:
    """Several runs on the same ranks; each gives ``(training losses, skipped steps)``, or its error as text (the
    rest still run)."""
    import time
    import traceback

    from megatron import mpu

    out: list[tuple[list[float], int] | str] = []
    for i, config in enumerate(configs):
        start = time.perf_counter()
        try:
            result = run_pretrain(config, env)
            out.append((result["train_losses"], result["skipped_iters"]))
        except Exception as e:  # reported per config by the test
            out.append(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}")
            mpu.destroy_model_parallel()
        print(f"[run_pretrain_each] config {i}: {time.perf_counter() - start:.1f}s {out[-1]}", flush=True)
    return out
