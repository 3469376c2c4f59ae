# One entry point per task; .ci/run calls `make ci`.
#   make bench   install into .venv and run the codec benchmark (README's first command)
#   make test    install into .venv and run the Python tests and the stub check
#   make ci      formatting, clippy, Rust tests, then `make test`
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP_PINS := maturin==1.16.0 numpy==2.4.6 pytest==9.2.0 hypothesis==6.170.17 mypy==2.4.1

.PHONY: install test bench rust-check ci clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(PIP_PINS)

install: $(VPY)
	rm -rf dist
	$(VENV)/bin/maturin build --release -o dist
	$(VPY) -m pip install -q --force-reinstall --no-deps dist/*.whl

test: install
	$(VPY) -m pytest
	$(VPY) -m mypy.stubtest kakeyaturbo._core

bench: install
	$(VPY) benches/bench_codec.py

rust-check:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	cargo test -p kakeyaturbo --release

ci: rust-check test

clean:
	rm -rf $(VENV) dist target bench-out
