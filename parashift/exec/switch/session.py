"""Live jobs that hot-switch: ``run_live(model, strategy, steps=..., switches=[...])``.

A job is a sequence of *generations* (strategy, devices), each starting at a global step.
:func:`run_live` starts one fresh process per device incarnation (see :mod:`..job.elastic`): the
devices of generation 0 train at once; a joining device's process is started when its switch is
announced, rendezvous with the job through the shared TCPStore, and receives its state. A switch
is announced ``notice`` steps ahead (as spot instances get a notice): the participants plan it,
build its communicators and allocate the destination store in the background while training
goes on (:class:`LiveSession`), then switch between iterations; leaving devices send their state
out and exit. During the pause, the next training world (torch's default process group, which
the old layout trains on until its last step) is built by a thread while the state moves, so the
pause is the transfer and verification plus whatever of the rebuild they do not hide.

A session's settings are one frozen :class:`LiveOptions`. Tests inject faults through
``LiveOptions.faults`` (an object with ``hooks(switch, device, program)`` returning the
executor's ``(on_received, on_issue)`` hooks); nothing in the runtime injects any.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import torch

from ... import gpus, models
from ...cluster import Cluster, get as get_cluster
from ...errors import MemoryBudgetError, StrategyError, SwitchAborted
from ...ir.program import Program
from ...strategy import Strategy
from ...traces.chrome import write_chrome_trace
from ...vps.transition import place
from ..job.elastic import ElasticContext, ElasticManager, incarnations, launch_elastic
from ..launch import RankContext
from ..reference import OptimConfig
from ..state import StateStore
from .memory import BufferPool, lazy_alloc, state_alloc
from .protocol import Prepared, SwitchRecord, execute_switch, prepare, training_worlds
from .stores import store_arrays
from .wire import BIG, CHUNK

__all__ = ["Generation", "generations", "LiveOptions", "SwitchFaults", "LiveSession", "LiveResult", "run_live",
           "step_times"]


class SwitchFaults(Protocol):
    """Fault hooks a test injects (picklable: processes are spawned): for switch ``switch`` on
    ``device``, the executor's ``(on_received, on_issue)`` hooks, each None for no hook."""

    def hooks(self, switch: int, device: int, program: Program) -> tuple[Callable | None, Callable | None]: ...

    def kills(self) -> bool:
        """Whether a process may die (the launcher then tolerates a missing report)."""


@dataclass(frozen=True)
class LiveOptions:
    """How a live job trains and switches. ``notice``: steps of warning before each switch;
    ``switch_timeout``: seconds a switch phase may wait; ``memory_budget``: bytes of switch state
    per device (None: no limit); ``export``: report flat states before and after each switch
    (tests); ``progress``: report each step's loss; ``big_piece``/``message_part``: see
    :mod:`.executor`; ``placement``: ``"keep"`` or ``"given"`` (see :func:`generations`);
    ``cost_model``: what the switch lowering scores promotions with; ``faults``: test hooks."""

    global_batch: int = 8
    seq_len: int = 0
    seed: int = 0
    data_seed: int = 0
    optim: OptimConfig = OptimConfig()
    data: Any = None         # a TokenData: each step's global batch from its sampler (None: synthetic)
    weights: str | None = None    # a folder of Hugging Face safetensors generation 0 starts from
    export_hf: str | None = None  # a folder the final layout writes its parameters to (Hugging Face safetensors)
    notice: int = 3
    switch_timeout: float = 60.0
    memory_budget: Any = None
    export: bool = False
    progress: bool = False
    big_piece: int = BIG
    message_part: int = CHUNK
    placement: str = "keep"
    cost_model: Any = None
    faults: "SwitchFaults | None" = None
    on_step: Any = None      # called as on_step(session, step) at every step boundary (multi-host jobs)
    snapshot_every: int = 0  # multi-host jobs: a DCP snapshot every this many steps (0: none; :mod:`..job.snapshot`)
    snapshot_dir: str = ""   # where snapshots go (a directory every host reaches)
    recover: Any = None      # recover(session, SwitchAborted) -> bool after a peer failed mid-switch (multi-host)
    device: str = "cpu"      # "cuda": state and training on this process's GPU, groups and transfers on NCCL
    ordered: Any = None      # switches issued in one global order on the device's streams (None: on NCCL only)
    strategy_for: tuple = ()  # multi-host jobs: (device count, Strategy) pairs to switch to as hosts come and go
    resume: tuple = ()       # multi-host jobs: (step, strategy, optimizer step) of the snapshot in snapshot_dir to start from
    hosts: Any = None        # multi-host jobs: hosts(store, devices) -> the host of each device id (None: one host)
    cluster: Any = None      # what prices the switches (a Cluster or its name; None: switch_cluster(device))
    promote: Any = None      # switches may use collectives (None: the cluster's default: on GPUs only)


@dataclass(frozen=True)
class Generation:
    """A layout of the live job: ``strategy`` on ``devices`` from global step ``step`` on."""

    step: int
    strategy: Strategy
    devices: tuple[int, ...]


def generations(spec: models.ModelSpec, strategy: "Strategy | str", steps: int,
                switches: list[tuple[int, "Strategy | str", "tuple[int, ...] | None"]],
                placement: str = "keep") -> list[Generation]:
    """Resolve a switch schedule: default devices keep the current ones (first ones when shrinking,
    plus the lowest free ids when growing). ``placement="keep"`` then orders each switch's devices
    (within a node) so that they keep the most state in place (:mod:`parashift.vps.placement`);
    ``"given"`` keeps the order as listed. Raises StrategyError on a bad schedule."""
    if placement not in ("keep", "given"):
        raise StrategyError(f"unknown placement {placement!r}; use 'keep' (order the devices to keep the most "
                            f"state in place) or 'given' (rank i on the i-th listed device)")
    s0 = Strategy.parse(strategy)
    s0.validate(spec)
    gens = [Generation(0, s0, tuple(range(s0.world)))]
    for step, st, devs in sorted(switches, key=lambda x: x[0]):
        st = Strategy.parse(st)
        st.validate(spec)
        if not 0 < step < steps:
            raise StrategyError(f"a switch at step {step} is outside the run (steps 1..{steps - 1}); "
                                f"switch after the first step and before the last")
        if step <= gens[-1].step:
            raise StrategyError(f"two switches at step {step}; give each switch its own step")
        cur = gens[-1].devices
        if devs is None:
            if st.world <= len(cur):
                devs = cur[:st.world]
            else:
                free = [d for d in range(max(cur) + st.world + 1) if d not in cur]
                devs = tuple(cur) + tuple(free[:st.world - len(cur)])
        devs = tuple(int(d) for d in devs)
        if len(devs) != st.world or len(set(devs)) != len(devs) or min(devs) < 0:
            raise StrategyError(f"switch at step {step}: {st} needs {st.world} distinct device ids, got {devs}")
        if placement == "keep":
            devs = place(spec, gens[-1].strategy, st, gens[-1].devices, devs)
        gens.append(Generation(step, st, devs))
    return gens


def _keys(gens: list[Generation], g: int) -> dict[int, str]:
    """Incarnation key of every participant of the switch into generation ``g``."""
    out = {}
    for d in sorted(set(gens[g - 1].devices) | set(gens[g].devices)):
        first = g if d not in gens[g - 1].devices else min(
            k for k in range(g) if all(d in gens[j].devices for j in range(k, g)))
        out[d] = f"{d}.{first}"
    return out


class LiveSession:
    """One process's side of a live job: the elastic manager, the current runtime and generation."""

    def __init__(self, ctx: ElasticContext, spec: models.ModelSpec, gens: list[Generation], opts: LiveOptions) -> None:
        self.ctx, self.spec, self.gens, self.opts = ctx, spec, gens, opts
        self.device = ctx.device
        self.timeout = float(opts.switch_timeout)
        self.torch_device, self.backend = device_setup(opts.device, ctx.device)
        self.manager = ElasticManager(ctx.store, ctx.member.key, self.timeout, self.backend, self.torch_device)
        self.pool = BufferPool(self.torch_device)
        self.ordered = opts.ordered if opts.ordered is not None else self.backend == "nccl"
        self.runtime = None
        self.gen = -1
        self.pending: dict[int, tuple[Future, float]] = {}
        self.records: list[SwitchRecord] = []
        self.rows: list[tuple] = []            # (stream, op, start, end, step)
        self.exports: dict[str, Any] = {}

    def host_map(self, devices) -> "tuple[int, ...] | None":
        """The host of each device id up to ``max(devices)`` (a multi-host job's, read from its store;
        the same on every process), or None on one host."""
        return self.opts.hosts(self.side_store(), devices) if self.opts.hosts is not None else None

    def side_store(self) -> Any:
        """A second connection to the job's store, for short calls that must not queue behind a
        blocking one of the background preparation (a world's rendezvous holds ``ctx.store``)."""
        side = getattr(self, "_side", None)
        if side is None:
            side = self._side = self.ctx.store.clone()
        return side

    # ---- background preparation ---------------------------------------------------------------------
    def announce(self, g: int) -> None:
        """Start planning switch ``g`` and building its world in the background; store keys ``sw<g>/notice``
        (the switch is announced) and ``sw<g>/noticed/<device>`` (this device took the notice: with no
        notice, its training up to the switch step is done)."""
        if g in self.pending:
            return
        self.ctx.store.set(f"sw{g}/notice", "1")
        self.ctx.store.set(f"sw{g}/noticed/{self.device}", "1")
        fut: Future = Future()
        src, dst = self.gens[g - 1], self.gens[g]
        o = self.opts

        def work() -> None:
            try:
                if self.torch_device.type == "cuda":      # the current device is per thread
                    torch.cuda.set_device(self.torch_device)
                hosts = self.host_map(src.devices + dst.devices)
                budget = o.memory_budget if o.memory_budget is not None else \
                    switch_fit(self.spec, src, dst, device=o.device, hosts=hosts)["memory_budget"]   # under its memory
                prep = prepare(self.manager, self.spec, src.strategy, dst.strategy, src.devices, dst.devices,
                               _keys(self.gens, g), self.device, global_batch=o.global_batch, seq_len=o.seq_len,
                               memory_budget=budget, cost_model=o.cost_model, hosts=hosts,
                               cluster=o.cluster or switch_cluster(o.device), promote=o.promote)
                if self.device in dst.devices:     # the destination store, faulted in while training goes on
                    t0 = time.time()            # (a staged switch's fills stage by stage: lazily allocated)
                    prep.new_store = StateStore(self.spec, dst.strategy, dst.devices.index(self.device),
                                                self.torch_device, init=False,
                                                alloc=lazy_alloc if prep.planned.staged else state_alloc)
                    if self.torch_device.type == "cuda":    # zeroed before any stream of the switch writes it
                        torch.cuda.synchronize(self.torch_device)
                    prep.alloc_seconds = time.time() - t0
                fut.set_result(prep)
            except BaseException as e:  # noqa: BLE001 - re-raised by switch()
                fut.set_exception(e)
        threading.Thread(target=work, name=f"parashift-prepare{g}", daemon=True).start()
        self.pending[g] = (fut, time.time())

    # ---- the switch ---------------------------------------------------------------------------------------
    def switch(self, g: int):
        """Switch into generation ``g`` between iterations; returns the new Runtime (None if this device
        leaves). Raises SwitchAborted, with the old layout's runtime, state and world untouched,
        when the switch fails (with every participant alive, training goes on in them)."""
        t_pause = time.time()
        src, dst = self.gens[g - 1], self.gens[g]
        rec = SwitchRecord(dst.step, str(src.strategy), str(dst.strategy), self.device,
                           joining=self.runtime is None)
        self.records.append(rec)
        prep = self._prepared(g, rec)
        if self.runtime is not None:
            self.runtime.sync_params()      # overlap_param: whole parameters before they move
        old = self.runtime.store if self.runtime is not None else None
        new, prep.new_store = prep.new_store, None      # allocated in the background by announce()
        faults = self.opts.faults
        on_received, on_issue = (faults.hooks(g, self.device, prep.planned.program) if faults is not None
                                 else (None, None))
        before = None                # (tests) a staged switch releases the old store as it goes
        if self.opts.export and old is not None:
            before = {"rank": src.devices.index(self.device), "arrays": store_arrays(old)}
        try:
            meta = execute_switch(prep, self.ctx.store, f"sw{g}/", self.device, old, new, rec, timeout=self.timeout,
                                  pool=self.pool, steps_done=self.runtime.steps_done if self.runtime else None,
                                  on_received=on_received, on_issue=on_issue, big=self.opts.big_piece,
                                  chunk=self.opts.message_part, streams=self._streams())
        except SwitchAborted as e:
            # the old layout's runtime, store and training world were never touched: with every
            # participant alive, training goes on in them; the switch's communicators are dropped
            self.pool.clear()
            rec.aborted = str(e)
            for g_ in [tuple(prep.keys[d] for d in prep.planned.participants)] + [
                    tuple(prep.keys[d] for d in grp) for grp in prep.groups]:
                self.manager.drop(g_)
            rec.pause_seconds = time.time() - t_pause
            raise
        self.pool.clear()            # no staging memory lingers while training goes on
        if before is not None:
            self.exports[f"before{g}"] = before
        t0 = time.time()
        rt = self._rebuild(g, prep, new, meta) if new is not None else None
        if rt is None:               # left the job through a verified switch: its death from now on stops nothing
            self.side_store().set(f"left/{self.device}", str(g))
        t1 = time.time()
        rec.rebuild_seconds = t1 - t0
        rec.rows.append(("switch", "rebuild", t0, t1))
        rec.pause_seconds = t1 - t_pause
        self.runtime, self.gen = rt, g       # the old store is freed with the old runtime
        return rt

    def _streams(self):
        """The device's streams for an ordered switch (every Program stream but ``pack`` on a stream
        of its own), or None for the gloo driver."""
        if not self.ordered:
            return None
        from ..streams import Streams, backend_for
        return Streams(backend_for(self.torch_device), default=("pack",))

    def _prepared(self, g: int, rec: SwitchRecord) -> Prepared:
        """Switch ``g``'s background preparation, once done (its timings go into ``rec``)."""
        self.announce(g)
        fut, _ = self.pending.pop(g)
        try:
            end = time.monotonic() + self.timeout
            while True:                  # the preparation, as soon as it is done; a participant marked dead ends the wait
                try:
                    prep: Prepared = fut.result(timeout=min(0.05, max(end - time.monotonic(), 0.0)))
                    break
                except FutureTimeout:
                    if time.monotonic() >= end:
                        raise
                gone = [d for d in _participants(self.gens, g) if self.side_store().check([f"dead/{d}"])]
                if gone:
                    raise SwitchAborted(f"switch at step {rec.step} aborted before moving anything: devices "
                                        f"{gone} were lost", "peer lost", peer_failed=True)
        except Exception as e:  # noqa: BLE001 - no world: nothing moved yet
            rec.aborted = f"preparation failed: {type(e).__name__}: {e}"
            # a refused plan (memory budget): train on in the old layout; anything else: a peer is gone
            raise SwitchAborted(f"switch at step {rec.step} aborted before moving anything: {rec.aborted}",
                                rec.aborted, peer_failed=not isinstance(e, MemoryBudgetError)) from e
        rec.plan_seconds = prep.plan_seconds
        rec.bytes_between_hosts = prep.planned.meta.bytes_inter_node
        rec.cluster = prep.planned.meta.cluster
        rec.world_seconds = prep.world_seconds + (prep.train_world_end - prep.train_world_start)
        rec.alloc_seconds = prep.alloc_seconds
        rec.rows += [("elastic", "plan", prep.world_start - prep.plan_seconds, prep.world_start),
                     ("elastic", "world", prep.world_start, prep.world_end)]
        if prep.worlds is not None:
            rec.rows.append(("elastic", "train-world", prep.train_world_start, prep.train_world_end))
        return prep

    def _rebuild(self, g: int, prep: Prepared, new: StateStore, meta: dict):
        """The new layout's Runtime: views over the new store, on the world built in the background;
        the step and optimizer counters carry over."""
        from ..runtime import Runtime
        dst = self.gens[g]
        new_rank = dst.devices.index(self.device)
        rctx = RankContext(new_rank, dst.strategy.world, self.backend, self.torch_device, None)
        rt = Runtime(prep.program, rctx, store=new, worlds=prep.worlds, data_seed=self.opts.data_seed,
                     model=self.spec, optim=self.opts.optim, timeout=self.ctx.timeout, data=self.opts.data)
        for b in new.buffers.values():
            b.step = int(meta["opt_step"])
        rt.steps_done = int(meta["steps_done"])
        if self.opts.export:
            self.exports[f"after{g}"] = {"rank": new_rank, "arrays": store_arrays(new)}
        return rt

    def switch_to(self, strategy: "Strategy | str", devices: "tuple[int, ...] | list[int] | None" = None):
        """Switch to the next scheduled generation when it matches, else (after the schedule's last
        generation) to a new one on a subset of the current devices. Returns the new Runtime, or
        None when this device leaves."""
        st = Strategy.parse(strategy)
        nxt = self.gen + 1
        cur = self.gens[self.gen]
        step = self.runtime.steps_done if self.runtime is not None else cur.step
        if nxt < len(self.gens):
            want = self.gens[nxt]
            if str(want.strategy) != str(st) or (devices is not None and tuple(devices) != want.devices):
                raise StrategyError(f"the job's next scheduled switch is to {want.strategy} on {list(want.devices)} "
                                    f"at step {want.step}, not to {st}; switch as scheduled")
            return self.switch(nxt)
        st.validate(self.spec)
        devs = tuple(int(d) for d in devices) if devices is not None else tuple(cur.devices[:st.world])
        if len(devs) != st.world or len(set(devs)) != len(devs):
            raise StrategyError(f"{st} needs {st.world} distinct devices, got {list(devs)}")
        if not set(devs) <= set(cur.devices):
            raise StrategyError(f"devices {sorted(set(devs) - set(cur.devices))} have no process in this job; "
                                f"growing needs joining processes: schedule the switch with run_live(switches=...) "
                                f"or parashift run --switch-at")
        if self.opts.placement == "keep":
            devs = place(self.spec, cur.strategy, st, cur.devices, devs, self.host_map(cur.devices + devs))
        gen = Generation(step, st, devs)
        self.gens.append(gen)
        return self.switch(len(self.gens) - 1)

    # ---- the job ----------------------------------------------------------------------------------------------
    def start(self) -> bool:
        """Join the job: generation 0 builds its runtime; a joining device waits for its switch.
        False when the job ended (or gave up the switch) before this device was needed."""
        from ..runtime import Runtime, compile_program
        m = self.ctx.member
        if m.first == 0:
            g0 = self.gens[0]
            rank = g0.devices.index(self.device)
            prog = compile_program(self.spec if not _preset(self.spec) else self.spec.name, g0.strategy,
                                   global_batch=self.opts.global_batch, seq_len=self.opts.seq_len)
            worlds = training_worlds(self.manager, [f"{d}.0" for d in g0.devices], rank, prog)
            rctx = RankContext(rank, g0.strategy.world, self.backend, self.torch_device, None)
            store = None
            if self.opts.resume:        # a restarted job: this rank's state cut from the snapshot (any layout)
                from ..job.snapshot import restore
                step, snap_st, opt = self.opts.resume
                store = restore(self.opts.snapshot_dir, self.spec, snap_st, step, g0.strategy, rank, opt)
            elif self.opts.weights:     # only this rank's boxes of the safetensors
                from ..weights import load_store
                store = load_store(self.spec, g0.strategy, rank, self.torch_device, self.opts.weights)
            self.runtime = Runtime(prog, rctx, seed=self.opts.seed, data_seed=self.opts.data_seed, model=self.spec,
                                   worlds=worlds, optim=self.opts.optim, timeout=self.ctx.timeout, store=store,
                                   data=self.opts.data)
            if self.opts.resume:
                self.runtime.steps_done = g0.step
            self.gen = 0
            return True
        g = m.first
        if not _wait_any(self.ctx.store, [f"sw{g}/notice", "job/end"], self.ctx.timeout) or \
                self.ctx.store.check(["job/end"]) and not self.ctx.store.check([f"sw{g}/notice"]):
            return False
        try:
            self.switch(g)
        except SwitchAborted:
            return False
        return True

    def train(self, steps: int) -> dict:
        """Train until ``steps`` global steps, switching on schedule; returns this process's report."""
        losses: dict[int, float] = {}
        trained: dict[int, dict] = {}      # step -> grad_norm, lr, samples (the step's sequence indices)
        error = None
        notice = self.opts.notice
        stop_switching = False
        while self.runtime is not None and self.runtime.steps_done < steps:
            step = self.runtime.steps_done
            if self.opts.on_step is not None:
                self.opts.on_step(self, step)
            nxt = self.gen + 1
            if not stop_switching and nxt < len(self.gens) and self.device in _participants(self.gens, nxt):
                if step >= self.gens[nxt].step - notice:
                    self.announce(nxt)
                if step == self.gens[nxt].step:
                    try:
                        self.switch_to(self.gens[nxt].strategy, self.gens[nxt].devices)
                    except SwitchAborted as e:
                        if e.peer_failed and self.opts.recover is not None and self.opts.recover(self, e):
                            continue           # recovered from the old layout (a lost host, :mod:`..job.recover`)
                        if e.peer_failed:
                            error = str(e)
                            break
                        stop_switching = True      # rolled back: train on in the old layout
                    continue
            t0 = time.time()
            loss, _ = self.runtime.step()
            self.rows.append(("train", "step", t0, time.time(), step))
            losses[step] = float(loss)
            rt = self.runtime
            trained[step] = {"grad_norm": rt.grad_norm, "lr": rt.lr,
                             "samples": rt.feed.indices(step) if rt.feed is not None else None}
            if self.ctx.report is not None and self.opts.progress:
                self.ctx.report((step, float(loss), self.gens[self.gen].devices, self.rows[-1][3] - t0,
                                 rt.grad_norm, rt.lr))
        snaps = getattr(self, "_snapshots", None)
        if snaps is not None and error is None:
            snaps.finish(wait=True)        # the last snapshot is on disk before the job ends (a later --resume)
        finished = self.runtime is not None and self.runtime.steps_done >= steps
        if finished and error is None and self.opts.export_hf:
            from ..weights import export_hf
            rt = self.runtime
            rt.sync_params()
            world = rt.program.strategy.world
            export_hf(rt.store, self.opts.export_hf, group=rt.worlds.get(range(world)) if world > 1 else None)
        if finished or error is not None:
            self.ctx.store.set("job/end", "1")
        out = {"device": self.device, "key": self.ctx.member.key, "losses": losses, "trained": trained,
               "error": error,
               "switches": [asdict(r) for r in self.records], "rows": self.rows,
               "final_gen": self.gen if self.runtime is not None else None,
               "groups_created": self.manager.created, "groups_reused": self.manager.reused}
        if self.opts.export:
            if self.runtime is not None:
                if error is None:
                    self.runtime.sync_params()
                self.exports["final"] = {"rank": self.runtime.ctx.rank, "arrays": store_arrays(self.runtime.store)}
            out["exports"] = self.exports
        if error is not None and self.runtime is not None:
            out["intact"] = {"rank": self.runtime.ctx.rank, "arrays": store_arrays(self.runtime.store)}
        return out


def device_setup(kind: str, device_id: int) -> tuple[torch.device, str]:
    """(torch device, backend) of a live job's process: ``"cpu"``: host memory and gloo;
    ``"cuda"``: GPU ``device_id`` modulo the GPUs this host has (made current, as NCCL needs) and
    NCCL. Raises StrategyError for an unknown kind or when CUDA is missing."""
    if kind == "cpu":
        return torch.device("cpu"), "gloo"
    i = int(device_id) % _gpus(kind)
    torch.cuda.set_device(i)
    return torch.device("cuda", i), "nccl"


def _gpus(kind: str) -> int:
    """GPUs of this host for a live job on ``kind`` (``"cuda"``); StrategyError otherwise."""
    if kind != "cuda":
        raise StrategyError(f"unknown device {kind!r} for a live job; use 'cpu' (gloo) or 'cuda' (NCCL)")
    if not torch.cuda.is_available():
        raise StrategyError("device='cuda' needs CUDA GPUs, and this machine has none; run the live job with "
                            "device='cpu'")
    return torch.cuda.device_count()


def check_gpus(gens: list[Generation], gpus: int) -> None:
    """Raise StrategyError unless every generation and every switch of a CUDA live job puts its
    processes on distinct GPUs (device ``d`` runs on GPU ``d % gpus``): NCCL refuses two ranks of a
    communicator on one GPU ("Duplicate GPU detected")."""
    for g in range(len(gens)):
        devs = sorted(_participants(gens, g) if g else set(gens[0].devices))
        gpu = [d % max(gpus, 1) for d in devs]
        if gpus < 1 or len(set(gpu)) < len(gpu):
            what = f"switch {g}" if g else "the first layout"
            raise StrategyError(f"{what} runs devices {devs} at once, but this host has {gpus} GPU(s) and NCCL "
                                f"puts one rank per GPU; use fewer devices, or device='cpu' "
                                f"(benchmarks/gpu_switch_check.py runs a switch of processes sharing a GPU)")


def _participants(gens: list[Generation], g: int) -> set[int]:
    return set(gens[g - 1].devices) | set(gens[g].devices)


def _preset(spec: models.ModelSpec) -> bool:
    try:
        return models.get(spec.name) == spec
    except Exception:  # noqa: BLE001 - a custom model
        return False


def _wait_any(store, keys: list[str], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(store.check([k]) for k in keys):
            return True
        time.sleep(0.01)
    return False


def _live_worker(ctx: ElasticContext, spec: models.ModelSpec, gens: list[Generation], steps: int,
                 opts: LiveOptions) -> dict:
    torch.manual_seed(0)
    session = LiveSession(ctx, spec, gens, opts)
    if not session.start():
        return {"device": ctx.device, "key": ctx.member.key, "losses": {}, "error": None, "switches":
                [asdict(r) for r in session.records], "rows": [], "final_gen": None, "joined": False}
    return session.train(steps)


@dataclass
class LiveResult:
    """What a live job measured: global losses per step, one entry per switch, per-process reports."""

    losses: list[float]
    switches: list[dict]
    reports: dict[str, Any] = field(repr=False)
    generations: list[Generation] = field(repr=False)
    survivability: list[dict] = field(default_factory=list, repr=False)   # multi-host jobs (:mod:`..job.recover`)
    #: a job restarted with ``--resume``: the snapshot it started from (``step``, ``strategy``); ``losses``
    #: then begin at that step
    resumed: dict | None = None
    grad_norms: list[float] = field(default_factory=list)     # global, before clipping, per step
    lrs: list[float] = field(default_factory=list)
    samples: list[list[int]] | None = None                    # each step's sequence indices (a token file)

    def timeline(self):
        """Training steps and switch phases of every process: ``device, stream, op, step, start, end``
        (seconds since the job's first row)."""
        import pandas as pd
        rows = []
        for r in self.reports.values():
            if not r:
                continue
            for stream, op, a, b, step in r["rows"]:
                rows.append((r["device"], stream, op, step, a, b))
            for sw in r["switches"]:
                for stream, op, a, b in sw["rows"]:
                    rows.append((r["device"], stream, op, sw["step"], a, b))
        df = pd.DataFrame(rows, columns=["device", "stream", "op", "step", "start", "end"])
        if len(df):
            t0 = df["start"].min()
            df["start"] -= t0
            df["end"] -= t0
        return df.sort_values(["start", "device"]).reset_index(drop=True)

    def to_chrome_trace(self, path: str) -> None:
        """Write :meth:`timeline` as a Chrome/Perfetto trace (one process per device; streams
        ``train``, ``elastic`` (background planning and world creation) and ``switch``)."""
        df = self.timeline()
        df = df.assign(rank=df["device"], id=range(len(df)), phase=[f"step {s}" for s in df["step"]],
                       microbatch=float("nan"), nbytes=0, flops=0.0)
        write_chrome_trace(df, path)

    def to_json(self) -> dict:
        out = {"losses": self.losses, "switches": self.switches,
               "devices": [list(g.devices) for g in self.generations],
               "strategies": [str(g.strategy) for g in self.generations]}
        if self.survivability:
            out["survivability"] = self.survivability
        if self.resumed:
            out["resumed"] = self.resumed
        out["grad_norm"], out["lr"] = self.grad_norms, self.lrs
        if self.samples is not None:
            out["samples"] = self.samples
        return out


def switch_cluster(device: str = "cpu", name: "str | None" = None, count: int = 8) -> Cluster:
    """The cluster whose links price a live job's switches: ``cpu-local`` for gloo processes; on
    ``device="cuda"`` the preset of the GPU named ``name`` (default: this process's GPU), found by its
    device name in :mod:`parashift.gpus`, ``count`` devices a node. A GPU the table does not know
    raises :class:`~parashift.errors.UnknownGPUError` (name the cluster with ``--switch-cluster``).
    Live planning replaces its node sizes with the job's hosts."""
    if device != "cuda":
        return get_cluster("cpu-local")
    gpu = gpus.by_device_name(torch.cuda.get_device_name(0) if name is None else name,
                              fix="name its cluster with --switch-cluster PRESET|FILE (e.g. h100-1x8:"
                                  "memory=94GB, or a JSON file of its numbers; `parashift clusters` lists the presets)")
    return get_cluster(f"{gpu.name}-1x{max(1, int(count))}")


def switch_fit(spec: models.ModelSpec, src: Generation, dst: Generation, memory_budget=None,
               device: str = "cpu", hosts: "tuple[int, ...] | None" = None) -> dict:
    """Whether the switch from ``src`` to ``dst`` fits each process's memory (on CPU this machine's
    available memory shared among the switch's processes; on ``device="cuda"`` one GPU's total
    memory, the same figure on every participant, so that all plan alike) and its staging budget:
    ``memory_budget`` when given, else chosen under that memory when one stage does not fit (see
    :func:`.live_fit`; ``hosts``: the host of each device id, None for one host)."""
    from ...units import available_memory
    from ...vps.transition import live_fit
    n = len(set(src.devices) | set(dst.devices))
    mem = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else available_memory() // n
    return live_fit(spec, src.strategy, dst.strategy, src.devices, dst.devices, mem, memory_budget, hosts)


def _summarize(gens: list[Generation], reports: dict[str, Any], spec: "models.ModelSpec | None" = None,
               memory_budget=None, device: str = "cpu", hosts: "tuple[int, ...] | None" = None) -> list[dict]:
    """One entry a switch that ran; with ``spec``, its planned fit too (``fits``, ``planned_peak_bytes``,
    ``device_memory``, ``memory_budget``, ``budget_auto``)."""
    out = []
    for g in range(1, len(gens)):
        recs = [sw for r in reports.values() if r for sw in r["switches"] if sw["step"] == gens[g].step]
        if not recs:
            continue
        aborted = next((r["aborted"] for r in recs if r["aborted"]), None)
        entry = {"step": gens[g].step, "src": str(gens[g - 1].strategy), "dst": str(gens[g].strategy),
                 "src_devices": list(gens[g - 1].devices), "dst_devices": list(gens[g].devices),
                 "seconds": max(SwitchRecord(**{k: v for k, v in r.items()}).seconds for r in recs),
                 "pause_seconds": max(r["pause_seconds"] for r in recs if not r["joining"])}
        for k in ("plan_seconds", "world_seconds", "transfer_seconds", "verify_seconds", "rebuild_seconds",
                  "alloc_seconds", "peak_bytes", "staging_peak_bytes", "released_bytes", "stages",
                  "bytes_between_hosts"):
            entry[k] = max(r[k] for r in recs)      # the slowest process's phase; the largest high-water mark
        entry["bytes_moved"] = sum(r["bytes_sent"] for r in recs)
        entry["cluster"] = next((r["cluster"] for r in recs if r["cluster"]), "")
        if spec is not None:
            fit = switch_fit(spec, gens[g - 1], gens[g], memory_budget, device, hosts)
            entry.update({"fits": fit["fits"], "planned_peak_bytes": fit["peak_bytes"],
                          "device_memory": fit["device_memory"], "memory_budget": fit["memory_budget"],
                          "budget_auto": fit["budget_auto"]})
        if aborted:
            entry["aborted"] = aborted
        out.append(entry)
    return out


def run_live(model: "str | models.ModelSpec", strategy: "str | Strategy", *, steps: int,
             switches: list[tuple[int, "Strategy | str", "tuple[int, ...] | None"]] = (), global_batch: int = 8,
             seq_len: int | None = None, seed: int = 0, data_seed: int = 0, optim: OptimConfig = OptimConfig(),
             notice: int = 3, timeout: float = 300.0, switch_timeout: float = 60.0, memory_budget=None,
             export: bool = False, faults: "SwitchFaults | None" = None, big_piece: int = BIG,
             message_part: int = CHUNK, placement: str = "keep", cost_model: Any = None,
             progress: Callable[[int, float], None] | None = None, device: str = "cpu",
             ordered: bool | None = None, cluster: "str | Cluster | None" = None,
             promote: bool | None = None, data: Any = None, weights: str | None = None, export_hf: str | None = None,
             metrics: Callable[[int, float, float, float, float], Any] | None = None) -> LiveResult:
    """Train ``model`` for ``steps`` steps, hot-switching at the scheduled steps.

    ``switches``: (step, strategy, devices or None). ``notice``: steps of warning before each switch
    (planning and world creation overlap them). ``export``: return every process's flat state
    before and after each switch (tests). ``faults``: test hooks (:class:`SwitchFaults`).
    ``big_piece``: pieces of at least this many bytes travel as messages of their own, unpacked,
    in parts of at most ``message_part`` bytes (see :mod:`.executor`). ``placement``: ``"keep"``
    orders each switch's devices (within a node) to keep the most state in place, ``"given"``
    keeps their order. ``cost_model``: what the switch lowering scores promotions with.
    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (state and training on one GPU per process, NCCL;
    written for GPUs, see the README for what has run). ``ordered``: issue each switch in one global
    order on the device's streams (the NCCL driver; default on NCCL only, True runs its CPU twin).
    ``cluster``: what prices the switches' links (default: :func:`switch_cluster` of ``device``);
    ``promote``: let switches use collectives (default: on GPU clusters only, see :func:`.lower`).
    ``data``: a :class:`~parashift.exec.train.TokenData` to train on (checked before any process starts);
    ``metrics(step, loss, seconds, grad_norm, lr)``: called as each step completes on every process.
    ``weights``: a folder of Hugging Face safetensors to start from (else initial values from ``seed``);
    ``export_hf``: a folder the last layout writes the trained parameters to, as Hugging Face safetensors.
    """
    spec = models.get(model)
    if data is not None:
        data.open(seq_len or spec.seq_len, global_batch, spec.vocab)
    if notice < 0:
        raise StrategyError(f"notice={notice} must be a number of steps >= 0 (the warning before each switch)")
    gens = generations(spec, strategy, steps, list(switches), placement)
    if device != "cpu":
        check_gpus(gens, _gpus(device))
    opts = LiveOptions(global_batch=global_batch, seq_len=seq_len or spec.seq_len, seed=seed, data_seed=data_seed,
                       optim=optim, data=data, weights=weights,
                       export_hf=os.path.abspath(export_hf) if export_hf else None, notice=notice,
                       switch_timeout=switch_timeout, memory_budget=memory_budget,
                       export=export, progress=progress is not None or metrics is not None, big_piece=big_piece,
                       message_part=message_part,
                       placement=placement, cost_model=cost_model, faults=faults, device=device, ordered=ordered,
                       cluster=get_cluster(cluster) if cluster is not None else switch_cluster(device),
                       promote=promote)
    parts: dict[int, dict[str, tuple]] = {}

    def on_report(key: str, payload: tuple) -> None:
        step, loss, devices, secs, norm, lr = payload
        got = parts.setdefault(step, {})
        got[key] = (loss, secs)
        if len(got) == len(devices):
            total, slowest = sum(x for x, _ in got.values()), max(t for _, t in got.values())
            if progress is not None:
                progress(step, total)
            if metrics is not None:
                metrics(step, total, slowest, norm, lr)
            del parts[step]
    reports = launch_elastic(_live_worker, incarnations([g.devices for g in gens]), args=(spec, gens, steps, opts),
                             timeout=timeout, allow_dead=faults is not None and faults.kills(),
                             on_report=on_report if progress or metrics else None,
                             start_key=lambda m: None if m.first == 0 else f"sw{m.first}/notice")
    losses = []
    for k in range(steps):
        shares = [r["losses"][k] for r in reports.values() if r and k in r["losses"]]
        if not shares:
            break
        losses.append(float(sum(shares)))
    trained = [next((r["trained"][k] for r in reports.values() if r and k in r.get("trained", {})), None)
               for k in range(len(losses))]
    res = LiveResult(losses, _summarize(gens, reports, spec, memory_budget, device), reports, gens)
    res.grad_norms = [t["grad_norm"] if t else float("nan") for t in trained]
    res.lrs = [t["lr"] if t else float("nan") for t in trained]
    if data is not None:
        res.samples = [t["samples"] if t else None for t in trained]
    return res


def step_times(result: LiveResult) -> list[float]:
    """Seconds of every step (the slowest process's)."""
    per: dict[int, float] = {}
    for r in result.reports.values():
        for stream, op, a, b, step in (r or {}).get("rows", []):
            if op == "step":
                per[step] = max(per.get(step, 0.0), b - a)
    return [per[k] for k in sorted(per)]
