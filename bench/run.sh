#!/usr/bin/env bash
# The CPU benchmarks, each against its peer in the same run on the same machine.
# Needs the PyTorch peer environment (../shared/tools/peer-env.sh) for the peer's figures.
set -euo pipefail
# qatc names OpenBLAS's kernel set from the CPU unless the environment does; some machines'
# environments name a weaker one (OPENBLAS_CORETYPE=Haswell on AVX-512 CPUs: half the f32 GEMM rate)
unset OPENBLAS_CORETYPE
cd "$(dirname "$0")/.."
py=$(bash ../shared/tools/peer-env.sh | tail -1)
cargo build --release --examples
echo "== lowering + verification"
target/release/examples/bench_lower
echo "== CPU training step: 4 layers, n_embd 256, vocab 50257, B 4, T 128, 4-bit g64, LoRA r 16"
common=(--layers 4 --embd 256 --heads 4 --vocab 50257 --seq 128 --batch 4 --bits 4 --group 64 --r 16 --steps 10 --threads 2)
for round in 1 2; do
  target/release/examples/bench_cpu_train 10 compiled small
  target/release/examples/bench_cpu_train 10 compiled small --no-blas | sed 's/qatc-compiled/qatc-compiled-gemm-crate/'
  "$py" ../shared/tools/torch_peer.py "${common[@]}" 2>/dev/null | tail -1
  "$py" ../shared/tools/torch_peer.py "${common[@]}" --precompute-quant 2>/dev/null | tail -1
done
target/release/examples/bench_cpu_train 3 interpreter small
echo "== CPU training step: GPT-2 124M, B 1, T 256, 4-bit g64, LoRA r 16"
big=(--layers 12 --embd 768 --heads 12 --vocab 50257 --seq 256 --batch 1 --bits 4 --group 64 --r 16 --steps 5 --threads 2)
for round in 1 2; do
  target/release/examples/bench_cpu_train 5 compiled 124m
  "$py" ../shared/tools/torch_peer.py "${big[@]}" 2>/dev/null | tail -1
done
