"""Tokenise chat-formatted JSONL with a local HF tokenizer's chat template into GPT-NeoX ``.bin``/``.idx`` streams.

    python tools/datasets/preprocess_data_with_chat_template.py --input sft.jsonl --output-prefix data/sft \\
        --tokenizer-path hf_tokenizer_dir --jsonl-keys messages

writes ``data/sft_messages_document`` (tokens), ``data/sft_messages_label_document`` (token id where trained,
-100 where masked) and, with ``--reward-key``, ``data/sft_messages_reward_document`` (float32). Pairwise data:
``--jsonl-keys chosen rejected``. Reward models: ``--for-rm``.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import megatron.setup_check  # noqa: F401  (first: a one-line hint when the environment is not set up)
from megatron.data.chat_template import ChatPreprocessConfig, preprocess_chat
from megatron.data.staged_output import clean_exit_on_sigterm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """GPT-NeoX's flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="comma-separated .jsonl files")
    p.add_argument("--jsonl-keys", nargs="+", default=["messages"], help="keys holding conversations")
    p.add_argument("--num-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--tokenizer-path", required=True, help="local HF tokenizer folder with a chat template")
    p.add_argument("--generation-role", default="assistant", help="role whose turns are trained")
    p.add_argument("--only-last", action="store_true", help="train only the last generation-role turn")
    p.add_argument("--no-mask", action="store_true", help="write no label stream (train every token)")
    p.add_argument("--for-rm", action="store_true", help="append EOS and train only it (reward-model data)")
    p.add_argument("--reward-key", default=None, help="JSON key of a per-document reward (KTO)")
    p.add_argument("--binary-reward", action="store_true", help="reward > 0 (or true) -> 1, else -1")
    p.add_argument("--output-prefix", required=True, help="output prefix (no suffix)")
    p.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes")
    p.add_argument(
        "--render-timeout",
        type=float,
        default=10.0,
        help="seconds one conversation may take to render with the chat template (0 = no limit)",
    )
    p.add_argument("--log-interval", type=int, default=100, help="accepted for GPT-NeoX compatibility")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point: prints what was written, or the error, and returns the exit code."""
    a = parse_args(argv)
    cfg = ChatPreprocessConfig(
        inputs=[s for s in a.input.split(",") if s],
        output_prefix=a.output_prefix,
        tokenizer_path=a.tokenizer_path,
        jsonl_keys=a.jsonl_keys,
        generation_role=a.generation_role,
        only_last=a.only_last,
        no_mask=a.no_mask,
        for_rm=a.for_rm,
        reward_key=a.reward_key,
        binary_reward=a.binary_reward,
        num_docs=a.num_docs,
        workers=a.workers,
        render_timeout=a.render_timeout,
    )
    try:
        result = preprocess_chat(cfg)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Processed {result['documents']} documents")
    for prefix in result["outputs"]:
        print(f"Wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    clean_exit_on_sigterm()
    raise SystemExit(main())
