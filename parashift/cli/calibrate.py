"""`parashift calibrate`: run probe strategies live, fit the simulator's cost model, write it as JSON."""
from __future__ import annotations

import argparse
import sys
import time

from ..validate import arg_float, arg_int
from .limits import MAX_LOCAL_PROCS, check_memory
from .options import add_batch_options, load_cost_model

HELP = "run a few probe strategies live, fit the simulator's cost model to their timelines, write it as JSON"
OUTPUTS = {"out": "file", "save_timelines": "dir"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=arg_int(1, 64), default=4, help="how many probe strategies to run (default 4)")
    p.add_argument("--model", default="tiny-gpt", help="model preset the runtime can train (default tiny-gpt)")
    p.add_argument("--nprocs", type=arg_int(1, MAX_LOCAL_PROCS), default=4, help="local processes per probe (default 4)")
    p.add_argument("--steps", type=arg_int(1, 10_000), default=3, help="measured steps per probe, after one warm-up step")
    add_batch_options(p, live=True)
    p.add_argument("--strategies", help='probe strategies separated by ";" (default: a diverse built-in set)')
    p.add_argument("--cluster", default="cpu-local", help="cluster preset of this machine (default cpu-local)")
    p.add_argument("--base", help="cost model JSON to start from (default: the cluster's datasheet model)")
    p.add_argument("--save-timelines", metavar="DIR", help="also write each probe's measured timeline (parquet) "
                   "and Program (JSON)")
    p.add_argument("--from-timelines", metavar="DIR", help="fit timelines written by --save-timelines instead of "
                   "running probes")
    p.add_argument("--host-cores", type=arg_float(0, 1e6), default=0.0,
                   help="model the probe processes as sharing this many CPU cores (a start value --refine "
                        "fits; default 0: not modeled)")
    p.add_argument("--refine", action="store_true",
                   help="also fit time scales of compute and communication to the probes' step times, "
                        "simulating them (fits the probes closely; held-out strategies may not gain)")
    p.add_argument("--measured", metavar="CSV", help="fit a table of measured runs on --cluster instead of probing "
                   "(columns model, strategy, global_batch, seq_len, step_seconds); see parashift.calibrate.measured")
    p.add_argument("--holdout", action="store_true", help="with --measured: also predict each row from a fit on "
                   "the other rows (one fit per row), the check of how well the fit generalizes")
    p.add_argument("--out", required=True, help="where to write the fitted cost model (JSON)")


def _progress(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


def _probe(args: argparse.Namespace, spec) -> list:
    from ..calibrate import CalibrationError
    from ..calibrate.probe import probe_strategies, run_probes
    from ..strategy import Strategy
    if args.strategies:
        strategies = [Strategy.parse(s).validate(spec) for s in args.strategies.split(";") if s.strip()]
        if not strategies:
            raise CalibrationError(f"--strategies {args.strategies!r} names no strategy; give strategies separated "
                                   f"by ';', e.g. 'dp=4;tp=2,dp=2', or drop --strategies")
        bad = [str(s) for s in strategies if s.world != args.nprocs]
        if bad:
            raise CalibrationError(f"probe strategies {bad} do not use {args.nprocs} processes; give strategies "
                                   f"whose dp*tp*pp is --nprocs")
        strategies = strategies[:args.runs]
    else:
        strategies = probe_strategies(spec, args.nprocs, args.runs, global_batch=args.global_batch)
    _progress(f"{len(strategies)} probes of {spec.name} on {args.nprocs} processes, {args.steps} steps each")
    return run_probes(spec.name, strategies, global_batch=args.global_batch, seq_len=args.seq_len,
                      steps=args.steps, progress=_progress)


def _save_runs(runs: list, directory: str) -> None:
    from pathlib import Path

    from ..traces.timeline import save_timeline
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for k, r in enumerate(runs):
        save_timeline(r.timeline, d / f"probe{k}.parquet")
        r.program.save(str(d / f"probe{k}.program.json"))


def _load_runs(directory: str) -> list:
    """Probe runs saved by ``--save-timelines`` (timelines and Programs; runtime step times are not kept,
    so each run's step time is its timeline's median step span)."""
    from pathlib import Path

    import numpy as np

    from ..calibrate import CalibrationError, ProbeRun
    from ..ir.program import Program
    from ..traces.timeline import load_timeline
    d = Path(directory)
    files = sorted(d.glob("probe*.parquet"), key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else 0)
    if not files:
        raise CalibrationError(f"no probe*.parquet timelines in {d}; write them with --save-timelines DIR")
    runs = []
    for f in files:
        prog = Program.load(str(f.with_suffix("").with_suffix(".program.json")))
        tl = load_timeline(f)
        span = tl.groupby("step").apply(lambda g: g["end"].max() - g["start"].min(), include_groups=False)
        runs.append(ProbeRun(prog.strategy, prog, tl, tuple(float(x) for x in np.atleast_1d(span.to_numpy()))))
    _progress(f"{len(runs)} saved probes from {d}")
    return runs


def run(args: argparse.Namespace) -> dict:
    from .. import cluster as clusters, models
    from ..calibrate import CalibrationError, fit
    from ..sim import CostModel

    if args.holdout and not args.measured:
        raise CalibrationError("--holdout applies to --measured tables; probe calibration always holds each "
                               "probe out (see its verdict)")
    if args.measured:
        from ..calibrate.measured import run_measured
        return run_measured(args, _progress)
    if args.runs < 1 or args.steps < 1 or args.nprocs < 1:
        raise CalibrationError("--runs, --steps and --nprocs must be at least 1")
    spec = models.get(args.model)
    cl = clusters.get(args.cluster)
    base = load_cost_model(args.base) or CostModel.for_cluster(cl)
    if args.from_timelines is None:
        check_memory(spec, args.global_batch, args.seq_len or spec.seq_len, "a probe")
    t0 = time.perf_counter()
    if args.from_timelines:
        runs = _load_runs(args.from_timelines)
    else:
        runs = _probe(args, spec)
        if args.save_timelines:
            _save_runs(runs, args.save_timelines)
    _progress("fitting")
    cores = args.host_cores
    if cores < 0:
        raise CalibrationError(f"--host-cores must be 0 (no sharing) or a positive core count, got {cores}")
    f = fit([r.timeline for r in runs], cl, programs=[r.program for r in runs], base=base,
            host_cores=cores or None, refine=args.refine)
    f.cost_model.save(args.out)
    summ = f.summary()
    pred = dict(zip(f.steps["source"], f.steps["predicted"])) if len(f.steps) else {}
    probes = [{"strategy": str(r.strategy), "step_time": r.step_time, "predicted_step_time": pred.get(k),
               "base_predicted_step_time": dict(zip(f.steps["source"], f.steps["base_predicted"])).get(k)}
              for k, r in enumerate(runs)]
    _progress("held-out check (leave one probe out)")
    from ..calibrate.verdict import holdout_verdict
    verdict = holdout_verdict(runs, cl, base=base, host_cores=cores or None, refine=args.refine)
    return {"out": args.out, "model": spec.name, "cluster": cl.name, "nprocs": max(r.program.world for r in runs),
            "verdict": verdict.to_json() if verdict is not None else
            {"ok": None, "text": "verdict: one probe only, nothing to hold out; run --runs 2 or more"},
            "median_ape": summ["median_ape"], "step_median_ape": summ["step_median_ape"],
            "per_op": summ["per_op"], "params": summ["params"], "probes": probes,
            "samples": summ["samples"], "dropped": summ["dropped"], "step_factors": summ["step_factors"],
            "host_cores": f.cost_model.host_cores, "p2p_posted": f.cost_model.p2p_posted,
            "seconds": time.perf_counter() - t0}


def render(result: dict, args: argparse.Namespace) -> None:
    if "measured" in result:
        from ..calibrate.measured import render_measured
        return render_measured(result)
    print(f"cost model for {result['cluster']} fitted on {len(result['probes'])} probes of {result['model']} "
          f"({result['samples']} samples, {result['seconds']:.1f} s) -> {result['out']}")
    print("  error per op kind (APE of single instructions, of their total; median APE before the fit):")
    print(f"  {'op kind':<16}{'count':>7}{'median APE':>12}{'mean APE':>10}{'total APE':>11}{'before':>9}")
    for kind, r in result["per_op"].items():
        print(f"  {kind:<16}{r['count']:>7}{r['median_ape'] * 100:>11.1f}%{r['mean_ape'] * 100:>9.1f}%"
              f"{r['total_ape'] * 100:>10.1f}%{r['base_median_ape'] * 100:>8.1f}%")
    print("  probe step times (measured / simulated):")
    for p in result["probes"]:
        sim = p["predicted_step_time"]
        print(f"    {p['strategy']:<32}{p['step_time'] * 1e3:9.1f} ms / "
              + (f"{sim * 1e3:.1f} ms" if sim is not None else "-"))
    if result.get("step_factors"):
        print("  step-time refinement (factor per scale): "
              + ", ".join(f"{k} {v:.3g}" for k, v in result["step_factors"].items())
              + (f"; host cores {result['host_cores']:.3g}" if result.get("host_cores") else "")
              + ("; send/recv posted" if result.get("p2p_posted") else ""))
    print("  fitted parameters:")
    for name, v in result["params"].items():
        print(f"    {name:<28}{v:.4g}")
    v = result["verdict"]
    for p in v.get("probes", []):
        print(f"    held out: {p['strategy']:<32}{p['measured'] * 1e3:9.1f} ms measured, "
              f"{p['held_out_predicted'] * 1e3:.1f} ms predicted by the other probes' fit, noise {p['noise'] * 100:.1f}%")
    print(f"  {v['text']}")
