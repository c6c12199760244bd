# qatc: the two commands.
#   make demo   compile and evaluate the embedded Shakespeare GPT-2
#   make test   the whole test suite (what CI runs)
# Each installs what is missing first.

SHELL := bash
CARGO ?= cargo
MODEL := examples/gpt2-shakespeare-small/model.safetensors
VAL   := examples/shakespeare_val.bin
TRAIN := examples/shakespeare_train.bin
QATC  := target/release/qatc

.PHONY: all deps build demo test fmt bench clean

all: build

# Rust is the one prerequisite a fresh machine must have; everything else installs from here.
deps:
	@command -v $(CARGO) >/dev/null || { echo "error: cargo not found: install Rust (https://rustup.rs) first" >&2; exit 2; }

build: deps
	$(CARGO) build --release --bin qatc

demo: build
	@echo "== qatc compile: the embedded GPT-2 (4 layers, n_embd 128) into a 4-bit + LoRA training step"
	$(QATC) compile $(MODEL) --batch 4 --seq 128 --bits 4 --lora r=16 -o out/demo
	@echo
	@echo "== qatc eval: full precision, then 4-bit post-training quantization (first 10 batches)"
	$(QATC) eval $(MODEL) --data $(VAL) --batch 4 --seq 128 --batches 10
	$(QATC) eval $(MODEL) --data $(VAL) --batch 4 --seq 128 --batches 10 --bits 4
	@echo
	@echo "== qatc train: 4-bit QAT + LoRA r=16, 20 steps on the train split, on the interpreter (the loss falls)"
	$(QATC) train $(MODEL) --data $(TRAIN) --batch 4 --seq 128 --steps 20 --bits 4 --lora r=16 --lr 2e-3 --out out/demo-adapter --log-json out/demo-train.jsonl
	@echo
	@echo "== qatc eval with the adapter"
	$(QATC) eval $(MODEL) --data $(VAL) --batch 4 --seq 128 --batches 10 --bits 4 --adapter out/demo-adapter
	@echo
	@echo "artifacts: out/demo/{forward.qir,train.qir,manifest.json}, out/demo-adapter/ (PEFT), out/demo-train.jsonl"

test: deps
	$(CARGO) test --workspace --release

bench: build
	bash bench/run.sh

clean:
	$(CARGO) clean
	rm -rf out
