"""The tag grammar: every string that names a message, a collective, a payload or a buffer.

Training steps (built by :mod:`parashift.ir.directives`, read by the runtime):

============  =====================================  ==========================================
type          text                                   what
============  =====================================  ==========================================
P2PTag        ``act.c{chunk}.m{mb}``                 activation sent by ``chunk`` to the next
              ``grad.c{chunk}.m{mb}``                input gradient sent back to ``chunk``
TPTag         ``tp.{region}.{phase}.m{mb}``          TP reduction after a region (``fwd``,
                                                     ``bwd``, ``bwd_input``)
EPTag         ``ep.layers.{l}.moe.{which}.{ph}.m{mb}``  MoE ``dispatch`` / ``combine`` all-to-all
SyncTag       ``{dp|edp}.{grad|param}.c{chunk}``     DP gradient sync / ZeRO-1/2 param gather
              ``dp.replica.c{chunk}``               hybrid sharding: the gradient shard's all-reduce across replicas
              ``dp.param.c{chunk}.{region}``         overlap_param: one region's parameter gather
              ``{dp|edp}.grad.c{chunk}.m{mb}[.{region}]``  ZeRO-2/3: one micro-batch's gradient
                                                     reduce-scatter (of one region's bucket)
Z3Tag         ``z3.{param|eparam}.c{c}.{ph}.m{mb}[.{region}]``  ZeRO-3 parameter gather before an
                                                     action (of one region's parameters)
EmbedTag      ``embed.grad``                         tied-embedding gradient all-reduce
Fp8Tag        ``fp8.amax.c{chunk}``                  a chunk's FP8 amax max-reduction (delayed scaling)
SPTag         ``sp.{region}.{ph}.{rs|ag|input}.m{mb}``  sequence-parallel reduce-scatter / all-gather
                                                     / backward input re-gather around a region
CPTag         ``cp.{region}.{ph}.{kv|dkv}.m{mb}``    context-parallel K/V gather / K/V-grad scatter
============  =====================================  ==========================================

Payload keys ``grad:c{chunk}:{dense|expert}``, ``param:c{chunk}:{dense|expert}``,
``grad:embed``, ``ce_stats`` and the sp/cp payloads ``sp_scatter``, ``sp_gather``, ``sp_input``,
``cp_kv``, ``cp_dkv`` (:class:`StepKey`) and buffer names ``act.c{c}.m{mb}[.{region}]``,
``rc.{region}.m{mb}``, ``z3.c{c}.{ph}.m{mb}[.{region}]``, ``z3e.c{c}.{ph}.m{mb}``, ``zg.c{c}.m{mb}[.{region}]``,
``zge.c{c}.m{mb}`` (:class:`StepBuffer`).

Switch Programs (:mod:`parashift.vps.transition`): transfer tags ``s{stage}:{src}>{dst}[:{n}]``
(point-to-point), ``b{stage}:{src}>{d1},{d2}`` (broadcast), ``{s|g}{stage}:{root}:{m1},{m2}``
(scatter / gather), ``a{stage}:{root}:{m1},{m2}`` (all-gather; :class:`TransferTag`); instruction keys ``keep:{stage}``, ``pack:{tag}``,
``unpack:{tag}``, ``buf:{tag}`` (:class:`SwitchKey`); state buffers ``old:{kind}:{tensor}`` and
``new:{kind}:{tensor}`` (:class:`StateBuffer`).

Every type prints as its text (``str``) and ``parse`` inverts it; parse errors raise
ProgramError naming the text and the grammar it breaks.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from operator import add
from typing import Any, Callable, Union

from ..errors import ProgramError
from ..collectives import ACTIVATION_PHASES, OPS

__all__ = ["mb_namer", "mb_head", "mb_names", "Payload", "Axis", "Sync", "A2A", "P2PTag", "TPTag", "EPTag", "SyncTag",
           "Z3Tag", "EmbedTag", "Fp8Tag",
           "SPTag", "CPTag", "StepTag", "parse_tag", "StepKey", "StepBuffer", "TransferTag", "SwitchKey", "StateBuffer",
           "TP_PHASES", "EP_PHASES", "Z3_PHASES", "SP_HOPS", "CP_PARTS", "FLAT_KEYS"]

TP_PHASES = ACTIVATION_PHASES
EP_PHASES = ACTIVATION_PHASES
Z3_PHASES = ("fwd", "bwd")
SP_HOPS = ("rs", "ag", "input")
CP_PARTS = ("kv", "dkv")
FLAT_KEYS = ("ce_stats", "sp_scatter", "sp_gather", "sp_input", "cp_kv", "cp_dkv")


class Payload(str, Enum):
    """What a pipeline message carries."""
    ACT = "act"
    GRAD = "grad"

    def __str__(self) -> str:
        return self.value


class Axis(str, Enum):
    """The data-parallel axis of a gradient sync or parameter gather."""
    DP = "dp"
    EDP = "edp"

    def __str__(self) -> str:
        return self.value


class Sync(str, Enum):
    """What a DP collective moves."""
    GRAD = "grad"
    PARAM = "param"
    REPLICA = "replica"     # hybrid sharding: a reduce-scattered gradient shard all-reduced across replicas

    def __str__(self) -> str:
        return self.value


class A2A(str, Enum):
    """Which MoE all-to-all."""
    DISPATCH = "dispatch"
    COMBINE = "combine"

    def __str__(self) -> str:
        return self.value


def _bad(text: str, what: str) -> ProgramError:
    return ProgramError(f"tag {text!r} is not a valid {what}; tags are built by parashift.ir.tags "
                        f"(see its docstring for the grammar): rebuild the Program with parashift.ir.compile")


def _int(text: str, part: str, prefix: str, what: str) -> int:
    if not part.startswith(prefix) or not part[len(prefix):].isdigit():
        raise _bad(text, what)
    return int(part[len(prefix):])


def _enum(cls, value: str, text: str, what: str):
    try:
        return cls(value)
    except ValueError:
        raise _bad(text, what) from None


def _phase(value: str, allowed: tuple[str, ...], text: str, what: str) -> str:
    if value not in allowed:
        raise _bad(text, what)
    return value


def _check_name(name: str, what: str, forbidden: str = "") -> None:
    if not name or any(ch in name for ch in forbidden) or name != name.strip():
        raise ProgramError(f"{what} {name!r} cannot be written in a tag (empty, padded or holding one of "
                           f"{forbidden!r}); rename it")


# ---- training-step tags --------------------------------------------------------------------------
@dataclass(frozen=True)
class P2PTag:
    """A pipeline message: ``act`` sent by ``chunk``, or ``grad`` sent back to ``chunk``."""
    payload: Payload
    chunk: int
    mb: int

    def __str__(self) -> str:
        return f"{self.payload.value}.c{self.chunk}.m{self.mb}"


@dataclass(frozen=True)
class TPTag:
    """The TP reduction that follows ``region``'s ``phase`` for micro-batch ``mb``."""
    region: str
    phase: str
    mb: int

    def __post_init__(self) -> None:
        _check_name(self.region, "region")
        if self.phase not in TP_PHASES:
            raise ProgramError(f"TP tag phase {self.phase!r} is not one of {TP_PHASES}")

    def __str__(self) -> str:
        return f"tp.{self.region}.{self.phase}.m{self.mb}"


@dataclass(frozen=True)
class EPTag:
    """A MoE all-to-all of layer ``layer``."""
    layer: int
    which: A2A
    phase: str
    mb: int

    def __post_init__(self) -> None:
        if self.phase not in EP_PHASES:
            raise ProgramError(f"EP tag phase {self.phase!r} is not one of {EP_PHASES}")

    def __str__(self) -> str:
        return f"ep.layers.{self.layer}.moe.{self.which.value}.{self.phase}.m{self.mb}"


@dataclass(frozen=True)
class SyncTag:
    """A chunk's DP gradient sync (``grad``), ZeRO-1/2 parameter gather (``param``) or, under hybrid
    sharding, its gradient shard's all-reduce across the shard's replicas (``replica``); ``mb``: the
    micro-batch whose gradients a ZeRO-2/3 reduce-scatter moves (None: the whole step's), ``region``
    the region whose gradient bucket (or, for ``param``, whose parameters) it moves (None: the chunk's)."""
    axis: Axis
    what: Sync
    chunk: int
    mb: int | None = None
    region: str | None = None

    def __post_init__(self) -> None:
        if self.mb is not None and self.what is not Sync.GRAD:
            raise ProgramError(f"only a gradient sync names a micro-batch: {self!r}")
        if self.region is not None:
            if self.mb is None and self.what is Sync.GRAD:
                raise ProgramError(f"a gradient bucket sync names its micro-batch: {self!r}")
            _check_name(self.region, "region")

    def __str__(self) -> str:
        return (f"{self.axis.value}.{self.what.value}.c{self.chunk}" + ("" if self.mb is None else f".m{self.mb}")
                + ("" if self.region is None else f".{self.region}"))


@dataclass(frozen=True)
class Z3Tag:
    """A ZeRO-3 gather of ``chunk``'s parameters (``expert``: its expert parameters; ``region``: only
    that region's) before an action."""
    expert: bool
    chunk: int
    phase: str
    mb: int
    region: str | None = None

    def __post_init__(self) -> None:
        if self.phase not in Z3_PHASES:
            raise ProgramError(f"ZeRO-3 tag phase {self.phase!r} is not one of {Z3_PHASES}")
        if self.region is not None:
            if self.expert:
                raise ProgramError(f"expert parameters are gathered per chunk, not per region: {self!r}")
            _check_name(self.region, "region")

    def __str__(self) -> str:
        return (f"z3.{'eparam' if self.expert else 'param'}.c{self.chunk}.{self.phase}.m{self.mb}"
                + ("" if self.region is None else f".{self.region}"))

    @property
    def buffer(self) -> "StepBuffer":
        """The buffer the gather fills."""
        return StepBuffer("z3e" if self.expert else "z3", chunk=self.chunk, phase=self.phase, mb=self.mb,
                          region=self.region)


@dataclass(frozen=True)
class EmbedTag:
    """The tied-embedding gradient all-reduce between the first and the last stage."""

    def __str__(self) -> str:
        return "embed.grad"


@dataclass(frozen=True)
class Fp8Tag:
    """A chunk's FP8 amax reduction at the end of a step (delayed scaling, :mod:`parashift.fp8`)."""
    chunk: int

    def __str__(self) -> str:
        return f"fp8.amax.c{self.chunk}"


@dataclass(frozen=True)
class SPTag:
    """A sequence-parallel collective around ``region``'s ``phase``: ``rs`` (reduce-scatter), ``ag``
    (all-gather) or ``input`` (the backward's re-gather of the saved input)."""
    region: str
    phase: str
    hop: str
    mb: int

    def __post_init__(self) -> None:
        _check_name(self.region, "region")
        if self.phase not in TP_PHASES or self.hop not in SP_HOPS:
            raise ProgramError(f"SP tag {self!r}: phase must be one of {TP_PHASES}, hop one of {SP_HOPS}")

    def __str__(self) -> str:
        return f"sp.{self.region}.{self.phase}.{self.hop}.m{self.mb}"


@dataclass(frozen=True)
class CPTag:
    """A context-parallel exchange of attention ``region``'s ``phase``: ``kv`` (K/V all-gather) or
    ``dkv`` (K/V-gradient reduce-scatter)."""
    region: str
    phase: str
    part: str
    mb: int

    def __post_init__(self) -> None:
        _check_name(self.region, "region")
        if self.phase not in TP_PHASES or self.part not in CP_PARTS:
            raise ProgramError(f"CP tag {self!r}: phase must be one of {TP_PHASES}, part one of {CP_PARTS}")

    def __str__(self) -> str:
        return f"cp.{self.region}.{self.phase}.{self.part}.m{self.mb}"


StepTag = Union[P2PTag, TPTag, EPTag, SyncTag, Z3Tag, EmbedTag, SPTag, CPTag, Fp8Tag]


def mb_namer(tag_at: Callable[[int], Any]) -> Callable[[int], str]:
    """``mb -> str(tag_at(mb))`` for a record whose text ends in ``.m<mb>`` (the per-micro-batch tags and
    buffers of a training step), the record built and checked once: a compiler names hundreds of
    thousands of them, one per micro-batch of the same region."""
    head = mb_head(tag_at)
    return lambda mb: f"{head}{mb}"


def mb_head(tag_at: Callable[[int], Any]) -> str:
    """The text of ``str(tag_at(mb))`` before the micro-batch number (see :func:`mb_namer`)."""
    text = str(tag_at(0))
    if not text.endswith(".m0"):
        raise ProgramError(f"{text!r} does not end in the micro-batch ('.m0'); name it with str()")
    return text[:-1]


def mb_names(heads: list, mbs: list, head_of: Callable[[Any], str]) -> list[str]:
    """``[head_of(h) + str(mb) for h, mb in zip(heads, mbs)]``: per-micro-batch tags or buffer names,
    ``head_of`` (the text before the micro-batch, see :func:`mb_head`) called once per distinct ``h``."""
    text = {h: head_of(h) for h in dict.fromkeys(heads)}
    return list(map(add, map(text.__getitem__, heads), map(str, mbs)))


def parse_tag(text: str) -> StepTag:
    """The training-step tag ``text`` as a typed value (inverse of ``str``)."""
    head, _, rest = text.partition(".")
    if head in ("act", "grad") and rest:
        parts = rest.split(".")
        if len(parts) != 2:
            raise _bad(text, "pipeline tag act|grad.c<chunk>.m<mb>")
        what = "pipeline tag"
        return P2PTag(Payload(head), _int(text, parts[0], "c", what), _int(text, parts[1], "m", what))
    if head == "tp":
        what = "TP tag tp.<region>.<phase>.m<mb>"
        parts = rest.rsplit(".", 2)
        if len(parts) != 3 or not parts[0]:
            raise _bad(text, what)
        return TPTag(parts[0], _phase(parts[1], TP_PHASES, text, what), _int(text, parts[2], "m", what))
    if head in ("sp", "cp"):
        what = f"{head.upper()} tag {head}.<region>.<phase>.<{'rs|ag|input' if head == 'sp' else 'kv|dkv'}>.m<mb>"
        parts = rest.rsplit(".", 3)
        if len(parts) != 4 or not parts[0]:
            raise _bad(text, what)
        allowed = SP_HOPS if head == "sp" else CP_PARTS
        cls = SPTag if head == "sp" else CPTag
        return cls(parts[0], _phase(parts[1], TP_PHASES, text, what), _phase(parts[2], allowed, text, what),
                   _int(text, parts[3], "m", what))
    if head == "ep":
        what = "EP tag ep.layers.<l>.moe.<dispatch|combine>.<phase>.m<mb>"
        parts = rest.split(".")
        if len(parts) != 6 or parts[0] != "layers" or parts[2] != "moe":
            raise _bad(text, what)
        return EPTag(_int(text, parts[1], "", what), _enum(A2A, parts[3], text, what),
                     _phase(parts[4], EP_PHASES, text, what), _int(text, parts[5], "m", what))
    if head in ("dp", "edp"):
        what = "DP tag dp|edp.grad.c<chunk>[.m<mb>[.<region>]] or dp|edp.param.c<chunk>[.<region>]"
        if rest.startswith("param."):
            parts = rest.split(".", 2) + [""]
            if len(parts) == 4 and not parts[2]:
                raise _bad(text, what)
            return SyncTag(Axis(head), Sync.PARAM, _int(text, parts[1], "c", what), None, parts[2] or None)
        parts = rest.split(".", 3)
        if len(parts) < 2 or (len(parts) > 2 and parts[0] != "grad") or (len(parts) == 4 and not parts[3]):
            raise _bad(text, what)
        mb = _int(text, parts[2], "m", what) if len(parts) > 2 else None
        return SyncTag(Axis(head), _enum(Sync, parts[0], text, what), _int(text, parts[1], "c", what), mb,
                       parts[3] if len(parts) == 4 else None)
    if head == "z3":
        what = "ZeRO-3 tag z3.param|eparam.c<chunk>.<phase>.m<mb>[.<region>]"
        parts = rest.split(".", 4)
        if len(parts) < 4 or parts[0] not in ("param", "eparam") or (len(parts) == 5 and not parts[4]):
            raise _bad(text, what)
        return Z3Tag(parts[0] == "eparam", _int(text, parts[1], "c", what),
                     _phase(parts[2], Z3_PHASES, text, what), _int(text, parts[3], "m", what),
                     parts[4] if len(parts) == 5 else None)
    if text == "embed.grad":
        return EmbedTag()
    if head == "fp8":
        what = "FP8 tag fp8.amax.c<chunk>"
        parts = rest.split(".")
        if len(parts) != 2 or parts[0] != "amax":
            raise _bad(text, what)
        return Fp8Tag(_int(text, parts[1], "c", what))
    raise _bad(text, "training-step tag")


@dataclass(frozen=True)
class StepKey:
    """A training-step payload key: ``grad``/``param`` of a chunk's ``dense``/``expert`` parameters,
    ``grad:embed`` (``chunk`` None, ``family`` "embed") or a flat key (``what`` one of
    :data:`FLAT_KEYS`: ``ce_stats`` and the sp/cp payloads)."""
    what: str
    chunk: int | None = None
    family: str | None = None

    def __post_init__(self) -> None:
        ok = ((self.what in FLAT_KEYS and self.chunk is None and self.family is None)
              or (self.what == "grad" and self.chunk is None and self.family == "embed")
              or (self.what in ("grad", "param") and self.chunk is not None and self.family in ("dense", "expert")))
        if not ok:
            raise ProgramError(f"payload key {self!r} is none of grad|param:c<chunk>:dense|expert, grad:embed, "
                               f"{', '.join(FLAT_KEYS)}")

    def __str__(self) -> str:
        if self.what in FLAT_KEYS:
            return self.what
        if self.chunk is None:
            return f"{self.what}:{self.family}"
        return f"{self.what}:c{self.chunk}:{self.family}"

    @classmethod
    def parse(cls, text: str) -> "StepKey":
        what = "payload key"
        if text in FLAT_KEYS:
            return cls(text)
        parts = text.split(":")
        if parts == ["grad", "embed"]:
            return cls("grad", None, "embed")
        if len(parts) != 3 or parts[0] not in ("grad", "param") or parts[2] not in ("dense", "expert"):
            raise _bad(text, what)
        return cls(parts[0], _int(text, parts[1], "c", what), parts[2])


@dataclass(frozen=True)
class StepBuffer:
    """A training-step buffer: ``act`` (a chunk's activations of a micro-batch, or one region's where
    the chunk's regions are separate instructions), ``rc`` (a region's
    recomputed activations), ``z3`` / ``z3e`` (a ZeRO-3 gathered dense / expert parameter copy),
    ``zg`` / ``zge`` (ZeRO-2/3: a chunk's full-size dense / expert gradient of one micro-batch)."""
    kind: str
    mb: int
    chunk: int | None = None
    region: str | None = None
    phase: str | None = None

    def __post_init__(self) -> None:
        ok = ((self.kind in ("act", "zg", "zge") and self.chunk is not None and self.phase is None
               and (self.region is None or self.kind in ("act", "zg")))
              or (self.kind == "rc" and self.region is not None and self.chunk is None and self.phase is None)
              or (self.kind in ("z3", "z3e") and self.chunk is not None and self.phase in Z3_PHASES
                  and (self.region is None or self.kind == "z3")))
        if not ok:
            raise ProgramError(f"buffer {self!r} is none of act|zg|zge.c<c>.m<mb>, act|zg.c<c>.m<mb>.<region>, rc.<region>.m<mb>, "
                               f"z3|z3e.c<c>.<fwd|bwd>.m<mb>")
        if self.region is not None:
            _check_name(self.region, "region")

    @classmethod
    def act_names(cls, chunks: list, mbs: list, regions: list) -> list[str]:
        """``[str(StepBuffer("act", mb, chunk=chunk, region=region)) ...]``, each distinct (chunk, region)
        checked once (a compiler names hundreds of thousands of them)."""
        parts = {}
        for chunk, region in dict.fromkeys(zip(chunks, regions)):
            cls("act", 0, chunk=chunk, region=region)
            parts[(chunk, region)] = (f"act.c{chunk}.m", "" if region is None else f".{region}")
        head, tail = zip(*map(parts.__getitem__, zip(chunks, regions))) if chunks else ((), ())
        return list(map(add, map(add, head, map(str, mbs)), tail))

    def __str__(self) -> str:
        if self.kind in ("act", "zg", "zge"):
            return f"{self.kind}.c{self.chunk}.m{self.mb}" + ("" if self.region is None else f".{self.region}")
        if self.kind == "rc":
            return f"rc.{self.region}.m{self.mb}"
        return f"{self.kind}.c{self.chunk}.{self.phase}.m{self.mb}" + ("" if self.region is None else f".{self.region}")

    @classmethod
    def parse(cls, text: str) -> "StepBuffer":
        what = "training-step buffer name"
        head, _, rest = text.partition(".")
        if head == "rc":
            region, _, m = rest.rpartition(".")
            if not region:
                raise _bad(text, what)
            return cls("rc", _int(text, m, "m", what), region=region)
        parts = rest.split(".")
        if head in ("act", "zg", "zge") and len(parts) == 2:
            return cls(head, _int(text, parts[1], "m", what), chunk=_int(text, parts[0], "c", what))
        if head in ("act", "zg") and len(parts) > 2:
            return cls(head, _int(text, parts[1], "m", what), chunk=_int(text, parts[0], "c", what),
                       region=".".join(parts[2:]))
        if head in ("z3", "z3e") and len(parts) >= 3 and (len(parts) == 3 or head == "z3"):
            return cls(head, _int(text, parts[2], "m", what), chunk=_int(text, parts[0], "c", what),
                       phase=_phase(parts[1], Z3_PHASES, text, what),
                       region=".".join(parts[3:]) if len(parts) > 3 else None)
        raise _bad(text, what)


# ---- switch tags ------------------------------------------------------------------------------------
#: Each switch transfer op's tag letter, from the op table (a send and a scatter share ``s``: a
#: send's tag has ``>``).
TRANSFER_LETTERS = {o.name: o.letter for o in OPS.values()}
_TRANSFER_OPS = TRANSFER_LETTERS
_BY_LETTER = {o.letter: o.name for o in OPS.values() if o.chunked}


@dataclass(frozen=True)
class TransferTag:
    """A switch transfer: ``send`` from ``root`` to ``peers[0]`` (``part``: which of several
    uncoalesced messages of the pair), ``broadcast`` from ``root`` to ``peers``, ``scatter`` /
    ``gather`` rooted at ``root`` with ``peers`` the other members, or ``all_gather`` with
    ``peers`` every member."""
    op: str
    stage: int
    root: int
    peers: tuple[int, ...]
    part: int | None = None

    def __post_init__(self) -> None:
        if self.op not in _TRANSFER_OPS:
            raise ProgramError(f"transfer op {self.op!r} is not one of {tuple(_TRANSFER_OPS)}")
        if self.op != "send" and self.part is not None:
            raise ProgramError(f"only a send transfer has a part number: {self!r}")
        if self.op == "send" and len(self.peers) != 1:
            raise ProgramError(f"a send transfer has exactly one peer: {self!r}")
        if not self.peers:
            raise ProgramError(f"a {self.op} transfer needs peers: {self!r}")

    def __str__(self) -> str:
        peers = ",".join(map(str, self.peers))
        if self.op == "send":
            return f"s{self.stage}:{self.root}>{peers}" + ("" if self.part is None else f":{self.part}")
        if self.op == "broadcast":
            return f"b{self.stage}:{self.root}>{peers}"
        return f"{_TRANSFER_OPS[self.op]}{self.stage}:{self.root}:{peers}"

    @classmethod
    def parse(cls, text: str) -> "TransferTag":
        what = "switch transfer tag"
        parts = text.split(":")
        if not parts[0] or parts[0][0] not in set(TRANSFER_LETTERS.values()) or len(parts) not in (2, 3):
            raise _bad(text, what)
        stage = _int(text, parts[0][1:], "", what)
        code = parts[0][0]

        def ints(s: str) -> tuple[int, ...]:
            xs = s.split(",")
            if not all(x.isdigit() for x in xs):
                raise _bad(text, what)
            return tuple(int(x) for x in xs)
        if ">" in parts[1]:
            src, _, dst = parts[1].partition(">")
            root = _int(text, src, "", what)
            if code == "s":
                part = _int(text, parts[2], "", what) if len(parts) == 3 else None
                return cls("send", stage, root, (_int(text, dst, "", what),), part)
            if code == "b" and len(parts) == 2:
                return cls("broadcast", stage, root, ints(dst))
            raise _bad(text, what)
        if code in _BY_LETTER and len(parts) == 3:
            return cls(_BY_LETTER[code], stage, _int(text, parts[1], "", what), ints(parts[2]))
        raise _bad(text, what)


@dataclass(frozen=True)
class SwitchKey:
    """A switch instruction's key: ``keep`` (copy stage ``stage``'s kept pieces), ``pack`` /
    ``unpack`` (copy a transfer's pieces into / out of its buffer), ``buf`` (the buffer a
    send / recv / collective moves)."""
    action: str
    stage: int | None = None
    transfer: str | None = None

    def __post_init__(self) -> None:
        if self.action == "keep":
            ok = self.stage is not None and self.transfer is None
        else:
            ok = self.action in ("pack", "unpack", "buf") and self.stage is None and bool(self.transfer)
        if not ok:
            raise ProgramError(f"switch key {self!r} is none of keep:<stage>, pack|unpack|buf:<transfer tag>")

    def __str__(self) -> str:
        return f"keep:{self.stage}" if self.action == "keep" else f"{self.action}:{self.transfer}"

    @classmethod
    def parse(cls, text: str) -> "SwitchKey":
        action, _, arg = text.partition(":")
        if action == "keep":
            return cls("keep", stage=_int(text, arg, "", "switch key keep:<stage>"))
        if action in ("pack", "unpack", "buf") and arg:
            return cls(action, transfer=arg)
        raise _bad(text, "switch key")

    @property
    def transfer_tag(self) -> TransferTag:
        """The parsed transfer tag (not for ``keep``)."""
        if self.transfer is None:
            raise ProgramError(f"switch key {self} names no transfer")
        return TransferTag.parse(self.transfer)


@dataclass(frozen=True)
class StateBuffer:
    """A switch's state buffer: the ``old`` or ``new`` layout's ``kind`` (param, master, ...) of ``tensor``."""
    which: str
    kind: str
    tensor: str

    def __post_init__(self) -> None:
        if self.which not in ("old", "new"):
            raise ProgramError(f"state buffer side {self.which!r} is not old or new")
        _check_name(self.kind, "state kind", ":")
        _check_name(self.tensor, "tensor name")

    def __str__(self) -> str:
        return f"{self.which}:{self.kind}:{self.tensor}"

    @classmethod
    def parse(cls, text: str) -> "StateBuffer":
        parts = text.split(":", 2)
        if len(parts) != 3 or parts[0] not in ("old", "new"):
            raise _bad(text, "state buffer name old|new:<kind>:<tensor>")
        return cls(*parts)
