#!/usr/bin/env bash
# Issue 18's check on the demo: the demo's recipe (4-bit Q4_0 + QAT LoRA r=16 on the embedded
# Shakespeare GPT-2) trained with --precision fp32, bf16 and fp16 on the CPU, the validation loss
# of each at the end side by side (|bf16 - fp32| and |fp16 - fp32| should be under 2e-2).
# Usage: bench/precision.sh [QATC_BINARY] [STEPS]; writes out/precision-*.jsonl.
set -euo pipefail
qatc=${1:-target/release/qatc}
steps=${2:-500}
model=examples/gpt2-shakespeare-small/model.safetensors
mkdir -p out
printf '%-10s %12s %12s %10s %8s\n' precision "val loss" "vs fp32" "seconds" skipped
base=
for p in fp32 bf16 fp16; do
  t0=$(date +%s.%N)
  "$qatc" train "$model" --data examples/shakespeare_train.bin --batch 4 --seq 128 --steps "$steps" \
    --bits 4 --group 32 --scheme q4_0 --lora r=16 --lr 1e-3 --warmup 10 --schedule cosine --shuffle --seed 1 \
    --val examples/shakespeare_val.bin --val-batches 10 --precision "$p" \
    --out "out/precision-$p" --log-json "out/precision-$p.jsonl" >/dev/null 2>&1
  secs=$(echo "$(date +%s.%N) - $t0" | bc)
  val=$(tail -n 1 "out/precision-$p.jsonl" | sed -n 's/.*"val_loss":\([-0-9.e]*\).*/\1/p')
  skipped=$(tail -n 1 "out/precision-$p.jsonl" | sed -n 's/.*"skipped":\([0-9]*\).*/\1/p')
  [ -z "$base" ] && base=$val
  printf '%-10s %12.5f %12.5f %10.1f %8s\n' "$p" "$val" "$(echo "$val - $base" | bc -l)" "$secs" "${skipped:--}"
done
