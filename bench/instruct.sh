#!/usr/bin/env bash
# The training step on instruction data against plain text (issue 32, 6): bench/instruct.rs
# (`bench_instruct`) times the same step on the train split's tokens, on dialogue.jsonl packed
# and on it padded (--no-pack), in turn in one process. dialogue.jsonl is made here: the train
# split's speeches as prompt/completion pairs (a speech and the reply to it, under 600
# characters together; those still over T 128 tokens are skipped, counted).
# Usage: bash bench/instruct.sh [--profile]   (ROUNDS=30 by default; writes out/bench-instruct/)
set -euo pipefail
out=out/bench-instruct
mkdir -p "$out"
python3 - "$out/dialogue.jsonl" <<'EOF'
import json, sys
text = open("../shared/data/shakespeare/shakespeare_train.txt", encoding="utf-8").read()
speeches = []
for block in text.split("\n\n"):
    lines = block.strip().split("\n")
    # a speech: a speaker's name in capitals, then what they say
    if len(lines) >= 2 and lines[0].isupper() and not lines[0].startswith(("ACT", "SCENE")):
        speeches.append(lines[0].title() + ": " + " ".join(lines[1:]))
with open(sys.argv[1], "w") as f:
    for a, b in zip(speeches, speeches[1:]):
        if len(a) + len(b) < 600:
            f.write(json.dumps({"prompt": a, "completion": b}) + "\n")
EOF
cargo run --release --example bench_instruct -- "$out/dialogue.jsonl" "${ROUNDS:-30}" "$@"
