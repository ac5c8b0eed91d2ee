#!/usr/bin/env bash
# GPU check of the runtime: the NCCL equivalence tests (one rank per GPU; cases needing more GPUs
# than the machine has are skipped), the runtime benchmark (gloo, CPU processes) and the live
# switch benchmark (gloo, 4 processes; on a GPU host each gets a core of its own, which a 2-core
# machine cannot give them).
# Usage: benchmarks/gpu_check.sh [python] [all|nccl|runtime|switch]
#   (from the repository root; each part takes a few minutes, all of them about ten)
set -euo pipefail
PY="${1:-python}"
PART="${2:-all}"
cd "$(dirname "$0")/.."
case "$PART" in all|nccl|runtime|switch) ;; *) echo "unknown part '$PART': use all, nccl, runtime or switch" >&2; exit 2;; esac
echo "== devices"
"$PY" -c "import os, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count(), 'cpus', os.cpu_count())"
if [[ "$PART" == all || "$PART" == nccl ]]; then
  echo "== NCCL equivalence tests"
  timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_exec_gpu.py -rs
fi
if [[ "$PART" == all || "$PART" == runtime ]]; then
  echo "== runtime benchmark (gloo, 4 processes)"
  timeout 400 "$PY" benchmarks/runtime_bench.py --steps 12 --repeats 3
fi
if [[ "$PART" == all || "$PART" == switch ]]; then
  echo "== live switch benchmark (gloo, 4 processes, 3 rounds)"
  timeout 420 "$PY" benchmarks/switch_live_bench.py --repeats 7 --dcp-repeats 3 --rounds 3
fi
