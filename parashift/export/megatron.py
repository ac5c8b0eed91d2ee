"""A job as Megatron-LM command-line arguments (``pretrain_gpt.py``), from the option names of
NVIDIA/Megatron-LM ``megatron/training/arguments.py`` at d98e8a64 (August 2026)."""
from __future__ import annotations

import shlex

from ..fp8 import get as fp8_recipe
from .common import Export, Job, build

__all__ = ["to_megatron", "VERSION"]

VERSION = "Megatron-LM d98e8a64 (2026-08-22)"
_RECOMPUTE = {"selective": [("--recompute-granularity", "selective")],
              "full": [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                       ("--recompute-num-layers", 1)]}


def _layout(job: Job) -> str:
    """``--pipeline-model-parallel-layout``: the embedding (E), each chunk's decoder layers (t) and the
    loss (L), chunks in virtual-stage order split by ``|``."""
    s = job.strategy
    counts = [int((s.layer_stages(job.model.layers) == c).sum()) for c in range(s.stages)]
    parts = ["t" * n for n in counts]
    parts[0], parts[-1] = "E" + parts[0], parts[-1] + "L"
    return "|".join(parts)


def _parallel(job: Job, out: Export) -> None:
    s, m = job.strategy, job.model
    out.set("--tensor-model-parallel-size", s.tp)
    out.set("--pipeline-model-parallel-size", s.pp)
    out.set("--context-parallel-size", s.cp)
    if m.experts:
        out.set("--expert-model-parallel-size", s.ep)
        out.set("--expert-tensor-parallel-size", s.tp)
    if s.sp:
        out.set("--sequence-parallel")
    sched = s.schedule
    if s.pp > 1 and sched in ("gpipe", "zb-h1", "dualpipev"):
        what = {"gpipe": "GPipe (all forwards, then all backwards)",
                "zb-h1": "the zero-bubble ZB-H1 schedule (split backward)",
                "dualpipev": "DualPipeV (V-shaped chunks, overlapped forward and backward)"}[sched]
        out.unsupported.append(f"schedule {sched}: Megatron-LM has no option for {what}; it runs 1F1B "
                               f"(interleaved with virtual stages), so its step time differs from the plan's")
    uneven = m.layers % s.stages != 0
    if s.pp > 1 and (uneven or (s.vpp > 1 and sched != "dualpipev")):
        if uneven:
            out.set("--pipeline-model-parallel-layout", _layout(job))
        else:
            out.set("--num-virtual-stages-per-pipeline-rank", s.vpp)
    z = s.zero_stage
    if z.sharded and not z.shards_grads:
        out.set("--use-distributed-optimizer")
    elif z.shards_grads:
        out.set("--use-megatron-fsdp")
        out.set("--data-parallel-sharding-strategy", "optim_grads_params" if z.shards_params else "optim_grads")
        out.notes.append(f"zero={s.zero} maps to Megatron-FSDP, which checkpoints with --ckpt-format fsdp_dtensor")
    if s.shard:
        out.set("--num-distributed-optimizer-instances", s.dp_replicas)
    if s.overlap_grad:
        out.set("--overlap-grad-reduce")
    if s.overlap_param:
        out.set("--overlap-param-gather")
    if s.tp > 1 and not s.tp_async:
        out.unsupported.append("tp_async off: Megatron-LM always overlaps the backward's tensor-parallel "
                               "reduction with the weight-gradient GEMM and has no option to turn that off")
    if not s.grad_fusion:
        out.set("--no-gradient-accumulation-fusion")
    recipe = fp8_recipe(s.fp8)
    if recipe is not None:     # Transformer Engine's recipes under Megatron-LM's names
        out.set("--fp8-format", "hybrid")
        out.set("--fp8-recipe", {"delayed": "delayed", "current": "tensorwise", "mx": "mxfp8"}[s.fp8])
        if recipe.delayed:
            out.set("--fp8-amax-history-len", recipe.amax_history)
            out.set("--fp8-amax-compute-algo", "max")
        if s.fp8_gather:
            out.set("--fp8-param-gather")
    for name, value in _RECOMPUTE.get(s.recompute, []):
        out.set(name, value)
    out.set("--micro-batch-size", s.mbs)
    out.set("--global-batch-size", job.global_batch)


def _model(job: Job, out: Export) -> None:
    m = job.model
    out.set("--num-layers", m.layers)
    out.set("--hidden-size", m.hidden)
    out.set("--ffn-hidden-size", m.ffn)
    out.set("--num-attention-heads", m.heads)
    if m.head_dim * m.heads != m.hidden:
        out.set("--kv-channels", m.head_dim)
    if m.kv_heads != m.heads:
        out.set("--group-query-attention")
        out.set("--num-query-groups", m.kv_heads)
    out.set("--seq-length", job.seq_len)
    out.set("--max-position-embeddings", max(job.seq_len, m.seq_len))
    out.set("--vocab-size", m.vocab)
    out.set("--make-vocab-size-divisible-by", 1)
    if m.gated:
        out.set("--swiglu")
    out.set("--normalization", "RMSNorm" if m.norm == "rms" else "LayerNorm")
    out.set("--position-embedding-type", "rope" if m.pos_emb == "rope" else "learned_absolute")
    if not m.bias:
        out.set("--disable-bias-linear")
    if m.qkv_bias and not m.bias:
        out.set("--add-qkv-bias")
    if m.qk_norm:
        out.set("--qk-layernorm")
    if not m.tied:
        out.set("--untie-embeddings-and-output-weights")
    out.set("--attention-dropout", m.dropout)
    out.set("--hidden-dropout", m.dropout)
    if not m.flash_attention:
        out.set("--attention-backend", "unfused")
    if m.experts:
        out.set("--num-experts", m.experts)
        out.set("--moe-router-topk", m.top_k)
        out.set("--moe-ffn-hidden-size", m.expert_ffn)
        if m.router == "sigmoid":                                  # DeepSeek-V3's scores
            out.set("--moe-router-score-function", "sigmoid")
        if not m.norm_topk:     # softmax over all experts, then top-k; Megatron's default (top-k, then softmax
            out.set("--moe-router-pre-softmax")   # over those k) is the renormalised routing of Mixtral and Qwen3
        out.set("--moe-router-load-balancing-type", "none")      # the plan's model has no auxiliary loss
        if m.shared_ffn:
            out.set("--moe-shared-expert-intermediate-size", m.shared_ffn)
            out.set("--moe-shared-expert-gate")                  # sigmoid gate on the shared expert
    if m.dtype in ("bf16", "fp16"):
        out.set(f"--{m.dtype}")


def _training(job: Job, out: Export) -> None:
    t = job.training
    if t.fp8:
        out.set("--fp8-format", t.fp8)
        out.notes.append("fp8 was not part of the simulated plan; its figures are for "
                         f"{job.model.dtype} matrix multiplies")
    sch = t.schedule
    if sch is not None:
        out.set("--lr", sch.lr)
        out.set("--min-lr", sch.min_lr)
        out.set("--lr-decay-style", sch.decay)
        if sch.warmup_steps:
            out.set("--lr-warmup-iters", sch.warmup_steps)
        if sch.warmup_init:
            out.set("--lr-warmup-init", sch.warmup_init)
        decay_end = sch.decay_steps if sch.decay_steps is not None else t.steps
        if decay_end is not None and sch.decay != "constant":
            out.set("--lr-decay-iters", decay_end)
        if sch.convention != "megatron":
            out.notes.append("the schedule was given in torchtitan's convention; Megatron-LM's warmup reaches "
                             "the peak one step later (step W, not W - 1)")
    out.set_plain(t, {"steps": "--train-iters", "clip_grad": "--clip-grad", "weight_decay": "--weight-decay"})


def _fmt(v: object) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def to_megatron(job: Job) -> Export:
    """Megatron-LM arguments for ``job``; what Megatron-LM cannot express is in ``unsupported``."""
    out = build("megatron", VERSION, job, (_parallel, _model, _training))
    out.notes.append(f"world size {job.strategy.world} GPUs (data parallel {job.strategy.dp} is what remains "
                     f"after tp x pp x cp); add --data-path, --tokenizer-type/--tokenizer-model, --save and --load")
    lines = [name if value is True else f"{name} {shlex.quote(_fmt(value))}" for name, value in out.options]
    out.text = out.header() + " \\\n    ".join(["torchrun --nproc-per-node <gpus> pretrain_gpt.py"] + lines) + "\n"
    return out
