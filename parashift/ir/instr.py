"""Instructions: the records a Program is made of, below the Program and its validator.

An :class:`Instr` is one instruction of one rank (compute, or a comm op of :data:`COMM_OPS`); a
:class:`RankProgram` is one rank's streams of them. :mod:`parashift.ir.validate` checks these
records and :class:`~parashift.ir.program.Program` (which re-exports them) holds one per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Iterator, Mapping

from ..collectives import COLLECTIVES, COMM_OPS, COMPUTE, P2P_OPS, PHASES
from ..errors import ProgramError

__all__ = ["Instr", "RankProgram", "COMPUTE", "COMM_OPS", "COLLECTIVES", "PHASES", "instrs_from_columns"]

Group = "tuple[int, ...] | str | None"


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
        return self.op in P2P_OPS

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
