"""Fidelity at cluster scale: predict published large-scale training measurements, print one JSON object.

Data: every CSV under ``traces/published/`` (see its PROVENANCE.md): one row per published run with its
source, the model (an inline spec), the strategy, global batch, sequence length, cluster preset and
the measured step time. Every row is compiled and simulated with the cluster preset's default cost
model (nothing here is fitted on these rows; the A100 defaults come from the single-node vTrain fit,
``benchmarks/vtrain_bench.py --fit``). Reports per-row predicted and measured step seconds and APE,
the median and mean APE, and the Spearman rank correlation of predicted against measured throughput
per GPU (the order a search ranks configurations in). ``--model-kind flops`` predicts with the
FLOPs-at-one-efficiency compute model instead, for a side-by-side with the shape-aware one.
``--files`` picks CSVs by name; ``--set key=value,...`` changes cost-model fields on top of each row's
preset (e.g. ``grad_accum_traffic=0``: no unfused accumulation pass, which a row's ``grad_fusion`` says itself).
``by_file`` reports each file's median APE and Spearman alone.

Usage: python benchmarks/fidelity_published.py [--rows 0,3] [--files korthikanti] [--cost-model F]
       [--set key=value,...] [--model-kind shape|flops]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd

from parashift import cluster as clusters, models
from parashift.ir import compile as ir_compile
from parashift.sim import CostModel, simulate
from parashift.strategy import Strategy

DATA = Path(__file__).resolve().parents[1] / "traces" / "published"
COLUMNS = ("source", "name", "model", "strategy", "global_batch", "seq_len", "gpus", "cluster", "step_seconds")


def load(files: str = "") -> pd.DataFrame:
    """Published rows (columns :data:`COLUMNS`, plus any others a file has) of every CSV, or of those
    whose name contains one of the comma-separated ``files``."""
    frames = []
    for p in sorted(DATA.glob("*.csv")):
        if files and not any(f in p.name for f in files.split(",")):
            continue
        df = pd.read_csv(p)
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise SystemExit(f"{p}: missing columns {missing}")
        frames.append(df.assign(file=p.name))
    return pd.concat(frames, ignore_index=True)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = pd.Series(a).rank().to_numpy(), pd.Series(b).rank().to_numpy()
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else float("nan")


def overrides(text: str) -> dict:
    """``key=value,...`` into cost-model fields (numbers or true/false)."""
    known = {f.name for f in fields(CostModel)}
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, val = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes key=value pairs, got {item!r}")
        if key not in known:
            raise SystemExit(f"--set: {key!r} is not a cost-model field; fields are {', '.join(sorted(known))}")
        low = val.lower()
        try:
            out[key] = True if low == "true" else False if low == "false" else float(val)
        except ValueError:
            raise SystemExit(f"--set {key}: {val!r} is not a number or true/false") from None
        if out[key] != out[key] or out[key] in (float("inf"), float("-inf")):
            raise SystemExit(f"--set {key}: give a finite number, not {val!r}")
    return out


def predict(row: pd.Series, cost: "CostModel | None", kind: str, changes: "dict | None" = None) -> dict:
    model = models.get(row.model)
    strategy = Strategy.parse(row.strategy)
    cl = clusters.get(row.cluster)
    if strategy.world != int(row.gpus):
        raise SystemExit(f"row {row['name']}: strategy has {strategy.world} ranks, the row says {row.gpus} GPUs")
    cm = cost or CostModel.for_cluster(cl)
    if changes:
        cm = cm.replace(**changes)
    if kind == "flops":
        cm = cm.replace(compute_model="flops")
    t0 = time.perf_counter()
    prog = ir_compile(model, strategy, global_batch=int(row.global_batch), seq_len=int(row.seq_len))
    t1 = time.perf_counter()
    res = simulate(prog, cl, cm, model=model)
    t2 = time.perf_counter()
    return {"predicted_s": res.step_time, "compile_s": t1 - t0, "simulate_s": t2 - t1, "mfu": res.mfu,
            "bubble_fraction": res.bubble_fraction}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", help="comma-separated row indices (default: all)")
    ap.add_argument("--files", default="", help="comma-separated parts of CSV names to keep (default: every file)")
    ap.add_argument("--cost-model", help="a cost model JSON instead of each cluster preset's defaults")
    ap.add_argument("--set", default="", help="cost-model fields to change on every row, key=value,...")
    ap.add_argument("--model-kind", choices=("shape", "flops"), default="shape",
                    help="compute model: shape-aware kernels (default) or FLOPs at one efficiency")
    args = ap.parse_args()
    df = load(args.files)
    if df.empty:
        raise SystemExit(f"no CSV under {DATA} matches --files {args.files!r}")
    changes = overrides(args.set)
    if args.rows:
        df = df.iloc[[int(x) for x in args.rows.split(",")]]
    cost = CostModel.load(args.cost_model) if args.cost_model else None
    out_rows = []
    for i, (_, row) in enumerate(df.iterrows()):
        print(f"fidelity_published: {i + 1}/{len(df)} {row['name']} {row.strategy} on {row.cluster}",
              file=sys.stderr, flush=True)
        p = predict(row, cost, args.model_kind, changes)
        meas = float(row.step_seconds)
        out_rows.append({"name": row["name"], "source": row.source, "file": row.file, "strategy": row.strategy,
                         "gpus": int(row.gpus), "measured_s": meas, "predicted_s": p["predicted_s"],
                         "ape": abs(p["predicted_s"] / meas - 1), "signed_error": p["predicted_s"] / meas - 1,
                         "predicted_mfu": p["mfu"], "bubble_fraction": p["bubble_fraction"],
                         "compile_s": p["compile_s"], "simulate_s": p["simulate_s"]})
    res = pd.DataFrame(out_rows)
    # throughput per GPU ranks the configurations: tokens per second per GPU, measured vs predicted
    tok = df["global_batch"].to_numpy() * df["seq_len"].to_numpy() / df["gpus"].to_numpy()
    res["tokens_per_gpu"] = tok
    by_file = {f: {"rows": len(g), "median_ape": float(g["ape"].median()), "median_signed_error": float(g["signed_error"].median()),
                   "spearman_tokens_per_gpu": spearman(g["tokens_per_gpu"] / g["measured_s"], g["tokens_per_gpu"] / g["predicted_s"])}
               for f, g in res.groupby("file", sort=True)}
    kind = "flops" if args.model_kind == "flops" or (cost is not None and cost.compute_model == "flops") else "shape"
    out = {"rows": len(res), "model_kind": kind,
           "median_ape": float(res["ape"].median()), "mean_ape": float(res["ape"].mean()),
           "worst_ape": float(res["ape"].max()),
           "spearman_tokens_per_gpu": spearman(tok / res["measured_s"].to_numpy(), tok / res["predicted_s"].to_numpy()),
           "spearman_step_time": spearman(res["measured_s"].to_numpy(), res["predicted_s"].to_numpy()),
           "cost_changes": changes, "by_file": by_file,
           "aim": {"median_ape": 0.05, "spearman": 0.9}, "per_row": out_rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
