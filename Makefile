# qatc: the two commands.
#   make demo   compile and evaluate the embedded Shakespeare GPT-2
#   make test   the whole test suite (what CI runs)
# Each installs what is missing first.

SHELL := bash
CARGO ?= cargo
MODEL := examples/gpt2-shakespeare-small/model.safetensors
VAL   := examples/shakespeare_val.bin
QATC  := target/release/qatc

.PHONY: all deps build demo test fmt bench clean

all: build

# Rust is the one prerequisite a fresh machine must have; everything else installs from here.
deps:
	@command -v $(CARGO) >/dev/null || { echo "error: cargo not found: install Rust (https://rustup.rs) first" >&2; exit 2; }

build: deps
	$(CARGO) build --release --bin qatc

demo: build
	@echo "== qatc compile: the embedded GPT-2 (4 layers, n_embd 128) into a training step"
	$(QATC) compile $(MODEL) --batch 4 --seq 128 -o out/demo
	@echo
	@echo "== qatc eval: loss and perplexity on the Shakespeare validation split (first 20 batches)"
	$(QATC) eval $(MODEL) --data $(VAL) --batch 4 --seq 128 --batches 20
	@echo
	@echo "== qatc train --full-finetune: 20 steps on the validation tokens (the loss falls)"
	$(QATC) train $(MODEL) --data $(VAL) --batch 4 --seq 64 --steps 20 --lr 3e-4 --full-finetune --out out/demo-ft --log-json out/demo-ft.jsonl
	@echo
	@echo "artifacts: out/demo/{forward.qir,train.qir,manifest.json}, out/demo-ft/, out/demo-ft.jsonl"

test: deps
	$(CARGO) test --workspace --release 2>&1 | tee target/test.log; exit $${PIPESTATUS[0]}

bench: build
	bash bench/run.sh

clean:
	$(CARGO) clean
	rm -rf out
