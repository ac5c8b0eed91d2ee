"""Simulator speed on full-scale programs: prints one JSON object.

Cases: llama2-70b on a800-128x8 (1024 devices) with dp=32,tp=8,pp=4,zero=1 and a global batch
of 2048 sequences (64 micro-batches), qwen3-235b-a22b on 1024 devices with expert parallelism, and
the largest: Megatron-LM's 1T GPT on 3072 A100s (dp=6,tp=8,pp=64, 512 micro-batches per pipeline).
Per case: medians over repeats of the compile and the simulation, each in wall seconds and in CPU
seconds of this process (``*_cpu_seconds``: steadier than wall time on a shared machine),
``events_per_s``, instruction counts and the simulated step. Targets: under 1 s of simulation for the
1024-device cases, and compile + simulate under 5 s for the 3072-device one (``target_met``, on wall
seconds).

Usage: python benchmarks/sim_bench.py [--repeats 3] [--cases llama2-70b_1024,gpt-1t_3072]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from parashift import cluster as clusters, models
from parashift.ir import compile as ir_compile
from parashift.sim import CostModel, simulate
from parashift.strategy import Strategy

CASES = {
    "llama2-70b_1024": ("llama2-70b", "a800-128x8", "dp=32,tp=8,pp=4,zero=1", 2048, 4096),
    "qwen3-235b-a22b_ep16_1024": ("qwen3-235b-a22b", "a800-128x8", "dp=64,tp=4,pp=4,ep=16,zero=1", 2048, 4096),
    "gpt-1t_3072": ("gpt:layers=128,hidden=25600,heads=160,vocab=51200,gated=false,bias=true,norm=ln,"
                    "pos_emb=learned,tied=true,dtype=fp16,flash_attention=false", "a100-384x8",
                    "dp=6,tp=8,pp=64,mbs=1,recompute=full", 3072, 2048),
}
#: seconds of compile + simulate a case must stay under (default: 1 s of simulation alone)
LIMITS = {"gpt-1t_3072": 5.0}


def bench(name: str, model: str, cluster: str, strategy: str, global_batch: int, seq_len: int, repeats: int) -> dict:
    m, c, s = models.get(model), clusters.get(cluster), Strategy.parse(strategy)
    cost = CostModel.for_cluster(c)
    comp, comp_cpu, times, cpu, res = [], [], [], [], None
    for _ in range(repeats):
        prog = res = None
        t0, c0 = time.perf_counter(), time.process_time()
        prog = ir_compile(m, s, global_batch=global_batch, seq_len=seq_len)
        comp.append(time.perf_counter() - t0)
        comp_cpu.append(time.process_time() - c0)
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(prog, c, cost)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert res is not None and prog is not None
    sim_s = statistics.median(times)
    compile_s = statistics.median(comp)
    distinct = len(prog.classes())
    return {"sim_seconds": sim_s, "events": res.events, "events_per_s": res.events / sim_s,
            "compile_seconds": compile_s, "compile_cpu_seconds": statistics.median(comp_cpu),
            "sim_cpu_seconds": statistics.median(cpu), "total_seconds": compile_s + sim_s, "ranks": prog.world, "distinct_rank_programs": distinct,
            "simulated_ranks": len(res.raw.folding.members),
            "instructions_simulated": sum(len(prog.ranks[r]) for r in res.raw.folding.members),
            "microbatches": prog.meta.get("microbatches"), "step_time": res.step_time,
            "tokens_per_s": res.tokens_per_s, "mfu": res.mfu, "bubble_fraction": res.bubble_fraction,
            "peak_memory_max_gib": res.peak_memory_max / 2**30, "fits": res.fits,
            "target_met": (compile_s + sim_s < LIMITS[name]) if name in LIMITS else sim_s < 1.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", help=f"comma-separated case names (default all: {', '.join(CASES)})")
    args = ap.parse_args()
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; cases are {', '.join(CASES)}")
    out = {}
    for name in names:
        print(f"sim_bench: {name}", file=sys.stderr, flush=True)
        out[name] = bench(name, *CASES[name], repeats=args.repeats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
