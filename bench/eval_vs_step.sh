#!/usr/bin/env bash
# Issue 34's "qatc eval as fast as the compiled step's forward", on the demo model (B 4, T 128,
# 4-bit + LoRA 16): five rounds of `qatc train --profile` (8 steps, 7 timed) then `qatc eval
# --profile` of its adapter (16 batches, 15 timed), each round's figures from the tables' rows.
# The step's forward is its `forward` phase plus the LM head's loss part, which the step fuses
# with the head's gradient (so its profile counts it as backward): the logits tiles' GEMMs and
# the online softmax over them; eval's head is the same GEMMs and kernels without the gradient.
#   bash bench/eval_vs_step.sh [QATC]
set -euo pipefail
cd "$(dirname "$0")/.."
M=examples/gpt2-shakespeare-small/model.safetensors
Q=${1:-target/release/qatc}
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
# the LM head's rows: its logits GEMMs (tiles of 4,096 columns and the last of 1,105) and the
# online softmax's kernels; of the step's, those the profile counts as backward
head_rows='gemm 512x(4096|1105)x128$|cross_entropy\.online_(tile|init|finish)$'
for i in 1 2 3 4 5; do
  "$Q" train $M --data examples/shakespeare_train.bin --batch 4 --seq 128 --steps 8 --bits 4 --lora r=16 --device cpu --profile --out "$w/adapter" 2>"$w/train.txt" >/dev/null
  "$Q" eval $M --adapter "$w/adapter" --data examples/shakespeare_val.bin --batch 4 --seq 128 --batches 16 --profile 2>"$w/eval.txt" >/dev/null
  step=$(grep -oE "one step, [0-9.]+" "$w/train.txt" | grep -oE "[0-9.]+$")
  fwd=$(grep -oE "by phase: forward [0-9.]+" "$w/train.txt" | grep -oE "[0-9.]+$")
  head=$(grep -E " backward +($head_rows)" "$w/train.txt" | awk '{s += $1} END {print s + 0}')
  ev=$(grep -oE "one batch, [0-9.]+" "$w/eval.txt" | grep -oE "[0-9.]+$")
  evhead=$(grep -E "$head_rows" "$w/eval.txt" | awk '{s += $1} END {print s + 0}')
  awk -v i="$i" -v load="$(cut -d' ' -f1 /proc/loadavg)" -v step="$step" -v fwd="$fwd" -v head="$head" -v ev="$ev" -v evhead="$evhead" 'BEGIN {
    printf "round %d (load %s): step %.1f ms, its forward %.1f + its head'"'"'s loss %.1f = %.1f ms; eval %.1f ms a batch (its head %.1f): %.2fx\n",
      i, load, step, fwd, head, fwd + head, ev, evhead, ev / (fwd + head) }'
done
