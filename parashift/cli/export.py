"""`parashift export`: a deploy plan or a strategy as Megatron-LM arguments or a torchtitan TOML."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InputError

HELP = "print a plan's (or a strategy's) Megatron-LM arguments or torchtitan TOML, saying what the target cannot express"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN_OR_STRATEGY",
                   help="a deploy plan file (parashift search --out) or a strategy such as dp=4,tp=2,pp=2,zero=1")
    p.add_argument("--to", required=True, choices=("megatron", "torchtitan"), help="the target framework")
    p.add_argument("--model", default=None, help="model preset or spec (with a strategy; a plan names its own)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (with a strategy)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (exports the schedule)")
    p.add_argument("--min-lr", type=float, default=0.0, help="learning rate the decay ends at")
    p.add_argument("--lr-warmup-steps", type=int, default=0, help="linear warmup steps")
    p.add_argument("--lr-decay", default="cosine", choices=("cosine", "linear", "constant"), help="decay after warmup")
    p.add_argument("--steps", type=int, default=None, help="training steps (the decay runs over them)")
    p.add_argument("--clip-grad", type=float, default=None, help="gradient clipping by global norm")
    p.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay")
    p.add_argument("--fp8", default=None, choices=("e4m3", "hybrid"), help="train the matrix multiplies in fp8")


def _job(args: argparse.Namespace):
    from .. import models
    from ..export import Job, Training
    from ..strategy import Strategy
    from ..train import LRSchedule
    model, gb, seq = args.model, args.global_batch, args.seq_len
    spec = None
    if Path(args.plan).is_file():
        from ..ir.program import Program
        from ..ir.step_meta import StepMeta
        from ..validate import read_json
        obj = read_json(args.plan, "plan")
        meta = obj.get("meta") if isinstance(obj, dict) else None
        if not isinstance(meta, dict) or "model" not in meta or "strategy" not in obj:
            raise InputError(f"plan {args.plan} is not a parashift plan (a Program JSON with meta.model); write "
                             f"one with `parashift search --out`")
        step = StepMeta.of(Program.from_json(obj))      # the plan carries its model
        if step.model is None and model is None:
            raise InputError(f"plan {args.plan} was compiled from a traced user model, which has no architecture "
                             f"to export; give --model")
        strategy = Strategy.parse(meta.get("deploy", {}).get("strategy", obj["strategy"]))
        spec = None if model else step.model
        gb = gb or step.global_batch
        seq = seq or step.seq_len
    else:
        strategy = Strategy.parse(args.plan)
        if model is None or gb is None:
            raise InputError("a strategy needs --model and --global-batch (a plan file carries both)")
    spec = spec or models.get(model)
    schedule = None
    if args.lr is not None:
        schedule = LRSchedule(lr=args.lr, warmup_steps=args.lr_warmup_steps, decay=args.lr_decay,
                              min_lr=args.min_lr)
        if args.lr_decay != "constant" and args.steps is None:
            raise InputError("a decaying --lr schedule needs --steps (the decay runs over them)")
    training = Training(schedule=schedule, steps=args.steps, clip_grad=args.clip_grad,
                        weight_decay=args.weight_decay, fp8=args.fp8)
    return Job(spec, strategy, int(gb), int(seq or spec.seq_len), training)


def run(args: argparse.Namespace) -> dict:
    from ..export import export
    job = _job(args)
    out = export(job, args.to)
    return {"model": job.model.name, "strategy": str(job.strategy), "global_batch": job.global_batch,
            "seq_len": job.seq_len, **out.to_dict()}


def render(result: dict, args: argparse.Namespace) -> None:
    print(result["text"], end="")
