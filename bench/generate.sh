#!/usr/bin/env bash
# Tokens/s of `qatc generate` against transformers' `generate` on the CPU (bench/RESULTS.md), in the
# same run on the same machine, rounds interleaved so that both see the same load: greedy, float32,
# 2 threads, the prompt "ROMEO:" (3 tokens), NEW tokens (EOS ignored: qatc --ignore-eos, transformers
# min_new_tokens). Models: the embedded Shakespeare GPT-2, and GPT-2 124M with random weights
# (bench/generate_peer.py --write-124m: no 124M checkpoint ships here; speed does not depend on the
# weights). Needs the PyTorch peer environment (../shared/tools/peer-env.sh).
# Usage: bash bench/generate.sh [NEW [ROUNDS]]
set -euo pipefail
cd "$(dirname "$0")/.."
new=${1:-64}
rounds=${2:-3}
py=$(bash ../shared/tools/peer-env.sh | tail -1)
cargo build --release --bin qatc
big=out/bench-124m
[ -f "$big/model.safetensors" ] || "$py" bench/generate_peer.py --write-124m "$big"
for spec in "embedded Shakespeare GPT-2 (4 layers, n_embd 128):examples/gpt2-shakespeare-small" "GPT-2 124M (random weights):$big"; do
  dir=${spec##*:}
  echo "== ${spec%:*}: greedy, 3-token prompt, $new new tokens, 2 threads"
  for round in $(seq "$rounds"); do
    target/release/qatc generate "$dir/model.safetensors" --prompt "ROMEO:" --max-new-tokens "$new" --ignore-eos --device cpu --json 2>/dev/null \
      | sed -n 's/.*"engine":"\([a-z]*\)".*"seconds":\([0-9.]*\),.*"tokens_per_s":\([0-9.]*\).*/qatc (\1): \3 tokens\/s (\2 s)/p'
    "$py" bench/generate_peer.py --model "$dir" --new "$new" --repeats 1 --threads 2 | sed 's/"tokens": \[.*\]/.../'
  done
done
