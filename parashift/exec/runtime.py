"""``exec.Runtime`` (one rank) and ``exec.run`` (compile, launch, train, collect).

``run("tiny-gpt", "dp=2,pp=2", steps=5)`` compiles the training-step Program with
``parashift.ir.compile``, starts one process per rank, trains, and returns a :class:`RunResult`
with per-step losses (the global-batch mean), step times, peak memory per rank, the measured
timeline and (on request) the final parameters as full tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import models
from ..errors import ProgramError
from ..ir.program import Program
from ..ir.step_meta import StepMeta
from ..strategy import Strategy
from .groups import Worlds
from .interpreter import Interpreter, group_keys
from .launch import RankContext, launch_local
from .models import check_supported
from .profiler import Profiler, timeline_frame
from .reference import OptimConfig, make_batch
from .state import StateStore
from .checkpoint import CheckpointOptions, Checkpointing
from .train import DataFeed, TokenData

if TYPE_CHECKING:  # pragma: no cover
    from ..data import DataPosition

__all__ = ["Runtime", "RunResult", "run", "run_program", "compile_program", "load_plan", "world_keys", "export_keys",
           "assemble_params", "StepProgress"]


def _spec(program: Program, model: "models.ModelSpec | None") -> "models.ModelSpec":
    """The model the program carries (its StepMeta); ``model``, when given, must be that model."""
    step = StepMeta.of(program)
    if model is not None and (step.model is None or model != step.model or model.tensors != step.model.tensors):
        raise ProgramError(f"the program was compiled for {step.name!r}, not the given {model.name!r} (or that "
                           f"model differs from the one it carries); leave model= out: the program carries its model")
    if step.model is None:
        raise ProgramError("this program was compiled from a traced user model: run it with "
                           "parashift.exec.run_user_model(factory, strategy, example_input=..., data=..., "
                           "loss_fn=...), which also maps the model's parameters onto the program's chunks")
    return step.model


def _check(program: Program, model: "models.ModelSpec | None" = None) -> None:
    if program.strategy is None:
        raise ProgramError("the program has no strategy; compile it with parashift.ir.compile")
    if program.meta.get("kind", "train_step") != "train_step":
        raise ProgramError(f"program kind {program.meta.get('kind')!r} is not a training step")
    check_supported(_spec(program, model), program.strategy)


class Runtime:
    """One rank's runtime: its process groups, state store and interpreter."""

    memory = True      # the CPU peak memory is tracked (``memory=False`` turns the accounting off)
    feed: "DataFeed | None" = None     # the token file's batches (None: synthetic data)

    def __init__(self, program: Program, ctx: RankContext, *, seed: int = 0, data_seed: int = 0,
                 optim: OptimConfig = OptimConfig(), timeout: float = 300.0,
                 model: "models.ModelSpec | None" = None, store: StateStore | None = None,
                 worlds: Worlds | None = None, profile: bool = True, memory: bool = True,
                 data: "TokenData | None" = None) -> None:
        """``store``: this rank's state in the program's layout (a hot switch builds it), else
        initialized from ``seed``. ``worlds``: the process groups to run on, already prepared with
        :func:`world_keys` (a live job builds them ahead), else created here. ``profile``: record
        every instruction's timing (off: no timing, no synchronization, receives posted early). ``memory``:
        track the CPU peak memory (:meth:`peak_memory`; off: no activation accounting, GPUs read the
        allocator instead). ``data``: a token file whose sampler gives each step's global batch (default:
        the synthetic :func:`~parashift.exec.reference.make_batch` at ``data_seed``)."""
        _check(program, model)
        self.program, self.ctx = program, ctx
        if program.world != ctx.world:
            raise ProgramError(f"the program has {program.world} ranks but the job has {ctx.world} processes; "
                               f"launch it with nprocs={program.world}")
        self.spec = _spec(program, model)
        self.worlds = worlds if worlds is not None else Worlds(ctx.rank, ctx.world, ctx.backend)
        self.worlds.prepare(world_keys(program))
        if store is not None and (str(store.strategy) != str(program.strategy) or store.rank != ctx.rank):
            raise ProgramError(f"the given state store holds rank {store.rank} of {store.strategy}, but this runtime "
                               f"runs rank {ctx.rank} of {program.strategy}; build the store for the program's layout")
        self.store = store if store is not None else StateStore(self.spec, program.strategy, ctx.rank, ctx.device,
                                                                seed=seed)
        self.profiler = Profiler(ctx.rank, ctx.rank)
        step = StepMeta.of(program)
        gb, seq = step.global_batch, step.seq_len
        self.memory = memory
        self.feed = data.open(seq, gb, self.spec.vocab) if data is not None else None
        batch = self.feed.batch if self.feed is not None else (lambda step: make_batch(self.spec, step, gb, seq,
                                                                                       data_seed))
        self.interp = Interpreter(program, ctx.rank, self.worlds, self.store, self.spec, ctx.device, batch, optim,
                                  self.profiler.record if profile else None, timeout,
                                  memory=memory and ctx.device.type != "cuda")
        self.steps_done = 0
        #: overlap_param: the last step left its parameter gathers to the next step's forward
        self.params_pending = False

    @property
    def grad_norm(self) -> float:
        """The global gradient norm (before clipping) of the last step."""
        return self.interp.st.grad_norm

    @property
    def lr(self) -> float:
        """The learning rate of the last step's update."""
        return self.interp.st.lr

    def data_position(self) -> "DataPosition | None":
        """Where the token stream stands after the steps done (None on synthetic data)."""
        return self.feed.position(self.steps_done) if self.feed is not None else None

    def step(self) -> tuple[float, float]:
        """One training step; returns (this rank's loss share, seconds)."""
        self.worlds.barrier()
        t0 = time.perf_counter()
        self.profiler.begin(self.steps_done, t0)
        if self.ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss = self.interp.run_step(self.steps_done)
        if self.interp.fp8 is not None:     # the step's amaxes (reduced by the Program) into the history
            self.interp.fp8.end_step()
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()
        self.steps_done += 1
        self.params_pending = self.program.strategy.overlap_param
        return loss, time.perf_counter() - t0

    def sync_params(self) -> None:
        """Finish the parameter gathers an ``overlap_param`` step leaves to the next step (a no-op
        otherwise), so that every rank holds its whole updated parameters. Collective: every rank
        calls it before the state is read outside a step (export, switch, snapshot)."""
        if self.params_pending:
            self.interp.sync_params()
            self.params_pending = False

    def peak_memory(self) -> int:
        if self.ctx.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated())
        if not self.memory:
            raise ProgramError("this runtime does not track memory; build it with memory=True to read its peak")
        return int(self.store.mem.peak)

    def gathered_parameters(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """name -> (global offsets, local values as numpy) of this rank's parameters; ZeRO-3 gathers
        each chunk's parameters from its DP group first (outside any step)."""
        from .comm import all_gather
        self.sync_params()
        s = self.program.strategy
        if s.zero_stage.gathers_around_use:
            works = []
            for fam, b in self.store.buffers.items():
                axis = "edp" if fam == "expert" and s.ep > 1 else s.zero_axis     # dp, dp x cp or shard
                members = s.group(self.ctx.rank, axis)
                g = self.worlds.get(members, "export") if len(members) > 1 else None
                for c in sorted(b.ranges):
                    copy = b.new_copy(c, "export")
                    if g is None:
                        a, e = b.ranges[c]
                        copy[:e - a] = b.param[a:e]
                        continue
                    w, then, keep = all_gather(b, c, g, copy, b.param, base=b.ranges[c][0])
                    w.wait()
                    then()
                    works.append(keep)
        out = {k: (off, v.numpy()) for k, (off, v) in self.store.local_params().items()}
        if s.zero_stage.gathers_around_use:
            self.store.release("export")
        return out


def world_keys(program: Program) -> set:
    """Every process group a Runtime of ``program`` uses: the Program's and the whole world's."""
    keys = group_keys(program)
    if program.world > 1:
        keys.add((tuple(range(program.world)), "default"))
    return keys


def export_keys(program: Program) -> set:
    """The process groups :meth:`Runtime.gathered_parameters` needs (ZeRO-3 DP groups)."""
    s = program.strategy
    keys = set()
    if s.zero_stage.gathers_around_use:
        for r in range(s.world):
            for axis in (s.zero_axis, "edp"):
                g = s.group(r, axis)
                if len(g) > 1:
                    keys.add((tuple(sorted(g)), "export"))
    return keys


def _train_job(ctx: RankContext, program_json: dict, steps: int, opts: dict) -> dict:
    """What every rank runs under :func:`run_program`."""
    torch.manual_seed(0)
    program = Program.from_json(program_json)
    ckpt = Checkpointing(opts.get("checkpoint"), _spec(program, opts.get("model")), program.strategy, ctx.rank,
                         opts.get("optim"))
    store, start = ckpt.start(ctx.device)       # --resume: this rank's state cut from the checkpoint
    if store is None and opts.get("weights"):
        from .weights import load_store      # only this rank's boxes of the safetensors
        store = load_store(_spec(program, opts.get("model")), program.strategy, ctx.rank, ctx.device, opts["weights"])
    rt = Runtime(program, ctx, seed=opts.get("seed", 0), data_seed=opts.get("data_seed", 0),
                 optim=OptimConfig(**opts.get("optim", {})), timeout=opts.get("timeout", 300.0),
                 model=opts.get("model"), profile=opts.get("profile", True), memory=opts.get("memory", True),
                 store=store, data=opts.get("data"))
    rt.worlds.prepare(export_keys(program))
    rt.steps_done = start
    losses, times, norms, lrs, samples = [], [], [], [], []
    for _ in range(start, steps):
        step = rt.steps_done
        loss, dt = rt.step()
        losses.append(loss)
        times.append(dt)
        norms.append(rt.grad_norm)
        lrs.append(rt.lr)
        if rt.feed is not None:
            samples.append(rt.feed.indices(step))
        if opts.get("progress") and ctx.report is not None:
            ctx.report((step, loss, dt, rt.grad_norm, rt.lr))     # the step number (a resumed run starts late)
        ckpt.after_step(rt)
    pos = rt.data_position()
    out = {"rank": ctx.rank, "losses": losses, "step_times": times, "grad_norms": norms, "lrs": lrs,
           "samples": samples, "data_position": pos.to_dict() if pos is not None else None,
           "checkpoint": ckpt.finish(rt), "start": start,
           "peak_memory": rt.peak_memory() if opts.get("memory", True) else None,
           "timeline": rt.profiler.rows if opts.get("profile", True) else []}
    if opts.get("params"):
        out["params"] = rt.gathered_parameters()
    return out


@dataclass
class RunResult:
    """What a run measured."""

    program: Program
    losses: list[float]
    step_times: list[float]
    peak_memory: list[int]
    rows: list[tuple] = field(default_factory=list, repr=False)
    params: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    grad_norms: list[float] = field(default_factory=list)     # global, before clipping
    lrs: list[float] = field(default_factory=list)
    samples: list[list[int]] | None = field(default=None, repr=False)   # sequence indices per step (--data)
    data_position: dict | None = None
    first_step: int = 0                 # the step the run started at (a resumed run's checkpoint step)
    checkpoint: dict = field(default_factory=dict)      # what was saved, resumed and exported

    @property
    def strategy(self) -> str:
        return str(self.program.strategy)

    @property
    def nprocs(self) -> int:
        return self.program.world

    @property
    def step(self) -> StepMeta:
        """The training step that ran (the Program's typed metadata)."""
        return StepMeta.of(self.program)

    def to_frame(self, step: int | None = None):
        """The measured timeline (TIMELINE_COLUMNS) of ``step`` (default: the last step)."""
        return timeline_frame(self.rows, step)

    def to_chrome_trace(self, path: str, step: int | None = None) -> None:
        from ..traces.chrome import write_chrome_trace
        write_chrome_trace(self.to_frame(step), path)

    @property
    def tokens(self) -> int | None:
        """Tokens one step trains on (global batch x sequence length; None for a model without sequences)."""
        return self.step.global_batch * self.step.seq_len if self.step.seq_len else None

    def to_json(self) -> dict:
        out = {"losses": self.losses, "step_times": self.step_times, "peak_memory": self.peak_memory,
               "strategy": self.strategy, "nprocs": self.nprocs, "model": self.step.name,
               "schedule": self.step.schedule, "grad_norm": self.grad_norms, "lr": self.lrs,
               "tokens": [self.tokens] * len(self.losses)}
        if self.samples is not None:
            out["samples"] = self.samples
            out["data_position"] = self.data_position
        out.update({"first_step": self.first_step} if self.first_step else {})
        out.update(self.checkpoint)
        return out


def assemble_params(spec, parts: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from the ranks' ``gathered_parameters`` (name -> (offsets, values)); NaN where none held."""
    out = {t.name: torch.full(t.shape, float("nan")) for t in spec.tensors}
    for part in parts:
        for name, (off, val) in part.items():
            box = tuple(slice(o, o + n) for o, n in zip(off, val.shape))
            out[name][box] = torch.from_numpy(val)
    return out


def compile_program(model: "str | models.ModelSpec", strategy: "str | Strategy", *, global_batch: int,
                    seq_len: int) -> Program:
    """``parashift.ir.compile`` with the runtime's checks."""
    from ..ir.compile import compile as ir_compile
    program = ir_compile(model, Strategy.parse(strategy), global_batch=global_batch, seq_len=seq_len)
    _check(program, model if isinstance(model, models.ModelSpec) else None)
    return program


class StepProgress:
    """Sums the ranks' per-step reports and calls ``fn(step, loss, seconds)`` once a step is complete;
    ``metrics(step, loss, seconds, grad_norm, lr)`` too when the ranks report those."""

    def __init__(self, world: int, fn: Callable[[int, float, float], None] | None,
                 metrics: Callable[[int, float, float, float, float], Any] | None = None) -> None:
        self.world, self.fn, self.metrics = world, fn, metrics
        self.parts: dict[int, list[tuple]] = {}

    def __call__(self, rank: int, payload: tuple) -> None:
        step, loss, dt, *rest = payload
        got = self.parts.setdefault(step, [])
        got.append((loss, dt, *rest))
        if len(got) == self.world:
            total, secs = sum(x[0] for x in got), max(x[1] for x in got)
            if self.fn is not None:
                self.fn(step, total, secs)
            if self.metrics is not None and rest:
                self.metrics(step, total, secs, *rest)
            del self.parts[step]


def run_program(program: Program, *, steps: int = 1, seed: int = 0, data_seed: int = 0,
                optim: OptimConfig = OptimConfig(), params: bool = False, profile: bool = True,
                memory: bool = True, timeout: float = 300.0, backend: str | None = None,
                progress: Callable[[int, float, float], None] | None = None,
                model: "models.ModelSpec | None" = None, weights: str | None = None,
                data: TokenData | None = None,
                metrics: Callable[[int, float, float, float, float], Any] | None = None,
                checkpoint: CheckpointOptions | None = None) -> RunResult:
    """Execute a compiled training-step Program on ``program.world`` local processes.

    The program carries its model, batch and sequence length (:class:`~parashift.ir.step_meta.StepMeta`);
    nothing else is needed. ``progress(step, loss, seconds)`` is called in this process as each step
    completes on all ranks, and ``metrics(step, loss, seconds, grad_norm, lr)`` (a
    :class:`~parashift.exec.metrics.MetricsLog`) too; ``model``: optional, checked to be the model the
    program carries; ``memory`` off: no peak memory (``peak_memory`` is empty) and no accounting cost;
    ``weights``: a folder of Hugging Face ``*.safetensors`` to start from (else initial values from
    ``seed``); ``data``: train on a token file (checked here, before any process starts);
    ``checkpoint``: save, resume (then ``steps`` counts from step 0 and the run trains the steps after
    the checkpoint's) and export.
    """
    _check(program, model)
    if weights:
        from .hf import check_convertible
        check_convertible(_spec(program, model))
    if data is not None:
        data.open(StepMeta.of(program).seq_len, StepMeta.of(program).global_batch, _spec(program, model).vocab)
    if checkpoint is not None:
        checkpoint.check(_spec(program, model), steps, data, StepMeta.of(program).global_batch,
                         StepMeta.of(program).seq_len)
    opts = {"seed": seed, "data_seed": data_seed, "optim": optim.__dict__, "params": params, "profile": profile,
            "memory": memory, "timeout": timeout, "progress": progress is not None or metrics is not None,
            "model": model, "weights": weights, "data": data,
            "checkpoint": checkpoint}
    outs = launch_local(_train_job, program.world, args=(program.to_json(), steps, opts), timeout=timeout,
                        backend=backend, on_report=StepProgress(program.world, progress, metrics)
                        if progress or metrics else None,
                        gather=True)
    outs = [o for o in outs if o is not None]
    ran = len(outs[0]["losses"])
    losses = [float(sum(o["losses"][k] for o in outs)) for k in range(ran)]
    times = [max(o["step_times"][k] for o in outs) for k in range(ran)]
    rows = [r for o in outs for r in o["timeline"]]
    spec = _spec(program, model)
    first = min(outs, key=lambda o: o["rank"])
    if data is not None and any(o["samples"] != first["samples"] for o in outs):
        raise ProgramError("the ranks trained on different sequences; the sampler must not depend on the rank")
    return RunResult(program, losses, times, [o["peak_memory"] for o in outs if o["peak_memory"] is not None], rows,
                     assemble_params(spec, [o["params"] for o in outs]) if params else None,
                     first["grad_norms"], first["lrs"], first["samples"] if data is not None else None,
                     first["data_position"], first_step=first["start"], checkpoint=first["checkpoint"])


def run(model: "str | models.ModelSpec", strategy: "str | Strategy", *, steps: int = 1, global_batch: int = 8,
        seq_len: int | None = None, **kw: Any) -> RunResult:
    """Compile ``model`` under ``strategy`` and train it for ``steps`` steps on local processes."""
    spec = models.get(model)
    seq_len = seq_len or spec.seq_len
    return run_program(compile_program(spec, strategy, global_batch=global_batch, seq_len=seq_len),
                       steps=steps, model=None if isinstance(model, str) else spec, **kw)


def load_plan(path: str) -> Program:
    """A deploy plan file (a saved Program with its model and strategy in meta)."""
    program = Program.load(path)
    _check(program)
    return program




