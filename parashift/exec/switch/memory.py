"""Switch memory: pooled staging buffers, huge-page and lazily faulted state buffers, page release
and the process's resident size.

A switch's destination store is allocated huge-page backed (:func:`state_alloc`: first-touch
faults of 4 KiB pages cost about a tenth of a second per GB), or lazily (:func:`lazy_alloc`) when
it fills stage by stage; staging buffers come from a :class:`BufferPool` and go back as soon as
their transfer is sent or unpacked; a staged switch hands verified old regions back to the kernel
(:func:`advise_free`).
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np
import torch

from ..state import StateStore

__all__ = ["BufferPool", "state_alloc", "lazy_alloc", "advise_huge", "advise_free", "rss_bytes", "reset_rss_peak",
           "bytes_of", "HUGE", "PAGE"]

#: Transparent huge pages: buffers of at least this many bytes are advised to use them.
HUGE = 1 << 21
PAGE = 4096
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14

_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise  # noqa: B018 - raises AttributeError where libc has none
        except (OSError, AttributeError):  # pragma: no cover - no madvise: small pages, same bytes
            lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def advise_huge(t: torch.Tensor) -> None:
    """Ask Linux to back the 2 MiB-aligned interior of ``t`` (not yet touched) with huge pages:
    first-touch page faults then cost ~1/10 (a 4 KiB-page fault per 4 KiB runs at ~1.3 GB/s)."""
    n = t.numel() * t.element_size()
    if n < 2 * HUGE or not sys.platform.startswith("linux"):
        return
    a = -(-t.data_ptr() // HUGE) * HUGE
    e = (t.data_ptr() + n) // HUGE * HUGE
    if e > a and _libc() is not None:
        _libc().madvise(ctypes.c_void_p(a), ctypes.c_size_t(e - a), _MADV_HUGEPAGE)  # advice only


def advise_free(t: torch.Tensor, a: int, e: int) -> int:
    """Hand the whole pages of elements ``[a, e)`` of contiguous CPU ``t`` back to the kernel
    (their contents read as zeros afterwards); returns the bytes released."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux") or _libc() is None:
        return 0
    es = t.element_size()
    lo = -(-(t.data_ptr() + a * es) // PAGE) * PAGE
    hi = (t.data_ptr() + e * es) // PAGE * PAGE
    if hi <= lo:
        return 0
    if _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) != 0:
        return 0
    return hi - lo


def state_alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed state buffer for a switch's destination store, huge-page backed on Linux CPUs
    (the allocator for ``StateStore(..., alloc=state_alloc)``)."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    t = torch.empty(numel, dtype=dtype)
    advise_huge(t)
    return t.zero_()


def lazy_alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed state buffer whose pages are faulted in only when written (``calloc``: fresh
    anonymous pages), for a destination store that fills stage by stage."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(numel * size, dtype=np.uint8)).view(dtype)


class BufferPool:
    """Reusable uint8 staging buffers, by size (sizes are 16-byte aligned by the planner), in host
    memory (default), device memory (``device``), or pinned host memory (``pinned``: a device job
    whose transfers go through the host).

    ``in_use``: bytes handed out and not yet returned; ``peak``: the most ``in_use`` ever was
    (reset by :meth:`reset_peak`); ``held``: bytes the pool owns (in use or idle). On a device,
    work queued on a buffer may still run after it is handed back: ``put(t, fence)`` keeps a
    ``fence`` with it, and ``get(n, on)`` calls ``fence(on)`` before handing the buffer out again
    (the executor makes stream ``on`` wait for the work that last used it)."""

    def __init__(self, device: "torch.device | str | None" = None, pinned: bool = False) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.pinned = bool(pinned) and self.device.type == "cpu"
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.allocated = 0
        self.held = 0
        self.in_use = 0
        self.peak = 0

    def get(self, nbytes: int, on: Any = None) -> torch.Tensor:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        lst = self.free.get(nbytes)
        if lst:
            t, fence = lst.pop()
            if fence is not None:
                fence(on)
            return t
        self.allocated += nbytes
        self.held += nbytes
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)
        if self.device.type == "cpu" and not self.pinned:
            advise_huge(t)
        return t

    def put(self, t: torch.Tensor, fence: Any = None) -> None:
        self.in_use -= t.numel()
        self.free.setdefault(t.numel(), []).append((t, fence))

    def reset_peak(self) -> None:
        self.peak = self.in_use

    def clear(self) -> None:
        """Release the idle buffers (buffers in use stay with their holders)."""
        self.held -= sum(t.numel() for lst in self.free.values() for t, _ in lst)
        self.free.clear()


def rss_bytes() -> tuple[int, int]:
    """(resident bytes now, resident high-water mark) of this process (Linux; (0, 0) elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            got = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.startswith(("VmRSS", "VmHWM"))}
        return got.get("VmRSS", 0), got.get("VmHWM", 0)
    except OSError:
        return 0, 0


def reset_rss_peak() -> None:
    """Reset this process's resident high-water mark to its current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def bytes_of(store: StateStore | None) -> int:
    """Bytes of a store's parameter and optimizer buffers."""
    if store is None:
        return 0
    total = 0
    for b in store.buffers.values():
        for k in ("param", "master", "exp_avg", "exp_avg_sq"):
            t = getattr(b, k)
            if t is not None:
                total += t.numel() * t.element_size()
    return total
