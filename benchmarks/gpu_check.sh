#!/usr/bin/env bash
# GPU check of the runtime: the NCCL equivalence tests (one rank per GPU; cases needing more GPUs
# than the machine has are skipped) and the runtime benchmark (gloo, CPU processes).
# Usage: benchmarks/gpu_check.sh [python]   (from the repository root; a few minutes)
set -euo pipefail
PY="${1:-python}"
cd "$(dirname "$0")/.."
echo "== devices"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count())"
echo "== NCCL equivalence tests"
timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_exec_gpu.py -rs
echo "== runtime benchmark (gloo, 4 processes)"
timeout 400 "$PY" benchmarks/runtime_bench.py --steps 12 --repeats 3
