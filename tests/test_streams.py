"""The stream abstraction (:mod:`parashift.exec.streams`) and the switch executor's ordered (NCCL)
driver, on CPU.

A recording backend stands in for CUDA streams and events: it logs every record, wait and drain,
so the tests check that each instruction ran on its stream only after waiting for the event (or
the communication handles) of every dependency on another stream, and that nothing waits on the
whole device but the one drain at the end. The switch executor's ordered driver runs every
device of a switch in threads of this process over an in-memory fabric with NCCL's matching
rules: no tags (the n-th send from a to b meets the n-th receive posted by b from a, and their
sizes must agree) and collectives matched in issue order per group; the moved state must be
bit-exact.
"""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from parashift import models
from parashift.exec.lanes import install
from parashift.exec.state import StateStore
from parashift.exec.streams import HostBackend, Streams
from parashift.exec.switch import BufferPool, SwitchExecutor, full_from_arrays, store_arrays, store_from_full
from parashift.exec.switch.executor import issue_order
from parashift.exec.switch.stores import STATE_KINDS
from parashift.exec.switch.wire import checksum, resolve
from parashift.ir.program import Instr
from parashift.strategy import Strategy
from parashift.vps.transition import plan_live_switch

GPT = models.gpt(4, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="sw-gpt", dtype="fp32", pad_vocab=8)


class _Ev:
    ids = itertools.count()

    def __init__(self, timing: bool) -> None:
        self.id, self.timing, self.t = next(self.ids), timing, 0.0


class RecordingBackend(HostBackend):
    """The CPU twin, logging what a CUDA backend would be asked to do: (what, stream, event id)."""

    kind = "recording"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.local = threading.local()

    def stream(self, name):
        return f"lane:{name}"

    def current(self):
        return "current"

    def use(self, stream):
        backend = self

        class _Use:
            def __enter__(self_):
                self_.prev = getattr(backend.local, "on", "current")
                backend.local.on = stream

            def __exit__(self_, *a):
                backend.local.on = self_.prev
        return _Use()

    def event(self, timing):
        return _Ev(timing)

    def record(self, event, stream):
        super().record(event, stream)
        self.log.append(("record", stream, event.id))

    def wait(self, stream, event):
        self.log.append(("wait", stream, event.id))

    def wait_stream(self, stream, other):
        self.log.append(("wait_stream", stream, other))

    def synchronize(self):
        self.log.append(("synchronize", None, None))

    def drain(self, events, poll):
        self.log.append(("drain", None, tuple(e.id for e in events)))


class KeyedStreams(Streams):
    """Streams that remember which event stands for which key, and tag communication handles."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.key_of_event: dict[int, object] = {}

    def mark(self, name, key):
        super().mark(name, key)
        self.key_of_event[self._events[key][1].id] = key

    def pending(self, key, works, then=None):
        for w in works:
            w.key = key
        super().pending(key, works, then)


def _waited_before(log, pos, stream, key, key_of_event) -> bool:
    for what, s, x in log[:pos]:
        if s != stream:
            continue
        if what == "wait" and key_of_event.get(x) == key:
            return True
        if what == "work" and x == key:
            return True
    return False


# ---- the abstraction itself -------------------------------------------------------------------------
def test_streams_order_cross_stream_work_by_events_and_wait_on_handles_once():
    rec = RecordingBackend()
    s = KeyedStreams(rec, default=("compute",))
    with s.enter("compute"):
        pass
    s.mark("compute", "a")
    with s.enter("grads", ["a"], after_current=True):      # another stream: waits for the current one and a
        pass
    s.mark("grads", "b")
    with s.enter("compute", ["a", "b"]):                   # same-stream dep a: ordered already, no wait
        pass
    assert [e for e in rec.log if e[0] in ("wait", "wait_stream")] == [    # created after the current stream's work
        ("wait_stream", "lane:grads", "current"), ("wait_stream", "lane:grads", "current"),
        ("wait", "lane:grads", s._events["a"][1].id),
        ("wait", "current", s._events["b"][1].id)]

    class Work:
        def __init__(self):
            self.waits = 0

        def wait(self, *a):
            self.waits += 1
    w, landed = Work(), []
    s.pending("x", [w], then=lambda: landed.append(rec.local.on))
    s.wait("unpack", ["x"])
    s.wait("unpack", ["x"])                                 # once per stream
    s.wait("compute", ["x"])
    assert w.waits == 2 and landed == ["lane:unpack"]       # ``then`` once, on the first stream that waited
    assert not any(e[0] in ("synchronize", "drain") for e in rec.log)
    s.finish()
    assert [e[0] for e in rec.log].count("drain") == 1


def test_profiling_stamps_are_free_when_off_and_host_clock_seconds_on_the_twin():
    off = Streams(HostBackend())
    assert off.stamp() is None
    on = Streams(HostBackend(), profile=True)
    on.begin()
    a = on.stamp()
    b = on.stamp("comm")
    secs = on.seconds([a, b, on._host0 + 0.5])
    assert 0 <= secs[0] <= secs[1] < 0.5 and secs[2] == pytest.approx(0.5)


def test_lanes_wait_for_every_cross_stream_dependency_of_a_user_stream():
    """The interpreter's hook on a Program with a user-named stream: every instruction runs after
    a wait on the event of each dependency recorded on another lane."""
    streams = {"compute": [Instr(0, "compute", "compute"), Instr(3, "compute", "compute", deps=(2,))],
               "grads": [Instr(1, "all_reduce", "grads", deps=(0,)), Instr(2, "all_reduce", "grads", deps=(1,))]}

    class RP:
        pass
    rp = RP()
    rp.streams = streams
    rec = RecordingBackend()
    ran: list[tuple[int, str, int]] = []

    class Prep:
        def __init__(self, ins, idx, deps):
            self.ins, self.idx, self.deps = ins, idx, deps

    class Interp:
        device = torch.device("cpu")

        def __init__(self):
            self.rp = rp

        def _issue(self, p):
            ran.append((p.idx, getattr(rec.local, "on", "current"), len(rec.log)))
            return None

        def _complete(self, fl, err):
            pass
    interp = Interp()
    lanes = install(interp, backend=rec)
    assert lanes is not None
    order = [streams["compute"][0], streams["grads"][0], streams["grads"][1], streams["compute"][1]]
    for ins in order:
        interp._issue(Prep(ins, ins.id, ins.deps))
    assert [(i, on) for i, on, _ in ran] == [(0, "current"), (1, "lane:grads"), (2, "lane:grads"), (3, "current")]
    ev_of = {k: ev.id for k, (_, ev) in lanes.streams._events.items()}
    # instruction 3 (compute) waited on the event of 2 (grads lane) before it ran
    pos3 = ran[3][2]
    assert ("wait", "current", ev_of[2]) in rec.log[:pos3]
    # instruction 1 (grads) waited for the current stream (what it may read) before it ran
    assert ("wait_stream", "lane:grads", "current") in rec.log[:ran[1][2]]
    assert install(type("I", (), {"rp": type("R", (), {"streams": {"compute": []}})(), "device": "cpu"})()) is None


# ---- an in-memory fabric with NCCL's matching rules --------------------------------------------------
class Fabric:
    """Point-to-point messages matched per ordered pair in posting order (tags ignored, sizes must
    agree) and collectives matched per group in issue order (kind and root must agree)."""

    def __init__(self, backend: RecordingBackend) -> None:
        self.cv = threading.Condition()
        self.sent: dict[tuple[int, int], list] = defaultdict(list)
        self.nrecv: dict[tuple[int, int], int] = defaultdict(int)
        self.coll: dict[tuple, dict] = defaultdict(dict)
        self.ncoll: dict[tuple, int] = defaultdict(int)
        self.backend = backend
        self.errors: list[str] = []

    def work(self, fn=None):
        fab = self

        class Work:
            key = None

            def wait(self, *a):
                fab.backend.log.append(("work", getattr(fab.backend.local, "on", "current"), self.key))
                if fn is not None:
                    fn()
        return Work()

    def get(self, pred, what):
        with self.cv:
            if not self.cv.wait_for(pred, timeout=20):
                self.errors.append(f"stuck: {what}")
                raise RuntimeError(f"stuck waiting for {what}")


class P2P:
    def __init__(self, fab: Fabric, me: int) -> None:
        self.fab, self.me = fab, me

    def send(self, tensors, peer, tag):
        t = tensors[0]
        with self.fab.cv:
            self.fab.sent[(self.me, peer)].append(t.clone())
            self.fab.cv.notify_all()
        return self.fab.work()

    def recv(self, tensors, peer, tag):
        t, fab, pair = tensors[0], self.fab, (peer, self.me)
        with fab.cv:
            n = fab.nrecv[pair]
            fab.nrecv[pair] += 1

        def land():
            fab.get(lambda: len(fab.sent[pair]) > n, f"message {n} {pair}")
            m = fab.sent[pair][n]
            if m.numel() != t.numel():
                fab.errors.append(f"message {n} from {peer} to {self.me}: {m.numel()} bytes into {t.numel()}")
                raise RuntimeError(fab.errors[-1])
            t.copy_(m)
        return fab.work(land)


class Group:
    def __init__(self, fab: Fabric, members: tuple[int, ...], me: int) -> None:
        self.fab, self.members, self.me = fab, members, me

    def _call(self, kind, root, data, finish):
        fab, g = self.fab, self.members
        with fab.cv:
            n = fab.ncoll[(g, self.me)]
            fab.ncoll[(g, self.me)] += 1
            slot = fab.coll[(g, n)]
            slot[self.me] = (kind, root, data)
            fab.cv.notify_all()

        def land():
            fab.get(lambda: len(slot) == len(g), f"{kind} {n} on {g}")
            if len({(k, r) for k, r, _ in slot.values()}) != 1:
                fab.errors.append(f"collective {n} on {g} mismatched: {sorted(slot.items())}")
                raise RuntimeError(fab.errors[-1])
            finish(slot)
        return fab.work(land)

    def broadcast(self, tensors, o):
        root = self.members[o.rootRank]
        return self._call("broadcast", root, tensors[0].clone() if self.me == root else None,
                          lambda slot: tensors[0].copy_(slot[root][2]) if self.me != root else None)

    def scatter(self, outs, ins, o):
        root = self.members[o.rootRank]
        data = [c.clone() for c in ins[0]] if self.me == root else None
        return self._call("scatter", root, data,
                          lambda slot: outs[0].copy_(slot[root][2][self.members.index(self.me)]))

    def gather(self, outs, ins, o):
        root = self.members[o.rootRank]

        def finish(slot):
            if self.me == root:
                for i, m in enumerate(self.members):
                    if m != root:
                        outs[0][i].copy_(slot[m][2])
        return self._call("gather", root, ins[0].clone() if self.me != root else None, finish)

    def allgather(self, outs, ins):
        def finish(slot):
            for i, m in enumerate(self.members):
                outs[0][i].copy_(slot[m][2])
        return self._call("all_gather", None, ins[0].clone(), finish)


def _stores(spec, strategy: Strategy, seed: int) -> dict[int, StateStore]:
    """Every rank's store with parameters and moments filled from one global random state."""
    full = {}
    rng = np.random.default_rng(seed)
    for t in spec.tensors:
        for k in STATE_KINDS[:1] + STATE_KINDS[2:]:
            full[(t.name, k)] = rng.standard_normal(t.shape).astype(np.float32)
    return {r: store_from_full(spec, strategy, r, full) for r in range(strategy.world)}


SWITCHES = [("dp=2,tp=2,zero=1", (0, 1, 2, 3), "tp=4", (0, 1, 2, 3)),        # point to point, both ways
            ("dp=1", (0,), "dp=4,zero=1", (0, 1, 2, 3)),                      # scatter and broadcast
            ("tp=4", (0, 1, 2, 3), "dp=1", (2,)),                             # gather
            ("tp=4", (0, 1, 2, 3), "dp=4", (0, 1, 2, 3)),                     # all_gather
            ("dp=2,zero=3", (0, 2), "dp=2,tp=2,pp=2,zero=2", tuple(range(8)))]  # grow 2 -> 8


def _staged_budget(src: str, dst: str, sd, dd) -> int:
    """A budget below the largest old + new state of a device: the switch runs in stages."""
    from parashift import cluster
    from parashift.vps import plan_switch
    from parashift.vps.transition.staging import state_buffers
    plan = plan_switch(GPT, Strategy.parse(src), Strategy.parse(dst), cluster=cluster.get("cpu-local").with_devices(8),
                       src_devices=list(sd), dst_devices=list(dd))
    buf = state_buffers(plan)
    return int(0.8 * np.bincount(buf.dev, weights=(buf.old + buf.new).astype(float)).max())


@pytest.mark.parametrize("src,sd,dst,dd,staged", [s + (False,) for s in SWITCHES] + [SWITCHES[0] + (True,)],
                         ids=[f"{a}->{b}" for a, _, b, _ in SWITCHES] + ["staged"])
def test_ordered_driver_moves_state_bit_exactly_under_nccl_matching_rules(src, sd, dst, dd, staged):
    budget = _staged_budget(src, dst, sd, dd) if staged else None
    planned = plan_live_switch(GPT, Strategy.parse(src), Strategy.parse(dst), sd, dd, memory_budget=budget)
    assert planned.staged == staged
    program = planned.program
    parts = planned.participants
    olds = _stores(GPT, planned.src, seed=1)
    full = full_from_arrays(GPT, planned.src, {r: store_arrays(s) for r, s in olds.items()})
    rec = RecordingBackend()
    fab = Fabric(rec)
    index = {d: i for i, d in enumerate(parts)}
    results: dict[int, object] = {}
    news: dict[int, StateStore] = {}
    streams: dict[int, KeyedStreams] = {}
    logs: dict[int, list] = {}
    execs: dict[int, SwitchExecutor] = {}

    class Logged(SwitchExecutor):
        def _copy(self, ins):
            logs[self.device].append((len(rec.log), ins))
            super()._copy(ins)

        def _issue(self, ins):
            logs[self.device].append((len(rec.log), ins))
            return super()._issue(ins)

    def run(d: int) -> None:
        try:
            old = olds[sd.index(d)] if d in sd else None
            new = StateStore(GPT, planned.dst, dd.index(d), torch.device("cpu"), init=False) if d in dd else None
            news[d] = new
            streams[d] = KeyedStreams(rec, default=("pack",))
            logs[d] = []
            ex = execs[d] = Logged(program, d, old, new, P2P(fab, index[d]), index,
                        lambda g, d=d: Group(fab, g, d), pool=BufferPool(), big=4096, chunk=1 << 12,
                        streams=streams[d])
            for k in range(program.meta["stages"]) if staged else [None]:    # stage by stage, as execute_switch
                results[d] = ex.run(k)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[d] = e
    threads = [threading.Thread(target=run, args=(d,)) for d in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not fab.errors, fab.errors
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    # the state arrived bit-exactly
    for d in dd:
        want = store_arrays(store_from_full(GPT, planned.dst, dd.index(d), full))
        got = store_arrays(news[d])
        for fam in want:
            for k in want[fam]:
                np.testing.assert_array_equal(got[fam][k], want[fam][k], err_msg=f"device {d} {fam} {k}")
    # what was sent is what was received, checksum for checksum
    sent = {k: v for r in results.values() for k, v in r.sent_crc.items()}
    recv = {k: v for r in results.values() for k, v in r.recv_crc.items()}
    assert recv and all(sent[k] == v for k, v in recv.items())
    # every instruction ran after waiting for each dependency held on another stream of its device
    order = issue_order(program)
    for d in parts:
        s = streams[d]
        by_id = {i.id: i for i in program.ranks[d].instrs()}
        ran = logs[d]
        stage = (lambda i: execs[d].stage_of(by_id[i])) if staged else (lambda i: 0)
        assert [i.id for _, i in ran] == sorted(by_id, key=lambda i: (stage(i), order[(d, i)], i))
        for pos, ins in ran:
            for dep in ins.deps:
                other = by_id[dep].stream
                if s.handle(other) == s.handle(ins.stream) or stage(dep) < stage(ins.id):
                    continue          # ordered on its stream, or done when the earlier stage drained
                assert _waited_before(rec.log, pos, s.handle(ins.stream), dep, s.key_of_event), \
                    f"device {d}: {ins} ran before waiting for {by_id[dep]}"
    # one drain per device (and stage), nothing synchronized per instruction
    assert [e[0] for e in rec.log].count("drain") == len(parts) * (program.meta["stages"] if staged else 1)
    assert not any(e[0] == "synchronize" for e in rec.log)


def test_issue_order_agrees_on_every_transfer_and_respects_deps():
    planned = plan_live_switch(GPT, Strategy.parse("dp=2,tp=2,zero=1"), Strategy.parse("dp=2,pp=2"), (0, 1, 2, 3),
                               (0, 1, 2, 3))
    order = issue_order(planned.program)
    tags: dict[str, set] = defaultdict(set)
    for d, rp in planned.program.ranks.items():
        for ins in rp.instrs():
            if ins.tag is not None:
                tags[ins.tag].add(order[(d, ins.id)])
            for dep in ins.deps:
                assert order[(d, dep)] < order[(d, ins.id)]
    assert tags and all(len(v) == 1 for v in tags.values())     # both ends of a transfer share a position


def test_host_checksums_resolve_unchanged_and_pool_fences_run_before_reuse():
    t = torch.arange(37, dtype=torch.uint8)
    assert resolve([checksum(t), 5]) == [checksum(t), 5]
    pool, waited = BufferPool(), []
    a = pool.get(64)
    pool.put(a, fence=lambda on: waited.append(on))
    b = pool.get(64, "recv1")
    assert b.data_ptr() == a.data_ptr() and waited == ["recv1"] and pool.in_use == 64


# ---- device placement errors (fast) and the drivers across processes (slow) -------------------------
def test_device_jobs_say_what_this_host_cannot_run():
    from parashift.errors import StrategyError
    from parashift.exec.switch import generations, run_live
    from parashift.exec.switch.check import switch_check
    from parashift.exec.switch.session import check_gpus
    gens = generations(GPT, "dp=2", 3, [(1, "tp=2", (2, 3))])
    with pytest.raises(StrategyError, match=r"switch 1 runs devices \[0, 1, 2, 3\] at once, but this host has 2 GPU"):
        check_gpus(gens, 2)
    check_gpus(gens, 4)
    with pytest.raises(StrategyError, match="unknown transport 'mpi'"):
        switch_check(GPT, "dp=2", "tp=2", transport="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(StrategyError, match="needs CUDA GPUs, and this machine has none"):
            run_live(GPT, "dp=2", steps=2, device="cuda")
        for t in ("nccl", "gloo-pinned"):
            with pytest.raises(StrategyError, match="keeps the state on a GPU, and this machine has none"):
                switch_check(GPT, "dp=2", "tp=2", transport=t)
    with pytest.raises(StrategyError, match="unknown device 'tpu'"):
        run_live(GPT, "dp=2", steps=2, device="tpu")


@pytest.mark.slow
def test_ordered_driver_across_gloo_processes_matches_the_gloo_driver():
    from parashift.exec.switch import run_live
    from parashift.exec.switch.check import switch_check
    from test_switch_live import check_switches
    for ordered in (False, True):
        out = switch_check(GPT, "dp=2,tp=2,zero=1", "tp=4", ordered=ordered, repeats=2, timeout=60)
        assert out["ok"] and out["ordered"] == ordered and out["bytes_moved"] > 0, out
    chain = [(1, "tp=4", None), (2, "dp=2,pp=2", None), (3, "dp=2,zero=3", (0, 2)), (4, "dp=4,zero=1", None)]
    res = run_live(GPT, "dp=2,tp=2,zero=1", steps=5, switches=chain, export=True, timeout=240, switch_timeout=30,
                   big_piece=4096, ordered=True)
    ref = run_live(GPT, "dp=2,tp=2,zero=1", steps=5, switches=chain, timeout=240, switch_timeout=30, big_piece=4096)
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(GPT, res) == len(chain)
    assert res.losses == ref.losses
