"""Convert a local Hugging Face GPTNeoX / Llama / Mistral folder into a GPT-NeoX checkpoint for any TP/PP.

    python tools/ckpts/convert_hf_to_neox.py --input_dir HF_DIR --output_dir OUT --tp 2 --pp 1

Writes ``OUT/latest``, ``OUT/global_step0/...``, ``OUT/neox_config.yml`` (the matching model keys) and, when the
folder has a ``tokenizer.json``, ``OUT/tokenizer/`` + ``OUT/tokenizer.yml``. Fine-tune with
``python deepy.py train.py OUT/neox_config.yml [OUT/tokenizer.yml] my_setup.yml`` and ``load: OUT``, ``finetune: true``.
Reads only safetensors or ``weights_only`` torch files and never runs the folder's code (``auto_map`` is refused);
the config's sizes are checked against the weight shapes first (``megatron.checkpoint.hf_checks``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.checkpoint import cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="local Hugging Face model folder")
    p.add_argument("--output_dir", required=True, help="NeoX checkpoint root to create")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (model_parallel_size)")
    p.add_argument("--pp", type=int, default=1, help="pipe_parallel_size (0 = sequential model files)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp16", "bf16", "fp32"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    return cli.parse_tool_args(p, argv)


def main(argv: list[str] | None = None) -> int:
    """Convert; returns the exit code."""
    args = parse_args(argv)
    cli.apply_tool_args(args)
    from megatron.checkpoint import (
        TargetLayout,
        hf_tokenizer_vocab,
        import_hf,
        neox_config_yaml,
        resize_vocab,
        tokenizer_files,
        tokenizer_identity,
        tokenizer_yaml,
        write_checkpoint,
    )

    target = TargetLayout(tp=args.tp, pp=args.pp)
    cli.refuse_existing_output_dir(args)
    sd, cfg, arch, _ = import_hf(args.input_dir, args.precision)
    if cfg.vocab_rows % target.tp:  # pad the vocabulary rows (zeros) so that every TP rank gets a slice
        rows = -(-cfg.vocab_rows // target.tp) * target.tp
        print(f"vocab_size {cfg.padded_vocab_size} is not divisible by tp={target.tp}: padding to {rows} rows")
        sd = {k: resize_vocab(k, v, rows) for k, v in sd.items()}
        cfg = cfg.replace(padded_vocab_size=rows)
    extra = tokenizer_files(args.input_dir)
    tokenizer = os.path.abspath(os.path.join(args.output_dir, "tokenizer", "tokenizer.json")) if extra else None
    extra["neox_config.yml"] = neox_config_yaml(cfg, target.tp, target.pp)
    if tokenizer:
        extra["tokenizer.yml"] = tokenizer_yaml(tokenizer)
    ckpt_args: dict[str, Any] = {"make_vocab_size_divisible_by": cfg.vocab_rows // target.tp}
    if tokenizer:  # recorded like a training run does, so that a finetune with another tokenizer is refused
        ckpt_args.update(
            tokenizer_type="HFTokenizer", **tokenizer_identity(hf_tokenizer_vocab(args.input_dir), tokenizer)
        )
    with cli.progress_bar("writing shards") as step:
        write_checkpoint(
            sd,
            cfg,
            args.output_dir,
            target,
            iteration=0,
            client_state={"args": ckpt_args},
            config_files={k: v for k, v in extra.items() if k.endswith(".yml")},
            extra_files=extra,
            overwrite=args.overwrite,
            progress=step,
        )
    print(f"converted {arch} model {args.input_dir} -> {args.output_dir} (tp={target.tp}, pp={target.pp})")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
