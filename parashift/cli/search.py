"""`parashift search`: an Optuna search of the best strategy over the simulator, with a deploy plan."""
from __future__ import annotations

import argparse
import sys

from ..validate import arg_int
from .dialect import format_bytes
from .options import (add_batch_options, add_cost_model, add_space_options, load_cost_model, positive_int,
                      space_options)
from .train_options import add_train_options

HELP = "search the fastest strategy that fits (Optuna over the simulator); write a deploy plan"
OUTPUTS = {"out": "file", "plot": "image"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-13b (see `parashift models`)")
    p.add_argument("--cluster", required=True, help="cluster preset, e.g. a800-16x8 or cpu-local")
    p.add_argument("--devices", type=positive_int, help="devices the job uses (default: all of the cluster)")
    add_batch_options(p)
    p.add_argument("--trials", type=arg_int(1, 100_000), default=100, help="Optuna trials (default 100)")
    p.add_argument("--seed", type=arg_int(0, 2**32 - 1), help="sampler seed (0 to 2^32-1), for a reproducible search")
    p.add_argument("--sampler", choices=("tpe", "random"), default="tpe", help="Optuna sampler (default tpe)")
    p.add_argument("--objective", default="throughput", choices=("throughput", "throughput,memory"),
                   help="'throughput,memory' searches the Pareto front of tokens/s against peak memory")
    p.add_argument("--storage", help="Optuna RDB storage to keep and resume the study, e.g. sqlite:///s.db")
    p.add_argument("--study-name", help="study name inside --storage (default: derived from the setting)")
    add_cost_model(p)
    add_space_options(p)
    p.add_argument("--out", help="write the best strategy's deploy plan (for `parashift run plan.json`)")
    p.add_argument("--plot", help="write the optimization history and parameter importances (PNG)")
    p.add_argument("--top", type=arg_int(1, 1000), default=5, help="strategies listed in the text output (default 5)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--all-devices", action="store_true",
                   help="only strategies that use every device (default: any count up to --devices; idle ones "
                        "are reported)")
    p.add_argument("--explain", action="store_true",
                   help="per listed strategy: step split into compute, exposed communication and bubble, peak "
                        "memory, the binding constraint and what it lost on against the winner")
    add_train_options(p)   # recorded in the --out plan, which `parashift run` trains with


def run(args: argparse.Namespace) -> dict:
    from .. import cluster as clusters, models, search
    from ..exec.train import with_precision
    from .train_options import train_settings

    train = train_settings(args, None)       # checked before the search starts; recorded in the plan
    model = with_precision(models.get(args.model), train["precision"])
    cl = clusters.get(args.cluster)
    devices = args.devices or cl.devices
    cost = load_cost_model(args.cost_model)
    study_name = args.study_name
    if args.storage and not study_name:
        study_name = f"{model.name}-{cl.name}-{devices}d-b{args.global_batch}-s{args.seq_len}-{args.objective}"
    opts = space_options(args)
    bar = None   # made at the first trial, after the storage and the space are checked

    def progress(done: int, total: int, best) -> None:
        nonlocal bar
        if bar is None and not args.no_progress:
            bar = _bar(args.trials)
            bar.update(done - 1)
        if bar is not None:
            bar.update(1)
            if best is not None:
                bar.set_postfix_str(f"best {best.tokens_per_s:,.0f} tok/s", refresh=False)

    try:
        res = search.tune(model, cl, devices=devices, global_batch=args.global_batch, seq_len=args.seq_len,
                          n_trials=args.trials, objective=args.objective, storage=args.storage,
                          study_name=study_name, seed=args.seed, cost_model=cost, sampler=args.sampler,
                          space_options=opts, all_devices=args.all_devices, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    out = res.summary()
    out.update({"model": model.name, "cluster": cl.name, "devices": devices, "study_name": res.study.study_name,
                "top": [c.to_dict() for c in res.top(args.top)]})
    if args.explain or args.json:
        out["explain"] = res.explain(args.top).to_dict(orient="records")
    if res.best is None and len(res.trials):
        why = res.trials.loc[res.trials["status"] != "ok", "reason"].astype(str).value_counts().head(3)
        out["reasons"] = [{"reason": r, "trials": int(n)} for r, n in why.items()]
    if args.out:
        res.export(args.out, train=train)
        out["out"] = args.out
    if args.plot:
        res.plot(args.plot)
        out["plot"] = args.plot
    return out


def _render_explain(rows: list[dict]) -> None:
    import pandas as pd
    df = pd.DataFrame(rows)
    table = pd.DataFrame({
        "tok/s": df["tokens_per_s"].map("{:,.0f}".format),
        "compute": df["compute"].map(_ms), "exposed comm": df["exposed_comm"].map(_ms),
        "bubble": df["bubble"].map(_ms), "peak": df["peak_memory"].map(_bytes),
        "devices": df["devices_used"], "bound by": df["binding"], "strategy": df["strategy"]})
    print("  why the winner won (each runner-up against it):")
    print("    " + table.to_string(index=False).replace("\n", "\n    "))
    for r in rows[1:]:
        print(f"    {r['strategy']}: {r['lost_on']}")


def _bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="search", unit="trial", file=sys.stderr, leave=False, dynamic_ncols=True)


_bytes = format_bytes


def _counts_line(c: dict) -> str:
    """What the trial counts mean, in one line."""
    return (f"  trials         {c['trials']}: {c['feasible']} distinct strategies fit, {c['infeasible']} do not fit "
            f"in memory, {c['invalid']} invalid points, {c['dominated']} pruned as unable to beat the best, "
            f"{c['repeats']} repeats answered from the cache; {c['simulated']} simulated (the others came from "
            "the cache or were ruled out by a memory bound before simulation)")


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.1f} ms" if x is not None else "?"


def render(result: dict, args: argparse.Namespace) -> None:
    c = result["counts"]
    print(f"{result['model']} on {result['devices']} devices of {result['cluster']}: {result['trials']} trials "
          f"({c['feasible']} feasible, {c['simulated']} simulated) in {result['search_seconds']:.1f} s")
    print(_counts_line(c))
    if result["best"] is None:
        print("  no feasible strategy found; run more trials, add devices or lower the global batch")
        for r in result.get("reasons", []):
            print(f"    {r['trials']:>4} trial(s): {r['reason']}")
    else:
        print(f"  best           {result['best']}")
        print(f"  throughput     {result['best_tokens_per_s']:,.0f} tokens/s")
        b = result["breakdown"]
        print(f"  step time      {result['best_step_time']:.4f} s = compute {_ms(b['compute'])} + exposed "
              f"communication {_ms(b['exposed_comm'])} + bubble {_ms(b['bubble'])}")
        print(f"  peak memory    {_bytes(result['best_peak_memory'])} per device; bound by {result['binding']}")
        if result.get("idle_devices"):
            print(f"  devices        uses {result['devices_used']} of {result['devices']} ({result['idle_devices']} "
                  "idle: the fastest strategy found leaves them free; --all-devices requires every device)")
    if result.get("pareto"):
        print("  Pareto front (tokens/s vs peak memory):")
        for c in result["pareto"]:
            print(f"    {c['tokens_per_s']:>14,.0f} tok/s  {_bytes(c['peak_memory']):>10}  {c['strategy']}")
    elif result["top"] and not args.explain:
        print("  top strategies:")
        for c in result["top"]:
            print(f"    {c['tokens_per_s']:>14,.0f} tok/s  {_bytes(c['peak_memory']):>10}  {c['strategy']}")
    if args.explain and result.get("explain"):
        _render_explain(result["explain"])
    for key, label in (("out", "deploy plan"), ("plot", "plot")):
        if result.get(key):
            print(f"  {label:<14} {result[key]}")
