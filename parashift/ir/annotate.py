"""Annotate a PyTorch model with regions and trace its single-device DAG on meta tensors.

``with parashift.region("layers.0.attn"):`` inside a module's ``forward`` marks a region (a no-op
unless a trace is recording, so annotated models run normally); ``annotate(module, "layers.0.mlp")``
marks a whole submodule. :func:`trace` runs the model once on meta tensors (no memory, no compute)
and returns the forward DAG (:class:`~parashift.ir.graph.Graph`): one node per region with its FLOPs
(torch's FlopCounterMode), the parameter bytes it reads, its output shape and bytes (``act``, the
estimate of what it stashes for backward); edges follow the
tensors between regions, reduced transitively, so a transformer annotated per region yields the same
chain as :func:`~parashift.ir.model_graph.model_graph` of its preset.

torch is imported only inside these functions: importing parashift.ir never loads it.
"""
from __future__ import annotations

import contextvars
import re
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import ProgramError
from .graph import DATA, Graph

__all__ = ["region", "annotate", "trace", "region_kind"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("parashift_region_recorder", default=None)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_KINDS = ("moe.route", "moe.experts", "moe.combine", "embed", "attn", "mlp", "head")


def region_kind(name: str) -> str:
    """Region kind from its name: the last known suffix (``layers.3.moe.route`` -> ``moe.route``)."""
    for k in _KINDS:
        if name == k or name.endswith("." + k):
            return k
    return "custom"


@contextmanager
def region(name: str, **tags: Any) -> Iterator[None]:
    """Mark the code inside as region ``name`` (tags: ``kind=``, ``layer=``, free-form extras)."""
    rec = _ACTIVE.get()
    if rec is None:
        yield
        return
    rec.enter(name, tags)
    try:
        yield
    finally:
        rec.exit(name)


def annotate(module: Any, name: str, **tags: Any) -> Any:
    """Mark every call of ``module`` (a torch.nn.Module) as region ``name``; returns the module."""
    def pre(_m: Any, _args: Any) -> None:
        rec = _ACTIVE.get()
        if rec is not None:
            rec.enter(name, tags)

    def post(_m: Any, _args: Any, _out: Any) -> None:
        rec = _ACTIVE.get()
        if rec is not None:
            rec.exit(name)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    return module


class _Recorder:
    """Region stack, per-region FLOPs/params/output, and tensor producers."""

    def __init__(self, param_ids: dict[int, int]) -> None:
        self.names: list[str] = []
        self.tags: list[dict] = []
        self.flops: list[float] = []
        self.params: list[int] = []
        self.seen_params: list[set] = []
        self.shape: list[tuple] = []
        self.out_bytes: list[int] = []
        self.edges: set[tuple[int, int]] = set()
        self.stack: list[int] = []
        self.start_flops: list[float] = []
        self.producer: dict[int, frozenset] = {}
        self.keep: list[Any] = []
        self.param_ids = param_ids
        self.counter: Any = None

    def enter(self, name: str, tags: dict) -> None:
        if name in self.names:
            raise ProgramError(f"region {name!r} runs twice in one forward; give every call its own name")
        self.names.append(name)
        self.tags.append(dict(tags))
        self.flops.append(0.0)
        self.params.append(0)
        self.seen_params.append(set())
        self.shape.append(())
        self.out_bytes.append(0)
        self.stack.append(len(self.names) - 1)
        self.start_flops.append(self.counter.get_total_flops())

    def exit(self, name: str) -> None:
        if not self.stack or self.names[self.stack[-1]] != name:
            raise ProgramError(f"region {name!r} closed out of order; nest regions properly")
        i = self.stack.pop()
        total = self.counter.get_total_flops() - self.start_flops.pop()
        self.flops[i] += float(total)
        for j in self.stack:  # inner regions' FLOPs are not the outer region's
            self.flops[j] -= float(total)

    def op(self, args: list, outs: list) -> None:
        cur = self.stack[-1] if self.stack else None
        srcs: set = set()
        for a in args:
            pid = self.param_ids.get(id(a))
            if pid is not None and cur is not None and pid not in self.seen_params[cur]:
                self.seen_params[cur].add(pid)
                self.params[cur] += a.numel() * a.element_size()
            srcs |= self.producer.get(id(a), frozenset())
        if cur is not None:
            for s in srcs:
                if s != cur:
                    self.edges.add((s, cur))
            prod = frozenset((cur,))
        else:
            prod = frozenset(srcs)
        for o in outs:
            self.producer[id(o)] = prod
            self.keep.append(o)
            if cur is not None:
                self.shape[cur] = tuple(o.shape)
                self.out_bytes[cur] = int(o.numel() * o.element_size())


def trace(model: Any, *inputs: Any) -> Graph:
    """Forward DAG of ``model(*inputs)`` by regions, recorded on meta tensors (model not modified)."""
    import copy

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import FlopCounterMode

    m = model
    if any(p.device.type != "meta" for p in model.parameters()):
        m = copy.deepcopy(model).to("meta")
    meta_in = [torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs]
    params = {id(p): k for k, p in enumerate(m.parameters())}
    rec = _Recorder(params)

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat_in = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
            flat_out = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            rec.op(flat_in, flat_out)
            return out

    counter = FlopCounterMode(display=False)
    rec.counter = counter
    token = _ACTIVE.set(rec)
    try:
        with torch.no_grad(), counter, _Mode():
            m(*meta_in)
    finally:
        _ACTIVE.reset(token)
    if not rec.names:
        raise ProgramError("the model ran no parashift.region; annotate its forward with "
                           "`with parashift.region(name):` or parashift.ir.annotate(submodule, name)")
    return _to_graph(rec)


def _to_graph(rec: _Recorder) -> Graph:
    n = len(rec.names)
    succ = {i: set() for i in range(n)}
    for u, v in rec.edges:
        succ[u].add(v)
    reach: dict[int, set] = {}
    for u in reversed(range(n)):  # regions run in order, so edges go forward
        r: set = set()
        for v in succ[u]:
            r |= {v} | reach.get(v, set())
        reach[u] = r
    g = Graph()
    for i, name in enumerate(rec.names):
        tags = rec.tags[i]
        kind = tags.get("kind", region_kind(name))
        lm = _LAYER.search(name)
        layer = tags.get("layer", int(lm.group(1)) if lm else (-1 if kind == "embed" else 1 << 30 if kind == "head"
                                                                  else -1))
        g.add(op="compute", phase="fwd", region=name, kind=kind, layer=int(layer), flops=rec.flops[i],
              params=int(rec.params[i]), shape=rec.shape[i], act=rec.out_bytes[i],
              nbytes=int(rec.params[i] + 2 * rec.out_bytes[i]))
    layers = [x for x in g.cols["layer"] if 0 <= x < 1 << 30]
    top = max(layers) + 1 if layers else 0
    g.cols["layer"] = [top if x == 1 << 30 else x for x in g.cols["layer"]]
    for u, v in sorted(rec.edges):
        if u < v and not any(v in reach[w] for w in succ[u] if w != v):
            g.edge(u, v, DATA)
    return g
