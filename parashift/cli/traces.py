"""`parashift traces`: the shipped preemption/availability traces with their source, license, span and nodes."""
from __future__ import annotations

import argparse

HELP = "list the shipped traces (source, license, span, nodes) that plan-trace and replay accept by name"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pattern", help="only names matching this pattern, e.g. 'bamboo/*'")


def run(args: argparse.Namespace) -> list:
    from .. import traces
    from ..errors import TraceFormatError
    from ..traces.shipped import index, root
    base = root()
    idx = index()
    rows = []
    for rec in idx.to_dict("records"):
        if args.pattern:
            import fnmatch
            if not fnmatch.fnmatch(rec["path"], args.pattern):
                continue
        row = {"name": rec["path"], "format": rec["format"], "source": rec["source"], "license": rec["license"],
               "about": rec.get("nodes", "")}
        try:
            df = traces.load(base / rec["path"])
            counts = [int(df.attrs.get("initial", 0)), *df["available"].astype(int).tolist()]
            row.update({"span_seconds": float(df.attrs.get("duration") or df["time"].max()), "events": len(df),
                        "nodes_min": min(counts), "nodes_max": max(counts),
                        "nodes_start": int(df.attrs.get("initial", 0))})
        except TraceFormatError as e:   # listed but unreadable: say so in the row
            row["problem"] = str(e)
        rows.append(row)
    return rows


def render(result: list, args: argparse.Namespace) -> None:
    import pandas as pd

    from .dialect import format_seconds
    if not result:
        print("no shipped trace matches")
        return
    df = pd.DataFrame(result)
    df["span"] = df["span_seconds"].map(lambda s: format_seconds(s) if s == s else "-")
    df["nodes"] = [f"{a}-{b} (start {s})" if a == a else "-" for a, b, s in
                   zip(df["nodes_min"], df["nodes_max"], df["nodes_start"])]
    df["name"] = df["name"].str.ljust(int(df["name"].str.len().max()))
    cols = ["name", "source", "license", "span", "events", "nodes"]
    with pd.option_context("display.max_colwidth", 40, "display.width", 200):
        print(df[cols].to_string(index=False))
