"""Schedule actions and their compact text form (torch's ``1F0``).

An action is one chunk's forward or backward for one micro-batch: ``{chunk}{T}{mb}`` with T in
``F`` (forward), ``B`` (full backward), ``I`` (input-grad backward), ``W`` (weight-grad backward).
A stage's order is a space-separated string of actions, e.g. ``"0F0 0F1 0B0 0F2 0B1"``; two actions
joined by ``&`` (``"0F3&5B1"``) run overlapped: their regions interleave on the compute stream, so one
micro-batch's communication hides behind the other's compute (DualPipe's F&B blocks).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from ..errors import ProgramError

__all__ = ["Action", "Step", "action_ids", "parse_order", "format_order", "stage_orders", "TYPES", "PHASES_OF", "AFTER",
           "END", "OPTIM", "POST"]

#: Anchors for graph nodes that belong to no action: after a chunk's last backward, at the end of the
#: comm stream, the optimizer step, after the optimizer step.
AFTER, END, OPTIM, POST = "after", "end", "optim", "post"

TYPES = ("F", "B", "I", "W")
#: Node phases each action type covers (B: split into bwd_input + bwd_weight under ``tp_async``).
PHASES_OF = {"F": ("fwd",), "B": ("recompute", "bwd", "bwd_input", "bwd_weight"), "I": ("recompute", "bwd_input"),
             "W": ("bwd_weight",)}
_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


class _ActionFields(NamedTuple):
    chunk: int
    type: str
    mb: int


class Action(_ActionFields):
    """``chunk`` (virtual stage), ``type`` (F/B/I/W), ``mb`` (micro-batch). A tuple underneath, so
    hashing and comparing (done millions of times by the compiler) run at C speed."""

    __slots__ = ()

    def __new__(cls, chunk: int, type: str, mb: int) -> "Action":
        if type not in TYPES:
            raise ProgramError(f"action type {type!r} is not one of {', '.join(TYPES)}")
        if chunk < 0 or mb < 0:
            raise ProgramError(f"action {chunk}{type}{mb} has a negative chunk or micro-batch")
        return super().__new__(cls, int(chunk), type, int(mb))

    def __str__(self) -> str:
        return f"{self.chunk}{self.type}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({self.chunk}, {self.type!r}, {self.mb})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _RE.match(text.strip())
        if not m:
            raise ProgramError(f"cannot parse action {text!r}; write '{{chunk}}{{F|B|I|W}}{{mb}}', e.g. '0F3'")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


def action_ids(acts: Sequence) -> "tuple[np.ndarray, list[Action]]":
    """Each entry of a graph's ``action`` column as an index into the returned list of its distinct
    actions (-1: a node of no action, such as an optimizer step or a sync anchored after a chunk)."""
    # distinct objects first (by identity, at numpy speed: a sort, where np.unique is far slower; a run
    # of one object read once), then equal actions share one id
    n = len(acts)
    ref = np.fromiter(map(id, acts), np.uintp, n)
    head = np.flatnonzero(np.concatenate(([True], ref[1:] != ref[:-1]))) if n else np.zeros(0, np.int64)
    h = ref[head]
    u = np.sort(h)
    u = u[np.concatenate([[True], u[1:] != u[:-1]])] if len(u) else u
    inv = np.searchsorted(u, h)
    some = np.empty(len(u), np.int64)
    some[inv] = head                        # a node holding each object (any one: they hold the same)
    code: dict[Action, int] = {}
    per = np.fromiter((code.setdefault(a, len(code)) if isinstance(a, Action) else -1
                       for a in (acts[i] for i in some.tolist())), np.int64, len(u))
    return np.repeat(per[inv], np.diff(np.append(head, n))), list(code)


#: One step of a stage's order: one action, or several run overlapped.
Step = tuple[Action, ...]


def parse_order(text: str) -> list[Step]:
    """``"0F0 0F1 0B0 0F2&1B0"`` -> steps (each a tuple of actions)."""
    return [tuple(Action.parse(a) for a in tok.split("&")) for tok in text.split()]


def format_order(steps: Iterable["Step | Action"]) -> str:
    """Inverse of :func:`parse_order`."""
    out = []
    for st in steps:
        acts: Sequence[Action] = (st,) if isinstance(st, Action) else st
        out.append("&".join(map(str, acts)))
    return " ".join(out)


def as_steps(order: "str | Iterable[Step | Action]") -> list[Step]:
    """Normalize a text order or a list of actions/steps to a list of steps."""
    if isinstance(order, str):
        return parse_order(order)
    return [(st,) if isinstance(st, Action) else tuple(st) for st in order]


_TYPE_OF = {"fwd": "F", "bwd": "B", "recompute": "B", "bwd_input": "I", "bwd_weight": "W"}


def stage_orders(program: Any) -> dict[int, list[Action]]:
    """Each stage's compute actions in stream order, read back from a compiled
    :class:`~parashift.ir.program.Program` (consecutive instructions of one action merged; a
    recompute counts as its backward). Typed loosely: this module sits below the Program."""
    s = program.strategy
    per = (s.world // s.pp) if s is not None else 1
    stages = (s.pp if s is not None else 1)
    out: dict[int, list[Action]] = {}
    for st in range(stages):
        rp = program.ranks[st * per]
        acts: list[Action] = []
        seen: set = set()
        for ins in rp.streams.get("compute", ()):
            if ins.op != "compute" or ins.phase not in _TYPE_OF:
                continue
            a = Action(ins.chunk, _TYPE_OF[ins.phase], ins.microbatch)
            if a not in seen:
                seen.add(a)
                acts.append(a)
        out[st] = acts
    return out
