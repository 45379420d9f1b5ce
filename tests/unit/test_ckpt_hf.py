"""HF → NeoX (tp=2, pp=2) → HF gives bit-identical tensors and an equivalent config, through the real CLIs
(run in-process); converted folders load with AutoModelForCausalLM / AutoTokenizer; bad inputs exit non-zero
without leaving an output directory."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron.checkpoint import cli
from megatron.neox_arguments import NeoXArgs
from megatron.tokenizer import TokenizerConfig, build_tokenizer, padded_vocab_size
from tests.harness import load_tool

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128


def _tool(name: str) -> ModuleType:
    return load_tool(f"tools/ckpts/{name}.py")


TO_NEOX, TO_HF, RESHARD = _tool("convert_hf_to_neox"), _tool("convert_neox_to_hf"), _tool("reshard_checkpoint")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
CASES = {
    "neox-parallel-pct0.25-untied-tanh": (
        "neox",
        transformers.GPTNeoXConfig(
            **COMMON, intermediate_size=128, rotary_pct=0.25, rotary_emb_base=500.0, use_parallel_residual=True,
            tie_word_embeddings=False, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-5,
        ),
    ),
    "neox-sequential-tied": (
        "neox",
        transformers.GPTNeoXConfig(
            **COMMON, intermediate_size=128, rotary_pct=1.0, use_parallel_residual=False, tie_word_embeddings=True
        ),
    ),
    "llama-gqa": (
        "llama",
        transformers.LlamaConfig(
            **COMMON, num_key_value_heads=2, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
        ),
    ),
    "mistral-window": (
        "mistral",
        transformers.MistralConfig(**COMMON, num_key_value_heads=2, intermediate_size=96, sliding_window=8),
    ),
}  # fmt: skip


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def _tokenizer(path: Path) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>", "<|padding|>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|padding|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def _hf_model(hf_config: transformers.PretrainedConfig, path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g) + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(str(path))
    return model


def _run(tool: ModuleType, argv: list[str]) -> int:
    return cli.run(lambda: tool.main(argv))


def _disk_tensors(path: Path) -> dict[str, torch.Tensor]:
    sd = load_file(str(path / "model.safetensors"))
    if "embed_out.weight" in sd:
        sd["lm_head.weight"] = sd.pop("embed_out.weight")
    return sd


@pytest.mark.parametrize("name", list(CASES))
def test_hf_to_neox_tp2_pp2_to_hf_is_bit_identical(name: str, tmp_path: Path) -> None:
    arch, hf_config = CASES[name]
    original = _hf_model(hf_config, tmp_path / "hf")
    _tokenizer(tmp_path / "hf")
    neox, back = tmp_path / "neox", tmp_path / "back"
    assert (
        _run(TO_NEOX, ["--input_dir", str(tmp_path / "hf"), "--output_dir", str(neox), "--tp", "2", "--pp", "2"]) == 0
    )
    step = neox / "global_step0"
    assert (neox / "latest").read_text() == "global_step0"
    assert {"layer_02-model_01-model_states.pt", "mp_rank_03_model_states.pt"} <= {p.name for p in step.iterdir()}

    # neox_config.yml + tokenizer.yml form a valid GPT-NeoX config whose vocabulary padding reproduces the rows
    setup = tmp_path / "setup.yml"
    setup.write_text("seq_length: 16\nglobal_num_gpus: 4\ntrain_micro_batch_size_per_gpu: 2\ntrain_iters: 1\n")
    args = NeoXArgs.from_ymls([str(neox / "neox_config.yml"), str(neox / "tokenizer.yml"), str(setup)])
    assert (args.model_parallel_size, args.pipe_parallel_size, args.num_layers) == (2, 2, 2)
    tok = build_tokenizer(TokenizerConfig.from_neox_args(args))
    assert padded_vocab_size(tok.vocab_size, args.make_vocab_size_divisible_by, 2) == VOCAB

    assert _run(TO_HF, ["--input_dir", str(step), "--output_dir", str(back), "--architecture", arch]) == 0
    src, dst = _disk_tensors(tmp_path / "hf"), _disk_tensors(back)
    assert set(dst) == set(src)
    for key, tensor in src.items():
        assert dst[key].dtype == tensor.dtype and torch.equal(dst[key], tensor), key

    a = json.loads((tmp_path / "hf" / "config.json").read_text())
    b = json.loads((back / "config.json").read_text())
    for key in set(a) - {"transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "dtype"}:
        if key in ("use_cache", "classifier_dropout", "is_decoder", "pretraining_tp", "mlp_bias"):
            continue
        assert b.get(key) == a[key], key

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(reloaded) is type(original)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(back))
    assert (
        tokenizer("the lazy dog")["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))("the lazy dog")["input_ids"]
    )
    # the chat template travels both ways (transformers 5 keeps it in chat_template.jinja)
    chat = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "the dog"}]
    for folder in (neox / "tokenizer", back):
        assert transformers.AutoTokenizer.from_pretrained(str(folder)).chat_template == CHAT_TEMPLATE, folder
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<|user|>the fox<|assistant|>the dog"

    # resharding the converted checkpoint to (1, 0) changes nothing in the exported model
    flat, back2 = tmp_path / "flat", tmp_path / "back2"
    assert _run(RESHARD, ["--input_dir", str(neox), "--output_dir", str(flat), "--tp", "1", "--pp", "0"]) == 0
    assert (flat / "global_step0" / "mp_rank_00_model_states.pt").is_file()
    assert _run(TO_HF, ["--input_dir", str(flat), "--output_dir", str(back2), "--architecture", arch]) == 0
    for key, tensor in _disk_tensors(back2).items():
        assert torch.equal(tensor, src[key]), key


def test_precision_and_bad_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _hf_model(CASES["llama-gqa"][1], tmp_path / "hf")
    neox = tmp_path / "neox"
    assert (
        _run(TO_NEOX, ["--input_dir", str(tmp_path / "hf"), "--output_dir", str(neox), "--tp", "2", "--pp", "0"]) == 0
    )
    half = tmp_path / "half"
    assert _run(TO_HF, ["--input_dir", str(neox), "--output_dir", str(half), "--precision", "bf16",
                        "--architecture", "llama"]) == 0  # fmt: skip
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(half / "model.safetensors")).values())
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    capsys.readouterr()

    def fails(tool: ModuleType, argv: list[str], message: str, out: Path) -> None:
        assert _run(tool, argv) == 1
        assert message in capsys.readouterr().err
        assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))

    out = tmp_path / "out"
    # an architecture the model cannot be expressed in
    fails(TO_HF, ["--input_dir", str(neox), "--output_dir", str(out), "--architecture", "neox"],
          "no exact GPTNeoXForCausalLM equivalent", out)  # fmt: skip
    # existing output directory
    fails(TO_HF, ["--input_dir", str(neox), "--output_dir", str(half), "--architecture", "llama"], "already exists",
          tmp_path / "never")  # fmt: skip
    # a config that does not match the checkpoint
    wrong = tmp_path / "wrong.yml"
    wrong.write_text((neox / "neox_config.yml").read_text().replace("hidden_size: 64", "hidden_size: 128"))
    fails(TO_HF, ["--input_dir", str(neox), "--config_file", str(wrong), "--output_dir", str(out)],
          "was saved with hidden_size=64 but the config says 128", out)  # fmt: skip
    # a missing shard
    (neox / "global_step0" / "mp_rank_01_model_states.pt").unlink()
    message = "saved by 2 model-parallel ranks but has 1 mp_rank files; missing: mp_rank_01_model_states.pt"
    fails(TO_HF, ["--input_dir", str(neox), "--output_dir", str(out)], message, out)
    fails(RESHARD, ["--input_dir", str(neox), "--output_dir", str(out), "--tp", "1", "--pp", "1"], message, out)
    # an unsupported Hugging Face model type
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(str(gpt2))
    fails(TO_NEOX, ["--input_dir", str(gpt2), "--output_dir", str(out)], "unsupported Hugging Face model_type", out)
    with pytest.raises(SystemExit):
        TO_HF.parse_args(["--input_dir", "x", "--output_dir", "y", "--architecture", "gpt2"])


def test_tokenizer_export_from_gpt2_bpe_files_and_hf_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from megatron.checkpoint import TargetLayout, write_checkpoint
    from megatron.checkpoint.hf_io import neox_config_yaml
    from megatron.model import GPTModelConfig, build_sequential_model

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["a tiny corpus for a tiny tokenizer"] * 10, trainer)
    vocab, merges = tok.model.save(str(tmp_path))
    tok.save(str(tmp_path / "tok.json"))
    cfg = GPTModelConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        padded_vocab_size=VOCAB,
        pos_emb="rotary",
        max_position_embeddings=64,
    )
    sd = build_sequential_model(cfg).state_dict()
    model_yml = neox_config_yaml(cfg, 1, 0)
    text = "a tiny tokenizer"
    for name, keys, extra in (
        ("bpe", f"tokenizer_type: GPT2BPETokenizer\nvocab_file: {vocab}\nmerge_file: {merges}\n", []),
        ("hf", f"tokenizer_type: HFTokenizer\nvocab_file: {tmp_path / 'tok.json'}\n", ["--vocab-is-hf-tokenizer"]),
    ):
        write_checkpoint(sd, cfg, tmp_path / name, TargetLayout(1, 0), config_files={"m.yml": model_yml + keys})
        out = tmp_path / f"{name}-hf"
        assert _run(TO_HF, ["--input_dir", str(tmp_path / name), "--output_dir", str(out), *extra]) == 0
        exported = transformers.AutoTokenizer.from_pretrained(str(out))
        assert exported(text)["input_ids"] == tok.encode(text).ids, name
        assert exported.eos_token == "<|endoftext|>"
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert _run(TO_HF, ["--input_dir", str(tmp_path / "bpe"), "--output_dir", str(tmp_path / "no-tok"),
                        "--no_save_tokenizer", "--pad-token-id", "7"]) == 0  # fmt: skip
    assert not (tmp_path / "no-tok" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "no-tok" / "config.json").read_text())["pad_token_id"] == 7


def test_generate_runs_on_a_converted_hf_model(tmp_path: Path) -> None:
    """HF folder → NeoX (tp=1, pp=0) → our generate path: greedy continuations equal HF's ``generate``."""
    from megatron.generation.text_generation import run_generation

    hf = _hf_model(CASES["llama-gqa"][1], tmp_path / "hf")
    tokenizer = _tokenizer(tmp_path / "hf")
    neox = tmp_path / "neox"
    assert (
        _run(TO_NEOX, ["--input_dir", str(tmp_path / "hf"), "--output_dir", str(neox), "--tp", "1", "--pp", "0"]) == 0
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown\nover the lazy\n")
    setup = tmp_path / "gen.yml"
    setup.write_text(
        f"load: {neox}\nseq_length: 64\ntrain_micro_batch_size_per_gpu: 1\ntrain_iters: 1\n"
        f"text_gen_type: input-file\nsample_input_file: {prompts}\nsample_output_file: {tmp_path / 'out.jsonl'}\n"
        "temperature: 0.0\nmaximum_tokens: 6\n"
    )
    args = NeoXArgs.from_ymls([str(neox / "neox_config.yml"), str(neox / "tokenizer.yml"), str(setup)])
    records = run_generation(args)
    assert len(records) == 2 and sum(r["length"] for r in records) > 0
    for record in records:  # HF greedy, with the padding rows beyond the tokenizer masked like generate.py does
        ids = tokenizer(record["context"])["input_ids"]
        new: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                logits = hf(torch.tensor([ids + new])).logits[0, -1]
                logits[len(tokenizer) :] = float("-inf")
                token = int(logits.argmax())
                if token == tokenizer.eos_token_id:
                    break
                new.append(token)
        assert record["length"] == len(new) and record["text"] == tokenizer.decode(new), record


def test_vocab_not_divisible_by_tp_is_padded(tmp_path: Path) -> None:
    config = transformers.GPTNeoXConfig(**{**COMMON, "vocab_size": 127}, intermediate_size=128)
    original = _hf_model(config, tmp_path / "hf")
    neox, back = tmp_path / "neox", tmp_path / "back"
    assert (
        _run(TO_NEOX, ["--input_dir", str(tmp_path / "hf"), "--output_dir", str(neox), "--tp", "2", "--pp", "0"]) == 0
    )
    assert "make_vocab_size_divisible_by: 64" in (neox / "neox_config.yml").read_text()
    assert _run(TO_HF, ["--input_dir", str(neox), "--output_dir", str(back)]) == 0
    padded = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert padded.config.vocab_size == 128
    ids = torch.randint(0, 127, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(padded(ids).logits[..., :127], original(ids).logits, atol=1e-6)


def test_pythia_config_checkpoint_converts(tmp_path: Path) -> None:
    """A checkpoint of GPT-NeoX's own configs/pythia/14M.yml (pipe, tp=2) exports to an equivalent GPTNeoX model."""
    from megatron.checkpoint import TargetLayout, write_checkpoint
    from megatron.checkpoint.config_io import load_neox_args, model_config
    from megatron.model import build_sequential_model

    config_file = REPO / "configs" / "pythia" / "14M.yml"
    cfg = model_config(load_neox_args([config_file]), padded_vocab_size=50304)
    assert cfg.params_dtype == torch.float16  # Pythia trained in fp16; compare in fp32 here
    cfg = cfg.replace(params_dtype=torch.float32)
    torch.manual_seed(0)
    ours = build_sequential_model(cfg).eval()
    write_checkpoint(ours.state_dict(), cfg, tmp_path / "ck", TargetLayout(2, 1), iteration=143000)
    out = tmp_path / "hf"
    assert _run(TO_HF, ["--input_dir", str(tmp_path / "ck"), "--config_file", str(config_file), "--output_dir",
                        str(out), "--precision", "fp32"]) == 0  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hf.config.hidden_act == "gelu_pytorch_tanh" and hf.config.rope_parameters["partial_rotary_factor"] == 0.25
    ids = torch.randint(0, 50277, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-5


def test_sharded_hf_folders_are_read(tmp_path: Path) -> None:
    original = _hf_model(CASES["llama-gqa"][1], tmp_path / "hf")
    original.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (tmp_path / "bin").mkdir()  # a torch-pickle folder (read with weights_only=True)
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    torch.save(original.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    src = _disk_tensors(tmp_path / "hf")
    for name in ("sharded", "bin"):
        neox, back = tmp_path / f"{name}-neox", tmp_path / f"{name}-back"
        assert _run(TO_NEOX, ["--input_dir", str(tmp_path / name), "--output_dir", str(neox), "--tp", "2"]) == 0
        assert _run(TO_HF, ["--input_dir", str(neox), "--output_dir", str(back), "--architecture", "llama"]) == 0
        assert all(torch.equal(t, src[k]) for k, t in _disk_tensors(back).items()), name
