#!/usr/bin/env bash
# The checks and figures of qatc's CUDA backend on a GPU machine (an H100/H200 with CUDA 13,
# PyTorch and transformers; no Rust, no network). Build first, on a machine with Rust:
#
#   make gpu-bundle                 # .gpu/bundle.tar.gz: qatc and the GPU test executables
#
# then, on the GPU machine, in the repository root (the device tool carries `.gpu`):
#
#   bash bench/gpu.sh [--dry-run] [--deadline SECONDS] [SECTION ...]
#
# Two device calls of at most 10 minutes each run everything (each stops starting work when its
# deadline, 560 s by default, comes near, and says what it skipped):
#
#   bash bench/gpu.sh env compile tests executor      # correctness
#   bash bench/gpu.sh speed peer sanitizer            # figures and the sanitizer
#
# Sections (default: all, in the order given here):
#   env        the GPU, driver, CUDA, PyTorch; which NVRTC and cuBLAS the checks load
#   compile    qatc compile --device cuda: every kernel of the demo and 124M steps to CUBINs for
#              the device, with registers, spills and shared memory per kernel (cold and cached)
#   tests      the GPU tests: the GPU API on the device; the CUDA executor (CudaProgram) ten
#              steps in lock step with the CPU (tiny full fine-tune and 4-bit + LoRA, Shakespeare
#              GPT-2 4-bit + LoRA: losses 1e-5, gradients 1e-4); the plain driver's ten steps; each
#              kernel of the demo step against the kernel-IR evaluator
#   executor   qatc train --device cuda against --device cpu over 10 steps (tiny 4-bit + LoRA, tiny
#              full fine-tune, Shakespeare GPT-2 4-bit + LoRA): the losses compared (1e-5), the
#              step's device memory as qatc states it
#   speed      qatc train --device cuda on GPT-2 124M (random init), B 8, T 1024, 4-bit g64 +
#              LoRA r 16: tokens/s (median of the steps after the first two) in strict fp32 and
#              TF32; the device's peak memory (nvidia-smi, sampled) against the executor's layout
#              and `qatc plan`
#   peer       the PyTorch twin (bench/torch_cuda_peer.py), the same step: fp32 and TF32 eager,
#              bf16 sdpa (median of 20 steps); with speed: qatc's figure over the peer's
#   sanitizer  compute-sanitizer memcheck and racecheck: every kernel of the demo step launched
#              once (the tests' plain driver), and the executor's own work (qatc train --device
#              cuda --no-cuda-graph, tiny, 2 steps: launches, cuBLAS calls, copies)
#
# --dry-run checks the plumbing on a machine without a GPU (CI or here): the arguments, the
# bundle (its contents, that its executables run and hold the tests named here, that the bundle
# and the tree fit in what a device call carries), the Python twin's --help, and the parts that
# need no GPU for real (the executor's HostGpu test, the CPU arms and the `--device cuda` error
# path of qatc train); every GPU command is written to its log instead of run.
#
# Everything is written under $OUT (the device tool's output folder; ./out-gpu, or
# ./out-gpu-dry with --dry-run, when unset), at most 8 files: summary.txt (the table of results,
# printed last), logs.tar.gz (every log), kernels-demo.json and kernels-124m.json (the resource
# reports), speed.jsonl (qatc's figures), peer.jsonl (the twin's).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
all=(env compile tests executor speed peer sanitizer)
dry=0
deadline=560
sections=()
while [ $# -gt 0 ]; do
  case $1 in
  --dry-run) dry=1 ;;
  --deadline) deadline=${2:-}; shift ;;
  --deadline=*) deadline=${1#*=} ;;
  -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  -*) echo "error: unknown option $1 (--dry-run, --deadline SECONDS)" >&2; exit 2 ;;
  *)
    if [[ " ${all[*]} " != *" $1 "* ]]; then
      echo "error: unknown section $1 (sections: ${all[*]})" >&2
      exit 2
    fi
    sections+=("$1")
    ;;
  esac
  shift
done
if ! [[ $deadline =~ ^[0-9]+$ ]]; then
  echo "error: --deadline takes whole seconds, got '$deadline'" >&2
  exit 2
fi
[ ${#sections[@]} -eq 0 ] && sections=("${all[@]}")
if [ $dry = 1 ]; then OUT=${OUT:-$root/out-gpu-dry}; else OUT=${OUT:-$root/out-gpu}; fi
mkdir -p "$OUT"
work=$(mktemp -d /tmp/qatc-gpu.XXXXXX)
logs=$work/logs
mkdir -p "$logs"
summary=$OUT/summary.txt
: >"$summary"
start=$SECONDS
failures=0
say() { echo "$*" | tee -a "$summary"; }
left() { echo $((deadline - (SECONDS - start))); }

# run NAME LIMIT CMD...: CMD with a time limit of LIMIT seconds or what is left of the deadline,
# its output in $logs/NAME.log; sets $rc (124: out of time; 'skipped' when no time was left;
# 'dry' in a dry run).
# In a dry run the command is written to the log instead (unless $really is 1).
really=0
run() {
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  ((l - 10 < limit)) && limit=$((l - 10))
  if ((limit < 5)); then
    echo "skipped: the deadline (${deadline} s) came" >"$logs/$name.log"
    rc=skipped
    return
  fi
  if [ $dry = 1 ] && [ $really = 0 ]; then
    printf 'dry run, not run: %q ' "$@" >"$logs/$name.log"
    echo >>"$logs/$name.log"
    rc=dry
    return
  fi
  timeout -k 5 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
}
# a result line: NAME, rc ('dry': written, not run), what
line() {
  say "$(printf '%-30s rc %-7s %s' "$1" "$2" "$3")"
  [ "$2" = 0 ] || [ "$2" = skipped ] || [ "$2" = dry ] || failures=$((failures + 1))
}

# --- the bundle --------------------------------------------------------------------------------
if [ ! -f .gpu/bundle.tar.gz ]; then
  say "error: no .gpu/bundle.tar.gz: run 'make gpu-bundle' on a machine with Rust and carry .gpu"
  exit 2
fi
tar xzf .gpu/bundle.tar.gz -C "$work" || { say "error: .gpu/bundle.tar.gz does not unpack"; exit 2; }
qatc=$work/bin/qatc
tests=$work/tests
# the test executables find their fixtures under the directory they were built in
built_in=$(cat .gpu/manifest 2>/dev/null)
if [ -n "$built_in" ] && [ "$built_in" != "$root" ] && [ ! -e "$built_in" ]; then
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
  for d in /usr/local/cuda/lib64 ${wheel_libs//:/ } "$root/.deps/nvrtc/nvidia/cu13/lib"; do
    f=$(ls "$d"/libnvrtc.so.1[0-9]* 2>/dev/null | grep -v builtins | head -1)
    [ -n "$f" ] && { export QATC_NVRTC_LIB=$f; break; }
  done
fi
export RUST_BACKTRACE=1
# one kernel cache for the call: qatc compile's (--kernel-cache) is qatc train's default one
export XDG_CACHE_HOME=$work/xdg-cache
kcache=$XDG_CACHE_HOME/qatc

# runs a test executable's tests (names as substrings); one result line, and its notable lines
run_test() {
  local exe=$1 name=$2 limit=$3
  shift 3
  run "$name" "$limit" "$tests/$exe" --nocapture --test-threads 1 "$@"
  local res
  res=$(grep -E '^test result' "$logs/$name.log" | tail -1)
  [ "$rc" = dry ] || res=${res:-no result (see logs/$name.log)}
  line "$name" "$rc" "$res"
  grep -E 'SKIPPED|worst|kernels for|GPU:|bytes in and out|launches and' "$logs/$name.log" | cut -c1-220 | sed 's/^/    /' | head -12 | tee -a "$summary"
}

# GPT-2 124M, randomly initialised, as Hugging Face safetensors (once per call)
model_124m() {
  [ -f "$work/gpt2-124m/model.safetensors" ] && return 0
  really=0 run model-124m 120 $py - "$work/gpt2-124m" <<'EOF'
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained(sys.argv[1], safe_serialization=True)
EOF
  [ "$rc" = 0 ]
}

# the losses of two --log-json files, compared: one line
compare_losses() {
  $py - "$1" "$2" <<'EOF'
import json, sys
def losses(p):
    try:
        return [json.loads(l)["loss"] for l in open(p) if l.strip()]
    except (OSError, KeyError, ValueError):
        return []
cpu, gpu = losses(sys.argv[1]), losses(sys.argv[2])
if len(gpu) < 10 or len(cpu) < 10:
    print(f"no comparison: {len(cpu)} CPU and {len(gpu)} CUDA losses")
else:
    worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(cpu, gpu))
    print(f"10 losses {cpu[0]:.5f} .. {cpu[-1]:.5f}, worst relative difference {worst:.2e}: {'PASS' if worst <= 1e-5 else 'FAIL'} (1e-5)")
EOF
}

# --- the dry run's own checks: the bundle, the executables, the twin --------------------------------
if [ $dry = 1 ]; then
  say "== dry run ($(date -u +%F\ %T) UTC): the script's plumbing, no GPU needed"
  bundle=$(du -b .gpu/bundle.tar.gz | cut -f1)
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | grep total$ | awk '{s += $1} END {print s + 0}')
  ok=0; [ $((bundle + tree)) -lt $((64 * 1048576)) ] || ok=1
  line "bundle size" $ok "bundle $((bundle / 1048576)) MiB + tracked tree $((tree / 1048576)) MiB of the 64 MiB a device call carries"
  for f in bin/qatc tests/gpu_api tests/gpu_step tests/cuda_exec; do
    [ -x "$work/$f" ] && r=0 || r=1
    line "bundle holds $f" $r ""
  done
  "$qatc" train --help >"$logs/qatc-train-help.log" 2>&1
  grep -q -- '--tf32' "$logs/qatc-train-help.log" && grep -q -- '--device' "$logs/qatc-train-help.log" && r=0 || r=1
  line "qatc train --help" $r "the bundle's qatc runs and has --device, --tf32"
  # every test this script names exists in its executable (a renamed test would silently run nothing)
  for pair in cuda_exec:ten_steps_of_the_cuda_executor_track_the_cpu cuda_exec:state_stays_on_the_device_between_steps \
    gpu_step:ten_steps_on_the_gpu_track_the_cpu gpu_step:every_kernel_of_the_demo_step_matches_the_evaluator; do
    exe=${pair%%:*} t=${pair#*:}
    "$tests/$exe" --list 2>/dev/null | grep -q "^$t: test$" && r=0 || r=1
    line "$exe has $t" $r ""
  done
  n=$("$tests/gpu_api" --list 2>/dev/null | grep -c ': test$')
  [ "$n" -gt 0 ] && r=0 || r=1
  line "gpu_api --list" $r "$n tests"
  $py bench/torch_cuda_peer.py --help >"$logs/peer-help.log" 2>&1 && grep -q -- '--dtype' "$logs/peer-help.log" && r=0 || r=1
  line "torch_cuda_peer.py --help" $r ""
fi

for s in "${sections[@]}"; do
  case $s in
  env)
    say "== env ($(date -u +%F\ %T) UTC)"
    run env 60 bash -c 'nvidia-smi; nvcc --version; ldconfig -p | grep -E "libcuda.so|libcublas"; python3 -c "import torch, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name()); print(\"transformers\", transformers.__version__)"'
    line env "$rc" "$(grep -m1 -E 'H100|H200|NVIDIA' "$logs/env.log" | cut -c1-100)"
    say "NVRTC: ${QATC_NVRTC_LIB:-not found}"
    say "cuBLAS: $(for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libcublas.so.* 2>/dev/null; done | head -1)"
    ;;
  compile)
    say "== compile: every kernel to a CUBIN for this GPU (qatc compile --device cuda)"
    demo=(examples/gpt2-shakespeare-small/model.safetensors --batch 4 --seq 128 --bits 4 --group 32 --scheme q4_0 --lora r=16)
    for round in cold cached; do
      run "compile-demo-$round" 150 "$qatc" compile "${demo[@]}" --device cuda --kernel-cache "$kcache" -o "$work/compile-demo"
      line "compile demo $round" "$rc" "$(grep -E 'cubins' "$logs/compile-demo-$round.log" | sed 's/^ *cubins *//' | cut -c1-150)"
    done
    cp "$work/compile-demo/kernels/report.json" "$OUT/kernels-demo.json" 2>/dev/null
    grep -A8 ' regs ' "$logs/compile-demo-cold.log" | head -9 | sed 's/^/    /' | tee -a "$summary"
    if [ $dry = 1 ] || model_124m; then
      run compile-124m 240 "$qatc" compile "$work/gpt2-124m/model.safetensors" --batch 8 --seq 1024 --bits 4 --group 64 --lora r=16 \
        --device cuda --kernel-cache "$kcache" -o "$work/compile-124m"
      line "compile 124m cold" "$rc" "$(grep -E 'cubins' "$logs/compile-124m.log" | sed 's/^ *cubins *//' | cut -c1-150)"
      cp "$work/compile-124m/kernels/report.json" "$OUT/kernels-124m.json" 2>/dev/null
    else
      line "compile 124m" "$rc" "no model (see logs/model-124m.log)"
    fi
    ;;
  tests)
    say "== tests on the GPU (test executables from make gpu-bundle)"
    run_test gpu_api gpu-api 60
    run_test cuda_exec executor-10-steps 240 ten_steps_of_the_cuda_executor_track_the_cpu
    # the emulated executor and the CLI's paths: they need no GPU, so the dry run runs them
    really=$dry run_test cuda_exec executor-emulated 120 state_stays_on_the_device_between_steps
    run_test gpu_step plain-10-steps 240 ten_steps_on_the_gpu_track_the_cpu
    run_test gpu_step each-demo-kernel 240 every_kernel_of_the_demo_step_matches_the_evaluator
    ;;
  executor)
    say "== qatc train --device cuda against --device cpu (10 steps; the CPU side is this bundle's: the reference interpreter)"
    cases=("tiny-lora:tests/fixtures/tiny/f32_prefix/model.safetensors:tests/fixtures/tiny/tokens.bin:1:16:--bits 4 --group 32 --lora r=16"
      "tiny-full:tests/fixtures/tiny/f32_prefix/model.safetensors:tests/fixtures/tiny/tokens.bin:1:16:--full-finetune"
      "shakespeare:examples/gpt2-shakespeare-small/model.safetensors:examples/shakespeare_train.bin:4:128:--bits 4 --group 32 --lora r=16")
    for c in "${cases[@]}"; do
      IFS=: read -r name model data b t extra <<<"$c"
      # the dry run trains the tiny CPU arms for real, and checks that --device cuda says why not
      for dev in cpu cuda; do
        real=0
        [ $dry = 1 ] && [ "$name" != shakespeare ] && real=1
        # shellcheck disable=SC2086
        really=$real run "train-$name-$dev" 240 "$qatc" train "$model" --data "$data" --batch "$b" --seq "$t" --steps 10 $extra \
          --lr 1e-3 --device "$dev" --out "$work/train-$name-$dev" --log-json "$work/train-$name-$dev.jsonl"
        eval "rc_$dev=\$rc"
      done
      if [ $dry = 1 ]; then
        # no GPU here: the CUDA arm must have failed with one line and exit code 2
        [ "$name" = shakespeare ] && { line "train $name" dry ""; continue; }
        [ "$rc_cpu" = 0 ] && [ "$rc_cuda" = 2 ] && [ "$(grep -c . "$logs/train-$name-cuda.log")" = 1 ] && r=0 || r=1
        line "train $name" $r "cpu rc $rc_cpu; cuda rc $rc_cuda: $(head -1 "$logs/train-$name-cuda.log" | cut -c1-100)"
        continue
      fi
      r=$(compare_losses "$work/train-$name-cpu.jsonl" "$work/train-$name-cuda.jsonl")
      [[ $r == *PASS* ]] && ok=0 || ok=1
      line "train $name" "$ok" "$r"
      grep -h -E 'runs on CUDA|error' "$logs/train-$name-cuda.log" | head -2 | cut -c1-400 | sed 's/^/    /' | tee -a "$summary"
    done
    ;;
  speed)
    say "== qatc's step on this GPU: GPT-2 124M, B 8, T 1024, 4-bit g64 + LoRA r 16 (median tokens/s of steps 2..11)"
    : >"$OUT/speed.jsonl"
    really=$dry run plan-124m 60 "$qatc" plan 124M --batch 8 --seq 1024 --bits 4 --group 64 --lora r=16 --json
    plan_peak=$($py -c 'import json, sys; print(json.load(open(sys.argv[1]))["summary"]["peak_bytes"])' "$logs/plan-124m.log" 2>/dev/null || echo 0)
    line "qatc plan 124m" "$rc" "peak $((plan_peak / 1048576)) MiB (the memory plan of the unfused step)"
    if [ $dry = 0 ] && ! model_124m; then
      line "speed" 1 "no model (see logs/model-124m.log)"
      continue
    fi
    for mode in fp32 tf32; do
      flag=()
      [ $mode = tf32 ] && flag=(--tf32)
      mem=$work/mem-$mode.log
      if [ $dry = 0 ]; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$mem" 2>/dev/null &
        smi=$!
      fi
      run "speed-$mode" 240 "$qatc" train "$work/gpt2-124m/model.safetensors" --data examples/shakespeare_train.bin --batch 8 --seq 1024 \
        --steps 12 --bits 4 --group 64 --lora r=16 --lr 1e-4 --device cuda "${flag[@]}" --out "$work/speed-$mode" --log-json "$work/speed-$mode.jsonl"
      [ $dry = 0 ] && { kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null; }
      [ $dry = 1 ] && { line "speed $mode" dry ""; continue; }
      fig=$($py - "$work/speed-$mode.jsonl" "$mem" "$mode" "$plan_peak" "$logs/speed-$mode.log" <<'EOF'
import json, sys
log, mem, mode, plan_peak, out = sys.argv[1:6]
try:
    steps = [json.loads(l) for l in open(log) if l.strip()]
except OSError:
    steps = []
tps = sorted(s["tokens_per_s"] for s in steps[2:])
used = [int(x) for x in open(mem).read().split() if x.strip().isdigit()] if mem else []
line = next((l.strip() for l in open(out) if "runs on CUDA" in l), "")
d = {"mode": mode, "steps": len(steps), "tokens_per_s_median": tps[len(tps) // 2] if tps else None,
     "step_ms_median": 8 * 1024 / tps[len(tps) // 2] * 1e3 if tps else None,
     "losses": [s["loss"] for s in steps], "nvidia_smi_peak_mib": max(used) if used else None,
     "plan_peak_bytes": int(plan_peak), "qatc": line}
print(json.dumps(d))
EOF
)
      echo "$fig" >>"$OUT/speed.jsonl"
      line "speed $mode" "$rc" "$(echo "$fig" | $py -c 'import json, sys
d = json.loads(sys.stdin.read())
t = d["tokens_per_s_median"]
print("%s tokens/s (%.1f ms/step), nvidia-smi peak %s MiB" % (round(t) if t else "?", d["step_ms_median"] or 0, d["nvidia_smi_peak_mib"]) if t else "no figure (see logs)")' 2>/dev/null)"
      grep -h 'runs on CUDA' "$logs/speed-$mode.log" | head -1 | cut -c1-500 | sed 's/^/    /' | tee -a "$summary"
    done
    ;;
  peer)
    say "== the PyTorch twin on this GPU: 124M, B 8, T 1024, 4-bit g64 fake-quant + LoRA r 16 (median of 20 steps)"
    : >"$OUT/peer.jsonl"
    for cfg in fp32:eager tf32:eager bf16:sdpa; do
      dtype=${cfg%%:*} attn=${cfg##*:}
      run "peer-$dtype-$attn" 150 $py bench/torch_cuda_peer.py --dtype "$dtype" --attn "$attn" --steps 20
      [ $dry = 1 ] && { line "peer $dtype $attn" dry ""; continue; }
      l=$(grep '^{' "$logs/peer-$dtype-$attn.log" | tail -1)
      [ -n "$l" ] && echo "$l" >>"$OUT/peer.jsonl"
      line "peer $dtype $attn" "$rc" "$(echo "${l:-{\}}" | $py -c 'import json, sys
d = json.loads(sys.stdin.read() or "{}")
print("%.1f ms/step, %.0f tokens/s, peak %.2f GiB" % (d["step_s_median"] * 1e3, d["tokens_per_s"], d["peak_allocated_bytes"] / 2**30) if d else "failed (see logs)")')"
    done
    # qatc over the twin, where both ran in this call
    if [ -s "$OUT/speed.jsonl" ] && [ -s "$OUT/peer.jsonl" ]; then
      $py - "$OUT/speed.jsonl" "$OUT/peer.jsonl" <<'EOF' | tee -a "$summary"
import json, sys
qatc = {d["mode"]: d for d in map(json.loads, open(sys.argv[1])) if d.get("tokens_per_s_median")}
peer = {d["dtype"]: d for d in map(json.loads, open(sys.argv[2])) if d.get("attn") == "eager"}
for mode in ("fp32", "tf32"):
    if mode in qatc and mode in peer:
        q, p = qatc[mode]["tokens_per_s_median"], peer[mode]["tokens_per_s"]
        print(f"qatc / PyTorch eager, {mode}: {q:.0f} / {p:.0f} tokens/s = {q / p:.2f}x")
EOF
    fi
    ;;
  sanitizer)
    say "== compute-sanitizer: memcheck and racecheck"
    for tool in memcheck racecheck; do
      run "sanitizer-$tool-kernels" 200 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
        "$tests/gpu_step" --nocapture --test-threads 1 every_kernel_of_the_demo_step_matches_the_evaluator
      line "$tool demo kernels" "$rc" "$(grep -E '^========= ERROR SUMMARY' "$logs/sanitizer-$tool-kernels.log" | tail -1)"
      run "sanitizer-$tool-executor" 120 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
        "$qatc" train tests/fixtures/tiny/f32_prefix/model.safetensors --data tests/fixtures/tiny/tokens.bin --batch 1 --seq 16 \
        --steps 2 --bits 4 --group 32 --lora r=16 --device cuda --no-cuda-graph --out "$work/sanitizer-$tool"
      line "$tool executor" "$rc" "$(grep -E '^========= ERROR SUMMARY' "$logs/sanitizer-$tool-executor.log" | tail -1)"
    done
    ;;
  esac
done

say "== $failures failed; $((SECONDS - start)) s of the ${deadline} s deadline"
tar czf "$OUT/logs.tar.gz" -C "$work" logs
n=$(find "$OUT" -type f | wc -l)
big=$(find "$OUT" -type f -size +16M | wc -l)
[ "$n" -le 8 ] && [ "$big" = 0 ] || say "warning: $n files under \$OUT ($big over 16 MiB): the device tool brings back at most 8 of 16 MiB"
say "logs: \$OUT/logs.tar.gz; figures: \$OUT/summary.txt, kernels-*.json, speed.jsonl, peer.jsonl"
rm -rf "$work"
[ $failures = 0 ]
