# qatc: the two commands.
#   make demo   compile and evaluate the embedded Shakespeare GPT-2
#   make test   the whole test suite (what CI runs)
# Each installs what is missing first.

SHELL := bash
CARGO ?= cargo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
MODEL := examples/gpt2-shakespeare-small/model.safetensors
VAL   := examples/shakespeare_val.bin
TRAIN := examples/shakespeare_train.bin
QATC  := target/release/qatc

.PHONY: all deps llvm openblas nvrtc build demo quality-model test lint bench gpu-bundle clean

all: build

# Rust is the one prerequisite a fresh machine must have; everything else installs from here.
deps: llvm openblas
	@command -v $(CARGO) >/dev/null || { echo "error: cargo not found: install Rust (https://rustup.rs) first" >&2; exit 2; }

# OpenBLAS: optional, loaded at run time for the CPU step's large GEMMs (about 2x the gemm
# crate's speed here); without it qatc runs the same, slower. A failed install is only a notice.
openblas:
	@ldconfig -p 2>/dev/null | grep -q 'libopenblas.so.0 ' || { echo "installing OpenBLAS (apt-get: libopenblas0-pthread)"; \
	  ( $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread >/dev/null ) || echo "notice: OpenBLAS not installed; GEMMs use the gemm crate"; }

# LLVM 19 for the CPU backend (the default `llvm` feature; .cargo/config.toml points llvm-sys at
# /usr/lib/llvm-19). Debian 12 and Ubuntu 24.04 carry these packages.
LLVM_CONFIG := /usr/lib/llvm-19/bin/llvm-config
llvm:
	@test -x $(LLVM_CONFIG) -a -f /usr/lib/llvm-19/lib/libPolly.a || { echo "installing LLVM 19 (apt-get: llvm-19-dev libpolly-19-dev libzstd-dev)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq llvm-19-dev libpolly-19-dev libzstd-dev >/dev/null; }
	@test -x $(LLVM_CONFIG) || { echo "error: LLVM 19 is not installed and apt-get could not install it; build without it: cargo build --no-default-features" >&2; exit 2; }

build: deps
	$(CARGO) build --release --bin qatc

demo: build
	bash examples/demo.sh $(QATC)

# The evaluation GPT-2 of bench/quality.sh's second model (6 layers, n_embd 384), trained by qatc
# from a random start into a cache, never committed (bench/quality-model/README.md): deterministic,
# and nothing to do when the cache holds it.
quality-model: build
	bash bench/quality-model/make.sh $(QATC)

# NVRTC, for the tests that compile every generated CUDA kernel (no GPU needed): the PyPI wheel,
# installed into .deps/ once (--target: nothing of the system changes, so Debian's PEP 668 guard is
# safely waived); tests/nvrtc.rs finds it through QATC_NVRTC_LIB. Pinned to the minor version of
# the GPU machine's toolkit (CUDA 13.0, whose NVRTC bench/gpu.sh loads first), so CI compiles the
# kernels with the compiler that will run them; the stamp names the pin, so a changed pin
# reinstalls.
NVRTC_PIN := 13.0
NVRTC_LIB := .deps/nvrtc/nvidia/cu13/lib/libnvrtc.so.13
NVRTC_STAMP := .deps/nvrtc/.pinned-$(NVRTC_PIN)

$(NVRTC_STAMP):
	@python3 -m pip --version >/dev/null 2>&1 || { echo "installing python3-pip (apt-get)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq python3-pip >/dev/null; }
	rm -rf .deps/nvrtc
	PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target .deps/nvrtc 'nvidia-cuda-nvrtc==$(NVRTC_PIN).*'
	@test -f $(NVRTC_LIB) || { echo "error: the nvidia-cuda-nvrtc wheel did not provide $(NVRTC_LIB)" >&2; exit 2; }
	touch $@

nvrtc: $(NVRTC_STAMP)

# The tree's own checks, before any test: formatting as rustfmt.toml states it, and no clippy
# warning anywhere (library, tests, benches; with and without LLVM).
lint:
	@$(CARGO) fmt --version >/dev/null 2>&1 || rustup component add rustfmt
	@$(CARGO) clippy --version >/dev/null 2>&1 || rustup component add clippy
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings
	$(CARGO) clippy --workspace --all-targets --release --no-default-features -- -D warnings

test: deps nvrtc lint
	QATC_NVRTC_LIB=$(abspath $(NVRTC_LIB)) $(CARGO) test --workspace --release

bench: build
	bash bench/run.sh

# What bench/gpu.sh runs on a GPU machine (no Rust there): qatc and the GPU test executables,
# built without LLVM, stripped, staged in .gpu/ (README: "On a GPU machine").
gpu-bundle:
	bash bench/gpu-bundle.sh

clean:
	$(CARGO) clean
	rm -rf out
