"""A live job with phases: every iteration switches the weights into the rollout layout, generates,
switches back and trains on what it generated.

``run_rl(model, train, rollout, iterations=N, rollout_tokens=K)`` starts one process per training
device (gloo). Iteration ``i``: the prompts are the first ``prompt_len`` tokens of data batch
``i`` (:func:`~parashift.exec.reference.make_batch`); the weights switch into the rollout layout
(:class:`~.weights.WeightSwitch`; optimizer state stays in the training layout); each rollout
replica greedily decodes ``K`` tokens for its share of the prompts with TP across its ranks
(:func:`~.generate.greedy_generate`), devices outside the rollout layout idle; the sequences are
shared with every process, the weights switch back, and one training step runs on the sequences
(next-token loss: the objective is a stand-in, the switching is the point).

:func:`reference_rl` does the same in one process without switching (full weights,
``torch.optim.AdamW``): the job's sequences must equal its sequences and its losses its losses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ... import models
from ...errors import StrategyError
from ..launch import RankContext, launch_local
from ..reference import OptimConfig, init_params, make_batch, param_groups, reference_loss
from .generate import greedy_generate, local_weights
from .weights import ROLLOUT_DTYPES, WeightSwitch, check_rollout

__all__ = ["RLOptions", "RLResult", "run_rl", "reference_rl", "prompts_of"]


@dataclass(frozen=True)
class RLOptions:
    """``prompts``: sequences per iteration (the training global batch); ``prompt_len``: tokens of
    each prompt; ``rollout_tokens``: tokens generated per sequence; ``dtype``: the rollout copy's
    (``fp32`` or ``bf16``); ``release``: free the training weights during the rollout (needs a
    rollout copy of the training dtype; None: whenever it has)."""

    rollout_tokens: int = 8
    prompts: int = 8
    prompt_len: int = 8
    dtype: str = "fp32"
    release: bool | None = None
    seed: int = 0
    data_seed: int = 0
    optim: OptimConfig = OptimConfig()

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.rollout_tokens - 1


def prompts_of(spec: models.ModelSpec, it: int, opts: RLOptions) -> torch.Tensor:
    """Iteration ``it``'s prompts ``[prompts, prompt_len]``."""
    return make_batch(spec, it, opts.prompts, opts.prompt_len, opts.data_seed)[0]


def _tp_group(rollout, rank: int):
    """Every rank builds every TP group of the rollout layout (same order); returns this rank's."""
    mine = None
    if rollout.tp == 1:
        return None
    for members in rollout.groups("tp").tolist():
        g = dist.new_group(ranks=[int(m) for m in members])
        if rank in members:
            mine = g
    return mine


def _worker(ctx: RankContext, spec: models.ModelSpec, train: str, rollout: str, iterations: int,
            opts: RLOptions) -> dict:
    from ..runtime import Runtime, compile_program
    torch.manual_seed(0)
    tr, ro = check_rollout(spec, train, rollout)
    prog = compile_program(spec.name, tr, global_batch=opts.prompts, seq_len=opts.seq_len)
    rt = Runtime(prog, ctx, seed=opts.seed, model=spec, optim=opts.optim)
    same = ROLLOUT_DTYPES[opts.dtype] == {"fp32": torch.float32, "bf16": torch.bfloat16}.get(spec.dtype)
    release = same if opts.release is None else opts.release
    ws = WeightSwitch(spec, tr, ro, ctx.rank, dtype=opts.dtype, release=release)
    group = _tp_group(ro, ctx.rank)
    rows: list[tuple] = []
    out: dict[str, Any] = {"rank": ctx.rank, "iterations": []}
    per = opts.prompts // ro.dp
    for it in range(iterations):
        prompts = prompts_of(spec, it, opts)
        dist.barrier()
        rt.sync_params()
        a = ws.to_rollout(rt.store)
        rows += [("rollout-switch", op, s, e, it) for op, s, e in a.rows]
        t0 = time.time()
        got = None
        if ws.rollout_rank is not None:
            c = ro.coords(ctx.rank)
            seqs = greedy_generate(spec, local_weights(ws.store), prompts[c["dp"] * per:(c["dp"] + 1) * per],
                                   opts.rollout_tokens, group=group, tp=ro.tp, tp_rank=c["tp"])
            got = (c["dp"], seqs) if c["tp"] == 0 else None
        parts: list = [None] * ctx.world
        dist.all_gather_object(parts, got)
        seqs = torch.cat([s for _, s in sorted(p for p in parts if p is not None)], 0)
        t1 = time.time()
        rows.append(("rollout", "generate" if ws.rollout_rank is not None else "idle", t0, t1, it))
        b = ws.to_train(rt.store)
        rows += [("train-switch", op, s, e, it) for op, s, e in b.rows]
        rt.interp.batch = (lambda step, s=seqs: (s[:, :-1].contiguous(), s[:, 1:].contiguous()))
        t2 = time.time()
        loss, _ = rt.step()
        rows.append(("train", "step", t2, time.time(), it))
        out["iterations"].append({"loss": float(loss), "rollout_switch_seconds": a.seconds,
                                  "train_switch_seconds": b.seconds, "generate_seconds": t1 - t0,
                                  "train_seconds": time.time() - t2, "bytes_sent": a.bytes_sent + b.bytes_sent,
                                  "sequences": seqs.tolist() if ctx.rank == 0 else None})
    out["rows"] = rows
    out["release"] = release
    return out


@dataclass
class RLResult:
    """Per iteration: the global loss, the slowest process's switch and phase seconds, whether the
    generated sequences equal the no-switch reference's, and the reference's loss."""

    model: str
    train: str
    rollout: str
    options: RLOptions
    iterations: list[dict]
    reports: list[dict] = field(repr=False)

    def timeline(self):
        """Every process's phases: ``device, stream, op, iteration, start, end`` (seconds from the first)."""
        import pandas as pd
        rows = [(r["rank"], st, op, it, a, b) for r in self.reports for st, op, a, b, it in r["rows"]]
        df = pd.DataFrame(rows, columns=["device", "stream", "op", "iteration", "start", "end"])
        df[["start", "end"]] -= df["start"].min() if len(df) else 0.0
        return df.sort_values(["start", "device"]).reset_index(drop=True)

    def to_json(self) -> dict:
        o = self.options
        return {"model": self.model, "strategy": self.train, "rollout": self.rollout,
                "rollout_tokens": o.rollout_tokens, "prompts": o.prompts, "prompt_len": o.prompt_len,
                "rollout_dtype": o.dtype, "released_training_weights": self.reports[0]["release"],
                "iterations": self.iterations}


def run_rl(model: "str | models.ModelSpec", train: str, rollout: str, *, iterations: int, rollout_tokens: int = 8,
           prompts: int = 8, prompt_len: int = 8, dtype: str = "fp32", release: bool | None = None, seed: int = 0,
           data_seed: int = 0, optim: OptimConfig = OptimConfig(), timeout: float = 300.0, check: bool = True,
           progress: Callable[[int, float], None] | None = None) -> RLResult:
    """Run ``iterations`` RL iterations (see the module docstring). ``check``: also run
    :func:`reference_rl` and report ``generated_equal_reference`` and ``reference_loss``."""
    spec = models.get(model)
    if iterations < 1 or rollout_tokens < 1 or prompt_len < 1:
        raise StrategyError(f"iterations={iterations}, rollout_tokens={rollout_tokens} and prompt_len={prompt_len} "
                            f"must each be at least 1")
    if dtype not in ROLLOUT_DTYPES:
        raise StrategyError(f"rollout dtype {dtype!r} is not supported; use one of {sorted(ROLLOUT_DTYPES)}")
    tr, ro = check_rollout(spec, train, rollout)
    if prompts % ro.dp or prompts % tr.dp:
        raise StrategyError(f"{prompts} prompts do not split over the rollout's {ro.dp} replicas and training's "
                            f"dp={tr.dp}; use a multiple of both")
    opts = RLOptions(rollout_tokens, prompts, prompt_len, dtype, release, seed, data_seed, optim)
    reports = launch_local(_worker, tr.world, args=(spec, str(tr), str(ro), iterations, opts), timeout=timeout)
    ref = reference_rl(spec, iterations, opts) if check else None
    its = []
    for i in range(iterations):
        per = [r["iterations"][i] for r in reports]
        row = {"iteration": i, "loss": float(sum(p["loss"] for p in per))}
        for k in ("rollout_switch_seconds", "train_switch_seconds", "generate_seconds", "train_seconds"):
            row[k] = max(p[k] for p in per)
        row["bytes_moved"] = sum(p["bytes_sent"] for p in per)
        if ref is not None:
            row["reference_loss"] = ref[0][i]
            row["generated_equal_reference"] = per[0]["sequences"] == ref[1][i]
        its.append(row)
        if progress is not None:
            progress(i, row["loss"])
    return RLResult(spec.name, str(tr), str(ro), opts, its, reports)


def reference_rl(spec: "models.ModelSpec | str", iterations: int, opts: RLOptions
                 ) -> tuple[list[float], list[list[list[int]]]]:
    """The same iterations in one process without switching: (losses, sequences per iteration)."""
    spec = models.get(spec)
    P = {k: v.requires_grad_() for k, v in init_params(spec, opts.seed).items()}
    o = opts.optim
    opt = torch.optim.AdamW(param_groups(spec, P, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            foreach=False)
    losses, seqs = [], []
    for it in range(iterations):
        W = {k: v.detach().to(ROLLOUT_DTYPES[opts.dtype]) for k, v in P.items()}
        s = greedy_generate(spec, W, prompts_of(spec, it, opts), opts.rollout_tokens)
        seqs.append(s.tolist())
        opt.zero_grad()
        loss = reference_loss(spec, P, s[:, :-1], s[:, 1:], s[:, 1:].numel())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, seqs
