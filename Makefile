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
	bash examples/demo.sh $(QATC)

test: deps
	$(CARGO) test --workspace --release

bench: build
	bash bench/run.sh

clean:
	$(CARGO) clean
	rm -rf out
