#!/usr/bin/env bash
# Issue 30, 4: qatc's CPU step against every variant of the PyTorch peer, side by side in one run
# on the same machine: GPT-2 124M at B 1 and B 4, T 256, and the 4-layer n_embd 256 config at B 4,
# T 128 (4-bit sym g64 frozen weights + LoRA r 16 on all four linears, AdamW; weights random).
# qatc in fp32 and bf16, and bf16 given 4 GiB (`--memory`: the chunked cross-entropy's rows grow
# into it); PyTorch eager fp32, eager + sdpa + precomputed fake-quant (+ bf16
# autocast), and torch.compile of that (+ bf16 autocast). Prints one JSON line per run and, per
# config, qatc's fastest against the fastest peer. Needs the peer environment.
# Usage: bench/cpu_peers.sh [STEPS]   (ROUNDS=2 runs every row twice, interleaved)
set -euo pipefail
# qatc names OpenBLAS's kernel set from the CPU unless the environment does; some machines'
# environments name a weaker one (OPENBLAS_CORETYPE=Haswell on AVX-512 CPUs: half the f32 GEMM rate)
unset OPENBLAS_CORETYPE
cd "$(dirname "$0")/.."
steps=${1:-5}
rounds=${ROUNDS:-1}
py=$(bash ../shared/tools/peer-env.sh | tail -1)
bin=target/release/examples/bench_cpu_train
log=out/cpu-peers.jsonl
mkdir -p out
: >"$log"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) threads; features:" \
  "$(grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
run() { "$@" 2>/dev/null | tail -1 | tee -a "$log"; }
for cfg in "124m 1 12 768 12 256" "124m 4 12 768 12 256" "small 4 4 256 4 128"; do
  read -r model b layers embd heads seq <<<"$cfg"
  torch=(--layers "$layers" --embd "$embd" --heads "$heads" --vocab 50257 --seq "$seq" --batch "$b" --bits 4 --group 64 --r 16
         --steps "$steps" --threads "$(nproc)")
  echo "== $model, B $b, T $seq"
  for _ in $(seq "$rounds"); do
    run "$bin" "$steps" compiled "$model" --batch "$b"
    run "$bin" "$steps" compiled "$model" --batch "$b" --precision bf16
    run "$bin" "$steps" compiled "$model" --batch "$b" --precision bf16 --memory 4GiB
    run "$py" ../shared/tools/torch_peer.py "${torch[@]}"
    run "$py" ../shared/tools/torch_peer.py "${torch[@]}" --attn sdpa --precompute-quant
    run "$py" ../shared/tools/torch_peer.py "${torch[@]}" --attn sdpa --precompute-quant --autocast bf16
    run "$py" ../shared/tools/torch_peer.py "${torch[@]}" --attn sdpa --precompute-quant --compile
    run "$py" ../shared/tools/torch_peer.py "${torch[@]}" --attn sdpa --precompute-quant --compile --autocast bf16
  done
done
python3 - "$log" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows:
    if "torch" in r:
        cfg = ("124m" if r["layers"] == 12 else "small", r["batch"])
        name = "torch " + "+".join(x for x in [r["attn"], "precompute" if r["precompute_quant"] else "", "compile" if r["compile"] else "eager", r["autocast"] if r["autocast"] != "none" else "fp32"] if x)
    else:
        cfg = (r["model"].split("-")[0], r.get("batch", 1))
        name = f"qatc {r['precision']}" + (f" --memory {r['memory'] / 2**30:g}GiB" if r.get("memory") else "")
    by.setdefault(cfg, {}).setdefault(name, []).append(r["step_s_median"])
for cfg, peers in by.items():
    best = {n: min(v) for n, v in peers.items()}
    q = min((v, n) for n, v in best.items() if n.startswith("qatc"))
    t = min((v, n) for n, v in best.items() if n.startswith("torch"))
    print(f"{cfg[0]} B {cfg[1]}: " + ", ".join(f"{n} {v:.3f} s" for n, v in sorted(best.items(), key=lambda x: x[1])))
    print(f"   fastest qatc ({q[1]}) / fastest PyTorch ({t[1]}): {t[0] / q[0]:.2f}x")
PY
