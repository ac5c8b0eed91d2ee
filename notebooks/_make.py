"""Write the exploration notebooks (nbformat v4, no outputs): ``python notebooks/_make.py``.

The .ipynb files are what ships; this script is how they are kept consistent. Each notebook runs
top to bottom in a fresh kernel on a laptop CPU in under two minutes (tests/test_notebooks.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
%matplotlib inline
import tempfile
from pathlib import Path
import pandas as pd
import parashift as ps
from parashift import plots      # every plot_* both displays inline and writes its file
pd.set_option("display.width", 160)
pd.set_option("display.max_columns", 20)
OUT = Path(tempfile.mkdtemp(prefix="parashift-notebook-"))   # the figures are saved here
print("figures go to", OUT)"""


def nb01() -> list:
    return [
        new_markdown_cell("""\
# 01 · Explore strategies and schedules

Describe a model and a cluster, then let the simulator score parallel strategies (DP x TP x PP, ZeRO)
and pipeline schedules (1F1B, interleaved 1F1B, zero-bubble ZB-H1, DualPipeV): step time, pipeline
bubble, memory per device and the timeline of every device. Everything here is simulated on the CPU in
seconds; nothing needs a GPU."""),
        new_code_cell(SETUP),
        new_markdown_cell("## The model and the cluster"),
        new_code_cell("""\
model = ps.models.get("llama2-70b")
cluster = ps.cluster.get("a800-16x8")
print(model.name, f"{model.params / 1e9:.1f}B parameters,", model.layers, "layers, hidden", model.hidden)
print(cluster.name, cluster.devices, "devices,", cluster.per_node, "per node,",
      f"{cluster.memory / 2**30:.0f} GiB each;", cluster.gpu.interconnect)"""),
        new_markdown_cell("""\
## Strategies side by side

Each strategy uses all 128 devices. `ps.explore.simulate_fitting` tries activation recompute `none`, then
`selective`, then `full`, and keeps the lightest that fits in device memory."""),
        new_code_cell("""\
GLOBAL_BATCH, SEQ_LEN = 128, 4096
rows, results = [], {}
for text in ["dp=4,tp=8,pp=4,zero=1", "dp=8,tp=8,pp=2,zero=1", "dp=2,tp=8,pp=8,zero=1", "dp=8,tp=4,pp=4,zero=1"]:
    s, res, tried = ps.explore.simulate_fitting(model.name, cluster.name, ps.Strategy.parse(text),
                                     global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    results[text] = res
    rows.append({"strategy": text, "recompute": s.recompute, "step time (s)": res.step_time,
                 "tokens/s": res.tokens_per_s, "MFU (%)": 100 * res.mfu, "bubble (%)": 100 * res.bubble_fraction,
                 "peak memory (GiB)": res.peak_memory_max / 2**30, "fits": res.fits})
strategies = pd.DataFrame(rows).round(2)
strategies"""),
        new_markdown_cell("""\
## Schedules side by side

One strategy (`dp=4,tp=8,pp=4,zero=1`) under four pipeline schedules; interleaved 1F1B and DualPipeV run
two model chunks per pipeline rank (`vpp=2`)."""),
        new_code_cell("""\
from parashift.explore import compare_schedules, stage_ranks

table, runs = compare_schedules(model.name, cluster.name, "dp=4,tp=8,pp=4,zero=1",
                                global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
table.round(3)"""),
        new_code_cell("""\
ax = table.set_index("schedule")[["step_time_s"]].plot.bar(legend=False, figsize=(6, 3), rot=0)
ax.set_ylabel("simulated step time (s)")
ax2 = ax.twinx()
ax2.plot(range(len(table)), 100 * table["bubble_fraction"], "o-", color="#C44E52")
ax2.set_ylabel("bubble (%)", color="#C44E52")
ax.figure.savefig(OUT / "schedules.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## Timelines

One rank per pipeline stage (the others are symmetric). Colours are phases (forward, backward,
input/weight gradients) and communication kinds; compare where the bubbles sit."""),
        new_code_cell("""\
first, best = "1f1b", table.loc[table["step_time_s"].idxmin(), "schedule"]
panels = {f"{k}: {runs[k].strategy}": runs[k].result.timeline_of(stage_ranks(runs[k].strategy)) for k in (first, best)}
plots.plot_gantt(panels, OUT / "timelines.png", max_devices=4)"""),
        new_markdown_cell("""\
## Memory

Peak memory on the fullest device, split into model states (parameters, gradients, optimizer) and
activations, against what a device can use; then the bytes in use over one step on each stage."""),
        new_code_cell("""\
mem = table.assign(states=table["states_gib"] * 2**30, activations=table["activations_gib"] * 2**30,
                   buffers=table["buffers_gib"] * 2**30)
cm = runs[first].result.cost_model
plots.plot_memory(mem, OUT / "memory.png", capacity=cm.memory_capacity - cm.memory_reserved)"""),
        new_code_cell("""\
res = runs[best].result
mt = res.memory_timeline(stage_ranks(runs[best].strategy))
fig, ax = plots.pyplot().subplots(figsize=(8, 3))
for dev, d in mt.groupby("device"):
    ax.step(d["time"], d["bytes"] / 2**30, where="post", label=f"device {dev}")
ax.set_xlabel("time (s)"); ax.set_ylabel("GiB in use"); ax.legend(fontsize=7); ax.set_title(f"{best}: memory over one step")
fig.savefig(OUT / "memory_over_step.png", dpi=110, bbox_inches="tight")"""),
        new_code_cell("""\
frame = res.memory_frame().drop_duplicates(["param", "activations"])     # one row per pipeline stage
gib = ["param", "grad", "master", "optim", "activations", "peak", "capacity"]
frame[["device", "rank"] + gib + ["fits"]].assign(**{c: frame[c] / 2**30 for c in gib}).round(2)  # GiB"""),
        new_markdown_cell("""\
The same numbers come from the command line:

```
parashift simulate --model llama2-70b --cluster a800-16x8 --strategy dp=4,tp=8,pp=4,zero=1 \\
    --global-batch 128 --seq-len 4096 --trace trace.json --plot timeline.png
```"""),
    ]


def nb02() -> list:
    return [
        new_markdown_cell("""\
# 02 · Switch plans

A switch moves the training state (parameters, fp32 master copy, Adam moments) from one strategy and
set of devices to another, in memory. Here: llama2-70b trains as `dp=4,tp=8,pp=4,zero=1` on 128 A800s;
node 5 (devices 40-47) is lost and the job continues as `dp=3,tp=8,pp=5,zero=1` on the other 120."""),
        new_code_cell(SETUP),
        new_code_cell("""\
from parashift.explore import bytes_matrix, node_bytes, ablation, lower_and_simulate

MODEL, CLUSTER, SRC = "llama2-70b", "a800-16x8", "dp=4,tp=8,pp=4,zero=1"
plan = ps.vps.plan_switch(MODEL, SRC, "dp=3,tp=8,pp=5,zero=1", cluster=CLUSTER,
                          src_devices=ps.cluster.parse_devices("0-127"),
                          dst_devices=ps.cluster.parse_devices("0-39,48-127"))   # node 5 (devices 40-47) is gone
plan.verify()          # every destination element is covered exactly once, by a device that holds it
plan"""),
        new_markdown_cell("## The plan as a table"),
        new_code_cell("""\
stats = pd.Series(plan.stats())
stats[[k for k in stats.index if k.startswith("bytes")]] / 2**30   # GiB"""),
        new_code_cell("""\
pieces = plan.to_frame()
pieces["moved"] = pieces["src"] != pieces["dst"]
print(len(pieces), "pieces")
pieces.head(8)"""),
        new_code_cell("""\
(pieces.groupby(["kind", "moved"])["nbytes"].sum() / 2**30).unstack("moved").rename(
    columns={False: "kept (GiB)", True: "moved (GiB)"}).round(2)"""),
        new_markdown_cell("""\
## Bytes between devices

First device to device (only moved bytes are drawn: what a device keeps in place costs nothing),
then the same summed per node. Most bytes stay inside a node's neighbourhood of pipeline stages."""),
        new_code_cell("""\
plots.plot_bytes_heatmap(bytes_matrix(plan), OUT / "device_bytes.png", title="bytes moved between devices")"""),
        new_code_cell("""\
plots.plot_bytes_heatmap(node_bytes(plan), OUT / "node_bytes.png", title="bytes moved between nodes",
                         src_label="source node", dst_label="destination node")"""),
        new_markdown_cell("""\
## The transition engine and its ablation

`vps.transition.lower` turns the plan into a switch Program: it picks each piece's source (cheapest
link, balanced NICs), promotes fan-outs to broadcasts, stages the switch under a memory budget,
coalesces pieces into one message per device pair, and orders point-to-point rounds by XOR pairing
(deadlock-free). Below, each pass is turned off alone and the switch is simulated again."""),
        new_code_cell("""\
abl = ablation(plan)
abl.round(3)"""),
        new_code_cell("""\
plots.plot_bars(list(abl["passes"]), list(abl["switch_s"]), OUT / "ablation.png", ylabel="simulated switch time (s)",
                title="switch time with each pass turned off")"""),
        new_markdown_cell("""\
With a memory budget per device the engine splits the switch into stages, freeing old buffers as it
goes; the staging pass matters only then."""),
        new_code_cell("""\
budget_gib = 16
rows = [{"stage pass": on, **lower_and_simulate(plan, memory_budget=budget_gib * 2**30, stage=on)} for on in (True, False)]
staged = pd.DataFrame(rows)
staged["within 16 GiB budget"] = staged["peak_memory_gib"] <= budget_gib
staged[["stage pass", "stages", "switch_s", "peak_memory_gib", "within 16 GiB budget"]].round(3)"""),
        new_markdown_cell("""\
## Placement: which device takes which rank

The destination device list fixes *which* devices run the new layout; its order decides how much of
each device's new state it already holds. `placement="keep"` orders the devices (only within each
node, so every group stays on its nodes) by a maximum-weight assignment of ranks to devices. Here
TP shrinks from 8 to 4 on the same 128 devices: in the given order half the TP groups take shards
their devices do not hold."""),
        new_code_cell("""\
rows = {}
for placement in ("given", "keep"):
    p = ps.vps.plan_switch(MODEL, SRC, "dp=8,tp=4,pp=4,zero=1", cluster=CLUSTER, placement=placement)
    rows[placement] = {"first node's devices in rank order": p.dst_devices[:8],
                       "moved (GiB)": p.stats()["bytes_moved"] / 2**30, "kept (GiB)": p.stats()["bytes_kept"] / 2**30}
pd.DataFrame(rows).T"""),
        new_markdown_cell("""\
## What a node loss costs

The hot switch against checkpoint-restart (save under the old layout, restart the job, load and
reshard), then the throughput the job keeps on 120 devices."""),
        new_code_cell("""\
sw = lower_and_simulate(plan)
ck = ps.sim.estimate_checkpoint_restart(plan.model, plan.src_strategy, plan.dst_strategy, plan.cluster)
cost = pd.DataFrame({"seconds": {"hot switch (simulated)": sw["switch_s"], "checkpoint: save": ck.save_seconds,
                                 "checkpoint: restart": ck.restart_seconds, "checkpoint: load + reshard": ck.load_seconds,
                                 "checkpoint-restart total": ck.total_seconds}})
cost.round(2)"""),
        new_code_cell("""\
steps = {}
for name, s in (("before (128 devices)", plan.src_strategy), ("after (120 devices)", plan.dst_strategy)):
    prog = ps.ir.compile(plan.model, s.replace(recompute="selective"), global_batch=120, seq_len=4096)
    r = ps.sim.simulate(prog, plan.cluster)
    steps[name] = {"strategy": str(s), "step time (s)": r.step_time, "tokens/s": r.tokens_per_s, "fits": r.fits}
steps = pd.DataFrame(steps).T
lost_tokens = {k: float(steps.loc["before (128 devices)", "tokens/s"]) * v
               for k, v in (("hot switch", sw["switch_s"]), ("checkpoint-restart", ck.total_seconds))}
display(steps)
pd.Series(lost_tokens, name="tokens not trained during the reconfiguration").map("{:,.0f}".format)"""),
        new_markdown_cell("""\
From the command line:

```
parashift plan --model llama2-70b --src dp=4,tp=8,pp=4,zero=1 --dst dp=3,tp=8,pp=5,zero=1 \\
    --cluster a800-16x8 --dst-devices 0-39,48-127 --simulate
```"""),
    ]


def nb03() -> list:
    return [
        new_markdown_cell("""\
# 03 · Autotune and deploy: the closed loop

Calibrate the simulator on this machine (a few short live probe runs), let an Optuna search pick the
fastest strategy for a small GPT on up to 4 CPU processes with the fitted cost model, see why the
winner won, then run the winner and the runner-up for real on gloo processes and check the predicted
ranking against the measured one."""),
        new_code_cell(SETUP),
        new_markdown_cell("## Calibrate `cpu-local`"),
        new_code_cell("""\
MODEL, CLUSTER, BATCH, SEQ = "tiny-gpt", "cpu-local", 12, 32
probes = ps.calibrate.run_probes(MODEL, ps.calibrate.probe_strategies(MODEL, 4, 3, global_batch=BATCH),
                                 global_batch=BATCH, seq_len=SEQ, steps=2)
fitted = ps.calibrate.fit([p.timeline for p in probes], CLUSTER, programs=[p.program for p in probes])
fitted.cost_model.save(str(OUT / "cost.json"))
fitted.steps[["source", "measured", "predicted", "base_predicted"]]"""),
        new_markdown_cell("## Search with the fitted cost model, and why the winner won"),
        new_code_cell("""\
search = ps.search.tune(MODEL, CLUSTER, devices=4, global_batch=BATCH, seq_len=SEQ, n_trials=30, seed=0,
                        cost_model=fitted.cost_model, space_options={"recompute": ("none",)})  # fits without it
pd.Series(search.counts())"""),
        new_code_cell("""\
search.explain(5)     # step split into compute / exposed communication / bubble, memory, what each lost on"""),
        new_markdown_cell("## Optuna's own plots"),
        new_code_cell("""\
import warnings
from optuna.visualization import matplotlib as ovm
with warnings.catch_warnings():
    warnings.simplefilter("ignore")          # Optuna marks its matplotlib plots experimental
    ax = ovm.plot_optimization_history(search.study, target_name="tokens/s")
ax.figure.savefig(OUT / "history.png", dpi=110, bbox_inches="tight")"""),
        new_code_cell("""\
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ax = ovm.plot_param_importances(search.study, target_name="tokens/s")
ax.figure.savefig(OUT / "importances.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## Deploy: winner and runner-up, run live

`measure` runs each strategy's Program on local gloo processes and sets the measured step time
(median after a warm-up step) next to the prediction; the runner-up is the best strategy predicted at
least 2% slower than the winner, so the pair can confirm or refute the ranking."""),
        new_code_cell("""\
table = ps.search.measure(search, steps=4)
print("ranking held:", ps.search.ranking_held(table))
table"""),
        new_markdown_cell("## Simulated vs measured, instruction by instruction"),
        new_code_cell("""\
plan_path = str(OUT / "plan.json")
search.export(plan_path)
program = ps.exec.load_plan(plan_path)
run = ps.exec.run_program(program, steps=3, timeout=300)
sim = ps.sim.simulate(program, CLUSTER, fitted.cost_model)
measured, simulated = run.to_frame(), sim.timeline
plots.plot_gantt({f"simulated, fitted cost model ({sim.step_time * 1e3:.1f} ms)": simulated,
                  f"measured, last step ({run.step_times[-1] * 1e3:.1f} ms)": measured}, OUT / "sim_vs_run.png",
                 unit="ms")"""),
        new_code_cell("""\
joined = measured.merge(simulated, on=["rank", "id"], suffixes=("_run", "_sim"), validate="one_to_one")
joined["measured_ms"] = 1e3 * (joined["end_run"] - joined["start_run"])
joined["simulated_ms"] = 1e3 * (joined["end_sim"] - joined["start_sim"])
joined["kind"] = joined["op_run"].where(joined["op_run"] != "compute", joined["phase_run"])
joined.groupby("kind")[["measured_ms", "simulated_ms"]].sum().round(2)"""),
        new_markdown_cell("""\
From the command line (`run` prints the plan's predicted step time next to the measured one):

```
parashift calibrate --runs 3 --steps 2 --global-batch 12 --seq-len 32 --out cost.json
parashift search --model tiny-gpt --cluster cpu-local --devices 4 --global-batch 12 --seq-len 32 --trials 30 --recompute none --cost-model cost.json --explain --out plan.json
parashift run plan.json --steps 4
```"""),
    ]


def nb04() -> list:
    return [
        new_markdown_cell("""\
# 04 · Replay a preemption trace

Load a real spot-instance trace shipped with parashift (Bamboo's AWS p3 trace), plan a job over it with
the switch-aware policy (per device count the best strategy, and whether a switch pays for itself),
then replay a short, time-compressed slice against a live job on this machine's processes and compare
its loss with a job that never switched."""),
        new_code_cell(SETUP + "\nfrom IPython.display import Image"),
        new_code_cell("""\
trace = ps.traces.load("bamboo/p3-trace.csv")
print(len(trace), "events over", f"{trace.attrs['duration'] / 3600:.1f} h, starting with",
      trace.attrs["initial"], "nodes")
trace.head()"""),
        new_code_cell("""\
curve = ps.traces.availability(trace)
fig, ax = plots.pyplot().subplots(figsize=(8, 2.8))
ax.step(curve["time"] / 3600, curve["available"], where="post")
ax.set_xlabel("hours"); ax.set_ylabel("nodes available"); ax.set_title("AWS p3 spot nodes (Bamboo trace)")
fig.savefig(OUT / "availability.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## Plan for the trace

The first three hours, mapped onto at most 4 local processes (8 nodes per process) and played 600x
faster. `plan_trace` searches the best strategies of a small GPT for every device count and compares
three policies: checkpoint-restart at every change, a hot switch at every change, and the switch-aware
dynamic program."""),
        new_code_cell("""\
MODEL, CLUSTER, BATCH, SEQ = "tiny-gpt", "cpu-local", 12, 32
window = ps.traces.window(trace, 0, 3 * 3600)
scaled = ps.traces.scale(window, devices_per_node=0.125, max_devices=4, time_scale=600)
tp = ps.search.plan_trace(scaled, MODEL, CLUSTER, global_batch=BATCH, seq_len=SEQ)
tp.summary()"""),
        new_code_cell("""\
tp.policy_frame("switch-aware")[["start", "end", "devices", "strategy", "switch_seconds", "tokens"]].head(10)"""),
        new_code_cell("""\
Image(tp.plot(str(OUT / "plan.png")))"""),
        new_markdown_cell("""\
## Replay a slice live

Trace minutes 20-45 (an addition, a preemption, an addition), 900x faster: the job starts on the
processes the trace allows and hot-switches at each event to the switch-aware policy's strategy; a
static job trains the same samples without switching. Each event's row says when the switch had
finished (`wall_time`), its `lag_seconds` after the event, and `late` when a preemption was handled
after its notice ran out (the job kept a device the trace had taken back)."""),
        new_code_cell("""\
rep = ps.replay.replay("bamboo/p3-trace.csv", MODEL, policy="switch-aware", max_procs=4, time_scale=900,
                     start=1200, end=2700, max_events=3, global_batch=BATCH, seq_len=SEQ)
print("every preemption handled within its notice:", rep.ok)
rep.to_frame()[["time", "wall_time", "lag_seconds", "late", "trace_time", "event", "devices", "strategy", "step",
                "pause_seconds", "lost_seconds"]]"""),
        new_code_cell("""\
pd.DataFrame({"loss": rep.losses, "static loss": rep.static_losses}).assign(
    relative_difference=lambda d: (d["loss"] - d["static loss"]).abs() / d["static loss"]).tail()"""),
        new_code_cell("""\
Image(rep.plot(str(OUT / "replay.png")))"""),
        new_markdown_cell("""\
From the command line (add `--baseline checkpoint-restart` to replay the same switches by DCP save,
restart and load):

```
parashift replay bamboo/p3-trace.csv --model tiny-gpt --strategy-policy switch-aware --max-procs 4 \\
    --time-scale 900 --from 1200 --to 2700 --max-events 3 --global-batch 12 --seq-len 32 --plot replay.png
```"""),
    ]


def nb05() -> list:
    return [
        new_markdown_cell("""\
# 05 · Program a schedule

A `Strategy` such as `dp=2,pp=2,schedule=zb-h1` is sugar: it expands to a short list of *directives*
(where regions run, how many micro-batches, how gradients sync, each stage's order of actions) that
compile into one Program, which the simulator and the runtime both take. Here we write such a list
ourselves for a small torch model of our own: annotate the model, place it in a V over two stages with
the weight gradients deferred, simulate that schedule against the built-in ones, run it live on four
local processes, and put the simulated and measured timelines side by side."""),
        new_code_cell(SETUP),
        new_markdown_cell("""\
## Annotate a model

`parashift.region(name)` marks what runs where (a no-op outside a trace); `parashift.ir.annotate(module,
name)` marks a whole submodule. To run under pipelining the model is an `nn.Sequential` whose children
hold whole regions. The worker processes import the model, so it lives in a module (written here next to
the figures); a `UserModel` bundles its builder, one example batch, the data of each step and the loss."""),
        new_code_cell("""\
%%writefile {OUT}/my_lm.py
import torch
import torch.nn as nn
import torch.nn.functional as F

import parashift
from parashift.exec import UserModel
from parashift.ir.annotate import annotate

VOCAB, D, SEQ, LAYERS = 32, 32, 8, 4


class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, h):
        with parashift.region(f"layers.{self.i}.attn"):
            z = self.norm1(h)
            h = h + self.attn(z, z, z, need_weights=False)[0]
        with parashift.region(f"layers.{self.i}.mlp"):
            return h + self.mlp(self.norm2(h))


def build():
    return nn.Sequential(annotate(nn.Embedding(VOCAB, D), "embed"), *[Block(i) for i in range(LAYERS)],
                         annotate(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, VOCAB)), "head"))


def data(step):                      # the global batch of a step: 8 sequences, next token = 3x + 1
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
    x[:, 1:] = (3 * x[:, :-1] + 1) % VOCAB
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


job = UserModel(build, torch.zeros(1, SEQ, dtype=torch.int64), data, loss, name="my-lm")"""),
        new_code_cell("""\
import sys
sys.path.insert(0, str(OUT))
import my_lm

graph = ps.ir.trace(my_lm.build(), my_lm.job.example_input)     # on meta tensors: no memory, no compute
graph.to_frame()[["region", "kind", "layer", "flops", "params", "act"]]"""),
        new_markdown_cell("""\
## What a strategy expands to

`parashift schedule --directives` prints the list for a preset; `strategy_directives` does it for any
layer count. Compiling the printed list gives the strategy's own Program (the test suite checks that):

```
parashift schedule --model tiny-gpt --strategy dp=2,pp=2,schedule=zb-h1 --global-batch 8 --directives
```"""),
        new_code_cell("""\
from parashift import directives as d
print(d.format_directives(d.strategy_directives("dp=2,pp=2,schedule=zb-h1", layers=4, global_batch=8)))"""),
        new_markdown_cell("""\
## Write a schedule

A V: chunks 0 and 3 on stage 0, chunks 1 and 2 on stage 1, so the last chunk (with the loss) sits on the
first stage and the turn at the bottom of the V needs no transfer. The backward is split into input
gradients (`I`, on the critical path) and weight gradients (`W`), and every stage defers all its `W`s to
the end of the step. Gradients sync over two data-parallel replicas on a stream of their own, `grads`."""),
        new_code_cell("""\
custom = [
    d.Place({"embed": 0, "layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 3, "head": 3},
            stages=(0, 1, 1, 0)),
    d.Replicate("*", over="dp", ways=2),
    d.Split(microbatches=4, backward=True),
    d.Order({0: "0F0 0F1 0F2 3F0 3I0 3F1 3I1 0I0 0F3 0I1 3F2 3I2 3F3 3I3 0I2 0I3 3W0 0W0 3W1 0W1 3W2 0W2 3W3 0W3",
             1: "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 1F2 2F2 1F3 2F3 2I2 1I2 2I3 1I3 2W0 1W0 2W1 1W1 2W2 1W2 2W3 1W3"}),
    d.Stream("grads", ops=("all_reduce",)),
]
program, _ = ps.exec.compile_user_model(my_lm.job, directives=custom, global_batch=8)
program.validate()
print(program.strategy, "| streams of rank 0:", sorted(program.ranks[0].streams))"""),
        new_markdown_cell("""\
## Simulate it against the built-in schedules

The same model under built-in strategies on the same four devices, and the custom list, simulated on
`cpu-local` (the machine they will run on):"""),
        new_code_cell("""\
builtin = ["dp=2,pp=2", "dp=2,pp=2,schedule=gpipe", "dp=2,pp=2,schedule=zb-h1", "dp=2,pp=2,vpp=2,schedule=dualpipev"]
programs = {s: ps.exec.compile_user_model(my_lm.job, s, global_batch=8)[0] for s in builtin}
programs["custom V, deferred W"] = program
sims = {name: ps.sim.simulate(p, "cpu-local") for name, p in programs.items()}
table = pd.DataFrame([{"schedule": n, "step_ms": 1e3 * r.step_time, "bubble": r.bubble_fraction,
                       "peak_MiB": r.peak_memory_max / 2**20} for n, r in sims.items()]).set_index("schedule")
table.round(3)"""),
        new_code_cell("""\
plots.plot_bars(list(table.index), list(table["step_ms"]), OUT / "schedules.png", ylabel="simulated step (ms)",
                title="my-lm on 4 cpu-local devices")"""),
        new_markdown_cell("""\
The Program of the list carries the label of the registered schedule with the same placement and
backward (`dualpipev` here: a V with split backward), but its order is the list's own. Deferring every
weight gradient to the end does not pay on this model: the stages idle while waiting on each other in the
middle of the step, and zb-h1 and DualPipeV put exactly those weight gradients into that idle time.
Move a few `W`s of the `Order` text back into the gaps and simulate again."""),
        new_markdown_cell("""\
## Run it live

`run_user_model` compiles the same list, starts four processes (gloo) and trains. One process running the
model without any directive is the reference: the losses agree to 1e-5. From the command line, with the
list in a file (or inline): `parashift run --model my_lm:job --directives custom.py --steps 3`, run from
the folder holding `my_lm.py`."""),
        new_code_cell("""\
live = ps.exec.run_user_model(my_lm.job, directives=custom, steps=3, global_batch=8)
one = ps.exec.run_user_model(my_lm.job, "dp=1", steps=3, global_batch=8)
assert max(abs(a - b) for a, b in zip(live.losses, one.losses)) <= 1e-5 * max(one.losses)
pd.DataFrame({"custom schedule, 4 processes": live.losses, "one process": one.losses})"""),
        new_markdown_cell("""\
## Simulated and measured, side by side

Rows are (device, stream); the `grads` stream is its own row in both. On two shared CPU cores the
measured bars are longer and noisier than the simulation's, but the order of the work is the same."""),
        new_code_cell("""\
measured = live.to_frame()
simulated = sims["custom V, deferred W"].timeline
plots.plot_gantt({f"simulated ({1e3 * sims['custom V, deferred W'].step_time:.1f} ms)": simulated,
                  f"measured, last step ({1e3 * live.step_times[-1]:.1f} ms)": measured},
                 OUT / "custom_timelines.png", max_devices=4, unit="ms")"""),
    ]


def nb06() -> list:
    return [
        new_markdown_cell("""\
# 06 · Reinforcement-learning phases

RL post-training alternates two phases on the same devices every iteration: a *rollout* (generation,
forward only, best in a TP-heavy layout without optimizer state) and a *training* step (DP / PP / ZeRO).
Here the weights switch between the two layouts in memory every iteration while the optimizer state
stays where it is. Plan the pair of layouts with the simulator, then run such a job for real on local
processes and look at its iteration timeline with both switches."""),
        new_code_cell(SETUP),
        new_markdown_cell("""\
## Plan: which (training, rollout) pair makes an iteration fastest?

`plan_rl` simulates the training step of each training layout, the rollout (a prefill Program, then
one decode Program per generated token) of each rollout layout, and both weight switches
(`kinds=("param",)`), and compares the best pair with the best single layout used for both phases.
The same from the command line:

```
parashift search-rl --model llama2-7b --cluster h100-16x8 --devices 8 --prompts 64 --prompt-len 512 \
    --rollout-tokens 256 --top 3
```"""),
        new_code_cell("""\
from parashift.search.rl import plan_rl

plan = plan_rl("llama2-7b", "h100-16x8", devices=8, prompts=64, prompt_len=512, rollout_tokens=256,
               train=["dp=8,zero=1", "dp=4,pp=2,zero=1", "dp=4,tp=2,zero=1", "dp=2,tp=4"])
cols = ["train", "rollout", "train_seconds", "rollout_seconds", "to_rollout_seconds", "to_train_seconds",
        "iteration_seconds"]
print("best pair:", plan.best["train"], "->", plan.best["rollout"], f"{plan.best['iteration_seconds']:.3f} s")
print("one layout for both:", plan.single["train"], f"{plan.single['iteration_seconds']:.3f} s",
      f"(the pair is {plan.speedup:.2f}x faster)")
plan.table[cols].head(8)"""),
        new_code_cell("""\
import numpy as np
plt = plots.pyplot()
rows = [("best pair", plan.best), ("one layout", plan.single)]
parts = ["train_seconds", "to_rollout_seconds", "rollout_seconds", "to_train_seconds"]
fig, ax = plt.subplots(figsize=(7, 2.6))
left = np.zeros(len(rows))
for part, colour in zip(parts, ["#55A868", "#DD8452", "#4C72B0", "#C44E52"]):
    vals = np.array([r[part] for _, r in rows])
    ax.barh([n for n, _ in rows], vals, left=left, color=colour, label=part.replace("_seconds", ""))
    left += vals
ax.set_xlabel("simulated seconds per iteration"); ax.legend(fontsize=7, ncol=4, loc="lower right")
fig.savefig(OUT / "iteration_parts.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## Simulate: decode steps are memory-bound

A decode step streams every local weight and the key/value cache for one token per sequence: its time
grows with the cache, and TP splits the weight traffic (at the price of two all-reduces per layer)."""),
        new_code_cell("""\
from parashift.sim.rollout import rollout_program
pasts = [256, 1024, 4096, 16384]
fig, ax = plt.subplots(figsize=(6, 3))
for layout in ["dp=8", "dp=4,tp=2", "tp=8"]:
    ys = [ps.sim.simulate(rollout_program("llama2-7b", layout, prompts=64, tokens=1, past=p), "h100-16x8").step_time
          for p in pasts]
    ax.plot(pasts, [1e3 * y for y in ys], marker="o", label=layout)
ax.set_xscale("log"); ax.set_xlabel("cached tokens"); ax.set_ylabel("decode step (ms)"); ax.legend(fontsize=8)
fig.savefig(OUT / "decode_steps.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## Run: a live job with phases

Four processes train `tiny-gpt` with `dp=2,tp=2,zero=1`; every iteration the weights switch to `tp=2` on
devices 0-1 (devices 2-3 idle), 6 tokens are generated greedily with a KV cache for each prompt, the
weights switch back and one step trains on the sequences. The job is checked against one process doing
the same without switching: the same tokens, the same losses."""),
        new_code_cell("""\
from parashift.exec.rl.job import run_rl
res = run_rl("tiny-gpt", "dp=2,tp=2,zero=1", "tp=2", iterations=3, rollout_tokens=6)
its = pd.DataFrame(res.iterations)
assert its["generated_equal_reference"].all() and (its["loss"] - its["reference_loss"]).abs().max() < 1e-5
its[["iteration", "loss", "reference_loss", "rollout_switch_seconds", "generate_seconds", "train_switch_seconds",
     "train_seconds", "generated_equal_reference"]]"""),
        new_code_cell("""\
tl = res.timeline()
tl = tl[tl["iteration"] > 0]                  # the first iteration includes warm-up
colours = {"rollout-switch": "#DD8452", "rollout": "#4C72B0", "train-switch": "#C44E52", "train": "#55A868"}
fig, ax = plt.subplots(figsize=(11, 2.8))
for (dev, stream), g in tl.groupby(["device", "stream"]):
    ax.broken_barh(list(zip(g["start"], g["end"] - g["start"])), (dev - 0.4, 0.8), facecolors=colours[stream],
                   linewidth=0)
ax.set_yticks(sorted(tl["device"].unique())); ax.set_ylabel("device"); ax.set_xlabel("seconds")
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], labels=list(colours),
          fontsize=7, ncol=4, loc="upper right")
ax.set_title("iterations 1-2: switch out, generate (devices 2-3 idle), switch back, train", fontsize=9)
fig.savefig(OUT / "rl_timeline.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## A bf16 rollout copy on fewer devices

`tiny-moe` trains with experts over `ep=2` on four devices; the rollout copy is bf16 (cast by the senders)
on two devices with `tp=2`. The training weights stay in fp32, so only the way out moves data."""),
        new_code_cell("""\
moe = run_rl("tiny-moe", "dp=4,ep=2,zero=1", "tp=2", iterations=2, rollout_tokens=4, dtype="bf16")
pd.DataFrame(moe.iterations)[["iteration", "loss", "reference_loss", "rollout_switch_seconds",
                              "train_switch_seconds", "generated_equal_reference"]]"""),
    ]


def nb07() -> list:
    return [
        new_markdown_cell("""\
# 07 · Deploy for real: a Hugging Face model on real text

The journey of a real job, with the commands a user types: a tiny Llama `config.json`, a tokenizer
trained on the shipped public-domain `data/lighthouse.txt` (see `data/PROVENANCE.md`), the token file,
a strategy searched on the embedded `cpu-local` cluster, training on those tokens across a hot switch next
to a static run, and the trained weights and the strategy exported (Hugging Face safetensors, Megatron-LM
arguments, a torchtitan TOML). Each cell runs `parashift` commands through the CLI's entry function and
prints them; they run unchanged in a shell."""),
        new_code_cell(SETUP + """
import contextlib, io, json, shlex
from parashift.cli import main

def sh(command):          # one `parashift ...` command line; its --json output as a dict (else its text)
    print("$", command)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(shlex.split(command)[1:])
    assert rc == 0, f"{command!r} exited {rc}"
    return json.loads(buf.getvalue()) if "--json" in command else buf.getvalue()"""),
        new_markdown_cell("""\
## A tokenizer and the token file

A byte-level BPE tokenizer of 512 tokens, trained with the `tokenizers` library on the shipped text, then
`parashift data prepare`: one document per paragraph, each ending with the end-of-text token, written as a
flat little-endian uint16 file with a JSON sidecar (dtype, document offsets, SHA-256)."""),
        new_code_cell("""\
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
TEXT = Path("..") / "data" / "lighthouse.txt"
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train([str(TEXT)], trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<|endoftext|>"],
                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
(OUT / "tokenizer").mkdir()
tok.save(str(OUT / "tokenizer" / "tokenizer.json"))
data = sh(f"parashift data prepare {TEXT} --tokenizer {OUT}/tokenizer --out {OUT}/lighthouse.bin --split paragraph --json")
print(data["tokens"], data["dtype"], "tokens in", data["documents"], "documents; vocabulary", data["vocab_size"])"""),
        new_markdown_cell("""\
## A tiny Llama, from its `config.json`

`--model hf:DIR` reads a local Hugging Face config (Llama, Qwen2/3, Mixtral, ...); nothing is downloaded.
This one is written with the standard library: 4 layers, hidden 64, grouped-query attention (4 heads, 2
KV heads), the tokenizer's vocabulary."""),
        new_code_cell("""\
LLAMA = OUT / "llama"
LLAMA.mkdir()
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": data["vocab_size"],
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32"}
(LLAMA / "config.json").write_text(json.dumps(config, indent=1))
spec = ps.models.get(f"hf:{LLAMA}")
print(f"{spec.params:,} parameters,", spec.layers, "layers, hidden", spec.hidden, "vocabulary", spec.vocab)"""),
        new_markdown_cell("""\
## Search a strategy on `cpu-local`

Two CPU processes, 8 sequences of 32 tokens per step, a few trials. The run below starts with the winner
and switches, in memory, to the best-ranked strategy of another dp/tp/pp shape."""),
        new_code_cell("""\
SHAPE = "--global-batch 8 --seq-len 32"
found = sh(f"parashift search --model hf:{LLAMA} --cluster cpu-local --devices 2 {SHAPE} --trials 8 --seed 0 "
           f"--out {OUT}/plan.json --json")
top = pd.DataFrame(found["top"])[["strategy", "step_time", "tokens_per_s", "peak_memory"]]
shapes = [(s.dp, s.tp, s.pp) for s in map(ps.Strategy.parse, top["strategy"])]
BEST = top["strategy"][0]
OTHER = next(t for t, shape in zip(top["strategy"], shapes) if shape != shapes[0])
print("start with", BEST, "then switch to", OTHER)
top"""),
        new_markdown_cell("""\
## Train on the tokens across a hot switch, and a static run

12 steps with warmup and cosine decay, clipping at 1.0. The switched run changes strategy before step 7;
the static run keeps the winner throughout and writes the trained weights as Hugging Face safetensors.
Both read the same global batch at every step (the sampler depends on the seed and the step only), so
their loss curves coincide."""),
        new_code_cell("""\
TRAIN = "--lr 3e-3 --lr-warmup-steps 2 --lr-decay cosine --min-lr 3e-4 --clip-grad 1.0"
RUN = f"parashift run --model hf:{LLAMA} --data {OUT}/lighthouse.bin --steps 12 {SHAPE} {TRAIN} --strategy {BEST} --json"
switched = sh(f"{RUN} --switch-at 6:{OTHER} --switch-notice 0")
static = sh(f"{RUN} --export-hf {OUT}/hf-export")
assert switched["samples"] == static["samples"]
diff = max(abs(a - b) for a, b in zip(switched["losses"], static["losses"]))
print(f"largest loss difference, switched vs static: {diff:.2e}")
assert diff < 1e-5"""),
        new_code_cell("""\
plots.plot_losses({f"hot switch {BEST} -> {OTHER}": switched["losses"], f"static {BEST}": static["losses"]},
                  OUT / "loss.png", marks=[(6, "hot switch")], title="tiny Llama on lighthouse.txt")"""),
        new_code_cell("""\
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(7, 3))
steps = range(1, 13)
ax.plot(steps, switched["grad_norm"], "o-", label="gradient norm (before clipping)")
ax.axhline(1.0, color="grey", lw=0.8, ls=":")
ax.set_xlabel("training step"); ax.set_ylabel("global L2 norm"); ax.legend(loc="upper left")
ax2 = ax.twinx()
ax2.plot(steps, switched["lr"], "s--", color="#C44E52"); ax2.set_ylabel("learning rate", color="#C44E52")
fig.savefig(OUT / "schedule.png", dpi=110, bbox_inches="tight")"""),
        new_markdown_cell("""\
## The exports

The weights load in `transformers` as any Hugging Face checkpoint; the strategy goes to Megatron-LM as
command-line arguments and to torchtitan as a TOML, each with what the target cannot express said in
comments."""),
        new_code_cell("""\
from transformers import AutoModelForCausalLM
print(sorted(p.name for p in (OUT / "hf-export").iterdir()))
hf = AutoModelForCausalLM.from_pretrained(OUT / "hf-export")
print(type(hf).__name__, f"{sum(p.numel() for p in hf.parameters()):,} parameters")"""),
        new_code_cell("""\
megatron = sh(f"parashift export {OUT}/plan.json --to megatron {TRAIN} --steps 12")
(OUT / "megatron_args.sh").write_text(megatron)
print(megatron)"""),
        new_code_cell("""\
torchtitan = sh(f"parashift export {OUT}/plan.json --to torchtitan {TRAIN} --steps 12")
(OUT / "torchtitan.toml").write_text(torchtitan)
print(torchtitan)"""),
        new_markdown_cell("""\
The commands above run unchanged in a shell. Without a plan file, `export` takes a strategy, a model and
the batch shape:

```
parashift export dp=2,zero=2 --to megatron --model tiny-gpt --global-batch 8 --seq-len 32 --lr 3e-3 --lr-warmup-steps 2 --steps 12 --clip-grad 1.0
parashift export dp=1,tp=2 --to torchtitan --model tiny-gpt --global-batch 8 --seq-len 32
```

`parashift demo` runs the same journey as its step 6 (`--only real-data`) and writes the loss plot, the
exported weights, the Megatron-LM and torchtitan files and the commands to `demo-out/`."""),
    ]


NOTEBOOKS = {"01_explore_strategies.ipynb": nb01, "02_switch_plans.ipynb": nb02,
             "03_autotune_and_deploy.ipynb": nb03, "04_replay_preemption.ipynb": nb04}
NOTEBOOKS["05_program_a_schedule.ipynb"] = nb05
NOTEBOOKS["06_rl_phases.ipynb"] = nb06
NOTEBOOKS["07_deploy_real_data.ipynb"] = nb07


def build(name: str) -> nbformat.NotebookNode:
    nb = new_notebook(cells=NOTEBOOKS[name]())
    for i, cell in enumerate(nb.cells):       # stable ids: regenerating changes nothing that did not change
        cell["id"] = f"cell-{i:02d}"
        if cell.cell_type == "code" and "plots.plot_" in cell.source and cell.source.endswith(")"):
            cell.source += ";"    # the figure displays once (inline), not also as the cell's value
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def main(names: list[str]) -> None:
    for name in names or list(NOTEBOOKS):
        nb = build(name)
        nbformat.validate(nb)
        nbformat.write(nb, str(HERE / name))
        print("wrote", HERE / name)


if __name__ == "__main__":
    main(sys.argv[1:])
