"""``parashift run ... --live --endpoint HOST:PORT --nprocs N``: the first host of a multi-host live job."""
from __future__ import annotations

import argparse
import os

from ..errors import StrategyError
from ..validate import arg_float, arg_int
from .options import resolve_device

__all__ = ["add_host_arguments", "run_cli", "parse_strategy_for"]


def parse_strategy_for(items: list[str], spec, global_batch: int) -> tuple:
    """``N:STRATEGY`` texts -> ((N, Strategy), ...), each checked against ``spec`` and the global batch."""
    from ..strategy import Strategy
    out: dict[int, Strategy] = {}
    for text in items:
        n, sep, st = text.partition(":")
        if not sep or not n.strip().isdigit() or int(n) < 1 or not st.strip():
            raise StrategyError(f"--strategy-for {text!r} is not N:STRATEGY; e.g. 4:tp=2,dp=2")
        s = Strategy.parse(st)
        if s.world != int(n):
            raise StrategyError(f"--strategy-for {text!r}: {s} runs {s.world} devices, not {n}; give a strategy "
                                f"of world {n}")
        s.validate(spec)
        if global_batch % (s.dp * s.mbs):
            raise StrategyError(f"--strategy-for {text!r}: the global batch {global_batch} is not a multiple of "
                                f"dp x mbs = {s.dp * s.mbs}; change the strategy or --global-batch")
        out[int(n)] = s
    return tuple(sorted(out.items()))


def add_host_arguments(p: argparse.ArgumentParser, first: bool = True) -> None:
    """``--endpoint``, ``--secret-file`` (shared by ``run`` and ``join``) and ``--on-join`` (``first``: run)."""
    p.add_argument("--endpoint", metavar="HOST:PORT",
                   help="multi-host live job: serve (run) or reach (join) the job's store at this address; "
                        "with run, --nprocs is the number of processes on this host")
    p.add_argument("--store", metavar="etcd://HOST:PORT[,HOST:PORT...]",
                   help="multi-host live job: keep the job's store on this etcd cluster instead of a TCPStore on the "
                        "first host (values sealed under the job's secret alike); run still takes --endpoint (where "
                        "its liveness listener listens), join needs no --endpoint")
    p.add_argument("--secret-file", metavar="PATH",
                   help="the job's secret, in a file only you can read (mode 0600; run creates it if missing); "
                        "default: the PARASHIFT_JOB_SECRET environment variable")
    if first:
        p.add_argument("--on-join", choices=("grow", "ignore"), default="grow",
                       help="when a host joins the running job: grow (default: switch to a strategy with a wider dp "
                            "that uses its devices, a few steps later) or ignore (refuse it)")
        p.add_argument("--strategy-for", action="append", default=[], metavar="N:STRATEGY",
                       help="multi-host live job: the strategy to switch to when hosts join or leave and the job "
                            "has N devices (repeatable; e.g. 4:tp=2,dp=2 2:pp=2); for other counts the current "
                            "strategy's dp is widened or narrowed")
        p.add_argument("--heartbeat-timeout", type=arg_float(0, 86400, lo_open=True), default=None, metavar="SECONDS",
                       help="multi-host live job: declare a host lost after its heartbeat stood still this long "
                            "(default 4; agents beat 8 times a window, at most every 0.5 s). A host whose agent "
                            "process dies is declared lost at once, through its liveness connection")
        p.add_argument("--snapshot-every", type=arg_int(0, 1_000_000), default=0, metavar="STEPS",
                       help="multi-host live job: write a DCP snapshot every STEPS steps in the background; a host "
                            "lost without a surviving copy of its state restores from the newest (default 0: none)")
        p.add_argument("--snapshot-dir", default="parashift-snapshots", metavar="DIR",
                       help="where snapshots go: a directory every host reaches at the same path (a shared "
                            "filesystem; default ./parashift-snapshots)")
        p.add_argument("--resume", nargs="?", const=True, default=False, metavar="DIR",
                       help="start from the newest whole checkpoint, resharded into --strategy; training goes on "
                            "from that step to --steps. A local run: --resume DIR (a --save DIR); a multi-host live "
                            "job: the snapshots in DIR or --snapshot-dir (a job restarted after its first host was lost)")


def run_cli(args: argparse.Namespace) -> dict:
    """The first host: serve the store, wait for the agents, train, print the whole job's result."""
    from .. import models
    from ..exec.job.endpoint import read_secret
    from ..exec.job.first_host import run_first_host
    from ..exec.switch import step_times
    from ..strategy import Strategy
    from ..units import parse_bytes
    if args.switch_at:
        raise StrategyError("--switch-at is not supported with --endpoint yet (a multi-host job trains its "
                            "strategy on the hosts that joined); drop --switch-at or --endpoint")
    if args.plan:
        raise StrategyError("--endpoint runs a live job from --model/--strategy; drop the plan file")
    if args.store:
        from ..exec.job.etcd import parse_url
        parse_url(args.store)
    s0 = Strategy.parse(args.strategy)
    device = resolve_device(args)
    table = parse_strategy_for(args.strategy_for, models.get(args.model), args.global_batch)
    nprocs = args.nprocs if args.nprocs is not None else s0.world
    budget = parse_bytes(args.switch_memory_budget) if getattr(args, "switch_memory_budget", None) else None
    res, placed = run_first_host(args.model, s0, steps=args.steps, endpoint=args.endpoint, nprocs=nprocs,
                         secret=read_secret(args.secret_file, create=True), timeout=args.timeout,
                         quiet=bool(args.json), global_batch=args.global_batch, seq_len=args.seq_len,
                         optim=args.optim, notice=args.switch_notice, memory_budget=budget,
                         placement=args.switch_placement, on_join=args.on_join,
                         snapshot_every=args.snapshot_every,
                         snapshot_dir=os.path.abspath(args.resume if isinstance(args.resume, str) else args.snapshot_dir),
                         resume=bool(args.resume), store_url=args.store,
                         strategy_for=table, device=device, cluster=args.switch_cluster,
                         **({} if args.heartbeat_timeout is None else {"heartbeat_timeout": args.heartbeat_timeout}))
    out = {"model": models.get(args.model).name, "strategy": str(s0), "nprocs": s0.world, "endpoint": args.endpoint, "store": args.store,
           "schedule": None, **res.to_json(), "step_times": step_times(res), "switches": res.switches,
           "hosts": {str(h): devs for h, devs in placed.items()}}
    if args.trace:
        res.to_chrome_trace(args.trace)
        out["timeline"] = args.trace
    return out
