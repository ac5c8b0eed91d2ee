"""`parashift run`'s checkpoint options: ``--save DIR --save-every N``, ``--resume DIR``, ``--export-hf DIR``."""
from __future__ import annotations

import argparse

from ..errors import StrategyError
from ..validate import arg_int

__all__ = ["add_checkpoint_arguments", "checkpoint_options"]


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save", metavar="DIR", help="write DCP checkpoints (parameters, optimizer states, step, trainer "
                   "state) to DIR, every --save-every steps and at the end")
    p.add_argument("--save-every", type=arg_int(0, 1_000_000), default=0, metavar="N",
                   help="steps between checkpoints written to --save (default 0: only at the end)")
    p.add_argument("--export-hf", metavar="DIR", help="at the end, write the parameters as Hugging Face safetensors "
                   "(model-0000i-of-0000n.safetensors, the index, config.json) that transformers loads")


def checkpoint_options(args: argparse.Namespace):
    """The run's CheckpointOptions, or None; ``--resume DIR`` (a local run) continues from DIR's newest whole
    checkpoint in --strategy, and ``--steps`` counts from step 0."""
    from ..exec.checkpoint import CheckpointOptions
    from .run_user import is_user_model
    if args.endpoint:               # a multi-host job resumes from its snapshots (run_hosts)
        if args.save or args.export_hf:
            raise StrategyError("--save and --export-hf run on local processes; a multi-host live job keeps "
                                "--snapshot-every snapshots. Drop --save/--export-hf or --endpoint")
        return None
    resume = args.resume if isinstance(args.resume, str) else None
    if args.resume is True:
        raise StrategyError("--resume needs the checkpoint folder on a local run (--resume DIR, a --save DIR); "
                            "a bare --resume restarts a multi-host live job (add --endpoint HOST:PORT and --live)")
    opts = CheckpointOptions(save=args.save, save_every=args.save_every, resume=resume, export_hf=args.export_hf)
    if not opts.any:
        return None
    if is_user_model(args.model):
        raise StrategyError("--save, --resume DIR and --export-hf need a preset or hf:DIR model; a user model "
                            "(MODULE:NAME) keeps its own checkpoints")
    if (opts.save or opts.resume) and (args.switch_at or args.live) or getattr(args, "rollout", None):
        raise StrategyError("--save and --resume DIR run with a static run, --export-hf with a static or hot-switched "
                            "one; drop --switch-at and --live (a live job keeps --snapshot-every snapshots) or "
                            "--rollout")
    if args.switch_at or args.live:
        return None             # a live job writes --export-hf itself (run_live)
    return opts
