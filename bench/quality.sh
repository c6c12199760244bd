#!/usr/bin/env bash
# The quality benchmark (issue 19): validation loss of the Shakespeare GPT-2 at full precision,
# after post-training quantization, after QAT + LoRA, and after LoRA on the unquantized model,
# side by side in one run, with PyTorch + PEFT on the same recipe as the reference row.
#
#   bash bench/quality.sh              every row; results in out/quality/ (rows.jsonl, table.md)
#   ROWS='b3_sym_learned_base b2*' bash bench/quality.sh     only rows matching these globs
#   MODEL=quality SEEDS='1 2 3' ROWS='fp lora_fp *_ptq *_learned_base *_learned_merged peer_*' \
#     bash bench/quality.sh            the defaults against PyTorch + PEFT on the evaluation GPT-2
#
# MODEL: shakespeare (the embedded 4-layer GPT-2, the default), quality (the 6-layer evaluation
# GPT-2 of issue 33, made by bench/quality-model/make.sh into its cache when missing), or a path to
# a model.safetensors with its config.json beside it. Results go to out/quality/ for the embedded
# model and out/quality-MODEL/ otherwise (OUT overrides).
# SEEDS: every trained row (qatc's and PyTorch's) runs once per seed (the batch order and LoRA's
# initialisation); the post-training rows do not depend on it. The table gives each trained row's
# mean over the seeds and their spread (largest minus smallest), the run-to-run noise a difference
# between rows has to beat.
#
# Recipe (every QAT and LoRA row): LoRA r 16, alpha 32 on c_attn, c_proj, c_fc; AdamW lr 1e-3
# (learned scales at --scale-lr), constant; B 8, T 128; STEPS steps (200) over the train split in
# qatc's shuffled order, seed 1. Validation: the first VAL_BATCHES (60) batches of B 8 x T 128 of
# the validation split. recovered = 1 - (qat - lora_fp) / (ptq - fp): the share of the
# post-training penalty that QAT + LoRA wins back, measured against what LoRA alone does.
#
# Rows finished earlier (their line in rows.jsonl) are kept, so an interrupted run continues
# where it stopped; delete out/quality to start over. Needs the peer environment
# (../shared/tools/peer-env.sh) for the PyTorch rows, which are skipped without it.
set -euo pipefail
cd "$(dirname "$0")/.."
qatc=${QATC:-target/release/qatc}
# the shared data and tools sit beside the main checkout (../shared), two levels up from a worktree
shared=${SHARED:-../shared}
[ -d "$shared" ] || shared=../../shared
train=$shared/data/shakespeare/shakespeare_train.bin
val=$shared/data/shakespeare/shakespeare_val.bin
# the repository carries the same files (examples/README.md)
[ -f "$train" ] || train=examples/shakespeare_train.bin
[ -f "$val" ] || val=examples/shakespeare_val.bin
[ -x "$qatc" ] || cargo build --release --bin qatc
model_name=${MODEL:-shakespeare}
case $model_name in
  shakespeare)
    model=$shared/models/gpt2-shakespeare-small/model.safetensors
    [ -f "$model" ] || model=examples/gpt2-shakespeare-small/model.safetensors
    out=${OUT:-out/quality}
    ;;
  quality)
    qdir=${QUALITY_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qatc/quality-model}
    [ -f "$qdir/model/model.safetensors" ] || QUALITY_MODEL_DIR=$qdir bash bench/quality-model/make.sh "$qatc"
    model=$qdir/model/model.safetensors
    out=${OUT:-out/quality-quality}
    ;;
  *)
    model=$model_name
    out=${OUT:-out/quality-$(basename "$(dirname "$model")")}
    ;;
esac
[ -f "$model" ] || {
  echo "bench/quality.sh: no model at $model" >&2
  exit 2
}
steps=${STEPS:-200}
val_batches=${VAL_BATCHES:-60}
scale_lr=${SCALE_LR:-1e-4}
seeds=${SEEDS:-1}
rows=$out/rows.jsonl
mkdir -p "$out"
touch "$rows"

seed=1 # the trained rows' seed, set by the loop over $seeds below
recipe() { echo --batch 8 --seq 128 --lora r=16,alpha=32 --lr 1e-3 --steps "$steps" --shuffle --seed "$seed"; }
eval_args=(--data "$val" --batch 8 --seq 128 --batches "$val_batches" --json)

wanted() { # row name[, seed]: selected by $ROWS (globs), and not done yet (for that seed)
  local name=$1 pat
  if [ -n "${2:-}" ]; then
    grep -q "\"row\":\"$name\",\"seed\":$2[,}]" "$rows" && return 1
    # rows of seed 1 recorded before rows carried their seed
    [ "$2" = 1 ] && grep -q "\"row\":\"$name\",\"[^s]" "$rows" && return 1
  else
    grep -q "\"row\":\"$name\"" "$rows" && return 1
  fi
  [ -z "${ROWS:-}" ] && return 0
  for pat in $ROWS; do
    # shellcheck disable=SC2053
    [[ $name == $pat ]] && return 0
  done
  return 1
}

loss() { sed -n 's/.*"loss":\([0-9.eE+-]*\).*/\1/p'; }

record() { # name, then key=value pairs (numbers or quoted strings)
  local name=$1 line
  shift
  line="{\"row\":\"$name\""
  for kv in "$@"; do line+=",\"${kv%%=*}\":${kv#*=}"; done
  echo "$line}" >>"$rows"
  echo "  $line}"
}

# name, quant flags...: post-training quantization
ptq() {
  local name=$1
  shift
  wanted "$name" || return 0
  local t0=$SECONDS l
  l=$("$qatc" eval "$model" "${eval_args[@]}" "$@" | loss)
  record "$name" "loss=$l" "seconds=$((SECONDS - t0))"
}

# name, train flags...: LoRA (or QAT + LoRA) for $steps steps at seed $seed, then the validation loss
qat() {
  local name=$1
  shift
  wanted "$name" "$seed" || return 0
  local dir=$out/$name t0=$SECONDS l first last
  [ "$seed" = 1 ] || dir=$out/$name.seed$seed
  rm -rf "$dir"
  # shellcheck disable=SC2046
  "$qatc" train "$model" --data "$train" $(recipe) "$@" --out "$dir" --log-json "$dir.jsonl" 2>"$dir.log"
  # eval takes the quantization flags, not the training ones
  local q=() skip=0 a
  for a in "$@"; do
    case $skip$a in
      1*) q+=("$a"); skip=0 ;;
      0--bits | 0--group | 0--scheme | 0--qat | 0--scales | 0--bits-map) q+=("$a"); skip=1 ;;
      *) ;;
    esac
  done
  l=$("$qatc" eval "$model" "${eval_args[@]}" "${q[@]}" --adapter "$dir" | loss)
  first=$(head -10 "$dir.jsonl" | sed -n 's/.*"loss":\([0-9.eE+-]*\).*/\1/p' | awk '{s+=$1} END {print s/NR}')
  last=$(tail -10 "$dir.jsonl" | sed -n 's/.*"loss":\([0-9.eE+-]*\).*/\1/p' | awk '{s+=$1} END {print s/NR}')
  record "$name" "seed=$seed" "loss=$l" "train_first10=$first" "train_last10=$last" "seconds=$((SECONDS - t0))"
}

echo "== qatc: $model, $steps steps, seeds $seeds, $val_batches validation batches of 8 x 128 (results: $rows)"
specs=("b4_sym:--bits 4 --group 64 --scheme sym" "b3_sym:--bits 3 --group 64 --scheme sym"
  "b2_sym:--bits 2 --group 64 --scheme sym" "nf4:--bits 4 --group 64 --scheme nf4")
# post-training rows: no seed
ptq fp
for spec in "${specs[@]}"; do
  name=${spec%%:*}
  read -ra flags <<<"${spec#*:}"
  ptq "${name}_ptq" "${flags[@]}"
  # post-training at the scales the searched start begins from, no training
  ptq "${name}_ptq_search" "${flags[@]}" --scales learned --scale-init search
done

# The precision range test: whole-model bit maps (sym g64, 2..8 bits or full precision per module)
# within each budget, searched on the first 4 batches of the TRAIN split, then measured on the
# validation batches above; QAT + LoRA with each map runs with the seeds below.
prt_search=(--data "$train" --batch 8 --seq 128 --batches 4 --group 64 --scheme sym)
for budget in 0.05 0.02 0.01 0.005; do # largest first: its measurements serve the smaller ones
  name=prt_$budget
  if wanted "$name"; then
    t0=$SECONDS
    "$qatc" prt "$model" "${prt_search[@]}" --budget "$budget" --measurements "$out/prt_measurements.json" \
      --bits-map "$out/$name.json" --json >"$out/$name.report.json"
    bits=$(sed -n 's/.*"average_bits":\([0-9.eE+-]*\).*/\1/p' "$out/$name.report.json")
    search=$(sed -n 's/.*"measured_penalty":\([0-9.eE+-]*\).*/\1/p' "$out/$name.report.json")
    l=$("$qatc" eval "$model" "${eval_args[@]}" --bits-map "$out/$name.json" | loss)
    record "$name" "loss=$l" "average_bits=$bits" "search_penalty=$search" "seconds=$((SECONDS - t0))"
  fi
done

py=$(bash "$shared/tools/peer-env.sh" 2>/dev/null | tail -1) || py=
[ -n "$py" ] && [ -x "$py" ] || echo "== PyTorch + PEFT rows skipped: no peer environment (../shared/tools/peer-env.sh)"

# trained rows, every seed (one seed's rows all before the next seed's)
for seed in $seeds; do
  echo "== seed $seed"
  qat lora_fp
  for spec in "${specs[@]}"; do
    name=${spec%%:*}
    read -ra flags <<<"${spec#*:}"
    for variant in minmax learned learned_minmax search; do
      # learned: the default start (--scale-init auto); learned_minmax: from the min-max grid
      case $variant in
        minmax) v=(--scales minmax) ;;
        learned) v=(--scales learned --scale-lr "$scale_lr") ;;
        learned_minmax) v=(--scales learned --scale-lr "$scale_lr" --scale-init minmax) ;;
        search) v=(--scales learned --scale-lr "$scale_lr" --scale-init search) ;;
      esac
      for mode in base merged; do
        qat "${name}_${variant}_${mode}" "${flags[@]}" "${v[@]}" --qat "$mode"
      done
    done
  done
  for budget in 0.05 0.02 0.01 0.005; do
    name=prt_$budget
    [ -f "$out/$name.json" ] && qat "${name}_search_base" --bits-map "$out/$name.json" --scales learned --qat base \
      --scale-lr "$scale_lr" --scale-init search
  done
  # PyTorch + PEFT on the same recipe (min-max, base: the script a user would write); the 3-bit run
  # also trains LoRA on the unquantized model, the peer's own baseline
  if [ -n "$py" ] && [ -x "$py" ]; then
    for spec in "b4_sym:--bits 4 --scheme sym" "b3_sym:--bits 3 --scheme sym" "b2_sym:--bits 2 --scheme sym" \
      "nf4:--bits 4 --scheme nf4"; do
      name=peer_${spec%%:*}
      read -ra flags <<<"${spec#*:}"
      wanted "$name" "$seed" || continue
      t0=$SECONDS
      log=$out/$name.log
      [ "$seed" = 1 ] || log=$out/$name.seed$seed.log
      # shellcheck disable=SC2046
      j=$("$py" bench/quality_peer.py --model "$(dirname "$model")" --train "$train" --val "$val" --group 64 "${flags[@]}" \
        --steps "$steps" --val-batches "$val_batches" --seed "$seed" $([ "$name" = peer_b3_sym ] && echo --lora-fp) \
        2>"$log" | tail -1)
      echo "{\"row\":\"$name\",\"seed\":$seed,${j#\{},\"seconds\":$((SECONDS - t0))}" | sed 's/},"seconds"/,"seconds"/' >>"$rows"
      echo "  $j"
    done
  fi
done

python3 bench/quality_table.py "$rows" >"$out/table.md"
cat "$out/table.md"
