"""Every op and compute phase a Program's instructions use: the one table the IR (``ir.program``,
``ir.validate``, ``ir.directives``), the tag grammar (``ir.tags``), the cost model, the simulator,
the switch planner's promotion and the executor read. It sits below every layer, beside ``units``
and ``states``.

An op is ``compute``, a point-to-point message (``send`` at one end, ``recv`` at the other), a
``copy`` between two buffers, or a collective over a group. The *switch transfer* ops
(:data:`OPS`: those with a tag letter) carry more: a transfer moves one buffer. Its *full* buffer
is ``nbytes`` long; for a *chunked* op it is ``len(group)`` chunks of ``chunk`` bytes in group
order, chunk ``p`` belonging to ``group[p]``. Per transfer op the table says who sends and who
receives, which chunks travel from whom to whom (each is checksummed at both ends), how many bytes
each member holds, packs or receives, where a member's local buffer starts in the full one, and how
many bytes each member's links carry (the ring or chain a collective runs as). Adding a switch
collective is one :class:`Op` here, a promotion pass in :mod:`parashift.vps.transition.transfers`
and one executor handler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["Op", "PROGRAM_OPS", "COMPUTE", "COMM_OPS", "COLLECTIVES", "P2P_OPS", "TWO_ENDED_OPS", "OPS",
           "COLLECTIVE_OPS", "op", "Phase", "PHASE_TABLE", "PHASES", "MODEL_PHASES", "BACKWARD_PHASES", "ACTIVATION_PHASES"]

COMPUTE = "compute"


@dataclass(frozen=True)
class Op:
    """One op. ``kind``: ``compute``, ``p2p`` (a message between two devices: ``send`` at one end,
    ``recv`` at the other), ``copy`` (between two buffers, priced like a message) or ``collective``
    (over a group); ``rooted``: one member (``root``) is special.

    The rest describe switch transfer ops only: ``letter``: the transfer tags' first letter
    (:class:`parashift.ir.tags.TransferTag` spells them; empty: not a transfer op); ``chunked``:
    the full buffer is one chunk per member; ``whole``: which members hold the full buffer (``"all"``,
    ``"root"``); ``chunk_from``: who sends chunk ``p`` (``"owner"``: ``group[p]``, ``"root"``),
    ``chunk_to``: who receives it (``"owner"``, ``"root"``, ``"others"``: every member but its owner);
    ``owners``: which members own a chunk that travels (``"all"`` or ``"non-root"``)."""

    name: str
    kind: str = "collective"
    letter: str = ""
    rooted: bool = True
    chunked: bool = False
    whole: str = "all"
    chunk_from: str = "root"
    chunk_to: str = "others"
    owners: str = "non-root"

    @property
    def p2p(self) -> bool:
        """A message between two devices (``send``/``recv``)."""
        return self.kind == "p2p"

    @property
    def collective(self) -> bool:
        """An op over a group of devices."""
        return self.kind == "collective"

    @property
    def two_ended(self) -> bool:
        """Runs between a source and a destination device (a message or a copy)."""
        return self.kind in ("p2p", "copy")

    @property
    def transfer(self) -> bool:
        """A switch transfer op (it has a tag letter)."""
        return bool(self.letter)

    # ---- who --------------------------------------------------------------------------------------
    def senders(self, root: int, group: tuple[int, ...], peer: int = -1) -> tuple[int, ...]:
        """Members that pack (part of) the buffer and put it on the wire."""
        if not self.chunked:
            return (root,)
        return tuple(sorted({self._from(m, root) for m in self._owners(root, group)}))

    def receivers(self, root: int, group: tuple[int, ...], peer: int = -1) -> tuple[int, ...]:
        """Members that get (part of) the buffer and unpack it."""
        if self.name == "send":
            return (peer,)
        if not self.chunked:
            return tuple(m for m in group if m != root)
        return tuple(sorted({d for m in self._owners(root, group) for d in self._to(m, root, group)}))

    def _owners(self, root: int, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(group) if self.owners == "all" else tuple(m for m in group if m != root)

    def _from(self, owner: int, root: int) -> int:
        return owner if self.chunk_from == "owner" else root

    def _to(self, owner: int, root: int, group: tuple[int, ...]) -> tuple[int, ...]:
        if self.chunk_to == "owner":
            return (owner,)
        if self.chunk_to == "root":
            return (root,)
        return tuple(m for m in group if m != owner)

    def chunks_sent(self, device: int, root: int, group: tuple[int, ...]) -> tuple[int, ...]:
        """Owners of the chunks ``device`` sends (one checksum each); ``()`` for an unchunked op."""
        if not self.chunked:
            return ()
        return tuple(m for m in self._owners(root, group) if self._from(m, root) == device)

    def chunks_received(self, device: int, root: int, group: tuple[int, ...]) -> tuple[int, ...]:
        """Owners of the chunks ``device`` receives (one checksum each); ``()`` for an unchunked op."""
        if not self.chunked:
            return ()
        return tuple(m for m in self._owners(root, group) if device in self._to(m, root, group))

    # ---- how many bytes, where -------------------------------------------------------------------
    def chunk(self, nbytes: int, members: int) -> int:
        """Bytes per member's chunk of a full buffer of ``nbytes`` (0 for an unchunked op)."""
        return nbytes // members if self.chunked else 0

    def holds_whole(self, device: int, root: int) -> bool:
        return not self.chunked or self.whole == "all" or device == root

    def member_bytes(self, device: int, root: int, nbytes: int, chunk: int) -> int:
        """Bytes of the buffer on ``device`` (what it packs or receives into)."""
        return nbytes if self.holds_whole(device, root) else chunk

    def local_offset(self, device: int, root: int, group: tuple[int, ...], chunk: int) -> int:
        """Where ``device``'s buffer starts in the full one (subtract it from a piece's offset)."""
        return 0 if self.holds_whole(device, root) else group.index(device) * chunk

    def wire_bytes(self, device: int, root: int, group: tuple[int, ...], nbytes: int, chunk: int,
                   sending: bool) -> int:
        """Bytes ``device`` counts as sent (``sending``) or received by this transfer."""
        if not self.chunked:
            return nbytes
        if sending:
            return nbytes if (device == root and self.chunk_from == "root") else chunk
        return chunk if self.chunk_to == "owner" else nbytes

    def link_bytes(self, root: int, group: tuple[int, ...], nbytes: int, chunk: int
                   ) -> tuple[dict[int, int], dict[int, int]]:
        """(Collectives) bytes each member's outgoing and incoming links carry: a pipelined chain for a broadcast
        (every member forwards the buffer once, every non-root receives it), a ring for a chunked op
        (each member passes ``n - 1`` chunks each way)."""
        if not self.chunked:
            return {m: nbytes for m in group}, {m: nbytes for m in group if m != root}
        ring = chunk * (len(group) - 1)
        return {m: ring for m in group}, {m: ring for m in group}


#: Every op a Program's instructions use, by name: compute, the switch transfer ops in the order the
#: planner reports them, the training step's other collectives, then ``copy``.
PROGRAM_OPS: Mapping[str, Op] = {o.name: o for o in (
    Op(COMPUTE, "compute", rooted=False),
    Op("send", "p2p", "s", rooted=False),
    Op("recv", "p2p", rooted=False),
    Op("broadcast", letter="b"),
    Op("scatter", letter="s", chunked=True, whole="root", chunk_from="root", chunk_to="owner"),
    Op("gather", letter="g", chunked=True, whole="root", chunk_from="owner", chunk_to="root"),
    Op("all_gather", letter="a", rooted=False, chunked=True, whole="all", chunk_from="owner", chunk_to="others",
       owners="all"),
    Op("all_reduce", rooted=False),
    Op("reduce_scatter", rooted=False),
    Op("all_to_all", rooted=False),
    Op("copy", "copy", rooted=False),
)}
#: Every communication op (all but compute).
COMM_OPS = tuple(n for n, o in PROGRAM_OPS.items() if o.kind != "compute")
#: Every op over a group.
COLLECTIVES = tuple(n for n, o in PROGRAM_OPS.items() if o.collective)
#: The point-to-point message ops, and those that run between a source and a destination device.
P2P_OPS = tuple(n for n, o in PROGRAM_OPS.items() if o.p2p)
TWO_ENDED_OPS = tuple(n for n, o in PROGRAM_OPS.items() if o.two_ended)
#: Every op a switch Program's transfers use, by name.
OPS: Mapping[str, Op] = {n: o for n, o in PROGRAM_OPS.items() if o.transfer}
#: Ops of switch transfers over a group (one communicator each), in the order the planner reports them.
COLLECTIVE_OPS = tuple(n for n, o in OPS.items() if not o.p2p)


def op(name: str) -> Op:
    """The table entry of ``name``; a point-to-point ``recv`` reads as ``send``."""
    return OPS["send" if name == "recv" else name]


@dataclass(frozen=True)
class Phase:
    """One compute phase. ``model``: its FLOPs count as the model's (MFU; not a recompute or the
    optimizer step); ``backward``: one of the backward's nodes (whole, input-gradient or
    weight-gradient half); ``activations``: activations or their gradients flow through it, so
    tensor-, expert-, sequence- and context-parallel collectives follow it (tags name it)."""

    name: str
    model: bool = False
    backward: bool = False
    activations: bool = False


#: Every compute phase, by name.
PHASE_TABLE: Mapping[str, Phase] = {p.name: p for p in (
    Phase("fwd", model=True, activations=True),
    Phase("bwd", model=True, backward=True, activations=True),
    Phase("bwd_input", model=True, backward=True, activations=True),
    Phase("bwd_weight", model=True, backward=True),
    Phase("optim"),
    Phase("recompute"),
)}
PHASES = tuple(PHASE_TABLE)
MODEL_PHASES = tuple(n for n, p in PHASE_TABLE.items() if p.model)
BACKWARD_PHASES = tuple(n for n, p in PHASE_TABLE.items() if p.backward)
ACTIVATION_PHASES = tuple(n for n, p in PHASE_TABLE.items() if p.activations)
