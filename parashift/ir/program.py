"""The Program: the contract between the compiler, the simulator and the runtime.

For every rank, for every logical stream, an ordered list of instructions with explicit
dependencies. Ranks whose programs are identical share one :class:`RankProgram` object, and
instructions may name groups and peers *symbolically* (``group="tp"``, ``peer="pp+1"``),
resolved per rank through the strategy's rank grid; this keeps a 1024-rank program as small
as its distinct pipeline stages. Switch programs use concrete device tuples instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..errors import ProgramError
from ..strategy import Strategy
from .instr import COLLECTIVES, COMM_OPS, COMPUTE, PHASES, Instr, RankProgram, instrs_from_columns
from .validate import validate_ranks

__all__ = ["Instr", "RankProgram", "Program", "COMPUTE", "COMM_OPS", "COLLECTIVES", "PHASES", "FORMAT_VERSION",
           "TIMELINE_COLUMNS", "TIMELINE_KINDS", "instrs_from_columns"]

#: 2: a training step carries its model's spec and recipe (:class:`~parashift.ir.step_meta.StepMeta`)
FORMAT_VERSION = 2

#: A timeline records one executed instruction per row (simulated by ``parashift.sim``, measured by
#: ``parashift.exec``'s profiler), times in seconds; the column kinds are int, float, text, and
#: ``?`` for nullable. ``rank`` may be absent from a saved timeline.
TIMELINE_KINDS = {"rank": "int", "device": "int", "stream": "text", "id": "int", "op": "text", "phase": "text?",
                  "microbatch": "int?", "start": "float", "end": "float", "nbytes": "int", "flops": "float"}
TIMELINE_COLUMNS = tuple(TIMELINE_KINDS)


@dataclass(frozen=True)
class Program:
    """Every rank's program plus metadata (model, strategy, schedule, batch...).

    ``strategy`` (when set) resolves symbolic groups and peers; ``meta`` is JSON-able.
    """

    ranks: Mapping[int, RankProgram]
    strategy: Strategy | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    # ---- symbolic names -> concrete ranks ------------------------------------------------------
    def resolve_group(self, rank: int, instr: Instr) -> tuple[int, ...]:
        g = instr.group
        if g is None:
            raise ProgramError(f"rank {rank} instruction {instr} has no group")
        if isinstance(g, tuple):
            return g
        if self.strategy is None:
            raise ProgramError(f"instruction {instr} names group {g!r} but the program has no strategy")
        return self.strategy.group(rank, g)

    def resolve_peer(self, rank: int, instr: Instr) -> int:
        """Concrete peer; symbolic peers are ``pp+k`` / ``pp-k`` (stage offset) or ``cp+k`` / ``cp-k``
        (context-parallel ring offset), wrapping (see :meth:`Strategy.peer`)."""
        p = instr.peer
        if isinstance(p, int):
            return p
        if p is None:
            raise ProgramError(f"rank {rank} instruction {instr} has no peer")
        if self.strategy is None or not p.startswith(("pp", "cp")):
            raise ProgramError(f"cannot resolve peer {p!r} of rank {rank}: use an int or 'pp+k'/'cp-k' with a strategy")
        return int(self.strategy.peer(rank, p))

    # ---- views -----------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.ranks)

    def classes(self) -> dict[int, list[int]]:
        """Ranks grouped by shared RankProgram object: id(program) -> ranks."""
        out: dict[int, list[int]] = {}
        for r, p in self.ranks.items():
            out.setdefault(id(p), []).append(r)
        return out

    def num_instructions(self) -> int:
        return sum(len(p) for p in self.ranks.values())

    def validate(self) -> "Program":
        """Check every invariant of DESIGN.md; raise ProgramError/DeadlockError naming the culprit."""
        validate_ranks(self.ranks, self.strategy)
        return self

    def to_frame(self, ranks: "list[int] | None" = None):
        """One row per instruction: rank, stream, index, id, op, phase, stage, chunk, microbatch,
        peer, group, nbytes, flops, tag."""
        import pandas as pd
        rows = []
        for r in (ranks if ranks is not None else sorted(self.ranks)):
            peers: dict = {}
            groups: dict = {}
            for stream, instrs in self.ranks[r].streams.items():
                for k, i in enumerate(instrs):
                    peer = group = None
                    if i.peer is not None:
                        peer = peers.get(i.peer)
                        if peer is None:
                            peer = peers[i.peer] = self.resolve_peer(r, i)
                    if i.group is not None:
                        group = groups.get(i.group)
                        if group is None:
                            group = groups[i.group] = self.resolve_group(r, i)
                    rows.append((r, stream, k, i.id, i.op, i.phase, i.stage, i.chunk, i.microbatch,
                                 peer, group, i.nbytes, i.flops, i.tag))
        return pd.DataFrame(rows, columns=["rank", "stream", "index", "id", "op", "phase", "stage", "chunk",
                                           "microbatch", "peer", "group", "nbytes", "flops", "tag"])

    # ---- JSON --------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        uniq: dict[int, int] = {}
        progs: list[dict] = []
        rank_map: dict[str, int] = {}
        for r in sorted(self.ranks):
            p = self.ranks[r]
            if id(p) not in uniq:
                uniq[id(p)] = len(progs)
                progs.append(p.to_json())
            rank_map[str(r)] = uniq[id(p)]
        return {"format": "parashift.program", "version": FORMAT_VERSION,
                "strategy": str(self.strategy) if self.strategy else None,
                "meta": dict(self.meta), "programs": progs, "ranks": rank_map}

    @classmethod
    def from_json(cls, obj: dict) -> "Program":
        """The Program :meth:`to_json` wrote, in this format version or an older one it still reads
        (a format-1 training step, which names its model instead of carrying it, is refused)."""
        if obj.get("format") != "parashift.program":
            raise ProgramError("not a parashift program file (missing format: parashift.program)")
        _check_version(obj)
        progs = [RankProgram.from_json(p) for p in obj["programs"]]
        ranks = {int(r): progs[i] for r, i in obj["ranks"].items()}
        strat = Strategy.parse(obj["strategy"]) if obj.get("strategy") else None
        from .placement import placed_from_meta   # a Place directive's explicit placement
        meta = obj.get("meta", {})
        if meta.get("kind") == "train_step":      # refuse an incomplete training step here, naming the fix
            from .step_meta import StepMeta
            StepMeta.decode(meta)
        return cls(ranks, placed_from_meta(strat, meta), meta)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))

    @classmethod
    def load(cls, path: str) -> "Program":
        try:
            with open(path) as f:
                obj = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ProgramError(f"cannot read program file {path}: {e}") from None
        return cls.from_json(obj)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        return self.to_json() == other.to_json()

    def __hash__(self) -> int:  # programs are values; hash by identity is fine for caches
        return id(self)

    def replace(self, **kw: Any) -> "Program":
        return replace(self, **kw)


def _check_version(obj: dict) -> None:
    """Refuse, in one line naming the fix, a Program file this version cannot read."""
    v = obj.get("version")
    meta = obj.get("meta") or {}
    if v == FORMAT_VERSION or (v == 1 and isinstance(meta, Mapping) and meta.get("kind") != "train_step"):
        return      # format 1 differs only in a training step's meta: switch and rollout Programs read as before
    if v == 1:
        raise ProgramError(f"this plan of {meta.get('model')!r} was written by an older parashift (format 1: no step "
                           f"meta, it names its model instead of carrying it); recompile it with this parashift: "
                           f"`parashift search ... --out plan.json` or `parashift schedule ... --out plan.json`")
    raise ProgramError(f"program format version {v!r} is not {FORMAT_VERSION} (this parashift reads 1 and "
                       f"{FORMAT_VERSION}); recompile it with this parashift, or upgrade parashift to read it")
