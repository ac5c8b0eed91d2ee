"""``parashift run --switch-at STEP:STRATEGY[:DEVICES]``: a live job that hot-switches (parsing,
the run, and its summary)."""
from __future__ import annotations

import os
import sys

from .. import models
from ..cluster import parse_devices
from ..errors import RuntimeFailure, StrategyError
from ..exec.switch import run_live, step_times
from ..strategy import Strategy
from ..units import parse_bytes
from .options import resolve_device

__all__ = ["parse_switch_at", "run_cli", "render_cli"]


def parse_switch_at(text: str) -> tuple[int, Strategy, tuple[int, ...] | None]:
    """``STEP:STRATEGY[:DEVICES]`` -> (step, strategy, devices or None)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0].strip().isdigit():
        raise StrategyError(f"--switch-at {text!r} is not STEP:STRATEGY[:DEVICES]; e.g. 10:tp=2,dp=2 or "
                            f"10:dp=3:0,1,2")
    step = int(parts[0])
    strategy = Strategy.parse(parts[1])
    devices = parse_devices(parts[2]) if len(parts) == 3 and parts[2].strip() else None
    if devices is not None and len(devices) != strategy.world:
        raise StrategyError(f"--switch-at {text!r}: strategy {strategy} runs {strategy.world} ranks but "
                            f"{len(devices)} devices are listed; list exactly {strategy.world} device ids")
    return step, strategy, devices


def run_cli(args) -> dict:
    """``parashift run ... --switch-at STEP:STRATEGY[:DEVICES]``: a live job that hot-switches."""
    from ..exec.train import TokenData, with_precision
    spec = with_precision(models.get(args.model), args.train["precision"])
    data = TokenData(args.data, args.data_seed) if getattr(args, "data", None) else None
    s0 = Strategy.parse(args.strategy)
    if args.nprocs is not None and args.nprocs != s0.world:
        raise StrategyError(f"strategy {s0} needs {s0.world} processes, not --nprocs {args.nprocs}; "
                            f"drop --nprocs or change the strategy")
    switches = [parse_switch_at(x) for x in args.switch_at]

    def progress(step: int, loss: float) -> None:
        if not args.json and not log.bar:
            print(f"step {step + 1}/{args.steps}  loss {loss:.6f}", file=sys.stderr, flush=True)
    budget = getattr(args, "switch_memory_budget", None)
    if budget:
        budget = parse_bytes(budget)
    log = _metrics_log(args, spec)
    weights = None
    if str(args.model).strip()[:3].lower() == "hf:":   # a Hugging Face model's own weights
        from ..exec.hf import weights_folder
        weights = weights_folder(str(args.model).strip()[3:])
    export = getattr(args, "export_hf", None)
    if export:          # refused before any process starts when the model has no exact Hugging Face config
        from ..exec.checkpoint import CheckpointOptions
        CheckpointOptions(export_hf=export).check(spec, args.steps)
    try:
        res = run_live(spec, s0, steps=args.steps, switches=switches, global_batch=args.global_batch,
                       seq_len=args.seq_len or spec.seq_len, optim=args.optim, timeout=args.timeout,
                       notice=getattr(args, "switch_notice", 3), memory_budget=budget or None,
                       placement=getattr(args, "switch_placement", "keep"), progress=progress,
                       device=resolve_device(args), cluster=getattr(args, "switch_cluster", None), data=data,
                       weights=weights, export_hf=export, metrics=log)
    finally:
        log.close()
    aborted = [s for s in res.switches if s.get("aborted")]
    out = {"model": spec.name, "strategy": str(s0), "nprocs": s0.world, "schedule": None, **res.to_json(),
           "step_times": step_times(res),
           "switches": [{k: s[k] for k in ("step", "src", "dst", "seconds", "pause_seconds", "plan_seconds",
                                           "world_seconds", "transfer_seconds", "verify_seconds",
                                           "rebuild_seconds", "bytes_moved", "peak_bytes", "stages",
                                           "released_bytes", "src_devices", "dst_devices", "fits",
                                           "planned_peak_bytes", "device_memory", "memory_budget", "budget_auto")}
                        | ({"aborted": s["aborted"]} if s.get("aborted") else {}) for s in res.switches]}
    if aborted:   # a rolled-back switch ends the schedule: the later switches are reported, not dropped
        done, first = {s["step"] for s in res.switches}, min(s["step"] for s in aborted)
        out["skipped_switches"] = [
            {"step": st, "dst": str(dst), "reason": f"the switch at step {first} was rolled back; the job trained "
                                                    f"on in its old layout and did not attempt later switches"}
            for st, dst, _ in sorted(switches, key=lambda x: x[0]) if st > first and st not in done]
    if getattr(args, "trace", None):
        res.to_chrome_trace(args.trace)
        out["timeline"] = args.trace
    out["train"] = args.train
    if export:
        out["export_hf"] = os.path.abspath(export)
    if data is not None:
        out["data"] = args.data
    out["tokens"] = [args.global_batch * (args.seq_len or spec.seq_len)] * len(res.losses)
    if getattr(args, "metrics", None):
        out["metrics"] = args.metrics
    out["warnings"] = out.get("warnings", []) + log.notes
    if len(res.losses) < args.steps:
        why = aborted[0]["aborted"] if aborted else "a process failed"
        raise RuntimeFailure(f"the live job stopped after {len(res.losses)} of {args.steps} steps: {why}")
    return out


def _metrics_log(args, spec):
    """The per-step metrics sink of a live job (steps of every layout, switches included)."""
    from ..exec.metrics import MetricsLog
    tokens = args.global_batch * (args.seq_len or spec.seq_len)
    return MetricsLog(args.steps, tokens, path=getattr(args, "metrics", None),
                      tensorboard=getattr(args, "tensorboard", None), bar=not args.json)


def render_cli(result: dict) -> None:
    """Human-readable summary of :func:`run_cli`'s result."""
    start = (result.get("resumed") or {}).get("step", 0)
    print(f"{result['model']} live job: {result['strategy']} on {result['nprocs']} processes, "
          f"{len(result['losses'])} steps" + (f" (steps {start}-{start + len(result['losses']) - 1}, resumed from "
                                                f"the snapshot of step {start})" if start else ""))
    print(f"  loss          {result['losses'][0]:.6f} -> {result['losses'][-1]:.6f}")
    if result.get("timeline"):
        print(f"  timeline      {result['timeline']}")
    for s in result["switches"]:
        if s.get("cause") == "failure":      # a multi-host job's recovery from a lost host
            print(f"  step {s['step']:>4}: devices {_devs(s['lost_devices'])} lost at step {s['failed_at']}: "
                  f"{s['src']} on {_devs(s['src_devices'])} -> {s['dst']} on {_devs(s['dst_devices'])}, recovered "
                  f"from {s['recovered_from']}, {s['steps_lost']} steps lost, pause {s['pause_seconds'] * 1e3:.0f} ms")
            continue
        cause = f" ({s['cause']})" if s.get("cause") else ""
        if "plan_seconds" not in s:          # planned, never begun
            print(f"  step {s['step']:>4}{cause}: {s['src']} on {_devs(s['src_devices'])} -> {s['dst']} on "
                  f"{_devs(s['dst_devices'])}  ABORTED: {s.get('aborted', 'never began')}")
            continue
        tag = f"  ABORTED: {s['aborted']}" if s.get("aborted") else ""
        between = f" ({s['bytes_between_hosts'] / 2**20:.1f} between hosts)" if s.get("bytes_between_hosts") else ""
        print(f"  step {s['step']:>4}{cause}: {s['src']} on {_devs(s['src_devices'])} -> {s['dst']} on "
              f"{_devs(s['dst_devices'])}  pause {s['pause_seconds'] * 1e3:.0f} ms of "
              f"{s['seconds'] * 1e3:.0f} ms (plan {s['plan_seconds'] * 1e3:.0f}, world {s['world_seconds'] * 1e3:.0f}, "
              f"transfer {s['transfer_seconds'] * 1e3:.0f}, verify {s['verify_seconds'] * 1e3:.0f}, "
              f"rebuild {s['rebuild_seconds'] * 1e3:.0f})  "
              f"{s['bytes_moved'] / 2**20:.1f} MiB moved{between}, peak {s['peak_bytes'] / 2**20:.1f} MiB/process"
              + (f", {s['stages']} stages freeing {s['released_bytes'] / 2**20:.1f} MiB of old state"
                 if s["stages"] > 1 else "")
              + ("" if s["fits"] else f"  DOES NOT FIT: planned peak {s['planned_peak_bytes'] / 2**20:.1f} MiB of "
                                      f"{s['device_memory'] / 2**20:.1f} MiB/process") + tag)
    for s in result.get("skipped_switches", []):
        print(f"  step {s['step']:>4}: -> {s['dst']}  SKIPPED: {s['reason']}")


def _devs(devices: list[int]) -> str:
    """Devices in rank order, as ``[0,2,1,3]``."""
    return "[" + ",".join(str(d) for d in devices) + "]"
