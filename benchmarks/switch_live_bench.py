"""In-memory hot switch vs. PyTorch Distributed Checkpoint vs. the transfer floor (one JSON object).

4 gloo processes hold the training state (fp32 parameters + AdamW moments, about 1.2 GB in all)
of a wide GPT in a source layout; each case moves it to a destination layout:

- ``switch``: the live switch (transfer per the switch Program, checksums and votes), with
  planning, world creation and the destination store's allocation done beforehand, as a live job
  does them in the background after the switch's notice (``alloc_seconds`` reports the last);
- ``dcp``: ``torch.distributed.checkpoint.save`` under the old layout and ``load`` under the
  new one (every rank's boxes as ShardedTensor shards, so DCP reshards), on /dev/shm and on disk,
  into a destination store allocated beforehand too. On disk the save is made durable (fsync) and
  the files are dropped from the page cache before the load, as for a job restarted on a
  replacement node (without that, "disk" reads back from memory and equals /dev/shm);
- ``floor``: the same cross-device bytes with the same carriers, pre-packed: one gloo all_to_all
  between hosts and one local read per same-host pair (as the switch moves them, see
  ``parashift.exec.switch.local``), plus each rank's on-device bytes as one memcpy, with no
  planning, into destination buffers allocated (and faulted in) beforehand with the same
  allocator as the switch's store.

Two more cases run on two "hosts" on loopback (``--set two-hosts`` runs only them): the script
starts itself once per host, each in a process group of its own with two processes (devices 0-1
and 2-3); host 1 serves the job's store on a loopback port under the job's secret and host 2
joins it, as ``parashift run --live --endpoint`` and ``parashift join`` do, so the two hosts'
processes meet only through that endpoint. ``dp=4,zero=1 -> tp=2,dp=2`` and ``dp=2,pp=2 -> tp=4``
move state between the hosts (``bytes_cross_host``); DCP runs on the same processes.
``bytes_local``: what the switch moved between processes of one host by local reads
(``parashift.exec.switch.local``; ``PARASHIFT_LOCAL_READS=0`` sends it through gloo too).

The destination devices are ordered as a live job orders them (``--placement keep``: the order
that keeps the most state in place, reported as ``dst_devices``); ``--placement given`` runs
rank i on device i. DCP and the floor run on the same order.

``phases`` (per case, slowest rank, median of the repeats; ``phases_mean``: the mean over ranks): the
transfer and verify phases, the transfer driver's own seconds (``keep``/``pack``/``unpack`` copies,
``checksum``, ``issue``, ``idle``: waiting on the wire), the seconds outside the transfer (``setup``:
the executor; verification's ``publish``, ``wait`` for every record, ``read``; ``gc``), and CPU
seconds, which a busy host inflates less than wall time: ``cpu`` (the process, every thread),
``driver_cpu`` (the driver thread), ``keep_cpu``, ``pack_cpu``, ``unpack_cpu``, ``checksum_cpu``,
``issue_cpu``. Planning and world creation (``plan_seconds``, ``world_seconds``) run before the
switch, as a live job runs them in the background after the notice. ``memory_max_rank``: the largest per-rank switch memory figures.
``cpu_seconds`` / ``floor_cpu_seconds``: CPU seconds of all four processes together (every
thread, gloo's included) during the switch / the floor, a figure a busy host disturbs less than
wall time; ``cpu_split`` / ``floor_cpu_split``: the same by thread (Linux), ``driver`` (the thread
that runs the switch, or the floor's call and copy), ``waiters`` (the switch's wait threads) and
``other`` (gloo's threads, which move the bytes through the sockets, and the store client's).

``--unverified`` (a diagnostic) replaces every transfer checksum by a constant, to show what
verification costs on the machine at hand.

``--rounds N`` runs the whole benchmark N times, each on fresh processes: on a shared host the
ratios drift more between runs than within one. Each case then reports every round (``rounds``),
the median over rounds of its seconds and ratios, and each ratio's lowest and highest round
(``vs_floor_range``, ``vs_dcp_disk_range``, ``vs_dcp_shm_range``). Progress goes to stderr.

Run: ``python benchmarks/switch_live_bench.py [--repeats 3] [--dcp-repeats 2] [--rounds 1] [--small]
[--placement given] [--set all|one-host|two-hosts] [--case TEXT]`` (``--case``: only the cases whose
name contains TEXT, e.g. ``dp4z1``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from parashift import models
from parashift.exec.job.elastic import ElasticManager, Member, launch_elastic
from parashift.exec.state import StateStore
from parashift.exec.switch.local import negotiate, read_bytes as local_read
from parashift.exec.switch import (BufferPool, Prepared, SwitchRecord, bytes_of, crc, execute_switch, kind_tensor,
                                   layout_store, lazy_alloc, piece_view, reserve_waiters, state_alloc)
from parashift.vps.transition import SwitchMeta, place, plan_live_switch
from parashift.strategy import Strategy
from parashift.vps import layout

CASES = [("tp2dp2z1->tp4", "tp=2,dp=2,zero=1", "tp=4", (0, 1, 2, 3), (0, 1, 2, 3)),
         ("tp4->tp2dp2z1", "tp=4", "tp=2,dp=2,zero=1", (0, 1, 2, 3), (0, 1, 2, 3)),
         ("shrink 4->3", "tp=2,dp=2,zero=1", "dp=3,zero=1", (0, 1, 2, 3), (0, 1, 2))]
#: run by two "hosts" on loopback (devices 0-1 and 2-3, each a process group of its own joined through
#: the job's store at an endpoint, as `parashift run --endpoint` / `parashift join` run them); each moves
#: state between the hosts (``bytes_cross_host``)
HOST_CASES = [("2 hosts: dp4z1->tp2dp2", "dp=4,zero=1", "tp=2,dp=2", (0, 1, 2, 3), (0, 1, 2, 3)),
              ("2 hosts: dp2pp2->tp4", "dp=2,pp=2", "tp=4", (0, 1, 2, 3), (0, 1, 2, 3))]
HOSTS = {1: (0, 1), 2: (2, 3)}


def _model(small: bool):
    if small:
        return models.gpt(2, 256, 8, ffn=1024, vocab=1024, seq_len=64, name="bench-small", dtype="fp32", pad_vocab=64)
    return models.gpt(2, 1536, 16, ffn=6144, vocab=8192, seq_len=256, name="bench-wide", dtype="fp32", pad_vocab=64)


def _fill(store: StateStore, spec) -> None:
    """Deterministic values by global position (replicas agree, as in a real job): element (i, j)
    of a tensor's ``kind`` is ``row[i] + col[j]`` for fixed pseudo-random ``row``/``col`` vectors."""
    shapes = {t.name: t.shape for t in spec.tensors}
    for fam, b in store.buffers.items():
        for ki, k in enumerate(("param", "exp_avg", "exp_avg_sq")):
            flat, base = kind_tensor(store, fam, k)
            for p in b.pieces:
                a, e = max(p.start, base), min(p.start + p.numel, base + flat.numel())
                if a >= e:
                    continue
                shape = shapes[p.name]
                g = torch.Generator().manual_seed(len(p.name) * 31 + ki)
                row = torch.rand(shape[0], generator=g)[p.offsets[0]:p.offsets[0] + p.sizes[0]]
                if len(shape) == 1:
                    local = row
                else:
                    cols = int(np.prod(shape[1:]))
                    col = torch.rand(cols, generator=g).view(shape[1:])
                    col = col[tuple(slice(o, o + n) for o, n in zip(p.offsets[1:], p.sizes[1:]))].reshape(-1)
                    local = (row[:, None] + col[None, :]).view(-1)
                flat[a - base:e - base] = local[a - p.start:e - p.start]


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process (Linux ``schedstat``, nanoseconds; empty elsewhere)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                out[int(t)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
    return out


def _cpu_split(before: dict[int, float]) -> dict[str, float]:
    """CPU seconds since ``before`` (:func:`_thread_cpu`) by thread: ``driver`` (this one), ``waiters``
    (the switch's wait threads) and ``other`` (gloo's, the store client's, ...)."""
    import threading
    waiters = {t.native_id for t in threading.enumerate() if t.name == "parashift-switch-wait"}
    me = threading.get_native_id()
    out = dict.fromkeys(("driver", "waiters", "other"), 0.0)
    for t, v in _thread_cpu().items():
        out["driver" if t == me else "waiters" if t in waiters else "other"] += v - before.get(t, 0.0)
    return out


def _allmax(pg, x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    o = torch.distributed.AllreduceOptions()
    o.reduceOp = torch.distributed.ReduceOp.MAX
    pg.allreduce([t], o).wait()
    return float(t.item())


def _allsum(pg, x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    pg.allreduce([t]).wait()
    return float(t.item())


def _boxes(spec, strategy: Strategy, rank: int, *, owned: bool = False):
    """(tensor name, kind, lo, hi) of every box ``rank`` holds (param and moments); ``owned``: only
    the boxes no lower rank holds too (replicas are saved once)."""
    lay = layout(spec, strategy)
    reg = lay.regions(kinds=["param", "exp_avg", "exp_avg_sq"])
    nd = lay.table.ndim
    seen: set = set()
    out = []
    for r, t, k, lo, hi in zip(reg.rank.tolist(), reg.tensor.tolist(), reg.kind.tolist(), reg.lo.tolist(),
                               reg.hi.tolist()):
        key = (lay.table.names[t], lay.kinds[k], tuple(lo[:nd[t]]), tuple(hi[:nd[t]]))
        first = key not in seen
        seen.add(key)
        if r == rank and (first or not owned):
            out.append(key)
    return out


def _save_dict(spec, store: StateStore, strategy: Strategy):
    """A DCP state dict: one ShardedTensor per (tensor, kind), this rank's owned boxes as local shards."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    me = torch.distributed.get_rank()
    mine: dict[tuple[str, str], list] = {}
    for name, kind, lo, hi in _boxes(spec, strategy, me, owned=True):
        size = [b - a for a, b in zip(lo, hi)]
        t = piece_view(store, name, kind, lo, hi).contiguous()
        mine.setdefault((name, kind), []).append(Shard(t, ShardMetadata(list(lo), size, f"rank:{me}/cpu")))
    return {f"{kind}/{t.name}": init_from_local_shards(mine.get((t.name, kind), []), *t.shape)
            for t in spec.tensors for kind in ("param", "exp_avg", "exp_avg_sq")}


def _box_planner(boxes: dict):
    """A DCP load planner that reads exactly this rank's boxes (``fqn -> [(offsets, tensor)]``),
    replicas included, straight into the given tensors."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class BoxLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, lst in boxes.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(lo), sizes=t.size()) for lo, t in lst]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            t = boxes[read_item.dest_index.fqn][read_item.dest_index.index][1]
            for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, off, n)
            return t

        def commit_tensor(self, read_item, tensor) -> None:
            pass
    return BoxLoadPlanner()


def _persist(path: str, device: int) -> None:
    """Make this rank's checkpoint files durable (fsync) and drop them from the page cache, so
    the load reads storage as a restarted job on a replacement node does."""
    for name in sorted(os.listdir(path)):
        if name.startswith(f"__{device}_") or (device == 0 and not name.startswith("__")):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dcp_case(spec, src, dst, ddev, device, old, path, durable: bool) -> tuple[float, list[int]]:
    import torch.distributed.checkpoint as dcp
    new = None                      # the destination store exists beforehand, as in the switch's case
    if device in ddev:
        new = StateStore(spec, dst, ddev.index(device), torch.device("cpu"), init=False, alloc=state_alloc)
    torch.distributed.barrier()
    t0 = time.perf_counter()
    dcp.save(_save_dict(spec, old, src), checkpoint_id=path)
    if durable:
        torch.distributed.barrier()
        _persist(path, device)
        torch.distributed.barrier()
    boxes: dict[str, list] = {}
    if device in ddev:
        rank = ddev.index(device)
        for name, kind, lo, hi in _boxes(spec, dst, rank):
            boxes.setdefault(f"{kind}/{name}", []).append((lo, torch.empty([b - a for a, b in zip(lo, hi)])))
    dcp.load({}, checkpoint_id=path, planner=_box_planner(boxes))
    for fqn, lst in boxes.items():
        kind, name = fqn.split("/", 1)
        for lo, t in lst:
            hi = tuple(a + n for a, n in zip(lo, t.shape))
            piece_view(new, name, kind, lo, hi).copy_(t)
    torch.distributed.barrier()
    dt = time.perf_counter() - t0
    digest = _digest(new)
    del boxes, new
    return dt, digest


def _digest(store: StateStore | None) -> list[int]:
    """CRC32 of every state buffer of a store (to check that both paths built the same state)."""
    if store is None:
        return []
    return [crc(getattr(b, k)) for _, b in sorted(store.buffers.items()) for k in ("param", "exp_avg", "exp_avg_sq")]


def _floor(planned, device: int, world, index, local) -> float:
    """The same carriers with none of the switch's work: pre-packed bytes through one all_to_all
    between hosts and one local read per same-host peer (``local``: the switch's), plus one
    memcpy of the kept bytes."""
    P = SwitchMeta.of(planned.program).pieces           # every destination piece, kept ones included
    src, dst, nb = P.src, P.dst, P.nbytes
    parts = planned.participants
    assert len(index) == len(parts)

    def size(a: int, b: int) -> int:
        return int(nb[(src == a) & (dst == b)].sum()) if a != b else 0
    send = [size(device, d) if d not in local.readers else 0 for d in parts]
    recv = [size(d, device) if d not in local.sources else 0 for d in parts]
    kept = int(nb[(src == device) & (dst == device)].sum())
    cpu = torch.device("cpu")       # destinations allocated (and faulted in) beforehand, as the switch's are
    inp = torch.ones(sum(send), dtype=torch.uint8)
    out = state_alloc(sum(recv), torch.uint8, cpu)
    lent = {d: torch.ones(size(device, d), dtype=torch.uint8) for d in local.readers}
    got = {d: state_alloc(size(d, device), torch.uint8, cpu) for d in local.sources}
    addrs = torch.zeros(len(parts), dtype=torch.int64)  # where each reader finds what this device lends it
    for d, t in lent.items():
        addrs[index[d]] = t.data_ptr()
    table = [torch.zeros_like(addrs) for _ in parts]
    world.allgather([table], [addrs]).wait()
    a, b = torch.ones(kept, dtype=torch.uint8), state_alloc(kept, torch.uint8, cpu)
    _allmax(world, 0.0)
    threads = _thread_cpu()
    t0, c0 = time.perf_counter(), time.process_time()
    work = world.alltoall_base(out, inp, recv, send, torch.distributed.AllToAllOptions())
    for d, t in got.items():
        local_read(local.sources[d], t.data_ptr(), int(table[index[d]][index[device]]), t.numel())
    work.wait()
    b.copy_(a)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    split = _cpu_split(threads)
    return _allmax(world, dt), _allsum(world, cpu), {k: _allsum(world, v) for k, v in split.items()}


def _staged_case(spec, ctx, world, keys, mgr, ci: int, src, dst, sdev, ddev, fraction: float, repeats: int) -> dict:
    """The switch under a memory budget of ``fraction`` x (old + new state) of the fullest device:
    stage by stage, old state released as it goes, into a lazily allocated store (the old store
    is refilled from a pristine copy before each run, since the switch releases it)."""
    device = ctx.device
    old = StateStore(spec, src, sdev.index(device), torch.device("cpu"), init=False)
    _fill(old, spec)
    pristine = {f: {k: getattr(b, k).clone() for k in ("param", "exp_avg", "exp_avg_sq")} for f, b in old.buffers.items()}
    new_bytes = bytes_of(layout_store(spec, dst, ddev.index(device))) if device in ddev else 0
    both = _allmax(world, float(bytes_of(old) + new_bytes))   # old + new state of the fullest device
    budget = int(fraction * both)
    planned = plan_live_switch(spec, src, dst, sdev, ddev, memory_budget=budget)
    groups = {g: mgr.group(tuple(keys[d] for d in g)) for g in planned.collective_groups(device)}
    reserve_waiters(planned.program, device)
    prep = Prepared(planned, world, {d: i for i, d in enumerate(planned.participants)}, groups, keys, None,
                    0.0, 0.0, 0, 0, manager=mgr)
    runs, recs = [], []
    for rep in range(repeats + 1):
        for f, kinds in pristine.items():
            for k, t in kinds.items():
                getattr(old.buffers[f], k).copy_(t)
        new = StateStore(spec, dst, ddev.index(device), torch.device("cpu"), init=False,
                         alloc=lazy_alloc) if device in ddev else None
        _allmax(world, 0.0)
        t0 = time.perf_counter()
        rec = SwitchRecord(0, str(src), str(dst), device)
        execute_switch(prep, ctx.store, f"staged{ci}.{rep}/", device, old, new, rec, timeout=300, steps_done=0)
        dt = _allmax(world, time.perf_counter() - t0)
        if rep:
            runs.append(dt)
            recs.append(rec)
        del new
    r = recs[-1]
    return {"staged_fraction": fraction, "budget_bytes": budget, "stages": SwitchMeta.of(planned.program).stages,
            "staged_switch_seconds": statistics.median(runs), "staged_switch_runs": runs,
            "staged_memory_max_rank": {k: int(_allmax(world, float(getattr(r, k)))) for k in
                                       ("old_bytes", "new_bytes", "released_bytes", "staging_peak_bytes", "peak_bytes")},
            "staged_rss_growth_max_rank": int(_allmax(world, float(r.rss_peak_bytes - r.rss_start_bytes)))}


def _cross_host(planned, host_of: dict) -> int:
    """Bytes the switch moves from a device of one host to a device of another."""
    P = SwitchMeta.of(planned.program).pieces
    hs, hd = (np.array([host_of[int(d)] for d in x]) for x in (P.src, P.dst))
    return int(P.nbytes[hs != hd].sum())


def _worker(ctx, spec, repeats: int, dcp_repeats: int, dirs: dict, staged: float | None = None,
            placement: str = "keep", unverified: bool = False, cases: tuple = tuple(CASES),
            host_of: dict | None = None) -> dict:
    if unverified:                     # diagnostic: every checksum a constant (what verification costs)
        import parashift.exec.switch.executor as executor
        executor.checksum = lambda t: 0
        executor.SwitchExecutor._hot = lambda self, buf: None     # no sums taken while packing either
        import parashift.exec.switch.local as local

        def unsummed(pid, addr, part, chunk):       # same-host reads, not summed
            b = part.view(-1).view(torch.uint8)
            local.read_bytes(pid, b.data_ptr(), addr, b.numel())
            return 0
        local.read_into = unsummed
        local.checksum = lambda t: 0
    device = ctx.device
    mgr = ElasticManager(ctx.store, ctx.member.key, 120.0)
    keys = {d: f"{d}.0" for d in range(4)}
    world = mgr.group(tuple(keys[d] for d in range(4)))
    torch.distributed.init_process_group("gloo", store=torch.distributed.PrefixStore("dcp", ctx.store), rank=device,
                                         world_size=4, timeout=datetime.timedelta(seconds=600))
    pool = BufferPool()
    out = {}
    hosts = tuple(host_of[d] for d in range(max(host_of) + 1)) if host_of is not None else None
    for ci, (name, src, dst, sdev, ddev) in enumerate(cases):
        src, dst = Strategy.parse(src), Strategy.parse(dst)
        if placement == "keep":        # as a live job orders the destination devices (on their hosts)
            ddev = place(spec, src, dst, sdev, ddev, hosts)
        if staged is not None:
            out[name] = _staged_case(spec, ctx, world, keys, mgr, ci, src, dst, sdev, ddev, staged, repeats)
            continue
        old = StateStore(spec, src, sdev.index(device), torch.device("cpu"), init=False)
        _fill(old, spec)
        t0 = time.perf_counter()
        planned = plan_live_switch(spec, src, dst, sdev, ddev, hosts=hosts)
        plan_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        parts = planned.participants
        groups = {g: mgr.group(tuple(keys[d] for d in g)) for g in planned.collective_groups(device)}
        reserve_waiters(planned.program, device)
        world_s = time.perf_counter() - t0
        prep = Prepared(planned, world, {d: i for i, d in enumerate(parts)}, groups, keys, None, plan_s, world_s, 0, 0,
                        local=negotiate(ctx.store, ctx.member.key, {d: keys[d] for d in parts}))
        sw, al, phases, recs, fl, sw_cpu, fl_cpu, sw_split, fl_split = [], [], [], [], [], [], [], [], []
        for rep in range(repeats + 1):
            t0 = time.perf_counter()      # the destination store: allocated when the switch is announced
            new = StateStore(spec, dst, ddev.index(device), torch.device("cpu"), init=False,
                             alloc=state_alloc) if device in ddev else None
            alloc_s = time.perf_counter() - t0
            _allmax(world, 0.0)
            threads = _thread_cpu()
            t0, c0 = time.perf_counter(), time.process_time()
            rec = SwitchRecord(0, str(src), str(dst), device)
            execute_switch(prep, ctx.store, f"bench{ci}.{rep}/", device, old, new, rec, timeout=300, pool=pool,
                           steps_done=0)
            dt = _allmax(world, time.perf_counter() - t0)
            cpu = _allsum(world, time.process_time() - c0)
            split = {k: _allsum(world, v) for k, v in _cpu_split(threads).items()}
            mine = sorted({**rec.phases, "transfer": rec.transfer_seconds, "verify": rec.verify_seconds}.items())
            ph = {k: _allmax(world, v) for k, v in mine}
            ph.update({f"mean_{k}": _allsum(world, v) / world.size() for k, v in mine})
            if rep:                       # the first run warms the pool and the allocator
                sw.append(dt)
                sw_cpu.append(cpu)
                sw_split.append(split)
                al.append(_allmax(world, alloc_s))
                phases.append(ph)
            recs.append(rec)
            want = _digest(new)
            del new
            if rep:                       # interleaved, so that a busy host slows both alike
                a, b, c = _floor(planned, device, world, prep.index, prep.local)
                fl.append(a)
                fl_cpu.append(b)
                fl_split.append(c)
        mem = {k: int(_allmax(world, float(getattr(recs[-1], k))))
               for k in ("old_bytes", "new_bytes", "staging_peak_bytes", "peak_bytes")}
        res = {"dst_devices": list(ddev), "switch_seconds": statistics.median(sw),
               "floor_seconds": statistics.median(fl),
               "plan_seconds": _allmax(world, plan_s), "world_seconds": _allmax(world, world_s),
               "alloc_seconds": statistics.median(al),
               "bytes_moved": SwitchMeta.of(planned.program).bytes_moved,
               "bytes_kept": SwitchMeta.of(planned.program).bytes_kept, "switch_runs": sw, "floor_runs": fl,
               "bytes_local": int(_allsum(world, float(recs[-1].bytes_local))),
               "cpu_seconds": statistics.median(sw_cpu), "floor_cpu_seconds": statistics.median(fl_cpu),
               "cpu_split": {k: statistics.median(x[k] for x in sw_split) for k in sw_split[0]},
               "floor_cpu_split": {k: statistics.median(x[k] for x in fl_split) for k in fl_split[0]},
               "phases": {k: statistics.median(p[k] for p in phases) for k in phases[0] if not k.startswith("mean_")},
               "phases_mean": {k[5:]: statistics.median(p[k] for p in phases) for k in phases[0]
                               if k.startswith("mean_")},
               "memory_max_rank": mem}
        if host_of is not None:
            res.update(hosts={str(h): list(d) for h, d in HOSTS.items()},
                       bytes_cross_host=_cross_host(planned, host_of))
        for label, root in dirs.items():
            runs = []
            for rep in range(dcp_repeats):
                path = os.path.join(root, f"c{ci}r{rep}")
                dt, got = _dcp_case(spec, src, dst, ddev, device, old, path, durable=label == "disk")
                if got != want:
                    raise RuntimeError(f"{name}: the state loaded from DCP differs from the switched state")
                runs.append(dt)
                torch.distributed.barrier()
                if device == 0:
                    shutil.rmtree(path, ignore_errors=True)
            res[f"dcp_{label}_seconds"] = statistics.median(runs)
        out[name] = res
        del old
        pool.clear()
    torch.distributed.destroy_process_group()
    return out


RATIOS = ("vs_floor", "vs_dcp_disk", "vs_dcp_shm")


def _round(spec, args) -> dict:
    """One run of every case on fresh processes, with its ratios."""
    shm = tempfile.mkdtemp(prefix="parashift-bench-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="parashift-bench-", dir=os.path.expanduser("~"))
    dirs = {} if args.no_dcp or args.staged else {"shm": shm, "disk": disk}
    cases = {}
    try:
        if args.set != "two-hosts" and any(args.case in c[0] for c in CASES):
            res = launch_elastic(_worker, [Member(d, 0, 0) for d in range(4)],
                                 args=(spec, args.repeats, args.dcp_repeats, dirs, args.staged, args.placement,
                                       args.unverified, tuple(c for c in CASES if args.case in c[0])),
                                 timeout=3000)
            cases.update(res["0.0"])
        if args.set != "one-host" and args.staged is None and any(args.case in c[0] for c in HOST_CASES):
            cases.update(_two_hosts(args, dirs))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    for c in cases.values():
        if "switch_seconds" not in c:          # a staged run reports its own figures
            continue
        c["vs_floor"] = c["switch_seconds"] / c["floor_seconds"]
        if "dcp_disk_seconds" in c:
            c["vs_dcp_disk"] = c["dcp_disk_seconds"] / c["switch_seconds"]
            c["vs_dcp_shm"] = c["dcp_shm_seconds"] / c["switch_seconds"]
    return cases


def _two_hosts(args, dirs: dict) -> dict:
    """:data:`HOST_CASES` on two hosts: this script again, once per host, each in a process group of
    its own; host 1 serves the job's store on a loopback port, host 2 joins it (as `parashift join`)."""
    import secrets
    import signal
    import socket
    import subprocess
    from parashift.exec.job.endpoint import SECRET_ENV
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, **{SECRET_ENV: secrets.token_hex(16)})
    cfg = json.dumps({"port": port, "small": args.small, "repeats": args.repeats, "dcp_repeats": args.dcp_repeats,
                      "dirs": dirs, "placement": args.placement, "unverified": args.unverified, "case": args.case})
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--host", str(h), "--host-config", cfg],
                              stdout=subprocess.PIPE, text=True, env=env, start_new_session=True) for h in HOSTS]
    try:
        outs = [p.communicate(timeout=3000)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"switch_live_bench: a host of the 2-host case failed (exit codes "
                         f"{[p.returncode for p in procs]})")
    return json.loads(outs[0])


def _host(h: int, cfg: dict) -> None:
    """One host of :func:`_two_hosts`: its two processes run :data:`HOST_CASES` with the other host's."""
    from parashift.exec.job.endpoint import SECRET_ENV
    from parashift.exec.jobstore import JobStore, connect, die_with_parent, serve
    die_with_parent()               # a host (and its processes) never outlives the benchmark
    secret, port = os.environ[SECRET_ENV], cfg["port"]
    if h == 1:
        job = serve(3000, "127.0.0.1", port, secret)
    else:
        store = connect("127.0.0.1", port, secret, 3000)   # a TCPStore client retries until host 1 serves
        job = JobStore(store, store, "127.0.0.1", port, secret)
    host_of = {d: k for k, ds in HOSTS.items() for d in ds}
    res = launch_elastic(_worker, [Member(d, 0, 0) for d in HOSTS[h]],
                         args=(_model(cfg["small"]), cfg["repeats"], cfg["dcp_repeats"], cfg["dirs"], None,
                               cfg["placement"], cfg["unverified"],
                               tuple(c for c in HOST_CASES if cfg["case"] in c[0]), host_of), timeout=3000, job=job)
    job.store.set(f"bench/done/{h}", "1")
    if h == 1:                      # the store lives here: serve it until every host is done
        job.store.wait([f"bench/done/{k}" for k in HOSTS])
        print(json.dumps(res["0.0"]))


def _line(c: dict) -> str:
    """A round's case in a few words (progress on stderr)."""
    if "switch_seconds" not in c:
        return f"staged {c['staged_switch_seconds']:.3f} s"
    s = f"switch {c['switch_seconds']:.3f} s, {c['vs_floor']:.2f}x the floor"
    return s + (f", {c['vs_dcp_disk']:.1f}x faster than DCP on disk" if "vs_dcp_disk" in c else "")


def _merge(rounds: list[dict]) -> dict:
    """Per case: every round's figures (``rounds``), and the median over rounds of the seconds and
    ratios (``*_range``: the lowest and highest round)."""
    out = {}
    for name in rounds[0]:
        rs = [r[name] for r in rounds]
        keys = [k for k, v in rs[0].items() if isinstance(v, float) and k.endswith(("_seconds",) + RATIOS)]
        c = {k: statistics.median(r[k] for r in rs) for k in keys}
        c.update({f"{k}_range": [min(r[k] for r in rs), max(r[k] for r in rs)] for k in RATIOS if k in rs[0]})
        c.update({k: {t: statistics.median(r[k][t] for r in rs) for t in rs[0][k]}
                  for k in ("cpu_split", "floor_cpu_split") if k in rs[0]})
        c.update({k: rs[0][k] for k in ("dst_devices", "bytes_moved", "bytes_kept", "bytes_local", "hosts", "bytes_cross_host")
                  if k in rs[0]})
        c["rounds"] = rs
        out[name] = c
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dcp-repeats", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a 30 MB state (a quick check of the script)")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP baselines (a quick look at the switch)")
    ap.add_argument("--staged", type=float, metavar="FRACTION",
                    help="instead: the switch under a memory budget of FRACTION x (old + new state), stage by stage")
    ap.add_argument("--placement", choices=("keep", "given"), default="keep",
                    help="keep (default, as a live job): order the destination devices to keep the most state in "
                         "place; given: rank i on device i")
    ap.add_argument("--unverified", action="store_true",
                    help="diagnostic: replace the transfer checksums by a constant, to see what verification "
                         "costs (such a switch checks nothing)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the whole benchmark this many times, each on fresh processes (a shared host "
                         "drifts between runs more than within one); report every round and their medians")
    ap.add_argument("--set", choices=("all", "one-host", "two-hosts"), default="all",
                    help="which cases: all (default), the one-host cases, or the 2-host cases")
    ap.add_argument("--case", default="", metavar="TEXT",
                    help="only the cases whose name contains TEXT (e.g. zero: dp4z1, or dp2pp2)")
    ap.add_argument("--host", type=int, help=argparse.SUPPRESS)           # one host of the 2-host cases
    ap.add_argument("--host-config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host:
        return _host(args.host, json.loads(args.host_config))
    if min(args.rounds, args.repeats, args.dcp_repeats if not args.no_dcp else 1) < 1:
        ap.error("--rounds, --repeats and --dcp-repeats must be at least 1")
    spec = _model(args.small)
    t0 = time.perf_counter()
    rounds = []
    for r in range(args.rounds):
        rounds.append(_round(spec, args))
        print(f"round {r + 1}/{args.rounds}: " + "; ".join(
            f"{name} {_line(c)}" for name, c in rounds[-1].items()), file=sys.stderr, flush=True)
    cases = rounds[0] if args.rounds == 1 else _merge(rounds)
    nparams = sum(t.numel for t in spec.tensors)
    print(json.dumps({"model": spec.name, "params": nparams, "state_bytes": nparams * 12, "processes": 4,
                      "threads_per_process": 1, "cpus": os.cpu_count(), "repeats": args.repeats,
                      "dcp_repeats": args.dcp_repeats, "rounds": args.rounds, "placement": args.placement, "set": args.set,
                      "unverified": args.unverified, "cases": cases,
                      "seconds": time.perf_counter() - t0}, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
