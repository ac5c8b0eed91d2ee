"""The switch Program's metadata as a type, with its one codec, and the names its instructions use.

:func:`lower` stores ``SwitchMeta.encode()`` (plain JSON) in ``Program.meta``; every consumer (the
executor, staged release, the live planner, the simulator's switch result) reads it back with
:meth:`SwitchMeta.of`. ``pieces`` lists every destination piece, kept ones included: a piece with
transfer ``-1`` is kept on its device (``src == dst``) and copied by ``keep:<stage>``.

Transfer tags, instruction keys and buffer names (``keep:<stage>``, ``pack:<tag>``,
``unpack:<tag>``, ``buf:<tag>``, ``old:<kind>:<tensor>``, ``new:<kind>:<tensor>``) follow the one
tag grammar of :mod:`parashift.ir.tags`; here they are spelled only by :func:`switch_name` and read
only by :func:`parse_switch_name` (a transfer's tag is an opaque
id: ``SwitchMeta.transfers`` maps it to its transfer).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping

import numpy as np

from ...errors import ProgramError
from ...ir import tags as T
from ...collectives import OPS

__all__ = ["PieceTable", "SwitchMeta", "switch_name", "parse_switch_name", "NAMES"]

#: What a switch name can say: per instruction or buffer, the parts after its first colon.
NAMES = {"keep": 1, "pack": 1, "unpack": 1, "buf": 1, "old": 2, "new": 2}


def switch_name(what: str, *parts: object) -> str:
    """Every name a switch Program spells, through the one tag grammar (:mod:`parashift.ir.tags`):
    an instruction key or buffer name (``what`` in :data:`NAMES`: ``switch_name("old", kind,
    tensor)``), or a transfer's tag (``what`` a transfer op: ``switch_name(op, stage, root,
    members)`` with the receivers of a send or broadcast, the other members of a scatter or gather,
    every member of an all_gather; a send may add the row of its one piece when transfers are not
    coalesced)."""
    if what in OPS:
        stage, root, members, *piece = parts
        return str(T.TransferTag(what, int(stage), int(root), tuple(int(m) for m in members),
                                 int(piece[0]) if piece else None))
    if NAMES.get(what) != len(parts):
        raise ProgramError(f"switch name {what!r} takes {NAMES.get(what)} part(s), got {parts!r}")
    if what in ("old", "new"):
        return str(T.StateBuffer(what, str(parts[0]), str(parts[1])))
    if what == "keep":
        return str(T.SwitchKey("keep", stage=int(parts[0])))
    return str(T.SwitchKey(what, transfer=str(parts[0])))


def parse_switch_name(text: str) -> tuple[str, tuple[str, ...]]:
    """``(what, parts)`` of a name :func:`switch_name` built (a tag may itself hold colons)."""
    what = text.partition(":")[0]
    if what in ("old", "new"):
        b = T.StateBuffer.parse(text)
        return what, (b.kind, b.tensor)
    if what in NAMES:
        k = T.SwitchKey.parse(text)
        return what, (str(k.stage) if what == "keep" else k.transfer,)
    raise ProgramError(f"{text!r} is not a switch Program key or buffer name ({', '.join(NAMES)})")


_COLUMNS = ("tensor", "kind", "src", "dst", "lo", "hi", "nbytes", "stage", "transfer", "offset")


@dataclass(frozen=True, eq=False)
class PieceTable:
    """Every destination piece as int64 columns: (tensor, kind) indices into the meta's names, the
    device it comes from and goes to, its box ``[lo, hi)`` (rows of ``dims`` coordinates, padded
    with unit dims), bytes, stage, transfer (``-1``: kept) and byte offset in the transfer's full
    buffer (``-1`` when kept)."""

    tensor: np.ndarray
    kind: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray
    stage: np.ndarray
    transfer: np.ndarray
    offset: np.ndarray

    def __len__(self) -> int:
        return len(self.tensor)

    def encode(self) -> dict[str, list[int]]:
        return {c: np.asarray(getattr(self, c), dtype=np.int64).ravel().tolist() for c in _COLUMNS}

    @classmethod
    def decode(cls, obj: Mapping[str, Any], dims: int) -> "PieceTable":
        try:
            cols = {c: np.asarray(obj[c], dtype=np.int64) for c in _COLUMNS}
        except KeyError as e:
            raise ProgramError(f"switch Program pieces lack column {e}; re-lower the switch") from None
        cols["lo"], cols["hi"] = cols["lo"].reshape(-1, dims), cols["hi"].reshape(-1, dims)
        return cls(**cols)


@dataclass(frozen=True, eq=False)
class SwitchMeta:
    """What a switch Program moves: names, pieces, transfers and totals (module doc); ``staged``:
    old and new state exceed the memory budget (release old state stage by stage); then how it
    was lowered: ``cluster``, ``options``, ``lower_seconds``, ``memory_budget`` (bytes per device,
    ``"per-device"`` or None); ``bytes_inter_node``: moved bytes whose source and destination sit on
    different nodes (hosts) of that cluster."""

    model: str
    src: str
    dst: str
    src_devices: str
    dst_devices: str
    kinds: tuple[str, ...]
    tensors: tuple[str, ...]
    stages: int
    align: int
    dims: int
    transfers: tuple[str, ...]
    pieces: PieceTable
    bytes_moved: int
    bytes_kept: int
    messages: int
    collectives: Mapping[str, int]
    staged: bool = False
    cluster: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    lower_seconds: float = 0.0
    memory_budget: "float | str | None" = None
    bytes_inter_node: int = 0

    def encode(self) -> dict:
        """The JSON-able ``Program.meta`` of a switch (``kind == "switch"``)."""
        out: dict[str, Any] = {"kind": "switch"}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "pieces":
                v = v.encode()
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out

    @classmethod
    def decode(cls, meta: Mapping[str, Any]) -> "SwitchMeta":
        if meta.get("kind") != "switch":
            raise ProgramError("not a switch Program (meta kind is not 'switch'); lower one with "
                               "parashift.vps.transition.lower")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in meta:
                if f.default is not MISSING or f.default_factory is not MISSING:
                    continue
                raise ProgramError(f"switch Program meta lacks {f.name!r}; re-lower the switch")
            v = meta[f.name]
            if f.name == "pieces":
                v = PieceTable.decode(v, int(meta["dims"]))
            elif f.name in ("kinds", "tensors", "transfers"):
                v = tuple(v)
            kw[f.name] = v
        return cls(**kw)

    @classmethod
    def of(cls, program: Any) -> "SwitchMeta":
        """The decoded metadata of switch ``program``."""
        return cls.decode(program.meta)

    def transfer_stage(self) -> np.ndarray:
        """Stage of every transfer id."""
        out = np.zeros(len(self.transfers), dtype=np.int64)
        moved = self.pieces.transfer >= 0
        out[self.pieces.transfer[moved]] = self.pieces.stage[moved]
        return out
