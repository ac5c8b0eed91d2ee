"""A live switch between processes whose state lives on a GPU, checked byte for byte (one JSON object).

Runs :func:`parashift.exec.switch.check.switch_check`: one process per participating device, the
source layout's state (fp32 parameters and AdamW moments of a GPT, filled from one random global
state) on the device, the live switch protocol (planning and communicators first, then transfer
and verification), and a byte comparison of every destination store with a fresh start in the
new layout. Transports: ``nccl`` (one GPU per process), ``gloo-pinned`` (processes sharing a GPU:
gloo, messages staged through pinned host memory), ``gloo`` (host state; what a CPU-only machine
runs). ``--ordered`` runs the ordered driver (the NCCL one, on CUDA streams and events) on gloo too.
Without ``--transport``: NCCL when every process has a GPU of its own, else gloo-pinned, else gloo.

Usage: python benchmarks/gpu_switch_check.py [--procs 4] [--transport T] [--ordered] [--hidden 512]
[--layers 8] [--repeats 3]. Exit status 1 when a state differs.
"""
from __future__ import annotations

import argparse
import json
import sys

from parashift import models
from parashift.exec.switch.check import TRANSPORTS, switch_check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4, help="processes (devices) of the source and destination layouts")
    ap.add_argument("--transport", choices=TRANSPORTS, default=None)
    ap.add_argument("--ordered", action="store_true", help="the ordered (NCCL) driver on any transport")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    n = a.procs
    if n < 2 or n % 2 or 8 % n:
        ap.error("--procs must be 2, 4 or 8 (the switch goes from dp=procs/2,tp=2,zero=1 to tp=procs; 8 heads)")
    spec = models.gpt(a.layers, a.hidden, 8, kv_heads=8, ffn=4 * a.hidden, vocab=4096, seq_len=64,
                      name=f"check-gpt-{a.layers}x{a.hidden}", dtype="fp32")
    src, dst = f"dp={n // 2},tp=2,zero=1", f"tp={n}"
    out = switch_check(spec, src, dst, transport=a.transport, ordered=True if a.ordered else None,
                       repeats=a.repeats, timeout=a.timeout)
    out["state_bytes"] = 12 * spec.params       # fp32 parameters and two AdamW moments
    print(json.dumps(out))
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
