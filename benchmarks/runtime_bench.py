"""parashift's runtime vs torch.distributed.pipelining on the same pipeline (one JSON object).

tiny-gpt deepened to 8 layers (4 stages x 2 virtual chunks need >= 8 layers), 4 gloo processes,
4 pipeline stages, 8 micro-batches of one sequence, ``torch.set_num_threads(1)``, AdamW step
included on both sides. For each schedule: median step time (over ``--steps`` after warm-up)
of parashift (1f1b, interleaved-1f1b, dualpipev) and of torch (Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleDualPipeV), and ratio = parashift / torch (< 1: parashift faster);
the best single step of each side too (``ratio_min``), which shared, loaded machines distort least.

    .venv/bin/python benchmarks/runtime_bench.py [--steps 12] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parashift import models
from parashift.exec import compile_program, launch_local, run_program
from parashift.exec.models import apply_rope, init_tensor, rms_norm, rope_tables, swiglu
from parashift.exec.reference import make_batch

PP, MICRO, SEQ = 4, 8, 32
SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
             "dualpipev": ("ScheduleDualPipeV", 2)}


def bench_model() -> models.ModelSpec:
    base = models.get("tiny-gpt")
    return models.gpt(8, base.hidden, base.heads, kv_heads=base.kv_heads, ffn=base.ffn, vocab=base.vocab,
                      seq_len=SEQ, name="tiny-gpt-8l", dtype="fp32", pad_vocab=8)


class Chunk(nn.Module):
    """One virtual stage of the model for torch.distributed.pipelining (the reference math)."""

    def __init__(self, spec: models.ModelSpec, layers: list[int], embed: bool, head: bool) -> None:
        super().__init__()
        self.spec, self.layers, self.embed, self.head = spec, layers, embed, head
        keep = [t for t in spec.tensors if (t.layer in layers) or (embed and t.layer < 0)
                or (head and t.layer >= spec.layers)]
        self.p = nn.ParameterDict({t.name.replace(".", "_"): nn.Parameter(init_tensor(t, spec.layers)) for t in keep})
        self.cos, self.sin = rope_tables(SEQ, spec.head_dim)

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "_")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.w
        h = w("embed.word")[x] if self.embed else x
        b, n, _ = h.shape
        d, r = s.head_dim, s.heads // s.kv_heads
        for i in self.layers:
            p = f"layers.{i}"
            z = rms_norm(h) * w(f"{p}.attn.norm.weight")
            qkv = (z @ w(f"{p}.attn.qkv.weight").t()).view(b, n, s.kv_heads, r + 2, d)
            q = qkv[:, :, :, :r].reshape(b, n, s.heads, d).transpose(1, 2)
            k, v = qkv[:, :, :, r].transpose(1, 2), qkv[:, :, :, r + 1].transpose(1, 2)
            q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
            h = h + o.transpose(1, 2).reshape(b, n, -1) @ w(f"{p}.attn.out.weight").t()
            z = rms_norm(h) * w(f"{p}.mlp.norm.weight")
            h = h + swiglu(z @ w(f"{p}.mlp.fc1.weight").t()) @ w(f"{p}.mlp.fc2.weight").t()
        if self.head:
            return (rms_norm(h) * w("head.norm.weight")) @ w("head.out").t()
        return h


def _torch_job(ctx, schedule: str, steps: int) -> list[float]:
    from torch.distributed import pipelining as pl
    from parashift import Strategy
    spec = bench_model()
    cls_name, vpp = SCHEDULES[schedule]
    strat = Strategy(pp=PP, vpp=vpp, schedule=schedule)
    n_stages = PP * vpp
    owner = [int(strat.chunk_rank_stage(c)) for c in range(n_stages)]
    layer_chunk = strat.layer_stages(spec.layers)
    total = MICRO * SEQ
    stages, params = [], []
    for c in range(n_stages):
        if owner[c] != ctx.rank:
            continue
        mod = Chunk(spec, [i for i in range(spec.layers) if layer_chunk[i] == c], c == 0, c == n_stages - 1)
        params += list(mod.parameters())
        example = torch.zeros(1, SEQ, dtype=torch.int64) if c == 0 else torch.zeros(1, SEQ, spec.hidden)
        stages.append(pl.PipelineStage(mod, c, n_stages, ctx.device, input_args=(example,)))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum") / total

    cls = getattr(pl, cls_name)
    sched = cls(stages[0] if vpp == 1 else stages, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    first, last = owner[0] == ctx.rank, owner[-1] == ctx.rank
    times = []
    for step in range(steps):
        tokens, targets = make_batch(spec, step, MICRO, SEQ)
        dist.barrier()
        t0 = time.perf_counter()
        kw = {"target": targets, "losses": []} if last else {}
        if first:
            sched.step(tokens, **kw)
        else:
            sched.step(**kw)
        opt.step()
        opt.zero_grad(set_to_none=False)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return times


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="launches per side; the median of their medians")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = bench_model()
    out: dict = {"model": "tiny-gpt, 8 layers", "stages": PP, "processes": PP, "microbatches": MICRO,
                 "seq_len": SEQ, "backend": "gloo", "threads": 1, "steps": args.steps, "warmup": args.warmup,
                 "repeats": args.repeats, "schedules": {}}
    from torch.distributed import pipelining
    for schedule, (cls_name, vpp) in SCHEDULES.items():
        if not hasattr(pipelining, cls_name):
            out["schedules"][schedule] = {"torch_schedule": cls_name, "skipped": f"torch {torch.__version__} lacks it"}
            continue
        program = compile_program(spec, f"pp={PP},vpp={vpp},schedule={schedule}", global_batch=MICRO, seq_len=SEQ)
        ours, theirs, ours_min, theirs_min = [], [], [], []
        for _ in range(args.repeats):           # alternate the two sides so load drifts hit both
            res = run_program(program, steps=args.steps, profile=False, model=spec, timeout=600)
            ours.append(median_after_warmup(res.step_times, args.warmup))
            ours_min.append(min(res.step_times[args.warmup:]))
            t = launch_local(_torch_job, PP, args=(schedule, args.steps), timeout=600)[0]
            theirs.append(median_after_warmup(t, args.warmup))
            theirs_min.append(min(t[args.warmup:]))
        a, b = statistics.median(ours), statistics.median(theirs)
        amin, bmin = min(ours_min), min(theirs_min)
        out["schedules"][schedule] = {"parashift_s": a, "torch_s": b, "torch_schedule": cls_name, "ratio": a / b,
                                      "parashift_min_s": amin, "torch_min_s": bmin, "ratio_min": amin / bmin,
                                      "parashift_runs": ours, "torch_runs": theirs}
        print(f"{schedule}: parashift {a * 1e3:.1f} ms, torch {cls_name} {b * 1e3:.1f} ms, ratio {a / b:.2f} "
              f"(best steps: {amin * 1e3:.1f} vs {bmin * 1e3:.1f} ms, ratio {amin / bmin:.2f})", file=sys.stderr)
    out["max_ratio"] = max((v["ratio"] for v in out["schedules"].values() if "ratio" in v), default=None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
