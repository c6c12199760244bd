#!/usr/bin/env bash
# qatc's demo on the embedded Shakespeare GPT-2 (4 layers, n_embd 128): full precision, 4-bit
# post-training quantization (llama.cpp's Q4_0), then 4-bit quantization-aware LoRA fine-tuning,
# with the three perplexities side by side. Usage: examples/demo.sh QATC_BINARY
set -euo pipefail
qatc=${1:-target/release/qatc}
model=examples/gpt2-shakespeare-small/model.safetensors
train=examples/shakespeare_train.bin
val=examples/shakespeare_val.bin
quant=(--bits 4 --group 32 --scheme q4_0)
eval_args=(--data "$val" --batch 4 --seq 128 --batches 10 --json)
steps=${DEMO_STEPS:-500}
mkdir -p out

ppl() { sed -n 's/.*"ppl":\([0-9.]*\).*/\1/p' | xargs printf '%.2f'; }

echo "== compile: the 4-bit (Q4_0) + LoRA r=16 training step"
"$qatc" compile "$model" --batch 4 --seq 128 "${quant[@]}" --lora r=16 -o out/demo
echo
echo "== eval: full precision and 4-bit post-training quantization (validation split, 5,120 tokens)"
fp=$("$qatc" eval "$model" "${eval_args[@]}" | ppl)
ptq=$("$qatc" eval "$model" "${eval_args[@]}" "${quant[@]}" | ppl)
echo "   full precision ppl $fp, 4-bit PTQ ppl $ptq"
echo
echo "== train: 4-bit QAT + LoRA r=16 on the train split, $steps steps, compiled for this CPU"
"$qatc" train "$model" --data "$train" --batch 4 --seq 128 --steps "$steps" "${quant[@]}" --lora r=16 \
  --lr 1e-3 --warmup 10 --schedule cosine --shuffle --seed 1 \
  --val "$val" --eval-every 20 --val-batches 2 \
  --out out/demo-adapter --log-json out/demo-train.jsonl --plot out/demo-loss.svg
# the adapter's qatc.json says how it was quantized: no quantization flag to repeat
qat=$("$qatc" eval "$model" "${eval_args[@]}" --adapter out/demo-adapter | ppl)
echo
printf '%-34s %10s\n' "validation perplexity" ""
printf '%-34s %10s\n' "full precision (fp16 weights)" "$fp"
printf '%-34s %10s\n' "4-bit Q4_0, post-training" "$ptq"
printf '%-34s %10s\n' "4-bit Q4_0 + QAT LoRA r=16" "$qat"
awk -v fp="$fp" -v ptq="$ptq" -v qat="$qat" 'BEGIN { if (ptq > fp) printf "QAT + LoRA recovered %.0f%% of the perplexity that post-training quantization lost\n", 100 * (ptq - qat) / (ptq - fp) }'
echo
echo "artifacts: out/demo/ (forward.qir, train.qir, manifest.json), out/demo-adapter/ (PEFT),"
echo "           out/demo-train.jsonl (loss per step), out/demo-loss.svg (loss curve)"
