#!/usr/bin/env bash
# qatc's demo on the embedded Shakespeare GPT-2 (4 layers, n_embd 128): full precision, 2-bit
# post-training quantization, then 2-bit quantization-aware LoRA fine-tuning with learned scales,
# the validation losses side by side and the training and validation curves in one picture, and
# last what each of the three models writes after the same prompt.
# Usage: examples/demo.sh QATC_BINARY
set -euo pipefail
qatc=${1:-target/release/qatc}
model=examples/gpt2-shakespeare-small/model.safetensors
train=examples/shakespeare_train.bin
val=examples/shakespeare_val.bin
quant=(--bits 2 --group 64 --scheme sym --scales learned --qat merged)
eval_args=(--data "$val" --batch 4 --seq 128 --batches 10 --json)
steps=${DEMO_STEPS:-500}
mkdir -p out

loss() { sed -n 's/.*"loss":\([0-9.]*\).*/\1/p' | xargs printf '%.3f'; }

echo "== compile: the 2-bit (sym, groups of 64, learned scales) + LoRA r=16 training step"
"$qatc" compile "$model" --batch 4 --seq 128 "${quant[@]}" --lora r=16 -o out/demo
echo
echo "== eval: full precision and 2-bit post-training quantization (validation split, 5,120 tokens)"
fp=$("$qatc" eval "$model" "${eval_args[@]}" | loss)
ptq=$("$qatc" eval "$model" "${eval_args[@]}" --bits 2 --group 64 --scheme sym | loss)
echo "   full precision loss $fp, 2-bit post-training loss $ptq"
echo
echo "== train: 2-bit QAT + LoRA r=16 with learned scales on the train split, $steps steps, compiled for this CPU"
# --precision auto: bf16 where the CPU's bf16 GEMMs run on AMX tiles (1.3-1.5x this step's fp32
# speed there), fp32 elsewhere (no faster in bf16); qatc says which it took
"$qatc" train "$model" --data "$train" --batch 4 --seq 128 --steps "$steps" "${quant[@]}" --lora r=16 --precision auto \
  --lr 1e-3 --scale-lr 1e-4 --warmup 10 --schedule cosine --shuffle --seed 1 \
  --val "$val" --eval-every 50 --val-batches 10 \
  --plot-line "full precision=$fp" --plot-line "2-bit post-training=$ptq" \
  --out out/demo-adapter --log-json out/demo-train.jsonl --plot out/demo-loss.svg
# the adapter's qatc.json says how it was quantized (and that its scales are learned): no flag to repeat
qat=$("$qatc" eval "$model" "${eval_args[@]}" --adapter out/demo-adapter | loss)
echo
printf '%-40s %8s %8s\n' "validation" "loss" "ppl"
for row in "full precision (fp16 weights):$fp" "2-bit, post-training:$ptq" "2-bit, QAT + LoRA r=16, learned scales:$qat"; do
  printf '%-40s %8s %8.1f\n' "${row%:*}" "${row##*:}" "$(awk -v l="${row##*:}" 'BEGIN { print exp(l) }')"
done
awk -v fp="$fp" -v ptq="$ptq" -v qat="$qat" 'BEGIN { if (ptq > fp) printf "QAT + LoRA won back %.0f%% of the %.2f nats that post-training 2-bit quantization lost\n", 100 * (ptq - qat) / (ptq - fp), ptq - fp }'
echo
# greedy, so the lines are the same on every run; qatc generate quantizes as the adapter's qatc.json says
prompt=$'ROMEO:\n'
echo "== generate: what each model writes after \"ROMEO:\" (greedy, 40 tokens, over a KV cache compiled for this CPU)"
log=$(mktemp)
for row in "full precision (fp16 weights):" "2-bit, post-training:--bits 2 --group 64 --scheme sym" \
           "2-bit, QAT + LoRA r=16, learned scales:--adapter out/demo-adapter"; do
  read -ra flags <<<"${row#*:}"
  text=$("$qatc" generate "$model" --prompt "$prompt" --max-new-tokens 40 "${flags[@]}" 2>"$log") || { cat "$log" >&2; exit 2; }
  echo "-- ${row%%:*}, $(sed -n 's/^qatc: [0-9]* tokens in [0-9.]* s: \([0-9.]* tokens\/s\).*/\1/p' "$log")"
  awk 'NF && n < 6 { print "   " $0; n++ }' <<<"$text"
done
rm -f "$log"
echo
echo "artifacts: out/demo/ (forward.qir, train.qir, manifest.json), out/demo-adapter/ (PEFT + learned scales),"
echo "           out/demo-train.jsonl (loss per step), out/demo-loss.svg (train and validation curves)"
