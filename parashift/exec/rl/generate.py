"""Greedy decoding with a KV cache, on TP shards of the weights (tiny-gpt / tiny-moe conventions).

:func:`greedy_generate` runs the runtime's model (``parashift.exec.models`` conventions: grouped
QKV rows, interleaved SwiGLU rows, vocab-parallel embedding and head) forward-only: a *prefill*
over the prompts fills each layer's key/value cache, then every *decode* step feeds one token
per sequence and appends to the cache. Under TP (``group`` over the ``tp`` ranks) each rank holds
its shards as a rollout store gives them (:func:`local_weights`): the vocab-parallel embedding
and the row-parallel projections (attention out, MLP/expert/shared fc2) end in an all-reduce,
the head's logits are all-gathered before the argmax. Weights of any dtype are computed in fp32.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...errors import StrategyError
from ...models import ModelSpec
from ..models import apply_rope, check_supported, rms_norm, rope_tables, swiglu
from ..state import StateStore

__all__ = ["local_weights", "greedy_generate", "next_token_logits"]


def local_weights(store: StateStore) -> dict[str, torch.Tensor]:
    """name -> this rank's shard of every parameter of ``store`` (views, ZeRO off)."""
    out = {}
    for b in store.buffers.values():
        for p in b.pieces:
            out[p.name] = b.param[p.start:p.start + p.numel].view(p.sizes)
    return out


class _TP:
    def __init__(self, group, tp: int, rank: int) -> None:
        self.group, self.tp, self.rank = group, tp, rank

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def cat(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _moe(spec: ModelSpec, W, p: str, z: torch.Tensor) -> torch.Tensor:
    """This rank's partial MoE output (experts' fc1/fc2 TP-sharded; router and gate replicated)."""
    zf = z.reshape(-1, z.shape[-1])
    w, idx = torch.softmax(zf @ W(f"{p}.router.weight").t(), -1).topk(spec.top_k, dim=-1)
    out = torch.zeros_like(zf)
    fc1, fc2 = W(f"{p}.experts.fc1"), W(f"{p}.experts.fc2")
    for e in range(spec.experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        a = swiglu(zf[tok] @ fc1[e].t())
        out = out.index_add(0, tok, (a @ fc2[e].t()) * w[tok, slot].unsqueeze(-1))
    if spec.shared_ffn:
        sh = swiglu(zf @ W(f"{p}.shared.fc1").t()) @ W(f"{p}.shared.fc2").t()
        out = out + sh * torch.sigmoid(zf @ W(f"{p}.shared.gate").t())
    return out.view(z.shape)


def next_token_logits(spec: ModelSpec, weights: dict[str, torch.Tensor], tokens: torch.Tensor, cache: list,
                      pos: int, tp: _TP) -> torch.Tensor:
    """Logits ``[b, vocab]`` of the token after ``tokens [b, n]`` (positions ``pos..pos+n-1``);
    appends the new keys and values to ``cache`` (one ``[k, v]`` per layer, empty lists at first)."""
    W = (lambda name: weights[name].float())
    b, n = tokens.shape
    d, r = spec.head_dim, spec.heads // spec.kv_heads
    cos, sin = rope_tables(pos + n, d)
    cos, sin = cos[pos:], sin[pos:]
    emb = W("embed.word")
    lo = tp.rank * emb.shape[0]
    mine = (tokens >= lo) & (tokens < lo + emb.shape[0])
    h = tp.sum(emb[(tokens - lo).clamp(0, emb.shape[0] - 1)] * mine.unsqueeze(-1))
    for i in range(spec.layers):
        p = f"layers.{i}"
        z = rms_norm(h) * W(f"{p}.attn.norm.weight")
        qkv = z @ W(f"{p}.attn.qkv.weight").t()
        kvl = qkv.shape[-1] // ((r + 2) * d)
        qkv = qkv.view(b, n, kvl, r + 2, d)
        q = apply_rope(qkv[:, :, :, :r].reshape(b, n, kvl * r, d).transpose(1, 2), cos, sin)
        k = apply_rope(qkv[:, :, :, r].transpose(1, 2), cos, sin)
        v = qkv[:, :, :, r + 1].transpose(1, 2)
        if cache[i]:
            k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
        cache[i][:] = [k, v]
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                           is_causal=n > 1 and pos == 0)
        h = h + tp.sum(o.transpose(1, 2).reshape(b, n, -1) @ W(f"{p}.attn.out.weight").t())
        if spec.is_moe:
            h = h + tp.sum(_moe(spec, W, f"{p}.moe", rms_norm(h) * W(f"{p}.moe.norm.weight")))
        else:
            z = rms_norm(h) * W(f"{p}.mlp.norm.weight")
            h = h + tp.sum(swiglu(z @ W(f"{p}.mlp.fc1.weight").t()) @ W(f"{p}.mlp.fc2.weight").t())
    last = rms_norm(h[:, -1]) * W("head.norm.weight")
    return tp.cat(last @ W("head.out").t())


def greedy_generate(spec: ModelSpec, weights: dict[str, torch.Tensor], prompts: torch.Tensor, new_tokens: int, *,
                    group=None, tp: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """``prompts [b, n]`` followed by ``new_tokens`` greedily decoded tokens: ``[b, n + new_tokens]``.

    ``weights``: this rank's TP shards (``tp`` ranks in ``group``, this one ``tp_rank``); every
    rank of the group must call it with the same prompts."""
    check_supported(spec)
    if spec.qkv_bias or spec.qk_norm or spec.tied or spec.norm_topk or spec.norm_eps != 1e-5 \
            or spec.rope_theta != 10000.0:
        raise StrategyError(f"generation runs the preset architecture only; {spec.name!r} has q/k/v biases, q/k "
                            f"norms, tied embeddings, renormalized routing or its own norm eps / rope theta")
    t = _TP(group, tp, tp_rank)
    cache: list = [[] for _ in range(spec.layers)]
    out = [prompts]
    with torch.no_grad():
        x, pos = prompts, 0
        for _ in range(new_tokens):
            nxt = next_token_logits(spec, weights, x, cache, pos, t).argmax(-1, keepdim=True)
            pos += x.shape[1]
            out.append(nxt)
            x = nxt
    return torch.cat(out, 1)
