"""Hand-built Programs for the simulator tests (and checks that the builders are sane).

``pipeline(...)`` builds a training step with one chunk per stage following a per-stage order
of (phase, microbatch) actions, as ``ir.compile`` would, so the simulator can be tested on its
own against closed-form results.
"""
from __future__ import annotations

import itertools

from parashift.ir.program import Instr, Program, RankProgram
from parashift.sim import CostModel
from parashift.strategy import Strategy


def unit_cost(**kw) -> CostModel:
    """Compute time == flops; transfer time == bytes; no overheads or latencies."""
    ones = dict(fwd=1.0, bwd=1.0, bwd_input=1.0, bwd_weight=1.0, recompute=1.0, optim=1.0)
    base = dict(gpu="unit", peak_flops=1.0, hbm_bw=1.0, memory_capacity=10**15,
                efficiency=ones, region_efficiency=dict(embed=1.0, attn=1.0, mlp=1.0, moe=1.0, head=1.0, layer=1.0),
                region_floor=dict(embed=0.0, attn=0.0, mlp=0.0, moe=0.0, head=0.0, layer=0.0),
                phase_floor=ones, optim_overhead=0.0, bandwidth=dict(local=1.0, intra=1.0, inter=1.0),
                link_efficiency=dict(local=1.0, intra=1.0, inter=1.0), latency=dict(local=0.0, intra=0.0, inter=0.0),
                comm_overhead=0.0, memory_reserved=0)
    base.update(kw)
    return CostModel(**base)


def order_1f1b(pp: int, m: int, s: int) -> list[tuple[str, int]]:
    warm = min(pp - s - 1, m)
    out = [("fwd", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out += [("fwd", f), ("bwd", b)]
        f += 1
        b += 1
    out += [("bwd", j) for j in range(b, m)]
    return out


def order_gpipe(pp: int, m: int, s: int) -> list[tuple[str, int]]:
    return [("fwd", i) for i in range(m)] + [("bwd", i) for i in range(m)]


def pipeline(pp: int, m: int, schedule: str = "1f1b", *, tf: float = 1.0, tb: float = 2.0, act: int = 0,
             p2p_bytes: int = 0, dp: int = 1, tp: int = 1, tp_bytes: int = 0, dp_bytes: int = 0,
             static: int = 0, share: bool = True, p2p_stream: str = "per-message") -> Program:
    """A training step of ``m`` micro-batches on ``pp`` stages (one chunk each).

    Each stage runs fwd (``tf`` FLOPs, allocating ``act`` bytes) and bwd (``tb`` FLOPs, freeing
    them); with tp > 1 a TP all-reduce of ``tp_bytes`` follows every fwd and bwd on the compute
    stream; with dp > 1 a DP all-reduce of ``dp_bytes`` runs on the comm stream after the last bwd.
    ``p2p_stream="per-message"`` gives every send/recv its own stream (fully asynchronous p2p).
    """
    strategy = Strategy(dp=dp, tp=tp, pp=pp, schedule=schedule)
    order = {"1f1b": order_1f1b, "gpipe": order_gpipe}[schedule]
    progs = []
    for s in range(pp):
        ids = itertools.count()
        compute: list[Instr] = []
        streams: dict[str, list[Instr]] = {}
        recv_ids: dict[tuple[str, int], int] = {}

        def stream_of(kind: str, mb: int) -> str:
            return f"p2p.{kind}{mb}" if p2p_stream == "per-message" else p2p_stream

        # recvs first, so compute can depend on them
        for ph, mb in order(pp, m, s):
            if ph == "fwd" and s > 0:
                i = Instr(next(ids), "recv", stream_of("f", mb), peer="pp-1", nbytes=p2p_bytes, tag=f"act.c{s - 1}.m{mb}")
                streams.setdefault(stream_of("f", mb), []).append(i)
                recv_ids[("fwd", mb)] = i.id
            if ph == "bwd" and s < pp - 1:
                i = Instr(next(ids), "recv", stream_of("b", mb), peer="pp+1", nbytes=p2p_bytes, tag=f"grad.c{s}.m{mb}")
                streams.setdefault(stream_of("b", mb), []).append(i)
                recv_ids[("bwd", mb)] = i.id
        last_bwd = None
        for ph, mb in order(pp, m, s):
            deps = (recv_ids[(ph, mb)],) if (ph, mb) in recv_ids else ()
            if ph == "fwd":
                c = Instr(next(ids), "compute", "compute", deps, phase="fwd", stage=s, chunk=s, microbatch=mb,
                          flops=tf, alloc=((f"act.c{s}.m{mb}", act),) if act else ())
            else:
                c = Instr(next(ids), "compute", "compute", deps, phase="bwd", stage=s, chunk=s, microbatch=mb,
                          flops=tb, free=(f"act.c{s}.m{mb}",) if act else ())
                last_bwd = c.id
            compute.append(c)
            after = c.id
            if tp > 1:
                a = Instr(next(ids), "all_reduce", "compute", (c.id,), group="tp", nbytes=tp_bytes,
                          tag=f"tp.{ph}.m{mb}")
                compute.append(a)
                after = a.id
            if ph == "fwd" and s < pp - 1:
                streams.setdefault(stream_of("f", mb), []).append(
                    Instr(next(ids), "send", stream_of("f", mb), (after,), peer="pp+1", nbytes=p2p_bytes,
                          tag=f"act.c{s}.m{mb}"))
            if ph == "bwd" and s > 0:
                streams.setdefault(stream_of("b", mb), []).append(
                    Instr(next(ids), "send", stream_of("b", mb), (after,), peer="pp-1", nbytes=p2p_bytes,
                          tag=f"grad.c{s - 1}.m{mb}"))
        all_streams = {"compute": tuple(compute)}
        if dp > 1:
            all_streams["comm"] = (Instr(next(ids), "all_reduce", "comm", (last_bwd,), group="dp", nbytes=dp_bytes,
                                         tag=f"dp.grad.c{s}"),)
        all_streams.update({k: tuple(v) for k, v in streams.items()})
        progs.append(all_streams)
    ranks = {}
    shared = [RankProgram(st, {"param": static}) for st in progs]
    for r in range(strategy.world):
        s = strategy.coords(r)["pp"]
        ranks[r] = shared[s] if share else RankProgram(progs[s], {"param": static})
    return Program(ranks, strategy, {"global_batch": m * dp, "seq_len": 1, "microbatches": m, "mbs": 1,
                                     "schedule": schedule, "kind": "train_step"})


def test_orders_are_canonical_1f1b():
    assert order_1f1b(4, 4, 0) == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("fwd", 3), ("bwd", 0), ("bwd", 1),
                                   ("bwd", 2), ("bwd", 3)]
    assert order_1f1b(4, 8, 3) == [p for i in range(8) for p in (("fwd", i), ("bwd", i))]
    for pp, m in [(2, 4), (4, 8)]:
        for s in range(pp):
            o = order_1f1b(pp, m, s)
            assert sorted(o) == sorted(order_gpipe(pp, m, s))


def test_builder_shares_programs_per_stage():
    p = pipeline(2, 4, dp=2, tp=2, tp_bytes=8, dp_bytes=8)
    assert p.world == 8
    assert len(p.classes()) == 2
