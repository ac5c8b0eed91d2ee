"""Options that several sub-commands share, declared once."""
from __future__ import annotations

import argparse

from ..errors import StrategyError

__all__ = ["add_batch_options", "add_space_options", "add_cost_model", "space_options", "load_cost_model",
           "positive_int", "resolve_device", "strategy_text"]

#: the search-space flags: (flag, make_space keyword, element type, help)
_SPACE = (("schedules", "schedules", str, "restrict the schedules, e.g. 1f1b,zb-h1 (default: all)"),
          ("zero", "zero", int, "restrict the ZeRO stages, e.g. 0,1 (default: 0-3)"),
          ("mbs", "mbs", int, "restrict the micro-batch sizes, e.g. 1,2 (default: powers of 2 up to 8)"),
          ("recompute", "recompute", str, "restrict recomputation, e.g. none,full (default: all)"),
          ("sp", "sp", bool, "offer sequence parallelism where tp > 1: off,on searches both, on only it "
                             "(default: off)"),
          ("overlap-param", "overlap_param", bool, "offer overlap_param where zero is 1 or 2: off,on or on "
                                                   "(default: off)"),
          ("tp-async", "tp_async", bool, "offer tp_async (the asynchronous TP all-reduce) where tp > 1: off,on "
                                         "or on (default: off)"),
          ("grad-fusion", "grad_fusion", bool, "offer grad_fusion (gradient-accumulation fusion): off,on or on "
                                               "(default: off)"))


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be a positive integer")
    return v


def strategy_text(text: str) -> str:
    """An argparse type: strategy text that is not blank (a blank one would silently mean dp=1)."""
    if not text.replace(",", "").strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a strategy such as dp=2,tp=2 (dp=1: one device)")
    return text


def add_batch_options(p: argparse.ArgumentParser, *, live: bool = False) -> None:
    """``--global-batch`` and ``--seq-len``: required for planning commands; for ``live`` ones
    (a job on this machine) 8 sequences of the model's own length by default."""
    from ..validate import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, arg_int
    batch, seq = arg_int(1, MAX_GLOBAL_BATCH), arg_int(1, MAX_SEQ_LEN)
    if live:
        p.add_argument("--global-batch", type=batch, default=8, help="sequences per step (default 8)")
        p.add_argument("--seq-len", type=seq, help="tokens per sequence (default: the model's)")
    else:
        p.add_argument("--global-batch", type=batch, required=True, help="sequences per step")
        p.add_argument("--seq-len", type=seq, required=True, help="tokens per sequence")


def add_cost_model(p: argparse.ArgumentParser,
                   help: str = "cost model JSON (default: the cluster's datasheet defaults)") -> None:
    """``--cost-model FILE``."""
    p.add_argument("--cost-model", help=help)


def load_cost_model(path: "str | None"):
    """The :class:`~parashift.sim.CostModel` in ``path``, or None."""
    from .inputs import load_cost_model as load   # schema-checked
    return load(path)


def add_space_options(p: argparse.ArgumentParser) -> None:
    """``--schedules/--zero/--mbs/--recompute``: comma-separated restrictions of the search space;
    ``--sp/--overlap-param/--tp-async/--grad-fusion``: the on/off axes offered (``off,on`` searches both)."""
    for flag, _, conv, text in _SPACE:
        p.add_argument(f"--{flag}", help=text, metavar="off,on" if conv is bool else None)


def space_options(args: argparse.Namespace) -> dict:
    """make_space axes from the flags of :func:`add_space_options`."""
    from ..states import ZERO_LEVELS
    from ..strategy import RECOMPUTE, SCHEDULES
    from ..validate import arg_choices_list
    allowed = {"schedules": SCHEDULES, "zero": ZERO_LEVELS, "recompute": RECOMPUTE, "mbs": None}
    out: dict = {}
    for flag, key, conv, _ in _SPACE:
        text = getattr(args, key)
        if text is None:
            continue
        if conv is bool:   # an on/off axis
            out[key] = tuple(v == "on" for v in arg_choices_list(flag, text, str, ("off", "on")))
        else:
            out[key] = arg_choices_list(flag, text, conv, allowed[flag])
            if flag == "mbs" and min(out[key]) < 1:
                raise StrategyError(f"--mbs {text!r}: micro-batch sizes must be at least 1")
    return out


def resolve_device(args: argparse.Namespace) -> str:
    """``--device``: ``"cpu"`` or ``"cuda"`` (``auto``: cuda when CUDA GPUs are present)."""
    import torch
    want = getattr(args, "device", "auto") or "auto"
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise StrategyError("--device cuda needs CUDA GPUs, and this machine has none (or this torch is a CPU "
                            "build); use --device cpu")
    return want
