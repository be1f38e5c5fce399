#!/usr/bin/env bash
# On a GPU machine: the CUDA tests, then the GPU benchmark. Under 5 minutes.
# Assumes a Python with a CUDA build of torch; installs shmsync's other needs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.cuda.get_device_name(0))"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_scheme.py -k "cuda"
timeout 120 python3 benchmarks/gpu_bench.py --reps 10 --out "${OUT:-benchmarks/results}/gpu_bench.json"
