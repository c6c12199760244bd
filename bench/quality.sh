#!/usr/bin/env bash
# The quality benchmark (issue 19): validation loss of the Shakespeare GPT-2 at full precision,
# after post-training quantization, after QAT + LoRA, and after LoRA on the unquantized model,
# side by side in one run, with PyTorch + PEFT on the same recipe as the reference row.
#
#   bash bench/quality.sh              every row; results in out/quality/ (rows.jsonl, table.md)
#   ROWS='b3_sym_learned_base b2*' bash bench/quality.sh     only rows matching these globs
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
model=$shared/models/gpt2-shakespeare-small/model.safetensors
train=$shared/data/shakespeare/shakespeare_train.bin
val=$shared/data/shakespeare/shakespeare_val.bin
# the repository carries the same files (examples/README.md)
[ -f "$model" ] || model=examples/gpt2-shakespeare-small/model.safetensors
[ -f "$train" ] || train=examples/shakespeare_train.bin
[ -f "$val" ] || val=examples/shakespeare_val.bin
steps=${STEPS:-200}
val_batches=${VAL_BATCHES:-60}
scale_lr=${SCALE_LR:-1e-4}
out=${OUT:-out/quality}
rows=$out/rows.jsonl
mkdir -p "$out"
touch "$rows"
[ -x "$qatc" ] || cargo build --release --bin qatc

recipe=(--batch 8 --seq 128 --lora r=16,alpha=32 --lr 1e-3 --steps "$steps" --shuffle --seed 1)
eval_args=(--data "$val" --batch 8 --seq 128 --batches "$val_batches" --json)

wanted() { # row name: selected by $ROWS (globs), and not done yet
  local name=$1 pat
  grep -q "\"row\":\"$name\"" "$rows" && return 1
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

# name, train flags...: LoRA (or QAT + LoRA) for $steps steps, then the validation loss
qat() {
  local name=$1
  shift
  wanted "$name" || return 0
  local dir=$out/$name t0=$SECONDS l first last
  rm -rf "$dir"
  "$qatc" train "$model" --data "$train" "${recipe[@]}" "$@" --out "$dir" --log-json "$dir.jsonl" 2>"$dir.log"
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
  record "$name" "loss=$l" "train_first10=$first" "train_last10=$last" "seconds=$((SECONDS - t0))"
}

echo "== qatc: $model, $steps steps, $val_batches validation batches of 8 x 128 (results: $rows)"
ptq fp
qat lora_fp
for spec in "b4_sym:--bits 4 --group 64 --scheme sym" "b3_sym:--bits 3 --group 64 --scheme sym" \
  "b2_sym:--bits 2 --group 64 --scheme sym" "nf4:--bits 4 --group 64 --scheme nf4"; do
  name=${spec%%:*}
  read -ra flags <<<"${spec#*:}"
  ptq "${name}_ptq" "${flags[@]}"
  # post-training at the scales the searched start begins from, no training
  ptq "${name}_ptq_search" "${flags[@]}" --scales learned --scale-init search
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

# The precision range test: whole-model bit maps (sym g64, 2..8 bits or full precision per module)
# within each budget, searched on the first 4 batches of the TRAIN split, then measured on the
# validation batches above, and the quality after QAT + LoRA (learned scales, searched start) with
# that map.
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
  [ -f "$out/$name.json" ] && qat "${name}_search_base" --bits-map "$out/$name.json" --scales learned --qat base \
    --scale-lr "$scale_lr" --scale-init search
done

py=$(bash "$shared/tools/peer-env.sh" 2>/dev/null | tail -1) || py=
if [ -n "$py" ] && [ -x "$py" ]; then
  echo "== PyTorch + PEFT, the same recipe"
  for spec in "b4_sym:--bits 4 --scheme sym" "b3_sym:--bits 3 --scheme sym" "b2_sym:--bits 2 --scheme sym" "nf4:--bits 4 --scheme nf4"; do
    name=peer_${spec%%:*}
    read -ra flags <<<"${spec#*:}"
    wanted "$name" || continue
    t0=$SECONDS
    j=$("$py" bench/quality_peer.py --model "$(dirname "$model")" --train "$train" --val "$val" --group 64 "${flags[@]}" \
      --steps "$steps" --val-batches "$val_batches" $([ "$name" = peer_b3_sym ] && echo --lora-fp) 2>"$out/$name.log" | tail -1)
    echo "${j%\}},\"row\":\"$name\",\"seconds\":$((SECONDS - t0))}" >>"$rows"
    echo "  $j"
  done
else
  echo "== PyTorch + PEFT rows skipped: no peer environment (../shared/tools/peer-env.sh)"
fi

python3 bench/quality_table.py "$rows" >"$out/table.md"
cat "$out/table.md"
