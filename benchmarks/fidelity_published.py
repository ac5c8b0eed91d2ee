"""Fidelity on published training measurements: predict every row of ``traces/published/*.csv``, print one JSON object.

Data: every CSV under ``traces/published/`` (sources in its PROVENANCE.md): one row per published run with its
source, the model (an inline spec or preset), the strategy, global batch, sequence length, GPUs, cluster preset
and the measured step time; optional columns ``job`` (rows of one job share model, GPUs, batch and sequence),
``schedule``, ``precision``, ``framework`` and ``derived`` (how ``step_seconds`` follows from the published figure).
Rows are written as their source states them; a row parashift cannot express yet (an FP8 recipe, a schedule,
GPU or model without a preset, uneven stages) is kept and reported as not expressed with the error that
stopped it, so coverage shows as features land. Nothing here is fitted on these rows: each row is compiled and
simulated with its cluster preset's default cost model.

Reports per source file and overall: rows, rows expressed, median APE, mean and median signed error (negative:
predicted too fast) and the share too fast; within-job pairs whose measured step times differ by more than
``--gap`` (5%) and how many the prediction orders the same way; schedule pairs (two rows of one job that differ
in schedule, among 1F1B, interleaved, ZB-1p, ZB-2p, ZB-V and DualPipeV) ordered as measured; the Spearman rank
correlation of tokens/s per GPU; and why rows were not expressed: the first error (``not_expressed``) and
every feature a row lacks (``blockers``: a GPU or model without a preset, a strategy key or schedule). Compiled Programs are cached by (model,
strategy, batch, sequence), so a thousand rows run in minutes; progress goes to stderr.

``--model-kind flops`` predicts with the FLOPs-at-one-efficiency compute model; ``--files`` picks CSVs by name;
``--set key=value,...`` changes cost-model fields on every row's preset; ``--table`` prints a readable table
instead of JSON.

Usage: python benchmarks/fidelity_published.py [--files zerobubble,llmfoundry] [--rows 0,3] [--limit N]
       [--cost-model F] [--set key=value,...] [--model-kind shape|flops] [--gap 0.05] [--table]
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd

from parashift import cluster as clusters, models
from parashift.errors import ParashiftError
from parashift.ir import compile as ir_compile
from parashift.sim import CostModel, simulate
from parashift.strategy import Strategy

DATA = Path(__file__).resolve().parents[1] / "traces" / "published"
COLUMNS = ("source", "name", "model", "strategy", "global_batch", "seq_len", "gpus", "cluster", "step_seconds")
OPTIONAL = ("job", "schedule", "precision", "framework", "derived")
# the schedules whose pairwise order is reported, by the names rows and strategies use
SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved", "interleaved": "interleaved", "zb-1p": "ZB-1p",
             "zb-2p": "ZB-2p", "zb-v": "ZB-V", "dualpipev": "DualPipeV"}


def load(files: str = "") -> pd.DataFrame:
    """Published rows (columns :data:`COLUMNS` and :data:`OPTIONAL`, plus any others a file has) of every CSV,
    or of those whose name contains one of the comma-separated ``files``. A missing ``job`` is the row's
    (model, GPUs, batch, sequence); other missing optional columns are empty."""
    frames = []
    for p in sorted(DATA.glob("*.csv")):
        if files and not any(f in p.name for f in files.split(",")):
            continue
        df = pd.read_csv(p, dtype={c: str for c in OPTIONAL}, keep_default_na=False, na_values={"step_seconds": [""]})
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise SystemExit(f"{p}: missing columns {missing}")
        for c in OPTIONAL:
            if c not in df.columns:
                df[c] = ""
        default_job = df.model.astype(str) + "/" + df.gpus.astype(str) + "gpu/gbs" + df.global_batch.astype(str) \
            + "/seq" + df.seq_len.astype(str)
        df["job"] = df.job.where(df.job != "", default_job)
        frames.append(df.assign(file=p.name))
    if not frames:
        return pd.DataFrame(columns=[*COLUMNS, *OPTIONAL, "file"])
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


def schedule_of(row: pd.Series) -> str:
    """The row's schedule as :data:`SCHEDULES` names it ('' when none applies): the ``schedule`` column, else the
    strategy's (when it parses and has a pipeline)."""
    raw = str(row.get("schedule", "") or "").strip().lower()
    if not raw:
        try:
            s = Strategy.parse(row.strategy)
        except ParashiftError:
            return ""
        raw = s.schedule if s.pp > 1 else ""
    return SCHEDULES.get(raw, raw)


class Predictor:
    """Compiles and simulates rows, caching Programs by (model, strategy, batch, sequence) and results by cluster."""

    def __init__(self, cost: "CostModel | None" = None, kind: str = "shape", changes: "dict | None" = None):
        self.cost, self.kind, self.changes = cost, kind, changes or {}
        self.programs: dict = {}
        self.results: dict = {}

    def _cost(self, cl) -> CostModel:
        cm = self.cost or CostModel.for_cluster(cl)
        if self.changes:
            cm = cm.replace(**self.changes)
        return cm.replace(compute_model="flops") if self.kind == "flops" else cm

    def __call__(self, row: pd.Series) -> dict:
        """``predicted_s`` and timings, or ``reason`` (stage: message) where the row cannot be expressed."""
        stage = "model"
        try:
            model = models.get(row.model)
            stage = "strategy"
            strategy = Strategy.parse(row.strategy)
            stage = "cluster"
            cl = clusters.get(row.cluster)
            if strategy.world != int(row.gpus):
                return {"reason": f"strategy: {strategy.world} ranks, the row says {row.gpus} GPUs"}
            stage = "compile"
            key = (str(row.model), str(row.strategy), int(row.global_batch), int(row.seq_len))
            t0 = time.perf_counter()
            prog = self.programs.get(key)
            if prog is None:
                prog = self.programs[key] = ir_compile(model, strategy, global_batch=key[2], seq_len=key[3])
            t1 = time.perf_counter()
            stage = "simulate"
            rkey = (key, str(row.cluster))
            res = self.results.get(rkey)
            if res is None:
                res = self.results[rkey] = simulate(prog, cl, self._cost(cl), model=model)
            t2 = time.perf_counter()
        except ParashiftError as e:
            return {"reason": f"{stage}: {type(e).__name__}: {e}"}
        return {"predicted_s": res.step_time, "compile_s": t1 - t0, "simulate_s": t2 - t1, "mfu": res.mfu,
                "bubble_fraction": res.bubble_fraction}


def blockers(row: pd.Series) -> "list[str]":
    """Every feature that keeps a row from being expressed, not only the first: the model or cluster that has no
    preset, and each strategy item the parser rejects (an unknown key, flag or schedule), found by dropping
    rejected items until the rest parses. Short names, so rows count together: ``cluster a100-40gb``,
    ``strategy precision``, ``schedule zb-v``, ``model gpt-oss-120b``."""
    out = []
    for kind, get, text in (("model", models.get, str(row.model)), ("cluster", clusters.get, str(row.cluster))):
        try:
            get(text)
        except ParashiftError:
            out.append(f"{kind} {re.sub(r'-[0-9]+x[0-9]+$', '', text.split(':')[0])}")
    items = [t.strip() for t in str(row.strategy).split(",") if t.strip()]
    for _ in range(len(items) + 1):
        try:
            Strategy.parse(",".join(items))
            break
        except ParashiftError as e:
            quoted = re.findall(r"'([^']+)'", str(e))
            bad = [t for t in items if quoted and (t == quoted[0] or t.split("=")[0] == quoted[0]
                                                   or t.partition("=")[2] == quoted[0])]
            if not bad:
                out.append(f"strategy {str(e).split(';')[0][:80]}")
                break
            for t in bad:
                key, _, val = t.partition("=")
                out.append(f"schedule {val}" if key == "schedule" else f"strategy {key}")
                items.remove(t)
    return out


def evaluate(df: pd.DataFrame, predictor: "Predictor | None" = None, progress: bool = True) -> pd.DataFrame:
    """One result per row: measured and predicted seconds, signed error, or the reason it is not expressed."""
    predictor = predictor or Predictor()
    out, t0 = [], time.perf_counter()
    for i, (_, row) in enumerate(df.iterrows()):
        if progress and (i % 25 == 0 or i == len(df) - 1):
            print(f"fidelity_published: {i + 1}/{len(df)} ({time.perf_counter() - t0:.0f} s) {row.file}: {row['name']}",
                  file=sys.stderr, flush=True)
        p = predictor(row)
        meas = float(row.step_seconds)
        rec = {"name": row["name"], "file": row.file, "source": row.source, "job": row.job,
               "schedule": schedule_of(row), "precision": row.precision, "strategy": row.strategy,
               "cluster": row.cluster, "gpus": int(row.gpus),
               "tokens_per_gpu": int(row.global_batch) * int(row.seq_len) / int(row.gpus), "measured_s": meas}
        if "reason" in p:
            rec.update(expressed=False, reason=p["reason"], blockers=blockers(row) or [_reason_kind(p["reason"])])
        else:
            err = p["predicted_s"] / meas - 1
            rec.update(expressed=True, predicted_s=p["predicted_s"], ape=abs(err), signed_error=err,
                       predicted_mfu=p["mfu"], bubble_fraction=p["bubble_fraction"], compile_s=p["compile_s"],
                       simulate_s=p["simulate_s"])
        out.append(rec)
    return pd.DataFrame(out)


def pairs(res: pd.DataFrame, gap: float = 0.05, schedules: bool = False) -> dict:
    """Within-job pairs whose measured times differ by more than ``gap`` (relative to the faster), and how many
    of those both expressed the prediction orders the same way. ``schedules``: only pairs of two different
    schedules of :data:`SCHEDULES` (every pair counted, with ``by_pair`` per schedule pair). Two rows with the same
    strategy and cluster (runs that differ only in what no strategy states, such as torch.compile) are one plan
    to the simulator: they are left out and counted apart."""
    measured = expressed = right = same = 0
    by_pair: dict = {}
    for _, g in res.groupby("job", sort=False):
        for (_, a), (_, b) in itertools.combinations(g.iterrows(), 2):
            if (a.strategy, a.cluster) == (b.strategy, b.cluster):
                same += 1     # one plan, differing in what no strategy states (a compiler, a release)
                continue
            if schedules:
                sa, sb = a.schedule, b.schedule
                if sa == sb or sa not in SCHEDULES.values() or sb not in SCHEDULES.values():
                    continue
            elif max(a.measured_s, b.measured_s) / min(a.measured_s, b.measured_s) - 1 <= gap:
                continue
            measured += 1
            if not (a.expressed and b.expressed):
                continue
            expressed += 1
            ok = bool(np.sign(a.predicted_s - b.predicted_s) == np.sign(a.measured_s - b.measured_s))
            right += ok
            if schedules:
                k = " vs ".join(sorted((a.schedule, b.schedule)))
                d = by_pair.setdefault(k, {"pairs": 0, "ordered_right": 0})
                d["pairs"] += 1
                d["ordered_right"] += ok
    out = {"pairs_measured": measured, "pairs_expressed": expressed, "ordered_right": right,
           "fraction_right": right / expressed if expressed else None, "same_plan_pairs_left_out": same}
    if schedules:
        out["by_pair"] = by_pair
    else:
        out["gap"] = gap
    return out


def summary(res: pd.DataFrame, gap: float = 0.05) -> dict:
    """Rows, rows expressed, error figures, pair ordering and the reasons rows were not expressed."""
    ex = res[res.expressed] if len(res) else res
    out: dict = {"rows": len(res), "rows_expressed": len(ex)}
    if len(ex):
        se = ex.signed_error.to_numpy(dtype=float)
        tok = ex.tokens_per_gpu.to_numpy(dtype=float)
        out.update(median_ape=float(np.median(np.abs(se))), mean_ape=float(np.mean(np.abs(se))),
                   worst_ape=float(np.max(np.abs(se))), mean_signed_error=float(np.mean(se)),
                   median_signed_error=float(np.median(se)), too_fast=int((se < 0).sum()), too_slow=int((se > 0).sum()),
                   spearman_tokens_per_gpu=spearman(tok / ex.measured_s.to_numpy(), tok / ex.predicted_s.to_numpy()))
    out["within_job_pairs"] = pairs(res, gap)
    out["schedule_pairs"] = pairs(res, gap, schedules=True)
    if len(res) > len(ex):
        left = res[~res.expressed]
        out["not_expressed"] = {k: int(v) for k, v in left.reason.map(_reason_kind).value_counts().items()}
        counts = pd.Series([b for bs in left.blockers for b in bs]).value_counts()
        out["blockers"] = {k: int(v) for k, v in counts.items()}
    return out


def _reason_kind(reason: str) -> str:
    """A reason cut to its stage and the first clause of its innermost message, so equal causes count together."""
    stage, _, msg = reason.partition(": ")
    msg = msg.rsplit(": ", 1)[-1]
    return re.sub(r"-[0-9]+x[0-9]+'", "-NxM'", f"{stage}: {msg.split(';')[0][:90]}")


def report(res: pd.DataFrame, gap: float = 0.05) -> dict:
    """The whole report: overall, per source file, per row."""
    by_file = {f: summary(g, gap) for f, g in res.groupby("file", sort=True)}
    return {"overall": summary(res, gap), "by_file": by_file,
            "aim": {"median_ape": 0.05, "within_job_pairs_right": 0.95, "schedule_pairs_right": 1.0},
            "per_row": json.loads(res.to_json(orient="records"))}


def table(rep: dict) -> str:
    """A readable per-source table of :func:`report`."""
    head = "| source | rows | expressed | median APE | mean signed | too fast/slow | job pairs >gap right | schedule pairs right |"
    lines = [head, "|" + "---|" * 8]
    for name, s in [*rep["by_file"].items(), ("overall", rep["overall"])]:
        jp, sp = s["within_job_pairs"], s["schedule_pairs"]
        pct = (lambda v: f"{100 * v:.1f}%" if v is not None else "-")
        lines.append(f"| {name} | {s['rows']} | {s['rows_expressed']} | {pct(s.get('median_ape'))} | "
                     f"{pct(s.get('mean_signed_error'))} | {s.get('too_fast', 0)}/{s.get('too_slow', 0)} | "
                     f"{jp['ordered_right']}/{jp['pairs_expressed']} (of {jp['pairs_measured']}) | "
                     f"{sp['ordered_right']}/{sp['pairs_expressed']} (of {sp['pairs_measured']}) |")
    return "\n".join(lines)


def main(argv: "list[str] | None" = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="comma-separated row indices (default: all)")
    ap.add_argument("--limit", type=int, help="only the first N rows of each file")
    ap.add_argument("--files", default="", help="comma-separated parts of CSV names to keep (default: every file)")
    ap.add_argument("--cost-model", help="a cost model JSON instead of each cluster preset's defaults")
    ap.add_argument("--set", default="", help="cost-model fields to change on every row, key=value,...")
    ap.add_argument("--model-kind", choices=("shape", "flops"), default="shape",
                    help="compute model: shape-aware kernels (default) or FLOPs at one efficiency")
    ap.add_argument("--gap", type=float, default=0.05, help="within-job pairs count where measured times differ by more")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", default=True, help="one JSON object on stdout (default)")
    out.add_argument("--table", action="store_true", help="a readable per-source table instead of JSON")
    args = ap.parse_args(argv)
    df = load(args.files)
    if df.empty:
        raise SystemExit(f"no CSV under {DATA} matches --files {args.files!r}")
    if args.limit:
        df = df.groupby("file", sort=False).head(args.limit)
    if args.rows:
        df = df.iloc[[int(x) for x in args.rows.split(",")]]
    changes = overrides(args.set)
    cost = CostModel.load(args.cost_model) if args.cost_model else None
    t0 = time.perf_counter()
    res = evaluate(df, Predictor(cost, args.model_kind, changes))
    rep = report(res, args.gap)
    kind = "flops" if args.model_kind == "flops" or (cost is not None and cost.compute_model == "flops") else "shape"
    rep.update(model_kind=kind, cost_changes=changes, seconds=time.perf_counter() - t0)
    print(table(rep) if args.table else json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
