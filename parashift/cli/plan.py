"""`parashift plan`: plan (and verify) a live switch of the training state between two strategies."""
from __future__ import annotations

import argparse
import time

from ..units import parse_bytes
from .options import strategy_text

HELP = "plan the in-memory switch of a model's training state from one strategy to another"
OUTPUTS = {"frame": "file", "program": "file"}
ALIASES = {"--placement": "--switch-placement", "--memory-budget": "--switch-memory-budget"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-70b (see `parashift models`)")
    p.add_argument("--src", required=True, type=strategy_text, help='current strategy, e.g. "dp=4,tp=8,pp=4,zero=1"')
    p.add_argument("--dst", required=True, type=strategy_text, help='new strategy, e.g. "dp=3,tp=8,pp=5,zero=1"')
    p.add_argument("--cluster", help="cluster preset that places devices on nodes, e.g. a800-16x8 "
                                     "(default: nodes of 8 devices)")
    p.add_argument("--src-devices", help="device of each current rank, e.g. 0-127 (default: rank i on device i)")
    p.add_argument("--dst-devices", help="device of each new rank, e.g. 0-39,48-127 (default: rank i on device i)")
    p.add_argument("--switch-placement", dest="placement", choices=("keep", "given"), default="keep",
                   help="keep (default): order the destination devices within each node so that they keep the "
                        "most state in place; given: rank i on the i-th destination device (was --placement)")
    p.add_argument("--kinds", default=",".join(("param", "master", "exp_avg", "exp_avg_sq")),
                   help="state kinds to move (default: param,master,exp_avg,exp_avg_sq)")
    p.add_argument("--frame", help="write the plan's pieces as CSV (tensor, kind, src, dst, lo, hi, nbytes)")
    p.add_argument("--program", help="lower the plan to a switch Program and write it as JSON")
    p.add_argument("--simulate", action="store_true",
                   help="lower and simulate the switch; compare with the checkpoint-restart estimate")
    p.add_argument("--switch-memory-budget", dest="memory_budget", metavar="BYTES",
                   help="bytes of switch state each device may hold (e.g. 60GiB, 7e10); the switch is staged to "
                        "stay under it (was --memory-budget)")
    p.add_argument("--off", default="", help="lowering passes to turn off, comma-separated: "
                                             "select_sources, promote, stage, coalesce, xor_order")


_PASSES = ("select_sources", "promote", "stage", "coalesce", "xor_order")


def run(args: argparse.Namespace) -> dict:
    from .. import vps
    from ..cluster import format_devices
    from ..errors import PlanError

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds:
        raise PlanError("--kinds is empty; give state kinds such as param,master,exp_avg,exp_avg_sq")
    if args.memory_budget is not None:
        parse_bytes(args.memory_budget)   # a bad budget fails before the planning work
    bad = sorted({k.strip() for k in args.off.split(",") if k.strip()} - set(_PASSES))
    if bad:
        raise PlanError(f"--off {','.join(bad)}: unknown lowering pass; use some of {', '.join(_PASSES)}")
    t0 = time.perf_counter()
    plan = vps.plan_switch(args.model, args.src, args.dst, cluster=args.cluster, src_devices=args.src_devices,
                           dst_devices=args.dst_devices, kinds=kinds, placement=args.placement)
    plan_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        plan.verify()
        verified, problem = True, None
    except PlanError as e:   # reported, not raised: the result says what is wrong
        verified, problem = False, str(e)
    verify_seconds = time.perf_counter() - t0
    if args.frame:
        plan.to_frame().to_csv(args.frame, index=False)
    out = {"model": plan.model.name, "src": str(plan.src_strategy), "dst": str(plan.dst_strategy),
           "cluster": plan.cluster.name, "verified": verified, "plan_seconds": plan_seconds,
           "verify_seconds": verify_seconds, **plan.stats(),
           "src_devices": format_devices(plan.src_devices), "dst_devices": format_devices(plan.dst_devices)}
    if problem:
        out["problem"] = problem
    from ..vps.transition import check_fit
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    fit = check_fit(plan, device_memory(plan.cluster), budget)
    out.update({"fits": fit["fits"], "peak_bytes": fit["peak_bytes"], "peak_device": fit["peak_device"],
                "device_memory": fit["device_memory"], "memory_budget": fit["memory_budget"],
                "budget_auto": fit["budget_auto"]})
    if not fit["fits"]:
        out["fit_problem"] = fit["problem"]
    # no --switch-memory-budget: staged under the device's memory when one stage does not fit it
    auto = fit["memory_budget"] if fit["budget_auto"] and fit["stages"] else None
    if args.program or args.simulate or args.memory_budget or auto is not None:
        out.update(_lower(plan, args, budget if budget is not None else auto))
    return out


def device_memory(cluster) -> int:
    """Bytes of memory one device of ``cluster`` has: its GPU memory, or on this machine's worker
    processes (cpu) the memory still available shared among one node's processes."""
    if cluster.gpu.name == "cpu":
        from .limits import available_memory
        return available_memory() // cluster.per_node
    return int(cluster.memory)


def _lower(plan, args: argparse.Namespace, budget) -> dict:
    from ..vps import transition
    off = {k.strip(): False for k in args.off.split(",") if k.strip()}
    prog = transition.lower(plan, plan.cluster, memory_budget=budget, **off)
    prog.validate()
    meta = transition.SwitchMeta.of(prog)
    out = {"lower_seconds": meta.lower_seconds, "stages": meta.stages, "switch_messages": meta.messages,
           "collectives": dict(meta.collectives), "instructions": prog.num_instructions(),
           "memory_budget": budget}
    if args.program:
        prog.save(args.program)
        out["program"] = args.program
    if args.simulate:
        from .. import sim
        res = sim.simulate_switch(prog, plan.cluster)
        ckpt = sim.estimate_checkpoint_restart(plan.model, plan.src_strategy, plan.dst_strategy, plan.cluster)
        out.update({"switch_seconds": res.switch_time, "checkpoint_restart_seconds": ckpt.total_seconds,
                    "speedup": ckpt.total_seconds / res.switch_time if res.switch_time > 0 else float("inf"),
                    "peak_memory_max": res.peak_memory_max, "bytes_intra": res.link_bytes["intra"],
                    "bytes_inter": res.link_bytes["inter"], "sim_seconds": res.sim_seconds})
    return out


def _bytes(n: float) -> str:
    from .dialect import format_bytes
    return format_bytes(n)


def render(r: dict, args: argparse.Namespace) -> None:
    print(f"{r['model']}: {r['src']} on devices {r['src_devices']}  ->  {r['dst']} on devices {r['dst_devices']}"
          f"  ({r['cluster']})")
    print(f"  kept in place   {_bytes(r['bytes_kept'])}")
    print(f"  moved           {_bytes(r['bytes_moved'])}  (needed: {_bytes(r['bytes_needed'])}, "
          f"across nodes: {_bytes(r['bytes_inter_node'])})")
    print(f"  messages        {r['messages']} device pairs, {r['pieces']} pieces")
    status = "verified: every destination element covered exactly once" if r["verified"] else \
        f"NOT verified: {r.get('problem')}"
    print(f"  {status}")
    print(f"  planned in {r['plan_seconds']:.3f} s, verified in {r['verify_seconds']:.3f} s")
    how = "" if r["memory_budget"] is None else \
        f", staged under {_bytes(r['memory_budget'])}" + (" (automatic)" if r["budget_auto"] else "")
    print(f"  switch peak     {_bytes(r['peak_bytes'])} on device {r['peak_device']} of "
          f"{_bytes(r['device_memory'])}{how}: " + ("fits" if r["fits"] else f"DOES NOT FIT: {r['fit_problem']}"))
    if "stages" in r:
        coll = ", ".join(f"{v} {k}" for k, v in r["collectives"].items() if v) or "no collectives"
        budget = f" under a budget of {_bytes(r['memory_budget'])}" if r.get("memory_budget") is not None else ""
        print(f"  switch program  {r['stages']} stage(s){budget}, {r['switch_messages']} messages, {coll}, "
              f"{r['instructions']} instructions (lowered in {r['lower_seconds']:.3f} s)")
    if "program" in r:
        print(f"  wrote {r['program']}")
    if "switch_seconds" in r:
        print(f"  simulated switch {r['switch_seconds']:.3f} s, peak memory {_bytes(r['peak_memory_max'])} per device")
        print(f"  checkpoint-restart estimate {r['checkpoint_restart_seconds']:.1f} s  ->  "
              f"{r['speedup']:.0f}x faster in memory")
