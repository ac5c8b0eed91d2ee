"""`parashift demo`: the whole tour (explore, switch, tune and deploy, hot switch, replay, real data) into one folder."""
from __future__ import annotations

import argparse
import sys

HELP = "run the end-to-end demo on this machine's CPUs and write plots and summary.md to a folder"
OUTPUTS = {"out": "dir"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-out", help="output folder (default demo-out)")
    p.add_argument("--only", help="comma-separated steps to run: explore, switch, deploy, hot-switch, replay, "
                                  "real-data (default: all)")


def run(args: argparse.Namespace) -> dict:
    from ..demo import DemoError, run_demo
    only = tuple(s.strip() for s in args.only.split(",") if s.strip()) if args.only is not None else None
    if only == ():
        raise DemoError(f"--only {args.only!r} names no step; give steps such as explore,switch, or drop --only")

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
    result = run_demo(args.out, only=only, progress=progress)
    out = result.to_json()
    if not result.ok:
        failed = [f"{s['step']}. {s['status']}" for s in out["steps"] if s["status"].startswith("failed")]
        # the summary is written; say where, and exit non-zero
        raise DemoError(f"{len(failed)} step(s) failed; see {result.summary}: " + " | ".join(failed))
    if not args.json:
        out["table"] = result.frame()
    return out


def render(result: dict, args: argparse.Namespace) -> None:
    import pandas as pd
    table = result.pop("table")
    with pd.option_context("display.max_rows", 200, "display.max_colwidth", 70, "display.width", 160):
        print(table.to_string(index=False))
    print(f"\nwrote {result['summary']} ({result['seconds']:.0f} s)")
