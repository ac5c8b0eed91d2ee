"""Switch-planner speed at full scale: prints one JSON object.

Cases (issue 2): llama2-70b on 1024 devices dp=32,tp=8,pp=4,zero=1 -> dp=16,tp=8,pp=8,zero=1;
llama2-70b on a800-16x8 losing node 5 (128 -> 120 devices) dp=4,tp=8,pp=4,zero=1 ->
dp=3,tp=8,pp=5,zero=1; qwen3-235b-a22b on 1024 devices dp=64,tp=4,pp=4,ep=16,zero=1 ->
dp=32,tp=4,pp=8,ep=32,zero=1; and llama2-70b on a800-16x8 reshaped from tp=8 to tp=4, where the
device order matters. Per case: median ``plan_seconds`` (vps.plan_switch, layouts included) and
``verify_seconds`` (SwitchPlan.verify) over repeats, the plan's stats and the target; then
``placed_plan_seconds`` and ``placed_bytes_moved`` with ``placement="keep"`` (the destination
devices reordered within nodes to keep the most state; the peer is the given order).
Targets on one core: under 0.5 s (dense) and 2 s (MoE) for planning.

Usage: python benchmarks/plan_bench.py [--repeats 5]
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")          # one core, as the targets say

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from parashift import vps  # noqa: E402

CASES = {
    "llama2-70b_1024_pp4_to_pp8": dict(model="llama2-70b", src="dp=32,tp=8,pp=4,zero=1",
                                       dst="dp=16,tp=8,pp=8,zero=1", cluster="a800-128x8", target=0.5),
    "llama2-70b_a800-16x8_node5_lost": dict(model="llama2-70b", src="dp=4,tp=8,pp=4,zero=1",
                                            dst="dp=3,tp=8,pp=5,zero=1", cluster="a800-16x8",
                                            dst_devices="0-39,48-127", target=0.5),
    "qwen3-235b-a22b_1024_ep16_to_ep32": dict(model="qwen3-235b-a22b", src="dp=64,tp=4,pp=4,ep=16,zero=1",
                                              dst="dp=32,tp=4,pp=8,ep=32,zero=1", cluster="a800-128x8",
                                              target=2.0),
    "llama2-70b_a800-16x8_tp8_to_tp4": dict(model="llama2-70b", src="dp=4,tp=8,pp=4,zero=1",
                                            dst="dp=8,tp=4,pp=4,zero=1", cluster="a800-16x8", target=0.5),
}


def bench(case: dict, repeats: int) -> dict:
    kw = {k: v for k, v in case.items() if k not in ("model", "src", "dst", "target")}
    plans, verify = [], []
    plan = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = vps.plan_switch(case["model"], case["src"], case["dst"], **kw)
        plans.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan.verify()
        verify.append(time.perf_counter() - t0)
    assert plan is not None
    stats = plan.stats()
    assert stats["bytes_moved"] == stats["bytes_needed"]
    med = statistics.median(plans)
    placed = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        kept = vps.plan_switch(case["model"], case["src"], case["dst"], placement="keep", **kw)
        placed.append(time.perf_counter() - t0)
    return {"plan_seconds": med, "verify_seconds": statistics.median(verify), "target_seconds": case["target"],
            "meets_target": med < case["target"], "pieces_total": len(plan), **stats,
            "placed_plan_seconds": statistics.median(placed), "placed_bytes_moved": kept.stats()["bytes_moved"],
            "placed_order_changed": kept.dst_devices != plan.dst_devices,
            "placed_vs_given_bytes": kept.stats()["bytes_moved"] / max(stats["bytes_moved"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps({name: bench(case, args.repeats) for name, case in CASES.items()}))


if __name__ == "__main__":
    main()
