"""Partial live switches: the weights (or any subset of the state kinds) into a rollout layout and back.

A *rollout layout* is a strategy without optimizer state (``pp=1``, ``zero=0``, ``ep=1``: TP
shards and DP replicas, e.g. ``tp=2`` or ``tp=2,dp=2``) on the first ``world`` devices of the
training job (the others idle during the rollout). Its store (:func:`rollout_store`) holds one
flat ``param`` buffer per family and nothing else.

:class:`WeightSwitch` plans both directions once (``vps.plan_switch`` with ``kinds``, lowered by
``vps.transition.lower``; deterministic, so every process plans the same) and runs them with the
live switch's :class:`~parashift.exec.switch.executor.SwitchExecutor`; only the chosen kinds
move, the training store's other kinds stay where they are. Each run is verified like a live
switch: every participant publishes the checksums of what it sent and received (one
all-gather) and any mismatch raises :class:`~parashift.errors.SwitchAborted`.

``release=True`` frees the training copy of the moved kinds while the rollout copy exists
(their storage is resized to zero; the views the runtime holds stay valid) and restores it from
the rollout copy on the way back, so the round trip is exact. It needs a rollout copy of the
training dtype. For a ``bf16`` rollout copy of fp32 weights, each sender casts its weights into
a temporary bf16 copy that the transfer reads (half the bytes on the wire); the training copy is
kept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...errors import StrategyError, SwitchAborted
from ...models import ModelSpec
from ...strategy import Strategy
from ...vps.plan import plan_switch
from ...vps.transition import lower
from ...vps.transition.live import SwitchPlanned, live_cluster
from ..state import MemoryTracker, StateStore
from ..switch.executor import SwitchExecutor
from ..switch.memory import BufferPool
from ..switch.stores import kind_tensor
from ..switch.wire import BIG, reserve_waiters

__all__ = ["ROLLOUT_DTYPES", "check_rollout", "rollout_store", "WeightSwitch", "SwitchTiming"]

ROLLOUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: With ``release``, every piece is packed into a staging buffer: a piece sent straight from the
#: state (gloo) pins that storage, which could then not be freed.
_PACK_ALL = 1 << 62


def check_rollout(spec: ModelSpec, train: "Strategy | str", rollout: "Strategy | str") -> tuple[Strategy, Strategy]:
    """Parse and check a (training, rollout) pair; raises StrategyError saying what to change."""
    tr, ro = Strategy.parse(train), Strategy.parse(rollout)
    tr.validate(spec)
    ro.validate(spec)
    bad = [f"{k}={getattr(ro, k)}" for k, ok in (("pp", ro.pp == 1), ("zero", not ro.zero_stage.sharded), ("ep", ro.ep == 1))
           if not ok]
    if bad:
        raise StrategyError(f"rollout layout {ro} has {', '.join(bad)}; a rollout layout holds weights only, as "
                            f"TP shards and DP replicas: use e.g. 'tp=2' or 'tp=2,dp=2'")
    if ro.world > tr.world:
        raise StrategyError(f"rollout layout {ro} needs {ro.world} devices but training ({tr}) has {tr.world}; "
                            f"use a rollout layout on at most {tr.world} devices")
    return tr, ro


def rollout_store(spec: ModelSpec, strategy: Strategy, rank: int) -> StateStore:
    """Rank ``rank``'s store of ``strategy`` holding weights only: a zeroed ``param`` buffer per
    family (its ZeRO-3 shard under ZeRO-3), no optimizer state (``master``/``exp_avg``/``exp_avg_sq``
    are None)."""
    s = StateStore(spec, strategy, rank, torch.device("cpu"), init=False,
                   alloc=lambda n, dt, dev: torch.empty(1, dtype=dt).expand(n))     # stand-ins, replaced below
    s.mem = MemoryTracker()
    for fam, b in s.buffers.items():
        b.param = torch.zeros(b.q if b.zero_stage.shards_params else b.padded, dtype=b.dtype)
        b.master = b.exp_avg = b.exp_avg_sq = None
        b.mem = s.mem
        s.mem.alloc(f"param:{fam}", b.param.numel() * b.param.element_size())
    return s


@dataclass
class SwitchTiming:
    """One direction of a weight switch on one process."""

    seconds: float = 0.0          # transfer + verify (+ cast / release / restore)
    transfer_seconds: float = 0.0
    verify_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    rows: list = field(default_factory=list)     # (op, start, end) wall clock


def _plan(spec: ModelSpec, src: Strategy, dst: Strategy, sdev: tuple[int, ...], ddev: tuple[int, ...],
          kinds: tuple[str, ...]) -> SwitchPlanned:
    devs = sorted(set(sdev) | set(ddev))
    clus = live_cluster(devs)
    plan = plan_switch(spec, src, dst, cluster=clus, src_devices=list(sdev), dst_devices=list(ddev), kinds=kinds)
    prog = lower(plan, clus, promote=False)    # point-to-point only: no extra communicators to build
    return SwitchPlanned(prog, src, dst, tuple(sdev), tuple(ddev), 0.0)


class WeightSwitch:
    """Both directions of the weight switch of one job on one process (every process of the job
    builds one with the same arguments: training ranks are devices ``0..train.world-1``, rollout
    ranks ``0..rollout.world-1``). ``world``: a process group over all training devices."""

    def __init__(self, spec: ModelSpec, train: "Strategy | str", rollout: "Strategy | str", device: int, *,
                 kinds: tuple[str, ...] = ("param",), dtype: str = "fp32", release: bool = False,
                 world=None, timeout: float = 60.0) -> None:
        if dtype not in ROLLOUT_DTYPES:
            raise StrategyError(f"rollout dtype {dtype!r} is not supported; use one of {sorted(ROLLOUT_DTYPES)}")
        self.spec, (self.train, self.rollout) = spec, check_rollout(spec, train, rollout)
        bad = [k for k in kinds if k not in ("param", "master", "exp_avg", "exp_avg_sq")]
        if bad or not kinds:
            raise StrategyError(f"kinds {list(kinds)} must be a non-empty subset of param, master, exp_avg, exp_avg_sq")
        if dtype != "fp32" and kinds != ("param",):
            raise StrategyError(f"a {dtype} rollout copy holds weights only; use kinds=('param',)")
        self.kinds, self.dtype, self.device = tuple(kinds), dtype, device
        same = ROLLOUT_DTYPES[dtype] == {"fp32": torch.float32, "bf16": torch.bfloat16}.get(spec.dtype)
        if release and not same:
            raise StrategyError(f"release=True restores the training weights from the rollout copy, which needs a "
                                f"{spec.dtype} rollout copy (got {dtype}); keep the training copy (release=False)")
        self.release = release
        self.tdev = tuple(range(self.train.world))
        self.rdev = tuple(range(self.rollout.world))
        self.world = world if world is not None else dist.group.WORLD
        self.timeout = timeout
        # a copy of another dtype travels in that dtype: the sender casts its weights, then they move
        self.wire = spec if same else _with_dtype(spec, dtype)
        self.out = _plan(self.wire, self.train, self.rollout, self.tdev, self.rdev, self.kinds)
        self.back = _plan(spec, self.rollout, self.train, self.rdev, self.tdev, self.kinds) if release else None
        for p in (self.out, self.back):
            if p is not None:
                reserve_waiters(p.program, device)
        self.pool = BufferPool()
        self.store: StateStore | None = None      # the rollout copy while it exists
        self._sizes: dict[tuple[str, str], int] = {}

    @property
    def rollout_rank(self) -> int | None:
        return self.device if self.device < self.rollout.world else None

    # ---- the two directions ----------------------------------------------------------------------------
    def to_rollout(self, train_store: StateStore) -> SwitchTiming:
        """Move the chosen kinds of ``train_store`` into a new rollout copy (``self.store``)."""
        t = SwitchTiming()
        t0 = time.time()
        new = rollout_store(self.wire, self.rollout, self.device) if self.rollout_rank is not None else None
        if new is not None and self.kinds != ("param",):
            for b in new.buffers.values():
                for k in self.kinds:
                    if k != "param":
                        setattr(b, k, torch.zeros(b.padded, dtype=torch.float32))
        src = train_store
        if self.wire is not self.spec:          # the cast, at the sender: the wire carries the rollout dtype
            t1 = time.time()
            src = rollout_store(self.wire, self.train, self.device)
            for fam, b in src.buffers.items():
                b.param.copy_(train_store.buffers[fam].param)
            t.rows.append(("cast", t1, time.time()))
        self._run(self.out, src, new, t)
        del src
        if self.release:
            t1 = time.time()
            for fam, b in train_store.buffers.items():
                for k in self.kinds:
                    flat, _ = kind_tensor(train_store, fam, k)
                    st = flat.untyped_storage()
                    self._sizes[(fam, k)] = st.nbytes()
                    st.resize_(0)
            t.rows.append(("release", t1, time.time()))
        self.store = new
        t.seconds = time.time() - t0
        return t

    def to_train(self, train_store: StateStore) -> SwitchTiming:
        """Drop the rollout copy; with ``release``, first restore the training copy from it (when
        that fails, SwitchAborted is raised and the rollout copy stays in ``self.store``)."""
        t = SwitchTiming()
        t0 = time.time()
        if self.release:
            for fam, b in train_store.buffers.items():
                for k in self.kinds:
                    flat, _ = kind_tensor(train_store, fam, k)
                    flat.untyped_storage().resize_(self._sizes[(fam, k)])
                    flat.zero_()          # the padding past the last tensor is zero, as before
            t.rows.append(("restore-alloc", t0, time.time()))
            self._run(self.back, self.store, train_store, t)
        t1 = time.time()
        self.store = None           # the rollout copy is freed
        t.rows.append(("drop", t1, time.time()))
        t.seconds = time.time() - t0
        return t

    # ---- one verified run --------------------------------------------------------------------------------
    def _run(self, planned: SwitchPlanned, old: StateStore | None, new: StateStore | None, t: SwitchTiming) -> None:
        index = {d: d for d in planned.participants}
        ex = SwitchExecutor(planned.program, self.device, old, new, self.world, index,
                            lambda g: (_ for _ in ()).throw(SwitchAborted(f"unexpected collective over {g}")),
                            timeout=self.timeout, pool=self.pool, big=_PACK_ALL if self.release else BIG)
        t0 = time.time()
        reason = None
        try:
            ex.run()
        except SwitchAborted as e:
            reason = str(e)
        t1 = time.time()
        recs: list = [None] * dist.get_world_size(self.world)
        dist.all_gather_object(recs, (reason, ex.stats.sent_crc, ex.stats.recv_crc), group=self.world)
        t2 = time.time()
        self.pool.clear()
        fails = [r[0] for r in recs if r[0] is not None]
        sent = {k: v for r in recs for k, v in r[1].items()}
        fails += [f"device {d}: transfer {k} arrived with checksum {v:#010x}, sent as {sent.get(k)}"
                  for d, r in enumerate(recs) for k, v in r[2].items() if sent.get(k) != v]
        if fails:
            raise SwitchAborted(f"weight switch {planned.src} -> {planned.dst} failed: {fails[0]}", fails[0])
        t.transfer_seconds += t1 - t0
        t.verify_seconds += t2 - t1
        t.bytes_sent += ex.stats.bytes_sent
        t.bytes_received += ex.stats.bytes_received
        t.rows += [("transfer", t0, t1), ("verify", t1, t2)]


def _with_dtype(spec: ModelSpec, dtype: str) -> ModelSpec:
    """``spec`` with its parameters in ``dtype`` (the geometry of a copy of another dtype)."""
    from dataclasses import replace

    from ...models.spec import _with_tensors
    return _with_tensors(replace(spec, dtype=dtype, tensors=()))
