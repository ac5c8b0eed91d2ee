"""An instruction of one rank's Program as resolved at load time, shared by the interpreter's loop and
its per-parallelism handlers (:mod:`.parallel`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir.instr import Instr
from ..ir.tags import StepTag

__all__ = ["Prepared", "COMPUTE", "SEND", "RECV", "TP", "EP", "DP", "Z3", "SP", "CP", "FP8"]

#: what an instruction does, decided once at load: compute, p2p send / recv, and one kind per collective payload
COMPUTE, SEND, RECV, TP, EP, DP, Z3, SP, CP, FP8 = range(10)


@dataclass(eq=False)
class Prepared:
    """One instruction resolved when the Program is loaded: what a step needs, and nothing to look up."""

    ins: Instr
    idx: int                         # dense index (done flags, deps)
    stream: int                      # index into the interpreter's streams
    deps: tuple[int, ...]
    kind: int
    tag: StepTag | None = None
    group: Any = None                # the process group of a collective or p2p
    peer: int = -1                   # p2p peer (group rank = global rank)
    itag: int = 0                    # gloo message tag
    atoms: tuple[str, ...] = ()
    z3_free: tuple[str, ...] = ()
    sync_chunk: int = -1             # a DP gradient sync's chunk (waits for TP backward reductions)
    buf: torch.Tensor | None = None  # a recv's reusable buffer
    watched: bool = True             # something depends on its completion (a send nobody waits for is reaped at the end)
