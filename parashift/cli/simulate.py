"""`parashift simulate`: compile a strategy and simulate one training step on a modeled cluster."""
from __future__ import annotations

import argparse
import time

from ..validate import check_step_size
from .dialect import format_bytes
from .options import add_batch_options, add_cost_model, load_cost_model, strategy_text

HELP = "simulate one training step of a model under a strategy on a cluster (step time, MFU, memory)"
OUTPUTS = {"timeline": "file", "plot": "image"}
OUTPUT_FLAGS = {"timeline": "--timeline"}
ALIASES = {"--trace": "--timeline"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-70b (see `parashift models`)")
    p.add_argument("--cluster", required=True, help="cluster preset, e.g. a800-16x8")
    p.add_argument("--strategy", required=True, type=strategy_text, help='e.g. "dp=4,tp=8,pp=4,zero=1"')
    add_batch_options(p)
    add_cost_model(p)
    p.add_argument("--timeline", metavar="JSON", help="write the timeline as a Chrome trace JSON file (was --trace)")
    p.add_argument("--plot", help="write a Gantt chart of the timeline (PNG)")


def run(args: argparse.Namespace) -> dict:
    from .. import cluster as clusters, models
    from ..errors import ClusterError
    from ..ir import compile as ir_compile
    from ..ir.step_meta import StepMeta
    from ..sim import CostModel, simulate
    from ..strategy import Strategy

    model = models.get(args.model)
    cl = clusters.get(args.cluster)
    strategy = Strategy.parse(args.strategy).validate(model)
    if strategy.world > cl.devices:
        raise ClusterError(f"strategy {strategy} needs {strategy.world} devices but {cl.name} has {cl.devices}; "
                           f"use a bigger cluster, e.g. {cl.with_devices(strategy.world).name}")
    cost = load_cost_model(args.cost_model) or CostModel.for_cluster(cl)
    check_step_size(args.global_batch, strategy.dp, strategy.mbs, strategy.pp)
    program = ir_compile(model, strategy, global_batch=args.global_batch, seq_len=args.seq_len)
    t0 = time.perf_counter()
    res = simulate(program, cl, cost)
    sim_seconds = time.perf_counter() - t0
    out = res.summary()
    out["sim_seconds"] = sim_seconds
    trace_ranks = _sample_ranks(program, strategy)
    if args.timeline:
        res.to_chrome_trace(args.timeline, ranks=trace_ranks)
    if args.plot:
        res.plot_timeline(args.plot, ranks=trace_ranks)
    mem = res.memory_summary()
    out.update({"model": model.name, "cluster": cl.name, "strategy": str(strategy), "devices": strategy.world,
                "microbatches": StepMeta.of(program).microbatches, "events": res.events,
                "memory_dominant": mem["dominant"], "memory_states": mem["states"],
                "memory_activations": mem["activations"]})
    return out


def _sample_ranks(program, strategy) -> list[int]:
    """One rank per pipeline stage (tp=0, dp=0) when the world is large, else every rank."""
    if program.world <= 16:
        return sorted(program.ranks)
    return [int(strategy.rank(0, 0, s)) for s in range(strategy.pp)]


def render(result: dict, args: argparse.Namespace) -> None:
    print(f"{result['model']} on {result['cluster']} with {result['strategy']} "
          f"({result['devices']} devices, {result['microbatches']} micro-batches)")
    print(f"  step time      {result['step_time']:.4f} s")
    print(f"  throughput     {result['tokens_per_s']:,.0f} tokens/s")
    print(f"  MFU            {result['mfu'] * 100:.1f} %")
    print(f"  bubble         {result['bubble_fraction'] * 100:.1f} %")
    print(f"  peak memory    {format_bytes(result['peak_memory_max'])} per device (max); "
          f"{'fits' if result['fits'] else 'DOES NOT FIT'}; dominated by {result['memory_dominant']} "
          f"(states {format_bytes(result['memory_states'])}, activations "
          f"{format_bytes(result['memory_activations'])})")
    print(f"  simulated in   {result['sim_seconds']:.3f} s ({result['events']} events)")
    if args.timeline:
        print(f"  timeline       {args.timeline}")
    if args.plot:
        print(f"  plot           {args.plot}")
