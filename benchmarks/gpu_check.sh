#!/usr/bin/env bash
# On a GPU machine: the CUDA tests, the GPU benchmark, then the collectors side by side with
# TorchRL's SharedMemWeightSyncScheme (benchmarks/gpu_collectors.py). Under 8 minutes whatever
# happens (each step has a deadline: 240 + 80 + 130 s); then it prints the README's GPU line to
# paste (benchmarks/gpu_status.py), or says that there is nothing to paste when a step failed.
#
# Needs a Python (PYTHON, default python3) whose torch has CUDA, with tensordict, torchrl, psutil,
# gymnasium, pytest, pytest-timeout and pytest-xdist importable. shmsync itself is installed here
# without its dependencies and without asking a package index, so the check also runs on a machine
# that is offline or keeps its own torch build (docs/gpus.md). Logs and the benchmark's JSON go to
# $OUT (default benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"

if ! PIP_NO_INDEX=1 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$out/gpu_pip.log" 2>&1; then
    cat "$out/gpu_pip.log"
    exit 2
fi
df -h /dev/shm | tail -1 | awk '{print "/dev/shm: " $2 " (" $4 " free)"}' | tee "$out/gpu_env.txt"
"$PY" - <<'EOF' | tee -a "$out/gpu_env.txt"
import platform

import tensordict
import torch
import torchrl

import shmsync
from shmsync.core import fences

assert torch.cuda.is_available(), "no GPU visible to torch"
print(f"gpu: {torch.cuda.get_device_name(0)}; python {platform.python_version()}; torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}); tensordict {tensordict.__version__}; torchrl {torchrl.__version__}; "
      f"shmsync {shmsync.__version__}; fence: {fences.source()}")
EOF

status=0
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rA tests/writer/test_cuda.py tests/torchrl/test_scheme.py \
    tests/torchrl/test_snapshots.py tests/torchrl/test_freshness.py tests/reader/test_held_copy.py \
    2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 80 "$PY" benchmarks/gpu_bench.py --reps 10 --out "$out/gpu_bench.json" \
    2>&1 | tee "$out/gpu_bench.txt" || status=1
timeout 130 "$PY" benchmarks/gpu_collectors.py --sizes 64MB 512MB --workers 2 4 --batches 15 \
    --async-size 256MB --seconds 12 --big "${BIG_GB:-14}" --out "$out/gpu_collectors.json" \
    2>&1 | tee "$out/gpu_collectors.txt" || status=1

passed=$(grep -oE "[0-9]+ passed" "$out/gpu_tests.log" | tail -1 | cut -d' ' -f1)
echo
if [ "$status" -eq 0 ]; then
    "$PY" benchmarks/gpu_status.py --passed "${passed:-0}"
else
    "$PY" benchmarks/gpu_status.py --passed "${passed:-0}" --failed
fi
exit $status
