"""Search quality and speed; prints one JSON object.

Quality: llama2-13b on 64 devices of a800-16x8 (global batch 256 x 4096 tokens). The exact
optimum comes from the enumerated space (every strategy scored by the simulator or bounded
below the optimum); the search as shipped (TPE with its bound-guided local search), plain
random search and TPE alone then get a budget of 10% of the space each, over 5 seeds, and
report their gap to the optimum's tokens/s (a fraction). The runs share one cache
of simulated strategies (the same strategy is the same simulation), so each run's seconds
are its sampling time plus the simulations it was first to ask for; ``*_evaluations`` counts
the distinct strategies each run scored.

Speed: 500 TPE trials for llama2-70b on 1024 devices (a800-128x8, global batch 2048), from an
empty cache, in wall and CPU seconds (the target is under 120 s on one core).

    python benchmarks/search_bench.py [--quick] [--cache outcomes.pkl]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import sys
import time

from parashift import search

QUALITY = dict(model="llama2-13b", cluster="a800-16x8", devices=64, global_batch=256, seq_len=4096)
SPEED = dict(model="llama2-70b", cluster="a800-128x8", devices=1024, global_batch=2048, seq_len=4096)


def log(msg: str) -> None:
    print(f"search_bench: {msg}", file=sys.stderr, flush=True)


_WORKER: dict = {}


def _init(q: dict) -> None:
    _WORKER["ev"] = search.SimEvaluator(q["model"], q["cluster"], global_batch=q["global_batch"],
                                       seq_len=q["seq_len"])


def _score(key: str):
    from parashift import Strategy
    return key, _WORKER["ev"](Strategy.parse(key))


def fill_in_parallel(space, ev, workers: int) -> None:
    """Score, on ``workers`` processes, the strategies the exhaustive search will visit (in
    decreasing upper bound, until the bound falls below the best score), into ``ev.cache``."""
    import multiprocessing as mp
    bound = ev.evaluate.throughput_bound
    order = sorted(space.enumerate(), key=lambda s: -bound(s))
    best, i, chunk = 0.0, 0, 4 * workers
    with mp.get_context("fork").Pool(workers, initializer=_init, initargs=(QUALITY,)) as pool:
        while i < len(order) and bound(order[i]) >= best:
            keys = [str(s) for s in order[i:i + chunk]]
            for key, out in pool.map(_score, keys):
                ev.cache[key] = out
                if out.ok:
                    best = max(best, out.tokens_per_s)
            i += chunk


def quality(seeds: int, cache_path: str | None, workers: int = 1) -> dict:
    q = QUALITY
    space = search.make_space(q["model"], q["cluster"], devices=q["devices"], global_batch=q["global_batch"],
                              seq_len=q["seq_len"])
    saved = _load(cache_path)
    ev = search.CachedEvaluator(search.SimEvaluator(q["model"], q["cluster"], global_batch=q["global_batch"],
                                                    seq_len=q["seq_len"]), saved.get("cache"))
    t0, c0 = time.perf_counter(), time.process_time()
    if not saved and workers > 1:
        fill_in_parallel(space, ev, workers)
    ex = search.exhaustive(space, ev)
    opt = ex.best.tokens_per_s
    timing = saved.get("exhaustive") or {"exhaustive_seconds": time.perf_counter() - t0,
                                         "exhaustive_cpu_seconds": time.process_time() - c0}
    log(f"optimum {ex.best} ({ex.evaluated} of {ex.space_size} strategies scored, {ex.seconds:.0f} s)")
    out: dict = {"setting": q, "space_size": ex.space_size, "optimum": str(ex.best.strategy),
                 "optimum_tokens_per_s": opt, **timing, "exhaustive_evaluated": ex.evaluated,
                 "exhaustive_bounded": ex.bounded, "exhaustive_from_cache": bool(saved)}
    budget = math.ceil(0.1 * ex.space_size)
    out["budget"] = budget
    # tpe: the search as shipped (TPE + bound-guided local search); random: plain random search;
    # tpe_plain: TPE alone (an ablation of the local search)
    runs = {"tpe": ("tpe", True), "random": ("random", False), "tpe_plain": ("tpe", False)}
    for name, (sampler, local) in runs.items():
        gaps, secs, evals, best = [], [], [], []
        for seed in range(seeds):
            t = time.perf_counter()
            r = search.tune(q["model"], q["cluster"], devices=q["devices"], global_batch=q["global_batch"],
                            seq_len=q["seq_len"], n_trials=budget, seed=seed, sampler=sampler, space=space,
                            evaluate=ev.evaluate, cache=ev.cache, local_search=local)
            secs.append(time.perf_counter() - t)
            gaps.append(max(0.0, 1.0 - r.best.tokens_per_s / opt) if r.best else 1.0)
            evals.append(int(r.trials.loc[r.trials["simulated"] | (r.trials["status"] == "infeasible"),
                                          "strategy"].nunique()))
            best.append(str(r.best.strategy) if r.best else None)
            log(f"{name} seed {seed}: gap {gaps[-1]:.4f} ({best[-1]}), {secs[-1]:.1f} s")
        out[f"{name}_gaps"] = gaps
        out[f"{name}_seconds"] = secs
        out[f"{name}_evaluations"] = evals
        out[f"{name}_best"] = best
        out[f"{name}_within_2pct"] = sum(g <= 0.02 for g in gaps)
        out[f"{name}_median_gap"] = statistics.median(gaps)
    if cache_path:
        with open(cache_path, "wb") as f:
            pickle.dump({"cache": ev.cache, "exhaustive": timing}, f)
    out["tpe_beats_random"] = (statistics.mean(out["tpe_gaps"]) < statistics.mean(out["random_gaps"])
                               or out["tpe_within_2pct"] > out["random_within_2pct"])
    out["tpe_vs_random_mean_gap_ratio"] = ((statistics.mean(out["tpe_gaps"]) + 1e-12)
                                           / (statistics.mean(out["random_gaps"]) + 1e-12))
    return out


def _load(path: str | None) -> dict:
    """A cache of simulated outcomes saved by an earlier run of this benchmark (same code)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        return pickle.load(f)


def speed(trials: int) -> dict:
    s = SPEED
    t0, c0 = time.perf_counter(), time.process_time()
    r = search.tune(s["model"], s["cluster"], devices=s["devices"], global_batch=s["global_batch"],
                    seq_len=s["seq_len"], n_trials=trials, seed=0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    counts = r.trials["status"].value_counts().to_dict()
    log(f"{trials} trials of {s['model']} on {s['devices']} devices: {wall:.0f} s wall, {cpu:.0f} s CPU")
    return {"setting": s, "trials": trials, "wall_seconds": wall, "cpu_seconds": cpu,
            "simulations": r.evaluations,  # distinct strategies scored (memory precheck included)
            "simulated": int(r.trials.loc[r.trials["simulated"].fillna(False).astype(bool), "strategy"].nunique()),
            "statuses": {k: int(v) for k, v in counts.items()},
            "best": str(r.best.strategy) if r.best else None,
            "best_tokens_per_s": r.best.tokens_per_s if r.best else None, "target_seconds": 120}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds and 100 speed trials (a smoke run)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--workers", type=int, default=1, help="processes scoring the exhaustive optimum "
                    "(its seconds are then wall time over all of them)")
    ap.add_argument("--cache", help="pickle of simulated outcomes to reuse and update (the exhaustive "
                    "optimum's timing is kept from the run that filled it)")
    a = ap.parse_args()
    out: dict = {}
    if not a.skip_quality:
        out.update(quality(2 if a.quick else 5, a.cache, a.workers))
    if not a.skip_speed:
        out["speed_70b_1024"] = speed(100 if a.quick else 500)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
