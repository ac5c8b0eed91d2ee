"""Elastic device manager: process groups on a shared TCPStore, created in the background.

``torch.distributed.new_group`` is collective over the default world, which cannot grow. The
manager instead builds each communicator directly on the job's TCPStore
(``ProcessGroupGloo(PrefixStore(...), rank, size)``), so a fresh worker process started for a
joining device rendezvous with the running job through the same store. Groups are cached by
member set (members are *incarnations*: a device id and the generation its process started in,
so a device that left and came back gets new communicators) and reused by later switches.

:func:`launch_elastic` starts one process per incarnation and collects their results like
``launch_local``; a joining device's process is started fresh when its switch is announced.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_mod
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import RuntimeFailure

__all__ = ["Member", "ElasticContext", "ElasticManager", "launch_elastic", "incarnations"]


@dataclass(frozen=True)
class Member:
    """One worker process: device ``device`` from generation ``first`` through ``last`` (inclusive)."""

    device: int
    first: int
    last: int

    @property
    def key(self) -> str:
        return f"{self.device}.{self.first}"


def incarnations(device_sets: list[tuple[int, ...]]) -> list[Member]:
    """The worker processes a sequence of generations needs: one per maximal run of consecutive
    generations a device belongs to."""
    out = []
    for d in sorted({d for ds in device_sets for d in ds}):
        g = 0
        while g < len(device_sets):
            if d in device_sets[g]:
                a = g
                while g + 1 < len(device_sets) and d in device_sets[g + 1]:
                    g += 1
                out.append(Member(d, a, g))
            g += 1
    return out


@dataclass
class ElasticContext:
    """What a worker function receives: its incarnation, the job's store and settings."""

    member: Member
    store: Any
    backend: str
    timeout: float
    report: Callable[[Any], None] | None = None

    @property
    def device(self) -> int:
        return self.member.device


class ElasticManager:
    """One process's communicator cache over the job's store.

    ``group(members)`` returns the communicator of a tuple of incarnation keys (this process's
    must be among them), creating it on first use; ``process_group(members, channel)`` the same
    as a ``torch.distributed.ProcessGroup`` for a training world. Creation blocks until every
    member creates the group too, so members create shared groups in one agreed order (callers
    build them in background threads). ``drop(members)`` forgets a group (after a failed switch: its in-flight work is abandoned), so
    the next ``group`` call builds a fresh one under a new prefix.
    """

    def __init__(self, store: Any, me: str, timeout: float = 60.0, backend: str = "gloo", device: Any = None) -> None:
        """``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (tensors on ``device``, this process's
        CUDA device: NCCL puts one rank per GPU)."""
        if backend not in ("gloo", "nccl"):
            raise RuntimeFailure(f"unknown backend {backend!r} for a live job's groups; use 'gloo' or 'nccl'")
        self.store, self.me, self.timeout, self.backend, self.device = store, me, timeout, backend, device
        self._groups: dict[tuple[tuple[str, ...], str], Any] = {}
        self._epoch: dict[tuple[tuple[str, ...], str], int] = {}
        self._lock = threading.Lock()
        self.created = 0            # groups built (cache misses)
        self.reused = 0             # cache hits

    def group(self, members: tuple[str, ...], channel: str = "") -> Any:
        """The communicator of ``members`` on ``channel`` (None for fewer than two members).
        The switch executor drives it directly (``send``/``recv``/``broadcast`` ...)."""
        return self._get(tuple(members), channel, wrap=False)

    def process_group(self, members: tuple[str, ...], channel: str = "default") -> Any:
        """A ``torch.distributed.ProcessGroup`` of ``members`` on ``channel``, for the
        ``torch.distributed`` collectives a training Runtime issues (``group=``; point-to-point
        calls name peers by group rank: ``group_dst``/``group_src``)."""
        return self._get(tuple(members), "train:" + channel, wrap=True)

    def _get(self, members: tuple[str, ...], channel: str, wrap: bool) -> Any:
        if len(members) < 2:
            return None
        key = (members, channel)
        with self._lock:
            pg = self._groups.get(key)
            if pg is not None:
                self.reused += 1
                return pg
            epoch = self._epoch.get(key, 0)
        import torch
        import torch.distributed as dist
        if self.me not in members:
            raise RuntimeFailure(f"process {self.me} asked for group {members}, which it is not in")
        prefix = f"pg/{','.join(members)}/{channel}/{epoch}"
        store, rank, size = dist.PrefixStore(prefix, self.store), members.index(self.me), len(members)
        if self.backend == "nccl":
            pg, kind, dev = _nccl_group(store, rank, size, self.timeout, self.device), \
                dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
        else:
            pg, kind, dev = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=self.timeout)), \
                dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
        if wrap:       # as init_process_group wraps its backend (torch has no public call for this)
            backend = pg
            pg = dist.ProcessGroup(store, rank, size)
            pg._set_default_backend(kind)
            pg._register_backend(dev, kind, backend)
        with self._lock:
            self._groups[key] = pg
            self.created += 1
        return pg

    def drop(self, members: tuple[str, ...], channel: str = "") -> None:
        key = (tuple(members), channel)
        with self._lock:
            if self._groups.pop(key, None) is not None:
                self._epoch[key] = self._epoch.get(key, 0) + 1

    def __len__(self) -> int:
        return len(self._groups)


def _nccl_group(store: Any, rank: int, size: int, timeout: float, device: Any) -> Any:
    """An NCCL communicator on ``store``, connected now on ``device`` (every member calls this in
    the same order, as for gloo), so that no transfer of a switch waits for its creation. Written
    for GPUs; not run on the CPU-only machines the project is tested on."""
    import torch.distributed as dist
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    pg._set_sequence_number_for_group()
    pg.eager_connect_single_device(device)
    return pg


# ---- launcher -------------------------------------------------------------------------------------------
def _child(fn: Callable, args: tuple, member: Member, where: tuple, results: Any, timeout: float,
           threads: int | None, backend: str, node: str) -> None:
    from ..jobstore import connect, die_with_parent
    from ..switch.local import NODE_ENV
    die_with_parent(os.getppid())   # dies with the forkserver, which dies with the launcher
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ[NODE_ENV] = node     # processes of one launch are one host (same-host switch transfers)
    key = member.key

    def report_err(e: BaseException) -> None:
        results.put((key, "err", f"{type(e).__name__}: {e}", traceback.format_exc(), time.time()))

    try:
        import torch
        import torch.distributed as dist
        if threads:
            torch.set_num_threads(threads)
        store = connect(*where, timeout)   # loopback, keys under the job's secret
        ctx = ElasticContext(member, store, backend, timeout, lambda payload: results.put((key, "progress", payload)))
        out = fn(ctx, *args)
        results.put((key, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        report_err(e)
    finally:
        # flush the result, then leave without running destructors: communicators abandoned by a
        # failed switch may still hold work posted to a dead peer, and would block until it times out
        results.close()
        results.join_thread()
        os._exit(0)


def _on_message(item: tuple, procs: dict, got: dict, allow_dead: bool,
                on_report: Callable[[str, Any], None] | None) -> None:
    """A message from a process: its result (into ``got``), a progress report (to ``on_report``), or its
    error, raised as RuntimeFailure (naming first a process that died without reporting: the cause)."""
    from ..launch import dead_ranks
    k, kind = item[0], item[1]
    if kind == "err":
        keys = list(procs)
        dead = [(keys[i], c) for i, c in dead_ranks(list(procs.values()), {keys.index(k)})
                if not (allow_dead and keys[i] in got)]
        if dead and not allow_dead:
            raise RuntimeFailure(f"process {dead[0][0]} died (exit code {dead[0][1]}) without reporting; "
                                 f"then process {k} failed: {item[2].splitlines()[0][:160]}")
        raise RuntimeFailure(f"process {k} failed: {item[2]}\n--- traceback of {k} ---\n{item[3]}")
    if kind == "progress":
        if on_report is not None:
            on_report(k, item[2])
        return
    got[k] = item[2]


def _reap_silent(procs: dict, got: dict, waiting: dict, results: Any, store: Any, members: dict,
                 allow_dead: bool) -> None:
    """A started process that exited without reporting: ``dead/<device>`` in the store (survivors stop
    waiting for it), then the result None (``allow_dead``) or a RuntimeFailure. A message still in the
    queue is put back for the caller to read first."""
    from ..launch import _script_hint
    for k, p in procs.items():
        if k not in got and k not in waiting and not p.is_alive() and p.exitcode is not None:
            try:
                item = results.get(timeout=0.5)
            except queue_mod.Empty:
                item = None
            if item is not None:
                results.put(item)
                return
            store.set(f"dead/{members[k].device}", k)   # survivors stop waiting for it
            if allow_dead:
                got[k] = None
                continue
            raise RuntimeFailure(f"process {k} died with exit code {p.exitcode} without reporting"
                                 f"{_script_hint()}")


def launch_elastic(fn: Callable, members: list[Member], *, args: tuple = (), timeout: float = 300.0,
                   backend: str = "gloo", threads: int | None = 1, allow_dead: bool = False,
                   on_report: Callable[[str, Any], None] | None = None,
                   start_key: Callable[[Member], str | None] | None = None, job: Any = None,
                   keep_sigterm: bool = False) -> dict[str, Any]:
    """Run ``fn(ctx, *args)`` in one fresh process per member; return {member key: result}.

    All processes share one TCPStore held by this process. ``start_key(member)``: a store key
    the member's process waits for before it is started (None: start at once), e.g. the notice of
    the switch a joining device comes in at; a member whose key never appears (every started
    process has finished) gets the result None. ``allow_dead``: a process that dies
    without reporting (a fault test kills it) gets the result None instead of failing the job.
    ``job``: the :class:`.jobstore.JobStore` to use (a multi-host job's, :mod:`.first_host`; default a new
    loopback one). ``keep_sigterm``: leave the caller's SIGTERM handler in place (default: SIGTERM stops
    the processes). Raises RuntimeFailure when a process raises, or when the job exceeds ``timeout`` seconds.
    """
    from ..jobstore import serve
    from ..switch.local import LOCAL_READS_ENV
    from ..launch import _context, _stop, stop_on_sigterm
    job = job if job is not None else serve(timeout)
    store = job.store
    ctx = _context()
    results = ctx.Queue()
    node = f"{os.getpid()}.{uuid.uuid4().hex[:12]}" if os.environ.get(LOCAL_READS_ENV, "1") != "0" else ""
    procs = {m.key: ctx.Process(target=_child, args=(fn, args, m, job.client_args(), results, timeout, threads,
                                                     backend, node),
                                name=f"parashift-dev{m.key}", daemon=True) for m in members}
    procs_members = {m.key: m for m in members}
    got: dict[str, Any] = {}
    waiting = {m.key: start_key(m) for m in members} if start_key is not None else {}
    waiting = {k: v for k, v in waiting.items() if v is not None}
    sigterm = stop_on_sigterm() if not keep_sigterm else contextlib.nullcontext()
    sigterm.__enter__()
    try:
        for k, p in procs.items():
            if k not in waiting:
                p.start()
        deadline = time.monotonic() + timeout
        while len(got) < len(procs):
            for k, key in list(waiting.items()):
                if store.check([key]):
                    procs[k].start()           # a fresh process for a joining device
                    del waiting[k]
            if waiting and all(k in got for k in procs if k not in waiting):
                for k in waiting:              # nobody is left to announce their switch
                    got[k] = None
                waiting.clear()
                continue
            try:
                item = results.get(timeout=0.1)
            except queue_mod.Empty:
                item = None
            if item is not None:
                _on_message(item, procs, got, allow_dead, on_report)
                continue
            _reap_silent(procs, got, waiting, results, store, procs_members, allow_dead)
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"the elastic job did not finish within {timeout:.0f} s (done: {sorted(got)}); "
                                     f"raise the timeout or look for a stuck switch")
        for p in procs.values():
            if p.pid is not None:
                p.join(10.0)
    finally:
        _stop(list(procs.values()))
        results.close()
        sigterm.__exit__(None, None, None)
        del store, job
    return got
