#!/usr/bin/env bash
# The checks and figures of qatc's CUDA backend on a GPU machine (an H100/H200 with CUDA 13,
# PyTorch and transformers; no Rust, no network). Build first, on a machine with Rust:
#
#   make gpu-bundle                 # .gpu/bundle.tar.gz: qatc and the GPU test executables
#
# then, on the GPU machine, in the repository root (the device tool carries `.gpu`):
#
#   bash bench/gpu.sh [SECTION ...]    # default: every section, in this order
#
#   env        the GPU, driver, CUDA, PyTorch; which NVRTC and cuBLAS the checks load
#   compile    qatc compile --device cuda: every kernel of the demo and 124M steps to CUBINs for
#              the device, with registers, spills and shared memory per kernel
#   tests      the GPU tests: the GPU API on the device; the tiny and Shakespeare GPT-2 steps on
#              CUDA against the CPU over 10 steps (losses 1e-5, gradients 1e-4 relative); each
#              kernel of the demo step against the kernel-IR evaluator; the writer's kernels
#   sanitizer  compute-sanitizer memcheck and racecheck over every kernel of the tiny steps
#              (each launched by the tests' plain driver) and of the demo step (each kernel once)
#   peer       the PyTorch peer (bench/torch_cuda_peer.py), 124M, B 8, T 1024, fp32 / TF32 / bf16,
#              eager and sdpa: the figures qatc's CUDA step is to be measured against
#   executor   WAITS FOR THE CUDA EXECUTOR: qatc train --device cuda against --device cpu over 10
#              steps (tiny fixture, Shakespeare GPT-2), the device's peak memory against
#              `qatc plan`, and qatc's 124M step time (fp32, TF32) next to the peer's. Until the
#              executor exists each part records why it could not run.
#
# Everything is written under $OUT (the device tool's output folder; ./out-gpu when unset) as at
# most a few files: summary.txt (the table of results, also printed last), logs.tar.gz (every log),
# kernels-demo.json and kernels-124m.json (the resource reports), peer.jsonl (the peer's figures).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
OUT=${OUT:-$root/out-gpu}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/qatc-gpu.XXXXXX)
logs=$work/logs
mkdir -p "$logs"
summary=$OUT/summary.txt
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(env compile tests sanitizer peer executor)

# --- the bundle --------------------------------------------------------------------------------
if [ ! -f .gpu/bundle.tar.gz ]; then
  say "error: no .gpu/bundle.tar.gz: run 'make gpu-bundle' on a machine with Rust and carry .gpu"
  exit 2
fi
tar xzf .gpu/bundle.tar.gz -C "$work"
qatc=$work/bin/qatc
tests=$work/tests
# the test executables find their fixtures under the directory they were built in
built_in=$(cat .gpu/manifest)
if [ "$built_in" != "$root" ] && [ ! -e "$built_in" ]; then
  mkdir -p "$(dirname "$built_in")" && ln -s "$root" "$built_in"
fi

# --- libraries: NVRTC and cuBLAS from the CUDA toolkit or PyTorch's wheels ------------------------
py=python3
wheel_libs=$($py -c 'import glob, os
try:
    import nvidia
    dirs = [d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "*", "lib")) + glob.glob(os.path.join(p, "*", "*", "lib"))]
except ImportError:
    dirs = []
print(":".join(sorted(set(dirs))))' 2>/dev/null)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${wheel_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ -z "${QATC_NVRTC_LIB:-}" ]; then
  for d in /usr/local/cuda/lib64 ${wheel_libs//:/ }; do
    f=$(ls "$d"/libnvrtc.so.1[0-9]* 2>/dev/null | grep -v builtins | head -1)
    [ -n "$f" ] && { export QATC_NVRTC_LIB=$f; break; }
  done
fi
export RUST_BACKTRACE=1

# runs a test executable's tests (names as substrings), logging to $logs/NAME.log; one result line
run_test() {
  local exe=$1 log=$2 limit=$3
  shift 3
  timeout "$limit" "$tests/$exe" --nocapture --test-threads 1 "$@" >"$logs/$log.log" 2>&1
  local rc=$?
  local res
  res=$(grep -E '^test result' "$logs/$log.log" | tail -1)
  say "$(printf '%-34s rc %-3s %s' "$log" "$rc" "${res:-no result (see logs/$log.log)}")"
  grep -E 'SKIPPED|worst|kernels for|GPU:' "$logs/$log.log" | sed 's/^/    /' | head -12 | tee -a "$summary"
}

for s in "${sections[@]}"; do
  case $s in
  env)
    say "== env ($(date -u +%F\ %T) UTC)"
    { nvidia-smi; nvcc --version; $py -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name()); print("transformers", transformers.__version__)'; } >"$logs/env.log" 2>&1
    say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
    say "NVRTC: ${QATC_NVRTC_LIB:-not found}"
    say "cuBLAS: $(for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libcublas.so.* 2>/dev/null; done | head -1)"
    ;;
  compile)
    say "== compile: every kernel to a CUBIN for this GPU (qatc compile --device cuda)"
    $py - "$work/gpt2-124m" <<'EOF' >"$logs/model-124m.log" 2>&1
import sys
from transformers import GPT2Config, GPT2LMHeadModel
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
EOF
    demo=(examples/gpt2-shakespeare-small/model.safetensors --batch 4 --seq 128 --bits 4 --group 32 --scheme q4_0 --lora r=16)
    big=("$work/gpt2-124m/model.safetensors" --batch 8 --seq 1024 --bits 4 --group 64 --lora r=16)
    for pair in "demo:demo" "124m:big"; do
      name=${pair%%:*}
      declare -n args=${pair##*:}
      for round in cold cached; do
        timeout 600 "$qatc" compile "${args[@]}" --device cuda --kernel-cache "$work/kcache" -o "$work/compile-$name" >"$logs/compile-$name-$round.log" 2>&1
        say "$(printf '%-10s %-7s rc %-3s %s' "$name" "$round" "$?" "$(grep -E 'cubins' "$logs/compile-$name-$round.log" | sed 's/^ *cubins *//')")"
      done
      cp "$work/compile-$name/kernels/report.json" "$OUT/kernels-$name.json" 2>/dev/null
      grep -A8 ' regs ' "$logs/compile-$name-cold.log" | head -9 | sed 's/^/    /' | tee -a "$summary"
      unset -n args
    done
    ;;
  tests)
    say "== tests on the GPU (test executables from make gpu-bundle)"
    run_test gpu_api gpu-api 300
    run_test gpu_step gpu-step-10-steps 600 ten_steps_on_the_gpu_track_the_cpu
    run_test gpu_step gpu-step-each-kernel 600 every_kernel_of_the_demo_step_matches_the_evaluator
    run_test gpu_step gpu-step-emulated 300 the_tiny_step_on_the_emulated_gpu
    run_test cuda_writer cuda-writer 300
    run_test nvrtc nvrtc 600
    ;;
  sanitizer)
    say "== compute-sanitizer (memcheck, racecheck): every kernel of the tiny steps and of the demo step"
    for tool in memcheck racecheck; do
      for t in ten_steps_on_the_gpu_track_the_cpu every_kernel_of_the_demo_step_matches_the_evaluator; do
        log=sanitizer-$tool-${t%%_*}
        timeout 600 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
          "$tests/gpu_step" --nocapture --test-threads 1 "$t" >"$logs/$log.log" 2>&1
        rc=$?
        errs=$(grep -E '^========= ERROR SUMMARY' "$logs/$log.log" | tail -1)
        say "$(printf '%-34s rc %-3s %s' "$log" "$rc" "${errs:-no summary (see logs/$log.log)}")"
      done
    done
    ;;
  peer)
    say "== PyTorch peer on this GPU: 124M, B 8, T 1024, 4-bit g64 fake-quant + LoRA r 16 (median of 20 steps)"
    : >"$OUT/peer.jsonl"
    for dtype in fp32 tf32 bf16; do
      for attn in eager sdpa; do
        timeout 600 $py bench/torch_cuda_peer.py --dtype "$dtype" --attn "$attn" --steps 20 >"$logs/peer-$dtype-$attn.log" 2>&1
        line=$(grep '^{' "$logs/peer-$dtype-$attn.log" | tail -1)
        [ -n "$line" ] && echo "$line" >>"$OUT/peer.jsonl"
        say "$(printf '%-5s %-6s ' "$dtype" "$attn")$(echo "${line:-{\}}" | $py -c 'import json, sys
d = json.loads(sys.stdin.read() or "{}")
print("%.1f ms/step, %.0f tokens/s, peak %.2f GiB" % (d["step_s_median"] * 1e3, d["tokens_per_s"], d["peak_allocated_bytes"] / 2**30) if d else "failed (see logs)")')"
      done
    done
    ;;
  executor)
    say "== WAITS FOR THE CUDA EXECUTOR: qatc train --device cuda against the CPU, peak memory, qatc's speed"
    for m in "tiny:tests/fixtures/tiny/f32_prefix/model.safetensors:tests/fixtures/tiny/tokens.bin:1:16:--group 32" \
      "shakespeare:examples/gpt2-shakespeare-small/model.safetensors:examples/shakespeare_train.bin:4:128:--group 32"; do
      IFS=: read -r name model data b t extra <<<"$m"
      for dev in cpu cuda; do
        # shellcheck disable=SC2086
        timeout 600 "$qatc" train "$model" --data "$data" --batch "$b" --seq "$t" --steps 10 --bits 4 $extra --lora r=16 \
          --lr 1e-3 --device "$dev" --out "$work/train-$name-$dev" --log-json "$work/train-$name-$dev.jsonl" >"$logs/train-$name-$dev.log" 2>&1
        echo "rc $?" >>"$logs/train-$name-$dev.log"
      done
      $py - "$work/train-$name-cpu.jsonl" "$work/train-$name-cuda.jsonl" <<'EOF' >"$logs/train-$name-compare.log" 2>&1
import json, sys
def losses(p):
    try:
        return [json.loads(l)["loss"] for l in open(p) if l.strip()]
    except (OSError, KeyError, ValueError):
        return []
cpu, gpu = losses(sys.argv[1]), losses(sys.argv[2])
if len(gpu) < 10 or len(cpu) < 10:
    print(f"no comparison: {len(cpu)} CPU and {len(gpu)} CUDA losses (the CUDA executor does not exist yet)")
else:
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(cpu, gpu))
    print(f"10 losses, worst relative difference {worst:.2e}: {'PASS' if worst <= 1e-5 else 'FAIL'} (1e-5)")
EOF
      say "$(printf '%-12s %s' "$name" "$(tail -1 "$logs/train-$name-compare.log")")"
      grep -h -E 'error|CUDA' "$logs/train-$name-cuda.log" | head -2 | sed 's/^/    /' | tee -a "$summary"
    done
    # qatc's 124M step next to the peer's waits for `qatc train --device cuda` (a GPU twin of
    # bench_cpu_train is the executor's to write); the plan's figure for the memory comparison:
    "$qatc" plan 124M --batch 8 --seq 1024 --bits 4 --group 64 --lora r=16 --json >"$logs/plan-124m.json" 2>&1
    say "qatc plan 124M B 8 T 1024: peak $($py -c 'import json, sys; print("%.2f GiB" % (json.load(open(sys.argv[1]))["summary"]["peak_bytes"] / 2**30))' "$logs/plan-124m.json" 2>/dev/null || echo "?") (to compare with the CUDA executor's peak)"
    ;;
  *) say "unknown section $s (env compile tests sanitizer peer executor)" ;;
  esac
done

tar czf "$OUT/logs.tar.gz" -C "$work" logs
say "logs: \$OUT/logs.tar.gz; figures: \$OUT/summary.txt, kernels-*.json, peer.jsonl"
