"""`parashift plan-trace`: plan a job over a resource trace and compare reconfiguration policies."""
from __future__ import annotations

import argparse
import sys

from .options import (add_batch_options, add_cost_model, add_space_options, load_cost_model, positive_int,
                      space_options)

HELP = ("plan strategies over a preemption/availability trace: checkpoint-restart vs hot switch vs "
        "switch-aware")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="trace file or shipped trace name (e.g. bamboo/p3-trace.csv), "
                   "or a CSV of time,devices rows")
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-13b")
    p.add_argument("--cluster", required=True, help="cluster preset, e.g. a800-16x8 (its size caps the counts)")
    add_batch_options(p)
    p.add_argument("--format", help="trace format (default: detected)")
    p.add_argument("--devices-per-node", type=int,
                   help="devices per trace node (default: the cluster's; 1 for a time,available CSV)")
    p.add_argument("--max-devices", type=int, help="cap on devices (default: the cluster's size)")
    p.add_argument("--from", dest="start", type=float, default=0.0, help="window start in trace seconds")
    p.add_argument("--to", dest="stop", type=float, help="window end in trace seconds")
    p.add_argument("--top-k", type=int, default=2, help="strategies kept per device count (default 2)")
    p.add_argument("--max-candidates", type=int, default=4, help="candidates per device count (default 4)")
    p.add_argument("--trials", type=positive_int, help="TPE trials per device count (default: enumerate small spaces, "
                   "else 200)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    add_cost_model(p)
    add_space_options(p)
    p.add_argument("--plot", help="write device count, chosen strategy and cumulative tokens (PNG)")
    p.add_argument("--table", help="write every policy's per-segment plan as CSV")
    p.add_argument("--all-devices", action="store_true",
                   help="per device count, only strategies that use every device (default: any count up to it)")


def load_trace(path: str, fmt: str | None = None):
    """A normalized trace, or a plain ``time,devices`` / ``time,available`` CSV as a DataFrame."""
    import pandas as pd
    from .. import traces
    from ..traces.shipped import resolve
    p = resolve(path)
    if fmt is None and str(p).endswith(".csv"):
        with open(p) as f:
            head = [c.strip() for c in f.readline().strip().split(",")]
        if head in (["time", "devices"], ["time", "available"]):
            return pd.read_csv(p)
    return traces.load(p, fmt)


def run(args: argparse.Namespace) -> dict:
    from .. import cluster as clusters, models, search, traces

    model = models.get(args.model)
    cl = clusters.get(args.cluster)
    trace = load_trace(args.trace, args.format)
    if "event" in trace.columns and (args.start or args.stop is not None):
        trace = traces.window(trace, args.start, args.stop)
    cost = load_cost_model(args.cost_model)

    def say(msg: str) -> None:
        print(f"plan-trace: {msg}", file=sys.stderr, flush=True)

    plan = search.plan_trace(trace, model, cl, global_batch=args.global_batch, seq_len=args.seq_len,
                             devices_per_node=args.devices_per_node, max_devices=args.max_devices,
                             top_k=args.top_k, max_candidates=args.max_candidates, trials=args.trials,
                             seed=args.seed, cost_model=cost, space_options=space_options(args),
                             all_devices=args.all_devices, progress=say)
    out = plan.to_dict()
    out.update({"model": model.name, "cluster": cl.name, "trace": args.trace,
                "duration_s": float(plan.segments["end"].iloc[-1] - plan.segments["start"].iloc[0])})
    if args.plot:
        plan.plot(args.plot)
        out["plot"] = args.plot
    if args.table:
        plan.to_frame().to_csv(args.table, index=False)
        out["table"] = args.table
    return out


def render(result: dict, args: argparse.Namespace) -> None:
    import pandas as pd
    print(f"{result['model']} on {result['cluster']} over {result['trace']} "
          f"({result['duration_s'] / 3600:.2f} h, {result['segments']} segments), planned in "
          f"{result['plan_seconds']:.1f} s")
    df = pd.DataFrame(result["policies"]).T
    df["tokens"] = df["tokens"].map(lambda v: f"{v:.4g}")
    for c in ("lost_seconds", "idle_seconds"):
        df[c] = df[c].map(lambda v: f"{v:,.1f}")
    df["switches"] = df["switches"].astype(int)
    print(df.to_string())
    print("best strategy per device count:")
    for r in result["per_count"]:
        tps = f"{r['tokens_per_s']:,.0f} tok/s" if r["strategy"] else "-"
        print(f"  {r['devices']:>5} devices  {tps:>18}  {r['strategy'] or 'nothing fits'}")
    for key, label in (("plot", "plot"), ("table", "table")):
        if result.get(key):
            print(f"{label}: {result[key]}")
