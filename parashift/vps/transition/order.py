"""XOR ordering of point-to-point transfers, and the global order of collectives.

Within a stage, device ``i`` issues its sends in rounds ``s = 1 .. 2^ceil(log2 n) - 1`` to peer
``i XOR s`` and its receives in the same rounds from ``i XOR s``, skipping peers it exchanges
nothing with (``n``: one more than the largest device id). Sends and receives run on streams
of their own, ``lanes`` of each per device: a message of round ``s`` uses lane ``hash(s) mod
lanes`` at both ends, and every lane keeps the order below. Packs precede sends and unpacks
follow receives on two further streams.

**Round structure.** For a fixed ``s`` the map ``i -> i XOR s`` is an involution without fixed
points (``s != 0``), so the pairs ``{i, i XOR s}`` form a perfect matching: in round ``s`` a
device sends to exactly one peer and receives from exactly that peer, and ``j = i XOR s`` iff
``i = j XOR s``, so both ends of every message place it in the same round ``s = i XOR j``.

**Deadlock freedom (proof).** Order all messages of a stage by ``(round, transfer id)``, the
order both of their ends use on every lane. Suppose some message is never completed and take
the smallest such ``m = (i -> j)`` in this order. Every message before ``m`` on ``i``'s send
lane or on ``j``'s receive lane is smaller than ``m``, hence completed; so ``m`` is at the
head of both lanes. Its send's only other dependency is its pack, on a stream that waits for
nothing but the previous stage; its receive waits only for the stage to begin. The two heads
therefore meet and ``m`` completes: a contradiction. Stages are chained per device (each
stream's first instruction of stage ``k + 1`` waits for the device's stage ``k``), and no
instruction of stage ``k`` waits for a later one, so by induction over stages every
instruction completes. No global coordination is needed: each device knows its own order.

Collectives run on their own stream in one global order (stage, transfer id); every member's
stream is a subsequence of it, so the smallest unfinished collective is at the head of all
its members' streams and completes by the same argument. Without XOR (``xor=False``) sends go
to peers in ascending id and receives come from sources in ascending id: still deadlock-free
(the same argument with the order (stage, source, destination)), but every sender starts with
the same low destinations, so transfers queue behind each other.
"""
from __future__ import annotations

from .transfers import Transfer

__all__ = ["p2p_order", "collective_order", "rounds", "round_matchings"]


def rounds(n_devices: int) -> int:
    """Number of XOR rounds for device ids below ``n_devices``: ``2^ceil(log2 n) - 1``."""
    return (1 << max(0, (n_devices - 1).bit_length())) - 1


def p2p_order(items: tuple[Transfer, ...], xor: bool = True) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Per device, the point-to-point transfer ids it sends and receives, in issue order."""
    sends: dict[int, list[tuple]] = {}
    recvs: dict[int, list[tuple]] = {}
    for k, t in enumerate(items):
        if t.op != "send":
            continue
        i, j = t.root, t.peer
        sends.setdefault(i, []).append((t.stage, i ^ j if xor else j, k))
        recvs.setdefault(j, []).append((t.stage, i ^ j if xor else i, k))
    return ({d: [k for *_, k in sorted(v)] for d, v in sends.items()},
            {d: [k for *_, k in sorted(v)] for d, v in recvs.items()})


def collective_order(items: tuple[Transfer, ...]) -> dict[int, list[int]]:
    """Per device, its collective transfer ids in the one global order (stage, id)."""
    out: dict[int, list[int]] = {}
    for k in sorted((k for k, t in enumerate(items) if t.op != "send"), key=lambda k: (items[k].stage, k)):
        for m in items[k].group:
            out.setdefault(m, []).append(k)
    return out


def round_matchings(items: tuple[Transfer, ...]) -> bool:
    """True when, in every stage and XOR round, each device sends to and receives from at most
    one peer, and that peer is ``device XOR round`` (the property the proof relies on)."""
    seen: dict[tuple[int, int, int, str], int] = {}
    for t in items:
        if t.op != "send":
            continue
        s = t.root ^ t.peer
        if s == 0:
            return False
        for dev, role, peer in ((t.root, "send", t.peer), (t.peer, "recv", t.root)):
            if seen.setdefault((t.stage, s, dev, role), peer) != peer or dev ^ s != peer:
                return False
    return True
