#!/usr/bin/env bash
# Two qatc binaries, interleaved, on what a restructuring must not slow down: the demo's compiled
# CPU step (median tokens/s of steps 2..N) and plan times (124M and 1.5B, B 8, T 1024, 4-bit +
# LoRA r=16, --checkpoint auto --memory 8GiB; the demo at --grad-accum 1000). Ratios matter: the
# machine is shared, so each round runs both binaries back to back.
#
#   bash bench/before_after.sh BEFORE_QATC AFTER_QATC [ROUNDS]
set -euo pipefail
before=$1 after=$2 rounds=${3:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
model=$root/examples/gpt2-shakespeare-small/model.safetensors
data=$root/examples/shakespeare_val.bin
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

step_tps() { # qatc -> median tokens/s of steps 2.. of an 8-step run
    rm -rf "$tmp/out" "$tmp/log.jsonl"
    "$1" train "$model" --data "$data" --bits 4 --lora r=16 --steps 8 --batch 4 --seq 128 \
        --out "$tmp/out" --log-json "$tmp/log.jsonl" >/dev/null 2>&1
    python3 - "$tmp/log.jsonl" <<'EOF'
import json, statistics, sys
v = [json.loads(l).get("tokens_per_s") for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
print(f"{statistics.median(v[2:]):.0f}")
EOF
}

secs() { # command... -> wall seconds (over 180: cut)
    local t0 t1 rc=0
    t0=$(date +%s.%N)
    timeout 180 "$@" >/dev/null 2>&1 || rc=$?
    t1=$(date +%s.%N)
    if [ "$rc" = 124 ]; then echo ">180"; else python3 -c "print(f'{$t1 - $t0:.2f}')"; fi
}

echo "| round | binary | demo step tokens/s | plan 124M | plan 1.5B | plan demo K 1000 |"
echo "|---|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
    for which in before after; do
        q=${!which}
        tps=$(step_tps "$q")
        p124=$(secs "$q" plan 124M --batch 8 --seq 1024 --bits 4 --lora r=16 --memory 8GiB)
        p15=$(secs "$q" plan 1.5B --batch 8 --seq 1024 --bits 4 --lora r=16 --memory 8GiB)
        pk=$(secs "$q" plan "$model" --batch 1 --seq 32 --bits 4 --lora r=16 --grad-accum 1000)
        echo "| $r | $which | $tps | $p124 s | $p15 s | $pk s |"
    done
done
