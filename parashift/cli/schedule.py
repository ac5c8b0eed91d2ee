"""`parashift schedule`: compile a strategy's training step into a Program, validate it, plot/save it."""
from __future__ import annotations

import argparse
import time

from ..validate import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, arg_int, check_step_size
from .options import strategy_text

HELP = "compile a strategy into a per-rank Program, validate it, and plot or save it"
OUTPUTS = {"out": "file", "plot": "image"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-7b (see `parashift models`)")
    p.add_argument("--strategy", required=True, type=strategy_text, help='e.g. "dp=2,tp=2,pp=4,schedule=1f1b"')
    p.add_argument("--global-batch", type=arg_int(1, MAX_GLOBAL_BATCH), required=True, help="sequences per step")
    p.add_argument("--seq-len", type=arg_int(1, MAX_SEQ_LEN), default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--plot", metavar="PNG", help="draw the per-stage order (stage x slot) to this file")
    p.add_argument("--out", metavar="JSON", help="save the Program to this file")
    p.add_argument("--directives", action="store_true",
                   help="also print the directive list the strategy expands to (Place, Split, Replicate/Shard, "
                        "Recompute, Order: what `parashift run --model MODULE:NAME --directives` takes)")


def run(args: argparse.Namespace) -> dict:
    from .. import ir
    from ..ir.actions import stage_orders
    from ..ir.step_meta import StepMeta

    from ..strategy import Strategy
    s = Strategy.parse(args.strategy)
    check_step_size(args.global_batch, s.dp, s.mbs, s.pp)
    t0 = time.perf_counter()
    prog = ir.compile(args.model, args.strategy, global_batch=args.global_batch, seq_len=args.seq_len)
    t1 = time.perf_counter()
    prog.validate()
    t2 = time.perf_counter()
    counts: dict[str, int] = {}
    for ranks in prog.classes().values():
        rp = prog.ranks[ranks[0]]
        for ins in rp.instrs():
            counts[ins.op] = counts.get(ins.op, 0) + len(ranks)
    orders = stage_orders(prog)
    step = StepMeta.of(prog)
    out = {
        "valid": True, "model": step.name, "strategy": step.strategy,
        "schedule": step.schedule, "microbatches": step.microbatches, "ranks": prog.world,
        "distinct_programs": len(prog.classes()), "instructions": dict(sorted(counts.items())),
        "instructions_per_program": max(len(p) for p in {id(p): p for p in prog.ranks.values()}.values()),
        "compile_seconds": round(t1 - t0, 4), "validate_seconds": round(t2 - t1, 4),
        "order": {str(st): " ".join(map(str, a)) for st, a in orders.items()},
    }
    if args.directives:
        from ..ir.compile import planning_costs
        from ..ir.schedules import schedule_order
        from ..ir.user_directives import format_directives, strategy_directives
        spec = step.model
        order = schedule_order(s, step.microbatches,
                               planning_costs(spec, s, args.seq_len or spec.seq_len))   # the order compile used
        out["directives"] = format_directives(strategy_directives(s, layers=spec.layers, global_batch=args.global_batch,
                                                                  order=order)).splitlines()
    if args.out:
        prog.save(args.out)
        out["out"] = args.out
    if args.plot:
        from ..plots import plot_order
        plot_order(orders, args.plot, chunked=s.vpp > 1,
                   title=f"{step.name} {step.strategy}".strip())
        out["plot"] = args.plot
    return out


def render(result: dict, args: argparse.Namespace) -> None:
    print(f"{result['model']}  {result['strategy']}  schedule={result['schedule']}  "
          f"micro-batches={result['microbatches']}")
    print(f"valid: {result['valid']}  ranks: {result['ranks']}  distinct rank programs: "
          f"{result['distinct_programs']}  (largest {result['instructions_per_program']} instructions)")
    print("instructions: " + ", ".join(f"{k}={v}" for k, v in result["instructions"].items()))
    print(f"compile {result['compile_seconds']:.3f} s, validate {result['validate_seconds']:.3f} s")
    orders = result["order"]
    if "directives" in result:
        print("directives (what the strategy expands to):")
        for line in result["directives"]:
            print(f"  {line}" if len(line) <= 2000 else f"  {line[:2000]} ...")
    if sum(len(v) for v in orders.values()) <= 2000:
        for st, text in orders.items():
            print(f"stage {st}: {text}")
    for k in ("out", "plot"):
        if k in result:
            print(f"wrote {result[k]}")
