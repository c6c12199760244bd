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
# Result: $DIR/model/model.safetensors and config.json (what bench/quality.sh takes as MODEL=),
# $DIR/train.jsonl (the loss curve, one line per step), $DIR/command (the exact command). A run
# cut short resumes from its last save (every 50 steps) when the script is run again.
#
# Budget: B 16 x T 128 = 2,048 tokens a step; the train split holds about 1.38 M tokens, so 2,000
# steps are 3 passes over it (4.1 M tokens), as the embedded model had. qatc's compiled CPU step
# trains this model at about 1,450 tokens/s on a 2-core Zen 5 VM with OpenBLAS's AVX-512 kernels
# (about 50 minutes), 470 with the AVX2 ones a machine's OPENBLAS_CORETYPE=Haswell chose (2.5
# hours; `make` now runs without it); a run cut short resumes. The first recipe (lr 1e-3, no weight decay, B 8 x T 256, 1,350 steps) gave a model
# too weak to tell recipes apart (README.md beside this script).
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
steps=${STEPS:-2000}
seed=1
[ -x "$qatc" ] || cargo build --release --bin qatc

# the recipe, all of it: a change of any part makes a new model
# (the embedded model's recipe, ../shared/models/gpt2-shakespeare-small/TRAINING.md, but AdamW's
# betas: qatc's default 0.9/0.999 instead of 0.9/0.95; `--betas 0.9,0.95` gave the same curve to
# step 181, README.md)
recipe=(--full-finetune --batch 16 --seq 128 --steps "$steps" --lr 2e-3 --schedule cosine --warmup 100 --min-lr 2e-4
  --weight-decay 0.1 --clip 1.0 --shuffle --seed "$seed")
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
cp "$dir/run/model.safetensors" "$dir/run/config.json" "$dir/model.tmp/"
rm -rf "$dir/model"
mv "$dir/model.tmp" "$dir/model"
echo "quality model: $dir/model"
