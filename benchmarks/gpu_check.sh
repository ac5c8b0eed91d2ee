#!/usr/bin/env bash
# GPU check of the runtime: the GPU tests (NCCL equivalence, one rank per GPU; CUDA streams and
# events; device checksums; profiling by CUDA events; switches with state on the GPU; a live job
# on CUDA), the runtime benchmark (gloo, CPU processes), the live switch benchmark (gloo, 4
# processes; on a GPU host each gets a core of its own, which a 2-core machine cannot give them)
# and a live switch with the state on the GPU (benchmarks/gpu_switch_check.py: NCCL when every
# process has a GPU of its own, else the processes share the GPU over gloo with pinned host
# staging; then the same with the ordered driver on CUDA streams). Tests needing more GPUs than
# the machine has are skipped (and say so).
# Usage: benchmarks/gpu_check.sh [python] [all|nccl|runtime|switch|live]
#   (from the repository root; each part takes a few minutes, all of them about fifteen)
set -euo pipefail
PY="${1:-python}"
PART="${2:-all}"
cd "$(dirname "$0")/.."
case "$PART" in all|nccl|runtime|switch|live) ;; *) echo "unknown part '$PART': use all, nccl, runtime, switch or live" >&2; exit 2;; esac
echo "== devices"
"$PY" -c "import os, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gpus', torch.cuda.device_count(), 'cpus', os.cpu_count())"
if [[ "$PART" == all || "$PART" == nccl ]]; then
  echo "== GPU tests (NCCL equivalence, streams, device switches, live job on CUDA)"
  timeout 500 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_exec_gpu.py -rs
fi
if [[ "$PART" == all || "$PART" == runtime ]]; then
  echo "== runtime benchmark (gloo, 4 processes)"
  timeout 400 "$PY" benchmarks/runtime_bench.py --steps 12 --repeats 3
fi
if [[ "$PART" == all || "$PART" == switch ]]; then
  echo "== live switch benchmark (gloo, 4 processes, 3 rounds)"
  timeout 420 "$PY" benchmarks/switch_live_bench.py --repeats 7 --dcp-repeats 3 --rounds 3
fi
if [[ "$PART" == all || "$PART" == live ]]; then
  echo "== live switch, state on the GPU (4 processes; they share the GPU when it has fewer than 4)"
  timeout 300 "$PY" benchmarks/gpu_switch_check.py --procs 4 --repeats 3
  echo "== the same with the ordered (NCCL) driver on CUDA streams and events"
  timeout 300 "$PY" benchmarks/gpu_switch_check.py --procs 4 --repeats 3 --ordered
  if [[ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]]; then
    echo "== live switch over NCCL (2 processes, one GPU each)"
    timeout 300 "$PY" benchmarks/gpu_switch_check.py --procs 2 --repeats 3 --transport nccl
  else
    echo "== live switch over NCCL skipped: NCCL needs a GPU per process and this host has one"
  fi
fi
