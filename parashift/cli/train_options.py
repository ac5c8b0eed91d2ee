"""The trainer's options (``--lr``, its schedule, ``--clip-grad``, ``--weight-decay``, ``--precision``),
shared by ``parashift run`` and ``parashift search --out``, and their resolution against a deploy plan.

An option given on the command line wins; else the plan's ``meta.deploy.train`` value; else the default.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import InputError
from ..validate import arg_float, arg_int

__all__ = ["add_train_options", "train_settings", "optim_config", "DEFAULTS"]

#: the defaults of :func:`train_settings` (the keys of ``meta.deploy.train`` and of the run JSON's ``train``)
DEFAULTS: dict[str, Any] = {"lr": 1e-3, "lr_warmup_steps": 0, "lr_decay": "constant", "min_lr": 0.0,
                            "lr_decay_steps": None, "clip_grad": None, "weight_decay": 0.1, "precision": None}


def add_train_options(p: argparse.ArgumentParser) -> None:
    """The trainer's options, every one defaulting to None (so that a plan's value can fill it)."""
    g = p.add_argument_group("trainer")
    g.add_argument("--lr", type=arg_float(0, 10, lo_open=True), help="peak AdamW learning rate (default 1e-3)")
    g.add_argument("--lr-warmup-steps", type=arg_int(0, 10_000_000), metavar="N",
                   help="linear warmup from 0 to --lr over N steps (Megatron's --lr-warmup-iters; default 0)")
    g.add_argument("--lr-decay", choices=("cosine", "linear", "constant"),
                   help="decay after the warmup, down to --min-lr at --lr-decay-steps (default constant)")
    g.add_argument("--min-lr", type=arg_float(0, 10), help="the rate the decay ends at (default 0)")
    g.add_argument("--lr-decay-steps", type=arg_int(1, 10_000_000), metavar="N",
                   help="the step the decay ends at, warmup included (default: --steps)")
    g.add_argument("--clip-grad", type=arg_float(0, 1e6, lo_open=True), metavar="X",
                   help="clip gradients to global L2 norm X (across every shard; default: no clipping)")
    g.add_argument("--weight-decay", type=arg_float(0, 10), help="AdamW weight decay on matrices and embeddings "
                   "(never on norms or biases; default 0.1)")
    g.add_argument("--precision", choices=("fp32", "bf16"),
                   help="fp32, or bf16 with fp32 master weights and gradient accumulation (default: the model's)")


def train_settings(args: argparse.Namespace, steps: int | None, plan: dict | None = None) -> dict:
    """The resolved trainer settings (command line, then the plan's ``train``, then :data:`DEFAULTS`);
    a decay with no ``lr_decay_steps`` ends at ``steps`` (None: left open, as a plan records it)."""
    plan = plan or {}
    unknown = set(plan) - set(DEFAULTS) - {"betas", "eps"}
    if unknown:
        raise InputError(f"the plan's trainer settings have unknown keys {sorted(unknown)}; keys are "
                         f"{', '.join(DEFAULTS)}")
    out = {}
    for k, default in DEFAULTS.items():
        v = getattr(args, k, None)
        out[k] = v if v is not None else plan.get(k, default)
    if out["lr_decay"] != "constant" and out["lr_decay_steps"] is None:
        out["lr_decay_steps"] = steps
    optim_config(out)          # checks the combination now, in one line
    return out


def optim_config(settings: dict) -> Any:
    """The :class:`~parashift.exec.OptimConfig` of resolved ``settings``."""
    from ..exec.reference import OptimConfig
    from ..train import LRSchedule
    lr = float(settings["lr"])
    schedule = None
    if settings["lr_warmup_steps"] or settings["lr_decay"] != "constant":
        schedule = LRSchedule(lr, warmup_steps=int(settings["lr_warmup_steps"]), decay=settings["lr_decay"],
                              min_lr=float(settings["min_lr"]),
                              decay_steps=None if settings["lr_decay"] == "constant"
                              or settings["lr_decay_steps"] is None else int(settings["lr_decay_steps"]))
    return OptimConfig(lr=lr, weight_decay=float(settings["weight_decay"]), schedule=schedule,
                       clip_grad=float(settings["clip_grad"] or 0.0))
