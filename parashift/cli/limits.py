"""Bounds checked before a live job starts: processes, device ids, switch steps and memory.

A live job (``run``, ``calibrate``, ``replay``) trains on this machine; what cannot finish here is
refused with a message naming the limit, before any process starts.
"""
from __future__ import annotations

import argparse

from ..errors import LimitError, StrategyError
from ..units import available_memory

__all__ = ["MAX_LOCAL_PROCS", "available_memory", "live_memory_estimate", "check_live", "check_memory"]

#: the most local processes (ranks, or the highest device id + 1) one job may start
MAX_LOCAL_PROCS = 256


def live_memory_estimate(spec, global_batch: int, seq_len: int) -> int:
    """A lower bound of the bytes one training step of ``spec`` needs on one process, summed over
    the job: the fp32 weights, gradients and Adam states (16 bytes a parameter) and the activations
    every layer keeps for the backward pass (about 16 values a token per hidden unit, plus the
    attention scores when attention is not fused)."""
    tokens = global_batch * seq_len
    act = tokens * spec.hidden * spec.layers * 16 * 4
    if not getattr(spec, "flash_attention", True):
        act += global_batch * spec.heads * seq_len * seq_len * spec.layers * 4
    logits = tokens * spec.vocab * 4 * 2
    return int(16 * spec.params + act + logits)


def check_memory(spec, global_batch: int, seq_len: int, what: str = "the job") -> None:
    """Refuse a live step whose estimate exceeds the memory this machine has available."""
    need, have = live_memory_estimate(spec, global_batch, seq_len), available_memory()
    if need > have:
        from .dialect import format_bytes
        raise LimitError(f"{what} needs at least {format_bytes(need)} of memory ({global_batch} x {seq_len} tokens "
                         f"of {spec.name}) but this machine has {format_bytes(have)} available; lower "
                         f"--global-batch or --seq-len")


def _switch_devices(text: str) -> tuple[int, list[int]]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0].strip().isdigit():
        raise StrategyError(f"--switch-at {text!r} is not STEP:STRATEGY[:DEVICES]; e.g. 10:tp=2,dp=2 or 10:dp=3:0,1,2")
    devices: list[int] = []
    if len(parts) == 3 and parts[2].strip():
        from ..cluster import parse_devices
        for item in parts[2].split(","):   # bound ranges before expanding them
            for end in item.split("-"):
                if end.strip().isdigit() and int(end) >= MAX_LOCAL_PROCS:
                    raise LimitError(f"--switch-at {text!r}: device {int(end)} is beyond the {MAX_LOCAL_PROCS} local "
                                     f"processes a job may use; list devices 0-{MAX_LOCAL_PROCS - 1}")
        devices = list(parse_devices(parts[2]))
    return int(parts[0]), devices


def check_live(args: argparse.Namespace) -> None:
    """The bounds of ``run``'s live job (preset models): switch steps and devices, memory."""
    from .. import models
    from .run_user import is_user_model
    for text in args.switch_at:
        step, _ = _switch_devices(text)
        if step >= args.steps:
            raise StrategyError(f"--switch-at {text!r}: step {step} is not before the last step (--steps "
                                f"{args.steps}); switch earlier or train longer")
    if getattr(args, "switch_cluster", None):
        if not (args.live or args.switch_at or args.endpoint):
            raise StrategyError("--switch-cluster prices a live job's switches; add --live (or --switch-at)")
        from ..cluster import get as get_cluster
        get_cluster(args.switch_cluster)          # a bad name or file fails here, before any process starts
    if args.plan:
        return
    from ..strategy import Strategy
    from ..validate import check_step_size
    s = Strategy.parse(args.strategy)
    if s.world > MAX_LOCAL_PROCS:
        raise LimitError(f"strategy {s} runs {s.world} processes, over the {MAX_LOCAL_PROCS} one local job may "
                         f"start; use a smaller strategy")
    if is_user_model(args.model):
        return
    spec = models.get(args.model)
    check_step_size(args.global_batch, s.dp, s.mbs, s.pp)
    check_memory(spec, args.global_batch, args.seq_len or spec.seq_len)
