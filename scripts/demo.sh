#!/bin/sh
# The main job end to end on an embedded example: plan a small GPT for local CPU
# workers, print the plan, compile it, run it with torchrun and print the losses.
set -eu
OUT=${1:-out/demo}
NPROC=${2:-2}
MODEL_ARGS="--model-arg n_layers=4 --model-arg hidden=64 --model-arg heads=4 --model-arg seq_len=32 --model-arg vocab=256"
mkdir -p "$OUT"
echo "== hetpar plan examples/gpt.py --cluster 1x${NPROC}xcpu --global-batch 16"
hetpar plan examples/gpt.py --cluster "1x${NPROC}xcpu" --global-batch 16 $MODEL_ARGS -o "$OUT/plan.json"
echo "== hetpar compile $OUT/plan.json -o $OUT/build"
hetpar compile "$OUT/plan.json" -o "$OUT/build"
echo "== torchrun --nproc_per_node=$NPROC train.py --steps 8"
rm -f "$OUT/metrics.jsonl"
(cd "$OUT/build" && torchrun --standalone --nproc_per_node="$NPROC" train.py --steps 8 --metrics ../metrics.jsonl)
python -c "
from hetpar.runtime.training import read_metrics
rows = read_metrics('$OUT/metrics.jsonl')
print(f'== losses: {rows[0][\"loss\"]:.4f} at step 1 -> {rows[-1][\"loss\"]:.4f} at step {rows[-1][\"step\"]} (per-step metrics: $OUT/metrics.jsonl)')
"
