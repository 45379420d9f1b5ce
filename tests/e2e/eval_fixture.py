"""A tiny trained-looking GPT-NeoX model as both a NeoX checkpoint and its convert_neox_to_hf export.

An HF GPTNeoX model (random weights, byte-level BPE tokenizer whose size equals the vocabulary rows) is converted to
a NeoX checkpoint with ``convert_hf_to_neox.py`` and exported back with ``convert_neox_to_hf.py``; tests run
neox-forge on the checkpoint and the reference (lm-eval's ``hf`` backend, transformers ``generate``) on the export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.checkpoint import cli
from tests.unit.test_ckpt_hf import TO_HF, TO_NEOX  # the converter CLIs, loaded from tools/ckpts

REPO = Path(__file__).resolve().parents[2]
CORPUS = [
    "Question: What color is the sky? Answer: blue. The quick brown fox jumps over the lazy dog.",
    "Q: What is 2 plus 2?\nA: 4\nQ: How many days are in a week?\nA: 7",
    "To be, or not to be, that is the question. All the world's a stage.",
]


@dataclass
class TinyModel:
    neox: Path  # NeoX checkpoint root (latest, global_step0, neox_config.yml, tokenizer.yml)
    export: Path  # convert_neox_to_hf.py output (model + tokenizer)
    configs: list[str]  # neox_config.yml, tokenizer.yml, setup.yml


def build_tiny_model(root: Path, *, tp: int = 1, pp: int = 0, setup: str = "") -> TinyModel:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    vocab = tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    hf = root / "hf"
    config = transformers.GPTNeoXConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
        hidden_act="gelu", eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(str(hf))
    fast.save_pretrained(str(hf))
    neox, export = root / "neox", root / "export"
    args = ["--input_dir", str(hf), "--output_dir", str(neox), "--tp", str(tp), "--pp", str(pp)]
    assert cli.run(lambda: TO_NEOX.main(args)) == 0
    args = ["--input_dir", str(neox / "global_step0"), "--output_dir", str(export), "--architecture", "neox"]
    assert cli.run(lambda: TO_HF.main(args)) == 0
    (root / "setup.yml").write_text(
        f"load: {neox}\nseq_length: 64\ntrain_micro_batch_size_per_gpu: 2\ntrain_iters: 1\nseed: 1234\n"
        f"global_num_gpus: {max(1, tp * max(pp, 1))}\n" + setup
    )
    return TinyModel(
        neox, export, [str(neox / "neox_config.yml"), str(neox / "tokenizer.yml"), str(root / "setup.yml")]
    )
