#!/usr/bin/env bash
# Issue 31's figures: (1) one rank's planned peak and the bytes its collectives send per step
# (`qatc plan --ranks N --zero S --json`, no run) for GPT-2 124M and 1.5B (the sizes' shapes: no
# weights needed), a full fine-tune in bf16 with AdamW, B 1 x T 1024 per rank, N 1, 2, 8, every
# stage; (2) the measured CPU time of the demo step on 2 ranks against 1 (`mpirun -np 2`), the
# same global batch. Prints markdown; run from the repository root after `make build`.
set -euo pipefail
qatc=${1:-target/release/qatc}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 # mpirun as root in a container

echo "| model | N | ZeRO | model states per rank | planned peak per rank | sent per rank per step |"
echo "|---|---|---|---|---|---|"
for model in 124M 1.5B; do
  for n in 1 2 8; do
    stages="0 1 2 3"
    [ "$n" = 1 ] && stages=0
    for z in $stages; do
      "$qatc" plan "$model" --batch 1 --seq 1024 --full-finetune --precision bf16 --optim adamw \
        --ranks "$n" --zero "$z" --json 2>/dev/null | python3 -c '
import json, sys
v = json.load(sys.stdin)
r = v.get("ranks") or {}
states = r.get("model_states", {}).get("this_rank", {}).get("total")
sent = r.get("collectives", {}).get("sent_bytes_per_step", 0)
peak = v["summary"]["peak_bytes"]
gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"
print(f"| {sys.argv[1]} | {sys.argv[2]} | {sys.argv[3]} | {gib(states)} | {gib(peak)} | {gib(sent)} |")
' "$model" "$n" "$z"
    done
  done
done

# (2) the demo model's 4-bit + LoRA step, global batch 8 x 128, 12 steps: median tokens/s of
# steps 2.. (the first compiles and hoists), one rank of 8 rows against two of 4
model=examples/gpt2-shakespeare-small/model.safetensors
data=examples/shakespeare_train.bin
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--data "$data" --seq 128 --steps 12 --bits 4 --lora r=16)
median() { python3 -c '
import json, statistics, sys
xs = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])][2:]
print(f"{statistics.median(xs):.0f}")' "$1"; }
"$qatc" train "$model" "${common[@]}" --batch 8 --out "$tmp/one" --log-json "$tmp/one.jsonl" >/dev/null 2>&1
mpirun --oversubscribe --bind-to none -np 2 "$qatc" train "$model" "${common[@]}" --batch 4 --out "$tmp/two" --log-json "$tmp/two.jsonl" >/dev/null 2>&1
echo
echo "| demo step (global batch 8 x 128) | tokens/s (median of steps 3-12) |"
echo "|---|---|"
echo "| 1 rank of 8 rows | $(median "$tmp/one.jsonl") |"
echo "| mpirun -np 2, 4 rows each | $(median "$tmp/two.jsonl") |"
