"""The litgpt peer: litgpt's ``GPT`` with its Pythia config, stepped the way ``litgpt pretrain`` steps it.

Runs in benchmarks/peers/.venv-litgpt (``bash benchmarks/peers/setup.sh litgpt``), driven over the protocol in
protocol.py. What comes from litgpt itself: ``Config.from_name`` (pythia-14m / pythia-160m), ``GPT``, the HF
GPT-NeoX weight conversion ``copy_weights_gpt_neox``, ``L.Fabric`` with ``fabric.setup``/``setup_optimizers``/
``backward``/``clip_gradients``, ``instantiate_torch_optimizer("AdamW", fused=<cuda>)``, ``chunked_cross_entropy``,
``get_lr`` with ``TrainArgs.warmup_iters``, the ``RunningMean`` loss tracker and, with ``--compile``,
``torch.compile(model)`` before ``fabric.setup`` as litgpt.pretrain.main does. The body of :func:`build`'s ``step``
is one iteration of litgpt.pretrain.fit's loop (throughput logging and checkpointing left out).

Settings that differ from ``litgpt pretrain``'s defaults, so that both sides do the same work:
- ``precision="32-true"`` (the recipe defaults to bf16-mixed on CPU; the benchmark compares fp32);
- ``global_batch_size = micro_batch_size`` (no gradient accumulation; the recipe's 512/4 would step every 128);
- ``max_seq_length = --seq`` (the recipe's ``train.max_seq_length`` option);
- the weights come from --init-hf (like ``--initial_checkpoint_dir``), so ``initialize_weights`` is not run;
- without ``--compile`` the ``torch.compile(model)`` line is skipped (the recipe always compiles).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from protocol import runner_arguments, serve

LITGPT_NAMES = {"pythia-14m": "pythia-14m", "pythia-160m": "pythia-160m", "small": "pythia-14m"}


def litgpt_config(shape: str, hf: dict[str, Any]) -> tuple[Any, list[str]]:
    """litgpt's own config for the shape, and where it differs from the exported model (field: litgpt vs ours)."""
    from litgpt.config import Config

    overrides: dict[str, Any] = {}
    if shape == "small":  # the quick-check shape: litgpt's pythia-14m, shrunk to the exported model's size
        overrides = {
            "n_layer": hf["num_hidden_layers"],
            "n_embd": hf["hidden_size"],
            "n_head": hf["num_attention_heads"],
        }
    cfg = Config.from_name(LITGPT_NAMES[shape], **overrides)
    checks = [
        ("n_layer", cfg.n_layer, hf["num_hidden_layers"]),
        ("n_embd", cfg.n_embd, hf["hidden_size"]),
        ("n_head", cfg.n_head, hf["num_attention_heads"]),
        ("padded_vocab_size", cfg.padded_vocab_size, hf["vocab_size"]),
        ("intermediate_size", cfg.intermediate_size, hf["intermediate_size"]),
        ("rotary_percentage", cfg.rotary_percentage, _rope(hf, "partial_rotary_factor", hf.get("rotary_pct"))),
        ("parallel_residual", cfg.parallel_residual, hf["use_parallel_residual"]),
        ("norm_eps", cfg.norm_eps, hf["layer_norm_eps"]),
        ("rope_base", cfg.rope_base, _rope(hf, "rope_theta", hf.get("rotary_emb_base"))),
        ("gelu_approximate", cfg.gelu_approximate, {"gelu": "none", "gelu_new": "tanh"}.get(hf["hidden_act"], "?")),
        ("bias", cfg.bias, hf.get("attention_bias", True)),
        ("lm_head_bias", cfg.lm_head_bias, False),
        ("tied embeddings", False, hf.get("tie_word_embeddings", False)),
    ]
    diffs = [f"{name}: litgpt {a!r} vs ours {b!r}" for name, a, b in checks if a != b]
    return cfg, diffs


def _rope(hf: dict[str, Any], key: str, default: Any) -> Any:
    """A rotary field: transformers 5 nests them in ``rope_parameters``, the Hub's Pythia configs keep them flat."""
    params = hf.get("rope_parameters") or {}
    return params.get(key, hf.get(key, default))


def build(args: Any) -> tuple[Any, dict[str, Any]]:
    import lightning as L
    import litgpt
    import torch
    from litgpt.args import TrainArgs
    from litgpt.model import GPT
    from litgpt.pretrain import get_lr
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_gpt_neox
    from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer, num_parameters
    from safetensors.torch import load_file
    from torchmetrics.aggregation import RunningMean

    torch.set_num_threads(args.threads)
    with open(os.path.join(args.init_hf, "config.json")) as f:
        hf_cfg = json.load(f)
    config, diffs = litgpt_config(args.shape, hf_cfg)
    # litgpt.pretrain.setup's TrainArgs defaults, with the three settings the module docstring names
    train = TrainArgs(
        save_interval=1000, log_interval=1, global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch,
        max_tokens=int(3e12), max_norm=1.0, min_lr=4e-5, lr_warmup_steps=2000, tie_embeddings=False,
        max_seq_length=args.seq,
    )  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="auto", precision="32-true", loggers=[])
    fabric.launch()
    fabric.seed_everything(42)

    with fabric.init_module(empty_init=False):
        model = GPT(config)
    hf_weights = {k: v for k, v in load_file(os.path.join(args.init_hf, "model.safetensors")).items()}
    state_dict: dict[str, Any] = {}
    copy_weights_gpt_neox(config, state_dict, hf_weights)
    model.load_state_dict(state_dict, strict=True)
    model.max_seq_length = train.max_seq_length
    params = num_parameters(model)

    if args.compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    optimizer = instantiate_torch_optimizer("AdamW", model.parameters(), fused=fabric.device.type == "cuda")
    optimizer = fabric.setup_optimizers(optimizer)

    devices, num_nodes = 1, 1
    accum = train.gradient_accumulation_iters(devices, num_nodes)
    max_iters = (train.max_tokens // fabric.world_size) // (train.micro_batch_size * model.max_seq_length)
    warmup_iters = train.warmup_iters(devices, num_nodes, max_iters, None)
    running_loss = RunningMean(window=accum, sync_on_compute=False).to(fabric.device)
    state = {"iter_num": 0, "step_count": 0}
    seq = model.max_seq_length

    def step(rows: list[list[int]]) -> float:
        train_data = torch.tensor(rows, dtype=torch.int64)
        # --- one iteration of litgpt.pretrain.fit ---
        lr = get_lr(optimizer.defaults["lr"], state["iter_num"], warmup_iters, max_iters, train.min_lr)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        state["iter_num"] += 1
        input_ids = train_data[:, 0:seq].contiguous().long()
        targets = train_data[:, 1 : (seq + 1)].contiguous().long()
        is_accumulating = state["iter_num"] % accum != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / accum)
        running_loss.update(loss.detach())
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
        if state["iter_num"] % (train.log_interval * accum) == 0:
            return float(running_loss.compute().item())  # the recipe logs every iteration by default
        return float(loss.detach().item())

    opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    facts = {
        "peer": "litgpt-compiled" if args.compile else "litgpt",
        "version": litgpt.__version__ if hasattr(litgpt, "__version__") else _dist_version("litgpt"),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "params": params,
        "litgpt_config": LITGPT_NAMES[args.shape],
        "config_diffs": diffs,
        "optimizer": f"{type(opt).__name__}({ {k: v for k, v in opt.defaults.items() if k in ('lr', 'betas', 'eps', 'weight_decay', 'fused', 'foreach')} })",
        "max_norm": train.max_norm,
        "lr_schedule": f"linear warmup {warmup_iters} iters from 0, cosine to {train.min_lr}",
        "loss": "chunked_cross_entropy(chunk_size=128)",
        "precision": "32-true",
        "threads": torch.get_num_threads(),
    }
    return step, facts


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> int:
    args = runner_arguments(__doc__.splitlines()[0]).parse_args()
    return serve(lambda: build(args))


if __name__ == "__main__":
    sys.exit(main())
