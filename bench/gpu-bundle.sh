#!/usr/bin/env bash
# Builds what bench/gpu.sh runs on the GPU machine, which has no Rust and no network, and stages
# it in .gpu/ (ignored by .gitignore; carried there with `carry: [".gpu"]`):
#   .gpu/bundle.tar.gz  bin/qatc (release, without LLVM, stripped) and tests/* (the test
#                       executables that use a GPU, without LLVM, stripped), compressed
#   .gpu/manifest       the directory the tests were built in: they find their fixtures through
#                       it, and bench/gpu.sh points it at the checkout on the GPU machine
# Usage: make gpu-bundle   (or bash bench/gpu-bundle.sh)
# Builds in target/gpu-bundle (CARGO_TARGET_DIR overrides): its own directory, so building without
# LLVM does not throw away the LLVM build of target/release that `make test` uses.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/gpu-bundle}
rm -rf .gpu && mkdir -p .gpu/stage/bin .gpu/stage/tests

# without LLVM: the GPU machine has no libLLVM, and the CPU side of the checks is the evaluator
cargo build --release --no-default-features --bin qatc
cp "$CARGO_TARGET_DIR/release/qatc" .gpu/stage/bin/qatc

# test executables, found through cargo's JSON messages
exes() {
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])'
}
{
  cargo test --release --no-default-features --no-run --message-format=json -p qatc --test gpu_step --test cuda_exec
  cargo test --release --no-default-features --no-run --message-format=json -p qatc-runtime --test gpu_api --test cuda_collectives
} | exes | while read -r name exe; do cp "$exe" ".gpu/stage/tests/$name"; done

strip .gpu/stage/bin/* .gpu/stage/tests/*
tar czf .gpu/bundle.tar.gz -C .gpu/stage .
rm -rf .gpu/stage
pwd >.gpu/manifest
bundle=$(du -b .gpu/bundle.tar.gz | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "staged .gpu/bundle.tar.gz: $((bundle / 1048576)) MiB; with the tracked tree $(((bundle + tree) / 1048576)) MiB of the 64 MiB a run carries"
if [ $((bundle + tree)) -gt $((60 * 1048576)) ]; then
  echo "error: too big to carry (64 MiB with untracked files)" >&2
  exit 2
fi
