"""Peer runner ``hf-fused`` / ``hf-compiled``: ``GPTNeoXForCausalLM`` trained by the real ``transformers.Trainer``.

    python hf_runner.py --shape pythia-14m --seq 256 --micro-batch 8 --threads 2 --init-hf DIR [--compile]

The model is loaded from the GPTNeoX export in DIR (our initial weights). ``Trainer.train()`` itself runs the
steps: its default optimizer (``TrainingArguments.optim``; ``adamw_torch_fused`` with torch >= 2.8), default lr
(5e-5) with its default linear schedule over ``--max-steps``, weight decay 0, ``max_grad_norm`` 1.0 (accelerate's
``clip_grad_norm_``), its ``compute_loss`` (the model's own causal-LM loss), its callbacks and bookkeeping.
``--compile`` sets ``torch_compile=True``, so accelerate's ``prepare`` compiles the model the way Trainer does.

The adaptation, and the only one, that lets the driver feed one batch per request:

- ``get_train_dataloader`` returns the driver's batches, handed over one at a time when the Trainer asks for the
  next one (accelerate's dataloader reads one batch ahead, which would wait for a request the driver only sends
  after this step's answer). A batch is what a padding-free collator gives: ``input_ids = row[:-1]`` and
  ``shift_labels = row[1:]`` (transformers' hook for labels already shifted, so the last position keeps its target
  as on our side), ``labels = input_ids`` only so the model computes its loss (ignored when ``shift_labels`` is set).
- ``training_step`` keeps the loss it returns, and a callback's ``on_step_end`` hands it to the protocol.

``Trainer.train()`` runs in the main thread; the protocol loop (``serve``) in a second thread that builds the
Trainer, passes each request to the dataloader and waits for ``on_step_end``. ``seconds`` therefore covers fetching
and collating the batch, the callbacks, forward, loss, backward, clipping, ``optimizer.step``, the scheduler and
``zero_grad``. Non-protocol settings: ``save_strategy="no"`` (no checkpoint mid-benchmark), ``report_to="none"``,
``use_cpu=True``, output into a temporary folder.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from protocol import SHAPE_DIMS, runner_arguments, serve
from step_handoff import Handoff


def _one_line_error(message: str) -> NoReturn:
    print(f"hf_runner.py: {message}", file=sys.stderr)
    raise SystemExit(2)


class DriverBatches:
    """The Trainer's train dataloader: one batch per driver request, taken only when the Trainer asks for it."""

    def __init__(self, seq: int, micro_batch: int, handoff: Handoff) -> None:
        self.seq, self.micro_batch, self.handoff = seq, micro_batch, handoff

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        while True:
            rows = self.handoff.next_rows()
            if rows is None:  # the protocol ended (the next epoch's iterator ends at once too)
                return
            if len(rows) != self.micro_batch or any(len(r) != self.seq + 1 for r in rows):
                raise ValueError(
                    f"a request must carry {self.micro_batch} rows of {self.seq + 1} token ids (--micro-batch, "
                    f"--seq + 1), got {len(rows)} rows of lengths {sorted({len(r) for r in rows})}"
                )
            tokens = torch.tensor(rows, dtype=torch.long)
            inputs = tokens[:, :-1].contiguous()
            yield {"input_ids": inputs, "labels": inputs, "shift_labels": tokens[:, 1:].contiguous()}


def build_trainer(args: Any, batches: DriverBatches) -> tuple[Any, dict[str, Any]]:
    """The Trainer over the exported model, and the facts for the ready line."""
    import accelerate
    import torch
    import transformers

    class DriverTrainer(transformers.Trainer):
        last_loss: Any = None

        def get_train_dataloader(self) -> Any:
            return batches

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            self.last_loss = super().training_step(model, inputs, num_items_in_batch)
            return self.last_loss

    class ReportStep(transformers.TrainerCallback):
        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            batches.handoff.step_done(float(trainer.last_loss))

    model = transformers.GPTNeoXForCausalLM.from_pretrained(args.init_hf, dtype=torch.float32, trust_remote_code=False)
    cfg = model.config
    dims = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads)
    if dims != SHAPE_DIMS[args.shape]:
        raise ValueError(f"{args.init_hf}/config.json has (layers, hidden, heads) {dims}, --shape {args.shape} "
                         f"is {SHAPE_DIMS[args.shape]}")  # fmt: skip
    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_runner_"),
        per_device_train_batch_size=args.micro_batch,
        max_steps=args.max_steps,
        torch_compile=bool(args.compile),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
    )
    trainer = DriverTrainer(model=model, args=targs, callbacks=[ReportStep()])
    facts = {
        "peer": "hf-compiled" if args.compile else "hf-fused",
        "version": transformers.__version__,
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "optim": str(getattr(targs.optim, "value", targs.optim)),
        "lr": targs.learning_rate,
        "lr_scheduler": str(getattr(targs.lr_scheduler_type, "value", targs.lr_scheduler_type)),
        "betas": [targs.adam_beta1, targs.adam_beta2],
        "weight_decay": targs.weight_decay,
        "max_grad_norm": targs.max_grad_norm,
        "max_steps": targs.max_steps,
        "torch_compile": targs.torch_compile,
        "dropout": [cfg.hidden_dropout, cfg.attention_dropout],
        "threads": torch.get_num_threads(),
    }
    return trainer, facts


def main() -> int:
    p = runner_arguments(__doc__ or "")
    p.add_argument("--max-steps", type=int, default=1000, help="TrainingArguments.max_steps (the linear decay's end)")
    p.add_argument("--profile-step", type=int, default=0, help="torch.profiler table of step N on stderr")
    p.error = _one_line_error  # type: ignore[method-assign]
    args = p.parse_args()
    if args.shape not in SHAPE_DIMS:
        _one_line_error(f"unknown --shape {args.shape!r} (valid: {', '.join(SHAPE_DIMS)})")
    if not os.path.isfile(os.path.join(args.init_hf, "config.json")):
        _one_line_error(f"--init-hf {args.init_hf}: no config.json (a GPTNeoX export: config.json + model.safetensors)")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # one process of its own: a driver rank's RANK/WORLD_SIZE/MASTER_PORT would make accelerate join its group
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    import torch

    torch.set_num_threads(args.threads)
    handoff = Handoff("hf-compiled" if args.compile else "hf-fused", args.profile_step)
    batches = DriverBatches(args.seq, args.micro_batch, handoff)
    built: queue.Queue[Any] = queue.Queue()
    exit_code = [1]

    def build() -> tuple[Any, dict[str, Any]]:
        torch.set_num_threads(args.threads)
        try:
            trainer, facts = build_trainer(args, batches)
        except BaseException:
            built.put(None)
            raise
        built.put(trainer)
        return handoff.step, facts

    def protocol_loop() -> None:
        exit_code[0] = serve(build)
        built.put(None)  # in case build never ran to the end
        handoff.stop()

    server = threading.Thread(target=protocol_loop, name="protocol", daemon=True)
    server.start()
    trainer = built.get()
    if trainer is not None:
        try:
            trainer.train()
            handoff.fail(RuntimeError(f"--max-steps {args.max_steps} reached: the Trainer has stopped"))
        except Exception as exc:  # serve's step raises it: the driver gets the one-line error
            handoff.fail(exc)
    server.join()
    if trainer is not None:
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())
