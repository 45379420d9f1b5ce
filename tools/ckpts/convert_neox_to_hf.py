"""Convert a GPT-NeoX checkpoint (any TP/PP layout) into a Hugging Face folder.

    python tools/ckpts/convert_neox_to_hf.py --input_dir ckpts/global_step1000 --config_file configs/125M.yml \
        --output_dir hf_out --precision fp16 --architecture neox

Reads sequential (``mp_rank_XX_model_states.pt``) and pipeline (``layer_LL-model_TT``) checkpoints, merges the TP
shards with each tensor's rule and writes ``config.json``, ``model.safetensors`` and the tokenizer files.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.checkpoint import cli


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """GPT-NeoX's flags (+ ``--overwrite``, ``--row_bias``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="checkpoint dir: .../global_stepN, or the root with 'latest'")
    p.add_argument("--config_file", nargs="*", default=None, help="GPT-NeoX YAML(s); default: the checkpoint's")
    p.add_argument("--output_dir", required=True, help="Hugging Face folder to create")
    p.add_argument("--precision", default="auto", choices=["auto", "fp16", "bf16", "fp32"])
    p.add_argument("--architecture", default="neox", choices=["neox", "llama", "mistral", "mixtral", "mamba"])
    p.add_argument("--no_save_tokenizer", action="store_true", help="do not write tokenizer files")
    p.add_argument("--vocab-is-hf-tokenizer", dest="vocab_is_hf_tokenizer", action="store_true")
    p.add_argument("--pad-token-id", dest="pad_token_id", type=int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    p.add_argument("--row_bias", default="auto", choices=["auto", "effective", "sum"], help=argparse.SUPPRESS)
    return cli.parse_tool_args(p, argv)


def main(input_args: list[str] | None = None, overwrite_values: dict[str, Any] | None = None) -> int:
    """Convert; returns the exit code. GPT-NeoX's signature: ``overwrite_values`` (config keys) override the
    ``--config_file`` values, e.g. ``{"tokenizer_type": ...}``."""
    args = parse_args(input_args)
    if not overwrite_values:
        return _convert(args)
    if not args.config_file:
        raise ValueError("overwrite_values needs --config_file (the values it overrides)")
    with tempfile.TemporaryDirectory() as tmp:
        args.config_file = [cli.merged_config_file(args.config_file, overwrite_values, tmp)]
        return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    cli.apply_tool_args(args)
    from megatron.checkpoint import export_hf, hf_tokenizer, read_checkpoint

    cli.refuse_existing_output_dir(args)
    with cli.progress_bar("reading shards", cli.shard_count(args.input_dir)) as step:
        ckpt = read_checkpoint(args.input_dir, config_files=args.config_file, row_bias=args.row_bias, progress=step)
    assert ckpt.tokenizer is not None  # read with the config files (or the checkpoint's own configs/)
    tokenizer = None if args.no_save_tokenizer else hf_tokenizer(ckpt.tokenizer, args.vocab_is_hf_tokenizer)
    with cli.progress_bar("writing tensors", len(ckpt.state_dict)) as step:
        export_hf(
            ckpt.state_dict,
            ckpt.cfg,
            args.output_dir,
            architecture=args.architecture,
            precision=args.precision,
            tokenizer=tokenizer,
            pad_token_id=args.pad_token_id,
            overwrite=args.overwrite,
            progress=step,
        )
    print(
        f"converted {ckpt.layout.directory} ({ckpt.layout.describe()}, iteration {ckpt.iteration}) -> {args.output_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
