"""Ablation of the transition passes: simulated switch time with all passes and each one off.

Cases (issue 5): llama2-70b on a800-16x8, dp=4,tp=8,pp=4,zero=1 on 128 devices -> dp=8,tp=4,pp=4,
zero=1, and the shrink to the 120 devices left after node 5 is lost (dp=3,tp=8,pp=5,zero=1);
qwen3-235b-a22b on 1024 A800s (a800-128x8) changing ep from 16 to 32. For each: the switch
Program is lowered with every pass, then with each pass off in turn, and simulated
(parashift.sim.simulate_switch); a tight memory budget (1.15x the larger of the old and new
per-device state) shows what staging costs and what turning it off would need. Next to them:
the checkpoint-restart estimate (parashift.sim.estimate_checkpoint_restart) and the published
figures of the VPS design (70B dense on 16x8 A800: under 2 s, 143x faster than Megatron-LM
distributed checkpointing; 235B MoE: 4.36 s, 926x). Also: the time to lower the 1024-device
llama2-70b switch of plan_bench (target under 3 s).

Prints one JSON object on stdout and a table on stderr.
Usage: python benchmarks/switch_bench.py [--cases llama_tp,llama_node_loss,qwen_ep]
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from parashift import sim, vps  # noqa: E402
from parashift.errors import MemoryBudgetError  # noqa: E402
from parashift.vps import transition  # noqa: E402

CASES = {
    "llama_tp": dict(model="llama2-70b", cluster="a800-16x8", src="dp=4,tp=8,pp=4,zero=1",
                     dst="dp=8,tp=4,pp=4,zero=1", published={"switch_seconds": 2.0, "speedup": 143}),
    "llama_node_loss": dict(model="llama2-70b", cluster="a800-16x8", src="dp=4,tp=8,pp=4,zero=1",
                            dst="dp=3,tp=8,pp=5,zero=1", dst_devices="0-39,48-127",
                            published={"switch_seconds": 2.0, "speedup": 143}),
    "qwen_ep": dict(model="qwen3-235b-a22b", cluster="a800-128x8", src="dp=64,tp=4,pp=4,ep=16,zero=1",
                    dst="dp=64,tp=4,pp=4,ep=32,zero=1", published={"switch_seconds": 4.36, "speedup": 926}),
}
PASSES = ("select_sources", "promote", "coalesce", "xor_order")


def _run(plan, cluster: str, budget: int | None = None, **off) -> dict:
    t0 = time.perf_counter()
    try:
        prog = transition.lower(plan, cluster, memory_budget=budget, **off)
    except MemoryBudgetError as e:
        return {"error": str(e)}
    lower_s = time.perf_counter() - t0
    res = sim.simulate_switch(prog, cluster)
    return {"switch_seconds": res.switch_time, "messages": prog.meta["messages"],
            "collectives": sum(prog.meta["collectives"].values()), "bytes_inter": res.link_bytes["inter"],
            "bytes_intra": res.link_bytes["intra"], "peak_memory_max": res.peak_memory_max,
            "stages": prog.meta["stages"], "lower_seconds": lower_s, "sim_seconds": res.sim_seconds}


def bench(case: dict) -> dict:
    plan = vps.plan_switch(case["model"], case["src"], case["dst"], cluster=case["cluster"],
                           dst_devices=case.get("dst_devices"))
    buf = transition.state_buffers(plan)
    n = int(buf.dev.max()) + 1
    tight = int(1.15 * max(np.bincount(buf.dev, weights=buf.old, minlength=n).max(),
                           np.bincount(buf.dev, weights=buf.new, minlength=n).max()))
    variants = {"all": _run(plan, case["cluster"])}
    for p in PASSES:
        variants[f"no_{p}"] = _run(plan, case["cluster"], **{p: False})
    variants["tight_budget"] = _run(plan, case["cluster"], tight)
    variants["tight_budget_no_stage"] = _run(plan, case["cluster"], tight, stage=False)
    ckpt = sim.estimate_checkpoint_restart(case["model"], case["src"], case["dst"], case["cluster"])
    best = variants["all"]["switch_seconds"]
    st = plan.stats()
    return {"model": case["model"], "src": case["src"], "dst": case["dst"], "cluster": case["cluster"],
            "bytes_moved": st["bytes_moved"], "bytes_inter_node_planned": st["bytes_inter_node"],
            "tight_budget_bytes": tight, "variants": variants,
            "checkpoint_restart_seconds": ckpt.total_seconds, "speedup": ckpt.total_seconds / best,
            "published": case["published"]}


def lowering_1024() -> dict:
    plan = vps.plan_switch("llama2-70b", "dp=32,tp=8,pp=4,zero=1", "dp=16,tp=8,pp=8,zero=1", cluster="a800-128x8")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        transition.lower(plan)
        times.append(time.perf_counter() - t0)
    return {"lower_seconds": float(np.median(times)), "target_seconds": 3.0}


def _table(out: dict) -> str:
    lines = []
    for name, r in out.items():
        if name == "lowering_1024":
            lines.append(f"\nlowering the 1024-device llama2-70b switch: {r['lower_seconds']:.2f} s (target < 3 s)")
            continue
        lines.append(f"\n{name}: {r['model']} {r['src']} -> {r['dst']} on {r['cluster']}  "
                     f"(checkpoint-restart {r['checkpoint_restart_seconds']:.1f} s, speedup {r['speedup']:.0f}x; "
                     f"published {r['published']['switch_seconds']} s, {r['published']['speedup']}x)")
        lines.append(f"  {'variant':24s} {'switch s':>9s} {'messages':>9s} {'colls':>6s} {'inter GB':>9s} "
                     f"{'peak GiB':>9s} {'stages':>6s} {'lower s':>8s}")
        for v, x in r["variants"].items():
            if "error" in x:
                lines.append(f"  {v:24s} error: {x['error'][:90]}")
                continue
            lines.append(f"  {v:24s} {x['switch_seconds']:9.3f} {x['messages']:9d} {x['collectives']:6d} "
                         f"{x['bytes_inter'] / 1e9:9.1f} {x['peak_memory_max'] / 2**30:9.2f} {x['stages']:6d} "
                         f"{x['lower_seconds']:8.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    out = {name: bench(CASES[name]) for name in args.cases.split(",") if name}
    out["lowering_1024"] = lowering_1024()
    print(json.dumps(out))
    print(_table(out), file=sys.stderr)


if __name__ == "__main__":
    main()
