"""Rank functions for tests/e2e/test_gpt_neox_api_flow.py: GPT-NeoX's scripting flow (its tests/common.py
``simulate_deepy_env`` + ``save_random_model``, then generate / finetune / HF conversion) on one CPU rank."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.harness import REPO_ROOT


def _deepy_main_args(config: dict[str, Any], config_file: Path, script: str) -> list[str]:
    """GPT-NeoX's ``simulate_deepy_env``: deepy's parse, then the worker command line."""
    from megatron.neox_arguments import NeoXArgs

    config_file.write_text(yaml.safe_dump(config))
    os.environ.update({"WORLD_SIZE": "1", "RANK": "0"})
    neox_args = NeoXArgs.consume_deepy_args([str(REPO_ROOT / script), str(config_file)])
    return neox_args.get_deepspeed_main_args()


def gpt_neox_flow(config: dict[str, Any], work: str, s3_path: str | None = None) -> dict[str, Any]:
    """Save a random model with ``train_iters: 0`` and ``extra_save_iters: [0]``, generate from it, finetune it,
    load it through ``setup_model_and_optimizer``, and convert it to Hugging Face, all in this process. With
    ``s3_path``, the API's ``save_checkpoint`` also uploads (the S3 endpoint comes from the environment)."""
    sys.path.insert(0, str(REPO_ROOT))
    import generate
    import train
    from megatron.checkpointing import load_checkpoint, save_checkpoint
    from megatron.neox_arguments import NeoXArgs
    from megatron.text_generation_utils import generate_samples_from_prompt
    from megatron.training import setup_model_and_optimizer
    from megatron.utils import is_mp_rank_0

    root = Path(work)
    model_dir = str(root / "random")
    main_args = _deepy_main_args(config, root / "tiny.yml", "train.py")
    out: dict[str, Any] = {"main_args_tail": main_args[-4::2]}
    save_random = {"do_train": False, "train_iters": 0, "save": model_dir, "extra_save_iters": [0]}
    out["train_code"] = train.main(input_args=main_args, overwrite_values=save_random)
    out["saved"] = sorted(p.name for p in Path(model_dir).iterdir())

    prompts = root / "prompts.txt"
    prompts.write_text("hello\nworld\n")
    gen = {
        "load": model_dir,
        "text_gen_type": "input-file",
        "sample_input_file": str(prompts),
        "sample_output_file": str(root / "out.jsonl"),
    }
    gen_args = _deepy_main_args(config, root / "tiny.yml", "generate.py")
    out["generate_code"] = generate.main(input_args=gen_args, overwrite_values={**gen, "maximum_tokens": 4})
    out["generated"] = [json.loads(line) for line in (root / "out.jsonl").read_text().splitlines()]

    finetune = {"load": model_dir, "finetune": True, "train_iters": 2, "save": str(root / "ft"), "checkpoint_factor": 2}
    out["finetune_code"] = train.main(input_args=main_args, overwrite_values=finetune)
    out["finetuned"] = (root / "ft" / "latest").read_text().strip()

    args = NeoXArgs.consume_neox_args(
        input_args=main_args,
        overwrite_values={
            "load": model_dir,
            "save": model_dir,
            "checkpoint_factor": 5,
            "finetune": True,
            **({"s3_path": s3_path} if s3_path else {}),
        },
    )
    args.build_tokenizer()
    model, optimizer, lr_scheduler = setup_model_and_optimizer(neox_args=args, use_cache=True)
    out["loaded_iteration"] = args.iteration
    out["engine_holds_the_lr_schedule"] = model.lr_scheduler is lr_scheduler  # model.step() moves it, as in GPT-NeoX
    out["is_mp_rank_0"] = is_mp_rank_0()
    records = generate_samples_from_prompt(args, model, ["hello"], maximum_tokens=3)
    out["api_generated"] = [r["text"] for r in records]
    save_checkpoint(neox_args=args, iteration=5, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)
    out["latest_after_save"] = (Path(model_dir) / "latest").read_text().strip()
    if s3_path:  # uploaded before save_checkpoint returned, as in GPT-NeoX
        import boto3

        bucket, _, prefix = s3_path.removeprefix("s3://").partition("/")
        listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)
        out["s3_after_save"] = sorted(item["Key"] for item in listed.get("Contents", []))
    out["load_iteration"] = load_checkpoint(
        neox_args=args, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, iteration=0
    )
    return out
