"""Peer runner ``torchtitan``: torchtitan's own ``Trainer.train()`` on a Llama-3 model shaped like our Pythia shape.

    python torchtitan_runner.py --shape pythia-14m --seq 256 --micro-batch 8 --threads 2 --init-hf DIR [--compile]

Not the same model (no loss gate; compare tokens/s): torchtitan has no GPT-NeoX, so this is its ``llama3``
``debugmodel`` recipe (``llama3_debugmodel()``: AdamW lr 8e-4 with 2 warm-up steps then linear decay, grad-norm
clipping 1.0, its chunked cross-entropy, fp32, loss logged every step) with the model's dims set to the shape's
layers / width / heads and the vocabulary of DIR's ``config.json`` (50304), untied embeddings like Pythia. What
still differs from Pythia: RMSNorm instead of LayerNorm, SwiGLU (3 matrices, hidden 8d/3 rounded up to 32, about
the 2 x 4d GELU MLP's parameters) instead of GELU, full-width rotary instead of 25 %, sequential instead of
parallel residual, no biases.

The smallest adaptation that runs it on a CPU in one gloo process:

- torchtitan picks ``torch._utils._get_available_device_type() or "cuda"`` as its device, so on a CPU-only host it
  would call CUDA; the runner makes that lookup answer ``"cpu"`` before importing torchtitan, and sets the
  one-process ``RANK``/``WORLD_SIZE``/``MASTER_*`` environment (``init_process_group`` then picks gloo for cpu);
- its memory monitor calls ``get_device_name``/``memory_stats``/... that ``torch.cpu`` lacks: no-op shims;
- attention: its language-model backends are FlexAttention and varlen, and FlexAttention has no backward on CPU
  (torch 2.13 ``NotImplementedError``): its own ``ScaledDotProductAttention`` module (causal) replaces it;
- after step 1 it synchronises with ``barrier(device_ids=["cpu"])`` (``TypeError``) and calls
  ``torch.distributed.set_timeout``, which torch 2.13 lacks: that hook is skipped (one process);
- ``import triton`` happens unconditionally (models.common -> moe): the venv has ``triton`` (imported only);
- the tokenizer and dataloader configs are replaced by the driver's batches (``{"input": row[:-1], "positions":
  0..S-1}`` and labels ``row[1:]``: one document per row, causal attention as on our side), handed over one at a
  time when the trainer asks;
- checkpointing, validation, activation checkpointing (the recipe's selective AC recomputes, which a 14M/160M
  model does not need and our side does not do) and CUDA graphs are off;
- ``train_step`` hands the loss of ``forward_backward_step`` to the protocol when it returns.

``--compile`` sets the recipe's ``compile.enable`` (torchtitan compiles each transformer block and the loss).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import SHAPE_DIMS, runner_arguments, serve
from step_handoff import Handoff


def _one_line_error(message: str) -> NoReturn:
    print(f"torchtitan_runner.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_device_module_shims(torch: Any) -> None:
    """The memory-monitor calls torchtitan makes on its device module, which ``torch.cpu`` lacks: no-op answers."""
    import types

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shims = {
        "get_device_name": lambda *a: "cpu",
        "get_device_properties": lambda *a: types.SimpleNamespace(total_memory=total),
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda *a: None,
        "memory_stats": lambda *a: {},
    }
    for name, fn in shims.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)


def build_trainer(args: Any, vocab: int, handoff: Handoff) -> tuple[Any, Any]:
    """torchtitan's debugmodel recipe with the shape's dims and the driver's batches; returns (trainer, facts)."""
    import torch
    import torchtitan
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.trainer import Trainer

    layers, dim, heads = SHAPE_DIMS[args.shape]
    seq, micro_batch = args.seq, args.micro_batch

    def shaped_model(attn_backend: str, tp_gemm_backend: str = "default") -> Any:
        # llama3's _debugmodel with the shape's dims (its private helpers keep torchtitan's inits)
        return llama3.Llama3Model.Config(
            dim=dim,
            vocab_size=vocab,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
            layers=llama3._build_llama3_layers(
                fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=max(seq, 2048), theta=500000, scaling="llama"),
                attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend,
            ),
        )  # fmt: skip

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            super().__init__()

        def encode(self, *a: Any, **k: Any) -> list[int]:
            raise NotImplementedError("the driver sends token ids")

        def decode(self, *a: Any, **k: Any) -> str:
            raise NotImplementedError("the driver sends token ids")

        def get_vocab_size(self) -> int:
            return vocab

    class DriverBatches(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Any = None, **kwargs: Any) -> None:
            self.positions = torch.arange(seq).expand(micro_batch, seq)

        def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
            while True:
                rows = handoff.next_rows()
                if rows is None:
                    return
                if len(rows) != micro_batch or any(len(r) != seq + 1 for r in rows):
                    raise ValueError(f"a request must carry {micro_batch} rows of {seq + 1} token ids")
                tokens = torch.tensor(rows, dtype=torch.long)
                yield {"input": tokens[:, :-1].contiguous(), "positions": self.positions}, tokens[:, 1:].contiguous()

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    class DriverTrainer(Trainer):
        last_loss: Any = None

        def forward_backward_step(self, **kwargs: Any) -> Any:
            loss = super().forward_backward_step(**kwargs)
            self.last_loss = loss.detach()
            return loss

        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            handoff.step_done(float(self.last_loss))

    def set_pg_timeouts_one_process(timeout: Any, parallel_dims: Any) -> None:
        # after step 1 torchtitan synchronises with barrier(device_ids=[device_module.current_device()]) (on cpu
        # "cpu" where an int is expected: TypeError), then calls torch.distributed.set_timeout, which torch 2.13
        # does not have (AttributeError; torchtitan 0.3.0 is built against a newer torch). One process has no
        # peer to wait for or time out on: nothing to do
        return None

    dist_utils.set_pg_timeouts = set_pg_timeouts_one_process
    cfg = llama3_debugmodel()
    spec = llama3.model_registry("debugmodel")
    spec.model = shaped_model(attn_backend="flex")
    # FlexAttention has no backward on CPU (torch 2.13: NotImplementedError): its SDPA module, causal, instead
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.flavor = f"{args.shape}-shaped"
    cfg.model_spec = spec
    cfg.loss.loss_fn.global_vocab_size = vocab
    cfg.hf_assets_path = args.init_hf
    cfg.dump_folder = tempfile.mkdtemp(prefix="torchtitan_runner_")
    cfg.tokenizer = NoTokenizer.Config()
    cfg.dataloader = DriverBatches.Config()
    cfg.training.local_batch_size = micro_batch
    cfg.training.seq_len = seq
    cfg.training.steps = args.max_steps
    cfg.training.dtype = "float32"
    cfg.training.disable_cuda_graphs = True
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.activation_checkpoint = None
    cfg.compile.enable = bool(args.compile)
    trainer = DriverTrainer(cfg)
    model = trainer.model_parts[0]
    group = cfg.optimizer.param_groups[0]
    facts = {
        "peer": "torchtitan-compiled" if args.compile else "torchtitan",
        "version": getattr(torchtitan, "__version__", "?"),
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "model": f"llama3 {layers} layers, d={dim}, {heads} heads, SwiGLU {compute_ffn_hidden_dim(dim, multiple_of=32)}"
        f", vocab {vocab}, untied, causal SDPA",
        "optimizer": f"{group.optimizer_name} ({cfg.optimizer.implementation})",
        "lr": group.optimizer_kwargs["lr"],
        "betas": list(group.optimizer_kwargs["betas"]),
        "weight_decay": group.optimizer_kwargs["weight_decay"],
        "lr_schedule": f"{cfg.lr_scheduler.warmup_steps} warm-up steps, then {cfg.lr_scheduler.decay_type} decay",
        "max_norm": cfg.training.max_norm,
        "compile": cfg.compile.enable,
        "threads": torch.get_num_threads(),
        "same_model": False,
    }
    return trainer, facts


def main() -> int:
    p = runner_arguments(__doc__ or "")
    p.add_argument("--max-steps", type=int, default=1000, help="training.steps (the lr schedule's length)")
    p.add_argument("--profile-step", type=int, default=0, help="torch.profiler table of step N on stderr")
    p.error = _one_line_error  # type: ignore[method-assign]
    args = p.parse_args()
    if args.shape not in SHAPE_DIMS:
        _one_line_error(f"unknown --shape {args.shape!r} (valid: {', '.join(SHAPE_DIMS)})")
    try:
        with open(os.path.join(args.init_hf, "config.json"), encoding="utf-8") as f:
            vocab = int(json.load(f)["vocab_size"])
    except (OSError, KeyError, ValueError) as exc:
        _one_line_error(f"--init-hf {args.init_hf}: cannot read vocab_size from config.json ({exc})")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))  # fmt: skip
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # torchtitan's device lookup: "cpu", not "cuda"
    _cpu_device_module_shims(torch)
    torch.set_num_threads(args.threads)
    handoff = Handoff("torchtitan-compiled" if args.compile else "torchtitan", args.profile_step)
    built: queue.Queue[Any] = queue.Queue()
    exit_code = [1]

    def build() -> tuple[Any, dict[str, Any]]:
        torch.set_num_threads(args.threads)
        built.put(None)  # the trainer is built in the main thread (its process group, its compile)
        facts = built_facts.get()
        if isinstance(facts, BaseException):
            raise facts
        return handoff.step, facts

    built_facts: queue.Queue[Any] = queue.Queue()

    def protocol_loop() -> None:
        exit_code[0] = serve(build)
        handoff.stop()

    server = threading.Thread(target=protocol_loop, name="protocol", daemon=True)
    server.start()
    built.get()  # serve has moved stdout away: what torchtitan prints goes to stderr
    try:
        trainer, facts = build_trainer(args, vocab, handoff)
    except Exception as exc:
        built_facts.put(exc)
        server.join()
        return exit_code[0]
    built_facts.put(facts)
    try:
        trainer.train()
        handoff.fail(RuntimeError(f"--max-steps {args.max_steps} reached: the trainer has stopped"))
    except Exception as exc:
        handoff.fail(exc)
    server.join()
    with contextlib.suppress(Exception):  # teardown after the answers were sent: nothing the driver needs
        trainer.close()
    shutil.rmtree(trainer.config.dump_folder, ignore_errors=True)
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())
