#!/usr/bin/env bash
# The CPU benchmarks, each against its peer in the same run on the same machine.
# Needs the PyTorch peer environment (../shared/tools/peer-env.sh) for the peer's figures.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash ../shared/tools/peer-env.sh | tail -1)
cargo build --release --examples
echo "== lowering + verification"
target/release/examples/bench_lower
echo "== CPU training step: 4 layers, n_embd 256, vocab 50257, B 4, T 128, 4-bit g64, LoRA r 16"
target/release/examples/bench_cpu_train 10
common=(--layers 4 --embd 256 --heads 4 --vocab 50257 --seq 128 --batch 4 --bits 4 --group 64 --r 16 --steps 10 --threads 2)
"$py" ../shared/tools/torch_peer.py "${common[@]}" 2>/dev/null | tail -1
"$py" ../shared/tools/torch_peer.py "${common[@]}" --precompute-quant 2>/dev/null | tail -1
