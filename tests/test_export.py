"""`parashift export`: Megatron-LM arguments and torchtitan TOML, checked against the frameworks' documented options."""
import dataclasses
import json
import shlex
import tomllib

import pytest
from hypothesis import given, settings, strategies as st

from parashift import ir, models
from parashift.cli import main
from parashift.errors import InputError, StrategyError
from parashift.export import Job, Training, export
from parashift.export.torchtitan import model_args
from parashift.strategy import Strategy
from parashift.train import LRSchedule

# Option strings of NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22), read from the
# argparse parser that megatron/training/arguments.py:add_megatron_arguments builds (877 options; the
# TransformerConfig fields come in through ArgumentGroupFactory, so a grep of arguments.py misses them).
# Only the options this project emits or considered are listed.
MEGATRON_OPTIONS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--sequence-parallel",
    "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage",
    "--pipeline-model-parallel-layout", "--use-distributed-optimizer", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "--num-distributed-optimizer-instances", "--overlap-grad-reduce",
    "--overlap-param-gather", "--no-gradient-accumulation-fusion", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--micro-batch-size", "--global-batch-size", "--num-layers", "--hidden-size",
    "--ffn-hidden-size", "--num-attention-heads", "--kv-channels", "--group-query-attention", "--num-query-groups",
    "--seq-length", "--max-position-embeddings", "--vocab-size", "--make-vocab-size-divisible-by", "--swiglu",
    "--normalization", "--position-embedding-type", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "--hidden-dropout", "--attention-backend",
    "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-router-pre-softmax",
    "--moe-router-score-function",    # TransformerConfig.moe_router_score_function: softmax or sigmoid
    "--moe-router-load-balancing-type", "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate",
    "--bf16", "--fp16", "--fp8-format", "--fp8-recipe", "--fp8-amax-history-len", "--fp8-amax-compute-algo",
    "--fp8-param-gather", "--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-iters",
    "--lr-warmup-init", "--lr-decay-iters", "--train-iters", "--clip-grad", "--weight-decay",
}
# Fields of pytorch/torchtitan v0.2.2 (73a0e6979dd10b6b1904098eb3c8f62c18ab87ce, 2026-02-20)
# torchtitan/config/job_config.py, as TOML "section.key" (JobConfig's sections; quantize.linear.float8 is
# Quantize.linear -> QuantizedLinear.float8 -> Float8Linear). The last release read from TOML.
TORCHTITAN_OPTIONS = {
    "model.name", "model.flavor", "model.converters", "model.hf_assets_path",
    "optimizer.lr", "optimizer.weight_decay", "lr_scheduler.warmup_steps", "lr_scheduler.total_steps",
    "lr_scheduler.decay_ratio", "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor",
    "training.local_batch_size", "training.global_batch_size", "training.seq_len", "training.max_norm",
    "training.steps", "training.dtype", "training.mixed_precision_param", "training.mixed_precision_reduce",
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.fsdp_reshard_after_forward", "parallelism.tensor_parallel_degree",
    "parallelism.enable_async_tensor_parallel", "parallelism.pipeline_parallel_degree",
    "parallelism.module_fqns_per_model_part", "parallelism.pipeline_parallel_layers_per_stage",
    "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
    "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree",
    "parallelism.expert_tensor_parallel_degree", "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option", "quantize.linear.float8.recipe_name",
    "quantize.linear.float8.enable_fsdp_float8_all_gather",
}
# torch.distributed.pipelining.schedules.get_schedule_class names (torch 2.13)
TORCH_SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}

CASES = [("llama2-7b", "dp=4,tp=2,pp=2,vpp=2,zero=1,sp,recompute=selective", 64, 4096),
         ("gpt3-1.3b", "dp=8,tp=1,pp=1,zero=3,recompute=full,overlap_grad", 64, 2048),
         ("tiny-moe", "dp=4,tp=2,pp=1,ep=2,mbs=2,zero=2,sp,tp_async,grad_fusion", 16, 32),
         ("tiny-gpt", "dp=2,tp=1,pp=3,schedule=gpipe,cp=2", 12, 64),
         ("tiny-gpt", "dp=2,tp=2,pp=2,schedule=zb-h1", 8, 32),
         ("tiny-gpt", "dp=1,tp=1,pp=2,vpp=2,schedule=dualpipev", 8, 32),
         ("tiny-gpt", "dp=4,zero=1,shard=2,overlap_param", 8, 32),
         ("tiny-gpt", "dp=4,zero=3,fp8,fp8_gather", 8, 32)]
TRAIN = Training(LRSchedule(3e-4, 10, "cosine", 3e-5), steps=100, clip_grad=1.0, weight_decay=0.1, fp8="e4m3")


def _job(model, strategy, gb, seq, training=TRAIN):
    s = Strategy.parse(strategy)
    if s.fp8 != "none":          # the strategy's recipe replaces --fp8
        training = dataclasses.replace(training, fp8=None)
    return Job(models.get(model), s, gb, seq, training)


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_every_emitted_option_is_documented(case):
    job = _job(*case)
    meg, tt = export(job, "megatron"), export(job, "torchtitan")
    assert {n for n, _ in meg.options} <= MEGATRON_OPTIONS, {n for n, _ in meg.options} - MEGATRON_OPTIONS
    assert {n for n, _ in tt.options} <= TORCHTITAN_OPTIONS, {n for n, _ in tt.options} - TORCHTITAN_OPTIONS
    sched = dict(tt.options).get("parallelism.pipeline_parallel_schedule")
    assert sched is None or sched in TORCH_SCHEDULES


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_text_carries_every_option_and_every_unsupported_line(case):
    job = _job(*case)
    meg = export(job, "megatron")
    body = "".join(ln.rstrip("\\") for ln in meg.text.splitlines() if not ln.startswith("#"))
    words = shlex.split(body)
    assert words[:4] == ["torchrun", "--nproc-per-node", "<gpus>", "pretrain_gpt.py"]
    argv = dict.fromkeys(w for w in words if w.startswith("--"))
    assert list(argv)[1:] == [n for n, _ in meg.options]
    for u in meg.unsupported:
        assert f"# unsupported: {u}" in meg.text
    tt = export(job, "torchtitan")
    doc = tomllib.loads(tt.text)
    for name, value in tt.options:
        node = doc
        for part in name.split("."):
            node = node[part]
        assert node == value, name
    for u in tt.unsupported:
        assert f"# unsupported: {u}" in tt.text


def test_megatron_mapping_of_a_full_strategy():
    opts = dict(export(_job(*CASES[0]), "megatron").options)
    assert opts["--tensor-model-parallel-size"] == 2 and opts["--pipeline-model-parallel-size"] == 2
    assert opts["--num-virtual-stages-per-pipeline-rank"] == 2 and opts["--sequence-parallel"] is True
    assert opts["--use-distributed-optimizer"] and opts["--recompute-granularity"] == "selective"
    assert opts["--micro-batch-size"] == 1 and opts["--global-batch-size"] == 64
    assert (opts["--num-layers"], opts["--hidden-size"], opts["--ffn-hidden-size"]) == (32, 4096, 11008)
    assert opts["--normalization"] == "RMSNorm" and opts["--swiglu"] and opts["--bf16"]
    assert (opts["--lr"], opts["--min-lr"], opts["--lr-warmup-iters"], opts["--lr-decay-iters"]) == (3e-4, 3e-5, 10, 100)
    assert opts["--fp8-format"] == "e4m3" and opts["--clip-grad"] == 1.0
    gpt = dict(export(_job(*CASES[1]), "megatron").options)
    assert gpt["--use-megatron-fsdp"] and gpt["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert gpt["--recompute-granularity"] == "full" and gpt["--recompute-method"] == "uniform"
    assert gpt["--position-embedding-type"] == "learned_absolute" and "--disable-bias-linear" not in gpt
    moe = dict(export(_job(*CASES[2]), "megatron").options)
    assert moe["--expert-model-parallel-size"] == 2 and moe["--num-experts"] == 8 and moe["--moe-router-topk"] == 2
    assert moe["--data-parallel-sharding-strategy"] == "optim_grads" and "--no-gradient-accumulation-fusion" not in moe
    hsdp = dict(export(_job(*CASES[6]), "megatron").options)
    assert hsdp["--num-distributed-optimizer-instances"] == 2 and hsdp["--overlap-param-gather"]


@pytest.mark.parametrize("case,target,needle", [
    (CASES[3], "megatron", "schedule gpipe"), (CASES[4], "megatron", "schedule zb-h1"),
    (CASES[5], "megatron", "schedule dualpipev"), (CASES[4], "torchtitan", "schedule zb-h1"),
    (CASES[0], "torchtitan", "zero=1"), (CASES[4], "torchtitan", "sp off"), (CASES[4], "megatron", "tp_async off"),
    (CASES[1], "torchtitan", "learned position embeddings"), (CASES[2], "torchtitan", "mixture-of-experts"),
    (CASES[0], "torchtitan", "warmup"),
])
def test_what_the_target_cannot_express_is_said(case, target, needle):
    assert any(needle in u for u in export(_job(*case), target).unsupported)


def test_nothing_unsupported_for_a_plain_strategy():
    job = _job("tiny-gpt", "dp=2,tp=2,pp=2,sp,tp_async,grad_fusion", 8, 32, Training())
    assert export(job, "megatron").unsupported == []


def test_uneven_pipeline_stages_are_laid_out_not_dropped():
    job = _job("tiny-gpt", "dp=1,tp=1,pp=3", 6, 32, Training())    # 4 layers over 3 stages: 2, 1, 1
    assert dict(export(job, "megatron").options)["--pipeline-model-parallel-layout"] == "Ett|t|tL"
    parts = dict(export(job, "torchtitan").options)["parallelism.module_fqns_per_model_part"]
    assert parts == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2"], ["layers.3", "norm", "output"]]


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 40), pp=st.sampled_from([1, 2, 4]), vpp=st.sampled_from([1, 2]))
def test_torchtitan_parts_cover_every_layer_once(layers, pp, vpp):
    if pp * vpp > layers or (vpp > 1 and pp == 1):
        return
    spec = models.get(f"gpt:layers={layers},hidden=64,heads=4")
    try:
        job = Job(spec, Strategy.parse(f"dp=1,pp={pp},vpp={vpp}"), 4 * pp, 16)
    except StrategyError:
        return
    parts = dict(export(job, "torchtitan").options).get("parallelism.module_fqns_per_model_part")
    if pp == 1:
        assert parts is None
        return
    flat = [n for p in parts for n in p if n.startswith("layers.")]
    assert flat == [f"layers.{i}" for i in range(layers)] and len(parts) == pp * vpp


@pytest.mark.parametrize("model", ["llama2-7b", "llama2-70b", "tiny-gpt", "qwen3-30b-a3b"])
def test_llama3_flavor_args_rebuild_the_exact_ffn(model):
    """torchtitan llama3 FeedForward (v0.2.2): hidden = int(2 * 4 * dim / 3), times ffn_dim_multiplier, rounded
    up to multiple_of."""
    spec = models.get(model)
    a = model_args(Job(spec, Strategy(), 1, 8))
    h = int(a["ffn_dim_multiplier"] * int(2 * (4 * a["dim"]) / 3))
    assert a["multiple_of"] * ((h + a["multiple_of"] - 1) // a["multiple_of"]) == spec.ffn


def test_cli_exports_a_plan_file(tmp_path, capsys):
    prog = ir.compile(models.get("tiny-gpt"), "dp=2,tp=2,pp=2,sp", global_batch=8, seq_len=32)
    obj = prog.to_json()
    obj["meta"]["deploy"] = {"format": "parashift.plan", "model": "tiny-gpt", "strategy": "dp=2,tp=2,pp=2,sp",
                             "global_batch": 8, "seq_len": 32}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(obj))
    assert main(["export", str(plan), "--to", "megatron", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["strategy"] == "dp=2,tp=2,pp=2,sp" and got["global_batch"] == 8
    assert got["options"]["--tensor-model-parallel-size"] == 2 and got["options"]["--seq-length"] == 32
    assert isinstance(got["unsupported"], list) and "tp_async off" in got["unsupported"][0]
    assert main(["export", str(plan), "--to", "torchtitan", "--lr", "1e-3", "--steps", "50"]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert doc["parallelism"]["tensor_parallel_degree"] == 2 and doc["optimizer"]["lr"] == 1e-3


def test_cli_errors_are_one_line(capsys):
    assert main(["export", "dp=2", "--to", "megatron"]) == 1
    assert "needs --model and --global-batch" in capsys.readouterr().err
    assert main(["export", "dp=3", "--model", "tiny-gpt", "--global-batch", "8", "--to", "megatron"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "divisible" in err[0]
    assert main(["export", "dp=2", "--model", "tiny-gpt", "--global-batch", "8", "--to", "megatron",
                 "--lr", "1e-3"]) == 1
    assert "needs --steps" in capsys.readouterr().err
    with pytest.raises(InputError, match="not one of"):
        export(_job("tiny-gpt", "dp=1", 2, 8, Training()), "deepspeed")


def test_moe_routing_follows_the_model():
    """Renormalised top-k routing (Mixtral, Qwen3-MoE) is Megatron's default order (top-k, then softmax);
    softmax over every expert before top-k is --moe-router-pre-softmax; DeepSeek-V3 scores by sigmoid."""
    def args(model):
        job = Job(models.get(model), Strategy.parse("dp=8,ep=8"), 64, 4096)
        return export(job, "megatron").text
    assert "--moe-router-pre-softmax" not in args("mixtral-8x7b")
    assert "--moe-router-pre-softmax" in args("moe:layers=2,hidden=256,heads=4,experts=8,top_k=2,expert_ffn=512,vocab=512")
    assert "--moe-router-score-function sigmoid" in args("deepseek-v3")
