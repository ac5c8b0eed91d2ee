"""Do the switch lowering's collectives pay off? Every promoted switch against its point-to-point twin,
on the simulated clock (one JSON object).

For every ordered pair of a set of strategies on 4 or 8 devices, the live planner lowers the switch
as a job on ``--cluster`` would (``plan_live_switch``); where it promoted messages to collectives,
the same switch is lowered again with ``promote=False`` and both Programs are simulated on the
cluster. Reported per model: how many promoted switches the simulator finds faster (``better``,
by more than 1%), slower (``worse``) or equal than point to point, and the slowest ratios
(promoted / point to point). The simulator is the judge here, as it is for the search; on gloo
(``cpu-local``) switches do not promote by default (see ``parashift.vps.transition.lower``).

Usage: python benchmarks/promotion_bench.py [--cluster h100-1x8] [--worst 5]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

from parashift import models
from parashift.errors import ParashiftError
from parashift.sim import simulate
from parashift.strategy import Strategy
from parashift.vps.transition import plan_live_switch

STRATEGIES = ("dp=4", "dp=4,zero=1", "tp=2,dp=2", "tp=2,dp=2,zero=1", "tp=4", "dp=2,pp=2", "dp=2", "dp=2,zero=1",
              "tp=2", "tp=8", "dp=8", "dp=8,zero=1", "tp=2,dp=4", "pp=2,dp=4")


def _models() -> dict:
    return {"gpt w768 (2 layers)": models.gpt(2, 768, 12, ffn=3072, vocab=8192, seq_len=256, name="w768",
                                              dtype="fp32", pad_vocab=64),
            "gpt3-1.3b": models.get("gpt3-1.3b")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cluster", default="h100-1x8", help="what the switches are priced on (default h100-1x8)")
    ap.add_argument("--worst", type=int, default=5, help="slowest promoted switches to list per model")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out: dict = {"cluster": args.cluster, "models": {}}
    for name, spec in _models().items():
        counts, rows = {"better": 0, "worse": 0, "same": 0, "not_promoted": 0}, []
        for a, b in itertools.permutations(STRATEGIES, 2):
            sa, sb = Strategy.parse(a), Strategy.parse(b)
            devs = (tuple(range(sa.world)), tuple(range(sb.world)))
            try:
                p = plan_live_switch(spec, sa, sb, *devs, cluster=args.cluster)
            except ParashiftError:           # a strategy this model cannot take
                continue
            used = {k: v for k, v in p.meta.collectives.items() if v}
            if not used:
                counts["not_promoted"] += 1
                continue
            q = plan_live_switch(spec, sa, sb, *devs, cluster=args.cluster, promote=False)
            tp, tq = (simulate(x.program, x.meta.cluster).step_time for x in (p, q))
            counts["better" if tp < 0.99 * tq else "worse" if tp > 1.01 * tq else "same"] += 1
            rows.append({"src": a, "dst": b, "collectives": used, "ratio": round(tp / tq, 3)})
        rows.sort(key=lambda r: -r["ratio"])
        out["models"][name] = {**counts, "slowest": rows[:args.worst]}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
