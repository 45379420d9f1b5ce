"""Post-training end to end on the CPU: chat JSONL → preprocess_data_with_chat_template → SFT / DPO / RM / KTO runs,
at 1 rank and at TP=2 / DP=2 (same first losses as 1 rank in fp32)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from megatron.data.chat_template import ChatPreprocessConfig, preprocess_chat
from tests.distributed.fns_post_training import run_precompute_then_train, run_recorded_many
from tests.distributed.fns_train import tiny_config
from tests.harness import run_distributed
from tests.post_training_data import kto_rows, make_chat_tokenizer, pair_rows, sft_rows, write_jsonl

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("post")
    tok = make_chat_tokenizer(root)

    def prep(name: str, rows: list[dict], **kw: Any) -> str:
        jsonl = write_jsonl(root / f"{name}.jsonl", rows)
        preprocess_chat(ChatPreprocessConfig([str(jsonl)], str(root / name), str(tok), **kw))
        return str(root / name)

    return {
        "tok": tok,
        "sft": prep("sft", sft_rows(20)),
        "dpo": prep("dpo", pair_rows(20), jsonl_keys=["chosen", "rejected"]),
        "rm": prep("rm", pair_rows(20), jsonl_keys=["chosen", "rejected"], for_rm=True),
        "kto": prep("kto", kto_rows(20), reward_key="reward"),
    }


def _base(d: dict[str, Any], world: int = 1, **kw: Any) -> dict[str, Any]:
    cfg = tiny_config(
        {"vocab_file": str(d["tok"] / "tokenizer.json")},
        world=world,
        seq_length=64,
        max_position_embeddings=64,
        pack_impl="unpacked",
        eval_interval=100,
        eval_iters=1,
        log_interval=100,
        warmup=0.0,
    )
    cfg.pop("split")
    cfg.update(kw)
    return cfg


def _lm(prefix: str, key: str, reward: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for split in ("train", "valid", "test"):
        out[f"{split}_data_paths"] = [f"{prefix}_{key}_document"]
        out[f"{split}_label_data_paths"] = [f"{prefix}_{key}_label_document"]
        if reward:
            out[f"{split}_reward_data_paths"] = [f"{prefix}_{key}_reward_document"]
    return out


def _pairs(prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {"dataset_impl": "pairwise"}
    for split in ("train", "valid", "test"):
        for side, key in (("pos", "chosen"), ("neg", "rejected")):
            out[f"{side}_{split}_data_paths"] = [f"{prefix}_{key}_document"]
            out[f"{side}_{split}_label_data_paths"] = [f"{prefix}_{key}_label_document"]
    return out


def configs(d: dict[str, Any], world: int = 1, iters: int = 20, **kw: Any) -> dict[str, dict[str, Any]]:
    return {
        "sft": _base(d, world, train_iters=iters, **_lm(d["sft"], "messages"), **kw),
        "dpo": _base(d, world, train_iters=iters, train_impl="dpo", dpo_beta=0.1, **_pairs(d["dpo"]), **kw),
        "rm": _base(d, world, train_iters=iters, train_impl="rm", z_loss=0.01, **_pairs(d["rm"]), **kw),
        "kto": _base(d, world, train_iters=iters, train_impl="kto", **_lm(d["kto"], "messages", True), **kw),
    }


def _decode(tok: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok)).decode(ids)


def test_sft_dpo_rm_kto_one_rank(data: dict[str, Any], tmp_path: Path) -> None:
    cfgs = configs(data)
    # The reward model starts from the SFT model's checkpoint (non-strict: the LM head is replaced by rm_linear).
    cfgs["sft"].update(save=str(tmp_path / "sft_ckpt"), checkpoint_factor=1000)
    cfgs["rm"].update(load=str(tmp_path / "sft_ckpt"), finetune=True, save=str(tmp_path / "rm_ckpt"))
    # DPO from the SFT model too: its reference is a frozen copy of the loaded weights.
    cfgs["dpo"].update(load=str(tmp_path / "sft_ckpt"), finetune=True)
    cfgs["rm"]["checkpoint_factor"] = 1000
    sft, dpo, rm, kto = run_distributed(run_recorded_many, 1, list(cfgs.values()), timeout=600)[0]
    # SFT: the first loss was computed on exactly the assistant answers
    batch = sft["sft_batch"]
    for targets, mask in zip(batch["targets"], batch["mask"]):
        trained = [t for t, m in zip(targets, mask) if m > 0]
        assert _decode(data["tok"], trained).endswith("<|endoftext|>\n")
        assert _decode(data["tok"], trained).removesuffix("<|endoftext|>\n") in {
            "It is noon, my lord.", "Peace.", "The citizen speaks.", "Richard, my lord.", "One, two, three.",
        }  # fmt: skip
    assert sft["train_losses"][-1] < 0.7 * sft["train_losses"][0]
    # DPO: exactly log 2 at step 0 (reference = policy), then the margin rises
    assert dpo["train_losses"][0] == pytest.approx(math.log(2.0), abs=1e-6)
    margins = [m["train/margins"] for m in dpo["metrics"]]
    # the reference runs without autograd (biases fused into the GEMM): equal to the policy up to rounding
    assert abs(margins[0]) < 1e-6 and margins[-1] > 0.5 and dpo["train_losses"][-1] < dpo["train_losses"][0]
    assert {"train/chosen_rewards", "train/rejected_rewards", "train/reward_acc"} <= set(dpo["metrics"][0])
    # RM: accuracy on the training pairs above chance by the end
    acc = [m["train/accuracy"] for m in rm["metrics"]]
    assert sum(acc[-5:]) / 5 > 0.8 and rm["train_losses"][-1] < rm["train_losses"][0]
    assert {"train/pos_values", "train/neg_values", "train/margin"} <= set(rm["metrics"][0])  # GPT-NeoX's names
    # KTO: runs, starts at 0.5 per example (log-ratio 0, KL 0), and moves
    assert kto["train_losses"][0] == pytest.approx(0.5, abs=1e-6)
    assert all(math.isfinite(x) for x in kto["train_losses"]) and kto["train_losses"][-1] < 0.5
    assert {"train/kl", "train/policy_rewards", "train/pos_policy_logp"} <= set(kto["metrics"][0])
    assert dpo["valid"] and rm["test"]
    # The reward model exports as GPTNeoXForSequenceClassification and still prefers the chosen answers
    hf_dir = tmp_path / "rm_hf"
    spec = importlib.util.spec_from_file_location("to_hf", REPO / "tools/ckpts/convert_neox_to_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args = ["--input_dir", str(tmp_path / "rm_ckpt"), "--output_dir", str(hf_dir), "--precision", "fp32"]
    assert tool.main([*args, "--vocab-is-hf-tokenizer"]) == 0
    _check_hf_reward_model(hf_dir, data["tok"])


def _check_hf_reward_model(hf_dir: Path, tok_dir: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(hf_dir))
    assert type(model).__name__ == "GPTNeoXForSequenceClassification" and model.config.num_labels == 1
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    wins = 0
    for row in pair_rows(5):
        scores = []
        for key in ("chosen", "rejected"):
            ids = tok.apply_chat_template(row[key], tokenize=True, return_dict=False)
            with torch.no_grad():
                scores.append(model(torch.tensor([ids])).logits[0, 0].item())
        wins += scores[0] > scores[1]
    assert wins >= 4


def test_tp2_and_dp2_match_one_rank(data: dict[str, Any]) -> None:
    one = {k: c for k, c in configs(data, iters=2, eval_iters=0).items() if k != "sft"}
    two = {k: c for k, c in configs(data, world=2, iters=2, eval_iters=0).items() if k != "sft"}
    tp = [{**c, "model_parallel_size": 2} for c in two.values()]
    dp = [{**c, "train_micro_batch_size_per_gpu": 2} for c in two.values()]
    # KTO's KL reference point is a statistic of the micro-batch: DP=2 with micro-batch 4 per rank sees the same
    # micro-batches as one rank with micro-batch 4 and 2 accumulation steps (global batch 8 in both).
    dp[2] = {**two["kto"], "train_micro_batch_size_per_gpu": 4}
    kto_gas = {**one["kto"], "gradient_accumulation_steps": 2}
    # DPO in bf16 with ZeRO-1 runs too (the DPO loss itself is computed in fp32: dpo_fp32)
    bf16 = {**one["dpo"], "precision": "bfloat16", "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    # eod_mask_loss holds for DPO too (as in GPT-NeoX): the trained newline after each EOS leaves the log-prob sums
    eod = {**one["dpo"], "eod_mask_loss": True}
    ref = run_distributed(run_recorded_many, 1, [*one.values(), kto_gas, bf16, eod], timeout=600)[0]
    assert ref[5]["metrics"][0]["train/chosen_pos"] > ref[0]["metrics"][0]["train/chosen_pos"]  # fewer log-probs
    assert ref[4]["params_dtype"] == "bfloat16" and ref[4]["zero_stage"] == 1
    assert ref[4]["train_losses"][0] == pytest.approx(math.log(2.0), abs=1e-6)
    assert all(math.isfinite(x) for x in ref[4]["train_losses"])
    par = run_distributed(run_recorded_many, 2, tp + dp, timeout=600)[0]
    for i, name in enumerate(one):
        for run, how, expected in ((par[i], "TP=2", ref[i]), (par[i + 3], "DP=2", ref[3] if name == "kto" else ref[i])):
            assert run["train_losses"] == pytest.approx(expected["train_losses"], abs=1e-5), f"{name} {how}"


def test_dpo_and_kto_read_precomputed_reference_logprobs(data: dict[str, Any], tmp_path: Path) -> None:
    """``text_gen_type: precompute`` from an SFT checkpoint, then DPO and KTO from that checkpoint with
    ``precompute_model_name``: the same losses and metrics as with the frozen in-memory reference (fp32), and no
    second model is built. A missing reference file is a one-line error naming it."""
    from megatron.errors import DataError
    from megatron.neox_arguments import NeoXArgs
    from megatron.post_training.config import PostTrainingConfig
    from megatron.post_training.data import build_datasets

    ckpt = str(tmp_path / "sft_ckpt")
    cfgs = configs(data, iters=3, eval_iters=0)
    sft = {**configs(data, iters=2, eval_iters=0)["sft"], "save": ckpt, "checkpoint_factor": 1000}
    start = {"load": ckpt, "finetune": True}
    frozen = [{**cfgs[k], **start} for k in ("dpo", "kto")]
    read = [{**c, "precompute_model_name": "sft"} for c in frozen]
    writers = [{**c, "text_gen_type": "precompute"} for c in read]
    out = run_distributed(run_precompute_then_train, 1, sft, writers, frozen + read, timeout=600)[0]
    chosen = [f"{data['dpo']}_{k}_document_sft" for k in ("chosen", "rejected")]
    assert out["precomputed"][0][:2] == [{"precomputed": p} for p in chosen]
    assert out["precomputed"][1][0] == {"precomputed": f"{data['kto']}_messages_document_sft"}
    for name, a, b in (("dpo", out["runs"][0], out["runs"][2]), ("kto", out["runs"][1], out["runs"][3])):
        assert b["train_losses"] == pytest.approx(a["train_losses"], abs=1e-5), name
        for ma, mb in zip(a["metrics"], b["metrics"], strict=True):
            assert set(ma) == set(mb), name
            # accuracies compare rewards that are exactly 0 at the first step (policy = reference): skip them
            assert {k: v for k, v in mb.items() if "acc" not in k} == pytest.approx(
                {k: v for k, v in ma.items() if "acc" not in k}, abs=1e-4
            ), name
    # DPO from the reference itself starts at log 2; the references are real (nonzero) log-probs
    assert out["runs"][2]["train_losses"][0] == pytest.approx(math.log(2.0), abs=1e-5)
    assert out["runs"][2]["metrics"][0]["train/ref_pos"] < -1.0
    # a run whose reference files were not written
    args = NeoXArgs.from_dict({**read[0], "precompute_model_name": "other"})
    with pytest.raises(DataError, match=r"_chosen_document_other\.bin/\.idx not found.*--text_gen_type precompute"):
        build_datasets(PostTrainingConfig.from_neox_args(args), _data_config(args))


def _data_config(args: Any) -> Any:
    from megatron.data.data_utils import DataConfig

    return DataConfig.from_neox_args(args)


@pytest.mark.parametrize("name", ["dpo", "kto", "rm", "sft"])
def test_real_post_training_configs_build_their_data(data: dict[str, Any], name: str, tmp_path: Path) -> None:
    """GPT-NeoX's llama3-8b-{sft,dpo,kto,rm}.yml with their data paths pointed at local files: the config loads and
    the post-training data loaders (or, for SFT, the label streams) are built from it."""
    import re

    from megatron.data.data_utils import DataConfig, build_train_valid_test_data_loaders
    from megatron.neox_arguments import LaunchEnv, NeoXArgs
    from megatron.neox_arguments.loader import merge_config_files
    from megatron.neox_arguments.neox_args import KNOWN_KEYS
    from megatron.post_training.config import PostTrainingConfig
    from megatron.post_training.data import build_post_training_loaders
    from tests.shared_files import SHARED

    path = SHARED / "reference" / "gpt-neox-configs" / "post-training" / f"llama3-8b-{name}.yml"
    if not path.is_file():
        pytest.skip("GPT-NeoX reference configs not present")
    values = dict(merge_config_files([str(path)], KNOWN_KEYS).values)
    prefix = data[name]

    def local(p: str) -> str:
        return re.sub(r"^data/\w+/llama3_(?:dpo_|rm_)?(?:train|val|test)_(\w+)$", lambda m: f"{prefix}_{m[1]}", p)

    for key, value in list(values.items()):
        if key.endswith("_data_paths"):
            values[key] = [local(p) for p in value]
    values.update(vocab_file=str(data["tok"] / "tokenizer.json"), save=str(tmp_path / "save"), global_num_gpus=4)
    values.pop("load")
    args = NeoXArgs(values, env=LaunchEnv(world_size=None, on_cpu=True))
    assert args.train_impl == {"sft": "normal"}.get(name, name) and args.model_parallel_size == 4
    cfg = DataConfig.from_neox_args(args)
    loaders = build_post_training_loaders(
        PostTrainingConfig.from_neox_args(args), cfg, dp_rank=0, dp_size=1, consumed_train=0, consumed_valid=0
    )
    if name == "sft":
        assert loaders is None
        loaders = build_train_valid_test_data_loaders(cfg, dp_rank=0, dp_size=1)
    batch = next(iter(loaders[0]))
    pairs = {"pos", "neg", "pos_label", "neg_label"}
    keys = {"sft": {"text", "label"}, "kto": {"text", "label", "reward"}}.get(name, pairs)
    assert set(batch) == keys and batch[next(iter(keys))].shape == (32, 1025)
