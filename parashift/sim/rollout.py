"""Rollout phases as Programs: greedy generation (prefill, then one decode step per token) simulated
like a training step.

A rollout layout is TP shards and DP replicas (``pp=1``); each replica generates for
``prompts / dp`` sequences. :func:`rollout_program` builds one forward pass of every rank over
``tokens`` new tokens per sequence after ``past`` cached ones: per layer an attention and an MLP
(or MoE) compute instruction, each followed by a TP all-reduce of the hidden states, then the
head and an all-gather of the vocab-parallel logits. Compute instructions carry their FLOPs and
the HBM bytes they stream (the local weights they touch and the key/value cache they read), so
the cost model's roofline makes prefill compute-bound and decode memory-bound.
:func:`simulate_rollout` simulates the prefill and the decode steps (exactly at up to
``samples`` cache lengths, linearly in between: a decode step's cost is affine in its cache
length between the roofline's corners) and sums them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cluster import Cluster, get as get_cluster
from ..cost import CostModel
from ..errors import StrategyError
from ..ir.program import Instr, Program, RankProgram
from ..ir.step_meta import spec_json
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy

__all__ = ["rollout_program", "simulate_rollout", "RolloutSim"]

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _region_bytes(spec: ModelSpec, tp: int, wbytes: int) -> dict[str, float]:
    """Local weight bytes per region kind of one layer (attn, mlp, moe.experts, moe.other), embed, head."""
    out: dict[str, float] = {}
    for t in spec.tensors:
        if t.layer not in (-1, 0, spec.layers):
            continue
        kind = ("embed" if t.layer < 0 else "head" if t.layer >= spec.layers else
                "moe.experts" if t.ep_dim is not None else t.region)
        n = t.numel / (tp if t.tp_dim is not None else 1)
        out[kind] = out.get(kind, 0.0) + n * wbytes
    return out


def rollout_program(model: "ModelSpec | str", strategy: "Strategy | str", *, prompts: int, tokens: int, past: int = 0,
                    dtype: str = "bf16", max_len: int | None = None) -> Program:
    """One forward pass of the rollout layout ``strategy``: ``tokens`` new tokens per sequence after
    ``past`` cached ones (prefill: ``past=0, tokens=prompt_len``; a decode step: ``tokens=1``).
    ``max_len``: the longest sequence of the rollout (the key/value cache every rank allocates)."""
    spec = get_model(model)
    s = Strategy.parse(strategy)
    if s.pp != 1 or s.ep != 1 or s.zero_stage.sharded:
        raise StrategyError(f"rollout layout {s} must have pp=1, ep=1, zero=0 (TP shards and DP replicas)")
    s.validate(spec)
    if prompts % s.dp:
        raise StrategyError(f"{prompts} prompts do not split over {s.dp} rollout replicas; use a multiple of {s.dp}")
    if dtype not in _BYTES:
        raise StrategyError(f"rollout dtype {dtype!r} is unknown; use one of {sorted(_BYTES)}")
    wb, tp = _BYTES[dtype], s.tp
    b = prompts // s.dp
    T = b * tokens
    L = past + tokens
    reg = _region_bytes(spec, tp, wb)
    kv_local = max(spec.kv_heads // tp, 1) * spec.head_dim * 2 * wb        # K and V bytes per token per layer
    hid = T * spec.hidden * wb
    attn_core = 2 * 2 * T * L * spec.heads * spec.head_dim / tp / (2 if past == 0 and tokens > 1 else 1)
    attn_proj = spec.attn_flops(T, 1) - spec.core_flops(T, 1)
    instrs: list[Instr] = []

    def add(**kw: Any) -> None:
        instrs.append(Instr.make(id=len(instrs), stream="compute", **kw))

    def reduce(what: str, nbytes: float) -> None:
        if tp > 1:
            add(op="all_reduce", group="tp", nbytes=int(nbytes), tag=f"{what}")

    add(op="compute", phase="fwd", region="embed", flops=0.0, nbytes=int(hid * 2))
    reduce("embed", hid)
    if spec.is_moe:
        touched = min(1.0, T * spec.top_k / spec.experts)      # share of the experts some token uses
        mlp_bytes = reg.get("moe.experts", 0.0) * touched + reg.get("moe", 0.0)
    else:
        mlp_bytes = reg.get("mlp", 0.0)
    for i in range(spec.layers):
        add(op="compute", phase="fwd", region=f"layers.{i}.attn", flops=float(attn_proj / tp + attn_core),
            nbytes=int(reg.get("attn", 0.0) + b * L * kv_local + 2 * hid))
        reduce(f"l{i}.attn", hid)
        add(op="compute", phase="fwd", region=f"layers.{i}.{'moe' if spec.is_moe else 'mlp'}",
            flops=float(spec.mlp_flops(T) / tp), nbytes=int(mlp_bytes + 2 * hid))
        reduce(f"l{i}.mlp", hid)
    last = b * spec.hidden * wb
    add(op="compute", phase="fwd", region="head", flops=float(spec.head_flops(b) / tp), nbytes=int(reg["head"] + last))
    if tp > 1:
        add(op="all_gather", group="tp", nbytes=int(b * spec.vocab / tp * 4), tag="logits")
    weights = int(reg.get("embed", 0.0) + reg.get("head", 0.0)
                  + spec.layers * sum(v for k, v in reg.items() if k not in ("embed", "head")))
    cache = int(spec.layers * b * (max_len or L) * kv_local)
    rp = RankProgram({"compute": tuple(instrs)}, {"weights": weights, "kv_cache": cache})
    meta = {"kind": "rollout", "model": spec.name, "model_spec": spec_json(spec), "prompts": prompts, "tokens": tokens, "past": past,
            "dtype": dtype, "global_batch": prompts, "seq_len": L, "mbs": b}
    return Program({r: rp for r in range(s.world)}, s, meta)


@dataclass(frozen=True)
class RolloutSim:
    """A simulated rollout: seconds of the prefill, of all decode steps, in all; peak bytes per device."""

    strategy: str
    prefill_seconds: float
    decode_seconds: float
    peak_memory: float
    fits: bool

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "seconds": self.seconds, "peak_memory": self.peak_memory,
                "fits": self.fits}


def simulate_rollout(model: "ModelSpec | str", strategy: "Strategy | str", cluster: "Cluster | str", *, prompts: int,
                     prompt_len: int, rollout_tokens: int, dtype: str = "bf16", cost_model: CostModel | None = None,
                     samples: int = 6) -> RolloutSim:
    """Simulate generating ``rollout_tokens`` tokens for ``prompts`` prompts of ``prompt_len`` tokens."""
    from .simulate import simulate
    spec, clus = get_model(model), get_cluster(cluster)
    cm = cost_model or CostModel.for_cluster(clus)
    n = prompt_len + rollout_tokens
    pre = simulate(rollout_program(spec, strategy, prompts=prompts, tokens=prompt_len, dtype=dtype, max_len=n),
                   clus, cm, model=spec)
    steps = rollout_tokens - 1              # the prefill yields the first new token
    decode = 0.0
    if steps > 0:
        pasts = np.arange(prompt_len, prompt_len + steps)
        at = np.unique(np.linspace(pasts[0], pasts[-1], min(samples, steps)).round().astype(int))
        t = [simulate(rollout_program(spec, strategy, prompts=prompts, tokens=1, past=int(p), dtype=dtype, max_len=n),
                      clus, cm, model=spec).step_time for p in at]
        decode = float(np.interp(pasts, at, t).sum())
    peak = float(max(pre.peak_memory.values()))
    return RolloutSim(str(Strategy.parse(strategy)), float(pre.step_time), decode, peak, bool(pre.fits))
