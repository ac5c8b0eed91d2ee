"""``parashift join --endpoint HOST:PORT --nprocs N`` (or ``--store etcd://...``): bring this host's processes into a live job."""
from __future__ import annotations

import argparse

from ..validate import arg_float, arg_int
from .limits import MAX_LOCAL_PROCS
from .run_hosts import add_host_arguments

HELP = "join a multi-host live job (started with `parashift run ... --live --endpoint HOST:PORT`) with local processes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_host_arguments(p, first=False)
    p.add_argument("--nprocs", type=arg_int(1, MAX_LOCAL_PROCS), required=True,
                   help="processes (devices) this host brings to the job")
    p.add_argument("--timeout", type=arg_float(0, 7 * 86400, lo_open=True), default=600.0,
                   help="seconds before this host gives up (default 600)")
    p.add_argument("--notice-seconds", type=arg_float(0, 7 * 86400, lo_open=True), default=None, metavar="S",
                   help="the platform kills this host S seconds after its SIGTERM: the agent announces the "
                        "deadline and, if its processes have not left the job by then, SIGKILLs them and itself "
                        "(default: none, the notice lasts as long as the switch takes)")


def run(args: argparse.Namespace) -> dict:
    from ..errors import StrategyError
    from ..exec.job.agent import run_agent
    from ..exec.job.endpoint import read_secret
    if not args.endpoint and not args.store:
        raise StrategyError("join needs --endpoint HOST:PORT, the address the first host's "
                            "`parashift run ... --live --endpoint` serves, or --store etcd://HOST:PORT,... when the "
                            "job's store is on etcd")
    if args.store:
        from ..exec.job.etcd import parse_url
        parse_url(args.store)
    return run_agent(endpoint=args.endpoint, nprocs=args.nprocs, secret=read_secret(args.secret_file),
                     timeout=args.timeout, quiet=bool(args.json), notice_seconds=args.notice_seconds,
                     store_url=args.store)


def render(result: dict, args: argparse.Namespace) -> None:
    steps = sorted(set(result["steps"].values()))
    print(f"host {result['host']}: devices {result['devices']} trained {steps[-1] if steps else 0} steps; "
          f"the first host prints the job's losses")
