"""`parashift plan-trace`: plan a job over a resource trace and compare reconfiguration policies."""
from __future__ import annotations

import argparse
import sys

from ..validate import arg_float, arg_int
from .options import add_batch_options, add_cost_model, add_space_options, load_cost_model, space_options

HELP = ("plan strategies over a preemption/availability trace: checkpoint-restart vs hot switch vs "
        "switch-aware")
OUTPUTS = {"plot": "image", "table": "file"}
ALIASES = {"--max-devices": "--devices"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="trace file or shipped trace name (e.g. bamboo/p3-trace.csv), "
                   "or a CSV of time,devices rows")
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-13b")
    p.add_argument("--cluster", required=True, help="cluster preset, e.g. a800-16x8 (its size caps the counts)")
    add_batch_options(p)
    p.add_argument("--format", help="trace format (default: detected)")
    p.add_argument("--devices-per-node", type=arg_int(1, 1024),
                   help="devices per trace node (default: the cluster's; 1 for a time,available CSV)")
    p.add_argument("--devices", dest="max_devices", type=arg_int(1, 1_000_000),
                   help="the most devices the job may use (default: the cluster's size; was --max-devices)")
    p.add_argument("--from", dest="start", type=arg_float(0), default=0.0, help="window start in trace seconds")
    p.add_argument("--to", dest="stop", type=arg_float(0), help="window end in trace seconds")
    p.add_argument("--top-k", type=arg_int(1, 100), default=2, help="strategies kept per device count (default 2)")
    p.add_argument("--max-candidates", type=arg_int(1, 100), default=4, help="candidates per device count (default 4)")
    p.add_argument("--trials", type=arg_int(1, 100_000), help="TPE trials per device count (default: enumerate small spaces, "
                   "else 200)")
    p.add_argument("--seed", type=arg_int(0, 2**32 - 1), default=0, help="sampler seed (default 0)")
    add_cost_model(p)
    add_space_options(p)
    p.add_argument("--plot", help="write device count, chosen strategy and cumulative tokens (PNG)")
    p.add_argument("--table", help="write every policy's per-segment plan as CSV")
    p.add_argument("--all-devices", action="store_true",
                   help="per device count, only strategies that use every device (default: any count up to it)")


#: the latest time a ``time,devices`` CSV may hold (about 30 years, in seconds)
MAX_TRACE_SECONDS = 1e9


def load_trace(path: str, fmt: str | None = None):
    """A normalized trace, or a plain ``time,devices`` / ``time,available`` CSV as a DataFrame."""
    from .. import traces
    from .inputs import resolve_trace
    p = resolve_trace(path)
    if fmt is None and str(p).endswith(".csv"):
        from ..validate import read_text
        text = read_text(p, "trace")
        head = [c.strip() for c in text.split("\n", 1)[0].strip().split(",")]
        if head in (["time", "devices"], ["time", "available"]):
            return _count_csv(path, text, head[1])
    return traces.load(p, fmt)


def _count_csv(name: str, text: str, col: str):
    """A ``time,devices`` / ``time,available`` CSV: finite times >= 0, non-decreasing; whole counts >= 0."""
    import io

    import numpy as np
    import pandas as pd

    from ..errors import TraceFormatError
    try:
        df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, ValueError):
        raise TraceFormatError(f"{name}: not a two-column CSV (a row has too many fields); write time,{col} "
                               "rows") from None
    if list(df.columns) != ["time", col]:
        raise TraceFormatError(f"{name}: the header must be time,{col}")
    if not len(df):
        raise TraceFormatError(f"{name}: the file holds no data rows; add time,{col} rows")
    t = pd.to_numeric(df["time"].str.strip(), errors="coerce").to_numpy(dtype=np.float64)
    n = pd.to_numeric(df[col].str.strip(), errors="coerce").to_numpy(dtype=np.float64)
    for what, v, whole in (("time", t, False), (col, n, True)):
        bad = np.flatnonzero(~np.isfinite(v) | (v < 0) | ((v != np.round(v)) if whole else False))
        if bad.size:
            kind = "a whole number >= 0" if whole else "a finite number of seconds >= 0"
            raise TraceFormatError(f"{name}, row {int(bad[0]) + 2}: {what} is not {kind}; fix the row")
    if np.any(np.diff(t) < 0):
        i = int(np.flatnonzero(np.diff(t) < 0)[0]) + 3
        raise TraceFormatError(f"{name}, row {i}: time goes backwards; sort the rows by time")
    if t[-1] > MAX_TRACE_SECONDS:
        i = int(np.flatnonzero(t > MAX_TRACE_SECONDS)[0]) + 2
        raise TraceFormatError(f"{name}, row {i}: time {t[i - 2]:g} s is beyond {MAX_TRACE_SECONDS:g} s (about 30 "
                               f"years); give times in seconds from the trace's start")
    return pd.DataFrame({"time": t, col: n.astype(np.int64)})


def _count_window(name: str, df, start: float, stop: "float | None"):
    """The rows of a ``time,devices`` frame in ``[start, stop]``: the count in force at ``start`` opens it and a
    closing row at ``stop`` (default: the last row's time) ends it."""
    import numpy as np
    import pandas as pd

    from ..errors import TraceFormatError
    t = df["time"].to_numpy()
    col = df.columns[1]
    stop = float(t[-1]) if stop is None else min(float(stop), float(t[-1]))
    start = max(float(start), float(t[0]))
    if start >= stop:
        raise TraceFormatError(f"{name}: the window [{start:g}, {stop:g}] s is empty; the trace covers "
                               f"{t[0]:g}..{t[-1]:g} s, pass --from/--to inside it")
    n = df[col].to_numpy()
    at = lambda x: n[int(np.searchsorted(t, x, side="right")) - 1]   # noqa: E731 - the count in force at x
    inside = (t > start) & (t < stop)
    return pd.DataFrame({"time": np.concatenate([[start], t[inside], [stop]]),
                         col: np.concatenate([[at(start)], n[inside], [at(stop)]]).astype(np.int64)})


def run(args: argparse.Namespace) -> dict:
    from .. import cluster as clusters, models, search, traces

    model = models.get(args.model)
    cl = clusters.get(args.cluster)
    if args.stop is not None and args.stop <= args.start:
        from ..errors import TraceFormatError
        raise TraceFormatError(f"--to {args.stop:g} must be after --from {args.start:g}")
    trace = load_trace(args.trace, args.format)
    if args.start or args.stop is not None:
        if "event" in trace.columns:
            trace = traces.window(trace, args.start, args.stop)
        else:
            trace = _count_window(args.trace, trace, args.start, args.stop)
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
