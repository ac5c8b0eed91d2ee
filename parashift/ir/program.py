"""The Program: the contract between the compiler, the simulator and the runtime.

For every rank, for every logical stream, an ordered list of instructions with explicit
dependencies. Ranks whose programs are identical share one :class:`RankProgram` object, and
instructions may name groups and peers *symbolically* (``group="tp"``, ``peer="pp+1"``),
resolved per rank through the strategy's rank grid; this keeps a 1024-rank program as small
as its distinct pipeline stages. Switch programs use concrete device tuples instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Iterator, Mapping

from ..errors import ProgramError
from ..strategy import Strategy

__all__ = ["Instr", "RankProgram", "Program", "COMPUTE", "COMM_OPS", "PHASES", "FORMAT_VERSION",
           "TIMELINE_COLUMNS", "TIMELINE_KINDS"]

FORMAT_VERSION = 1
COMPUTE = "compute"
COMM_OPS = ("send", "recv", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
            "scatter", "gather", "copy")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "gather")
PHASES = ("fwd", "bwd", "bwd_input", "bwd_weight", "optim", "recompute")
Group = "tuple[int, ...] | str | None"

#: A timeline records one executed instruction per row (simulated by ``parashift.sim``, measured by
#: ``parashift.exec``'s profiler), times in seconds; the column kinds are int, float, text, and
#: ``?`` for nullable. ``rank`` may be absent from a saved timeline.
TIMELINE_KINDS = {"rank": "int", "device": "int", "stream": "text", "id": "int", "op": "text", "phase": "text?",
                  "microbatch": "int?", "start": "float", "end": "float", "nbytes": "int", "flops": "float"}
TIMELINE_COLUMNS = tuple(TIMELINE_KINDS)


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of one rank.

    ``op``: ``compute`` or a comm kind in COMM_OPS. Compute ops carry ``phase`` (PHASES),
    ``stage`` (pipeline stage), ``chunk`` (virtual stage), ``microbatch``, ``region`` (what part
    of the chunk runs: ``None`` = the whole chunk) and ``flops``. Comm ops carry ``nbytes`` (what
    this rank contributes/receives: the message for p2p, the buffer for collectives), ``peer``
    (p2p) or ``group`` (collectives; ranks or an axis name such as ``"tp"``), ``root`` (rooted
    collectives) and ``tag`` (equal on a send and its recv, and on all members of a collective).
    ``alloc``/``free``: named buffers (and byte sizes) this instruction creates or releases.
    ``key``: an opaque payload name the runtime uses (e.g. which state buffer to pack).
    """

    id: int
    op: str
    stream: str = "compute"
    deps: tuple[int, ...] = ()
    phase: str | None = None
    stage: int | None = None
    chunk: int | None = None
    microbatch: int | None = None
    region: str | None = None
    flops: float = 0.0
    nbytes: int = 0
    peer: int | str | None = None
    group: tuple[int, ...] | str | None = None
    root: int | None = None
    tag: str | None = None
    key: str | None = None
    alloc: tuple[tuple[str, int], ...] = ()
    free: tuple[str, ...] = ()

    @classmethod
    def make(cls, **fields: Any) -> "Instr":
        """Fast constructor for compilers: the same instruction as ``Instr(**fields)``, built without
        the frozen dataclass's per-field ``__setattr__`` (``id`` and ``op`` are required)."""
        if not fields.keys() <= _INSTR_FIELDS:
            raise TypeError(f"unknown Instr fields {sorted(fields.keys() - _INSTR_FIELDS)}")
        obj = object.__new__(_RawInstr)
        obj.id, obj.op = fields["id"], fields["op"]
        for k, v in _INSTR_DEFAULTS.items():
            setattr(obj, k, fields.get(k, v))
        obj.__class__ = cls
        return obj

    @property
    def is_compute(self) -> bool:
        return self.op == COMPUTE

    @property
    def is_p2p(self) -> bool:
        return self.op in ("send", "recv")

    @property
    def is_collective(self) -> bool:
        return self.op in COLLECTIVES

    def __str__(self) -> str:
        """Compact text: ``7 compute stream=compute deps=3,5 phase=fwd chunk=1 microbatch=2``."""
        parts = [str(self.id), self.op]
        for f in fields(self)[2:]:
            v = getattr(self, f.name)
            if v == f.default:
                continue
            if f.name == "deps":
                v = ",".join(map(str, v))
            elif f.name == "group" and isinstance(v, tuple):
                v = "(" + ",".join(map(str, v)) + ")"
            elif f.name == "alloc":
                v = ",".join(f"{n}:{b}" for n, b in v)
            elif f.name == "free":
                v = ",".join(v)
            elif isinstance(v, float):
                v = repr(v)
            parts.append(f"{f.name}={v}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> "Instr":
        """Inverse of ``str()``."""
        tok = text.split()
        if len(tok) < 2:
            raise ProgramError(f"cannot parse instruction {text!r}; expected '<id> <op> key=value ...'")
        kw: dict[str, Any] = {"id": int(tok[0]), "op": tok[1]}
        for t in tok[2:]:
            k, _, v = t.partition("=")
            if k in ("deps",):
                kw[k] = tuple(int(x) for x in v.split(",") if x)
            elif k == "group":
                kw[k] = tuple(int(x) for x in v.strip("()").split(",") if x) if v.startswith("(") else v
            elif k == "peer":
                kw[k] = int(v) if v.lstrip("-").isdigit() else v
            elif k == "alloc":
                kw[k] = tuple((n, int(b)) for n, b in (x.rsplit(":", 1) for x in v.split(",") if x))
            elif k == "free":
                kw[k] = tuple(x for x in v.split(",") if x)
            elif k in ("stage", "chunk", "microbatch", "nbytes", "root"):
                kw[k] = int(v)
            elif k == "flops":
                kw[k] = float(v)
            elif k in ("stream", "phase", "region", "tag", "key"):
                kw[k] = v
            else:
                raise ProgramError(f"unknown instruction field {k!r} in {text!r}")
        return cls(**kw)

    def to_json(self) -> list:
        """Compact JSON: [id, op, {non-default fields}]."""
        extra = {}
        for f in fields(self)[2:]:
            v = getattr(self, f.name)
            if v != f.default:
                extra[f.name] = list(map(list, v)) if f.name == "alloc" else (list(v) if isinstance(v, tuple) else v)
        return [self.id, self.op, extra]

    @classmethod
    def from_json(cls, obj: list) -> "Instr":
        i, op, extra = obj
        kw = dict(extra)
        for k in ("deps", "free"):
            if k in kw:
                kw[k] = tuple(kw[k])
        if isinstance(kw.get("group"), list):
            kw["group"] = tuple(kw["group"])
        if "alloc" in kw:
            kw["alloc"] = tuple((n, int(b)) for n, b in kw["alloc"])
        if "flops" in kw:
            kw["flops"] = float(kw["flops"])
        return cls(id=i, op=op, **kw)


_INSTR_DEFAULTS = {f.name: f.default for f in fields(Instr)[2:]}
_INSTR_FIELDS = frozenset(f.name for f in fields(Instr))


class _RawInstr:
    """An Instr's slots without the frozen ``__setattr__``: compilers fill one, then make it an Instr
    (``obj.__class__ = Instr``; same layout), at a third of the frozen constructor's cost."""

    __slots__ = Instr.__slots__


assert _RawInstr.__slots__ == tuple(f.name for f in fields(Instr))


def instrs_from_columns(*columns: Iterable) -> list[Instr]:
    """Instructions from one column per field, in field order (``id, op, stream, deps, phase, stage,
    chunk, microbatch, region, flops, nbytes, peer, group, root, tag, key, alloc, free``), each exactly
    as ``Instr(*row)`` would be, built without the frozen dataclass's ``__setattr__``."""
    if len(columns) != len(_RawInstr.__slots__):
        raise TypeError(f"instrs_from_columns takes {len(_RawInstr.__slots__)} columns, not {len(columns)}")
    new, raw, cls, out = object.__new__, _RawInstr, Instr, []
    append = out.append
    for (id_, op, stream, deps, phase, stage, chunk, microbatch, region, flops, nbytes, peer, group, root, tag, key,
         alloc, free) in zip(*columns):
        o = new(raw)
        o.id = id_
        o.op = op
        o.stream = stream
        o.deps = deps
        o.phase = phase
        o.stage = stage
        o.chunk = chunk
        o.microbatch = microbatch
        o.region = region
        o.flops = flops
        o.nbytes = nbytes
        o.peer = peer
        o.group = group
        o.root = root
        o.tag = tag
        o.key = key
        o.alloc = alloc
        o.free = free
        o.__class__ = cls
        append(o)
    return out


@dataclass(frozen=True)
class RankProgram:
    """One rank's streams (name -> ordered instructions) and its static memory (name -> bytes)."""

    streams: Mapping[str, tuple[Instr, ...]]
    static_memory: Mapping[str, int] = field(default_factory=dict)

    def instrs(self) -> Iterator[Instr]:
        for s in self.streams.values():
            yield from s

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams.values())

    def to_json(self) -> dict:
        return {"streams": {k: [i.to_json() for i in v] for k, v in self.streams.items()},
                "static_memory": dict(self.static_memory)}

    @classmethod
    def from_json(cls, obj: dict) -> "RankProgram":
        return cls({k: tuple(Instr.from_json(i) for i in v) for k, v in obj["streams"].items()},
                   dict(obj.get("static_memory", {})))


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
        from .validate import validate_program
        validate_program(self)
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
        if obj.get("format") != "parashift.program":
            raise ProgramError("not a parashift program file (missing format: parashift.program)")
        if obj.get("version") != FORMAT_VERSION:
            raise ProgramError(f"program format version {obj.get('version')} is not {FORMAT_VERSION}; "
                               f"recompile it with this parashift")
        progs = [RankProgram.from_json(p) for p in obj["programs"]]
        ranks = {int(r): progs[i] for r, i in obj["ranks"].items()}
        strat = Strategy.parse(obj["strategy"]) if obj.get("strategy") else None
        from .placement import placed_from_meta   # a Place directive's explicit placement
        return cls(ranks, placed_from_meta(strat, obj.get("meta", {})), obj.get("meta", {}))

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
