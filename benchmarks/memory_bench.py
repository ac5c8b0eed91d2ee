"""Measured runtime memory peaks against the simulator's, and the largest batch under a budget.

Each case runs one training step of a tiny model on gloo (CPU, one process per rank) and reads
every rank's peak from the state store's accounting (parameters, gradients, optimizer states,
ZeRO buffers and the distinct tensors the live regions keep for their backward), then simulates
the same Program and reports the simulated peak of each rank and the ratio measured / simulated
(the maxima over ranks, and the rank whose ratio is farthest from 1). Cases: ZeRO 0-3 under pp=2 and pp=4 (dp=2),
ZeRO 1-3 under the split-backward schedules (zb-h1, dualpipev; dp=2, pp=2), the pipeline schedules
(gpipe, 1f1b, interleaved-1f1b, zb-h1, dualpipev) and recomputation none / selective / full.

``largest_batch``: per ZeRO stage (1 and 3) under pipelining, the largest micro-batch size whose
peak fits a memory budget: simulated on a 7B preset (``--big-model``, default llama2-7b, on
``--big-cluster``) and measured on tiny-gpt (next to the simulator's answer for the same runs).

Usage: python benchmarks/memory_bench.py [--quick] [--budget-gib 40] [--tiny-budget-mib 2.5]
Prints one JSON object; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import pandas as pd
import torch

from parashift import models
from parashift.exec import run
from parashift.ir import compile as ir_compile
from parashift.sim import simulate

GB, SEQ, CLUSTER = 8, 32, "a100-1x8"
MIB, GIB = 2**20, 2**30

ZERO = [f"dp=2,pp={pp},zero={z}" for pp in (2, 4) for z in (0, 1, 2, 3)]
SPLIT = [f"dp=2,pp=2,{v}schedule={k},zero={z}" for k, v in (("zb-h1", ""), ("dualpipev", "vpp=2,"))
         for z in (1, 2, 3)]
SCHEDULES = ["pp=2,schedule=gpipe", "pp=2,schedule=1f1b", "pp=2,vpp=2,schedule=interleaved-1f1b",
             "pp=2,schedule=zb-h1", "pp=2,vpp=2,schedule=dualpipev"]
RECOMPUTE = ["tp=2,pp=2,recompute=none", "tp=2,pp=2,recompute=selective", "tp=2,pp=2,recompute=full"]
QUICK = ["dp=2,pp=2,zero=1", "dp=2,pp=2,zero=2", "pp=2,schedule=gpipe", "pp=2,recompute=full"]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(model: str, strategy: str, global_batch: int = GB, seq_len: int = SEQ) -> dict:
    """One step's measured and simulated peaks per rank (bytes) for ``strategy``."""
    res = run(model, strategy, steps=1, global_batch=global_batch, seq_len=seq_len, timeout=300, profile=False)
    prog = ir_compile(model, strategy, global_batch=global_batch, seq_len=seq_len)
    sim = simulate(prog, CLUSTER).peak_memory
    measured = [int(m) for m in res.peak_memory]
    simulated = [int(sim[r]) for r in range(len(measured))]
    ratios = [m / s for m, s in zip(measured, simulated)]
    worst = max(range(len(ratios)), key=lambda r: abs(ratios[r] - 1.0))
    return {"strategy": strategy, "ranks": len(measured), "max_measured_mib": max(measured) / MIB,
            "max_simulated_mib": max(simulated) / MIB, "ratio_of_max": max(measured) / max(simulated),
            "worst_rank": worst, "worst_rank_ratio": ratios[worst]}


def table(cases: list[tuple[str, str]], model: str) -> pd.DataFrame:
    rows = []
    for k, (group, strategy) in enumerate(cases):
        t0 = time.perf_counter()
        row = {"group": group, **measure(model, strategy)}
        rows.append(row)
        _log(f"[{k + 1}/{len(cases)}] {strategy}: max measured {row['max_measured_mib']:.3f} MiB, max simulated "
             f"{row['max_simulated_mib']:.3f} MiB, worst rank ratio {row['worst_rank_ratio']:.3f} "
             f"({time.perf_counter() - t0:.1f} s)")
    df = pd.DataFrame(rows, columns=["group", "strategy", "ranks", "max_measured_mib", "max_simulated_mib",
                                     "ratio_of_max", "worst_rank", "worst_rank_ratio"])
    df["within_10pct"] = (df["worst_rank_ratio"] - 1.0).abs() <= 0.10
    return df


def largest_simulated(model: str, cluster: str, base: str, budget: int, mbs_max: int = 16) -> dict:
    """Largest micro-batch size whose simulated peak fits ``budget`` bytes."""
    best, peaks = 0, {}
    mbs = 1
    while mbs <= mbs_max:
        s = f"{base},mbs={mbs}"
        prog = ir_compile(model, s, global_batch=_global(s, mbs), seq_len=models.get(model).seq_len)
        peak = simulate(prog, cluster).peak_memory_max
        peaks[mbs] = peak / GIB
        if peak > budget:
            break
        best = mbs
        mbs += 1
    return {"largest_mbs": best, "peak_gib_by_mbs": peaks}


def _global(strategy: str, mbs: int) -> int:
    from parashift.strategy import Strategy
    s = Strategy.parse(strategy)
    return s.dp * mbs * 2 * s.pp          # two micro-batches per stage in flight


def largest_measured(base: str, budget: int, mbs_max: int = 8) -> dict:
    """Largest micro-batch size of tiny-gpt whose measured (and, apart, simulated) peak fits."""
    out = {"largest_mbs_measured": 0, "largest_mbs_simulated": 0, "measured_mib": {}, "simulated_mib": {}}
    mbs = 1
    while mbs <= mbs_max:
        s = f"{base},mbs={mbs}"
        r = measure("tiny-gpt", s, global_batch=_global(s, mbs))
        out["measured_mib"][mbs], out["simulated_mib"][mbs] = r["max_measured_mib"], r["max_simulated_mib"]
        _log(f"largest batch, tiny-gpt {s}: measured {r['max_measured_mib']:.3f} MiB, simulated "
             f"{r['max_simulated_mib']:.3f} MiB")
        if r["max_measured_mib"] * MIB <= budget:
            out["largest_mbs_measured"] = mbs
        if r["max_simulated_mib"] * MIB <= budget:
            out["largest_mbs_simulated"] = mbs
        if r["max_measured_mib"] * MIB > budget and r["max_simulated_mib"] * MIB > budget:
            break
        mbs += 1
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="four cases, no largest-batch search")
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--big-model", default="llama2-7b")
    ap.add_argument("--big-cluster", default="a100-4x8")
    ap.add_argument("--big-strategy", default="dp=8,pp=4", help="the 7B layout, without zero and mbs")
    ap.add_argument("--budget-gib", type=float, default=40.0, help="memory budget per GPU for the 7B model")
    ap.add_argument("--tiny-budget-mib", type=float, default=2.5, help="memory budget per rank for tiny-gpt")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = [("quick", s) for s in QUICK] if a.quick else (
        [("zero", s) for s in ZERO] + [("split", s) for s in SPLIT] + [("schedule", s) for s in SCHEDULES]
        + [("recompute", s) for s in RECOMPUTE])
    df = table(cases, a.model)
    out = {"model": a.model, "global_batch": GB, "seq_len": SEQ, "cluster": CLUSTER,
           "table": df.to_dict(orient="records"), "all_within_10pct": bool(df["within_10pct"].all()),
           "worst_ratio": float(df.loc[(df["worst_rank_ratio"] - 1).abs().idxmax(), "worst_rank_ratio"])}
    if not a.quick:
        big = {}
        for z in (1, 3):
            base = f"{a.big_strategy},zero={z}"
            _log(f"largest batch, {a.big_model} {base} (simulated)")
            big[f"zero={z}"] = largest_simulated(a.big_model, a.big_cluster, base, int(a.budget_gib * GIB))
        tiny = {f"zero={z}": largest_measured(f"dp=2,pp=2,zero={z}", int(a.tiny_budget_mib * MIB)) for z in (1, 3)}
        out["largest_batch"] = {"simulated": {"model": a.big_model, "cluster": a.big_cluster,
                                              "strategy": a.big_strategy, "budget_gib": a.budget_gib, **big},
                                "measured": {"model": "tiny-gpt", "strategy": "dp=2,pp=2",
                                             "budget_mib": a.tiny_budget_mib, **tiny}}
    print(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    main()
