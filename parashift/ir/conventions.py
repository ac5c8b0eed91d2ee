"""Training-step Program conventions: the contract between ``ir.compile``, ``sim`` and ``exec``.

This docstring is the authoritative copy. The tag, payload-key and buffer-name grammar below is
built and parsed by :mod:`parashift.ir.tags` (typed values, ``str`` / ``parse``); the compiler and
the runtime use that module, never string formatting or regular expressions of their own.

# Training-step Program conventions (shared contract of ir.compile, sim and exec)

`ir.compile(model, strategy, *, global_batch, seq_len)` returns a `Program` (parashift/ir/program.py) with
`strategy` set, `meta` = `StepMeta.encode()` (parashift/ir/step_meta.py: {"model": name, "model_spec": the
full ModelSpec, "strategy": str, "schedule": name, "global_batch", "seq_len", "microbatches": m, "mbs",
"kind": "train_step", "precision"}; read it with `StepMeta.of(program)`). Ranks 0..world-1; ranks with identical programs SHARE one
RankProgram object (all DP replicas and TP peers of one pipeline stage normally do, and EP ranks too, since
they differ only by which experts they hold, which comes from the strategy). Groups are symbolic axis
names ("tp", "dp", "ep", "edp", plus "embed" = first and last pipeline stage of the same (tp, dp) for tied
embeddings; ir may add axes to `Strategy.group`), peers are "pp+1"/"pp-1" (stage offset, wrapping).

Streams: "compute" (all compute instructions, and the blocking TP all-reduces / EP all-to-alls that sit
between compute ops in Megatron; dualpipev may put EP all-to-alls on "comm" to overlap), "comm" (DP gradient
sync, ZeRO all-gathers/reduce-scatters, overlapped with compute), "p2p" (pipeline send/recv), "tp" (tp_async:
the backward TP reductions beside the weight gradients, see below).

Compute instructions: `op="compute"`, `phase` in fwd / bwd / bwd_input / bwd_weight / recompute / optim,
`stage` = pipeline rank, `chunk` = virtual stage 0..pp*vpp-1 (model order), `microbatch`, `flops` (this
rank's share: TP divides it), `region` = which part of the model runs:
  "embed" | "layers.{i}.attn" | "layers.{i}.mlp" | "layers.{i}.moe.route" | "layers.{i}.moe.experts" |
  "layers.{i}.moe.combine" | "head" (final norm + output + loss) ;  optim: region None (whole rank).
A chunk's forward for one micro-batch is the sequence of its regions in model order; between regions sit
the TP all-reduces (row-parallel outputs in fwd, column-parallel input grads in bwd) and, for MoE with
ep>1, the dispatch/combine all-to-alls around "moe.experts". With tp == 1 and ep == 1 the compiler may
fuse a chunk's regions into ONE compute instruction with region "layers.{a}-{b}" (inclusive, may also be
"embed+layers.0-3" / "layers.4-7+head") to keep programs small; the runtime must accept such fused regions.
  bwd = full backward of the region (input and weight grads); zb-h1/dualpipev split it into bwd_input then
  bwd_weight (same region, same microbatch). recompute (recompute=full/selective) re-runs the forward of the
  region just before its bwd.

Communication instructions and tags (tags are unique per (sender, receiver)/group within a program):
  p2p activations  send/recv, stream "p2p", tag "act.c{src_chunk}.m{mb}", peer "pp+1" (or "pp-1" for
                   dualpipev's second leg), nbytes = mbs*seq*hidden*dtype_bytes
  p2p gradients    tag "grad.c{dst_chunk}.m{mb}" (sent by chunk dst_chunk+1 back to dst_chunk)
  TP all-reduce    op all_reduce, group "tp", tag "tp.{region}.{phase}.m{mb}"
  EP all-to-all    op all_to_all, group "ep", tag "ep.{region}.{dispatch|combine}.{phase}.m{mb}"
  DP grad sync     after the chunk's last backward: zero 0 -> all_reduce over "dp" (dense grads of the chunk)
                   and "edp" (expert grads); zero >= 1 -> reduce_scatter over "dp"/"edp"; tag
                   "dp.grad.c{chunk}" / "edp.grad.c{chunk}", key "grad:c{chunk}:dense" / "grad:c{chunk}:expert"
  ZeRO 2/3 grads   per micro-batch and bucket instead (no tied embedding across stages): a dense model's
                   graph is not fused and each region is a bucket, "dp.grad.c{c}.m{mb}.{region}" after the
                   region's last backward node, freeing "zg.c{c}.m{mb}.{region}" (its grad bytes) that the
                   region's first gradient-writing node allocs (bwd; under split backwards bwd_weight: a
                   bwd_input writes no gradient); MoE: one bucket per chunk ("dp.grad.c{c}.m{mb}",
                   "zg.c{c}.m{mb}" / "zge.c{c}.m{mb}"). The node allocating a bucket waits for the
                   reduce-scatter of the bucket its stage allocated two before (two live per rank).
  tied embedding   all_reduce over "embed", tag "embed.grad", before the optimizer
  optimizer        one compute instruction phase "optim" per rank after all grad syncs
  ZeRO 1/2 params  after optim: all_gather over "dp"/"edp" per chunk, tag "dp.param.c{chunk}"; with
                   overlap_param instead at the head of the step (the previous optimizer's output):
                   in the chunk's first forward action (F, mb 0), one per region where the graph is
                   unfused and dense ("dp.param.c{chunk}.{region}", the region's first forward node
                   waits for it; tp == 1 is then not fused), else per chunk; the optimizer waits for
                   all of them (it overwrites the shard they read). No alloc: the buffer is static.
  ZeRO 3 params    before each chunk's fwd (and bwd) per micro-batch: all_gather "dp"/"edp",
                   tag "z3.param.c{chunk}.{phase}.m{mb}", freed after use (alloc/free a buffer);
                   dense models gather per region: "z3.param.c{c}.{phase}.m{mb}.{region}"
Memory: `RankProgram.static_memory` = {"param", "grad", "master", "optim"} bytes this rank holds under
the layout (ZeRO-aware; use parashift.vps.layout when available). Activations: each fwd allocs
"act.c{chunk}.m{mb}[.{region}]" (bytes per recompute mode) and the matching bwd (or bwd_weight) frees it; comm
buffers that outlive one instruction are alloc/free'd likewise.

## Changes by the IR helper (binding; also in parashift/ir/conventions.py)

Schedule text: an action is `{chunk}{T}{mb}` (torch's `1F0` form), T in F (fwd), B (full bwd),
I (bwd_input), W (bwd_weight); a stage's order is a space-separated string, e.g. "0F0 0F1 0B0 0F2 0B1".
`parashift.ir.schedules.parse_order(text)` / `format_order(actions)` invert each other.

Instruction ids: unique per RankProgram, 0..n-1, numbered by schedule step (NOT guaranteed topological;
use stream order + deps). `deps` lists only CROSS-stream dependencies (same rank), and per producing
stream only the latest producer (earlier ones are implied by that stream's order).
Shared RankPrograms: every rank of one pipeline stage shares one RankProgram (ranks r with
r // (tp*dp) == stage). `Program.validate()` exploits this (cheap even at 1024 ranks).

Regions and fusion (tp == 1 and ep == 1): one compute instruction per (chunk, microbatch, phase);
region names "embed+layers.0-1", "layers.2-3", "layers.4-5+head" ("layers.{a}-{b}", inclusive; a
single layer is still written "layers.{a}-{a}"). With tp > 1 or ep > 1 nothing is fused and the regions
are "embed", "layers.{i}.attn", "layers.{i}.mlp" (dense) or "layers.{i}.moe.route" / ".moe.experts" /
".moe.combine" (MoE), "head".
  MoE regions: route = norm + router (top-k) + the shared expert (TP-sharded); experts = the routed
  experts on the (dispatched) tokens; combine = weighted sum of expert outputs + shared output + residual.

TP communication (stream "compute", group "tp", tag "tp.{region}.{phase}.m{mb}", nbytes = mbs*seq*hidden*dtype):
  fwd: all_reduce right after the fwd of "embed" (vocab-parallel lookup), "layers.{i}.attn",
       "layers.{i}.mlp", "layers.{i}.moe.combine" (sums the row-parallel partial output; the residual
       is added once, after the reduction — the runtime decides how);
       after "head" fwd: op all_gather, key "ce_stats", nbytes = tp*3*mbs*seq*4 (the gathered buffer;
       each rank contributes per token: local max, local sum-exp, local target logit, fp32): the vocab-parallel loss is finished from the gathered
       stats when it completes (the head bwd depends on it).
  bwd / bwd_input: all_reduce right after the bwd of "head", "layers.{i}.mlp", "layers.{i}.attn",
       "layers.{i}.moe.route" (column-parallel input grads); nothing after "embed" bwd; nothing after
       bwd_weight; nothing in recompute.
  tp_async: the bwd of "head", "layers.{i}.mlp", "layers.{i}.attn", "layers.{i}.moe.route" is split (unless the
       schedule splits it already) into bwd_input then bwd_weight, both in the B action, the weight half right
       after the input half (Strategy.column_wgrad, cp == 1: an attention's or MLP's bwd_weight is only its
       column-parallel GEMM's weight gradient, its bwd_input computes the row-parallel GEMM's, as Megatron orders
       them; the ZeRO-2/3 bucket is then allocated by the bwd_input); the bwd all_reduce (with sp: the reduce-scatter and the "sp_input" re-gather)
       goes on stream "tp". The bwd_weight does not wait for the reduction (with sp it waits for the re-gather);
       the gradient chain, a recompute of the next region, the chunk's gradient syncs and the optimizer do.
EP communication (ep > 1, group "ep", nbytes = mbs*seq*top_k*hidden*dtype, the balanced expectation;
  real splits are data-dependent): fwd: all_to_all "ep.layers.{i}.moe.dispatch.fwd.m{mb}" after route,
  "ep.layers.{i}.moe.combine.fwd.m{mb}" after experts; bwd/bwd_input: "ep.layers.{i}.moe.combine.bwd.m{mb}"
  after combine's bwd, "ep.layers.{i}.moe.dispatch.bwd.m{mb}" after experts' bwd. Stream "compute",
  except dualpipev, which puts them on "comm" so they overlap the other micro-batch's compute.
Recompute: per region, no communication. full: a "recompute" instruction (same region, flops = its fwd
  flops) right before every bwd / bwd_input; selective: only before attention regions (and fused
  regions), flops = core attention (QK^T, AV) / tp. It allocs "rc.{region}.m{mb}" that the region's last
  backward instruction frees.
P2P: no send/recv when consecutive chunks sit on the same stage (pp == 1; dualpipev chunk pp-1 -> pp):
  the data stays local. dualpipev: chunks c < pp send activations to "pp+1" and grads to "pp-1";
  chunks c >= pp send activations to "pp-1" and grads to "pp+1". The p2p stream of every rank follows
  one global order of matched pairs (deadlock-free by construction); a send depends on the compute that
  produced it, the consuming compute depends on the recv.
Collective nbytes: all_reduce / reduce_scatter / all_gather: the FULL (unsharded) buffer size;
  all_to_all: this rank's send buffer; send/recv: the message.
DP sync: dense grads over "dp" ("dp.grad.c{chunk}"); expert grads over "edp" ("edp.grad.c{chunk}") only
  when ep > 1 (with ep == 1 expert grads are part of the dense "dp" sync). nbytes = the chunk's grad bytes
  on this rank (its TP/EP shard, before ZeRO sharding). ZeRO 1/2 param all-gathers "dp.param.c{chunk}" /
  "edp.param.c{chunk}" after optim.
Tied embeddings (model.tied and pp > 1): Strategy.group(rank, "embed") = (rank of (tp, dp, pp=0),
  rank of (tp, dp, pp=pp-1)) — added to strategy.py. The "embed.grad" all_reduce (nbytes = the word
  embedding's TP shard grad bytes) and the dp/edp grad syncs of the chunks holding the tied tensor go at
  the END of the "comm" stream (embed.grad first), right before optim.
ZeRO-3: one all_gather per (chunk, mb, action) before its first compute: F -> "z3.param.c{c}.fwd.m{mb}",
  B / I -> "z3.param.c{c}.bwd.m{mb}" (W needs no parameters), on "comm" (+ "z3.eparam.c{c}.{fwd|bwd}.m{mb}"
  over "edp" when ep > 1 and dp/ep > 1, which allocs its own buffer "z3e.c{c}.{fwd|bwd}.m{mb}"). It allocs "z3.c{c}.{fwd|bwd}.m{mb}" (the chunk's params on this rank before ZeRO), freed by
  the action's last compute (for split backward: the last bwd_input). Prefetch depth 1: the gather of
  a stage's action k depends on the first compute of its action k-1. No param all-gather after optim.
  Dense models (unfused under ZeRO-3): one gather per (action, region), "z3.param.c{c}.{ph}.m{mb}.{region}"
  allocating "z3.c{c}.{ph}.m{mb}.{region}" (the region's param bytes) before the region's first node and
  freed by its last (an I action's copy by the region's last I node); the gather of the action's j-th
  region waits for its (j-2)-th region's last node.
Optimizer: flops = 10 per element of this rank's optimizer shard, nbytes = bytes of its states touched.
Compute nbytes: an estimate of memory traffic (region params on this rank + activations in/out).
Activations: the first fwd instruction of (chunk, mb) allocs "act.c{chunk}.m{mb}" (Megatron formula per
  recompute mode, per layer: none sbh(10+24/t+5as/(ht)), selective sbh(10+24/t), full 2sbh per region input,
  x dtype_bytes/2; 2sbh + 3as^2b/t less without dropout; last stage + logits 4*s*b*v/t), the chunk's last
  backward instruction for that mb frees it. Where a chunk's regions are separate instructions (unfused),
  each region has its own buffer "act.c{chunk}.m{mb}.{region}", allocated by its fwd and freed by its
  last backward (bwd, or bwd_weight), as the runtime holds each region's stash.
Overlapped steps (dualpipev "&" steps, e.g. "3F2&0I1"): the two actions' instructions interleave region
  by region on the compute stream (their EP all-to-alls on "comm"), so the runtime just follows the streams.
DP grad sync position on "comm": after the chunk's last backward step, behind the ZeRO-3 gather of the
  following step (so it overlaps that step).
Traced user models: `ir.compile(graph, strategy, global_batch=...)` accepts a region Graph from
  `parashift.ir.annotate.trace(model, one_microbatch_input)`; dp/pp/vpp/zero/schedules/recompute only
  (tp = ep = 1); regions are fused per chunk exactly as for presets (region names from the trace, e.g.
  "embed+layers.0-1"); StepMeta: model None (no spec; name "custom" unless given), seq_len None,
  regions and chunk_stages set.
Static memory: RankProgram.static_memory comes from parashift.vps.layout (ZeRO buffers incl. padding):
  "param", "grad", "master" (0 for fp32 models), "optim" = exp_avg + exp_avg_sq bytes.
"""
from __future__ import annotations

__all__: list[str] = []
