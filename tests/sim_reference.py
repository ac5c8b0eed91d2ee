"""Reference figures for the compile + simulate speed work (issue #18 item 8).

A fixed list of configurations covering every schedule and parallelism the compiler lowers; for
each, a digest of the compiled Program (every distinct RankProgram's instructions as text, its static
memory, and which ranks share it) and the simulated figures (step time, peak memory per device,
bytes per link class, event count, and a digest of every simulated record). Speed changes must
leave all of them identical: ``tests/test_sim_reference.py`` compares against the stored JSON.

Regenerate (only when a change is *meant* to alter results):
``python tests/sim_reference.py --write``
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

from parashift import cluster as clusters, models
from parashift.ir import compile as ir_compile
from parashift.sim import CostModel, simulate
from parashift.strategy import Strategy

PATH = pathlib.Path(__file__).with_name("data") / "sim_reference.json"

#: name -> (model, cluster, strategy, global_batch, seq_len)
CONFIGS = {
    "1f1b_dp_tp": ("tiny-gpt", "a100-1x8", "dp=2,tp=2,pp=2", 16, 128),
    "1f1b_zero1_rc": ("llama2-7b", "a100-64x8", "dp=4,tp=2,pp=4,zero=1,recompute=full", 64, 1024),
    "gpipe_fused": ("gpt3-1.3b", "a100-1x8", "dp=2,pp=4,schedule=gpipe", 16, 512),
    "1f1b_fused_zero2": ("gpt3-1.3b", "a100-64x8", "dp=8,pp=4,zero=2", 64, 512),
    "zero3_pp": ("llama2-7b", "a100-64x8", "dp=8,pp=2,zero=3,recompute=selective", 32, 1024),
    "interleaved": ("llama2-7b", "a100-64x8", "dp=2,tp=4,pp=4,vpp=2", 32, 1024),
    "interleaved_sp": ("llama2-13b", "a100-64x8", "dp=2,tp=4,pp=4,vpp=2,sp=1", 32, 1024),
    "zb_h1": ("llama2-7b", "a100-64x8", "dp=2,tp=2,pp=4,schedule=zb-h1", 32, 1024),
    "zb_h1_fused": ("gpt3-1.3b", "a100-1x8", "dp=2,pp=4,schedule=zb-h1", 32, 512),
    "zb_2p": ("llama2-7b", "a100-64x8", "dp=2,tp=2,pp=4,zero=1,schedule=zb-2p", 32, 1024),
    "zb_v_moe": ("qwen1.5-moe-a2.7b", "a100-64x8", "dp=4,tp=2,pp=2,ep=2,vpp=2,schedule=zb-v", 32, 1024),
    "dualpipev_moe": ("tiny-moe", "a100-64x8", "dp=4,pp=2,ep=2,vpp=2,schedule=dualpipev", 32, 128),
    "dualpipev_sp_cp": ("llama2-7b", "a100-64x8", "dp=2,tp=2,pp=4,cp=2,sp=1,vpp=2,schedule=dualpipev", 32, 1024),
    "cp_ring": ("llama2-7b", "a100-64x8", "dp=2,tp=2,pp=2,cp=2", 16, 2048),
    "moe_ep": ("qwen1.5-moe-a2.7b", "a100-64x8", "dp=8,tp=2,pp=2,ep=4,zero=1", 64, 1024),
    "moe_ep_interleaved": ("qwen3-30b-a3b", "a100-64x8", "dp=4,tp=2,pp=4,vpp=2,ep=2", 32, 1024),
    "pp16_many_mb": ("gpt3-175b", "a100-64x8", "dp=2,tp=8,pp=16,recompute=full", 256, 2048),
}
#: the benchmark's full-scale cases (minutes at the old speed: checked with ``--big``, not in the test)
BIG = {
    "gpt-1t_3072": ("gpt:layers=128,hidden=25600,heads=160,vocab=51200,gated=false,bias=true,norm=ln,"
                    "pos_emb=learned,tied=true,dtype=fp16,flash_attention=false", "a100-384x8",
                    "dp=6,tp=8,pp=64,mbs=1,recompute=full", 3072, 2048),
    "llama2-70b_1024": ("llama2-70b", "a800-128x8", "dp=32,tp=8,pp=4,zero=1", 2048, 4096),
}


def _digest(parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\n")
    return h.hexdigest()


def figures(name: str) -> dict:
    """The compiled Program's digest and the simulated figures of configuration ``name``."""
    model, cl, strategy, gb, seq = {**CONFIGS, **BIG}[name]
    c = clusters.get(cl)
    prog = ir_compile(models.get(model), Strategy.parse(strategy), global_batch=gb, seq_len=seq)
    first: dict[int, int] = {}
    share = [first.setdefault(id(prog.ranks[r]), r) for r in sorted(prog.ranks)]
    progs = []
    for r in sorted(set(share)):
        rp = prog.ranks[r]
        lines = [f"rank {r}", json.dumps(sorted(rp.static_memory.items()))]
        for s in sorted(rp.streams):
            lines.append(f"stream {s}")
            lines += [str(i) for i in rp.streams[s]]
        progs.append(_digest(lines))
    res = simulate(prog, c, CostModel.for_cluster(c))
    # the carried model spec and its precision (StepMeta) are the model itself: tests/test_step_meta.py checks them
    meta = {k: v for k, v in prog.meta.items() if k not in ("model_spec", "precision")}
    recs = sorted((r, s, i.id, repr(a), repr(b)) for r, s, i, a, b in res.raw.records)
    return {"program": _digest(progs + [json.dumps(share), json.dumps(sorted(meta.items()), default=str)]),
            "instructions": prog.num_instructions(), "step_time": repr(res.step_time),
            "bubble_fraction": repr(res.bubble_fraction), "mfu": repr(res.mfu),
            "peak_memory": _digest(f"{d} {p}" for d, p in sorted(res.peak_memory.items())),
            "peak_memory_max": res.peak_memory_max,
            "link_bytes": {k: repr(v) for k, v in sorted(res.link_bytes.items())},
            "events": res.events, "records": _digest(" ".join(map(str, x)) for x in recs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help=f"store the figures in {PATH}")
    ap.add_argument("--only", help="comma-separated configuration names")
    ap.add_argument("--big", action="store_true", help="the full-scale cases too (slow)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS) + (list(BIG) if args.big else [])
    stored = json.loads(PATH.read_text()) if PATH.exists() else {}
    bad = []
    for n in names:
        f = figures(n)
        if args.write:
            stored[n] = f
        elif stored.get(n) != f:
            bad.append(n)
        print(n, "ok" if stored.get(n) == f else "DIFFERS", flush=True)
    if args.write:
        PATH.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    if bad:
        raise SystemExit(f"differ: {bad}")


if __name__ == "__main__":
    main()
