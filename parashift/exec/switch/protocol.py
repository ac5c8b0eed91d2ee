"""The switch protocol on one process: prepare, execute (transfer), verify, restore.

Every participant of a switch computes the same plan locally (``vps.plan_switch`` and
``vps.transition.lower`` are deterministic), so nothing is negotiated. A job's schedule orders
each switch's destination devices to keep the most state in place (``vps.transition.place``).
Phases:

1. *planning* and 2. *world creation* run in a background thread as soon as the switch is
   announced (``prepare``), while training goes on: the switch Program is lowered, the new
   layout's training Program is compiled, and the process groups the switch needs (the
   participants' world and one group per promoted collective) and the new layout's training
   world are built on the job's TCPStore by the :class:`~parashift.exec.job.elastic.ElasticManager`.
3. *transfer*: between iterations, :class:`~.executor.SwitchExecutor` runs this
   device's streams of the switch Program from the old state store into a new one (allocated,
   and faulted in, in the background once the switch is announced).
4. *verify*: in one store round, every participant publishes a record (whether its transfer
   failed, the checksums of what it sent and of what it received, the job's step counters) and
   reads everyone's; all derive the same verdict from the same records. Any mismatch, failed
   transfer or missing record aborts: the new store is dropped and the old one, never written,
   stays in use (:class:`~parashift.errors.SwitchAborted`; ``peer_failed`` tells whether a
   participant is gone).
5. *rebuild* (:mod:`.session`): a Runtime is built over the new store (its parameters are views
   into it) and the new training world; the step counter carries over, so the data order (a
   function of the global step) and the global batch continue unchanged.

Memory. The Program allocates and frees buffers per stage (``alloc``/``free`` of its
instructions). Its *staging* buffers (packed and received messages) follow it exactly: they come
from a :class:`~.memory.BufferPool` and go back as soon as their transfer is
sent or unpacked, so a stage reuses the previous stage's buffers. The runtime keeps each
layout's states in a few flat buffers per rank (not one per tensor). Without a budget (or when
old and new fit in it) the new store exists whole before the transfer and the old store is kept
whole until the verdict, so that an abort at any point leaves the old layout's state intact:
the high-water mark is ``old + new + staging peak``. When old and new exceed the budget, the
switch is *staged* (:mod:`.staged`): each verified stage hands back the old regions the
Program frees there, the new store fills lazily, and an abort restores what was released. Both
are recorded in :class:`SwitchRecord` (``old_bytes``, ``new_bytes``, ``released_bytes``,
``staging_peak_bytes``, ``peak_bytes``). A budget below what one stage needs is refused by the
planner before anything moves.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from ...errors import SwitchAborted
from ...ir.program import Program
from ...models import ModelSpec
from ...strategy import Strategy
from ...vps.transition import SwitchMeta, SwitchPlanned, parse_switch_name, plan_live_switch
from ..state import StateStore
from .executor import SwitchExecutor
from .local import LocalPeers, negotiate
from .memory import BufferPool, bytes_of, reset_rss_peak, rss_bytes
from .staged import Releases, restore
from .wire import BIG, CHUNK, reserve_waiters

__all__ = ["Prepared", "prepare", "training_worlds", "execute_switch", "SwitchRecord"]


@dataclass
class Prepared:
    """The background part of a switch on one process: plan, groups, the new training Program."""

    planned: SwitchPlanned
    world: Any
    index: dict[int, int]
    groups: dict[tuple[int, ...], Any]
    keys: dict[int, str]
    program: Program | None
    plan_seconds: float
    world_seconds: float
    world_start: float
    world_end: float
    new_store: StateStore | None = None      # the destination store, when allocated ahead of the switch
    alloc_seconds: float = 0.0
    worlds: Any = None                       # the new layout's training world (Worlds), built ahead
    manager: Any = None                      # the ElasticManager that built the groups
    train_world_start: float = 0.0
    train_world_end: float = 0.0
    local: LocalPeers | None = None          # same-host peers moved by local reads (:func:`.local.negotiate`)


def prepare(manager, spec: ModelSpec, src: Strategy, dst: Strategy, src_devices: tuple[int, ...],
            dst_devices: tuple[int, ...], keys: dict[int, str], device: int, *, global_batch: int, seq_len: int,
            memory_budget=None, cost_model: Any = None, hosts: "tuple[int, ...] | None" = None,
            cluster: Any = "cpu-local", promote: "bool | None" = None) -> Prepared:
    """Plan the switch and compile the new training Program (planning), then build the switch's
    process groups and, on a device of the new layout, its training world (world creation).

    ``keys``: incarnation key of every participating device (see :mod:`..job.elastic`); ``cost_model``:
    what the lowering's promotions are scored with (default: the local machine's); ``hosts``: the
    host of each device id (None: one host) and ``cluster`` what prices the switch (see
    :func:`.live_cluster`); ``promote``: messages may become collectives (None: the cluster's
    default, see :func:`.lower`). Every
    participant creates the groups in the same order (the switch's world, its collective groups
    sorted, then the training world's groups sorted), so creation never waits crosswise.
    """
    from ..runtime import compile_program
    t0 = time.time()
    planned = plan_live_switch(spec, src, dst, src_devices, dst_devices, memory_budget=memory_budget,
                               cost_model=cost_model, hosts=hosts, cluster=cluster,
                               **({} if promote is None else {"promote": bool(promote)}))
    program = None
    if device in dst_devices:
        program = compile_program(spec if not _is_preset(spec) else spec.name, dst, global_batch=global_batch,
                                  seq_len=seq_len)
    t1 = time.time()
    parts = planned.participants
    world = manager.group(tuple(keys[d] for d in parts))
    groups = {g: manager.group(tuple(keys[d] for d in g))
              for g in sorted(planned.collective_groups(device), key=lambda g: (len(g), g))}
    reserve_waiters(planned.program, device)
    local = negotiate(manager.store, keys[device], {d: keys[d] for d in parts}) if world is not None else None
    t2 = time.time()
    prep = Prepared(planned, world, {d: i for i, d in enumerate(parts)}, groups, keys, program,
                    t1 - t0, t2 - t1, t1, t2, manager=manager, local=local)
    if program is not None:
        prep.worlds = training_worlds(manager, [keys[d] for d in dst_devices], dst_devices.index(device), program)
        prep.train_world_start, prep.train_world_end = t2, time.time()
    return prep


def training_worlds(manager, members: list[str], rank: int, program: Program):
    """The process groups a Runtime of ``program`` needs, built on the job's store by ``manager``
    (``members``: the incarnation key of each rank). Every rank of the layout must call it."""
    from ..groups import Worlds
    from ..runtime import world_keys
    worlds = Worlds(rank, len(members), getattr(manager, "backend", "gloo"),
                    factory=lambda ranks, channel: manager.process_group(tuple(members[r] for r in ranks), channel))
    worlds.prepare(world_keys(program))
    return worlds


def _is_preset(spec: ModelSpec) -> bool:
    from ... import models
    try:
        return models.get(spec.name) == spec
    except Exception:  # noqa: BLE001 - not a preset name
        return False


@dataclass
class SwitchRecord:
    """Timings (seconds) and volumes of one switch on one process."""

    step: int
    src: str
    dst: str
    device: int
    plan_seconds: float = 0.0
    world_seconds: float = 0.0
    transfer_seconds: float = 0.0
    verify_seconds: float = 0.0
    rebuild_seconds: float = 0.0
    pause_seconds: float = 0.0
    alloc_seconds: float = 0.0     # the destination store's allocation (in the background when announced)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0           # received by reading a same-host sender's memory (no socket)
    bytes_between_hosts: int = 0   # the whole switch's bytes from one host to another, as planned (multi-host jobs)
    cluster: str = ""              # what the switch was planned and priced on (its hosts and link kinds)
    zero_copy: int = 0
    sums_reused: int = 0           # sent parts of the old state summed once for several peers
    packs_shared: int = 0          # sends whose packed messages an identical send had packed (packed once)
    old_bytes: int = 0             # the source layout's state on this process (kept whole until the verdict)
    new_bytes: int = 0             # the destination layout's state on this process
    staging_peak_bytes: int = 0    # most staging (pack / receive) bytes in use at once
    peak_bytes: int = 0            # old + new + staging peak: this process's switch memory high-water mark
    released_bytes: int = 0        # old state handed back stage by stage (a staged switch)
    stages: int = 1
    rss_start_bytes: int = 0       # this process's resident memory when the transfer began ...
    rss_peak_bytes: int = 0        # ... and its high-water mark during transfer and verify (Linux)
    phases: dict = field(default_factory=dict)           # transfer driver seconds: keep, pack, unpack, ...
    #: seconds outside the transfer: ``setup`` (the executor, before the transfer), and per verification round
    #: ``publish`` (this device's record), ``wait`` (until every participant's record is there), ``read``; and
    #: for the whole switch ``gc`` (Python's garbage collector), ``cpu`` (this process's CPU seconds, every
    #: thread) and ``driver_cpu`` (the driver thread's)
    verify_phases: dict = field(default_factory=dict)
    joining: bool = False          # this process had no state before (its "pause" is its whole join)
    aborted: str | None = None
    rows: list[tuple] = field(default_factory=list)      # (stream, op, start, end) absolute wall clock

    @property
    def seconds(self) -> float:
        """Total work of the switch, background phases included."""
        return (self.plan_seconds + self.world_seconds + self.transfer_seconds + self.verify_seconds
                + self.rebuild_seconds)


def execute_switch(prep: Prepared, store, prefix: str, device: int, old: StateStore | None,
                   new: StateStore | None, record: SwitchRecord, *, timeout: float = 60.0, pool: BufferPool | None = None,
                   steps_done: int | None = None, on_received: Callable | None = None,
                   on_issue: Callable | None = None, big: int = BIG, chunk: int = CHUNK, streams: Any = None,
                   host_wire: bool = False) -> dict:
    """Transfer and verify (phases 3 and 4). Returns the job meta (``steps_done``, ``opt_step``).

    ``streams``/``host_wire``: how the executor drives the transfers (the NCCL driver on the
    device's streams, or the gloo one; messages through host staging for device state on gloo),
    see :class:`~.executor.SwitchExecutor`.

    A *staged* switch (``prep.planned.staged``: old + new state exceed the memory budget) runs
    stage by stage, verifies each stage, and releases the old regions the stage frees
    (:mod:`.staged`). ``on_received``/``on_issue``: fault hooks tests inject (see
    :class:`~.executor.SwitchExecutor`). Raises SwitchAborted when anything fails; the old
    layout's state is then whole again (never written, or restored from verified copies).
    """
    t_in, cpu0, driver0 = time.time(), time.process_time(), time.thread_time()
    kv = dist.PrefixStore(prefix, store)
    parts = prep.planned.participants
    leader = min(prep.planned.src_devices)
    pool = pool if pool is not None else BufferPool()
    reset_rss_peak()
    record.rss_start_bytes = rss_bytes()[0]
    record.old_bytes, record.new_bytes = bytes_of(old), bytes_of(new)
    ex = SwitchExecutor(prep.planned.program, device, old, new, prep.world, prep.index,
                        lambda g: prep.groups[g], timeout=timeout, pool=pool, on_received=on_received, on_issue=on_issue,
                        peer_gone=lambda: _gone(store, parts), big=big, chunk=chunk, streams=streams,
                        host_wire=host_wire, local=prep.local)
    meta = None if old is None else {"steps_done": steps_done,
                                     "opt_step": max(b.step for b in old.buffers.values())}
    gc_clock = _GcClock()
    try:
        record.verify_phases["setup"] = time.time() - t_in
        if prep.planned.staged:
            recs = _run_staged(ex, prep, kv, store, device, old, new, record, timeout, meta)
        else:
            t0 = time.time()
            reason = _transfer(ex, None)
            t1 = time.time()
            record.transfer_seconds = t1 - t0
            record.rows.append(("switch", "transfer", t0, t1))
            record.staging_peak_bytes = pool.peak
            record.peak_bytes = record.old_bytes + record.new_bytes + record.staging_peak_bytes
            fails, recs = _decide(kv, store, "verdict", device, parts, ex.stats, set(), set(), reason, timeout,
                                  record, meta)
            t2 = time.time()
            record.verify_seconds = t2 - t1
            record.rows.append(("switch", "verify", t1, t2))
            if fails:
                raise SwitchAborted(f"switch at step {record.step} aborted and rolled back to {record.src}: "
                                    f"{fails[0]}", fails[0])
    finally:
        gc_clock.stop()
    record.verify_phases.update(gc=gc_clock.seconds, cpu=time.process_time() - cpu0,
                                driver_cpu=time.thread_time() - driver0)
    _stats(record, ex.stats)
    record.phases.update({k: round(v, 6) for k, v in record.verify_phases.items()})
    record.rss_peak_bytes = rss_bytes()[1]
    return recs[parts.index(leader)]["meta"]


class _GcClock:
    """Seconds Python's garbage collector ran (any thread of this process) until :meth:`stop`."""

    def __init__(self) -> None:
        import gc
        self.seconds, self._t0 = 0.0, 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def stop(self) -> None:
        import gc
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def _transfer(ex: SwitchExecutor, stage: int | None) -> str | None:
    """Run the executor (one stage of it); the reason it failed, or None."""
    try:
        ex.run(stage)
    except SwitchAborted as e:
        return str(e)
    return None


def _stats(record: SwitchRecord, stats) -> None:
    record.bytes_sent, record.bytes_received, record.zero_copy = stats.bytes_sent, stats.bytes_received, stats.zero_copy
    record.bytes_local = stats.bytes_local
    record.sums_reused, record.packs_shared = stats.sums_reused, stats.packs_shared
    record.phases = {k: round(v, 6) for k, v in stats.seconds.items()}


def _decide(kv, store, name: str, device: int, parts, stats, sent_before: set, recv_before: set,
            reason: str | None, timeout: float, record: SwitchRecord,
            meta: dict | None) -> tuple[list[str], list[dict]]:
    """One store round per switch (or stage): publish this device's record as ``name`` (why its
    transfer failed, or None; the checksums of what it sent and received since ``sent_before`` /
    ``recv_before``; ``meta``) and read every participant's. Every device derives the same
    verdict from the same records: the failures' reasons (failed transfers, then received
    checksums that differ from their senders'), and the records. Raises SwitchAborted (peer
    failed) when a participant never publishes."""
    sent = {k: v for k, v in stats.sent_crc.items() if k not in sent_before}
    recv = {k: v for k, v in stats.recv_crc.items() if k not in recv_before}
    t0 = time.time()
    kv.set(f"{name}/{device}", json.dumps({"fail": reason, "sent": sent, "recv": recv, "meta": meta}))
    keys = [f"{name}/{d}" for d in parts]
    t1 = time.time()
    _await(kv, keys, timeout, lambda: _gone(store, [d for d in parts if not kv.check([f"{name}/{d}"])]))
    t2 = time.time()
    if not kv.check(keys):
        missing = [d for d in parts if not kv.check([f"{name}/{d}"])]
        raise SwitchAborted(f"switch at step {record.step} aborted: device(s) {missing} never finished "
                            f"({reason or 'a peer failed'}); the old layout's state is intact on the survivors",
                            reason, peer_failed=True)
    recs = [json.loads(v) for v in kv.multi_get(keys)]
    fails = [r["fail"] for r in recs if r["fail"] is not None]
    by_tag = {k: v for r in recs for k, v in r["sent"].items()}
    for d, r in zip(parts, recs):
        for k, mine in r["recv"].items():
            theirs = by_tag.get(k)
            if theirs is None:
                fails.append(f"device {d}: the sender of transfer {k} published no checksum of it")
            elif theirs != mine:
                fails.append(f"device {d}: the checksum of received transfer {k} is {mine:#010x} but "
                             f"the sender sent {theirs:#010x}")
    vp = record.verify_phases
    for k, v in (("publish", t1 - t0), ("wait", t2 - t1), ("read", time.time() - t2)):
        vp[k] = vp.get(k, 0.0) + v
    return fails, recs


def _await(kv, keys: list[str], timeout: float, gone) -> bool:
    """Poll until every key exists (one store round trip a poll); False after ``timeout`` seconds
    or as soon as ``gone()`` (checked every 25 polls) names a failed device."""
    end, polls = time.monotonic() + timeout, 0
    while not kv.check(keys):
        polls += 1
        if time.monotonic() > end or (polls % 25 == 0 and gone() is not None):
            return False
        time.sleep(0.001)
    return True


def _run_staged(ex: SwitchExecutor, prep: Prepared, kv, store, device: int, old: StateStore | None,
                new: StateStore | None, record: SwitchRecord, timeout: float, meta: dict | None) -> list[dict]:
    """Stage by stage: transfer, verify, then release the old regions the stage frees. A failed
    stage restores what earlier stages released, so the old layout is whole again. Returns the
    last stage's records (see :func:`_decide`)."""
    planned = prep.planned
    parts = planned.participants
    rel = Releases(planned.program, device, old, (old if old is not None else new).spec, planned.src,
                   planned.src_devices)
    new_by_stage = _new_bytes_by_stage(planned.program, device)
    record.peak_bytes = 0
    record.stages = len(new_by_stage)
    for k in range(record.stages):
        t0 = time.time()
        sent0, recv0 = set(ex.stats.sent_crc), set(ex.stats.recv_crc)
        ex.pool.reset_peak()
        reason = _transfer(ex, k)
        t1 = time.time()
        try:
            fails, recs = _decide(kv, store, f"verdict{k}", device, parts, ex.stats, sent0, recv0, reason, timeout,
                                  record, meta)
        except SwitchAborted as e:
            if k == 0:
                raise
            # put back what earlier stages released, from the survivors' verified copies
            gone = frozenset(d for d in parts if store.check([f"dead/{d}"]))   # as the launcher saw it
            raise SwitchAborted(f"{e}; {_try_restore(rel, k, prep, new, timeout, device, gone, record.step)}",
                                e.reason, e.peer_failed) from e
        t2 = time.time()
        record.transfer_seconds += t1 - t0
        record.verify_seconds += t2 - t1
        record.rows += [("switch", "transfer", t0, t1), ("switch", "verify", t1, t2)]
        live = record.old_bytes - rel.released_bytes + min(sum(new_by_stage[:k + 1]), record.new_bytes)
        record.peak_bytes = max(record.peak_bytes, live + ex.pool.peak)
        record.staging_peak_bytes = max(record.staging_peak_bytes, ex.pool.peak)
        if fails:
            got = _restore(rel, k, prep, new, timeout, frozenset(), record.step) if k > 0 else 0
            raise SwitchAborted(f"switch at step {record.step} aborted at stage {k} and rolled back to "
                                f"{record.src} ({got / 2**20:.1f} MiB of released old state restored here): "
                                f"{fails[0]}", fails[0])
        released = rel.release(k)
        record.released_bytes += released
        record.rows.append(("switch", f"release{k}", t2, time.time()))
    return recs


def _restore(rel, k: int, prep: Prepared, new, timeout: float, gone: frozenset, step: int) -> int:
    """Restore what stages before ``k`` released, over a fresh communicator of the survivors (a
    group that lost a member cannot be trusted)."""
    alive = [d for d in prep.planned.participants if d not in gone]
    world = prep.manager.group(tuple(prep.keys[d] for d in alive), f"restore/{step}/{k}")
    return restore(rel, k, world, {d: i for i, d in enumerate(alive)}, new, timeout, gone)


def _try_restore(rel, k: int, prep: Prepared, new, timeout: float, device: int, gone: frozenset, step: int) -> str:
    try:
        got = _restore(rel, k, prep, new, timeout, gone, step)
        return f"{got / 2**20:.1f} MiB of released old state restored on device {device}"
    except SwitchAborted as e:
        return str(e)


def _new_bytes_by_stage(program: Program, device: int) -> list[int]:
    """Bytes of new state buffers the Program allocates on ``device`` at each stage."""
    out = [0] * SwitchMeta.of(program).stages
    rp = program.ranks.get(device)
    for ins in (rp.streams.get("pack", ()) if rp is not None else ()):
        what, arg = parse_switch_name(ins.key)
        if what == "keep":
            out[int(arg[0])] += sum(nb for name, nb in ins.alloc if parse_switch_name(name)[0] == "new")
    return out


def _gone(store, devices) -> int | None:
    """A device among ``devices`` that the launcher marked dead, else None."""
    for d in devices:
        if store.check([f"dead/{d}"]):
            return d
    return None
