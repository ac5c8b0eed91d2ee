"""How a user model annotated with ``parashift.region`` maps onto a compiled Program's chunks.

A Program compiled from a traced model (``parashift.ir.annotate.trace`` + ``compile_graph``) places
regions on pipeline chunks (by layer, or as a ``Place`` directive says; ``StepMeta.regions``). To
execute a chunk, the runtime needs a forward that is a function of the previous chunk's output alone, so with more than one chunk (pp * vpp > 1) the model
must be a ``torch.nn.Sequential`` whose every child's regions fall in one chunk (each chunk is a
contiguous run of children, as in ``torch.distributed.pipelining``). With one chunk (DP and ZeRO)
any annotated model runs: the whole module is the chunk. Chunks sit on stages as the Program's
``StepMeta.chunk_stages`` says (uneven splits and V shapes included).

:func:`plan_user_model` finds, on meta tensors, which child runs which region, each child's chunk,
the activation shape crossing every chunk boundary, and the parameter inventory as a ModelSpec
(one dense TensorSpec per parameter, placed on its chunk) that the state store shards exactly
as ``parashift.vps.layout`` would.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import StrategyError
from ..ir.annotate import _ACTIVE as _RECORDER
from ..ir.placement import placed
from ..ir.program import Program
from ..ir.step_meta import StepMeta
from ..models import ModelSpec, TensorSpec
from ..strategy import Strategy

__all__ = ["UserPlan", "plan_user_model", "microbatch_input", "rows_of"]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class UserPlan:
    """Where each part of a user model runs under one strategy (picklable; sent to every rank).

    ``children``: per chunk, the top-level child indices it runs (``((-1,),)``: the whole module,
    one chunk). ``params``: per chunk, ``(full name, child index, name inside the child)`` of every
    parameter use (tied parameters appear once per local name). ``boundary``: per chunk, the shape
    (micro-batch rows first) and dtype name of the tensor it hands to the next chunk. ``strategy``:
    the Program's strategy with the placement of ``spec`` (layer i of ``spec`` is chunk i), which
    the state store shards parameters by.
    """

    spec: ModelSpec
    children: tuple[tuple[int, ...], ...]
    params: tuple[tuple[tuple[str, int, str], ...], ...]
    boundary: tuple[tuple[tuple[int, ...], str], ...]
    strategy: Strategy

    @property
    def chunks(self) -> int:
        return len(self.children)


class _RegionLog:
    """Stands in for the trace recorder: notes which top-level child each region runs in."""

    def __init__(self) -> None:
        self.current = -1
        self.where: dict[str, int] = {}

    def enter(self, name: str, tags: dict) -> None:
        self.where.setdefault(name, self.current)

    def exit(self, name: str) -> None:
        return None


def microbatch_input(example: Any, rows: int, device: str = "meta") -> Any:
    """``example`` (a tensor or tuple of tensors, batch dim first) resized to ``rows`` rows on ``device``."""
    if isinstance(example, torch.Tensor):
        return torch.empty((rows,) + tuple(example.shape[1:]), dtype=example.dtype, device=device)
    if isinstance(example, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in example):
        return tuple(microbatch_input(x, rows, device) for x in example)
    raise StrategyError("example_input must be a tensor or a tuple of tensors whose first dimension is the batch; "
                        "wrap other inputs in the model factory")


def rows_of(value: Any, rows: slice) -> Any:
    """Rows ``rows`` of a batch (a tensor or tuple of tensors)."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    return tuple(rows_of(v, rows) for v in value)


def _spec(model: torch.nn.Module, name: str, s: Strategy, child_chunk: list[int],
          chunks: int) -> tuple[ModelSpec, list[list[tuple[str, int, str]]]]:
    """The parameter inventory (one dense TensorSpec per parameter, chunk order) and per-chunk uses."""
    params = dict(model.named_parameters())
    ident = {id(p): n for n, p in params.items()}
    frozen = [n for n, p in params.items() if not p.requires_grad]
    if frozen:
        raise StrategyError(f"parameters {frozen[:3]} do not require grad; the runtime trains every parameter: "
                            f"register frozen tensors as buffers instead")
    dtypes = {p.dtype for p in params.values()}
    if len(dtypes) > 1 or not dtypes <= set(_DTYPES):
        raise StrategyError(f"the model's parameters have dtypes {sorted(map(str, dtypes))}; the runtime needs one "
                            f"of fp32/bf16/fp16 for all of them (call model.to(dtype) in the factory)")
    uses: list[list[tuple[str, int, str]]] = [[] for _ in range(chunks)]
    owner: dict[str, int] = {}
    if chunks == 1:
        uses[0] = [(n, -1, n) for n in params]
        owner = {n: 0 for n in params}
    else:
        for i, child in enumerate(model.children()):
            c = child_chunk[i]
            for local, p in child.named_parameters(remove_duplicate=False):
                full = ident[id(p)]
                if owner.setdefault(full, c) != c:
                    raise StrategyError(f"parameter {full!r} is used by chunks {owner[full]} and {c}; parameters "
                                        f"shared across pipeline chunks (tied weights) need pp*vpp=1")
                uses[c].append((full, i, local))
        missing = [n for n in params if n not in owner]
        if missing:
            raise StrategyError(f"parameters {missing[:3]} belong to no child of the Sequential; register them "
                                f"inside one of its blocks")
    names = sorted(params, key=lambda n: owner[n])          # stable: module order within a chunk
    dt = _DTYPES[next(iter(dtypes))] if dtypes else "fp32"
    tensors = tuple(TensorSpec(n, tuple(params[n].shape), owner[n], "custom", dtype=dt) for n in names)
    spec = ModelSpec(name=name, layers=chunks, hidden=0, heads=1, kv_heads=1, head_dim=1, ffn=0, vocab=0,
                     seq_len=0, dtype=dt, tensors=tensors)
    return spec, uses


def plan_user_model(model: torch.nn.Module, program: Program, example_input: Any, *,
                    name: str = "custom") -> UserPlan:
    """Map ``model`` onto the chunks of ``program`` (compiled from its trace by ``compile_graph``, whose
    ``StepMeta.regions`` gives every region's chunk); raises StrategyError with the fix when a chunk's
    forward cannot be cut out of the model (see module docstring)."""
    s = program.strategy
    step = StepMeta.of(program)
    if step.regions is None or step.chunk_stages is None:
        raise StrategyError(f"this program was compiled from model {step.name!r}, not traced from a user model; "
                            f"run it with parashift.exec.run_program")
    region_chunk = dict(step.regions)
    chunk_stages = step.chunk_stages
    chunks = len(chunk_stages)
    run = placed(s, range(chunks), chunk_stages) if chunks > 1 else s
    if chunks == 1:
        spec, uses = _spec(model, name, s, [0], 1)
        return UserPlan(spec, ((-1,),), (tuple(uses[0]),), (), run)
    if not isinstance(model, torch.nn.Sequential) or type(model).forward is not torch.nn.Sequential.forward:
        raise StrategyError(f"{chunks} pipeline chunks need the model to be a torch.nn.Sequential of annotated "
                            f"blocks (each pipeline chunk runs a contiguous run of its children); got "
                            f"{type(model).__name__}: wrap the blocks in nn.Sequential, or use pp=1 (dp/zero)")
    m = copy.deepcopy(model).to("meta")
    log, outs = _RegionLog(), {}
    kids = list(m.children())
    hooks = []
    for i, child in enumerate(kids):
        hooks.append(child.register_forward_pre_hook(lambda _m, _a, i=i: setattr(log, "current", i), prepend=True))
        hooks.append(child.register_forward_hook(lambda _m, _a, out, i=i: outs.__setitem__(i, out)))
    token = _RECORDER.set(log)
    try:
        with torch.no_grad():
            m(microbatch_input(example_input, s.mbs))
    finally:
        _RECORDER.reset(token)
        for h in hooks:
            h.remove()
    child_chunks: list[set] = [set() for _ in kids]
    for region, c in region_chunk.items():
        i = log.where.get(region, -1)
        if i < 0:
            raise StrategyError(f"region {region!r} runs outside the Sequential's children; annotate whole "
                                f"children (parashift.ir.annotate(block, name)) or regions inside them")
        child_chunks[i].add(c)
    split = [i for i, cs in enumerate(child_chunks) if len(cs) > 1]
    if split:
        inside = ", ".join(r for r in region_chunk if log.where.get(r) == split[0])
        raise StrategyError(f"child {split[0]} of the Sequential holds regions of chunks "
                            f"{sorted(child_chunks[split[0]])} ({inside}); a pipeline cut must fall between "
                            f"children: split that block into several children, or place its regions on one chunk")
    known = [next(iter(cs)) if cs else None for cs in child_chunks]
    prev = next((c for c in known if c is not None), 0)
    chunk_of_child = []
    for c in known:                  # region-less children (activations, reshapes) join the previous chunk
        prev = prev if c is None else c
        chunk_of_child.append(prev)
    if any(b < a for a, b in zip(chunk_of_child, chunk_of_child[1:])):
        raise StrategyError(f"the Sequential's children run chunks in the order {chunk_of_child}; regions must be "
                            f"named/layered in model order so each chunk is a contiguous run of children")
    children = tuple(tuple(i for i, c in enumerate(chunk_of_child) if c == ch) for ch in range(chunks))
    empty = [ch for ch, kids_ in enumerate(children) if not kids_]
    if empty:
        raise StrategyError(f"pipeline chunks {empty} run no child; lower pp*vpp or annotate more blocks")
    boundary = []
    for ch in range(chunks - 1):
        out = outs.get(children[ch][-1])
        if not isinstance(out, torch.Tensor):
            raise StrategyError(f"chunk {ch} ends with child {children[ch][-1]}, which returns "
                                f"{type(out).__name__}; a pipeline boundary must carry one tensor")
        boundary.append((tuple(out.shape), str(out.dtype).replace("torch.", "")))
    spec, uses = _spec(model, name, s, chunk_of_child, chunks)
    return UserPlan(spec, children, tuple(tuple(u) for u in uses), tuple(boundary), run)
