"""`parashift run --model MODULE:NAME`: train a user model (a ``parashift.exec.UserModel``) on local processes.

Used by :mod:`parashift.cli.run` when ``--model`` names a Python object instead of a preset.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import StrategyError
from .options import resolve_device

__all__ = ["is_user_model", "run_cli", "read_directives"]


def is_user_model(ref: str) -> bool:
    """``--model`` names a UserModel object (``module:NAME``) rather than a preset, an inline ``gpt:``/``moe:``
    spec or a Hugging Face config (``hf:DIR``)."""
    from ..models.parse import KINDS
    return ":" in ref and ref.split(":", 1)[0].strip().lower() not in (*KINDS, "hf")


def read_directives(value: "str | None") -> list:
    """Directives from ``--directives``: a Python file (when the path exists) or inline text."""
    import os
    from ..ir.user_directives import parse_directives
    if value is None:
        return []
    if not value.strip():
        raise StrategyError("--directives is empty; give a Python file or directives inline, or drop --directives")
    if os.path.isdir(value):
        raise StrategyError(f"--directives {value!r} is a folder; give a Python file or the directives inline")
    if os.path.isfile(value):
        with open(value) as f:
            return parse_directives(f.read())
    if value.endswith(".py"):
        raise StrategyError(f"--directives file {value!r} does not exist; give a path or the directives inline")
    return parse_directives(value)


def run_cli(args: argparse.Namespace) -> dict:
    """``parashift run --model MODULE:NAME --strategy S [--directives FILE|TEXT] --steps K [--global-batch B]
    [--trace F]``: compile, simulate (cpu-local) and run the same Program."""
    from ..exec.user_model import compile_user_model, load_user_model, run_user_model
    from ..sim import simulate
    um = load_user_model(args.model)
    if args.switch_at:
        raise StrategyError("--switch-at hot-switches preset models only (tiny-gpt, tiny-moe); drop it to train "
                            "a user model")
    if args.plan or args.seq_len:
        raise StrategyError("a user model is compiled from --model MODULE:NAME; drop the plan file and --seq-len "
                            "(the example input fixes the shapes)")
    if args.steps < 1:
        raise StrategyError(f"--steps {args.steps} must be at least 1")
    directives = read_directives(getattr(args, "directives", None))
    program, _ = compile_user_model(um.factory, args.strategy, example_input=um.example_input,
                                    global_batch=args.global_batch, name=um.name, directives=directives)
    if args.nprocs is not None and args.nprocs != program.world:
        raise StrategyError(f"strategy {args.strategy}{' with the directives' if directives else ''} needs "
                            f"{program.world} processes, not --nprocs {args.nprocs}; drop --nprocs or change them")
    sim = simulate(program, "cpu-local")

    def progress(step: int, loss: float, seconds: float) -> None:
        if not args.json:
            print(f"step {step + 1}/{args.steps}  loss {loss:.6f}  {seconds * 1e3:.1f} ms", file=sys.stderr,
                  flush=True)

    res = run_user_model(um.factory, args.strategy, directives=directives, example_input=um.example_input,
                         data=um.data, loss_fn=um.loss_fn, steps=args.steps, global_batch=args.global_batch,
                         name=um.name, optim=args.optim, timeout=args.timeout, progress=progress,
                         backend={"cpu": "gloo", "cuda": "nccl"}[resolve_device(args)])
    if args.trace:
        res.to_chrome_trace(args.trace)
    out = res.to_json()
    out["simulated_step_seconds"] = float(sim.step_time)
    if directives:
        from ..ir.user_directives import format_directives
        out["directives"] = format_directives(directives).splitlines()
        out["streams"] = sorted({s for rp in res.program.ranks.values() for s in rp.streams})
    if args.trace:
        out["timeline"] = args.trace
    return out
