"""The instruction interpreter: runs one rank's Program, stream by stream, honoring deps.

Each stream executes its instructions in order. Compute instructions run on the calling thread;
communication is issued asynchronously (work handles) and polled, so the compute stream keeps
going wherever the Program lets it: a stream's next instruction starts when the previous one of
that stream has completed and the instructions named in its ``deps`` (other streams of this rank)
have completed. Point-to-point sends and receives are *posted* in stream order without waiting
for the previous one to finish (as a GPU stream enqueues them); whatever consumes a receive, or
depends on a send, still waits for its completion through ``deps``. Collectives of
different streams use different communicators (the ``Worlds`` channel), so their interleaving
never mismatches between ranks.

With profiling on, a compute instruction is timed by stamps on its stream (CUDA timing events on
GPUs, resolved with one synchronize when the step ends; the host clock on CPU: :mod:`.streams`), a
communication instruction from its issue to when the host saw it complete; nothing synchronizes
the device per instruction. With profiling off on gloo (``record`` None) a step takes a faster
path with the same results: every receive without deps is posted when the step starts (each
into a buffer allocated once), sends nothing depends on are waited on at the step's end (no helper thread), and when every
blocked stream waits on one transfer the loop waits on that handle directly (helper threads watch
transfers only when several could unblock work). Nothing is timed or synchronized then.

Structure: :meth:`Interpreter._prepare` turns each instruction into a :class:`Prepared` once (its
kind, parsed tag, peer, group, gloo tag, recv buffer, dense dependency indices, regions); the step
loop (:meth:`Interpreter.run_step`) walks the streams' prepared lists with flat done flags, hands
compute to :meth:`_compute` (dispatch on phase) and communication to the handler of its kind
(:data:`HANDLERS`: one module per parallelism under :mod:`.parallel`, each handler a function of the
interpreter and the prepared instruction), and finishes transfers through their ``then`` callbacks.
New instruction kinds add a kind in :meth:`_kind_of` and a handler in :data:`HANDLERS`.

What each instruction does is decided by its op, phase, region and tag, parsed once at load (the
grammar is :mod:`parashift.ir.tags`, the conventions :mod:`parashift.ir.conventions`); the
numbers come from :mod:`parashift.exec.regions` and the state store. Sequence parallelism runs each TP
reduction as the Program's reduce-scatter along the sequence (the residual add on this rank's rows)
and all-gather; the column-parallel GEMMs keep their input's rows only, re-gathered on the comm
stream for their weight gradients (a gradient whose input has not landed waits for it). Context
parallelism (:mod:`parashift.exec.parallel.cp`) runs attention around the Program's K/V all-gathers and
K/V-gradient reduce-scatters. A failing instruction raises RuntimeFailure naming the rank, stream, instruction
and its neighbours.
"""
from __future__ import annotations

import contextlib
import datetime
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import RuntimeFailure, StrategyError
from ..ir.program import Instr, Program
from ..ir.step_meta import StepMeta
from ..ir.tags import CPTag, EPTag, Fp8Tag, P2PTag, SPTag, StepTag, Sync, SyncTag, TPTag, Z3Tag, parse_tag
from ..models import ModelSpec
from .comm import Flight, Poller
from .parallel import cp, dp, ep, pipeline, tp, zero
from .prepared import COMPUTE, CP, DP, EP, FP8, RECV, SEND, SP, TP, Z3, Prepared
from .reference import OptimConfig, microbatch_rows
from .models import weight_grad
from .fp8 import Fp8Gemms, reduce_amax
from .regions import (KINDS, CoreRecompute, Rec, RegionCtx, atomic_regions, chain_residual, finish_weights,
                      head_logit_grad, region_kind)
from .state import _DT, StateStore
from .parallel.zero import LiveTensors, alloc_grads

__all__ = ["Interpreter", "Prepared", "StepState", "HANDLERS", "chunk_atoms", "group_keys"]

_P2P_ORDER = ("p2p", "comm")   # streams issued before compute, so communication starts early


def _drain(fl: Flight, timeout: datetime.timedelta) -> BaseException | None:
    """Wait for a send nothing depends on (at the step's end); its error, if any."""
    try:
        for w in fl.works:
            w.wait(timeout)
    except BaseException as e:  # noqa: BLE001 - reported when the step reaps its sends
        return e
    return None


def chunk_atoms(spec: ModelSpec, strategy) -> list[list[str]]:
    """Atomic regions of every chunk (virtual stage), in model order."""
    ls = strategy.layer_stages(spec.layers)
    out: list[list[str]] = [[] for _ in range(strategy.stages)]
    out[0].append("embed")
    for i in range(spec.layers):
        out[int(ls[i])] += atomic_regions(f"layers.{i}-{i}", spec)
    out[-1].append("head")
    return out


def group_keys(program: Program) -> set[tuple[tuple[int, ...], str]]:
    """Every (members, channel) a program's collectives and p2p use, over all ranks."""
    keys: set[tuple[tuple[int, ...], str]] = set()
    world = tuple(range(program.world))
    for r, rp in program.ranks.items():
        for stream, instrs in rp.streams.items():
            for i in instrs:
                if i.group is not None:
                    keys.add((tuple(sorted(program.resolve_group(r, i))), stream))
                elif i.op in ("send", "recv"):
                    keys.add((world, "p2p"))
    return keys


def _connected_pieces(recs: list[Rec]) -> list[list[Rec]]:
    """An instruction's regions (the embedding aside) cut where a region's input is not the previous
    region's output: each piece is one connected autograd graph."""
    pieces: list[list[Rec]] = []
    for r in recs:
        if r.kind == "embed":
            continue
        if pieces and r.t["h"] is pieces[-1][-1].t.get("h_out"):
            pieces[-1].append(r)
        else:
            pieces.append([r])
    return pieces


@dataclass
class StepState:
    """Per-step state: activation / gradient environments per (chunk, mb) and the mailboxes."""

    env: dict = field(default_factory=dict)
    genv: dict = field(default_factory=dict)
    recs: dict = field(default_factory=dict)
    act: dict = field(default_factory=dict)
    gout: dict = field(default_factory=dict)
    open_bwd: dict = field(default_factory=dict)   # chunk -> TP backward reductions not yet finished
    sp_x: dict = field(default_factory=dict)       # (chunk, mb, region) -> (use index, this rank's rows of its input)
    sp_dy: dict = field(default_factory=dict)      # (chunk, mb, region) -> (param key, output grad) awaiting the re-gather
    sp_full: dict = field(default_factory=dict)    # (chunk, mb, region) -> re-gathered input awaiting its recompute
    cp: dict = field(default_factory=dict)         # context parallelism's mailboxes (see exec.parallel.cp)
    loss: float = 0.0
    heads: int = 0                                 # head forwards done (the loss share is whole at n_heads)
    grad_norm: float = float("nan")                # the global gradient norm before clipping (optim phase)
    lr: float = float("nan")                       # the learning rate the step's update used

    def e(self, c: int, mb: int) -> dict:
        return self.env.setdefault((c, mb), {})

    def g(self, c: int, mb: int) -> dict:
        return self.genv.setdefault((c, mb), {})


_NULL = contextlib.nullcontext()


def _grad_mode(on: bool):
    """``torch.set_grad_enabled(on)``, or nothing to enter when grad mode is already ``on``."""
    return _NULL if torch.is_grad_enabled() == on else torch.set_grad_enabled(on)


#: the communication handler of each instruction kind: ``handler(interpreter, prepared) -> Flight``
HANDLERS: dict[int, Callable[[Any, Prepared], Flight]] = {
    SEND: pipeline.send, RECV: pipeline.post_recv, TP: tp.reduce, SP: tp.sequence, EP: ep.exchange,
    DP: dp.sync, Z3: zero.gather_params, CP: cp.exchange, FP8: reduce_amax}


class Interpreter:
    """Executes one rank's RankProgram for one training step at a time.

    Everything that does not change between steps (parsed tags, peers, process groups, recv
    buffers, dependency indices, region lists) is resolved once, in :meth:`_prepare`; a step is a
    loop over those prepared instructions. Subclasses supply the compute (:meth:`_init_model`,
    :meth:`_compute`, :meth:`_recv_buffer`).
    """

    def __init__(self, program: Program, rank: int, worlds: Any, store: StateStore, spec: ModelSpec,
                 device: torch.device, batch: Callable[[int], tuple[Any, Any]],
                 optim: OptimConfig, record: Callable[[Instr, str, float, float], None] | None = None,
                 timeout: float = 300.0, memory: bool = True) -> None:
        """``record(instr, stream, t0, t1)``: called for every executed instruction (profiling on);
        None runs without timing or synchronizing anything. ``memory``: account the activation bytes
        the live regions hold in ``store.mem`` (its peak is the CPU peak memory); off costs nothing."""
        self.program, self.rank, self.worlds, self.store, self.spec = program, rank, worlds, store, spec
        self.device, self.batch, self.optim, self.record, self.timeout = device, batch, optim, record, timeout
        self.memory = memory
        self.strategy = program.strategy
        self.rp = program.ranks[rank]
        self.coords = self.strategy.coords(rank)
        self.step_meta = StepMeta.of(program)
        self.gb = self.step_meta.global_batch
        self.st = StepState()
        self.live = LiveTensors()
        self._step, self._data = 0, None
        self._kinds: dict[str, tuple[str, int]] = {}           # atomic region -> (kind, layer)
        self._auto: set[tuple[int, int, str]] = set()
        self._leaves: dict[str, torch.Tensor] = {}            # parameter -> its gradient leaf (_grad_leaf)
        self._leaves_of: list[tuple[Any, Any]] = []           # the store's flat buffers they alias
        self.fp8: Fp8Gemms | None = None    # set by _init_model under an fp8 recipe
        self._init_model()
        if self.strategy.fp8 != "none" and self.fp8 is None:
            raise StrategyError(f"fp8={self.strategy.fp8} runs on the preset and Hugging Face transformer models only; "
                                f"this model's linears are its own: drop fp8 from the strategy")
        self.streams = sorted(self.rp.streams, key=lambda n: (n not in _P2P_ORDER, _P2P_ORDER.index(n)
                                                              if n in _P2P_ORDER else 0, n))
        self.pos = {i.id: (st, k) for st, ins in self.rp.streams.items() for k, i in enumerate(ins)}
        self.nccl = worlds.backend == "nccl"
        self.pool: ThreadPoolExecutor | None = None     # waits on gloo send/recv (they cannot be polled)
        self._prepare()
        from .lanes import install
        from .streams import Streams, backend_for
        #: profiling stamps: CUDA timing events on GPUs (resolved once per step), the host clock on CPU
        self.clock = Streams(backend_for(device), profile=record is not None)
        self._stamps: list[tuple[Instr, str, Any, Any]] = []
        self.lanes = install(self)      # user-named streams: CUDA streams of their own on GPUs (the CPU twin elsewhere)
        self.n_heads = sum(1 for q in self.seqs for p in q if p.kind == COMPUTE and p.ins.phase == "fwd"
                           and "head" in p.atoms)
        #: multi-host jobs (:mod:`.job.recover`): ``on_loss(share)`` once the step's loss share is whole (before
        #: any gradient leaves this rank); ``interrupt()`` true ends a blocked wait (a peer's host was lost)
        self.on_loss: Callable[[float], None] | None = None
        self.interrupt: Callable[[], bool] | None = None

    def _init_model(self) -> None:
        """The preset model's region context (subclasses running other models override it)."""
        from .models import rope_tables
        spec, s, device = self.spec, self.strategy, self.device
        seq = int(self.step_meta.seq_len)
        if s.fp8 != "none" and (s.sp or s.cp > 1):
            raise StrategyError(f"the runtime runs fp8 without sp and cp (strategy {s}): their re-gathered inputs are "
                                f"not the FP8 ones; drop sp/cp or fp8")
        #: the fp8 recipe's GEMMs (:mod:`parashift.exec.fp8`); its amax history lives across steps
        self.fp8 = Fp8Gemms(s.fp8, spec, s) if s.fp8 != "none" else None
        self.seq = seq // s.cp          # tokens of a sequence this rank holds
        self.atoms = chunk_atoms(spec, s)
        rc = {(i.chunk, i.microbatch, a) for i in self.rp.instrs() if i.phase == "recompute"
              for a in atomic_regions(i.region, spec)}
        # full: those regions' forwards run without a graph and a recompute rebuilds it from their
        # inputs; selective: every region keeps its graph but an attention its core's (softmax(QK^T)V,
        # re-run by the recompute; with cp > 1 the backward always re-runs the core anyway)
        sel = s.recompute == "selective"
        self.rc = set() if sel else rc
        self.rc_core = {k for k in rc if region_kind(k[2])[0] == "attn"} if sel and s.cp == 1 else set()
        self.ctx = RegionCtx(spec, s.tp, self.coords["tp"], s.ep, self.coords["ep"], 1.0 / (self.gb * seq),
                             self.store.param, self.store.grad,
                             tuple(t.to(_DT[spec.dtype]) for t in rope_tables(seq, spec.head_dim, spec.rope_theta,
                                                                                 device=device)),
                             chain=s.tp == 1 and not spec.is_moe and s.cp == 1 and not s.zero_stage.grad_buckets
                             and spec.dtype == "fp32"
                             and not s.overlap_param,   # ZeRO-2/3, overlap_param: unfused region buckets
                             grad_leaf=self._grad_leaf, grad_fusion=s.grad_fusion,
                             fp8=self.fp8)
        # chain mode: the regions whose backward is a full one build their linears on gradient leaves
        # (autograd accumulates those weight gradients itself; see _bwd_chain)
        self._auto = {(i.chunk, i.microbatch, a) for i in self.rp.instrs() if i.op == "compute" and i.phase == "bwd"
                      for a in atomic_regions(i.region, spec)} if self.ctx.chain else set()
        if s.cp > 1:
            cp.setup(self, seq)

    def _grad_leaf(self, name: str) -> torch.Tensor:
        """Parameter ``name`` as a tensor that requires grad and whose ``.grad`` is its gradient
        accumulator (the same storages; made once, again only after the store's buffers change)."""
        leaf = self._leaves.get(name)
        if leaf is None:
            leaf = self.store.param(name).detach().requires_grad_(True)
            leaf.grad = self.store.grad(name)
            self._leaves[name] = leaf
            self._leaves_of = self._flat_buffers()
        return leaf

    def _flat_buffers(self) -> list[tuple[Any, Any]]:
        return [(b.param, b.grad) for b in self.store.buffers.values()]

    def _step_batch(self) -> tuple[Any, Any]:
        """This step's (tokens, targets), made on first use: middle stages never need them."""
        if self._data is None:
            self._data = self.batch(self._step)
        return self._data

    @property
    def tokens(self) -> Any:
        return self._step_batch()[0]

    @property
    def targets(self) -> Any:
        return self._step_batch()[1]

    # ---- load time ----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Resolve every instruction once (tags, groups, peers, buffers, deps)."""
        index: dict[int, int] = {}
        for s in self.streams:
            for ins in self.rp.streams[s]:
                index[ins.id] = len(index)
        self.n = len(index)
        self.seqs: list[list[Prepared]] = []
        needed: set[int] = set()
        p2p_group = None
        for k, s in enumerate(self.streams):
            seq = []
            for ins in self.rp.streams[s]:
                deps = tuple(index[d] for d in ins.deps)
                needed.update(deps)
                p = Prepared(ins, index[ins.id], k, deps, COMPUTE)
                if ins.op == "compute":
                    if ins.region is not None:
                        p.atoms = tuple(self._atoms_of(ins.region))
                else:
                    p.tag = parse_tag(ins.tag or "")
                    p.kind = self._kind_of(ins, p.tag)
                    if p.kind in (SEND, RECV):
                        if p2p_group is None:
                            p2p_group = self.worlds.get(range(self.program.world), "p2p")   # group rank = global rank
                        p.group, p.peer = p2p_group, self.program.resolve_peer(self.rank, ins)
                        p.itag = zlib.crc32(ins.tag.encode()) & 0x7FFFFFFF
                        if p.kind == RECV:
                            p.buf = self._recv_buffer(p.tag.chunk)
                    else:
                        p.group = self.worlds.get(self.program.resolve_group(self.rank, ins), s)
                    if isinstance(p.tag, SyncTag) and p.tag.what is Sync.GRAD:
                        p.sync_chunk = p.tag.chunk
                p.z3_free = tuple(name for name in ins.free if name.startswith("z3."))
                seq.append(p)
            self.seqs.append(seq)
        self.regions = {p.ins.id: p.atoms for seq in self.seqs for p in seq if p.atoms}   # compute id -> atoms
        self.stream_of = [0] * self.n
        for seq in self.seqs:
            for p in seq:
                self.stream_of[p.idx] = p.stream
                p.watched = p.idx in needed or p.kind != SEND

    def _atoms_of(self, region: str) -> list[str]:
        return atomic_regions(region, self.spec)

    @staticmethod
    def _kind_of(ins: Instr, tag: StepTag) -> int:
        if ins.op in ("send", "recv"):
            if not isinstance(tag, P2PTag):
                raise RuntimeFailure(f"p2p instruction {ins} has tag {ins.tag!r}, not act|grad.c<chunk>.m<mb>")
            return SEND if ins.op == "send" else RECV
        if isinstance(tag, TPTag) and (ins.op == "all_reduce" or ins.key == "ce_stats"):
            return TP
        if isinstance(tag, EPTag) and ins.op == "all_to_all":
            return EP
        if isinstance(tag, SPTag) and ins.op == ("reduce_scatter" if tag.hop == "rs" else "all_gather"):
            return SP
        if isinstance(tag, Fp8Tag) and ins.op == "all_reduce":
            return FP8
        if isinstance(tag, SyncTag):
            return DP
        if isinstance(tag, Z3Tag) and ins.op == "all_gather":
            return Z3
        if isinstance(tag, CPTag) and ins.op == ("all_gather" if tag.part == "kv" else "reduce_scatter"):
            return CP
        raise RuntimeFailure(f"the runtime does not know what {ins.op} with tag {ins.tag!r} carries "
                             f"(instruction {ins}); rebuild the Program with parashift.ir.compile")

    # ---- the loop ---------------------------------------------------------------------------------
    def run_step(self, step: int) -> float:
        """Execute the program once; returns this rank's share of the step's loss."""
        self._begin(step)
        if self.record is not None:
            self._stamps = []
            host0 = self.clock.begin()
        seqs, nstreams = self.seqs, len(self.seqs)
        done = bytearray(self.n)
        ptr = [0] * nstreams
        ends = [len(q) for q in seqs]
        busy: list[Flight | None] = [None] * nstreams
        nbusy = 0                                        # streams whose head is in flight
        inflight: dict[int, Flight] = {}
        fast = self.record is None and not self.nccl     # profiling off (gloo): post receives early, reap sends late
        poller = self._poller(fast)
        left = self.n
        loose: list[Flight] = []          # sends nothing waits for: waited on at the step's end
        early = bytearray(self.n)         # receives posted at the start of the step

        def finish(items: list) -> None:
            nonlocal left, nbusy
            for fl, err in items:
                self._complete(fl, err)
                p = fl.prep
                done[p.idx] = 1
                inflight.pop(p.idx, None)
                if busy[p.stream] is fl:
                    busy[p.stream] = None
                    nbusy -= 1
                left -= 1
        try:
            if fast:
                self._post_early(poller, early, inflight)
            while left:
                progressed = False
                for s in range(nstreams):
                    if busy[s] is not None or ptr[s] >= ends[s]:
                        continue
                    p = seqs[s][ptr[s]]
                    if early[p.idx]:                  # a receive posted early
                        ptr[s] += 1
                        progressed = True
                        continue
                    if not all(done[d] for d in p.deps) or (p.sync_chunk >= 0 and self.st.open_bwd.get(p.sync_chunk)):
                        continue
                    ptr[s] += 1
                    progressed = True
                    fl = self._issue(p)
                    if fl is None:
                        done[p.idx] = 1
                        left -= 1
                    elif not fl.works:
                        self._complete(fl, None)
                        done[p.idx] = 1
                        left -= 1
                    elif fast and not p.watched:
                        loose.append(fl)
                        done[p.idx] = 1
                        left -= 1
                    else:
                        if p.kind not in (SEND, RECV):   # p2p is posted in order, never waited on in line
                            busy[s] = fl
                            nbusy += 1
                        inflight[p.idx] = fl
                        poller.submit(fl)
                    if nbusy:
                        finish(poller.ready())
                if left and not progressed:
                    got = poller.wait(self.timeout, self._root(ptr, busy, inflight, done) if fast else None)
                    if not got:
                        raise self._stalled(ptr, busy)
                    finish(got)
            self._reap(loose)
        finally:
            poller.close()
        if self.record is not None:
            self._report_stamps(host0)
        self.store_release_all()
        return self.st.loss

    def _begin(self, step: int) -> None:
        """A fresh step's state; the gradient leaves are made again when the store's buffers were replaced."""
        self.st = StepState()
        if self._leaves and any(x is not y for old, new in zip(self._leaves_of, self._flat_buffers())
                                for x, y in zip(old, new)):
            self._leaves.clear()         # the store's buffers were replaced: alias the new ones
        if self.memory:
            self.live = LiveTensors()
        self._step, self._data = step, None

    def _poller(self, fast: bool) -> Poller:
        """The step's poller of in-flight transfers (gloo: helper threads of one pool wait on p2p)."""
        if self.pool is None and not self.nccl:
            self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="parashift-p2p")
        return Poller(gloo=not self.nccl, pool=self.pool, wait_only=self.worlds.backend == "fake",
                      eager=not fast, interrupt=self.interrupt)

    def _post_early(self, poller: Poller, early: bytearray, inflight: dict) -> None:
        """Fast path: post every receive without deps when the step starts."""
        for q in self.seqs:
            for p in q:
                if p.kind == RECV and not p.deps:
                    fl = pipeline.post_recv(self, p)
                    early[p.idx] = 1
                    inflight[p.idx] = fl
                    poller.submit(fl)

    def _stalled(self, ptr: list[int], busy: list) -> RuntimeFailure:
        """The error of a step that made no progress within the timeout: what was in flight, what was next."""
        heads = {self.streams[s]: str(q[ptr[s]].ins) for s, q in enumerate(self.seqs) if ptr[s] < len(q)}
        return RuntimeFailure(f"rank {self.rank} made no progress for {self.timeout:.0f} s; in flight: "
                              f"{ {self.streams[s]: str(f.instr) for s, f in enumerate(busy) if f} }; "
                              f"next: {heads}")

    def _reap(self, loose: list[Flight]) -> None:
        """Wait for the sends nothing depended on (fast path), at the step's end."""
        limit = datetime.timedelta(seconds=self.timeout)
        for fl in loose:
            err = _drain(fl, limit)
            if err is not None:
                raise RuntimeFailure(f"rank {self.rank}: a send failed: {type(err).__name__}: {err}")

    def _report_stamps(self, host0: float) -> None:
        """Profiling: one synchronize for the step's stamps (none per instruction), then ``record`` each."""
        secs = self.clock.seconds([t for row in self._stamps for t in row[2:]])
        for k, (ins, stream, _, _) in enumerate(self._stamps):
            self.record(ins, stream, host0 + secs[2 * k], host0 + secs[2 * k + 1])

    def sync_params(self) -> None:
        """Run this rank's ZeRO-1/2 parameter gathers now, outside a step, in stream order. Under
        ``overlap_param`` a step leaves them to the next step's forward; whoever reads the state in
        between (export, switch, snapshot) calls this on every rank first."""
        for q in self.seqs:
            for p in q:
                if p.kind == DP and p.tag.what is Sync.PARAM:
                    fl = dp.sync(self, p)
                    for w in fl.works:
                        w.wait()
                    if fl.then is not None:
                        fl.then()

    def _root(self, ptr: list[int], busy: list, inflight: dict, done: bytearray) -> "Flight | None":
        """The one in-flight instruction every blocked stream waits for, if there is exactly one
        (waiting on it alone then delays nothing); None when several could unblock work."""
        roots: set[int] = set()
        seen: set[int] = set()
        seqs = self.seqs

        def blocked_by(p: Prepared) -> bool:
            if p.sync_chunk >= 0 and self.st.open_bwd.get(p.sync_chunk):
                return False
            for d in p.deps:
                if done[d] or d in seen:
                    continue
                seen.add(d)
                if d in inflight:
                    roots.add(d)
                    continue
                s = self.stream_of[d]
                if busy[s] is not None:
                    roots.add(busy[s].prep.idx)
                elif not blocked_by(seqs[s][ptr[s]]):
                    return False
            return True
        for s, q in enumerate(seqs):
            if busy[s] is not None:
                roots.add(busy[s].prep.idx)
            elif ptr[s] < len(q) and not blocked_by(q[ptr[s]]):
                return None
        return inflight.get(next(iter(roots))) if len(roots) == 1 else None

    def store_release_all(self) -> None:
        for b in self.store.buffers.values():
            b.release_all()

    def _fail(self, ins: Instr, stream: str, e: BaseException) -> RuntimeFailure:
        seq = self.rp.streams[stream]
        k = self.pos[ins.id][1]
        near = "\n".join(("  >> " if j == k else "     ") + str(seq[j])
                         for j in range(max(0, k - 2), min(len(seq), k + 3)))
        return RuntimeFailure(f"rank {self.rank}, stream {stream!r}, instruction {ins.id} ({ins.op}"
                              f"{' ' + ins.phase if ins.phase else ''}) failed: {type(e).__name__}: {e}\n{near}")

    def _issue(self, p: Prepared) -> Flight | None:
        ins = p.ins
        t0 = self.clock.stamp()
        try:
            if p.kind == COMPUTE:
                if self.strategy.zero_stage.grad_buckets and ins.phase != "optim":
                    self._grad_buckets(ins)
                self._compute(ins)
                if p.z3_free:
                    self._release(p)
                if self.record is not None:
                    self._stamps.append((ins, ins.stream, t0, self.clock.stamp()))
                return None
            fl = self._comm(p)
            fl.t0, fl.prep = t0, p
            return fl
        except RuntimeFailure:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised with the instruction's context
            raise self._fail(ins, ins.stream, e) from e

    def _complete(self, fl: Flight, err: BaseException | None) -> None:
        try:
            if err is not None:
                raise err
            if fl.then is not None:
                fl.then()
            if fl.prep is not None and fl.prep.z3_free:
                self._release(fl.prep)
        except RuntimeFailure:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail(fl.instr, fl.stream, e) from e
        if self.record is not None:     # from issue (on the issuing stream) to when the host saw it complete
            self._stamps.append((fl.instr, fl.stream, fl.t0, time.perf_counter()))

    def _grad_buckets(self, ins: Instr) -> None:
        """ZeRO-2/3: allocate the gradient buckets the instruction allocates and route its gradient
        writes to its micro-batch's buckets."""
        self.store.grad_mb[ins.chunk] = ins.microbatch
        if ins.alloc:
            alloc_grads(self.store, tuple(n for n, _ in ins.alloc if n.startswith("zg")))

    def _release(self, p: Prepared) -> None:
        for name in p.z3_free:
            self.store.release(name)

    # ---- compute ----------------------------------------------------------------------------------
    def _compute(self, ins: Instr) -> None:
        ph = ins.phase
        if ph == "optim":
            from .train import optimizer_step, owned_ranges
            group = self.worlds.get(range(self.program.world)) if self.program.world > 1 else None
            if getattr(self, "_owned", None) is None:
                self._owned = owned_ranges(self.store)       # the gradient elements this rank counts in the norm
            self.st.grad_norm, self.st.lr = optimizer_step(self.store, self.optim, self._step, group, self.timeout,
                                                           self._owned)
            return
        c, mb = ins.chunk, ins.microbatch
        atoms = self.regions.get(ins.id) or atomic_regions(ins.region, self.spec)
        if self.strategy.zero_stage.gathers_around_use:   # the gathered copy this compute uses: its region's, else its chunk's
            name = f"z3.c{c}.{'fwd' if ph == 'fwd' else 'bwd'}.m{mb}"
            own = f"{name}.{ins.region}"
            self.store.active[c] = own if any(b.has_copy(c, own) for b in self.store.buffers.values()) else name
        if ph == "fwd":
            for a in atoms:
                self._fwd(c, mb, a, ins.region)
        elif ph == "recompute":
            carry: dict = {}
            for a in atoms:
                self._recompute(c, mb, a, carry)
        elif ph in ("bwd", "bwd_input") and self.ctx.chain:
            self._bwd_chain(c, mb, atoms, full=ph == "bwd")
        elif ph in ("bwd", "bwd_input"):
            for a in reversed(atoms):
                self._bwd(c, mb, a, full=ph == "bwd")
        elif ph == "bwd_weight":
            for a in reversed(atoms):
                rec = self.st.recs[(c, mb)][a]
                tp.defer_weight_grad(self, c, mb, rec)
                if "_drop" in rec.t:    # tp_async: its input gradient is still being reduced (stream "tp")
                    rec.tape.weight_grads(rec.dys or [], self.ctx.acc, self.ctx.grad_fusion)
                    rec.dys = None
                    rec.t["_drop"] = True   # the reduction's end finishes the norm's gradients and drops it
                    continue
                KINDS[rec.kind].bwd_weight(self.ctx, rec)
                self._drop(c, mb, a)
        else:
            raise RuntimeError(f"unknown compute phase {ph!r}")

    def _fwd(self, c: int, mb: int, atom: str, region: str) -> None:
        st, env = self.st, self.st.e(c, mb)
        first = self.atoms[c][0] == atom
        if first:
            if c == 0:
                rows = microbatch_rows(self.gb, self.strategy.dp, self.coords["dp"], self.strategy.mbs, mb)
                env["tokens"] = cp.take(self, self.tokens[rows]).to(self.device)
            else:
                env["h"] = st.act.pop((c - 1, mb))
        if atom == "head":
            rows = microbatch_rows(self.gb, self.strategy.dp, self.coords["dp"], self.strategy.mbs, mb)
            env["targets"] = cp.take(self, self.targets[rows]).to(self.device)
        kl = self._kinds.get(atom)
        if kl is None:
            kl = self._kinds[atom] = region_kind(atom)
        rec = Rec(atom, *kl)
        kind = kl[0]
        st.recs.setdefault((c, mb), {})[atom] = rec
        key = (c, mb, atom)
        graph = key not in self.rc
        if key in self.rc_core:
            rec.t["core"] = CoreRecompute()
        cp_attn = kind == "attn" and self.strategy.cp > 1     # finished when its K/V gather lands
        with _grad_mode(graph):
            if cp_attn:
                cp.attn_fwd(self, c, mb, rec, env, graph)
            else:
                self.ctx.auto = graph and key in self._auto
                KINDS[kind].fwd(self.ctx, rec, env, graph)
        rec.built = graph
        tp.keep_rows(self, c, mb, rec)
        if not cp_attn and not tp.needs_reduction(self.strategy, "fwd", kind):
            self.fwd_done(c, mb, rec)

    def fwd_done(self, c: int, mb: int, rec: Rec, h: torch.Tensor | None = None) -> None:
        """Finish a region's forward; ``h``: its output residual stream, already complete (SP)."""
        env = self.st.e(c, mb)
        if h is not None:
            env["h"] = h
            rec.pending = None
        else:
            with _grad_mode(self.ctx.chain and rec.built):   # chain mode keeps the residual attached
                KINDS[rec.kind].fwd_done(self.ctx, rec, env)
        if rec.kind == "head":
            if self.coords["tp"] == 0:
                self.st.loss += float(env.pop("loss"))
            else:
                env.pop("loss")
            self.st.heads += 1
            if self.on_loss is not None and self.st.heads == self.n_heads:
                self.on_loss(self.st.loss)
        if not rec.built and rec.kind != "embed":
            rec.t.clear()
            rec.tape.clear()
            rec.tape_a.clear()
        if self.atoms[c][-1] == rec.region and rec.kind != "head":
            self.st.act[(c, mb)] = env.pop("h").detach()
        if self.memory:
            self._account(c, mb, rec)

    def _account(self, c: int, mb: int, rec: Rec, recomputed: bool = False) -> None:
        """Track the bytes the live regions keep for their backward (activations, stashed
        gradients), each tensor once however many regions hold it."""
        uses = [(u.x, u.y) for u in rec.tape.uses] + [(u.x, u.y) for u in rec.tape_a.uses]
        self.store.mem.alloc("act", self.live.hold((c, mb, rec.region), [rec.t, rec.saved, uses, rec.dys or []]))

    def _recompute(self, c: int, mb: int, atom: str, carry: dict) -> None:
        """Rebuild one region's graph from its saved inputs (chain mode: from the previous
        recomputed region's attached output, so the instruction's regions form one graph); under
        selective recomputation re-run only an attention's core."""
        rec = self.st.recs[(c, mb)][atom]
        if (c, mb, atom) not in self.rc:        # selective: only an attention's core is re-run
            if "core" in rec.t:
                rec.t["core"].rebuild()
            return
        if rec.kind == "embed":
            return
        rec.t.clear()
        rec.tape.clear()
        rec.tape_a.clear()
        tmp = dict(rec.saved)
        if self.ctx.chain and "h" in carry:
            tmp["h"] = carry["h"]
        with torch.enable_grad():
            if rec.kind == "attn" and self.strategy.cp > 1:
                cp.attn_recompute(self, rec, tmp)
            else:
                self.ctx.auto = (c, mb, atom) in self._auto
                KINDS[rec.kind].fwd(self.ctx, rec, tmp, True)
            if self.ctx.chain and rec.kind in ("attn", "mlp"):
                carry["h"] = chain_residual(rec)
        rec.pending = None
        rec.built = True
        tp.keep_rows(self, c, mb, rec)
        if self.memory:
            self._account(c, mb, rec, recomputed=True)

    def _bwd(self, c: int, mb: int, atom: str, full: bool) -> None:
        st = self.st
        genv = st.g(c, mb)
        if self.atoms[c][-1] == atom and atom != "head":
            genv["h"] = st.gout.pop((c, mb))
        rec = st.recs[(c, mb)][atom]
        if not rec.built:
            raise RuntimeError(f"backward of {atom} (chunk {c}, micro-batch {mb}) has no graph: "
                               f"its forward ran without one and no recompute instruction rebuilt it")
        kd = KINDS[rec.kind]
        if rec.kind == "attn" and self.strategy.cp > 1:   # finished when its K/V gradients are scattered
            cp.attn_bwd(self, c, mb, rec, full)
            return
        kd.bwd_input(self.ctx, rec, genv)
        if not full and self.strategy.column_wgrad and rec.kind in ("attn", "mlp"):
            self._row_parallel_wgrad(rec)
        if full:
            tp.defer_weight_grad(self, c, mb, rec)
            kd.bwd_weight(self.ctx, rec)
        if not tp.needs_reduction(self.strategy, "bwd", rec.kind):
            self.bwd_done(c, mb, rec, drop=full)
        else:
            rec.t["_drop"] = full
            self.st.open_bwd[c] = self.st.open_bwd.get(c, 0) + 1

    def _row_parallel_wgrad(self, rec: Rec) -> None:
        """``column_wgrad``: a block's input-gradient backward also computes the weight gradients of its
        GEMMs after the first (the output projection, the second MLP GEMM), as Megatron's backward does
        before the asynchronous all-reduce starts; ``bwd_weight`` keeps the column-parallel GEMM's."""
        live = [u for u in rec.tape.uses if u.y.requires_grad]
        lin = [k for k, u in enumerate(live) if u.kind == "lin"]
        for k in lin[1:]:
            weight_grad(live[k], rec.dys[k], self.ctx.acc, self.ctx.grad_fusion)
            rec.dys[k] = None

    def _bwd_chain(self, c: int, mb: int, atoms: list[str], full: bool) -> None:
        """Backward of an instruction's regions through their shared graph (tp == 1, dense): one
        autograd call per connected piece yields its input gradient and every parameter use's
        output gradient. A region whose input is not the previous region's output (a recompute
        rebuilt the regions before it, or it ran without a graph) starts a new piece; the pieces
        run last to first, each one's input gradient feeding the piece before."""
        st = self.st
        recs = [st.recs[(c, mb)][a] for a in atoms]
        for rec in recs:
            if not rec.built:
                raise RuntimeError(f"backward of {rec.region} (chunk {c}, micro-batch {mb}) has no graph: its "
                                   f"forward ran without one and no recompute instruction rebuilt it")
        last = recs[-1]
        logits = None
        if last.kind == "head":
            logits = last.t["logits"]
            out, gout = logits, head_logit_grad(self.ctx, last)
        else:
            out, gout = last.t["h_out"], st.gout.pop((c, mb))
        pieces = _connected_pieces(recs)
        dh = None
        for k in range(len(pieces) - 1, -1, -1):
            first = pieces[k][0].t["h"]
            ins: list[torch.Tensor] = [first] if first.requires_grad and (k > 0 or first.grad_fn is None) else []
            lead = len(ins)
            if full and lead:
                grads = self._piece_backward_with_weights(pieces[k], out, gout, first, logits, c, mb)
            else:
                for r in pieces[k]:
                    ins += r.tape_a.outputs() + [t for t in r.tape.outputs() if t is not logits]
                grads = torch.autograd.grad([out], ins, [gout], allow_unused=True)
                pos = {id(t): j for j, t in enumerate(ins)}
                for r in pieces[k]:
                    r.t["dys_a"] = [grads[pos[id(t)]] for t in r.tape_a.outputs()]
                    r.dys = [gout if t is logits else grads[pos[id(t)]] for t in r.tape.outputs()]
            dh = grads[0] if lead else None
            if k > 0:
                if dh is None:
                    raise RuntimeError(f"backward of {pieces[k][0].region} (chunk {c}, micro-batch {mb}): its input "
                                       f"is not connected to the regions before it, so no gradient reaches them")
                out, gout = pieces[k - 1][-1].t["h_out"], dh
        if recs[0].kind == "embed":
            recs[0].dys = [dh]
        elif c > 0:
            st.gout[(c - 1, mb)] = dh
        for r in recs:
            r.t = {k: r.t[k] for k in ("dys_a", "idx", "mine") if k in r.t}
            if full:
                KINDS[r.kind].bwd_weight(self.ctx, r)
                self._drop(c, mb, r.region)

    def _piece_backward_with_weights(self, piece: list[Rec], out: torch.Tensor, gout: torch.Tensor,
                                     first: torch.Tensor, logits: Any, c: int, mb: int) -> tuple:
        """A full backward of one connected piece of a chain: its input gradient (the 1-tuple returned),
        every parameter use's weight gradient accumulated on the way. Every parameter use lies between
        ``first`` and ``out``. Built on gradient leaves: one backward accumulates the linears' weight
        gradients and keeps the norms' output gradients (the norm weights' then follow); else a hook
        takes each weight gradient as soon as its output gradient exists."""
        auto = all(len(r.tape.leaves) == len(r.tape.uses) for r in piece)
        leaves = [w for r in piece for w in r.tape.leaves] if auto else []
        if leaves:
            norms = [u for r in piece for u in r.tape_a.uses if u.y.requires_grad]
            torch.autograd.backward(out, gout, inputs=(first, *leaves, *(u.y for u in norms)))
            grads, first.grad = (first.grad,), None
            fired, want = [0], len(norms)
            for u in norms:
                if u.y.grad is not None:
                    fired[0] += 1
                    weight_grad(u, u.y.grad, self.ctx.acc, self.ctx.grad_fusion)
        else:
            fired, want = [0], 0
            for r in piece:
                want += r.tape_a.hook_weight_grads(self.ctx.acc, fired, fused=self.ctx.grad_fusion)
                want += r.tape.hook_weight_grads(self.ctx.acc, fired, skip=logits, fused=self.ctx.grad_fusion)
            grads = torch.autograd.grad([out], [first], [gout], allow_unused=True)
        if fired[0] != want:
            raise RuntimeError(f"backward of {piece[0].region} (chunk {c}, micro-batch {mb}): "
                               f"{want - fired[0]} parameter uses got no gradient")
        for r in piece:     # the logits' weight gradient, unless autograd took it
            r.dys = None if leaves else [gout if t is logits else None for t in r.tape.outputs()]
        return grads

    def bwd_done(self, c: int, mb: int, rec: Rec, drop: bool) -> None:
        genv = self.st.g(c, mb)
        self.store.grad_mb[c] = mb
        KINDS[rec.kind].bwd_done(self.ctx, rec, genv)
        if self.atoms[c][0] == rec.region and c > 0:
            self.st.gout[(c - 1, mb)] = genv.pop("h")
        if drop:
            finish_weights(self.ctx, rec)
            self._drop(c, mb, rec.region)

    def _drop(self, c: int, mb: int, atom: str) -> None:
        recs = self.st.recs[(c, mb)]
        rec = recs.pop(atom)
        rec.drop()
        if self.memory:
            self.store.mem.alloc("act", self.live.release((c, mb, atom)))
        if not recs:
            del self.st.recs[(c, mb)]
            self.st.env.pop((c, mb), None)
            self.st.genv.pop((c, mb), None)

    # ---- communication ------------------------------------------------------------------------------
    def _comm(self, p: Prepared) -> Flight:
        return HANDLERS[p.kind](self, p)

    def _recv_buffer(self, chunk: int) -> torch.Tensor:
        """A tensor (allocated once, when the Program is loaded) for chunk ``chunk``'s output activation (or its gradient) arriving by p2p."""
        shape = (self.strategy.mbs, self.seq, self.spec.hidden)
        return torch.empty(shape, dtype=self.store.buffers["dense"].dtype, device=self.device)
