"""State store: one rank's parameters, gradients and optimizer states in flat buffers.

Each (chunk, dense|expert) group of tensors this rank holds is one flat buffer: the local
(TP/EP-sharded) boxes concatenated in model order, padded to a multiple of the DP group size
(``dp x cp`` for dense tensors, ``edp`` for experts). ZeRO-k shards those flat buffers evenly over
the group: stage 1 the optimizer states (and master), 2 also gradients, 3 also parameters.
The model's parameters are views into the store.

ZeRO-2/3 with DP peers keep no full-size gradient buffer for the step: each micro-batch's
gradients go to buckets (one region's parameters, or a whole chunk's: ``zg.c<c>.m<mb>[.<region>]``
in the Program), allocated when the Program says (the bucket's first backward instruction) and
released once its reduce-scatter has added it into the gradient shard, which lives for the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..ir.memory import grad_bucket
from ..models import ModelSpec
from ..states import zero_stage
from ..strategy import Strategy
from ..train.schedule import decays
from .models import init_tensor
from .reference import OptimConfig

__all__ = ["Piece", "Buffer", "local_pieces", "chunk_of", "StateStore", "adamw_", "MemoryTracker"]

_DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Piece:
    """One tensor's local box, placed at ``start`` in its flat buffer."""

    name: str
    chunk: int
    group: str                      # "dense" | "expert"
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def box(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))


def chunk_of(spec: ModelSpec, strategy: Strategy) -> dict[str, int]:
    """Virtual stage (chunk) of every tensor: embedding first, head last."""
    ls = strategy.layer_stages(spec.layers)
    last = strategy.stages - 1
    return {t.name: 0 if t.layer < 0 else last if t.layer >= spec.layers else int(ls[t.layer])
            for t in spec.tensors}


def local_pieces(spec: ModelSpec, strategy: Strategy, rank: int) -> list[Piece]:
    """The local boxes of every tensor ``rank`` holds, with their offsets in the stage's flat buffer.

    As in ``parashift.vps.layout``: one buffer per family (dense, expert) per pipeline stage, the
    local shards concatenated in model order; TP splits ``tp_dim`` evenly, EP splits ``ep_dim``.
    """
    c = strategy.coords(rank)
    chunks = chunk_of(spec, strategy)
    cursor: dict[str, int] = {}
    out = []
    for t in spec.tensors:
        ch = chunks[t.name]
        if int(strategy.chunk_rank_stage(ch)) != c["pp"]:
            continue
        off, size = [0] * len(t.shape), list(t.shape)
        if t.tp_dim is not None and strategy.tp > 1:
            size[t.tp_dim] //= strategy.tp
            off[t.tp_dim] = c["tp"] * size[t.tp_dim]
        if t.ep_dim is not None and strategy.ep > 1:
            size[t.ep_dim] //= strategy.ep
            off[t.ep_dim] = c["ep"] * size[t.ep_dim]
        group = "expert" if t.ep_dim is not None else "dense"
        start = cursor.get(group, 0)
        out.append(Piece(t.name, ch, group, tuple(off), tuple(size), start))
        cursor[group] = start + math.prod(size)
    return out


class MemoryTracker:
    """Bytes of named live buffers on one rank and their peak."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.current = 0
        self.peak = 0

    def alloc(self, name: str, nbytes: int) -> None:
        self.free(name)
        self.live[name] = int(nbytes)
        self.current += int(nbytes)
        self.peak = max(self.peak, self.current)

    def free(self, name: str) -> None:
        self.current -= self.live.pop(name, 0)


class Buffer:
    """One family's flat buffer (dense or expert) on one rank and its states.

    ZeRO shards it over the ``n`` ranks of its DP group: shard ``j`` is ``[j*q, (j+1)*q)`` of the
    buffer padded to ``n*q``. Chunks occupy contiguous ranges (model order), so per-chunk
    collectives move the intersections of a chunk's range with the shards.
    """

    def __init__(self, family: str, pieces: list[Piece], n: int, index: int, zero: int,
                 dtype: torch.dtype, device: torch.device, mem: MemoryTracker, alloc=None) -> None:
        zeros = alloc or (lambda n_, dt, dev: torch.zeros(n_, dtype=dt, device=dev))
        self.family, self.pieces, self.n, self.index, self.zero = family, pieces, n, index, zero
        self.zero_stage = z = zero_stage(zero)
        self.numel = sum(p.numel for p in pieces)
        self.padded = -(-self.numel // n) * n
        self.q = self.padded // n
        self.lo, self.hi = index * self.q, (index + 1) * self.q
        self.dtype, self.device, self.mem = dtype, device, mem
        self.gdtype = torch.float32      # gradients accumulate and reduce in fp32 (bf16 models: Megatron's main_grad)
        self.ranges: dict[int, tuple[int, int]] = {}
        for p in pieces:
            a, b = self.ranges.get(p.chunk, (p.start, p.start))
            self.ranges[p.chunk] = (min(a, p.start), max(b, p.start + p.numel))
        self.param = zeros(self.q if z.shards_params else self.padded, dtype, device)
        self.copies: dict[int, list[tuple[str, torch.Tensor, int]]] = {}   # zero 3: chunk -> (name, copy, offset)
        osz = self.q if z.shards_optim else self.padded
        self.master = None if dtype == torch.float32 else zeros(osz, torch.float32, device)
        self.exp_avg = zeros(osz, torch.float32, device)
        self.exp_avg_sq = zeros(osz, torch.float32, device)
        self.grad: torch.Tensor | None = None          # full local accumulation buffer
        self.grad_shard: torch.Tensor | None = None    # reduce-scattered shard (zero >= 1)
        self.per_mb = z.grad_buckets and n > 1                # gradients reduce-scattered per micro-batch
        self.mb_grads: dict[tuple[int, int], dict[str | None, tuple[int, torch.Tensor]]] = {}
        #   (chunk, mb) -> bucket (region, None: the chunk) -> (buffer offset, gradient)
        self.step = 0
        self.name = family
        self._segments: list[tuple[int, int, bool]] | None = None   # weight-decay ranges (optimizer step)
        mem.alloc(f"param:{family}", self.param.numel() * self.param.element_size())
        for k in ("master", "exp_avg", "exp_avg_sq"):
            t = getattr(self, k)
            if t is not None:
                mem.alloc(f"{k}:{family}", t.numel() * t.element_size())
        if self.per_mb:
            self.grad_shard_buffer()

    # ---- parameters ---------------------------------------------------------------------------
    def load(self, values: dict[str, torch.Tensor]) -> None:
        """Fill parameters (and master) from global tensors."""
        full = torch.zeros(self.padded, dtype=torch.float32)
        for p in self.pieces:
            full[p.start:p.start + p.numel] = values[p.name][p.box()].reshape(-1)
        full = full.to(self.device)
        self.param.copy_((full[self.lo:self.hi] if self.zero_stage.shards_params else full).to(self.dtype))
        if self.master is not None:
            self.master.copy_(full[self.lo:self.hi] if self.zero_stage.shards_optim else full)

    def param_shard(self) -> torch.Tensor:
        return self.param if self.zero_stage.shards_params else self.param[self.lo:self.hi]

    def chunk_param(self, chunk: int, name: str | None = None) -> tuple[torch.Tensor, int] | None:
        """(flat tensor, offset of buffer element 0 in it) holding chunk's parameters, or None.

        ZeRO-3: the gathered copy called ``name`` (the copy of the running action), else the latest.
        """
        if not self.zero_stage.shards_params or self.n == 1:      # a group of one holds everything: no gather exists
            return self.param, 0
        copies = self.copies.get(chunk)
        if not copies:
            return None
        if name is not None:
            for n, t, base in copies:
                if n == name:
                    return t, base
            return None
        return copies[-1][1], copies[-1][2]

    def has_copy(self, chunk: int, name: str) -> bool:
        return any(n == name for n, _, _ in self.copies.get(chunk, ()))

    def new_copy(self, chunk: int, name: str, region: str | None = None) -> torch.Tensor:
        """Allocate a gathered copy of chunk's parameters (``region``: only that region's; zero 3),
        released by :meth:`release`."""
        a, b = self.bucket_span(chunk, region)
        t = torch.empty(b - a, dtype=self.dtype, device=self.device)
        self.copies.setdefault(chunk, []).append((name, t, a))
        self.mem.alloc(f"{name}:{self.family}", t.numel() * t.element_size())
        return t

    def release(self, name: str) -> None:
        for chunk, copies in self.copies.items():
            keep = [x for x in copies if x[0] != name]
            if len(keep) != len(copies):
                self.mem.free(f"{name}:{self.family}")
            self.copies[chunk] = keep

    def release_all(self) -> None:
        for copies in self.copies.values():
            for n, _, _ in copies:
                self.mem.free(f"{n}:{self.family}")
        self.copies.clear()

    # ---- per-chunk shard geometry -------------------------------------------------------------
    def segments(self, chunk: int, span: tuple[int, int] | None = None) -> tuple[list[tuple[int, int]], int]:
        """Per DP member i: the part of chunk's range (or of buffer range ``span``) inside shard i
        (buffer coords), and the max length."""
        a, b = span if span is not None else self.chunk_span(chunk)
        segs = [(max(a, i * self.q), min(b, (i + 1) * self.q)) for i in range(self.n)]
        segs = [(lo, max(lo, hi)) for lo, hi in segs]
        return segs, max(hi - lo for lo, hi in segs)

    # ---- gradients ----------------------------------------------------------------------------
    def grad_buffer(self) -> torch.Tensor:
        if self.grad is None:
            self.grad = torch.zeros(self.padded, dtype=self.gdtype, device=self.device)
            self.mem.alloc(f"grad:{self.family}", self.padded * self.grad.element_size())
        return self.grad

    def grad_shard_buffer(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.q, dtype=self.gdtype, device=self.device)
            self.mem.alloc(f"grad_shard:{self.family}", self.q * self.grad_shard.element_size())
        return self.grad_shard

    def chunk_span(self, chunk: int) -> tuple[int, int]:
        """Buffer range [a, b) of chunk's elements (the padding included when it spans the buffer)."""
        a, b = self.ranges[chunk]
        return (a, self.padded) if a == 0 and b == self.numel else (a, b)

    def bucket_span(self, chunk: int, region: str | None) -> tuple[int, int]:
        """Buffer range [a, b) of a gradient bucket: the region's pieces of ``chunk`` (None: the chunk)."""
        if region is None:
            return self.chunk_span(chunk)
        ps = [p for p in self.pieces if p.chunk == chunk and grad_bucket(p.name) == region]
        if not ps:
            raise RuntimeError(f"gradient bucket {region!r} has no parameters in chunk {chunk} ({self.family})")
        return min(p.start for p in ps), max(p.start + p.numel for p in ps)

    def alloc_mb_grad(self, chunk: int, mb: int, region: str | None = None) -> None:
        """ZeRO-2/3: a zeroed gradient bucket for micro-batch ``mb`` (the Program's ``zg`` buffer)."""
        buckets = self.mb_grads.setdefault((chunk, mb), {})
        if region in buckets:
            raise RuntimeError(f"gradient bucket {region or 'chunk'} of chunk {chunk} micro-batch {mb} "
                               f"({self.family}) allocated twice")
        a, b = self.bucket_span(chunk, region)
        t = torch.zeros(b - a, dtype=self.gdtype, device=self.device)
        buckets[region] = (a, t)
        self.mem.alloc(self._zg(chunk, mb, region), t.numel() * t.element_size())

    def _zg(self, chunk: int, mb: int, region: str | None) -> str:
        return f"zg.c{chunk}.m{mb}{'' if region is None else '.' + region}:{self.family}"

    def mb_grad(self, chunk: int, mb: int | None, start: int) -> tuple[torch.Tensor, int]:
        """(gradient bucket, its buffer offset) holding buffer element ``start`` of micro-batch ``mb``."""
        for a, t in self.mb_grads.get((chunk, mb), {}).values():
            if a <= start < a + t.numel():
                return t, a
        raise RuntimeError(f"gradients of chunk {chunk} micro-batch {mb} ({self.family}) are written but their "
                           f"bucket is not allocated: the Program's backward must allocate zg.c{chunk}.m{mb}[.<region>]")

    def bucket(self, chunk: int, mb: int, region: str | None) -> tuple[int, torch.Tensor]:
        return self.mb_grads[(chunk, mb)][region]

    def free_mb_grad(self, chunk: int, mb: int, region: str | None = None) -> None:
        buckets = self.mb_grads.get((chunk, mb), {})
        if buckets.pop(region, None) is not None:
            self.mem.free(self._zg(chunk, mb, region))
        if not buckets:
            self.mb_grads.pop((chunk, mb), None)

    # ---- optimizer ----------------------------------------------------------------------------
    def opt_grad(self) -> torch.Tensor:
        """The gradient the optimizer reads: this rank's ZeRO shard (zero >= 1), else the whole buffer."""
        if self.zero_stage.shards_optim and self.n == 1:   # no DP peers: no reduce-scatter, the shard is the buffer
            return self.grad_buffer()
        if self.zero_stage.shards_optim:
            return self.grad_shard if self.grad_shard is not None else torch.zeros(self.q, dtype=self.gdtype,
                                                                                   device=self.device)
        return self.grad_buffer()

    @property
    def opt_base(self) -> int:
        """Buffer offset of the optimizer state's element 0 (this rank's ZeRO shard's start, else 0)."""
        return self.lo if self.zero_stage.shards_optim else 0

    @property
    def opt_len(self) -> int:
        """Elements of the optimizer state (and of :meth:`opt_grad`)."""
        return self.q if self.zero_stage.shards_optim else self.padded

    def decay_segments(self) -> list[tuple[int, int, bool]]:
        """``(a, b, decays)`` ranges covering the optimizer state (offsets into it): weight decay on
        matrices and embeddings, not on norms and biases (:func:`parashift.train.decays`)."""
        lo, n = self.opt_base, self.opt_len
        out: list[tuple[int, int, bool]] = []
        cur = 0
        for p in self.pieces:
            a, e = max(lo, p.start) - lo, min(lo + n, p.start + p.numel) - lo
            if a >= e:
                continue
            flag = decays(p.name, p.sizes)
            if a > cur:                           # a gap (none today): decayed, it is zero
                out.append((cur, a, True))
            if out and out[-1][2] == flag and out[-1][1] == a:
                out[-1] = (out[-1][0], e, flag)
            else:
                out.append((a, e, flag))
            cur = e
        if cur < n:                               # the padding: decayed, it is zero
            if out and out[-1][2]:
                out[-1] = (out[-1][0], n, True)
            else:
                out.append((cur, n, True))
        return out

    def optimizer_step(self, cfg: OptimConfig, scale: float = 1.0) -> None:
        """AdamW on this rank's optimizer shard (gradients times ``scale``; weight decay only on the
        ranges of :meth:`decay_segments`), then write the new values into the parameters."""
        g = self.opt_grad().float()
        if scale != 1.0:
            g = g * scale
        target = self.master if self.master is not None else (self.param_shard() if self.zero_stage.shards_optim else self.param)
        self.step += 1
        if self._segments is None:
            self._segments = self.decay_segments()
        plain = replace(cfg, weight_decay=0.0)
        for a, e, dec in self._segments:
            adamw_(target[a:e], g[a:e], self.exp_avg[a:e], self.exp_avg_sq[a:e], self.step, cfg if dec else plain)
        if self.master is not None:
            (self.param_shard() if self.zero_stage.shards_optim else self.param).copy_(self.master.to(self.dtype))
        self.zero_grad()

    def zero_grad(self) -> None:
        for (chunk, mb), buckets in list(self.mb_grads.items()):
            for region in list(buckets):
                self.free_mb_grad(chunk, mb, region)
        if self.per_mb:
            self.grad_shard_buffer().zero_()
            return
        if self.grad is not None:
            if self.zero_stage.grad_buckets:
                self.grad = None
                self.mem.free(f"grad:{self.family}")
            else:
                self.grad.zero_()
        if self.grad_shard is not None:
            self.grad_shard = None
            self.mem.free(f"grad_shard:{self.family}")


#: AdamW runs over the flat buffers in pieces of this many elements: the six passes over one piece
#: (parameter, gradient, two moments, the denominator) stay in cache, as per-parameter loops do
ADAMW_PIECE = 1 << 16


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
           cfg: OptimConfig, piece: int = ADAMW_PIECE) -> None:
    """One AdamW step in place, the same operations as torch.optim.AdamW (single-tensor path),
    over flat tensors ``piece`` elements at a time (elementwise, so the result does not depend on it)."""
    bc1 = 1 - cfg.beta1 ** step
    bc2 = (1 - cfg.beta2 ** step) ** 0.5
    decay, size = 1 - cfg.lr * cfg.weight_decay, -(cfg.lr / bc1)
    n = p.numel()
    denom = torch.empty(min(n, piece), dtype=v.dtype, device=v.device)
    for a in range(0, n, piece):
        e = min(a + piece, n)
        pp, gp, mp, vp, d = p[a:e], g[a:e], m[a:e], v[a:e], denom[:e - a]
        pp.mul_(decay)
        mp.lerp_(gp, 1 - cfg.beta1)
        vp.mul_(cfg.beta2).addcmul_(gp, gp, value=1 - cfg.beta2)
        torch.sqrt(vp, out=d).div_(bc2).add_(cfg.eps)
        pp.addcdiv_(mp, d, value=size)


class StateStore:
    """One rank's flat buffers (by family) and the parameter/gradient views the model uses."""

    def __init__(self, spec: ModelSpec, strategy: Strategy, rank: int, device: torch.device,
                 seed: int = 0, mem: MemoryTracker | None = None, init: bool = True, alloc=None) -> None:
        """``init=False``: leave every buffer zero (a hot switch fills it from the old layout).
        ``alloc(numel, dtype, device)``: returns a zeroed flat state buffer (default ``torch.zeros``)."""
        self.spec, self.strategy, self.rank = spec, strategy, rank
        self.mem = mem or MemoryTracker()
        c = strategy.coords(rank)
        pieces = local_pieces(spec, strategy, rank)
        dtype = _DT[spec.dtype]
        self.buffers: dict[str, Buffer] = {}
        for fam in ("dense", "expert"):
            ps = [p for p in pieces if p.group == fam]
            if ps:
                # ZeRO shards over the ranks that reduce the family's gradients: dp x cp (cp fastest,
                # as parashift.vps.layout), experts over edp (ep > 1 needs cp == 1); hybrid sharding
                # (cp == ep == 1): both over the shard group, shard index dp % shard
                if strategy.shard:
                    n, idx = strategy.shard, c["shard"]
                else:
                    n, idx = (strategy.dpcp, c["dpcp"]) if fam == "dense" else \
                        (strategy.dpcp // strategy.ep, c["dpcp"] // strategy.ep)
                self.buffers[fam] = Buffer(fam, ps, n, idx, strategy.zero, dtype, device, self.mem, alloc)
        self.pieces = {p.name: p for p in pieces}
        if init:
            values = {t.name: init_tensor(t, spec.layers, seed) for t in spec.tensors if t.name in self.pieces}
            for b in self.buffers.values():
                b.load(values)
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grad_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.active: dict[int, str] = {}     # ZeRO-3: chunk -> gathered copy the running compute uses
        self.grad_mb: dict[int, int] = {}    # ZeRO-2/3: chunk -> micro-batch whose gradients are being written

    def families(self, axis: str) -> list[Buffer]:
        """Buffers a DP-axis collective covers: "dp" -> dense (and experts when ep == 1), "edp" -> experts."""
        if axis == "edp":
            return [self.buffers["expert"]] if "expert" in self.buffers else []
        out = [self.buffers["dense"]] if "dense" in self.buffers else []
        if self.strategy.ep == 1 and "expert" in self.buffers:
            out.append(self.buffers["expert"])
        return out

    def chunks(self) -> list[int]:
        return sorted({p.chunk for p in self.pieces.values()})

    def _view(self, flat: torch.Tensor, base: int, p: Piece) -> torch.Tensor:
        hit = self._views.get(p.name)
        if hit is not None and hit[0] is flat:
            return hit[1]
        v = flat[p.start - base:p.start - base + p.numel].view(p.sizes)
        self._views[p.name] = (flat, v)
        return v

    def param(self, name: str) -> torch.Tensor:
        """Local shard of a parameter (a view into the store; ZeRO-3 needs it gathered first)."""
        p = self.pieces[name]
        want = self.active.get(p.chunk)
        got = self.buffers[p.group].chunk_param(p.chunk, want)
        if got is None:
            raise RuntimeError(f"parameters of chunk {p.chunk} ({p.group}) are used but not gathered"
                               f"{f' (no copy {want})' if want else ''}: ZeRO-3 needs an all_gather before each use")
        return self._view(got[0], got[1], p)

    def grad(self, name: str) -> torch.Tensor:
        """Local gradient accumulator of a parameter (a view into the flat gradient buffer)."""
        hit = self._grad_views.get(name)
        p = self.pieces[name]
        b = self.buffers[p.group]
        if b.per_mb:
            g, base = b.mb_grad(p.chunk, self.grad_mb.get(p.chunk), p.start)
        else:
            g, base = b.grad_buffer(), 0
        if hit is not None and hit[0] is g:
            return hit[1]
        v = g[p.start - base:p.start - base + p.numel].view(p.sizes)
        self._grad_views[name] = (g, v)
        return v

    def release(self, name: str) -> None:
        for b in self.buffers.values():
            b.release(name)

    def local_params(self) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
        """name -> (global offsets, local values) of every parameter whose values this rank has
        in full (all of them unless ZeRO-3, where the caller gathers first)."""
        out = {}
        for b in self.buffers.values():
            for p in b.pieces:
                got = b.chunk_param(p.chunk)
                if got is not None:
                    flat, base = got
                    out[p.name] = (p.offsets, flat[p.start - base:p.start - base + p.numel].view(p.sizes)
                                   .float().cpu().clone())
        return out
