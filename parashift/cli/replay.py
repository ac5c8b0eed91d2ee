"""`parashift replay`: replay a preemption trace against a live, hot-switching job."""
from __future__ import annotations

import argparse
import math
import sys

from ..validate import arg_float, arg_int
from .inputs import resolve_trace
from .limits import MAX_LOCAL_PROCS, check_memory
from .options import add_batch_options, add_cost_model, load_cost_model

HELP = ("replay a preemption/availability trace against a live job that hot-switches at every event "
        "(optionally against checkpoint-restart)")
OUTPUTS = {"plot": "image", "table": "file"}
ALIASES = {"--max-procs": "--nprocs"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="trace file or shipped trace name (e.g. bamboo/p3-trace.csv)")
    p.add_argument("--model", default="tiny-gpt", help="model preset the runtime can train (default tiny-gpt)")
    p.add_argument("--strategy-policy", dest="policy", choices=("best", "switch-aware", "dp"), default="switch-aware",
                   help="best: the best strategy per device count; switch-aware: the plan_trace dynamic program "
                        "(default); dp (with --hosts only): dp-only, the widest dp of each device count")
    p.add_argument("--nprocs", dest="max_procs", type=arg_int(1, MAX_LOCAL_PROCS), default=4,
                   help="local processes at the busiest moment (default 4; was --max-procs)")
    p.add_argument("--time-scale", type=arg_float(0, 1e9, lo_open=True), default=600.0,
                   help="trace seconds per replay second (default 600: ten trace minutes a second)")
    p.add_argument("--from", dest="start", type=arg_float(0), help="window start in trace seconds")
    p.add_argument("--to", dest="stop", type=arg_float(0), help="window end in trace seconds")
    p.add_argument("--max-events", type=arg_int(1, 100_000), help="replay only the first K events of the window")
    p.add_argument("--notice", type=arg_float(0, 1e9),
                   help="notice in trace seconds for preemptions the trace records none for (default 120, AWS)")
    p.add_argument("--devices-per-node", type=arg_float(0, MAX_LOCAL_PROCS, lo_open=True),
                   help="devices per trace node (default: max-procs / the most nodes in the window)")
    add_batch_options(p, live=True)
    p.add_argument("--max-steps", type=arg_int(1, 1_000_000), default=400, help="stop the replay after this many steps (default 400)")
    p.add_argument("--baseline", choices=("checkpoint-restart",),
                   help="also replay the same switches by DCP save, process restart and load")
    add_cost_model(p, "calibrated cost model JSON for the strategy search")
    p.add_argument("--timeout", type=arg_float(0, 7 * 86400, lo_open=True), default=900.0, help="seconds before a job is stopped (default 900)")
    p.add_argument("--hosts", action="store_true",
                   help="node-level replay: one agent per trace node on loopback (a process group of its own, "
                        "`parashift join`), SIGTERM for a preemption with notice, SIGKILL for one without, a new "
                        "agent for an addition; the job trains for --max-steps steps under the policy's "
                        "strategy per device count")
    p.add_argument("--seconds-per-step", type=arg_float(0, 1e9, lo_open=True),
                   help="with --hosts: trace seconds per training step (default: the window over --max-steps)")
    p.add_argument("--snapshot-every", type=arg_int(0, 1_000_000), default=0,
                   help="with --hosts: DCP snapshot every N steps (the restore point of a loss without replicas)")
    p.add_argument("--plot", help="write availability, switches and the loss curves (PNG)")
    p.add_argument("--table", help="write the per-event table as CSV")


def run(args: argparse.Namespace) -> dict:
    from .. import models
    from ..replay import replay
    if args.stop is not None and args.start is not None and args.stop <= args.start:
        from ..errors import TraceFormatError
        raise TraceFormatError(f"--to {args.stop:g} must be after --from {args.start:g}")
    trace = str(resolve_trace(args.trace))
    if args.hosts:
        return _run_hosts(trace, args)
    from ..errors import StrategyError
    if args.policy == "dp":
        raise StrategyError("--strategy-policy dp is for the node-level replay; add --hosts or use best or "
                            "switch-aware")
    for opt, given in (("--seconds-per-step", args.seconds_per_step is not None),
                       ("--snapshot-every", bool(args.snapshot_every))):
        if given:
            raise StrategyError(f"{opt} applies to the node-level replay; add --hosts or drop {opt}")
    cost = load_cost_model(args.cost_model)
    spec = models.get(args.model)
    check_memory(spec, args.global_batch, args.seq_len or spec.seq_len)

    def say(msg: str) -> None:
        if not args.json:
            print(f"replay: {msg}", file=sys.stderr, flush=True)

    res = replay(trace, args.model, policy=args.policy, max_procs=args.max_procs, time_scale=args.time_scale,
                 start=args.start, end=args.stop, max_events=args.max_events, baseline=args.baseline,
                 notice=args.notice, devices_per_node=args.devices_per_node, global_batch=args.global_batch,
                 seq_len=args.seq_len, cost_model=cost, max_steps=args.max_steps, timeout=args.timeout, progress=say)
    out = res.to_json()
    out["trace"] = args.trace
    if args.plot:
        out["plot"] = res.plot(args.plot)
    if args.table:
        res.to_frame().to_csv(args.table, index=False)
        out["table"] = args.table
    return out


def _run_hosts(trace: str, args: argparse.Namespace) -> dict:
    """``--hosts``: :func:`parashift.replay.hosts.replay_hosts` on the trace's window."""
    import tempfile
    from .. import traces
    from ..errors import StrategyError
    from ..replay.hosts import planned_strategies, replay_hosts
    for opt, bad in (("--baseline", args.baseline), ("--plot", args.plot), ("--table", args.table)):
        if bad:
            raise StrategyError(f"{opt} is not available with --hosts (a node-level replay); drop one of them")
    df = traces.load(trace, notice=args.notice)        # no notice given: preemptions without one are SIGKILLs
    df = traces.window(df, args.start or 0.0, args.stop)
    if args.max_events is not None:
        df = df.iloc[:args.max_events]
    dpn = args.devices_per_node or 1
    if dpn != int(dpn):
        raise StrategyError(f"--devices-per-node {dpn:g} must be a whole number with --hosts (processes per agent)")
    steps = args.max_steps
    sps = args.seconds_per_step or max(float(df.attrs["duration"]), 1e-9) / steps
    table = {} if args.policy == "dp" else planned_strategies(
        df, args.model, devices_per_node=int(dpn), global_batch=args.global_batch, policy=args.policy, cost_model=load_cost_model(args.cost_model))
    if not args.json:
        print(f"replay: {len(df)} event(s), one agent per node ({int(dpn)} process(es) each), {steps} steps of "
              f"{sps:g} trace seconds; strategy per device count ({args.policy}): "
              + (", ".join(f"{n}: {st}" for n, st in sorted(table.items())) or "dp-only"), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="parashift-snap-") as snap:
        got = replay_hosts(df, model=args.model, devices_per_node=int(dpn), steps=steps, seconds_per_step=sps,
                           global_batch=args.global_batch, snapshot_every=args.snapshot_every,
                           snapshot_dir=snap, timeout=args.timeout, strategies=table)
    job = got["job"]
    return {"trace": args.trace, "model": args.model, "hosts": True, "seconds_per_step": sps, "steps": steps,
            "devices_per_node": int(dpn), "policy": args.policy,
            "planned": {str(n): str(st) for n, st in sorted(table.items())}, "applied": got["applied"],
            "exit_codes": {str(k): v for k, v in got["exit_codes"].items()},
            "losses": job["losses"], "strategies": job["strategies"], "devices": job.get("devices"),
            "switches": job["switches"]}


def _render_hosts(result: dict) -> None:
    print(f"{result['model']} replaying {result['trace']} node by node: {len(result['losses'])} steps of "
          f"{result['seconds_per_step']:g} trace seconds, {result['devices_per_node']} process(es) a node")
    if result.get("planned"):
        print(f"  strategy per device count ({result['policy']}): "
              + ", ".join(f"{n}: {st}" for n, st in result["planned"].items()))
    for a in result["applied"]:
        print(f"  t={a['time']:8.1f}  step {a['step']:>5}  {a['event']:>7} node(s) "
              f"{','.join(map(str, a.get('nodes', [])))}" + (f"  {a['signal']}" if a.get("signal") else "")
              + (f" (notice {a['notice_seconds']:.2f} s)" if a.get("notice_seconds") is not None else "")
              + (f"; SIGKILL when it ran out: node(s) {','.join(map(str, a['ran_out']))}" if a.get("ran_out") else ""))
    for s in result["switches"]:
        how = f" from {s['recovered_from']}" if s.get("recovered_from") else ""
        print(f"  step {s['step']:>5}: {s['src']} -> {s['dst']}  ({s.get('cause', '?')}{how}"
              + (", aborted)" if s.get("aborted") else ")"))
    print(f"  loss {result['losses'][0]:.6f} -> {result['losses'][-1]:.6f}; agents' exit codes "
          + ", ".join(f"node {k}: {v}" for k, v in result["exit_codes"].items()))


def _ms(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:.0f}"


def render(result: dict, args: argparse.Namespace) -> None:
    if result.get("hosts"):
        return _render_hosts(result)
    wall = result.get("wall_seconds")
    print(f"{result['model']} replaying {result['trace']} ({result['policy']}, x{result['time_scale']:g}, "
          f"{result['devices_per_node']:g} devices/node): {result['steps']} steps in "
          + (f"{wall:.1f} s of wall clock " if wall is not None else "")
          + f"(trace window {result['duration']:.1f} s at this scale), starting on "
          f"{result['initial_devices']} devices with {result['initial_strategy']}")
    base = result.get("baseline")
    print(f"  {'event s':>7} {'done s':>7} {'lag ms':>7} {'trace t':>8} {'event':>8} {'dev':>3} {'step':>5} "
          f"{'pause ms':>8} {'lost ms':>8}" + (f" {'restart ms':>10}" if base else "") + "  strategy")
    for e in result["events"]:
        step = "-" if e.get("step") is None else str(e["step"])
        what = e["strategy"] if e["switched"] else ("(no switch)" if e["applied"] else "(not reached)")
        done = "-" if e.get("wall_time") is None else f"{e['wall_time']:7.2f}"
        print(f"  {e['time']:7.2f} {done:>7} {_ms(e.get('lag_seconds')):>7} {e['trace_time']:8.0f} {e['event']:>8} "
              f"{e['devices']:3d} {step:>5} {_ms(e['pause_seconds'] if e['switched'] else None):>8} "
              f"{_ms(e['lost_seconds'] if e['switched'] else None):>8}"
              + (f" {_ms(e.get('baseline_lost_seconds')):>10}" if base else "") + f"  {what}"
              + ("  LATE" if e.get("late") else ""))
    for f in result.get("failures", []):
        print(f"  FAILED: {f}")
    missed = sum(1 for e in result["events"] if not e["applied"])
    if missed:
        print(f"  {missed} event(s) not reached before the job stopped (window end or --max-steps {args.max_steps})")
    print(f"  loss {result['losses'][0]:.6f} -> {result['losses'][-1]:.6f}; static job "
          f"{result['static_losses'][0]:.6f} -> {result['static_losses'][-1]:.6f} "
          f"(max relative difference {result['max_loss_rel_diff']:.2e})")
    diff = ", ".join(f"{k} {v:.1e}" for k, v in result["state_difference"].items())
    print(f"  final state vs static job (max relative difference): {diff}")
    print(f"  time lost to reconfiguration: {result['lost_seconds']:.3f} s (hot switch)")
    if base:
        ratio = result.get("lost_ratio")
        print(f"                                {result['baseline_lost_seconds']:.3f} s ({base})"
              + (f"  -> {ratio:.1f}x more with {base}" if ratio else ""))
    for key in ("plot", "table"):
        if result.get(key):
            print(f"  {key}: {result[key]}")
