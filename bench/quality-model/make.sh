#!/usr/bin/env bash
# The evaluation GPT-2 of issue 33, 3: 6 layers, n_embd 384, 6 heads, GPT-2's vocabulary and 256
# positions, initialised at random (init_gpt2.py, seed 1) and trained by qatc itself, a full
# fine-tune on the Shakespeare train split with the compiled CPU step. The weights are not
# committed (the repository must stay small enough to travel to the GPU machine): this script
# remakes them, deterministically, into a cache, and does nothing when they are already there.
#
#   make quality-model                       (= bash bench/quality-model/make.sh target/release/qatc)
#   QUALITY_MODEL_DIR=DIR STEPS=N bash bench/quality-model/make.sh
#
# Result: $DIR/model/model.safetensors and config.json (what bench/quality.sh takes as MODEL=): the
# weights of the lowest validation loss (16 batches, every 100 steps; `qatc train --keep-best`),
# $DIR/train.jsonl (the loss curve, one line per step), $DIR/command (the exact command). A run
# cut short resumes from its last save (every 50 steps) when the script is run again.
#
# Budget: B 16 x T 128 = 2,048 tokens a step; the train split holds about 1.38 M tokens, so 8,000
# steps are 12 passes over it (16.4 M tokens, 0.55 a parameter, as trained per parameter as the
# embedded model; README.md beside this script says why 2,000 steps were too few). The step runs
# in bf16 (issue 30's path: oneDNN's bf16 GEMMs where the CPU has AVX512-BF16 or AMX; elsewhere
# the same recipe widens to f32 and is slower): about 2,700 tokens/s on a 2-core Zen 5 VM, so
# 8,000 steps take about 1.7 hours alone (fp32: 1,500 tokens/s, 3 hours). The model overfits after
# about 4,000 steps (README.md, "Third recipe"), so the run stops early once 10 validations in a
# row (1,000 steps) have not lowered the validation loss (`--patience 10`): about 5,000 steps, an
# hour. The schedule stays the 8,000-step cosine, so the weights kept are those of the 8,000-step
# run's best step. A run cut short resumes.
# Never edit this file while it runs: bash reads a script as it goes.
set -euo pipefail
cd "$(dirname "$0")/../.."
qatc=${1:-${QATC:-target/release/qatc}}
shared=${SHARED:-../shared}
[ -d "$shared" ] || shared=../../shared
train=$shared/data/shakespeare/shakespeare_train.bin
val=$shared/data/shakespeare/shakespeare_val.bin
[ -f "$train" ] || train=examples/shakespeare_train.bin
[ -f "$val" ] || val=examples/shakespeare_val.bin
dir=${QUALITY_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qatc/quality-model}
steps=${STEPS:-8000}
seed=1
[ -x "$qatc" ] || cargo build --release --bin qatc

# the recipe, all of it: a change of any part makes a new model
# (the embedded model's recipe, ../shared/models/gpt2-shakespeare-small/TRAINING.md, but AdamW's
# betas: qatc's default 0.9/0.999 instead of 0.9/0.95; `--betas 0.9,0.95` gave the same curve to
# step 181, README.md; four times its steps; bf16 GEMMs with f32 weights, moments and sums)
recipe=(--full-finetune --batch 16 --seq 128 --steps "$steps" --lr 2e-3 --schedule cosine --warmup 100 --min-lr 2e-4
  --weight-decay 0.1 --clip 1.0 --shuffle --seed "$seed" --precision bf16 --keep-best --patience 10)
stamp="init seed $seed layers 6 embd 384 heads 6; train ${recipe[*]}; data $(basename "$train") $(wc -c <"$train") bytes"
if [ -f "$dir/model/model.safetensors" ] && [ "$(cat "$dir/stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "quality model: $dir/model (made already)"
  exit 0
fi
mkdir -p "$dir"
if [ "$(cat "$dir/stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$dir/init" "$dir/run" "$dir/model" "$dir/train.jsonl"
  echo "$stamp" >"$dir/stamp"
fi
[ -f "$dir/init/model.safetensors" ] || python3 bench/quality-model/init_gpt2.py "$dir/init" --layers 6 --embd 384 --heads 6 --seed "$seed"
cmd=("$qatc" train "$dir/init/model.safetensors" --data "$train" "${recipe[@]}" --val "$val" --val-batches 16 --eval-every 100
  --save-every 50 --out "$dir/run" --log-json "$dir/train.jsonl")
[ -f "$dir/run/checkpoint/resume.json" ] && cmd+=(--resume "$dir/run")
printf '%q ' "${cmd[@]}" >"$dir/command"
echo >>"$dir/command"
echo "quality model: training into $dir ($(cat "$dir/command"))"
"${cmd[@]}"
rm -rf "$dir/model.tmp"
mkdir -p "$dir/model.tmp"
cp "$dir/run/best/model.safetensors" "$dir/run/best/config.json" "$dir/run/best/best.json" "$dir/model.tmp/"
rm -rf "$dir/model"
mv "$dir/model.tmp" "$dir/model"
echo "quality model: $dir/model ($(tr -d ' \n' <"$dir/model/best.json"))"
