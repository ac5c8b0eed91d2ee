"""The ``parashift`` command line: one module per sub-command under ``parashift.cli``.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> dict``;
``--json`` prints that result, otherwise ``render(result, args)`` (if defined) prints it for people.
Errors print in one line and exit non-zero.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from typing import Sequence

from ..errors import ParashiftError

__all__ = ["main", "COMMANDS"]

#: sub-command -> module; each module is imported only when its command runs.
COMMANDS = {
    "models": "models",
    "plan": "plan",
    "schedule": "schedule",
    "simulate": "simulate",
    "run": "run",
    "search": "search",
    "search-rl": "search_rl",
    "plan-trace": "plan_trace",
    "replay": "replay",
    "calibrate": "calibrate",
    "demo": "demo",
}


def _module(cmd: str):
    return importlib.import_module(f".{COMMANDS[cmd]}", __name__)


def _available() -> list[str]:
    out = []
    for cmd in COMMANDS:
        try:
            if importlib.util.find_spec(f"{__name__}.{COMMANDS[cmd]}") is not None:  # type: ignore[attr-defined]
                out.append(cmd)
        except ImportError:
            pass
    return out


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parashift", description="Explore, tune, deploy and hot-switch "
                                     "distributed training strategies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for cmd in _available():
        if wanted is not None and cmd != wanted:
            sub.add_parser(cmd, help="")  # cheap placeholder: only the chosen command loads its module
            continue
        mod = _module(cmd)
        p = sub.add_parser(cmd, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def emit(result: object, as_json: bool, render=None, args=None) -> None:
    if as_json:
        print(json.dumps(result, default=_jsonable))
    elif render is not None:
        render(result, args)
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def _jsonable(o):
    import numpy as np
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    mod = _module(args.command)
    try:
        result = mod.run(args)
        emit(result, args.json, getattr(mod, "render", None), args)
    except ParashiftError as e:
        print(f"parashift {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"parashift {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0
