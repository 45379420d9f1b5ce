#!/usr/bin/env bash
# The quick start, on this machine's CPUs: install what is missing, build the embedded corpus (Python stdlib),
# train a tokenizer, preprocess, train configs/cpu/quickstart.yml on 2 CPU ranks, save a checkpoint, and print
# text generated from it. Re-running reuses the data and retrains from scratch (runs/quickstart is replaced).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
bash scripts/bootstrap.sh
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS="ignore::FutureWarning,ignore::DeprecationWarning"
PY=.venv/bin/python
DATA=data/stdlib
RUN=runs/quickstart

echo "[quickstart] 1/4 data: corpus, tokenizer, .bin/.idx in $DATA"
# The data is reused only if this script built it (the stamp holds the checksums of the corpus and tokenizer it
# tokenized with); anything else in $DATA (another tool's output, an interrupted run) is rebuilt.
stamp() { sha256sum "$DATA/stdlib.jsonl" "$DATA/tokenizer.json" "$DATA/stdlib_text_document.bin" 2>/dev/null; }
if [ ! -s "$DATA/.quickstart-stamp" ] || [ "$(stamp)" != "$(cat "$DATA/.quickstart-stamp")" ]; then
    rm -rf "$DATA"
    mkdir -p "$DATA"
    $PY tools/datasets/corpora.py --output "$DATA/stdlib.jsonl"
    $PY tools/datasets/train_tokenizer.py --json_input_dir "$DATA" --tokenizer_output_path "$DATA/tokenizer.json" \
        --vocab_size 4096
    $PY tools/datasets/preprocess_data.py --input "$DATA/stdlib.jsonl" --output-prefix "$DATA/stdlib" \
        --tokenizer-type HFTokenizer --vocab-file "$DATA/tokenizer.json" --append-eod --workers 2
    stamp > "$DATA/.quickstart-stamp"
fi
entropy=$($PY - <<'EOF'
import numpy as np
from megatron.data.indexed_dataset import make_dataset

ds = make_dataset("data/stdlib/stdlib_text_document", "mmap")
counts = np.zeros(1, dtype=np.int64)
for i in range(len(ds)):
    c = np.bincount(np.asarray(ds[i], dtype=np.int64))
    if len(c) > len(counts):
        counts = np.pad(counts, (0, len(c) - len(counts)))
    counts[: len(c)] += c
p = counts[counts > 0] / counts.sum()
print(f"{-(p * np.log(p)).sum():.3f}")
EOF
)
echo "[quickstart] unigram entropy of the corpus: $entropy nats/token (the loss of a model without context)"

echo "[quickstart] 2/4 training configs/cpu/quickstart.yml on 2 CPU ranks"
rm -rf "$RUN"
mkdir -p "$RUN"
t1=$(date +%s)
$PY deepy.py train.py configs/cpu/quickstart.yml 2>&1 | tee "$RUN/train.log" | grep --line-buffered -E "^(iteration|validation|test|saved|run summary|error|Traceback)|Error" || true
if ! grep -q "^training finished" "$RUN/train.log"; then
    echo "[quickstart] training failed; full log: $RUN/train.log" >&2
    exit 1
fi
t2=$(date +%s)

echo "[quickstart] 3/4 checkpoint: $(cat "$RUN/checkpoints/latest") in $RUN/checkpoints"
ls "$RUN/checkpoints/$(cat "$RUN/checkpoints/latest")"

echo "[quickstart] 4/4 generating from the checkpoint (temperature 0.7, top-p 0.9, 48 tokens per prompt)"
printf 'def read_config(path):\nclass LRUCache:\nimport os\n\ndef main():\n' > "$RUN/prompts.txt"
$PY deepy.py generate.py configs/cpu/quickstart.yml --text_gen_type input-file \
    --sample_input_file "$RUN/prompts.txt" --sample_output_file "$RUN/samples.jsonl" --maximum_tokens 48 \
    --temperature 0.7 --top_p 0.9 \
    2>&1 | sed -n '/^----- prompt/,$p' | grep -v "launch.py" || true
[ -s "$RUN/samples.jsonl" ] || { echo "[quickstart] generation failed" >&2; exit 1; }

final=$(grep "^validation results" "$RUN/train.log" | tail -1 | sed -E 's/.*lm_loss value: ([0-9.E+-]+).*/\1/')
$PY tools/plot_run.py "$RUN" --out "$RUN/report.png" >/dev/null
t3=$(date +%s)
echo "[quickstart] done in $((t3 - t0)) s (training $((t2 - t1)) s)"
echo "[quickstart] final validation loss $final nats/token vs unigram entropy $entropy"
echo "[quickstart] run report (loss, learning rate, grad norm, tokens/s, memory): $RUN/report.png"
