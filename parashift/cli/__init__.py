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
import math
import os
import sys
import traceback
from typing import Sequence

from ..errors import ParashiftError, RuntimeFailure
from . import dialect
from .outputs import Outputs

__all__ = ["main", "COMMANDS"]

#: sub-command -> module; each module is imported only when its command runs.
COMMANDS = {
    "models": "models",
    "clusters": "clusters",
    "plan": "plan",
    "schedule": "schedule",
    "simulate": "simulate",
    "run": "run",
    "join": "join",
    "search": "search",
    "search-rl": "search_rl",
    "plan-trace": "plan_trace",
    "replay": "replay",
    "calibrate": "calibrate",
    "demo": "demo",
    "traces": "traces",
    "data": "data",
    "export": "export",
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


class _UsageError(SystemExit):
    """An argparse error (exit status 2), raised with its one-line message so that :func:`main`
    prints it and returns instead of exiting."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="parashift", description="Explore, tune, deploy and hot-switch "
                     "distributed training strategies.")
    parser.add_argument("--version", action="store_true", help="print parashift's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
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
    if as_json:   # strict JSON: a missing number (NaN, e.g. "nothing fits") is null, not the NaN token
        print(json.dumps(_strict(result), default=_jsonable, allow_nan=False))
    elif render is not None:
        render(result, args)
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def _strict(o):
    """``o`` with every non-finite float (NaN, inf) replaced by None, recursively."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _strict(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strict(v) for v in o]
    return o


def _jsonable(o):
    import numpy as np
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return _strict(float(o))
    if isinstance(o, np.ndarray):
        return _strict(o.tolist())
    if isinstance(o, (set, tuple)):
        return _strict(list(o))
    return str(o)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command; return its exit status (0 ok, 1 error, 2 usage, 130 interrupted).

    Errors print as one line on stderr (``PARASHIFT_TRACEBACK=1`` adds the traceback of an
    unexpected one); output files are written all or nothing (:mod:`parashift.cli.outputs`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # torch's C++ logs (c10d's stacks of frames when a peer or the store goes away or cannot be reached)
    # stay out of the CLI's output, which says what failed in one line; TORCH_CPP_LOG_LEVEL=WARNING brings
    # them back
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    cmd = next((a for a in argv if not a.startswith("-")), None)
    try:
        if cmd in COMMANDS:
            argv = dialect.rewrite_aliases(cmd, argv, getattr(_module(cmd), "ALIASES", {}))
        parser = build_parser(argv)
        args = parser.parse_args(argv)
    except _UsageError as e:
        print(e.message, file=sys.stderr)
        return 2
    if args.version:
        from .. import __version__
        print(f"parashift {__version__}")
        return 0
    if not args.command:
        parser.print_help()
        return 2
    mod = _module(args.command)
    name = f"parashift {args.command}"
    tx = None
    try:
        tx = Outputs(args, getattr(mod, "OUTPUTS", {}), getattr(mod, "OUTPUT_FLAGS", None))
        result = mod.run(args)
        result = tx.commit(result)
        tx = None
        emit(result, args.json, getattr(mod, "render", None), args)
    except ParashiftError as e:
        _abort(tx)
        text = str(e) if isinstance(e, RuntimeFailure) else " ".join(str(e).split())
        print(f"{name}: error: {text}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _abort(tx)
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        _abort(tx)
        print(f"{name}: error: out of memory; make the problem smaller (batch, sequence length, model)",
              file=sys.stderr)
        return 1
    except BrokenPipeError:   # the reader (e.g. `| head`) went away: nothing left to say
        _abort(tx)
        sys.stderr.close()
        return 0
    except OSError as e:
        _abort(tx)
        what = f" {e.filename}" if e.filename else ""
        print(f"{name}: error: cannot access{what}: {e.strerror or e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback on request
        _abort(tx)
        if os.environ.get("PARASHIFT_TRACEBACK"):
            traceback.print_exc()
        print(f"{name}: internal error ({type(e).__name__}: {' '.join(str(e).split())[:200]}); this is a bug, "
              f"please report it with PARASHIFT_TRACEBACK=1 set", file=sys.stderr)
        return 3
    return 0


def _abort(tx: "Outputs | None") -> None:
    if tx is not None:
        tx.abort()
