"""parashift's runtime vs torch.distributed.pipelining on the same pipeline (one JSON object).

Two sizes (``--size``): ``small`` is tiny-gpt deepened to 8 layers (hidden 64, sequence 32,
vocabulary 256), ``medium`` 8 blocks of hidden 256, sequence 128, vocabulary 1024; both run 4
gloo processes (4 pipeline stages, one thread each), 8 micro-batches of one sequence, AdamW step
included on both sides; parashift runs as torch does, without profiling or memory accounting
(``profile=False, memory=False``). Both runtimes live in the same 4 processes and their steps alternate (the
order flips every step), so load that comes and goes on a shared machine hits both alike
(``--separate``: one launch per side instead). For each schedule (gpipe, 1f1b, interleaved-1f1b, dualpipev against
torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleDualPipeV): the median step
time (over ``--steps`` after ``--warmup``) of each side per launch, the median over ``--repeats``
launches, ``ratio`` = parashift / torch
(< 1: parashift faster), and ``max_ratio`` over schedules. Paired runs also report the CPU seconds
of each step's busiest rank (main thread, ``thread_time``; median per launch, median of launches),
``cpu_ratio`` and ``max_cpu_ratio``: what each side costs, which load on a shared machine cannot
inflate. ``reference_s``: one process training
the whole model on the same micro-batches (the pipeline's own efficiency is reference_s / step).
``breakdown``: where one rank's step time goes, per side, from ``cProfile`` over a separate
launch (mean over ranks; seconds per step and per instruction; cProfile inflates Python time,
so compare the sides' shares, not these absolutes with the timed runs); ``compute_phases``: its
compute split into forward (the loss included), backward (weight gradients included) and optimizer.

    .venv/bin/python benchmarks/runtime_bench.py --size small [--steps 8] [--repeats 3]
    .venv/bin/python benchmarks/runtime_bench.py --size medium --schedules 1f1b,dualpipev
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
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

PP, MICRO = 4, 8
SIZES = {"small": dict(hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32),
         "medium": dict(hidden=256, heads=4, kv_heads=2, ffn=512, vocab=1024, seq=128)}
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2), "dualpipev": ("ScheduleDualPipeV", 2)}


def bench_model(size: str) -> models.ModelSpec:
    z = SIZES[size]
    return models.gpt(8, z["hidden"], z["heads"], kv_heads=z["kv_heads"], ffn=z["ffn"], vocab=z["vocab"],
                      seq_len=z["seq"], name=f"bench-gpt-{size}", dtype="fp32", pad_vocab=8)


class Chunk(nn.Module):
    """One virtual stage of the model for torch.distributed.pipelining (the reference math)."""

    def __init__(self, spec: models.ModelSpec, layers: list[int], embed: bool, head: bool) -> None:
        super().__init__()
        self.spec, self.layers, self.embed, self.head = spec, layers, embed, head
        keep = [t for t in spec.tensors if (t.layer in layers) or (embed and t.layer < 0)
                or (head and t.layer >= spec.layers)]
        self.p = nn.ParameterDict({t.name.replace(".", "_"): nn.Parameter(init_tensor(t, spec.layers)) for t in keep})
        self.cos, self.sin = rope_tables(spec.seq_len, spec.head_dim)

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


def _torch_setup(ctx, size: str, schedule: str):
    """This rank's torch pipeline: (step function, its optimizer's parameters)."""
    from torch.distributed import pipelining as pl
    from parashift import Strategy
    spec = bench_model(size)
    seq = spec.seq_len
    cls_name, vpp = SCHEDULES[schedule]
    strat = Strategy(pp=PP, vpp=vpp, schedule=schedule)
    n_stages = PP * vpp
    owner = [int(strat.chunk_rank_stage(c)) for c in range(n_stages)]
    layer_chunk = strat.layer_stages(spec.layers)
    total = MICRO * seq
    stages, params = [], []
    for c in range(n_stages):
        if owner[c] != ctx.rank:
            continue
        mod = Chunk(spec, [i for i in range(spec.layers) if layer_chunk[i] == c], c == 0, c == n_stages - 1)
        params += list(mod.parameters())
        example = torch.zeros(1, seq, dtype=torch.int64) if c == 0 else torch.zeros(1, seq, spec.hidden)
        stages.append(pl.PipelineStage(mod, c, n_stages, ctx.device, input_args=(example,)))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum") / total

    cls = getattr(pl, cls_name)
    sched = cls(stages[0] if vpp == 1 else stages, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    first, last = owner[0] == ctx.rank, owner[-1] == ctx.rank

    def torch_step(step: int) -> None:
        tokens, targets = make_batch(spec, step, MICRO, seq)
        kw = {"target": targets, "losses": []} if last else {}
        if first:
            sched.step(tokens, **kw)
        else:
            sched.step(**kw)
        opt.step()
        opt.zero_grad(set_to_none=False)
    return torch_step


def _max_time(dt: float) -> float:
    """The slowest rank's time of one step (every rank calls this once per step)."""
    t = torch.tensor([dt])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _paired_job(ctx, program_json: dict, size: str, schedule: str, steps: int) -> tuple[list[float], ...]:
    """Both runtimes in the same processes, their steps alternating (the order flips every step), so
    load that comes and goes on a shared machine hits both sides alike; (parashift, torch) step times
    and the CPU seconds of each step's busiest rank (its main thread: what load cannot inflate)."""
    from parashift.exec.runtime import Runtime
    from parashift.ir.program import Program
    rt = Runtime(Program.from_json(program_json), ctx, model=bench_model(size), timeout=600, profile=False,
                 memory=False)
    torch_step = _torch_setup(ctx, size, schedule)

    def ours(step: int) -> tuple[float, float]:
        c0 = time.thread_time()
        dt = rt.step()[1]          # after a barrier, like the torch side
        return dt, time.thread_time() - c0

    def theirs(step: int) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        torch_step(step)
        return time.perf_counter() - t0, time.thread_time() - c0
    out: tuple[list[float], ...] = ([], [], [], [])
    for step in range(steps):
        for k in ((0, 1) if step % 2 == 0 else (1, 0)):
            dt, cpu = (ours, theirs)[k](step)
            out[k].append(_max_time(dt))
            out[k + 2].append(_max_time(cpu))
    return out


def _torch_job(ctx, size: str, schedule: str, steps: int) -> list[float]:
    torch_step = _torch_setup(ctx, size, schedule)
    times = []
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        torch_step(step)
        times.append(_max_time(time.perf_counter() - t0))
    return times


# ---- where the time goes --------------------------------------------------------------------------
_TORCH_COMPUTE = {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"}
_OURS_BUFFERS = {"_recv_buffer", "_release", "store_release_all", "release_all"}


def _is_wait(fn: tuple) -> bool:
    """A blocking wait: a work handle's wait, a lock or condition, a sleep."""
    name = fn[2]
    return fn[0] == "~" and (("wait" in name and "_distributed_c10d" in name) or name in (
        "<method 'acquire' of '_thread.lock' objects>", "<built-in method time.sleep>"))


def _categorize(stats: dict, side: str, steps: int, instrs: int) -> dict:
    """Seconds per step in each category from a cProfile table (``side``: parashift or torch)."""
    def cum(pred) -> float:
        return sum(v[3] for k, v in stats.items() if pred(k))

    def tot(pred) -> float:
        return sum(v[2] for k, v in stats.items() if pred(k))
    builtin = lambda k: k[0] == "~"  # noqa: E731
    comm_c = tot(lambda k: builtin(k) and "_distributed_c10d" in k[2] and not _is_wait(k))
    torch_c = tot(lambda k: builtin(k) and "torch" in k[2] and not _is_wait(k)) - comm_c
    python = tot(lambda k: not builtin(k))
    if side == "parashift":
        total = cum(lambda k: k[2] == "run_step")
        waits = tot(_is_wait)
        compute = cum(lambda k: k[0].endswith("interpreter.py") and k[2] == "_compute")
        tags = (tot(lambda k: k[2] in ("<method 'match' of 're.Pattern' objects>", "<built-in method zlib.crc32>"))
                + cum(lambda k: k[0].endswith("ir/tags.py") and k[2] == "parse_tag"))
        buffers = cum(lambda k: k[0].endswith(("interpreter.py", "state.py")) and k[2] in _OURS_BUFFERS)
        profiler = cum(lambda k: k[0].endswith("profiler.py") and k[2] == "record")
        cats = {"compute": compute, "dependency_waits": waits, "comm_issue_torch": comm_c, "tag_handling": tags,
                "buffer_management": buffers, "profiler_hooks": profiler}
        ours = lambda name: cum(lambda k: k[0].endswith("interpreter.py") and k[2] == name)  # noqa: E731
        phases = {"fwd": ours("_fwd"), "bwd": ours("_bwd_chain") + ours("_bwd") + cum(
            lambda k: k[0].endswith("regions.py") and k[2] in ("_tape_weight", "_embed_bwd_weight")),
            "optim": cum(lambda k: k[0].endswith("state.py") and k[2] == "optimizer_step")}
    else:
        total = cum(lambda k: k[2] == "torch_step")
        waits = tot(_is_wait)
        compute = cum(lambda k: k[2] in _TORCH_COMPUTE) + cum(lambda k: k[2] == "step" and "optim" in k[0])
        cats = {"compute": compute, "dependency_waits": waits, "comm_issue_torch": comm_c, "tag_handling": 0.0,
                "buffer_management": 0.0, "profiler_hooks": 0.0}
        phases = {"fwd": cum(lambda k: k[2] == "forward_one_chunk") + cum(lambda k: k[2] == "_maybe_compute_loss"),
                  "bwd": cum(lambda k: k[2] in ("backward_one_chunk", "backward_weight_one_chunk")),
                  "optim": cum(lambda k: k[2] == "step" and "optim" in k[0])}
    cats["dispatch"] = max(total - sum(cats.values()), 0.0)
    out = {k: v / steps for k, v in cats.items()}
    out["compute_phases"] = {k: v / steps for k, v in phases.items()}
    out.update(step_s=total / steps, python_s=python / steps, torch_s=torch_c / steps, instructions=instrs,
               overhead_per_instr_us={k: 1e6 * out[k] / max(instrs, 1) for k in
                                      ("dispatch", "tag_handling", "buffer_management", "profiler_hooks",
                                       "comm_issue_torch")})
    return out


def _profiled(step_fn, steps: int, warmup: int) -> dict:
    for k in range(warmup):
        dist.barrier()
        step_fn(k)
    prof = cProfile.Profile()
    for k in range(warmup, warmup + steps):
        dist.barrier()
        prof.enable()
        step_fn(k)
        prof.disable()
    return pstats.Stats(prof).stats


def _ours_profile_job(ctx, program_json: dict, size: str, steps: int, warmup: int) -> dict:
    from parashift.exec.runtime import Runtime
    from parashift.ir.program import Program
    program = Program.from_json(program_json)
    try:
        rt = Runtime(program, ctx, model=bench_model(size), timeout=600, profile=False, memory=False)   # as timed
    except TypeError:      # a runtime from before `profile` / `memory` existed (it always recorded both)
        rt = Runtime(program, ctx, model=bench_model(size), timeout=600)
    stats = _profiled(lambda k: rt.interp.run_step(k), steps, warmup)
    return _categorize(stats, "parashift", steps, len(program.ranks[ctx.rank]))


def _torch_profile_job(ctx, size: str, schedule: str, steps: int, warmup: int, instrs: list[int]) -> dict:
    torch_step = _torch_setup(ctx, size, schedule)
    return _categorize(_profiled(torch_step, steps, warmup), "torch", steps, instrs[ctx.rank])


def _mean_breakdown(parts: list[dict]) -> dict:
    out = {}
    for k, v in parts[0].items():
        if isinstance(v, dict):
            out[k] = {j: statistics.fmean(p[k][j] for p in parts) for j in v}
        else:
            out[k] = statistics.fmean(p[k] for p in parts)
    return out


def reference_step(spec: models.ModelSpec, steps: int, warmup: int) -> float:
    """Median step time of one process training the whole model on the same micro-batches."""
    seq = spec.seq_len
    model = Chunk(spec, list(range(spec.layers)), True, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=False)
    times = []
    for step in range(steps):
        tokens, targets = make_batch(spec, step, MICRO, seq)
        t0 = time.perf_counter()
        for mb in range(MICRO):
            logits = model(tokens[mb:mb + 1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[mb:mb + 1].reshape(-1),
                                   reduction="sum") / (MICRO * seq)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=tuple(SIZES), default="small")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="launches per side; the median of their medians")
    ap.add_argument("--separate", action="store_true",
                    help="time each side in its own launches (default: both in one launch, steps alternating)")
    ap.add_argument("--breakdown-steps", type=int, default=3, help="profiled steps per side (0: no breakdown)")
    args = ap.parse_args()
    scheds = [x for x in args.schedules.split(",") if x]
    bad = [x for x in scheds if x not in SCHEDULES]
    if bad or args.steps <= args.warmup or args.repeats < 1:
        ap.error(f"unknown schedules {bad} (known: {', '.join(SCHEDULES)})" if bad else
                 "--steps must exceed --warmup and --repeats be at least 1")
    torch.set_num_threads(1)
    spec = bench_model(args.size)
    z = SIZES[args.size]
    out: dict = {"size": args.size, "model": {"layers": spec.layers, **z}, "stages": PP, "processes": PP,
                 "microbatches": MICRO, "backend": "gloo", "threads": 1, "steps": args.steps, "warmup": args.warmup,
                 "repeats": args.repeats,
                 "pairing": "separate launches" if args.separate else "one launch, steps alternating", "torch": torch.__version__, "schedules": {}}
    out["reference_s"] = reference_step(spec, args.steps, args.warmup)
    print(f"[{args.size}] one-process reference step {out['reference_s'] * 1e3:.1f} ms", file=sys.stderr)
    from torch.distributed import pipelining
    for schedule in scheds:
        cls_name, vpp = SCHEDULES[schedule]
        if not hasattr(pipelining, cls_name):
            out["schedules"][schedule] = {"torch_schedule": cls_name, "skipped": f"torch {torch.__version__} lacks it"}
            continue
        program = compile_program(spec, f"pp={PP},vpp={vpp},schedule={schedule}", global_batch=MICRO,
                                  seq_len=spec.seq_len)
        ours, theirs, ours_min, theirs_min, ours_cpu, theirs_cpu = [], [], [], [], [], []
        for _ in range(args.repeats):
            if args.separate:                   # one launch per side, the sides alternating
                res = run_program(program, steps=args.steps, profile=False, memory=False, model=spec, timeout=600)
                mine = res.step_times
                other = launch_local(_torch_job, PP, args=(args.size, schedule, args.steps), timeout=600)[0]
            else:                               # one launch, the sides' steps alternating
                mine, other, cpu_a, cpu_b = launch_local(_paired_job, PP, args=(program.to_json(), args.size,
                                                                                schedule, args.steps), timeout=600)[0]
                ours_cpu.append(median_after_warmup(cpu_a, args.warmup))
                theirs_cpu.append(median_after_warmup(cpu_b, args.warmup))
            ours.append(median_after_warmup(mine, args.warmup))
            ours_min.append(min(mine[args.warmup:]))
            theirs.append(median_after_warmup(other, args.warmup))
            theirs_min.append(min(other[args.warmup:]))
        a, b = statistics.median(ours), statistics.median(theirs)
        amin, bmin = min(ours_min), min(theirs_min)
        row = {"parashift_s": a, "torch_s": b, "torch_schedule": cls_name, "ratio": a / b,
               "parashift_min_s": amin, "torch_min_s": bmin, "ratio_min": amin / bmin,
               "efficiency": out["reference_s"] / a, "torch_efficiency": out["reference_s"] / b,
               "parashift_runs": ours, "torch_runs": theirs}
        if ours_cpu:
            ca, cb = statistics.median(ours_cpu), statistics.median(theirs_cpu)
            row.update(parashift_cpu_s=ca, torch_cpu_s=cb, cpu_ratio=ca / cb)
        if args.breakdown_steps > 0:
            pj = program.to_json()
            n = [len(program.ranks[r]) for r in range(PP)]
            mine = launch_local(_ours_profile_job, PP, args=(pj, args.size, args.breakdown_steps, args.warmup),
                                timeout=600, gather=True)
            other = launch_local(_torch_profile_job, PP,
                                 args=(args.size, schedule, args.breakdown_steps, args.warmup, n),
                                 timeout=600, gather=True)
            row["breakdown"] = {"parashift": _mean_breakdown(mine), "torch": _mean_breakdown(other)}
        out["schedules"][schedule] = row
        print(f"[{args.size}] {schedule}: parashift {a * 1e3:.1f} ms, torch {cls_name} {b * 1e3:.1f} ms, "
              f"ratio {a / b:.2f} (best steps: {amin * 1e3:.1f} vs {bmin * 1e3:.1f} ms, ratio {amin / bmin:.2f})"
              + (f"; CPU of the busiest rank {row['parashift_cpu_s'] * 1e3:.1f} vs {row['torch_cpu_s'] * 1e3:.1f} ms, "
                 f"ratio {row['cpu_ratio']:.2f}" if "cpu_ratio" in row else ""), file=sys.stderr)
    out["max_ratio"] = max((v["ratio"] for v in out["schedules"].values() if "ratio" in v), default=None)
    out["max_cpu_ratio"] = max((v["cpu_ratio"] for v in out["schedules"].values() if "cpu_ratio" in v), default=None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
