"""Run a user's torch model annotated with ``parashift.region`` under dp / pp / vpp / ZeRO.

``run_user_model(factory, "dp=2,pp=2", example_input=x, data=batches, loss_fn=F.mse_loss, steps=5)``
builds the model with ``factory()`` (under ``torch.manual_seed(seed)``, the same on every rank),
traces it (``parashift.ir.annotate.trace``) with one micro-batch of ``example_input``, compiles the
training step (``parashift.ir.compile_graph``), and executes that Program on local processes:

* parameters live in the state store's flat buffers (ZeRO-1/2/3 shards as ``vps.layout`` says);
  each chunk's forward is ``torch.func.functional_call`` of its children with views into them;
* ``data(step) -> (inputs, targets)`` returns the *global* batch of a step (batch dim first);
  micro-batch ``mb`` of DP rank ``d`` trains on its rows as for the presets;
* ``loss_fn(output, targets)`` must be a mean over the batch rows (e.g. ``F.mse_loss``,
  ``F.cross_entropy``): the step's loss is the mean of the micro-batch losses, which equals
  ``loss_fn`` on the whole global batch, so a single-process ``torch.optim.AdamW`` run of the same
  model, data and hyper-parameters (:class:`OptimConfig`) is the reference;
* ``factory``, ``data`` and ``loss_fn`` are sent to the ranks: module-level functions (or other
  picklable callables).

``directives=[...]`` (``parashift.directives``: Place, Replicate, Shard, Split, Order, Stream,
Recompute) refine the strategy; the one compiled Program is what runs and what ``result.program``
hands to the simulator. Tensor and expert parallelism need to know how a region shards, which only
the preset models describe: ``tp``/``ep`` > 1 raise StrategyError. With pp*vpp > 1 the model must be an
``nn.Sequential`` whose children hold whole regions (see :mod:`parashift.exec.user_plan`).
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.func import functional_call

from ..errors import StrategyError
from ..ir.program import Instr, Program
from ..strategy import Strategy
from .groups import Worlds
from .interpreter import Interpreter
from .launch import RankContext, launch_local
from .profiler import Profiler, tensor_bytes
from .reference import OptimConfig, microbatch_rows
from .runtime import RunResult, Runtime, StepProgress, assemble_params, export_keys, world_keys
from .state import StateStore
from .user_plan import UserPlan, microbatch_input, plan_user_model, rows_of

__all__ = ["UserModel", "load_user_model", "compile_user_model", "run_user_model", "UserRuntime"]


@dataclass(frozen=True)
class UserModel:
    """Everything a user-model run needs besides the strategy (what ``parashift run --model MODULE:NAME``
    loads): the model factory, one example input batch, ``data(step)`` and the loss (module docstring)."""

    factory: Callable[[], torch.nn.Module]
    example_input: Any
    data: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable
    name: str = "custom"


def load_user_model(ref: str) -> UserModel:
    """The :class:`UserModel` named ``"package.module:NAME"`` (the current directory is importable)."""
    mod, _, attr = ref.partition(":")
    if not mod or not attr:
        raise StrategyError(f"user model {ref!r} is not MODULE:NAME (e.g. mymodels:job, a parashift.exec.UserModel)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise StrategyError(f"cannot load user model {ref!r}: {e}; run from the directory holding the module "
                            f"or install it") from e
    if not isinstance(obj, UserModel):
        raise StrategyError(f"{ref} is a {type(obj).__name__}, not a parashift.exec.UserModel(factory, "
                            f"example_input, data, loss_fn)")
    return obj


class _Fixed:
    """A factory returning copies of one module (picklable when the module is)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self) -> torch.nn.Module:
        import copy
        return copy.deepcopy(self.module)


def _factory(model_or_builder: Any) -> Callable[[], torch.nn.Module]:
    if isinstance(model_or_builder, torch.nn.Module):
        return _Fixed(model_or_builder)
    if not callable(model_or_builder):
        raise StrategyError(f"{model_or_builder!r} is neither a torch.nn.Module nor a function building one")
    return model_or_builder


def compile_user_model(model_or_builder: Any, strategy: "str | Strategy" = "dp=1", *, example_input: Any = None,
                       global_batch: int, name: str = "custom", seed: int = 0, directives: Sequence = (),
                       order: Any = None) -> tuple[Program, UserPlan]:
    """Trace the model and compile its training step under ``strategy`` refined by ``directives``
    (:mod:`parashift.directives`; ``order``: an Order, its text per stage, or ``(strategy, m) -> Order``):
    (Program, UserPlan). The Program is what the simulator and the runtime both take. A
    :class:`UserModel` brings its example input."""
    if isinstance(model_or_builder, UserModel) and example_input is None:
        example_input = model_or_builder.example_input
    if example_input is None:
        raise StrategyError("compile_user_model needs example_input= (one batch, batch dimension first) or a "
                            "parashift.exec.UserModel that brings it")
    from ..ir.annotate import trace
    from ..ir.compile_graph import compile_graph
    from ..ir.ordering import Order
    s = Strategy.parse(strategy)
    if s.tp > 1 or s.ep > 1:
        raise StrategyError(f"a user model runs with dp, pp, vpp, zero, any schedule and recompute; tp={s.tp}, "
                            f"ep={s.ep} need a preset model (tiny-gpt, tiny-moe, parashift.models.gpt/moe) whose "
                            f"regions say how they shard: use tp=1, ep=1")
    if isinstance(order, Mapping):
        order = Order(order)
    if isinstance(model_or_builder, UserModel):
        name = model_or_builder.name if name == "custom" else name
        model_or_builder = model_or_builder.factory
    torch.manual_seed(seed)
    model = _factory(model_or_builder)()
    # trace one micro-batch: Split/Replicate directives may change mbs, so resolve them first
    from ..ir.user_directives import resolve
    rows = resolve([d for d in directives if type(d).__name__ in ("Split", "Replicate", "Shard")], s, [],
                   global_batch=global_batch, param_regions=[]).strategy.mbs if directives else s.mbs
    graph = trace(model, microbatch_input(example_input, rows))
    program = compile_graph(graph, s, global_batch=global_batch, name=name, directives=tuple(directives),
                            order=order)
    return program, plan_user_model(model, program, example_input, name=name)


class UserInterpreter(Interpreter):
    """The Program interpreter with a user model's chunks as compute (communication is inherited)."""

    def __init__(self, program: Program, rank: int, worlds: Worlds, store: StateStore, plan: UserPlan,
                 model: torch.nn.Module, device: torch.device, batch: Callable[[int], tuple[Any, Any]],
                 loss_fn: Callable, optim: OptimConfig, record: Callable | None, timeout: float) -> None:
        self.plan, self.model, self.loss_fn = plan, model, loss_fn
        super().__init__(program, rank, worlds, store, plan.spec, device, batch, optim, record, timeout)

    def _init_model(self) -> None:
        self.kids = list(self.model.children())
        self.scale = self.strategy.mbs / self.gb      # micro-batch losses average to the global-batch mean
        self.rc = {(i.chunk, i.microbatch) for i in self.rp.instrs() if i.phase == "recompute"}

    def _atoms_of(self, region: str) -> list[str]:
        return [region]

    def _recv_buffer(self, chunk: int) -> torch.Tensor:
        shape, dtype = self.plan.boundary[chunk]
        return torch.empty((self.strategy.mbs,) + tuple(shape[1:]), dtype=getattr(torch, dtype), device=self.device)

    def _rows(self, mb: int) -> slice:
        return microbatch_rows(self.gb, self.strategy.dp, self.coords["dp"], self.strategy.mbs, mb)

    def _to(self, x: Any) -> Any:
        return x.to(self.device) if isinstance(x, torch.Tensor) else tuple(self._to(v) for v in x)

    def _run_chunk(self, c: int, x: Any, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
        """Chunk ``c``'s forward on input ``x`` with parameters ``leaves`` (full name -> tensor)."""
        args = x if isinstance(x, tuple) else (x,)
        if self.plan.children[c] == (-1,):
            return functional_call(self.model, {loc: leaves[full] for full, _, loc in self.plan.params[c]}, args)
        for i in self.plan.children[c]:
            ps = {loc: leaves[full] for full, j, loc in self.plan.params[c] if j == i}
            args = (functional_call(self.kids[i], ps, args),)
        return args[0]

    def _compute(self, ins: Instr) -> None:
        ph, c, mb = ins.phase, ins.chunk, ins.microbatch
        if ph == "optim":
            super()._compute(ins)        # the shared optimizer phase: global norm, clipping, rate, AdamW
            return
        if self.strategy.zero_stage.gathers_around_use:
            self.store.active[c] = f"z3.c{c}.{'fwd' if ph == 'fwd' else 'bwd'}.m{mb}"
        if ph == "fwd":
            x = self._to(rows_of(self.tokens, self._rows(mb))) if c == 0 else self.st.act.pop((c - 1, mb))
            self.st.recs[(c, mb)] = {"x": x}
            self._forward(c, mb, grad=(c, mb) not in self.rc and not self.strategy.zero_stage.gathers_around_use)
        elif ph == "recompute":
            self._forward(c, mb, grad=True)
        elif ph in ("bwd", "bwd_input", "bwd_weight"):
            if self.strategy.zero_stage.gathers_around_use and not self.st.recs[(c, mb)]["out"].requires_grad:
                self._forward(c, mb, grad=True)    # rebuild the graph on the backward's gathered parameters
            self._backward(c, mb, ph)
        else:
            raise RuntimeError(f"unknown compute phase {ph!r}")

    def _forward(self, c: int, mb: int, grad: bool) -> None:
        """Chunk ``c``'s forward of micro-batch ``mb`` (a recompute rebuilds the graph from the kept input)."""
        rec = self.st.recs[(c, mb)]
        x = rec["x"]
        if c > 0:
            x = x.detach().requires_grad_(grad)
        leaves = {full: self.store.param(full).detach().requires_grad_(grad) for full, _, _ in self.plan.params[c]}
        last = c == self.plan.chunks - 1
        cuda = [self.device] if self.device.type == "cuda" else []
        if "rng" not in rec:                       # a rebuild replays the forward's random numbers (dropout)
            rec["rng"] = (torch.random.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda])
        with torch.random.fork_rng(devices=cuda), torch.set_grad_enabled(grad):
            torch.random.set_rng_state(rec["rng"][0])
            for d, state in zip(cuda, rec["rng"][1]):
                torch.cuda.set_rng_state(state, d)
            out = self._run_chunk(c, x, leaves)
            if last:
                out = self.loss_fn(out, self._to(rows_of(self.targets, self._rows(mb)))) * self.scale
        if "out" not in rec:                       # the first forward hands its result on
            if last:
                self.st.loss += float(out.detach())
            else:
                self.st.act[(c, mb)] = out.detach()
        rec.update(xin=x, leaves=leaves, out=out)
        self.store.mem.alloc(f"act:{c}:{mb}", tensor_bytes([x, out]))

    def _backward(self, c: int, mb: int, ph: str) -> None:
        rec = self.st.recs[(c, mb)]
        out = rec.get("out")
        if out is None or not out.requires_grad:
            raise RuntimeError(f"backward of chunk {c}, micro-batch {mb} has no graph: its forward ran without "
                               f"one and no recompute instruction rebuilt it")
        if "gout" not in rec:
            rec["gout"] = None if c == self.plan.chunks - 1 else self.st.gout.pop((c, mb))
        gout, xin = rec["gout"], rec["xin"]
        want_x = c > 0 and ph in ("bwd", "bwd_input")
        names = list(rec["leaves"]) if ph in ("bwd", "bwd_weight") else []
        ins = ([xin] if want_x else []) + [rec["leaves"][n] for n in names]
        if ins:
            grads = torch.autograd.grad([out], ins, None if gout is None else [gout], allow_unused=True,
                                        retain_graph=ph == "bwd_input")
            if want_x:
                self.st.gout[(c - 1, mb)] = grads[0] if grads[0] is not None else torch.zeros_like(xin)
            for n, g in zip(names, grads[1:] if want_x else grads):
                if g is not None:
                    self.store.grad(n).add_(g)
        if ph != "bwd_input":
            del self.st.recs[(c, mb)]
            self.store.mem.free(f"act:{c}:{mb}")


class UserRuntime(Runtime):
    """One rank's runtime for a user model (step, peak memory and parameter export as :class:`Runtime`)."""

    def __init__(self, program: Program, plan: UserPlan, model: torch.nn.Module, ctx: RankContext, *,
                 data: Callable[[int], tuple[Any, Any]], loss_fn: Callable, optim: OptimConfig = OptimConfig(),
                 timeout: float = 300.0, profile: bool = True) -> None:
        if program.world != ctx.world:
            raise StrategyError(f"the program has {program.world} ranks but the job has {ctx.world} processes; "
                                f"launch it with nprocs={program.world}")
        self.program, self.ctx, self.spec = program, ctx, plan.spec
        self.worlds = Worlds(ctx.rank, ctx.world, ctx.backend)
        self.worlds.prepare(export_keys(program) | world_keys(program))
        self.store = StateStore(plan.spec, plan.strategy, ctx.rank, ctx.device, init=False)
        values = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        for b in self.store.buffers.values():
            b.load(values)
        for p in model.parameters():           # the store holds the values now; drop the module's copies
            p.data = torch.empty(0, dtype=p.dtype, device=ctx.device)
        model.to(ctx.device)
        self.profiler = Profiler(ctx.rank, ctx.rank)
        self.interp = UserInterpreter(program, ctx.rank, self.worlds, self.store, plan, model, ctx.device, data,
                                      loss_fn, optim, self.profiler.record if profile else None, timeout)
        self.steps_done = 0
        self.params_pending = False     # overlap_param: set by each step, see Runtime.sync_params


def _pack(objs: tuple) -> tuple[list[str], bytes]:
    """The user's callables pickled with the launcher's import path: a worker process imports their
    modules (one written next to a notebook, the current directory) wherever it was started."""
    import pickle
    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path], pickle.dumps(objs)


def _unpack(packed: tuple[list[str], bytes]) -> tuple:
    import pickle
    paths, blob = packed
    sys.path.extend(p for p in paths if p not in sys.path)
    return pickle.loads(blob)


def _user_job(ctx: RankContext, program_json: dict, plan: UserPlan, packed: tuple[list[str], bytes], steps: int,
              opts: dict) -> dict:
    """What every rank runs under :func:`run_user_model`."""
    factory, data, loss_fn = _unpack(packed)
    torch.manual_seed(opts["seed"])
    model = factory()
    program = Program.from_json(program_json)
    rt = UserRuntime(program, plan, model, ctx, data=data, loss_fn=loss_fn, optim=OptimConfig(**opts["optim"]),
                     timeout=opts["timeout"], profile=opts["profile"])
    losses, times, norms, lrs = [], [], [], []
    for _ in range(steps):
        loss, dt = rt.step()
        losses.append(loss)
        times.append(dt)
        norms.append(rt.grad_norm)
        lrs.append(rt.lr)
        if opts["progress"] and ctx.report is not None:
            ctx.report((len(losses) - 1, loss, dt))
    out = {"losses": losses, "step_times": times, "peak_memory": rt.peak_memory(), "grad_norms": norms, "lrs": lrs,
           "timeline": rt.profiler.rows if opts["profile"] else []}
    if opts["params"]:
        out["params"] = rt.gathered_parameters()
    return out


def run_user_model(model_or_builder: Any, strategy: "str | Strategy" = "dp=1", *, directives: Sequence = (),
                   order: Any = None, example_input: Any = None, data: Callable[[int], tuple[Any, Any]] | None = None,
                   loss_fn: Callable | None = None, steps: int = 1, global_batch: int = 8, name: str = "custom",
                   seed: int = 0, optim: OptimConfig = OptimConfig(), params: bool = False, profile: bool = True,
                   timeout: float = 300.0, backend: str | None = None,
                   progress: Callable[[int, float, float], None] | None = None) -> RunResult:
    """Train a user model for ``steps`` steps on local processes (module docstring).

    ``model_or_builder``: a :class:`UserModel` (which brings its example input, data and loss), a
    function building the module, or the module itself. ``strategy`` refined by ``directives``
    (``parashift.directives``: Place, Replicate, Shard, Split, Order, Stream, Recompute) and
    ``order`` is compiled once (:func:`compile_user_model`); that Program is what runs, and
    ``result.program`` is what ``parashift.sim.simulate`` takes. Returns a RunResult: per-step
    global-batch losses, step times, peak memory per rank, the measured timeline and, with
    ``params=True``, the final parameters by ``named_parameters`` name.
    """
    if isinstance(model_or_builder, UserModel):
        um = model_or_builder
        example_input = um.example_input if example_input is None else example_input
        data, loss_fn = data or um.data, loss_fn or um.loss_fn
        name = um.name if name == "custom" else name
        model_or_builder = um.factory
    if example_input is None or data is None or loss_fn is None:
        raise StrategyError("run_user_model needs example_input=, data= and loss_fn= (or a parashift.exec.UserModel "
                            "that brings them)")
    factory = _factory(model_or_builder)
    program, plan = compile_user_model(factory, strategy, example_input=example_input, global_batch=global_batch,
                                       name=name, seed=seed, directives=directives, order=order)
    opts = {"seed": seed, "optim": optim.__dict__, "params": params, "profile": profile, "timeout": timeout,
            "progress": progress is not None}
    outs = launch_local(_user_job, program.world, args=(program.to_json(), plan, _pack((factory, data, loss_fn)), steps,
                                                       opts),
                        timeout=timeout, backend=backend,
                        on_report=StepProgress(program.world, progress) if progress else None, gather=True)
    outs = [o for o in outs if o is not None]
    losses = [float(sum(o["losses"][k] for o in outs)) for k in range(steps)]
    times = [max(o["step_times"][k] for o in outs) for k in range(steps)]
    rows = [r for o in outs for r in o["timeline"]]
    return RunResult(program, losses, times, [o["peak_memory"] for o in outs], rows,
                     assemble_params(plan.spec, [o["params"] for o in outs]) if params else None,
                     outs[0]["grad_norms"], outs[0]["lrs"])

