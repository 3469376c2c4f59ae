#!/usr/bin/env bash
# On the GPU machine: install the prebuilt abi3 wheel from dist/ (no build, no dependencies,
# no network), then run the parity fuzz and the timing. Usage: bash benches/gpu_run.sh OUT_DIR
# (default: $OUT, else gpu-bench-out). Extra arguments go to benches/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-bench-out}}"
shift || true
wheels=(dist/kakeyaturbo-*.whl)
if [ ! -e "${wheels[0]}" ]; then
    echo "no dist/kakeyaturbo-*.whl: build it first (maturin build --release -o dist)" >&2
    exit 2
fi
python3 -m pip install --quiet --no-deps --no-index --force-reinstall "${wheels[@]}"
python3 -c 'import torch, triton, kakeyaturbo; print("torch", torch.__version__, "triton", triton.__version__, "kakeyaturbo", kakeyaturbo.__version__, "cuda", torch.cuda.is_available())'
exec python3 benches/gpu_bench.py --out "$out" "$@"
