"""The discrete-event engine that interprets a Program on a modeled cluster.

Each (rank, stream) is a process that runs its instructions in order; an instruction
starts when its deps are done (with ``cost.p2p_posted``, a send/recv is posted and the stream
goes on at once, as a runtime that posts asynchronous point-to-point operations does) (its start time is then recorded, so waiting for a peer shows in
its duration, as a profiler would measure it). Sends meet their recvs, collectives start when
every member arrived; transfers are fluid flows on per-device links (``out``/``in`` per link
class, ``copy`` for local moves) and compute ops are flows on the device's compute, so
concurrent users share them. With ``cost.host_cores`` set, the compute of every device of a node
also flows through one host resource of that many cores (CPU processes sharing a machine); ranks
are then not folded, since a class's members load their host together.
Memory: static state plus alloc/free, tracked per device.
"""
from __future__ import annotations

import time
from heapq import heappush
from inspect import getgeneratorlocals
from typing import Mapping, Sequence

from ..cluster import Cluster
from ..collectives import MODEL_PHASES
from ..errors import DeadlockError, DeviceListError, ProgramError
from ..ir.graph import paused_gc
from ..ir.program import Instr, Program
from ..cost import CostModel, Phase, Workload, link_class, topology
from .fluid import FluidNetwork, _plan_end
from .fold import Folding, fold
from .kernel import Event, Kernel, fire

__all__ = ["Engine", "RawRun", "resolve_devices"]

_ACT_PREFIXES = ("act", "rc.")  # activation and recompute buffers; other named buffers are comm/params
_INF = float("inf")   # Kernel._cur of a FIFO entry
_MODEL_PHASES = frozenset(MODEL_PHASES)   # compute that counts as model FLOPs (MFU)


def _noop(_arg: object) -> None:
    pass


class _Waker:
    """What one stream waits on (a stream waits on one thing at a time): ``succeed`` resumes the
    stream as processing an event succeeded now would, ``process`` resumes it now (the stream's
    ``gen.send`` and ``gen.__next__``); ``start_flow`` starts the flow it awaits."""

    __slots__ = ("kernel", "resume", "process", "net", "links", "work")

    def __init__(self, kernel: Kernel, net: FluidNetwork) -> None:
        self.kernel = kernel
        self.net = net
        self.resume = _noop
        self.process = _noop
        self.links: tuple = ()
        self.work = 0.0

    def succeed(self) -> None:
        k = self.kernel
        k._fifo.append((k._now, self.resume, None))

    def start_flow(self, _arg: object) -> None:
        self.net.flow(self.links, self.work, self)   # type: ignore[arg-type]


class _Posted:
    """A posted send/recv: ``succeed`` (its transfer is done) queues :meth:`done`, as processing an
    event succeeded now would."""

    __slots__ = ("engine", "r", "s", "ins", "start")

    def __init__(self, engine: "Engine", r: int, s: str, ins: Instr, start: float) -> None:
        self.engine, self.r, self.s, self.ins, self.start = engine, r, s, ins, start

    def succeed(self) -> None:
        k = self.engine.env
        k._fifo.append((k._now, self.done, None))

    def done(self, _arg: object) -> None:
        self.process()

    def process(self) -> None:
        """Record the instruction, free its buffers, release its dependents."""
        eng = self.engine
        r, s, ins, start = self.r, self.s, self.ins, self.start
        end = eng.env._now
        eng.raw.records.append((r, s, ins, start, end))
        if s == "compute":
            eng.busy[r][0] += end - start
        if ins.free:
            eng._free(r, ins)
        ev = eng.done[r].get(ins.id)
        if ev is not None:   # ev.succeed(), inline
            k = eng.env
            k._fifo.append((k._now, fire, ev))


class _Chain:
    """The phases of one transfer between one pair of ends, one flow each after its latency (the
    operation's fixed overhead paid with the first), as :meth:`Engine._run_phases` runs them; a flow
    on free resources is planned (:meth:`FluidNetwork.plan`). ``flows``: per phase, (resources, work,
    latency). Between phases the chain is the event a phase's flow succeeds: ``succeed`` queues the
    next step (or the end) as processing that event would."""

    __slots__ = ("env", "net", "flows", "waiters", "extra", "i", "next", "process")

    def __init__(self, engine: "Engine", flows: tuple, waiters: list, overhead: float) -> None:
        self.env, self.net = engine.env, engine.net
        self.flows, self.waiters = flows, waiters
        self.extra = overhead
        self.i = 0
        self.next = self.process = self.step   # process(): run what succeed() would queue, now

    def succeed(self) -> None:
        k = self.env
        k._fifo.append((k._now, self.next, None))

    def step(self, _e: object = None) -> None:
        i = self.i
        flows = self.flows
        links, work, latency = flows[i]
        self.i = i = i + 1
        delay = latency + self.extra
        self.extra = 0.0
        waiters = self.waiters
        if i < len(flows):
            done = self
        elif len(waiters) == 1:
            done = waiters[0]
        else:
            done = self
            self.next = self.process = self._finish
        if self.net.plan(links, delay, work, done):
            return
        if delay > 0:
            self.env.timeout(delay).callbacks.append(lambda _e: self.net.flow(links, work, done))
        else:
            self.net.flow(links, work, done)

    def _finish(self, _e: object = None) -> None:
        """Release the waiters. Run by the kernel (or at once in its place, by ``process``): when no
        other entry is due now, the entries their ``succeed`` would queue are the next processed, in
        this order, and what processing one queues comes after all of them; so process them here."""
        env = self.env
        queue = env._queue
        if env._fifo or env._urgent or (queue and queue[0][0] <= env._now):
            for w in self.waiters:
                w.succeed()
        else:
            for w in self.waiters:
                env._extra += 1
                env._cur = _INF
                w.process()


def resolve_devices(program: Program, cluster: Cluster,
                    devices: "Mapping[int, int] | Sequence[int] | None") -> dict[int, int]:
    """Rank -> device: rank i on device i by default, else the given mapping or list."""
    ranks = sorted(program.ranks)
    if devices is None:
        out = {r: r for r in ranks}
    elif isinstance(devices, Mapping):
        missing = [r for r in ranks if r not in devices]
        if missing:
            raise DeviceListError(f"devices= lacks ranks {missing[:8]}; map every rank of the program to a device")
        out = {r: int(devices[r]) for r in ranks}
    else:
        devs = list(devices)
        if len(devs) != len(ranks):
            raise DeviceListError(f"{len(devs)} devices given for {len(ranks)} ranks; give one device per rank")
        out = dict(zip(ranks, (int(d) for d in devs)))
    if out:
        bad = [d for d in out.values() if not 0 <= d < cluster.devices]
        if bad:
            raise DeviceListError(f"device {bad[0]} is not in {cluster.name} (devices 0-{cluster.devices - 1}); "
                                  f"use a bigger cluster, e.g. {cluster.gpu.name}-{-(-max(out.values()) // cluster.per_node) + 1}x{cluster.per_node}")
    return out


def _links(link: str, a: int, b: "int | None") -> tuple:
    """Resources a transfer from device ``a`` (to ``b``, if a point-to-point) occupies."""
    if link == "local":
        return (("copy", a),)
    if b is None:
        return (("out", link, a),)
    return (("out", link, a), ("in", link, b))


class RawRun:
    """What one engine run produced, at the level of the simulated representatives."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, Instr, float, float]] = []  # (rep, stream, instr, start, end), as they end
        self.busy: dict[int, float] = {}   # rep -> seconds its compute stream ran (summed in record order)
        self.model_flops = 0.0             # model FLOPs of all ranks (summed in record order)
        self.peak: dict[int, float] = {}
        self.peak_parts: dict[int, dict[str, float]] = {}
        self.peak_activations: dict[int, float] = {}   # rep -> most activation bytes it held at once
        self.static: dict[int, dict[str, float]] = {}
        self.link_bytes: dict[str, float] = {"local": 0.0, "intra": 0.0, "inter": 0.0}
        self.mem_events: list[tuple[int, float, float]] = []  # (rep rank, time, bytes in use after)
        self.events = 0
        self.sim_seconds = 0.0
        self.folding: Folding | None = None
        self.devices: dict[int, int] = {}


class Engine:
    """Interpret ``program`` on ``cluster`` with ``cost``; :meth:`run` returns a :class:`RawRun`."""

    def __init__(self, program: Program, cluster: Cluster, cost: CostModel,
                 devices: "Mapping[int, int] | Sequence[int] | None" = None, fold_symmetric: bool = True,
                 scores_per_layer: float = 0.0, workload: "Workload | None" = None) -> None:
        self.program = program
        self.workload = workload
        self.scores = float(scores_per_layer)
        self.cluster = cluster
        self.cost = cost
        self.devices = resolve_devices(program, cluster, devices)
        self.fold_symmetric = fold_symmetric

    # ------------------------------------------------------------------------------------------
    def run(self) -> RawRun:
        with paused_gc():  # many short-lived events and no cycles worth collecting
            return self._run()

    def _run(self) -> RawRun:
        t0 = time.perf_counter()
        raw = RawRun()
        raw.devices = self.devices
        self.raw = raw
        host = self.cost.host_cores > 0
        scans: dict[int, tuple] = {}   # id of a RankProgram -> (group names, peer names, ids depended on)
        self.folding = fo = fold(self.program, self.devices, self.cluster, self.fold_symmetric and not host, scans)
        raw.folding = fo
        self.env = env = Kernel()
        self.net = FluidNetwork(env)
        if host:
            for d in set(self.devices.values()):
                self.net.capacity[("host", self.cluster.node_of(d))] = float(self.cost.host_cores)
        self.done: dict[int, dict[int, Event]] = {}
        self.p2p: dict[tuple, tuple] = {}
        self.coll: dict[tuple, list] = {}
        self.phase_cache: dict[tuple, tuple[Phase, ...]] = {}
        self.coll_cache: dict[tuple, tuple] = {}   # (rank, group, op, bytes) -> (member reps, phases)
        self.op_consts: dict[str, tuple[float, float]] = {}   # op -> (fixed overhead, bandwidth factor)
        self.p2p_cache: dict[tuple, tuple[Phase, ...]] = {}
        self.p2p_route: dict[tuple, tuple] = {}   # (rank, peer name) -> what _p2p needs of the pair
        self.p2p_flows: dict[tuple, tuple] = {}   # (sender, peer name, bytes) -> what _p2p runs
        st = self.program.strategy
        self.tp_step = st is not None and self.program.meta.get("kind") == "train_step"
        self.tp = int(getattr(st, "tp", 1)) if self.tp_step else 1
        self.ctime: dict[float, dict[tuple, float]] = {}   # static bytes -> compute key -> seconds
        self.bw = {link: self.cost.link_bw(link) for link in ("local", "intra", "inter")}
        self.group_reps: dict[tuple, tuple[tuple[int, ...], tuple]] = {}
        # rep -> [bytes in use, activation bytes, peak, static bytes, peak activation bytes]
        self.mem: dict[int, list[float]] = {}
        self.bufs: dict[int, dict[str, float]] = {}
        self.busy: dict[int, list[float]] = {}   # rep -> [seconds its compute stream ran]
        self.streams: list[tuple[int, str, object]] = []   # (rep, stream, its generator)
        self.flops = [0.0]   # model FLOPs so far (a cell the streams add to)
        for r in fo.reps:
            rp = self.program.ranks[r]
            self.done[r] = {d: Event(env) for d in scans[id(rp)][2]}  # only what someone waits for
            static = {k: float(rp.static_memory.get(k, 0)) for k in rp.static_memory}
            raw.static[r] = static
            base = sum(static.values())
            self.mem[r] = [base, 0.0, base, base, 0.0]
            self.bufs[r] = {}
            raw.peak_parts[r] = {"activations": 0.0, "buffers": 0.0}
            self.busy[r] = [0.0]
            raw.mem_events.append((r, 0.0, base))
            computing = [s for s, instrs in rp.streams.items() if any(i.op == "compute" for i in instrs)]
            shared = len(computing) > 1 or host  # several streams compute, or a shared host: fluid
            for s, instrs in rp.streams.items():
                if instrs:
                    self._start(r, s, instrs, base, shared)
        raw.events = env.run()
        self._check_finished()
        for r, m in self.mem.items():
            raw.peak[r] = m[2]
            raw.peak_activations[r] = m[4]
            raw.busy[r] = self.busy[r][0]
        raw.model_flops = self.flops[0]
        raw.sim_seconds = time.perf_counter() - t0
        return raw

    def _check_finished(self) -> None:
        stuck = []
        for r, s, gen in self.streams:   # each suspended at its end, or blocked at instruction ``ins``
            at = getgeneratorlocals(gen).get("ins")
            gen.close()
            if at is not None:
                stuck.append(f"rank {r} stream {s} at [{at}]")
        # a posted send/recv still in flight waits for its peer (a matched one ends before the queue empties)
        stuck += [f"rank {w.r} stream {w.s} at [{w.ins}] (posted)" for _i, w, _r, _route in self.p2p.values()
                  if isinstance(w, _Posted)]
        if stuck:
            for r in self.done:   # a dep on an unknown instruction blocks its stream
                rp = self.program.ranks[r]
                ids = {i.id for i in rp.instrs()}
                bad = [d for d in self.done[r] if d not in ids]
                if bad:
                    user = next(i for i in rp.instrs() if min(bad) in i.deps)
                    raise ProgramError(f"rank {r} instruction {user.id} depends on unknown instruction {min(bad)}; "
                                       f"deps must name instructions of the same rank")
            raise DeadlockError(f"simulation stopped with {len(stuck)} streams blocked: " + "; ".join(stuck[:8])
                                + ("" if len(stuck) <= 8 else " ...") + "; check the program with Program.validate()")

    # ---- one stream -----------------------------------------------------------------------------
    def _start(self, r: int, s: str, instrs: Sequence[Instr], static_bytes: float, shared_compute: bool) -> None:
        """Start stream ``s`` of rank ``r`` as a kernel process would (its start and its end each count
        as one event). The stream is a generator the kernel resumes directly (``gen.send`` is its
        :class:`_Waker`'s ``resume`` and the callback it adds to an event it waits for)."""
        env = self.env
        waker = _Waker(env, self.net)
        gen = self._stream(r, s, instrs, static_bytes, shared_compute, waker)
        waker.resume, waker.process = gen.send, gen.__next__
        self.streams.append((r, s, gen))
        env._urgent.append((env._now, gen.send, None))

    def _stream(self, r: int, s: str, instrs: Sequence[Instr], static_bytes: float, shared_compute: bool,
                waker: _Waker):
        """Run the stream's instructions in order. It waits by yielding nothing, having arranged to be
        resumed: a callback on the event it waits for, or its waker (a flow's end, a timeout); a
        one-member collective's planned flow (fluid's ``_Plan``) has its end entry resume the stream
        with that plan, and the stream does what fluid's ``_plan_end`` would."""
        env = self.env
        done = self.done[r]
        raw = self.raw
        dev = self.devices[r]
        ctime = self.ctime.setdefault(static_bytes, {})   # compute durations on this rank's static state
        rec = raw.records
        cres = (("compute", dev), ("host", self.cluster.node_of(dev))) if self.cost.host_cores > 0 \
            else (("compute", dev),)
        posted = self.cost.p2p_posted or (self.cost.step_p2p_posted and self.tp_step)
        queue = env._queue
        fifo = env._fifo
        urgent = env._urgent
        net = self.net
        flow = net.flow
        active, planned, capacity = net.active, net.planned, net.capacity
        busy = self.busy[r] if s == "compute" else None
        flops = self.flops
        nmem = len(self.folding.members[r])
        coll_cache = self.coll_cache
        solos: dict[tuple, "tuple | None"] = {}   # (group, op, bytes) -> coll_cache's _solo entry for r
        lb = raw.link_bytes
        resume = waker.resume
        bufs = self.bufs[r]
        mem = self.mem[r]
        mem_events = raw.mem_events
        static_sum = mem[3]
        for ins in instrs:
            deps = ins.deps
            if deps:
                for d in deps:
                    ev = done[d]
                    if ev.callbacks is not None:   # not processed yet
                        ev.callbacks.append(resume)
                        yield
            start = env._now
            alloc = ins.alloc
            if alloc:   # self._alloc, inline
                cur = mem[0]
                for name, b in alloc:
                    n = len(bufs)
                    bufs[name] = b
                    if len(bufs) == n:
                        raise ProgramError(f"rank {r} instruction {ins.id} allocates buffer {name!r} twice; "
                                           f"free it first")
                    cur += b
                    if name.startswith(_ACT_PREFIXES):
                        mem[1] += b
                mem[0] = cur
                mem_events.append((r, start, cur))
                if mem[1] > mem[4]:
                    mem[4] = mem[1]
                if cur > mem[2]:
                    mem[2] = cur
                    act = mem[1]
                    raw.peak_parts[r] = {"activations": act, "buffers": cur - act - static_sum}
            op = ins.op
            if op == "compute":
                phase = ins.phase
                fl = ins.flops
                key = (phase, ins.region, fl, ins.nbytes, not ins.microbatch)
                dt = ctime.get(key)
                if dt is None:
                    dt = ctime[key] = self.cost.compute_time(ins, static_bytes, self.scores, self.workload)
                if shared_compute:
                    flow(cres, dt, waker)   # type: ignore[arg-type]
                else:   # env.timeout(dt), inline (Kernel.call_at)
                    if dt < 0:
                        raise ValueError(f"negative delay {dt}")
                    if dt == 0:
                        fifo.append((start, resume, None))
                    else:
                        env._eid = eid = env._eid + 1
                        heappush(queue, (start + dt, eid, resume, None))
                yield
            elif op == "send" or op == "recv":
                if posted:   # posted: the stream moves on, completion comes later
                    self._p2p(r, ins, _Posted(self, r, s, ins, start))
                    continue
                self._p2p(r, ins, waker)
                yield
            elif op == "copy":
                ev = self._copy(r, ins)
                if ev.callbacks is not None:
                    ev.callbacks.append(resume)
                    yield
            else:
                ck = (ins.group, op, ins.nbytes)
                solo = solos.get(ck, False)
                if solo is False:   # not seen by this stream: what _collective cached, if it ran it
                    hit = coll_cache.get((r, *ck))
                    solo = None if hit is None else solos.setdefault(ck, hit[2])
                if solo is not None:
                    # every member folds into r and it runs one phase: its flow, precomputed (_solo)
                    link, nbytes, links, work, delay = solo
                    lb[link] += nbytes
                    free = delay > 0 and work > 0.0   # FluidNetwork.plan, inline
                    if free:
                        for link in links:
                            if link in planned or active.get(link) or (capacity and link in capacity):
                                free = False
                                break
                    if free:
                        eid = env._eid + 1
                        t0 = start + delay
                        p = [links, t0, work, waker, eid, None, net]   # a fluid _Plan
                        for link in links:
                            planned[link] = p
                        env._eid = eid = eid + 1
                        heappush(queue, (t0 + work, eid, resume, p))   # its end resumes this stream
                        if (yield) is p:   # its end entry (fluid._plan_end, handled here)
                            if p[5] is None:   # ran alone: its start and its end
                                for link in links:
                                    del planned[link]
                                env._extra += 1
                                if fifo or urgent or (queue and queue[0][0] <= env._now):
                                    fifo.append((env._now, resume, None))   # waker.succeed()
                                    yield
                                else:   # processed next anyway: go on here
                                    env._extra += 1
                                    env._cur = _INF
                            else:   # made real: wait for that flow
                                _plan_end(p)
                                yield
                        else:   # the real flow it became ended before its planned end: that entry is void
                            for i, e in enumerate(queue):
                                if e[3] is p:
                                    queue[i] = (e[0], e[1], _plan_end, p)
                                    break
                    else:
                        waker.links, waker.work = links, work
                        if delay > 0:   # env.timeout(delay), inline
                            env._eid = eid = env._eid + 1
                            heappush(queue, (start + delay, eid, waker.start_flow, None))
                        else:
                            waker.start_flow(None)
                        yield
                else:
                    ev = self._collective(r, ins)
                    if ev.callbacks is not None:
                        ev.callbacks.append(resume)
                        yield
            end = env._now
            rec.append((r, s, ins, start, end))
            if busy is not None:
                busy[0] += end - start
            if op == "compute" and phase in _MODEL_PHASES:
                flops[0] += fl * nmem
            free = ins.free
            if free:   # self._free, inline
                cur = mem[0]
                for name in free:
                    b = bufs.pop(name, None)
                    if b is None:
                        raise ProgramError(f"rank {r} instruction {ins.id} frees buffer {name!r}, "
                                           f"which is not allocated")
                    cur -= b
                    if name.startswith(_ACT_PREFIXES):
                        mem[1] -= b
                mem[0] = cur
                mem_events.append((r, env._now, cur))
            if ins.id in done:   # done[ins.id].succeed(), inline
                fifo.append((env._now, fire, done[ins.id]))
        ins = None
        fifo.append((env._now, _noop, None))   # the process's end
        yield   # never resumed

    # ---- memory -------------------------------------------------------------------------------
    def _free(self, r: int, ins: Instr) -> None:
        bufs = self.bufs[r]
        mem = self.mem[r]
        cur = mem[0]
        for name in ins.free:
            b = bufs.pop(name, None)
            if b is None:
                raise ProgramError(f"rank {r} instruction {ins.id} frees buffer {name!r}, which is not allocated")
            cur -= b
            if name.startswith(_ACT_PREFIXES):
                mem[1] -= b
        mem[0] = cur
        self.raw.mem_events.append((r, self.env._now, cur))

    # ---- transfers ----------------------------------------------------------------------------
    def _run_phases(self, phases: Sequence[Phase], link_ends: list[tuple[int, int | None]],
                    waiters: list[Event], op: str) -> None:
        """Run ``phases`` of ``op`` in order; each phase is one flow per (device, peer device) in
        ``link_ends`` (one pair: a :class:`_Chain`); the operation's fixed overhead is paid with the
        first latency."""
        env, net, cost = self.env, self.net, self.cost
        overhead, factor = self._op_consts(op)
        if len(link_ends) == 1 and phases:   # one flow per phase
            _Chain(self, self._chain_flows(phases, link_ends[0], factor), waiters, overhead).step()
            return
        it = iter(phases)

        def finish() -> None:
            for w in waiters:
                w.succeed()

        def step(_e=None, extra: float = 0.0) -> None:
            ph = next(it, None)
            if ph is None:
                if extra > 0:
                    env.timeout(extra).callbacks.append(lambda _e: finish())
                else:
                    finish()
                return
            work = ph.nbytes / (cost.link_bw(ph.link) * factor)

            def go(_e=None) -> None:
                evs = [net.flow(_links(ph.link, a, b), work) for a, b in link_ends]
                env.all_of(evs).callbacks.append(step)

            delay = ph.latency + extra
            if delay > 0:
                env.timeout(delay).callbacks.append(go)
            else:
                go()

        step(extra=overhead)  # the fixed per-operation cost is paid with the first latency

    def _chain_flows(self, phases: Sequence[Phase], ends: tuple, factor: float) -> tuple:
        """Per phase of a transfer between ``ends``: (resources, work, latency), for a :class:`_Chain`."""
        bw = self.bw
        return tuple((_links(ph.link, *ends), ph.nbytes / (bw[ph.link] * factor), ph.latency) for ph in phases)

    def _p2p(self, r: int, ins: Instr, waiter) -> None:
        """Post ``ins`` (a send or a recv); ``waiter.succeed()`` runs once the transfer is done."""
        rk = (r, ins.peer)
        route = self.p2p_route.get(rk)
        if route is None:   # (peer's rep, this device, peer's device, link class, members of r)
            fo = self.folding
            peer = fo.peers[rk]
            src, dst = self.devices[r], self.devices[peer]
            route = self.p2p_route[rk] = (fo.rep_of[peer], src, dst, link_class(self.cluster, src, dst),
                                          len(fo.members[r]))
        send = ins.op == "send"
        key = (r, route[0], ins.tag) if send else (route[0], r, ins.tag)
        other = self.p2p.pop(key, None)
        if other is None:
            self.p2p[key] = (ins, waiter, r, route)
            return
        o_ins, o_waiter, o_r, o_route = other
        if o_ins.op == ins.op:
            raise ProgramError(f"rank {r} and rank {o_r} both {ins.op} tag {ins.tag!r}; pair each send with a recv")
        send_ins, s_route, s_r = (ins, route, r) if send else (o_ins, o_route, o_r)
        ck = (s_r, send_ins.peer, send_ins.nbytes)
        hit = self.p2p_flows.get(ck)
        if hit is None:   # (what each phase adds to its link class, the chain's flows, the overhead)
            _rep, src, dst, link, nmem = s_route
            phases = self._p2p_phases(send_ins, link)
            overhead, factor = self._op_consts("send")
            hit = self.p2p_flows[ck] = (tuple((ph.link, ph.nbytes * nmem) for ph in phases),
                                        self._chain_flows(phases, (src, dst), factor), overhead)
        adds, flows, overhead = hit
        lb = self.raw.link_bytes
        for link, nbytes in adds:
            lb[link] += nbytes
        if flows:
            _Chain(self, flows, [waiter, o_waiter], overhead).step()
        else:
            self._run_phases((), [s_route[1:3]], [waiter, o_waiter], "send")

    def _p2p_phases(self, ins: Instr, link: str) -> tuple[Phase, ...]:
        """A pipeline send under TP with ``cost.pp_scatter_gather`` (as Megatron does): each TP rank
        sends 1/tp of the activation, and the receiving TP group all-gathers it over its node's links."""
        cost = self.cost
        tp = self.tp
        scatter = tp > 1 and cost.pp_scatter_gather and link != "local" and isinstance(ins.peer, str) \
            and ins.peer.startswith("pp")
        key = (ins.nbytes, link, scatter)
        ph = self.p2p_cache.get(key)
        if ph is None:
            if scatter:
                inner = "intra" if tp <= self.cluster.per_node else "inter"
                ph = cost.p2p_phases(ins.nbytes / tp, link) + \
                    (Phase(inner, ins.nbytes * (tp - 1) / tp, cost.latency[inner] * (tp - 1)),)
            else:
                ph = cost.p2p_phases(ins.nbytes, link)
            self.p2p_cache[key] = ph
        return ph

    def _copy(self, r: int, ins: Instr) -> Event:
        ev = self.env.event()
        dev = self.devices[r]
        self.raw.link_bytes["local"] += ins.nbytes * len(self.folding.members[r])
        self._run_phases(self.cost.p2p_phases(ins.nbytes, "local"), [(dev, None)], [ev], "copy")
        return ev

    def _collective(self, r: int, ins: Instr) -> Event:
        fo = self.folding
        ck = (r, ins.group, ins.op, ins.nbytes)
        hit = self.coll_cache.get(ck)
        if hit is None:
            gk = (r, ins.group)
            cached = self.group_reps.get(gk)
            if cached is None:
                members = fo.groups[gk]
                reps = tuple(sorted({fo.rep_of[m] for m in members}))
                topo = topology(self.cluster, [self.devices[m] for m in members])
                cached = self.group_reps[gk] = (reps, topo)
            reps, topo = cached
            pk = (ins.op, ins.nbytes, topo)
            phases = self.phase_cache.get(pk)
            if phases is None:
                phases = self.phase_cache[pk] = self.cost.collective_phases(ins.op, ins.nbytes, topo)
            hit = self.coll_cache[ck] = (reps, phases, self._solo(r, reps, phases, ins.op))
        reps, phases, solo = hit
        env = self.env
        ev = Event(env)
        if solo is not None:  # one member, one phase: the flow precomputed (as _run_phases would run it)
            link, nbytes, links, work, delay = solo
            self.raw.link_bytes[link] += nbytes
            if delay <= 0 or not self.net.plan(links, delay, work, ev):
                if delay > 0:
                    env.timeout(delay).callbacks.append(lambda _e: self.net.flow(links, work, ev))
                else:
                    self.net.flow(links, work, ev)
            return ev
        if reps == (r,):  # every member is folded into this rank: no one to wait for
            arrived = [(r, ev, ins)]
        else:
            arrived = self._arrive(r, ins, ev, reps)
            if arrived is None:
                return ev
        lb = self.raw.link_bytes
        members = fo.members
        for ph in phases:
            for r2, _e, _i in arrived:
                lb[ph.link] += ph.nbytes * len(members[r2])
        devices = self.devices
        self._run_phases(phases, [(devices[r2], None) for r2, _e, _i in arrived], [e for _r, e, _i in arrived],
                         ins.op)
        return ev

    def _solo(self, r: int, reps: tuple[int, ...], phases: Sequence[Phase], op: str) -> "tuple | None":
        """For a collective whose members all fold into ``r`` and that runs one phase: (link class,
        bytes it adds to that class, the flow's resources, its work, its delay before the flow)."""
        if reps != (r,) or len(phases) != 1:
            return None
        ph = phases[0]
        overhead, factor = self._op_consts(op)
        return (ph.link, ph.nbytes * len(self.folding.members[r]), _links(ph.link, self.devices[r], None),
                ph.nbytes / (self.bw[ph.link] * factor), overhead + ph.latency)

    def _op_consts(self, op: str) -> tuple[float, float]:
        """``op``'s fixed overhead and bandwidth factor."""
        consts = self.op_consts.get(op)
        if consts is None:
            consts = self.op_consts[op] = (self.cost.op_overhead(op), self.cost.comm_op_bw.get(op, 1.0))
        return consts

    def _arrive(self, r: int, ins: Instr, ev: Event, reps: tuple[int, ...]) -> list | None:
        """Register ``r`` at collective ``ins``; all arrivals once the last member is in, else None."""
        if r not in reps:
            raise ProgramError(f"rank {r} runs {ins.op} {ins.tag!r} on a group that does not contain it")
        key = (ins.tag, reps)
        arrived = self.coll.get(key)
        if arrived is None:
            arrived = self.coll[key] = []
        arrived.append((r, ev, ins))
        if len(arrived) < len(reps):
            return None
        del self.coll[key]
        for r2, _e, i2 in arrived:
            if i2.op != ins.op:
                raise ProgramError(f"collective {ins.tag!r}: rank {r2} runs {i2.op}, rank {r} runs {ins.op}; "
                                   f"every member must issue the same collective")
        return arrived
