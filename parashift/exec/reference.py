"""The golden run: deterministic data and a single-process model trained with torch.optim.AdamW.

The reference is written independently of the region machinery (plain autograd on full
tensors), so agreement between it and a parallel run checks the runtime, not a shared bug.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..errors import ProgramError
from ..models import ModelSpec
from ..train.schedule import LRSchedule, decays
from .models import apply_rope, check_supported, init_tensor, rms_norm, rope_tables, swiglu

__all__ = ["OptimConfig", "Fp8Reference", "make_batch", "microbatch_rows", "reference_logits", "reference_loss",
           "reference_train", "init_params", "param_groups", "ReferenceRun"]


@dataclass(frozen=True)
class OptimConfig:
    """AdamW hyper-parameters (the same math as ``torch.optim.AdamW``)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    #: the learning rate of each step (None: ``lr`` throughout); a decaying one needs ``decay_steps``
    schedule: "LRSchedule | None" = None
    #: clip gradients to this global L2 norm before each update (0: no clipping; ``clip_grad_norm_``)
    clip_grad: float = 0.0

    def __post_init__(self) -> None:
        if self.schedule is not None and self.schedule.lr != self.lr:
            raise ProgramError(f"the schedule's peak rate {self.schedule.lr} differs from lr {self.lr}")
        if self.clip_grad < 0 or self.clip_grad != self.clip_grad:
            raise ProgramError(f"clip_grad {self.clip_grad} must be 0 (off) or a positive norm")

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step`` (0-based)."""
        return self.lr if self.schedule is None else self.schedule.at(step)


def make_batch(spec: ModelSpec, step: int, global_batch: int, seq_len: int, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets ``[global_batch, seq_len]`` of one step (int64, CPU).

    Sequences follow ``x[t+1] = (5 x[t] + c) mod V`` with a per-sequence ``c`` and 10% noise,
    so the loss falls within a few steps.
    """
    g = torch.Generator().manual_seed(seed * 7919 + step)
    v = spec.vocab
    start = torch.randint(0, v, (global_batch, 1), generator=g)
    inc = torch.randint(1, 8, (global_batch, 1), generator=g)
    x = torch.empty(global_batch, seq_len + 1, dtype=torch.int64)
    x[:, :1] = start
    for t in range(seq_len):
        x[:, t + 1:t + 2] = (5 * x[:, t:t + 1] + inc) % v
    noise = torch.rand(global_batch, seq_len + 1, generator=g) < 0.1
    x = torch.where(noise, torch.randint(0, v, x.shape, generator=g), x)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def microbatch_rows(global_batch: int, dp: int, dp_rank: int, mbs: int, mb: int) -> slice:
    """Rows of the global batch that micro-batch ``mb`` of DP rank ``dp_rank`` trains on."""
    per = global_batch // dp
    start = dp_rank * per + mb * mbs
    return slice(start, start + mbs)


def init_params(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every global tensor's initial value (fp32)."""
    return {t.name: init_tensor(t, spec.layers, seed) for t in spec.tensors}


def _moe(spec: ModelSpec, P: dict, p: str, z: torch.Tensor) -> torch.Tensor:
    zf = z.reshape(-1, z.shape[-1])
    w, idx = torch.softmax(zf @ P[f"{p}.router.weight"].t(), -1).topk(spec.top_k, dim=-1)
    if spec.norm_topk:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(zf)
    for e in range(spec.experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        a = swiglu(zf[tok] @ P[f"{p}.experts.fc1"][e].t())
        out = out.index_add(0, tok, (a @ P[f"{p}.experts.fc2"][e].t()) * w[tok, slot].unsqueeze(-1))
    if spec.shared_ffn:
        sh = swiglu(zf @ P[f"{p}.shared.fc1"].t()) @ P[f"{p}.shared.fc2"].t()
        out = out + sh * torch.sigmoid(zf @ P[f"{p}.shared.gate"].t())
    return out.view(z.shape)


def _plain(x: torch.Tensor, P: dict, name: str) -> torch.Tensor:
    return x @ P[name].t()


def reference_logits(spec: ModelSpec, P: dict[str, torch.Tensor], tokens: torch.Tensor,
                     mm: Callable = _plain) -> torch.Tensor:
    """Logits ``[b, n, vocab]`` of ``tokens`` (full tensors, plain autograd). ``mm(x, P, name)``: the
    transformer's GEMMs (QKV, attention output, fc1, fc2), e.g. :class:`Fp8Reference`'s."""
    b, n = tokens.shape
    d, r, eps = spec.head_dim, spec.heads // spec.kv_heads, spec.norm_eps
    cos, sin = rope_tables(n, d, spec.rope_theta)
    h = P["embed.word"][tokens]
    for i in range(spec.layers):
        p = f"layers.{i}"
        z = rms_norm(h, eps) * P[f"{p}.attn.norm.weight"]
        qkv = mm(z, P, f"{p}.attn.qkv.weight")
        if spec.qkv_bias:
            qkv = qkv + P[f"{p}.attn.qkv.bias"]
        qkv = qkv.view(b, n, spec.kv_heads, r + 2, d)
        q, k, v = qkv[:, :, :, :r].reshape(b, n, spec.heads, d), qkv[:, :, :, r], qkv[:, :, :, r + 1]
        if spec.qk_norm:
            q = rms_norm(q, eps) * P[f"{p}.attn.q_norm.weight"]
            k = rms_norm(k, eps) * P[f"{p}.attn.k_norm.weight"]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
        h = h + mm(o.transpose(1, 2).reshape(b, n, -1), P, f"{p}.attn.out.weight")
        if spec.is_moe:
            h = h + _moe(spec, P, f"{p}.moe", rms_norm(h, eps) * P[f"{p}.moe.norm.weight"])
        else:
            z = rms_norm(h, eps) * P[f"{p}.mlp.norm.weight"]
            h = h + mm(swiglu(mm(z, P, f"{p}.mlp.fc1.weight")), P, f"{p}.mlp.fc2.weight")
    return (rms_norm(h, eps) * P["head.norm.weight"]) @ P["embed.word" if spec.tied else "head.out"].t()


def reference_loss(spec: ModelSpec, P: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor,
                   total_tokens: int, mm: Callable = _plain) -> torch.Tensor:
    """Sum of token losses of this batch divided by ``total_tokens`` (full tensors, plain autograd)."""
    logits = reference_logits(spec, P, tokens, mm)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / total_tokens


class Fp8Reference:
    """FP8 GEMMs of a delayed-scaling recipe, written apart from the runtime's: per tensor and role (input,
    weight: E4M3; output gradient: E5M2) ``scale = fp8_max / max(amax of the last `history` steps)`` (1
    before any), saturating casts there and back, the matmul in fp32, then unscaled; the step's amaxes
    (over the whole batch) join the history at :meth:`end_step`."""

    def __init__(self, history: int = 16) -> None:
        self.history, self.past, self.now = history, [], {}

    def _qdq(self, t: torch.Tensor, key: tuple, fmt: str) -> torch.Tensor:
        t = t.detach()
        self.now[key] = max(self.now.get(key, 0.0), float(t.abs().max()))
        top = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
        amax = max((p.get(key, 0.0) for p in self.past), default=0.0)
        scale = top / amax if amax > 0 else 1.0
        dtype = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
        return (t * scale).clamp(-top, top).to(dtype).to(t.dtype) * (1.0 / scale)

    def __call__(self, x: torch.Tensor, P: dict, name: str) -> torch.Tensor:
        ref = self

        class Gemm(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, w):  # type: ignore[override]
                xq, wq = ref._qdq(x, (name, 0), "e4m3"), ref._qdq(w, (name, 1), "e4m3")
                ctx.save_for_backward(xq, wq)
                return xq @ wq.t()

            @staticmethod
            def backward(ctx, dy):  # type: ignore[override]
                xq, wq = ctx.saved_tensors
                g = ref._qdq(dy, (name, 2), "e5m2")
                return g @ wq, g.reshape(-1, g.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])

        return Gemm.apply(x, P[name])

    def end_step(self) -> None:
        self.past = (self.past + [self.now])[-self.history:]
        self.now = {}


def param_groups(spec: ModelSpec, P: dict[str, torch.Tensor], weight_decay: float) -> list[dict]:
    """torch.optim param groups: weight decay where :func:`parashift.train.decays` says, none elsewhere."""
    shapes = {t.name: t.shape for t in spec.tensors}
    dec = [v for k, v in P.items() if decays(k, shapes[k])]
    rest = [v for k, v in P.items() if not decays(k, shapes[k])]
    return [g for g in ({"params": dec, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0})
            if g["params"]]


@dataclass
class ReferenceRun:
    """Per-step losses, global gradient norms (before clipping) and rates of :func:`reference_train`."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    grad_norms: list[float]
    lrs: list[float]

    def __iter__(self):            # ``losses, params = reference_train(...)``
        return iter((self.losses, self.params))

    def __getitem__(self, i: int):
        return (self.losses, self.params)[i]


def reference_train(spec: ModelSpec, steps: int, global_batch: int, seq_len: int, *,
                    optim: OptimConfig = OptimConfig(), seed: int = 0, data_seed: int = 0,
                    fp8: "Sequence[str] | str" = "none",
                    batch: "Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None" = None) -> ReferenceRun:
    """A single-process run: torch.optim.AdamW (decay on matrices and embeddings only), the rate of
    ``optim.lr_at(step)``, ``clip_grad_norm_`` at ``optim.clip_grad``. ``fp8``: the recipe of every step
    (``none`` or ``delayed``), or one per step (a job switching precision). ``batch(step)``: the step's
    (tokens, targets) (default :func:`make_batch`)."""
    check_supported(spec)
    recipes = [fp8] * steps if isinstance(fp8, str) else list(fp8)
    f8: Fp8Reference | None = None
    P = {k: v.requires_grad_() for k, v in init_params(spec, seed).items()}
    opt = torch.optim.AdamW(param_groups(spec, P, optim.weight_decay), lr=optim.lr,
                            betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False)
    losses, norms, lrs = [], [], []
    for step in range(steps):
        tokens, targets = batch(step) if batch is not None else make_batch(spec, step, global_batch, seq_len,
                                                                           data_seed)
        opt.zero_grad()
        if recipes[step] == "none":
            f8 = None
        elif recipes[step] != "delayed":
            raise ValueError(f"the reference runs fp8=none or delayed, not {recipes[step]!r}")
        elif f8 is None:             # a recipe switched on starts with an empty amax history
            f8 = Fp8Reference()
        loss = reference_loss(spec, P, tokens, targets, tokens.numel(), f8 or _plain)
        loss.backward()
        if f8 is not None:
            f8.end_step()
        norm = torch.nn.utils.clip_grad_norm_(list(P.values()), optim.clip_grad or float("inf"), foreach=False)
        lr = optim.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
        lrs.append(lr)
    return ReferenceRun(losses, {k: v.detach() for k, v in P.items()}, norms, lrs)
