"""A job as a torchtitan TOML job config, from the fields of pytorch/torchtitan ``torchtitan/config/job_config.py``
at v0.2.2 (73a0e697, February 2026), the last release read from TOML. Later torchtitan builds its
``Trainer.Config`` in Python (pytorch/torchtitan#2386), with the sections renamed.

torchtitan builds the model from a registered flavor (``[model] name`` and ``flavor``), not from the
TOML. The export therefore names a flavor and gives the ``TransformerModelArgs`` to register it with, for
the llama3 model (SwiGLU, RMSNorm, RoPE, no biases).
"""
from __future__ import annotations

import json

from .common import Export, Job, build

__all__ = ["to_torchtitan", "VERSION", "model_args"]

VERSION = "torchtitan v0.2.2 (73a0e697)"
_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B", "dualpipev": "DualPipeV"}
_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


def model_args(job: Job) -> dict:
    """``TransformerModelArgs`` of torchtitan's llama3 that build ``job.model``. Its FFN width is
    ``multiple_of * ceil(int(ffn_dim_multiplier * int(8 * dim / 3)) / multiple_of)``, so ``multiple_of = ffn``
    with ``ffn_dim_multiplier = ffn / int(8 * dim / 3)`` gives the exact width."""
    m = job.model
    base = int(2 * (4 * m.hidden) / 3)
    return {"dim": m.hidden, "n_layers": m.layers, "n_heads": m.heads, "n_kv_heads": m.kv_heads,
            "vocab_size": m.vocab, "multiple_of": m.ffn, "ffn_dim_multiplier": m.ffn / base,
            "max_seq_len": max(job.seq_len, m.seq_len)}


def flavor_name(name: str) -> str:
    """A flavor key for a model name: a Hugging Face config's folder (``hf:/x/llama3-8b/config.json`` ->
    ``llama3-8b``), else the name itself."""
    if name.startswith("hf:"):
        path = name[3:].rstrip("/")
        parts = [p for p in path.split("/") if p]
        if parts and parts[-1] == "config.json":
            parts = parts[:-1]
        return parts[-1] if parts else name
    return name


def _model(job: Job, out: Export) -> None:
    m = job.model
    flavor = flavor_name(m.name)
    out.set("model.name", "llama3")
    out.set("model.flavor", flavor)
    misfits = [what for bad, what in [
        (not m.gated, "a GELU MLP (llama3 has SwiGLU)"), (m.norm != "rms", "LayerNorm (llama3 has RMSNorm)"),
        (m.pos_emb != "rope", "learned position embeddings (llama3 has RoPE)"),
        (m.bias or m.qkv_bias, "linear biases (llama3 has none)"), (m.qk_norm, "QK norm"),
        (m.tied, "tied embeddings"), (m.head_dim * m.heads != m.hidden, f"head_dim {m.head_dim} != hidden/heads"),
        (bool(m.experts), "mixture-of-experts layers (use torchtitan's deepseek_v3 or qwen3 model instead)"),
        (m.dropout > 0, f"dropout {m.dropout} (torchtitan trains without dropout)")] if bad]
    if misfits:
        out.unsupported.append(f"model {m.name}: torchtitan's llama3 cannot express " + "; ".join(misfits))
    out.notes.append(f"register flavor {flavor!r} in torchtitan/models/llama3/__init__.py: llama3_args[{flavor!r}] = "
                     "TransformerModelArgs(" + ", ".join(f"{k}={v!r}" for k, v in model_args(job).items()) + ")")
    if m.dtype == "fp16":
        out.unsupported.append("fp16: torchtitan trains in bfloat16 or float32 only")
    else:   # parameters in fp32 (training.dtype's default), computed in mixed precision
        out.set("training.mixed_precision_param", _DTYPE[m.dtype])


def _fqns(job: Job) -> list[list[str]]:
    """Each virtual stage's modules (llama3 names), embedding first and norm + output last."""
    s, m = job.strategy, job.model
    stage = s.layer_stages(m.layers)
    parts = [[f"layers.{i}" for i in range(m.layers) if stage[i] == c] for c in range(s.stages)]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def _parallel(job: Job, out: Export) -> None:
    s = job.strategy
    z = s.zero_stage
    if not z.sharded:
        out.set("parallelism.data_parallel_replicate_degree", s.dp)
        out.set("parallelism.data_parallel_shard_degree", 1)
    else:
        shard = s.shard or s.dp
        out.set("parallelism.data_parallel_replicate_degree", s.dp // shard)
        out.set("parallelism.data_parallel_shard_degree", shard)
        if z.gathers_after_step:      # full parameters kept between steps
            out.set("parallelism.fsdp_reshard_after_forward", "never")
        if not z.shards_grads:
            out.unsupported.append("zero=1: torchtitan shards with FSDP2, which also shards gradients; with "
                                   "fsdp_reshard_after_forward = never it is ZeRO-2 (less memory, the same traffic)")
    out.set("parallelism.tensor_parallel_degree", s.tp)
    if s.tp > 1 and not s.sp:
        out.unsupported.append("sp off: torchtitan's tensor parallelism always shards norms along the sequence "
                               "(sequence parallel)")
    out.set("parallelism.context_parallel_degree", s.cp)
    out.set("parallelism.pipeline_parallel_degree", s.pp)
    if s.pp > 1:
        if s.schedule in _SCHEDULES:
            out.set("parallelism.pipeline_parallel_schedule", _SCHEDULES[s.schedule])
        else:
            out.unsupported.append(f"schedule {s.schedule}: torch.distributed.pipelining has no single-chunk "
                                   "zero-bubble schedule (InterleavedZeroBubble needs virtual stages); "
                                   "pick a schedule there by hand")
        out.set("parallelism.pipeline_parallel_microbatch_size", s.mbs)
        out.set("parallelism.module_fqns_per_model_part", _fqns(job))
    if job.model.experts:
        out.set("parallelism.expert_parallel_degree", s.ep)
        out.set("parallelism.expert_tensor_parallel_degree", s.tp)
    if s.overlap_grad or s.overlap_param:
        out.notes.append("overlap_grad/overlap_param: torchtitan's FSDP2 prefetches and overlaps its gathers and "
                         "reductions by itself; there is no option to set")
    if s.tp_async and s.tp > 1:
        out.unsupported.append("tp_async: torchtitan has no option to overlap the backward's tensor-parallel "
                               "reduction with the weight-gradient GEMM (enable_async_tensor_parallel is a "
                               "different, compiled micro-pipelining)")
    if s.recompute == "none":
        out.set("activation_checkpoint.mode", "none")
    else:
        out.set("activation_checkpoint.mode", s.recompute)
        if s.recompute == "selective":
            out.set("activation_checkpoint.selective_ac_option", "op")
            out.notes.append("selective: torchtitan's per-op selective checkpointing keeps matmul outputs and "
                             "recomputes the rest, close to but not the same set as Megatron's attention-core recompute")
    out.set("training.seq_len", job.seq_len)
    out.set("training.global_batch_size", job.global_batch)
    # without pipelining torchtitan accumulates gradients over local batches; with it, local_batch_size is
    # the DP rank's whole batch, cut into pipeline micro-batches
    out.set("training.local_batch_size", job.global_batch // s.dp if s.pp > 1 else s.mbs)


def _fp8(job: Job, out: Export) -> None:
    """The strategy's fp8 recipe as torchao's float8 converter (tensorwise: dynamic, E4M3 throughout)."""
    s = job.strategy
    if s.fp8 == "mx":
        out.unsupported.append("fp8=mx: this export writes torchao's float8 converter only; the plan's MX "
                               "(32-element block) scaling is not expressed")
        return
    out.set("model.converters", ["quantize.linear.float8"])
    out.set("quantize.linear.float8.recipe_name", "tensorwise")
    out.unsupported.append(f"fp8={s.fp8}: torchao's tensorwise recipe scales each tensor by its current amax and "
                           f"keeps E4M3 for gradients too" + (" (the plan's delayed scaling keeps a 16-step amax "
                                                             "history)" if s.fp8 == "delayed" else ""))
    if s.fp8_gather:
        out.set("quantize.linear.float8.enable_fsdp_float8_all_gather", True)


def _training(job: Job, out: Export) -> None:
    t = job.training
    if job.strategy.fp8 != "none":
        _fp8(job, out)
    if t.fp8:
        out.set("model.converters", ["quantize.linear.float8"])
        out.set("quantize.linear.float8.recipe_name", "tensorwise")
        if t.fp8 == "hybrid":
            out.unsupported.append("fp8 hybrid (E5M2 gradients): torchao's float8 recipes use E4M3 throughout "
                                   "(tensorwise here)")
        out.notes.append("fp8 was not part of the simulated plan")
    sch = t.schedule
    if sch is not None:
        out.set("optimizer.lr", sch.lr)
        out.set("lr_scheduler.warmup_steps", sch.warmup_steps)
        if sch.decay == "constant":
            out.set("lr_scheduler.decay_ratio", 0.0)
        else:
            out.set("lr_scheduler.decay_type", sch.decay)
            if sch.decay_steps is not None:
                out.set("lr_scheduler.total_steps", sch.decay_steps)
        out.set("lr_scheduler.min_lr_factor", sch.min_lr / sch.lr)
        if sch.convention == "megatron" and sch.warmup_steps:
            out.unsupported.append("warmup: torchtitan's warmup reaches the peak at step W - 1 and starts at "
                                   "lr/W; Megatron-LM's (the schedule given) at step W and starts at 0")
    out.set_plain(t, {"steps": "training.steps", "clip_grad": "training.max_norm", "weight_decay": "optimizer.weight_decay"})


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)   # strings and lists of strings: JSON's syntax is TOML's here


def render_toml(options: list[tuple[str, object]]) -> str:
    """``section.key`` options as TOML tables, sections in first-use order."""
    tables: dict[str, list[str]] = {}
    for name, value in options:
        section, _, key = name.rpartition(".")
        tables.setdefault(section, []).append(f"{key} = {_toml_value(value)}")
    return "\n\n".join(f"[{sec}]\n" + "\n".join(lines) for sec, lines in tables.items()) + "\n"


def to_torchtitan(job: Job) -> Export:
    """A torchtitan TOML for ``job``; what torchtitan cannot express is in ``unsupported``."""
    out = build("torchtitan", VERSION, job, (_model, _parallel, _training))
    out.notes.append(f"world size {job.strategy.world} GPUs (NGPU); add [training] dataset/dataset_path and "
                     "[model] hf_assets_path for the tokenizer")
    out.text = f"{out.header()}\n{render_toml(out.options)}"
    return out
