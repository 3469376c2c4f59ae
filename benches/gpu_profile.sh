#!/usr/bin/env bash
# On the GPU machine: install the prebuilt abi3 wheel from dist/ (as gpu_run.sh), then profile
# the attention kernels of a few decode steps with Nsight Compute (ncu; on the H200 kind it reads
# the counters on Firecracker machines, clocks left alone). Usage:
#   bash benches/gpu_profile.sh OUT_DIR [gpu_profile.py arguments]
# Writes OUT_DIR/ncu.txt (per kernel launch: speed of light, launch, occupancy, warp stalls,
# memory) and OUT_DIR/steps.txt (the script's own timing lines). Steps 3 and 4 of each mode are
# profiled (the first compiles).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-profile-out}}"
shift || true
mkdir -p "$out"
wheels=(dist/kakeyaturbo-*.whl)
if [ ! -e "${wheels[0]}" ]; then
    echo "no dist/kakeyaturbo-*.whl: build it first (maturin build --release -o dist)" >&2
    exit 2
fi
python3 -m pip install --quiet --no-deps --no-index --force-reinstall "${wheels[@]}"
python3 benches/gpu_profile.py "$@" | tee "$out/steps.txt"
# Two modes x two kernels per step: skip the first two steps' launches, take the next two steps'.
ncu --clock-control none --kernel-name regex:'_split_kernel|_combine_kernel' --launch-skip 8 --launch-count 8 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benches/gpu_profile.py --steps 4 "$@" > "$out/ncu.txt" 2>&1
tail -n 40 "$out/ncu.txt"
