"""Same-host transfers: the receiver copies a message straight out of the sender's memory.

Between two processes of one host, a point-to-point message through gloo costs two kernel copies
(into the socket, out of it) and the TCP work around them on both processes' CPUs. With Linux's
cross-memory attach (``process_vm_readv``) the receiver copies the sender's bytes into its own
buffer in one kernel copy, and sums each block while it is still in cache; the sender only sends
a small descriptor (address and length, over the same gloo pair and tag) and waits for the
receiver's acknowledgement before its buffer is reused. So the switch's bytes and checksums are
those of the gloo path; only the carrier changes.

Who reads whom is agreed once per pair of processes (:func:`negotiate`): each process publishes
its host identity (the launcher that started it, the kernel's boot id and pid namespace) and a
probe buffer; each reads the probe of every participant of its own host and publishes whether it
could (a kernel that forbids it, e.g. Yama's ``ptrace_scope`` >= 1 between siblings, or a
seccomp filter, leaves that pair on gloo). Processes started by different launchers (hosts of a
multi-host job, even on one machine) never read each other. ``PARASHIFT_LOCAL_READS=0`` in the
launcher's environment turns the path off.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import SwitchAborted
from .wire import PartSums, checksum

__all__ = ["LocalPeers", "LocalSend", "LocalRecv", "negotiate", "read_bytes", "read_into", "node_token", "NODE_ENV",
           "LOCAL_READS_ENV"]

#: set by the launcher in every process it starts (:func:`..job.elastic.launch_elastic`): one id per launch
NODE_ENV = "PARASHIFT_NODE"
#: local reads copy and sum this many bytes at a time (the sum finds them in cache)
READ_BLOCK = 1 << 18
#: "0" in the launcher's environment: no local reads (every message through gloo)
LOCAL_READS_ENV = "PARASHIFT_LOCAL_READS"

_LIBC: Any = None
_PROBE: tuple[int, np.ndarray] | None = None     # (pid, what peers read back): drawn in each process
_PAIRS: dict[tuple[str, str], bool] = {}          # (reader key, source key) -> it can read (this process's cache)
_LOCK = threading.Lock()


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        fn = getattr(lib, "process_vm_readv", None)
        if fn is not None:
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                           ctypes.c_ulong, ctypes.c_ulong]
        _LIBC = fn if fn is not None else False
    return _LIBC


def read_bytes(pid: int, dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes at address ``src`` of process ``pid`` to address ``dst`` of this one."""
    fn = _libc()
    local, remote = _Iovec(), _Iovec()
    while n > 0:
        local.base, local.len, remote.base, remote.len = dst, n, src, n
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise SwitchAborted(f"reading {n} bytes of process {pid}'s memory failed ({os.strerror(err)}); "
                                f"the sender is gone or no longer lends its memory")
        dst, src, n = dst + got, src + got, n - got


def read_into(pid: int, addr: int, part: torch.Tensor, chunk: int) -> int:
    """Fill the contiguous host tensor ``part`` from address ``addr`` of process ``pid`` a block at a
    time, summing each block right after it lands; returns ``part``'s transfer checksum (as
    :func:`~.wire.checksum`; ``part`` is at most ``chunk`` bytes)."""
    b = part.view(-1).view(torch.uint8)
    sums = PartSums(b, chunk)
    base, n = b.data_ptr(), b.numel()
    for a in range(0, n, READ_BLOCK):
        k = min(READ_BLOCK, n - a)
        read_bytes(pid, base + a, addr + a, k)
        sums.upto(a + k)
    return sums.values()[0]


def _identity() -> str:
    def first(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return f"{first('/proc/sys/kernel/random/boot_id')}/{ns}"


def node_token() -> str | None:
    """This process's host for local reads (None: it takes no part: no launcher id, not Linux, or
    turned off)."""
    node = os.environ.get(NODE_ENV)
    if not node or os.environ.get(LOCAL_READS_ENV, "1") == "0" or not _libc():
        return None
    return f"{node}@{_identity()}"


@dataclass
class LocalPeers:
    """Which point-to-point peers of a switch go by local reads: ``sources`` (device -> pid) are
    read by this process when it receives from them; ``readers`` read this process's messages."""

    sources: dict[int, int] = field(default_factory=dict)
    readers: frozenset = frozenset()


def _probe_buffer() -> np.ndarray:
    """This process's probe (drawn after a fork, so no two processes share one)."""
    global _PROBE
    if _PROBE is None or _PROBE[0] != os.getpid():
        _PROBE = (os.getpid(), np.random.default_rng().integers(0, 1 << 62, size=64, dtype=np.int64))
    return _PROBE[1]


def _probe(info: dict) -> bool:
    got = np.zeros(64, dtype=np.int64)
    try:
        read_bytes(int(info["pid"]), got.ctypes.data, int(info["addr"]), got.nbytes)
    except SwitchAborted:
        return False
    return bool(np.array_equal(got, np.asarray(info["probe"], dtype=np.int64)))


def negotiate(store: Any, me: str, keys: dict[int, str]) -> LocalPeers:
    """Agree with the other participants (``keys``: device -> incarnation key, this process's is
    ``me``) which pairs of processes of one host move messages by local reads. Every participant
    calls it (it publishes, then waits for the others); each pair is probed once per process."""
    node, probe = node_token(), _probe_buffer()
    mine = {"node": node, "pid": os.getpid(), "addr": int(probe.ctypes.data), "probe": probe.tolist()}
    store.set(f"local/info/{me}", json.dumps(mine))
    if node is None:
        return LocalPeers()
    infos = {d: json.loads(store.get(f"local/info/{k}")) for d, k in keys.items() if k != me}
    same = {d: i for d, i in infos.items() if i["node"] == node}
    for d, info in sorted(same.items()):
        with _LOCK:
            if (me, keys[d]) not in _PAIRS:
                _PAIRS[(me, keys[d])] = _probe(info)
        store.set(f"local/can/{me}/{keys[d]}", b"1" if _PAIRS[(me, keys[d])] else b"0")
    sources = {d: int(same[d]["pid"]) for d in same if _PAIRS[(me, keys[d])]}
    readers = frozenset(d for d in sorted(same) if store.get(f"local/can/{keys[d]}/{me}") == b"1")
    return LocalPeers(sources, readers)


class LocalSend:
    """A message part lent to a same-host receiver: its descriptor (address, length) goes out over
    ``world`` with ``tag``, and :meth:`wait` returns once the receiver acknowledges holding the bytes
    (only then may the part's buffer be reused). Unless ``summed`` (its checksum was taken while
    packing), :meth:`wait` first sums the part (``sum``) while the receiver reads it, so that one
    of the two reads finds the bytes in cache."""

    def __init__(self, world: Any, peer: int, tag: int, part: torch.Tensor) -> None:
        self.part, self.n = part, part.numel() * part.element_size()
        self.desc = torch.tensor([part.data_ptr(), self.n], dtype=torch.int64)
        self.ack = torch.full((1,), -1, dtype=torch.int64)
        self.works = [world.send([self.desc], peer, tag), world.recv([self.ack], peer, tag)]
        self.summed = False
        self.sum: int | None = None

    def wait(self, timeout: Any) -> bool:
        self.works[0].wait(timeout)
        if not self.summed:
            self.sum = checksum(self.part)
        self.works[1].wait(timeout)
        if int(self.ack[0]) != self.n:
            raise SwitchAborted(f"a same-host receiver acknowledged {int(self.ack[0])} bytes of a {self.n}-byte part")
        return True


class LocalRecv:
    """A message part read out of a same-host sender's memory: :meth:`wait` takes the sender's
    descriptor, copies and sums the bytes (``sum``: the part's checksum) and acknowledges them."""

    def __init__(self, world: Any, peer: int, tag: int, part: torch.Tensor, pid: int, chunk: int) -> None:
        self.world, self.peer, self.tag, self.part, self.pid, self.chunk = world, peer, tag, part, pid, chunk
        self.desc = torch.zeros(2, dtype=torch.int64)
        self.work = world.recv([self.desc], peer, tag)
        self.sum: int | None = None

    def wait(self, timeout: Any) -> bool:
        self.work.wait(timeout)
        addr, n = self.desc.tolist()
        want = self.part.numel() * self.part.element_size()
        if n != want:
            raise SwitchAborted(f"a same-host sender lent a {n}-byte part where {want} bytes were expected "
                                f"(the peers' switch Programs differ)")
        self.sum = read_into(self.pid, addr, self.part, self.chunk)
        self.world.send([torch.tensor([n], dtype=torch.int64)], self.peer, self.tag).wait(timeout)
        return True
