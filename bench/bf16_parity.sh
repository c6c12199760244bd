#!/usr/bin/env bash
# Issue 30, 5: `--precision bf16` on the CPU against PyTorch's bf16 autocast, on the demo's recipe
# (embedded Shakespeare GPT-2, 2-bit sym g64, learned scales, merged QAT, LoRA r 16 alpha 32, lr 1e-3
# cosine after 10 warmup steps, scale lr 1e-4, B 4, T 128, shuffled, seed 1), 50 steps, validation
# loss on 10 batches. Both sides start from the same LoRA (the peer writes its initial A and B as a
# PEFT adapter; qatc reads it with --init-adapter) and from min-max scales, so the only differences
# left are the arithmetic's. fp32 on both sides too, for the same gap without bf16.
# Usage: bench/bf16_parity.sh [QATC_BINARY] [STEPS]; writes out/bf16-parity/.
set -euo pipefail
cd "$(dirname "$0")/.."
qatc=${1:-target/release/qatc}
steps=${2:-50}
py=$(bash ../shared/tools/peer-env.sh | tail -1)
model=examples/gpt2-shakespeare-small/model.safetensors
dir=out/bf16-parity
mkdir -p "$dir"
recipe=(--bits 2 --group 64 --scheme sym --scales learned --qat merged --lr 1e-3 --scale-lr 1e-4 --warmup 10 --schedule cosine
        --batch 4 --seq 128 --seed 1 --steps "$steps")
peer=(--r 16 --alpha 32 --val-batches 10 --skip-baselines --save-init "$dir/init")
val() { tail -n 1 "$1" | sed -n 's/.*"val_loss":\([-0-9.e]*\).*/\1/p'; }
printf '%-8s %12s %12s %10s\n' precision "qatc val" "PyTorch val" "|gap|"
for p in fp32 bf16; do
  ac=none; [ "$p" = bf16 ] && ac=bf16
  torch=$("$py" bench/quality_peer.py "${recipe[@]}" "${peer[@]}" --autocast "$ac" | sed -n 's/.*"qat_lora": \([-0-9.e]*\).*/\1/p')
  "$qatc" train "$model" --data examples/shakespeare_train.bin "${recipe[@]}" --lora r=16,alpha=32 --shuffle \
    --scale-init minmax --init-adapter "$dir/init" --precision "$p" \
    --val examples/shakespeare_val.bin --val-batches 10 --out "$dir/qatc-$p" --log-json "$dir/qatc-$p.jsonl" >/dev/null 2>"$dir/qatc-$p.log"
  ours=$(val "$dir/qatc-$p.jsonl")
  printf '%-8s %12.5f %12.5f %10.5f\n' "$p" "$ours" "$torch" "$(echo "$ours - $torch" | bc -l | tr -d -)"
done
