# The two commands of the README: `make run` (the CPU quickstarts: GRPO on arithmetic, then GRPO
# with a calculator tool) and `make test` (every test that
# runs without a GPU). Both do their own set-up (torch venv, test Python packages) and are quick
# when it is already done. `make test-gpu` runs the GPU-only tests, on a machine with CUDA.
SHELL := /bin/bash
ENV := source scripts/env.sh &&
# One test at a time per binary: libtorch's RNG and intra-op thread pools are process-wide, so tests
# running side by side perturb each other's random inits and reduction orders (parity tests at 1e-6
# then fail now and then).
CARGO_TEST ?= cargo test --workspace --no-fail-fast -- --test-threads=1
# The GPU-only tests: `#[ignore = "needs CUDA"]`, all named `…_on_cuda` (checked by
# crates/test-support/tests/ignored_tests.rs), so the filter picks exactly them and no other
# ignored test (measurements). Each fails, not skips, where there is no CUDA device.
CARGO_TEST_GPU ?= cargo test --workspace --no-fail-fast -- --ignored --test-threads=1 _on_cuda
# A fresh machine builds everything once: incremental caches would only add gigabytes of disk.
export CARGO_INCREMENTAL ?= 0

.PHONY: setup setup-tests build build-debug run test test-gpu fmt clippy

setup:
	@bash scripts/setup.sh

setup-tests:
	@bash scripts/setup.sh --tests

build: setup
	@$(ENV) cargo build --release

build-debug: setup
	@$(ENV) cargo build --workspace

run: build
	@bash scripts/quickstart.sh
	@bash scripts/quickstart_tools.sh

test: setup-tests build-debug
	@$(ENV) $(CARGO_TEST)

test-gpu: setup-tests build-debug
	@$(ENV) $(CARGO_TEST_GPU)

fmt:
	cargo fmt --all

clippy: setup
	@$(ENV) cargo clippy --workspace --all-targets -- -D warnings
