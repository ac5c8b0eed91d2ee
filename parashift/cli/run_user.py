"""`parashift run --model MODULE:NAME`: train a user model (a ``parashift.exec.UserModel``) on local processes.

Used by :mod:`parashift.cli.run` when ``--model`` names a Python object instead of a preset.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import StrategyError
from ..strategy import Strategy

__all__ = ["is_user_model", "run_cli"]


def is_user_model(ref: str) -> bool:
    """``--model`` names a UserModel object (``module:NAME``) rather than a preset."""
    return ":" in ref


def run_cli(args: argparse.Namespace) -> dict:
    """``parashift run --model MODULE:NAME --strategy S --steps K [--global-batch B] [--trace F]``."""
    from ..exec import OptimConfig
    from ..exec.user_model import load_user_model, run_user_model
    um = load_user_model(args.model)
    if args.switch_at:
        raise StrategyError("--switch-at hot-switches preset models only (tiny-gpt, tiny-moe); drop it to train "
                            "a user model")
    if args.plan or args.seq_len:
        raise StrategyError("a user model is compiled from --model MODULE:NAME; drop the plan file and --seq-len "
                            "(the example input fixes the shapes)")
    if args.steps < 1:
        raise StrategyError(f"--steps {args.steps} must be at least 1")
    world = Strategy.parse(args.strategy).world
    if args.nprocs is not None and args.nprocs != world:
        raise StrategyError(f"strategy {args.strategy} needs {world} processes, not --nprocs {args.nprocs}; "
                            f"drop --nprocs or change the strategy")

    def progress(step: int, loss: float, seconds: float) -> None:
        if not args.json:
            print(f"step {step + 1}/{args.steps}  loss {loss:.6f}  {seconds * 1e3:.1f} ms", file=sys.stderr,
                  flush=True)

    res = run_user_model(um.factory, args.strategy, example_input=um.example_input, data=um.data,
                         loss_fn=um.loss_fn, steps=args.steps, global_batch=args.global_batch, name=um.name,
                         optim=OptimConfig(lr=args.lr), timeout=args.timeout, progress=progress)
    if args.trace:
        res.to_chrome_trace(args.trace)
    out = res.to_json()
    if args.trace:
        out["timeline"] = args.trace
    return out
