"""Region functions: one region's forward / backward for one micro-batch on local parameter shards.

A region reads named values from the micro-batch's activation environment (``env``: ``tokens``,
``targets``, ``h`` the residual stream, ``moe.*`` routing values) and writes its outputs there;
the backward reads output gradients from the gradient environment (``genv``) and writes input
gradients. Tensor parallelism leaves a *partial* tensor (``Rec.pending``) that the Program's TP
all-reduce sums in place before ``*_done`` finishes the region:

* fwd: attn / mlp / embed leave their row-parallel output partial; ``fwd_done`` adds the residual.
* bwd: attn / mlp / head leave the column-parallel input gradient (at the normalized input
  ``z``) partial; ``bwd_done`` back-propagates the norm and adds the residual gradient.

MoE: route (norm, router, shared expert) leaves its input gradient partial (bwd all-reduce, with
the TP-partial router/gate weight gradients appended); combine leaves its output partial (fwd
all-reduce). The EP all-to-alls between them live in the interpreter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..models import ModelSpec
from .models import Tape, apply_rope, swiglu, weight_grad

if TYPE_CHECKING:  # pragma: no cover
    from .fp8 import Fp8Gemms

__all__ = ["RegionCtx", "Rec", "KINDS", "CoreRecompute", "chain_residual", "finish_weights", "atomic_regions",
           "region_kind", "head_logit_grad", "cp_attn_pre", "cp_attn_core", "cp_attn_bwd_out", "cp_attn_bwd_core",
           "cp_attn_bwd_qkv"]


@dataclass
class RegionCtx:
    """What region code needs besides activations: shapes, TP/EP coordinates, parameters, grads."""

    spec: ModelSpec
    tp: int
    tp_rank: int
    ep: int
    ep_rank: int
    loss_scale: float                                   # 1 / tokens of the global batch
    param: Callable[[str], torch.Tensor]                # local shard of a parameter
    grad: Callable[[str], torch.Tensor]                 # local gradient accumulator of a parameter
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    chain: bool = False     # tp == 1 dense: regions of one instruction share one autograd graph
    cp: int = 1
    cp_mask: torch.Tensor | None = None   # [local queries, cp * local keys]: key position <= query position
    grad_leaf: Callable[[str], torch.Tensor] | None = None   # a parameter's gradient leaf (see ``w``)
    auto: bool = False      # the region being built uses gradient leaves (its backward is a full chain one)
    grad_fusion: bool = False   # linears' weight-gradient GEMMs accumulate into the gradient buffer
    fp8: "Fp8Gemms | None" = None   # the strategy's fp8 recipe: its GEMMs run in FP8

    def w(self, name: str) -> torch.Tensor:
        """A linear's weight: its gradient leaf when ``auto`` (a backward that accumulates into
        leaves adds its gradient in place), else the parameter."""
        return self.grad_leaf(name) if self.auto else self.param(name)

    def leaf(self, h: torch.Tensor, grad: bool) -> torch.Tensor:
        """The region's input: kept attached in chain mode, else a fresh leaf."""
        if self.chain and h.requires_grad:
            return h
        return h.detach().requires_grad_(grad)

    def sink(self, name: str, index: int | None, g: torch.Tensor) -> None:
        self.acc(name, index).add_(g)

    def acc(self, name: str, index: int | None = None) -> torch.Tensor:
        """The gradient accumulator of a parameter (of expert ``index`` when given)."""
        a = self.grad(name)
        return a if index is None else a[index]


@dataclass
class Rec:
    """One region's forward for one micro-batch (graph pieces kept for its backward)."""

    region: str
    kind: str
    layer: int
    saved: dict[str, Any] = field(default_factory=dict)   # inputs kept for recompute
    t: dict[str, Any] = field(default_factory=dict)       # graph tensors
    tape: Tape = field(default_factory=Tape)
    tape_a: Tape = field(default_factory=Tape)
    dys: list | None = None
    pending: torch.Tensor | None = None
    built: bool = False

    def drop(self) -> None:
        self.t.clear()
        self.tape.clear()
        self.tape_a.clear()
        self.dys = None
        self.pending = None


def atomic_regions(region: str, spec: ModelSpec) -> list[str]:
    """Expand a (possibly fused) region string into atomic regions in model order.

    ``"layers.2-3"`` -> the attn and mlp (or moe route/experts/combine) regions of layers 2 and 3;
    ``"embed+layers.0-1"``, ``"layers.2-3+head"`` and single regions are accepted too.
    """
    out: list[str] = []
    for part in region.split("+"):
        if part in ("embed", "head"):
            out.append(part)
            continue
        if not part.startswith("layers."):
            raise ValueError(f"unknown region {region!r}")
        rest = part[len("layers."):]
        head, _, tail = rest.partition(".")
        if tail:
            out.append(part)
            continue
        a, _, b = head.partition("-")
        for i in range(int(a), int(b or a) + 1):
            if spec.is_moe:
                out += [f"layers.{i}.attn", f"layers.{i}.moe.route", f"layers.{i}.moe.experts",
                        f"layers.{i}.moe.combine"]
            else:
                out += [f"layers.{i}.attn", f"layers.{i}.mlp"]
    return out


def region_kind(region: str) -> tuple[str, int]:
    """(kind, layer) of an atomic region; kind in KINDS."""
    if region in ("embed", "head"):
        return region, -1
    parts = region.split(".")
    return ".".join(parts[2:]), int(parts[1])


# ---------------------------------------------------------------------------------------------
# dense residual blocks (attn, mlp): h -> z = norm(h) | z -> partial p | h_out = h + sum_tp(p)
# ---------------------------------------------------------------------------------------------
def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class CoreRecompute:
    """Selective recomputation of one attention's core (softmax(QK^T)V, Megatron's
    ``--recompute-granularity selective``): the forward keeps only the core's inputs q, k, v (the rest
    of the region keeps its graph); :meth:`rebuild`, the Program's recompute instruction, re-runs the
    core with a graph that the region's backward then runs through (or rebuilds it itself)."""

    def __init__(self) -> None:
        self.ins: tuple[torch.Tensor, ...] | None = None
        self.graph: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _Core.apply(q, k, v, self)

    def rebuild(self) -> None:
        if self.ins is None:
            raise RuntimeError("a core-attention recompute ran before its forward")
        ins = tuple(t.detach().requires_grad_(True) for t in self.ins)
        with torch.enable_grad():
            self.graph = (ins, _core(*ins))


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, held):  # type: ignore[override]
        held.ins = (q.detach(), k.detach(), v.detach())
        ctx.held = held
        return _core(q, k, v)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        held = ctx.held
        if held.graph is None:
            held.rebuild()
        ins, out = held.graph
        held.graph = held.ins = None
        return (*torch.autograd.grad([out], list(ins), [do]), None)


def _qkv(c: RegionCtx, tape: Tape, z: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's query, key and value heads ``[b, heads, n, d]`` of ``z``: the QKV projection (and its
    bias, Qwen2), per-head RMS norms of q and k (Qwen3), then rotary embeddings of q and k."""
    s = c.spec
    b, n, _ = z.shape
    d, r = s.head_dim, s.heads // s.kv_heads
    groups = s.kv_heads // c.tp
    y = tape.linear(z, c.w(f"{p}.qkv.weight"), f"{p}.qkv.weight", fp8=c.fp8)
    if s.qkv_bias:
        y = tape.bias(y, c.w(f"{p}.qkv.bias"), f"{p}.qkv.bias")
    qkv = y.view(b, n, groups, r + 2, d)
    q, k, v = qkv[:, :, :, :r].reshape(b, n, groups * r, d), qkv[:, :, :, r], qkv[:, :, :, r + 1]
    if s.qk_norm:
        q = tape.norm(q, c.param(f"{p}.q_norm.weight"), f"{p}.q_norm.weight", s.norm_eps)
        k = tape.norm(k, c.param(f"{p}.k_norm.weight"), f"{p}.k_norm.weight", s.norm_eps)
    cos, sin = c.rope[0][:n], c.rope[1][:n]
    return apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)


def _attn_body(c: RegionCtx, tape: Tape, z: torch.Tensor, p: str,
               core: "CoreRecompute | None" = None) -> torch.Tensor:
    s = c.spec
    b, n, _ = z.shape
    r = s.heads // s.kv_heads
    q, k, v = _qkv(c, tape, z, p)
    k = k.repeat_interleave(r, dim=1)
    v = v.repeat_interleave(r, dim=1)
    o = (core or _core)(q, k, v)
    o = o.transpose(1, 2).reshape(b, n, -1)
    return tape.linear(o, c.w(f"{p}.out.weight"), f"{p}.out.weight", fp8=c.fp8)


def _mlp_body(c: RegionCtx, tape: Tape, z: torch.Tensor, p: str) -> torch.Tensor:
    a = swiglu(tape.linear(z, c.w(f"{p}.fc1.weight"), f"{p}.fc1.weight", fp8=c.fp8))
    return tape.linear(a, c.w(f"{p}.fc2.weight"), f"{p}.fc2.weight", fp8=c.fp8)


def _norm(c: RegionCtx, rec: Rec, h: torch.Tensor, name: str, grad: bool) -> torch.Tensor:
    """Graph A of a block: h (leaf) -> z = rms(h) * w; returns a fresh leaf for z."""
    h_leaf = c.leaf(h, grad)
    z = rec.tape_a.norm(h_leaf, c.param(name), name, c.spec.norm_eps)
    rec.t.update(h=h_leaf, z=z)
    return z if c.chain else z.detach().requires_grad_(grad)


def _block_fwd(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> None:
    p = rec.region
    h = env["h"]
    rec.saved.update(h=h)
    z = _norm(c, rec, h, f"{p}.norm.weight", grad)
    if rec.kind == "attn":
        out = _attn_body(c, rec.tape, z, p, rec.t.get("core") if grad else None)
    else:
        out = _mlp_body(c, rec.tape, z, p)
    rec.t.update(z_leaf=z, out=out)
    rec.pending = out.detach().clone() if c.tp > 1 else out.detach()


def chain_residual(rec: Rec) -> torch.Tensor:
    """Chain mode: the block's attached output ``h + out``. The row-parallel output ``out`` is then
    no longer needed (the residual add saves nothing for its backward; the weight gradient needs
    only ``out``'s gradient, which autograd captures through its graph node), so its storage is
    released, as Megatron releases a stage's output tensor once it is sent."""
    rec.t["h_out"] = rec.t["h"] + rec.t["out"]
    _release(rec.t["out"])
    return rec.t["h_out"]


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _release(t: torch.Tensor) -> None:
    """Free a graph tensor's storage, keeping its autograd node (a backward root or capture point)."""
    key = (t.dtype, t.device)
    e = _EMPTY.get(key)
    if e is None:
        e = _EMPTY[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    t.data = e


def _grad_from(root: torch.Tensor, ins: list[torch.Tensor], g: torch.Tensor) -> tuple:
    """Gradients of ``ins`` from ``root`` (possibly released) given its gradient ``g``; the engine
    checks ``g`` against the shape the root's node recorded, as ``torch.autograd.grad`` cannot."""
    return torch.autograd.Variable._execution_engine.run_backward(
        (root,), (g,), False, False, tuple(ins), True, False)


def _block_fwd_done(c: RegionCtx, rec: Rec, env: dict) -> None:
    if c.chain and "out" in rec.t:
        env["h"] = chain_residual(rec)
    else:
        env["h"] = rec.t["h"].detach() + rec.pending
        if "out" in rec.t:          # the backward's root: only its autograd node is needed
            _release(rec.t["out"])
    rec.pending = None


def _block_bwd_input(c: RegionCtx, rec: Rec, genv: dict) -> None:
    dh = genv.pop("h")
    ins = [rec.t["z_leaf"]] + rec.tape.outputs()
    grads = _grad_from(rec.t["out"], ins, dh)
    rec.t["dh_out"] = dh
    _partial_grads(c, rec, list(grads[1:]), grads[0])
    del rec.t["out"], rec.t["z_leaf"]


def _norm_bwd(c: RegionCtx, rec: Rec, dz: torch.Tensor) -> torch.Tensor:
    """The norm's input gradient; its weight's output gradient waits in ``dys_a`` for the region's
    weight-gradient phase (:func:`finish_weights`), so an input-gradient node writes no gradient."""
    ins = [rec.t["h"]] + rec.tape_a.outputs()
    grads = torch.autograd.grad([rec.t["z"]], ins, [dz], allow_unused=True)
    rec.t["dys_a"] = list(grads[1:])
    return grads[0]


def _block_bwd_done(c: RegionCtx, rec: Rec, genv: dict) -> None:
    genv["h"] = rec.t.pop("dh_out") + _norm_bwd(c, rec, _split_partial(rec))
    rec.pending = None


#: Replicated (not TP-sharded) weights whose gradients are TP-partial: the route's (they multiply
#: partial expert / shared outputs) and q/k norms (each TP rank normalizes its own heads); they ride
#: along with the region's input-gradient all-reduce.
_PARTIAL_GRAD = ("router.weight", "shared.gate", "q_norm.weight", "k_norm.weight")


def _partial_grads(c: RegionCtx, rec: Rec, dys: list, dz: torch.Tensor) -> None:
    """Set the region's weight output gradients ``dys`` and its TP-partial input gradient ``dz`` as
    ``pending``; with tp > 1 the TP-partial weight gradients (:data:`_PARTIAL_GRAD`) are computed now
    and appended to it (flat), so one all-reduce sums both (:func:`_split_partial` takes them apart)."""
    extra: list[tuple[str, torch.Tensor]] = []
    if c.tp > 1:
        live = [u for u in rec.tape.uses if u.y.requires_grad]
        for k, (u, dy) in enumerate(zip(live, dys)):
            if dy is not None and u.key[0].endswith(_PARTIAL_GRAD):
                if u.kind == "lin":
                    x = u.x.detach()
                    g = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
                else:
                    g = torch.zeros(c.param(u.key[0]).shape, dtype=dy.dtype, device=dy.device)
                    weight_grad(u, dy, lambda *_: g)
                extra.append((u.key[0], g))
                dys[k] = None
    rec.dys = dys
    if extra:
        rec.t["extra"] = [(n, g.shape) for n, g in extra]
        rec.t["dz_shape"] = dz.shape
        dz = torch.cat([dz.reshape(-1)] + [g.reshape(-1) for _, g in extra])
    rec.pending = dz


def _split_partial(rec: Rec) -> torch.Tensor:
    """The reduced input gradient of ``pending``; reduced partial weight gradients go to ``sinks``."""
    if "extra" not in rec.t:
        return rec.pending
    flat = rec.pending.reshape(-1)
    shape = rec.t.pop("dz_shape")
    n = math.prod(shape)
    dz = flat[:n].view(shape)
    for name, gshape in rec.t.pop("extra"):
        g = flat[n:n + math.prod(gshape)].view(gshape)
        n += g.numel()
        rec.t.setdefault("sinks", []).append((name, g))     # summed in by the weight-gradient phase
    return dz


# ---------------------------------------------------------------------------------------------
# context parallelism: attention over the K/V of every CP rank (gathered by the Program's cp.*.kv
# all-gather, their gradients returned to the owners by its cp.*.dkv reduce-scatter)
# ---------------------------------------------------------------------------------------------
def cp_attn_pre(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> torch.Tensor:
    """Norm, QKV projection and rope on this rank's tokens (the graph the backward and a recompute
    need); returns its K/V ``[2, b, groups, n, d]`` for the all-gathers, kept in ``saved``."""
    s, p = c.spec, rec.region
    h = env["h"]
    rec.saved.update(h=h)
    z = _norm(c, rec, h, f"{p}.norm.weight", grad)
    q, k, v = _qkv(c, rec.tape, z, p)
    rec.t.update(z_leaf=z, q=q, k=k, v=v)
    rec.saved["kv_local"] = torch.stack([k.detach(), v.detach()])
    return rec.saved["kv_local"]


def _cp_core(c: RegionCtx, q: torch.Tensor, kv_all: torch.Tensor) -> torch.Tensor:
    """Attention of local queries ``q [b, heads, n, d]`` over every rank's keys and values
    (``kv_all [cp, 2, b, groups, n, d]``, CP rank order) with the causal mask of global positions."""
    r = c.spec.heads // c.spec.kv_heads
    cp, _, b, g, n, d = kv_all.shape
    k = kv_all[:, 0].permute(1, 2, 0, 3, 4).reshape(b, g, cp * n, d).repeat_interleave(r, dim=1)
    v = kv_all[:, 1].permute(1, 2, 0, 3, 4).reshape(b, g, cp * n, d).repeat_interleave(r, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=c.cp_mask)
    return o.transpose(1, 2).reshape(b, n, -1)


def cp_attn_core(c: RegionCtx, rec: Rec, kv_all: torch.Tensor) -> None:
    """Core attention over the gathered K/V and the output projection; leaves the (TP-partial)
    output in ``pending``. Neither the gathered K/V nor the attention output are kept: the backward
    gathers the K/V again and re-runs the core (as flash attention's backward does)."""
    with torch.no_grad():
        o = _cp_core(c, rec.t["q"].detach(), kv_all)
        rec.pending = torch.matmul(o, c.param(f"{rec.region}.out.weight").t())


def cp_attn_bwd_out(c: RegionCtx, rec: Rec, genv: dict) -> None:
    """Backward of the output projection to the attention output (its weight gradient waits for
    the core's re-run output)."""
    dh = genv.pop("h")
    rec.t.update(dh_out=dh, dy_out=dh, do=torch.matmul(dh, c.param(f"{rec.region}.out.weight")))


def cp_attn_bwd_core(c: RegionCtx, rec: Rec, kv_all: torch.Tensor) -> torch.Tensor:
    """Backward of the core attention on the re-gathered K/V: keeps dq and records the output
    projection's input; returns the gradients of every rank's K/V ``[cp, 2, b, groups, n, d]`` for
    the reduce-scatter to their owners."""
    q = rec.t["q"].detach().requires_grad_(True)
    kv = kv_all.detach().requires_grad_(True)
    with torch.enable_grad():
        o = _cp_core(c, q, kv)
    dq, dkv = torch.autograd.grad([o], [q, kv], [rec.t.pop("do")])
    rec.tape.record(o.detach(), f"{rec.region}.out.weight")
    rec.t["dq"] = dq
    return dkv


def cp_attn_bwd_qkv(c: RegionCtx, rec: Rec, dkv: torch.Tensor) -> None:
    """Backward of rope and the QKV projection from dq and this rank's summed K/V gradients
    ``[2, b, groups, n, d]``; leaves the (TP-partial) input gradient at ``z`` in ``pending`` and the
    parameter uses' output gradients in ``dys`` (tape order: qkv and its bias and norms, out)."""
    t = rec.t
    outs = [t.pop("q"), t.pop("k"), t.pop("v")]
    live = rec.tape.outputs()[:-1]          # the last: the output projection, recorded by the core's backward
    grads = torch.autograd.grad(outs, [t["z_leaf"]] + live, [t.pop("dq"), dkv[0], dkv[1]], allow_unused=True)
    _partial_grads(c, rec, list(grads[1:]) + [t.pop("dy_out")], grads[0])
    del t["z_leaf"]


# ---------------------------------------------------------------------------------------------
# embed and head
# ---------------------------------------------------------------------------------------------
def _embed_fwd(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> None:
    w = c.param("embed.word")
    tok = env["tokens"]
    local = tok - c.tp_rank * w.shape[0]
    mine = (local >= 0) & (local < w.shape[0])
    idx = torch.where(mine, local, torch.zeros_like(local))
    rec.t.update(idx=idx, mine=mine)
    rec.pending = w[idx] * mine.unsqueeze(-1).to(w.dtype)


def _embed_fwd_done(c: RegionCtx, rec: Rec, env: dict) -> None:
    env["h"] = rec.pending
    rec.pending = None


def _embed_bwd_input(c: RegionCtx, rec: Rec, genv: dict) -> None:
    rec.dys = [genv.pop("h")]


def _embed_bwd_weight(c: RegionCtx, rec: Rec) -> None:
    dh = rec.dys[0]
    mine = rec.t["mine"]
    g = c.grad("embed.word")
    g.index_add_(0, rec.t["idx"][mine], dh[mine].to(g.dtype))


def _head_fwd(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> None:
    """Final norm, vocabulary-parallel logits and this rank's loss statistics (per token: local
    max, local sum of exp, local target logit), left in ``pending`` for the TP all-gather."""
    h = env["h"]
    rec.saved.update(h=h, targets=env["targets"])
    z = _norm(c, rec, h, "head.norm.weight", grad)
    out = "embed.word" if c.spec.tied else "head.out"    # tied: the embedding is the output layer (pp = 1)
    w = c.w(out)
    logits = rec.tape.linear(z, w, out)
    with torch.no_grad():
        lg = logits.detach().float()          # loss statistics in fp32 whatever the model dtype
        m = lg.amax(-1)
        se = (lg - m.unsqueeze(-1)).exp_().sum(-1)
        local = env["targets"] - c.tp_rank * w.shape[0]
        mine = (local >= 0) & (local < w.shape[0])
        idx = torch.where(mine, local, torch.zeros_like(local))
        tl = torch.gather(lg, -1, idx.unsqueeze(-1)).squeeze(-1) * mine
    rec.t.update(z_leaf=z, logits=logits, idx=idx, mine=mine)
    rec.pending = torch.stack([m, se, tl]).unsqueeze(0)      # [1, 3, b, n]


def _head_fwd_done(c: RegionCtx, rec: Rec, env: dict) -> None:
    """Finish the loss from every TP rank's statistics ``[tp, 3, b, n]``."""
    st = rec.pending
    m, se, tl = st[:, 0], st[:, 1], st[:, 2]
    big = m.max(0).values
    total = (se * torch.exp(m - big)).sum(0)
    loss = (torch.log(total) + big - tl.sum(0)).sum() * c.loss_scale
    rec.saved.update(M=big, S=total)
    env["loss"] = loss
    rec.pending = None


def _head_bwd_input(c: RegionCtx, rec: Rec, genv: dict) -> None:
    logits = rec.t["logits"]
    g = head_logit_grad(c, rec)
    (dz,) = torch.autograd.grad([logits], [rec.t["z_leaf"]], [g])
    rec.dys = [g]
    rec.pending = dz
    for k in ("logits", "z_leaf"):
        del rec.t[k]


def head_logit_grad(c: RegionCtx, rec: Rec) -> torch.Tensor:
    """d loss / d local logits: (softmax - onehot) * loss_scale, from the finished statistics."""
    logits = rec.t["logits"]
    with torch.no_grad():
        g = (logits.detach().float() - rec.saved["M"].unsqueeze(-1)).exp_().div_(rec.saved["S"].unsqueeze(-1))
        g.scatter_add_(-1, rec.t["idx"].unsqueeze(-1), -rec.t["mine"].to(g.dtype).unsqueeze(-1))
        return g.mul_(c.loss_scale).to(logits.dtype)


def _head_bwd_done(c: RegionCtx, rec: Rec, genv: dict) -> None:
    genv["h"] = _norm_bwd(c, rec, rec.pending)
    rec.pending = None


# ---------------------------------------------------------------------------------------------
# MoE (tp=1): route -> [dispatch a2a] -> experts -> [combine a2a] -> combine
# ---------------------------------------------------------------------------------------------
def _route_fwd(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> None:
    """Norm, top-k router and the (TP-sharded) shared expert; prepares the dispatch."""
    s, p = c.spec, rec.region.rsplit(".", 1)[0]
    h = env["h"]
    rec.saved.update(h=h)
    z = _norm(c, rec, h, f"{p}.norm.weight", grad)
    zf = z.reshape(-1, z.shape[-1])
    logits = rec.tape.linear(zf, c.param(f"{p}.router.weight"), f"{p}.router.weight")
    w, idx = torch.softmax(logits, -1).topk(s.top_k, dim=-1)
    if s.norm_topk:
        w = w / w.sum(-1, keepdim=True)
    order = torch.argsort(idx.reshape(-1), stable=True)
    tok = order // s.top_k
    xs = zf[tok]
    outs = {"xs": xs, "w": w}
    if s.shared_ffn:
        a = swiglu(rec.tape.linear(zf, c.param(f"{p}.shared.fc1"), f"{p}.shared.fc1", fp8=c.fp8))
        sh = rec.tape.linear(a, c.param(f"{p}.shared.fc2"), f"{p}.shared.fc2", fp8=c.fp8)
        gate = torch.sigmoid(rec.tape.linear(zf, c.param(f"{p}.shared.gate"), f"{p}.shared.gate"))
        outs["sh"] = sh * gate                        # TP-partial (row-parallel fc2)
    rec.t.update(z_leaf=z, outs=outs)
    counts = torch.bincount(idx.reshape(-1), minlength=s.experts)
    env.update({f"moe.{k}": v.detach() for k, v in outs.items()})
    env["moe.res"] = h
    env["moe.order"] = order
    env["moe.tok"] = tok
    env["moe.counts"] = counts.view(c.ep, -1)          # row j: rows sent to EP rank j, per local expert
    env["moe.recv_counts"] = env["moe.counts"]          # replaced by the dispatch all-to-all when ep > 1


def _route_bwd_input(c: RegionCtx, rec: Rec, genv: dict) -> None:
    names = list(rec.t["outs"])
    outs = [rec.t["outs"][k] for k in names]
    gouts = [genv.pop(f"moe.{k}") for k in names]
    ins = [rec.t["z_leaf"]] + rec.tape.outputs()
    grads = torch.autograd.grad(outs, ins, gouts, allow_unused=True)
    _partial_grads(c, rec, list(grads[1:]), grads[0])
    rec.t["res_grad"] = genv.pop("moe.res")
    for k in ("outs", "z_leaf"):
        del rec.t[k]


def _route_bwd_done(c: RegionCtx, rec: Rec, genv: dict) -> None:
    dz = _split_partial(rec)
    genv["h"] = rec.t.pop("res_grad") + _norm_bwd(c, rec, dz)
    rec.pending = None


def _experts_in(c: RegionCtx) -> str:
    return "moe.xr" if c.ep > 1 else "moe.xs"


def _ys(c: RegionCtx) -> str:
    return "moe.ys" if c.ep > 1 else "moe.yr"


def _experts_fwd(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> None:
    p = rec.region.rsplit(".", 1)[0]
    xin = _experts_in(c)
    x = env[xin]
    cnt = env["moe.recv_counts"]                      # [ep sources, local experts]
    rec.saved.update({xin: x, "moe.recv_counts": cnt})
    x_leaf = x.detach().requires_grad_(grad)
    n_local = cnt.shape[1]
    ids = torch.repeat_interleave(torch.arange(n_local).repeat(cnt.shape[0]), cnt.reshape(-1).cpu()).to(x.device)
    order = torch.argsort(ids, stable=True)
    per = cnt.sum(0).tolist()
    w1, w2 = c.param(f"{p}.experts.fc1"), c.param(f"{p}.experts.fc2")
    ys = []
    for e, xe in enumerate(torch.split(x_leaf[order], per)):
        a = swiglu(rec.tape.linear(xe, w1[e], f"{p}.experts.fc1", e, fp8=c.fp8))
        ys.append(rec.tape.linear(a, w2[e], f"{p}.experts.fc2", e, fp8=c.fp8))
    y = torch.cat(ys)[torch.argsort(order)]
    rec.t.update(x=x_leaf, y=y)
    env["moe.yr"] = y.detach()


def _experts_bwd_input(c: RegionCtx, rec: Rec, genv: dict) -> None:
    xin = _experts_in(c)
    dy = genv.pop("moe.yr")
    grads = torch.autograd.grad([rec.t["y"]], [rec.t["x"]] + rec.tape.outputs(), [dy], allow_unused=True)
    rec.dys = list(grads[1:])
    genv[xin] = grads[0]
    rec.t.clear()


def _combine_fwd(c: RegionCtx, rec: Rec, env: dict, grad: bool) -> None:
    keys = [_ys(c), "moe.w", "moe.sh", "moe.res", "moe.order", "moe.tok"]
    rec.saved.update({k: env[k] for k in keys if k in env})
    leaves = {"ys": env[_ys(c)].detach().requires_grad_(grad), "w": env["moe.w"].detach().requires_grad_(grad)}
    if "moe.sh" in env:
        leaves["sh"] = env["moe.sh"].detach().requires_grad_(grad)
    res = env["moe.res"]
    wf = leaves["w"].reshape(-1)[env["moe.order"]].unsqueeze(-1)
    out = torch.zeros(res.numel() // res.shape[-1], res.shape[-1], dtype=res.dtype, device=res.device)
    out = out.index_add(0, env["moe.tok"], leaves["ys"] * wf)
    if "sh" in leaves:
        out = out + leaves["sh"]
    out = out.view(res.shape)
    rec.t.update(leaves=leaves, out=out)
    rec.pending = out.detach().clone() if c.tp > 1 else out.detach()   # TP-partial until reduced


def _combine_fwd_done(c: RegionCtx, rec: Rec, env: dict) -> None:
    env["h"] = rec.saved["moe.res"] + rec.pending
    rec.pending = None


def _combine_bwd_input(c: RegionCtx, rec: Rec, genv: dict) -> None:
    dh = genv.pop("h")
    names = list(rec.t["leaves"])
    grads = torch.autograd.grad([rec.t["out"]], [rec.t["leaves"][k] for k in names], [dh], allow_unused=True)
    for k, g in zip(names, grads):
        key = _ys(c) if k == "ys" else f"moe.{k}"
        genv[key] = g if g is not None else torch.zeros_like(rec.t["leaves"][k])
    genv["moe.res"] = dh
    rec.dys = []
    rec.t.clear()


def _no_done(c: RegionCtx, rec: Rec, env: dict) -> None:
    return None


def _tape_weight(c: RegionCtx, rec: Rec) -> None:
    rec.tape.weight_grads(rec.dys or [], c.acc, c.grad_fusion)
    finish_weights(c, rec)


def finish_weights(c: RegionCtx, rec: Rec) -> None:
    """Write the weight gradients a region's input-gradient backward left for later: the norm's
    (``dys_a``, also what chain mode captures) and the route's TP-partial ones (``sinks``). The
    weight-gradient phase calls it, and a full backward once its input gradient is finished."""
    if "dys_a" in rec.t:
        rec.tape_a.weight_grads(rec.t.pop("dys_a"), c.acc, c.grad_fusion)
    for name, g in rec.t.pop("sinks", ()):
        c.sink(name, None, g)


@dataclass(frozen=True)
class Kind:
    """The functions of one region kind."""

    fwd: Callable
    fwd_done: Callable
    bwd_input: Callable
    bwd_done: Callable
    bwd_weight: Callable


KINDS: dict[str, Kind] = {
    "embed": Kind(_embed_fwd, _embed_fwd_done, _embed_bwd_input, _no_done, _embed_bwd_weight),
    "attn": Kind(_block_fwd, _block_fwd_done, _block_bwd_input, _block_bwd_done, _tape_weight),
    "mlp": Kind(_block_fwd, _block_fwd_done, _block_bwd_input, _block_bwd_done, _tape_weight),
    "head": Kind(_head_fwd, _head_fwd_done, _head_bwd_input, _head_bwd_done, _tape_weight),
    "moe.route": Kind(_route_fwd, _no_done, _route_bwd_input, _route_bwd_done, _tape_weight),
    "moe.experts": Kind(_experts_fwd, _no_done, _experts_bwd_input, _no_done, _tape_weight),
    "moe.combine": Kind(_combine_fwd, _combine_fwd_done, _combine_bwd_input, _no_done, _tape_weight),
}
