"""Simulator speed on full-scale programs: prints one JSON object.

Cases: llama2-70b on a800-128x8 (1024 devices) with dp=32,tp=8,pp=4,zero=1 and a global batch
of 2048 sequences (64 micro-batches), and qwen3-235b-a22b on 1024 devices with expert
parallelism. Per case: median ``sim_seconds`` over repeats, ``events_per_s``, the compile time,
instruction counts and the simulated step. Target: under 1 s of simulation per case.

Usage: python benchmarks/sim_bench.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from parashift import cluster as clusters, models
from parashift.ir import compile as ir_compile
from parashift.sim import CostModel, simulate
from parashift.strategy import Strategy

CASES = {
    "llama2-70b_1024": ("llama2-70b", "a800-128x8", "dp=32,tp=8,pp=4,zero=1", 2048, 4096),
    "qwen3-235b-a22b_ep16_1024": ("qwen3-235b-a22b", "a800-128x8", "dp=64,tp=4,pp=4,ep=16,zero=1", 2048, 4096),
}


def bench(model: str, cluster: str, strategy: str, global_batch: int, seq_len: int, repeats: int) -> dict:
    m, c, s = models.get(model), clusters.get(cluster), Strategy.parse(strategy)
    t0 = time.perf_counter()
    prog = ir_compile(m, s, global_batch=global_batch, seq_len=seq_len)
    compile_s = time.perf_counter() - t0
    cost = CostModel.for_cluster(c)
    times, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = simulate(prog, c, cost)
        times.append(time.perf_counter() - t0)
    assert res is not None
    sim_s = statistics.median(times)
    distinct = len(prog.classes())
    return {"sim_seconds": sim_s, "events": res.events, "events_per_s": res.events / sim_s,
            "compile_seconds": compile_s, "ranks": prog.world, "distinct_rank_programs": distinct,
            "simulated_ranks": len(res.raw.folding.members),
            "instructions_simulated": sum(len(prog.ranks[r]) for r in res.raw.folding.members),
            "microbatches": prog.meta.get("microbatches"), "step_time": res.step_time,
            "tokens_per_s": res.tokens_per_s, "mfu": res.mfu, "bubble_fraction": res.bubble_fraction,
            "peak_memory_max_gib": res.peak_memory_max / 2**30, "fits": res.fits,
            "target_met": sim_s < 1.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    out = {name: bench(*case, repeats=args.repeats) for name, case in CASES.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
