"""Simulator fidelity after calibration, on this machine: prints one JSON object.

Live gloo runs of tiny-gpt on ``--nprocs`` local processes. The cost model is fitted
(``parashift.calibrate.fit``; ``--host-cores``, ``--refine``, ``--p2p-posted`` turn on its
optional terms) on the measured timelines of the probe strategies FIT, then the simulator predicts the step time of the
held-out strategies HOLDOUT, which are also run live and never seen by the fit. Every strategy
runs ``--repeats`` times, interleaved with the others (so a burst of load on a shared machine
hits all of them alike), for ``--steps`` measured steps after a warm-up step; a strategy's
measured step time is the median of its steps (the slowest rank's barrier-to-end wall time).

Keys: ``median_ape`` and ``worst_ape`` (absolute percentage error of held-out step times, as
fractions), ``spearman`` (rank correlation of predicted and measured held-out step times),
``base_median_ape`` (the uncalibrated datasheet model, for comparison), ``fit_median_ape``
(step times of the strategies fitted on), ``measurement_split_half_ape`` (the measurements' own
reproducibility: median step time of the odd rounds against the even ones, median over
strategies; no prediction can be more accurate than this on a machine as noisy),
``switch_median_ape`` (live hot switches through SWITCHES: the measured transfer of each switch
Program against ``simulate_switch`` of it under the training-calibrated model, which saw no
switch; ``switch_loo_median_ape``: with SWITCH_PARAMS fitted on the other three switches; null
with ``switch_reason`` when the runtime cannot hot-switch), per-strategy rows, the fitted parameters
and step-time factors, and the machine's load average.
Target: median under 10% on CPU/gloo.

``--save F`` also writes the measurements (timelines, step and switch times) to a pickle file;
``--load F`` evaluates saved measurements with the current code instead of running anything.

Usage: python benchmarks/fidelity_bench.py [--nprocs 4] [--steps 3] [--repeats 2] [--save F | --load F]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import numpy as np

#: probes: every term the held-out strategies use (TP, DP, ZeRO collectives, pipeline send/recv, a
#: second microbatch size, split backward) on strategies that are not held out
FIT = ("dp=4", "tp=2,dp=2", "dp=2,pp=2", "pp=4", "dp=2,pp=2,zero=1", "tp=2,dp=2,zero=1", "pp=4,mbs=2",
       "dp=4,mbs=2", "pp=4,schedule=zb-h1")
HOLDOUT = ("tp=2,pp=2", "dp=4,zero=2", "dp=2,pp=2,mbs=2", "pp=4,schedule=gpipe", "dp=2,pp=2,schedule=zb-h1",
           "dp=4,zero=1")


def _log(msg: str) -> None:
    print(f"fidelity: {msg}", file=sys.stderr, flush=True)


#: what the switches are fitted on (leave-one-out): the fixed cost of a switch and the copy rate
SWITCH_PARAMS = ("link_bw.local",)
SWITCHES = (("dp=4", "tp=2,dp=2"), ("tp=2,dp=2", "dp=2,pp=2"), ("dp=2,pp=2", "pp=4"), ("pp=4", "dp=4,zero=1"))


def _measure_switches(model: str, repeats: int, global_batch: int, seq_len: int) -> dict:
    """Transfer seconds of each switch of SWITCHES, ``repeats`` live jobs switching through them
    (``{"measured": {k: [seconds, ...]}}``, or ``{"reason": why}`` when the runtime cannot)."""
    try:
        from parashift.exec.switch import run_live
    except ImportError as e:
        return {"reason": f"the runtime has no live hot switch ({e})"}
    from parashift import models
    spec = models.get(model)
    plan = [(2 * (k + 1), dst, None) for k, (_src, dst) in enumerate(SWITCHES)]
    measured: dict[int, list[float]] = {}
    try:
        for rep in range(repeats):
            res = run_live(spec, SWITCHES[0][0], steps=2 * len(SWITCHES) + 2, switches=plan,
                           global_batch=global_batch, seq_len=seq_len)
            if any(sw.get("aborted") for sw in res.switches) or len(res.switches) != len(SWITCHES):
                raise RuntimeError(f"live switches did not all complete: {res.switches}")
            for k, sw in enumerate(res.switches):
                measured.setdefault(k, []).append(sw["transfer_seconds"])
            _log(f"switch round {rep + 1}/{repeats}: "
                 + ", ".join(f"{sw['src']}->{sw['dst']} {sw['transfer_seconds'] * 1e3:.1f} ms" for sw in res.switches))
    except Exception as e:  # noqa: BLE001 - the live switch is another component; report why it is missing
        return {"reason": f"live hot switch failed: {type(e).__name__}: {e}"[:300]}
    return {"measured": measured}


def _switch_fidelity(cost_model, cluster, model: str, switches: dict) -> dict:
    """Measured transfer of each live switch Program against ``simulate_switch`` of it under the
    training-calibrated model (``switch_median_ape``), and under that model plus SWITCH_PARAMS
    fitted on the other switches (``switch_loo_median_ape``, leave-one-out)."""
    if "reason" in switches:
        return {"switch_median_ape": None, "switch_reason": switches["reason"]}
    from parashift import models
    from parashift.calibrate import ape, fit_programs
    from parashift.vps.transition import plan_live_switch
    from parashift.sim import simulate_switch
    from parashift.strategy import Strategy
    spec = models.get(model)
    measured = {int(k): v for k, v in switches["measured"].items()}
    progs, meas = [], []
    for k, (src, dst) in enumerate(SWITCHES):
        a, b = Strategy.parse(src), Strategy.parse(dst)
        progs.append(plan_live_switch(spec, a, b, tuple(range(a.world)), tuple(range(b.world))).program)
        meas.append(float(np.median(measured[k])))
    rows = []
    for k, (src, dst) in enumerate(SWITCHES):
        # leave-one-out: SWITCH_PARAMS (training never exercises them) fitted on the other switches
        others = [j for j in range(len(SWITCHES)) if j != k]
        loo, _ = fit_programs([progs[j] for j in others], [meas[j] for j in others], cluster, base=cost_model,
                              params=SWITCH_PARAMS)
        pred = simulate_switch(progs[k], cluster, cost_model).switch_time
        loo_pred = simulate_switch(progs[k], cluster, loo).switch_time
        rows.append({"src": src, "dst": dst, "measured": meas[k], "predicted": pred, "loo_predicted": loo_pred,
                     "ape": float(ape([pred], [meas[k]])[0]), "loo_ape": float(ape([loo_pred], [meas[k]])[0])})
    e = [r["ape"] for r in rows]
    e1 = [r["loo_ape"] for r in rows]
    return {"switch_median_ape": float(np.median(e)), "switch_worst_ape": float(np.max(e)),
            "switch_loo_median_ape": float(np.median(e1)), "switch_loo_worst_ape": float(np.max(e1)),
            "switches": rows}


def _load(path: str) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-gpt")
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--fit", default=";".join(FIT), help='strategies to fit on, ";"-separated')
    ap.add_argument("--holdout", default=";".join(HOLDOUT), help='strategies to predict, ";"-separated')
    ap.add_argument("--save", default=None, help="also write the measurements (timelines, step and switch "
                                                 "times) to this pickle file")
    ap.add_argument("--load", default=None, help="evaluate measurements saved by --save instead of running")
    ap.add_argument("--no-switch", action="store_true", help="skip the live hot switches")
    ap.add_argument("--host-cores", type=float, default=0.0,
                    help="fit with the processes sharing this many cores (0, the default: not modeled)")
    ap.add_argument("--refine", action="store_true", help="fit time scales to the probes' step times too")
    ap.add_argument("--p2p-posted", action="store_true", help="simulate send/recv as posted (the runtime's way)")
    args = ap.parse_args(argv)

    from parashift import cluster as clusters, models
    from parashift.calibrate import ape, fit, spearman
    from parashift.calibrate.probe import ProbeRun, run_probe
    from parashift.ir import compile as ir_compile
    from parashift.sim import CostModel, simulate
    from parashift.strategy import Strategy

    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    spec = models.get(args.model)
    cl = clusters.get("cpu-local")
    seq = args.seq_len or spec.seq_len
    fit_set = [s for s in args.fit.split(";") if s]
    hold_set = [s for s in args.holdout.split(";") if s]
    strategies = {s: Strategy.parse(s).validate(spec) for s in fit_set + hold_set}
    bad = [s for s, st in strategies.items() if st.world != args.nprocs]
    if bad:
        raise SystemExit(f"strategies {bad} do not use --nprocs={args.nprocs} processes; pass --fit/--holdout")
    programs = {s: ir_compile(spec, st, global_batch=args.global_batch, seq_len=seq) for s, st in strategies.items()}
    saved = _load(args.load) if args.load else None
    runs: dict[str, list] = {s: [] for s in programs}
    if saved is not None:
        for s in programs:
            if s not in saved["runs"]:
                raise SystemExit(f"{args.load} has no measurements of {s}")
            runs[s] = [ProbeRun(strategies[s], programs[s], tl, tuple(ts)) for tl, ts in saved["runs"][s]]
    for rep in range(args.repeats if saved is None else 0):
        order = fit_set + hold_set if rep % 2 == 0 else list(reversed(fit_set + hold_set))
        for s in order:
            r = run_probe(programs[s], steps=args.steps)
            runs[s].append(r)
            _log(f"round {rep + 1}/{args.repeats} {s}: {r.step_time * 1e3:.1f} ms/step")
    if saved is not None:
        switches = saved["switches"]
    elif args.no_switch:
        switches = {"reason": "skipped (--no-switch)"}
    else:
        switches = _measure_switches(spec.name, args.repeats, args.global_batch, seq)
    if args.save:
        with open(args.save, "wb") as fh:
            pickle.dump({"runs": {s: [(r.timeline, list(r.step_times)) for r in rs] for s, rs in runs.items()},
                         "switches": switches}, fh)
    measured = {s: float(np.median([t for r in rs for t in r.step_times])) for s, rs in runs.items()}
    # the measurement's own reproducibility: median step time of the odd rounds against the even ones
    halves = {s: [float(np.median([t for r in rs[i::2] for t in r.step_times])) for i in (0, 1)]
              for s, rs in runs.items() if len(rs) >= 2}
    noise = [abs(a / b - 1.0) for a, b in halves.values()]

    _log("fitting")
    tls = [r.timeline for s in fit_set for r in runs[s]]
    progs = [programs[s] for s in fit_set for _ in runs[s]]
    f = fit(tls, cl, programs=progs, steps=False, host_cores=args.host_cores or None, refine=args.refine,
            p2p_posted=args.p2p_posted)
    base = CostModel.for_cluster(cl)
    pred = {s: simulate(p, cl, f.cost_model).step_time for s, p in programs.items()}
    base_pred = {s: simulate(p, cl, base).step_time for s, p in programs.items()}

    m_h = [measured[s] for s in hold_set]
    e = ape([pred[s] for s in hold_set], m_h)
    eb = ape([base_pred[s] for s in hold_set], m_h)
    ef = ape([pred[s] for s in fit_set], [measured[s] for s in fit_set])
    rows = [{"strategy": s, "set": "fit" if s in fit_set else "holdout", "measured": measured[s],
             "predicted": pred[s], "base_predicted": base_pred[s], "ape": float(ape([pred[s]], [measured[s]])[0]),
             "run_medians": [r.step_time for r in runs[s]]}
            for s in fit_set + hold_set]
    out = {"model": spec.name, "cluster": cl.name, "nprocs": args.nprocs, "steps": args.steps,
           "repeats": args.repeats, "median_ape": float(np.median(e)), "worst_ape": float(np.max(e)),
           "spearman": spearman([pred[s] for s in hold_set], m_h), "base_median_ape": float(np.median(eb)),
           "base_spearman": spearman([base_pred[s] for s in hold_set], m_h),
           "fit_median_ape": float(np.median(ef)), "instr_median_ape": f.median_ape,
           "measurement_split_half_ape": float(np.median(noise)) if noise else None,
           **_switch_fidelity(f.cost_model, cl, spec.name, switches),
           "strategies": rows,
           "params": {r.name: r.fitted for r in f.params.itertuples()}, "step_factors": f.step_factors,
           "p2p_posted": f.cost_model.p2p_posted, "host_cores": f.cost_model.host_cores,
           "load_average": [load0, os.getloadavg()[0]], "seconds": time.perf_counter() - t0}
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
