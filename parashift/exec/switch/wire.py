"""What a switch puts on the wire: message parts, their checksums, and the threads that wait on them.

Messages travel in parts of at most ``CHUNK`` bytes; each part is checksummed (a vectorized
64-bit sum, at memory speed) as soon as it has gone out or landed, and the part checksums fold, in
order, into one value per transfer (or chunk) that verification compares.
"""
from __future__ import annotations

import datetime
import queue
import threading
import zlib
from typing import Any, Callable

import numpy as np
import torch

from ...ir.program import Program

__all__ = ["BIG", "CHUNK", "SLICE", "MAX_MSGS", "BLOCK", "crc", "checksum", "word_sum", "seal", "PartSums", "checksum_device", "resolve", "fold", "parts",
           "slices", "reserve_waiters", "submit", "timedelta"]

#: Pieces of at least this many bytes travel as messages of their own (p2p transfers and broadcasts).
BIG = 1 << 16
#: Messages travel in parts of at most this many bytes (checksummed as they land). 16 MiB: a part
#: is a wait, a queue hand-off and a gloo rendezvous; against 4 MiB parts the switch's CPU was
#: lower in 5 of 6 interleaved pairs (by 2-6%; one pair 3% higher). Smaller parts did not make
#: the checksums cache-hot.
CHUNK = 1 << 24
#: Kept pieces are copied in slices of about this many bytes, so landed parts wait at most one slice.
SLICE = 1 << 22
#: Parts per transfer (gloo tags are ``transfer * MAX_MSGS + part``).
MAX_MSGS = 1 << 24
#: Packing copies this many bytes at a time and sums them at once, while they are in cache.
BLOCK = 1 << 20
MASK = 0xFFFFFFFFFFFFFFFF


def crc(t: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def checksum(t: torch.Tensor) -> int:
    """A transfer checksum of a contiguous tensor's bytes: the 64-bit wrapping sum of its 8-byte words
    (any corrupted word changes it; it runs at memory speed) plus a CRC32 of the tail. The value
    depends only on the bytes, not on their alignment: numpy sums misaligned words in place
    (about half the aligned speed) instead of copying them. :class:`PartSums` computes the same
    values block by block while a buffer is written."""
    b = t.contiguous().view(-1).view(torch.uint8)
    a = b.numpy()
    n8 = a.size // 8 * 8
    if n8 == 0:
        return zlib.crc32(a)
    return seal(word_sum(b[:n8]), n8, a[n8:])


def word_sum(b: torch.Tensor) -> int:
    """The 64-bit wrapping sum (unsigned) of the 8-byte words of a contiguous uint8 CPU tensor whose
    length is a multiple of 8."""
    if b.data_ptr() % 8 == 0:        # aligned: torch's reduction is the faster one (same wrapping sum)
        return int(b.view(torch.int64).sum()) & MASK
    return int(b.numpy().view(np.uint64).sum(dtype=np.uint64))


def seal(head: int, n8: int, tail: np.ndarray) -> int:
    """:func:`checksum` of a buffer from the sum of its ``n8 > 0`` leading bytes' words and its tail bytes."""
    return (head * 0x100000001B3 + zlib.crc32(tail) + n8) & MASK


class PartSums:
    """The :func:`checksum` of each part (``chunk`` bytes, as :func:`parts` cuts) of a contiguous
    host message, summed while the message is being written: after its bytes before ``end`` are
    final, :meth:`upto` sums the words not summed yet (still in cache when called right after the
    write that produced them); :meth:`values` sums the rest and returns one checksum per part.
    The 64-bit word sum is associative, so the values equal :func:`checksum` of each part."""

    def __init__(self, msg: torch.Tensor, chunk: int) -> None:
        self.msg = msg.view(-1).view(torch.uint8)
        self.n, self.chunk = self.msg.numel(), int(chunk)
        self.heads = [0] * max(1, -(-self.n // self.chunk))
        self.done = 0                   # bytes summed (whole words of each part)

    def upto(self, end: int) -> None:
        end = min(int(end), self.n)
        while self.done < end:
            j = self.done // self.chunk
            start = j * self.chunk
            stop = min(start + self.chunk, self.n)          # this part's end
            words = start + (min(end, stop) - start) // 8 * 8
            if words > self.done:
                self.heads[j] = (self.heads[j] + word_sum(self.msg[self.done:words])) & MASK
                self.done = words
            if end < stop:
                return
            self.done = stop                # the part's words are summed (its tail is sealed by values())

    def values(self) -> list[int]:
        self.upto(self.n)
        out = []
        for j, head in enumerate(self.heads):
            a, e = j * self.chunk, min((j + 1) * self.chunk, self.n)
            n8 = (e - a) // 8 * 8
            tail = self.msg[a + n8:e].numpy()
            out.append(seal(head, n8, tail) if n8 else zlib.crc32(tail))
        return out


def checksum_device(t: torch.Tensor) -> torch.Tensor:
    """The transfer checksum of a contiguous device tensor's bytes, as an int64 scalar on the
    device (no host synchronization; :func:`resolve` reads many at once): the wrapping sum of its
    8-byte words times a prime, plus its tail bytes as one zero-padded word and its length. It
    depends only on the bytes (a misaligned tensor is summed from an aligned copy); sender and
    receiver of a transfer use the same function (both ends of a device job are devices)."""
    b = t.contiguous().view(-1).view(torch.uint8)
    n = b.numel()
    n8 = n // 8 * 8
    if b.data_ptr() % 8:
        b = b.clone()
    head = b[:n8].view(torch.int64).sum() if n8 else torch.zeros((), dtype=torch.int64, device=b.device)
    pad = torch.zeros(8, dtype=torch.uint8, device=b.device)
    if n > n8:
        pad[:n - n8] = b[n8:]
    return head * 0x100000001B3 + pad.view(torch.int64)[0] * 31 + n


def resolve(values: list) -> list[int]:
    """Checksums as unsigned 64-bit ints: host values as they are, device scalars read with one copy."""
    dev = [v for v in values if isinstance(v, torch.Tensor)]
    got = iter(torch.stack(dev).cpu().tolist()) if dev else iter(())
    return [(next(got) if isinstance(v, torch.Tensor) else v) & 0xFFFFFFFFFFFFFFFF for v in values]


def fold(h: int, c: int) -> int:
    """Order-dependent combination of part checksums into one per transfer."""
    return (h * 0x100000001B3 ^ c) & 0xFFFFFFFFFFFFFFFF


def parts(msgs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    """Messages cut into consecutive parts of at most ``chunk`` bytes (views, no copy); both ends
    of a transfer cut alike, as their messages have the same sizes."""
    return [m[a:a + chunk] for m in msgs for a in range(0, max(m.numel(), 1), chunk)]


def slices(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) views of equal shape cut along the first dimension into copies of about
    ``nbytes`` bytes or less (a single row may be larger)."""
    if dst.dim() == 0 or dst.numel() * dst.element_size() <= nbytes:
        return [(dst, src)]
    row = max(1, dst[0].numel() * dst.element_size())
    step = max(1, nbytes // row)
    return [(dst[a:a + step], src[a:a + step]) for a in range(0, dst.shape[0], step)]


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class _Waiters:
    """Daemon threads that wait on issued work (gloo completes p2p work only inside ``wait()``),
    kept across switches: issuing a message hands it to an idle thread instead of starting one
    (``Thread.start`` blocks until the new thread runs, which costs a scheduling round on a busy
    host). :meth:`reserve` starts threads ahead of a switch."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            fn, args = self.q.get()
            fn(*args)
            with self.lock:
                self.idle += 1

    def _spawn(self, n: int) -> None:
        for _ in range(n):
            threading.Thread(target=self._loop, name="parashift-switch-wait", daemon=True).start()

    def reserve(self, n: int) -> None:
        """Make sure at least ``n`` threads are idle."""
        with self.lock:
            need = max(0, n - self.idle)
            self.idle += need
        self._spawn(need)

    def submit(self, fn: Callable, *args: Any) -> None:
        with self.lock:
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1
        self.q.put((fn, args))
        if spawn:
            self._spawn(1)


_WAITERS = _Waiters()


def submit(fn: Callable, *args: Any) -> None:
    """Run ``fn(*args)`` on an idle waiter thread."""
    _WAITERS.submit(fn, *args)


def reserve_waiters(program: Program, device: int) -> None:
    """Start the threads ``device``'s part of ``program`` waits on (call it before the switch)."""
    rp = program.ranks.get(device)
    _WAITERS.reserve(sum(ins.op != "copy" for ins in (rp.instrs() if rp is not None else ())))
