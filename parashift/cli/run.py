"""`parashift run`: train a model under a strategy on local processes (or execute a saved plan)."""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import StrategyError
from .dialect import format_bytes
from ..validate import arg_float, arg_int
from .limits import MAX_LOCAL_PROCS, check_live
from .options import add_batch_options, resolve_device, strategy_text
from .run_hosts import add_host_arguments
from .checkpoint_options import add_checkpoint_arguments, checkpoint_options
from .train_options import add_train_options, optim_config, train_settings

HELP = "train a model for real on local processes (gloo on CPU, NCCL on GPUs) under a strategy or a saved plan"
OUTPUTS = {"timeline": "file"}
OUTPUT_FLAGS = {"timeline": "--timeline"}
ALIASES = {"--trace": "--timeline"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", nargs="?", help="a deploy plan file (a saved Program); omit to compile --model/--strategy")
    p.add_argument("--model", default="tiny-gpt", help="model preset (default tiny-gpt), hf:DIR (a Hugging Face "
                   "config.json, and its safetensors weights when present), or MODULE:NAME of a "
                   "parashift.exec.UserModel (your annotated torch model)")
    p.add_argument("--strategy", default="dp=1,tp=1,pp=1", type=strategy_text, help="e.g. 'dp=2,pp=2,schedule=1f1b'")
    p.add_argument("--directives", metavar="FILE|TEXT", help="directives refining --strategy (parashift.directives), "
                   "a Python file or inline text, e.g. \"Place({'embed': 0, 'layers.0': 0, '*': 1}); Split(microbatches=4)\"")
    p.add_argument("--nprocs", type=arg_int(1, MAX_LOCAL_PROCS), help="processes to start (default: the strategy's world size)")
    p.add_argument("--steps", type=arg_int(1, 1_000_000), default=5, help="training steps (default 5)")
    add_batch_options(p, live=True)
    p.add_argument("--data", metavar="PATH", help="train on this token file (`parashift data prepare`); each step's "
                   "global batch comes from a sampler seeded by --data-seed, the same under every strategy "
                   "(default: synthetic sequences)")
    p.add_argument("--data-seed", type=arg_int(0, 2 ** 31 - 1), default=0, help="the sampler's seed (default 0)")
    add_train_options(p)
    p.add_argument("--metrics", metavar="PATH", help="write one JSON line per step (loss, grad_norm, lr, tokens/s, "
                   "step time and the simulator's predicted step time)")
    p.add_argument("--tensorboard", metavar="DIR", help="write the per-step metrics as TensorBoard events (needs "
                   "the tensorboard package)")
    p.add_argument("--timeline", metavar="JSON", help="write the last step's measured timeline as a Chrome trace to this "
                                                   "file (was --trace)")
    p.add_argument("--timeout", type=arg_float(0, 7 * 86400, lo_open=True), default=600.0, help="seconds before the job is stopped (default 600)")
    p.add_argument("--switch-at", action="append", default=[], metavar="STEP:STRATEGY[:DEVICES]",
                   help="hot-switch the live job at STEP to STRATEGY (on DEVICES, e.g. 0,1,2 or 0-2: shrink, "
                        "grow or reshape); repeatable")
    p.add_argument("--switch-notice", type=arg_int(0, 1_000_000), default=3, metavar="STEPS",
                   help="steps of warning before each switch, while planning and world creation run in the "
                        "background (default 3)")
    p.add_argument("--switch-memory-budget", metavar="BYTES",
                   help="state bytes each device may hold during a switch (e.g. 12MiB); when the old and the new "
                        "state together exceed it, the switch runs stage by stage and frees old state as it goes")
    p.add_argument("--force", action="store_true",
                   help="start even when the preflight finds too many processes per core or too little memory")
    p.add_argument("--live", action="store_true", help="run a live (hot-switchable) job; implied by --switch-at, "
                   "needed with --endpoint")
    add_host_arguments(p)
    add_checkpoint_arguments(p)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where training runs: cpu (gloo), cuda (one GPU per process, NCCL) or auto (default: cuda "
                        "when this machine has CUDA GPUs, else cpu)")
    p.add_argument("--switch-placement", choices=("keep", "given"), default="keep",
                   help="keep (default): order each switch's devices (within a node) so that they keep the most "
                        "state in place; given: rank i runs on the i-th listed device")
    p.add_argument("--switch-cluster", metavar="CLUSTER",
                   help="cluster preset or JSON file whose links price a live job's switches (e.g. h100-1x8); its "
                        "node sizes become the job's hosts (default: cpu-local, or this machine's GPU kind on cuda)")
    from .run_rl import add_arguments as add_rl_arguments
    add_rl_arguments(p)


def run(args: argparse.Namespace) -> dict:
    from .. import models
    from ..exec import compile_program, run_program, under_torchrun
    from ..exec.train import TokenData, with_precision
    from ..ir.step_meta import StepMeta
    from .run_user import is_user_model
    args.trace = args.timeline   # the name run_user and switch_live read
    check_live(args)
    plan_train = _plan_train(args.plan) if args.plan else None
    args.train = train_settings(args, args.steps, plan_train)
    args.optim = optim_config(args.train)
    args.lr = args.train["lr"]
    if (args.data or args.metrics or args.tensorboard or args.train["precision"]) and \
            (is_user_model(args.model) or getattr(args, "rollout", None) or args.endpoint):
        raise StrategyError("--data, --metrics, --tensorboard and --precision train a preset model on this machine; "
                            "drop them for a user model, --rollout or a multi-host job")
    if not args.endpoint:   # the multi-host options, on any other run
        if args.strategy_for:
            raise StrategyError("--strategy-for is for a multi-host live job (the strategy as hosts come and go); "
                                "add --endpoint HOST:PORT and --live, or use --switch-at STEP:STRATEGY")
        if args.heartbeat_timeout is not None:
            raise StrategyError("--heartbeat-timeout is for a multi-host live job (how fast a silent host is declared "
                                "lost); add --endpoint HOST:PORT and --live, or drop --heartbeat-timeout")
        if args.snapshot_every:
            raise StrategyError("--snapshot-every is for a multi-host live job (its snapshots restore a lost host's "
                                "state); add --endpoint HOST:PORT and --live, or drop --snapshot-every")
    checkpoint = checkpoint_options(args)
    if is_user_model(args.model):
        from .run_user import run_cli as run_user_cli
        return run_user_cli(args)
    if args.directives is not None and (args.plan or args.switch_at or args.live or getattr(args, "rollout", None)):
        raise StrategyError("--directives refines --model/--strategy for one run; drop the plan file, --switch-at, "
                            "--live and --rollout")
    if getattr(args, "rollout", None):
        from .run_rl import run_cli as run_rl_cli
        return run_rl_cli(args)
    if args.store and not args.endpoint:
        raise StrategyError("--store keeps a multi-host live job's store on etcd; add --endpoint HOST:PORT (this "
                            "host's address, where its agents' liveness connections arrive) and --live")
    if args.endpoint:
        if not args.live:
            raise StrategyError("--endpoint starts a multi-host live job; add --live")
        from .run_hosts import run_cli as run_hosts_cli
        return run_hosts_cli(args)
    if args.switch_at or args.live:
        if args.plan:
            raise StrategyError("--switch-at runs a live job from --model/--strategy; drop the plan file")
        if args.steps < 1:
            raise StrategyError(f"--steps {args.steps} must be at least 1")
        from .run_live import run_cli
        return run_cli(args)
    if args.plan:
        from .inputs import load_plan as load_checked_plan
        program = load_checked_plan(args.plan)
        spec = StepMeta.of(program).model
        if args.train["precision"] and spec.dtype != args.train["precision"]:
            raise StrategyError(f"the plan was compiled for {spec.dtype}, not --precision {args.train['precision']}; "
                                f"search again with --precision {args.train['precision']}, or drop --precision")
    elif args.directives is not None:
        from ..ir.compile import compile as ir_compile
        from .run_user import read_directives
        spec = with_precision(models.get(args.model), args.train["precision"])
        program = ir_compile(spec, args.strategy, global_batch=args.global_batch,
                             seq_len=args.seq_len or spec.seq_len, directives=read_directives(args.directives))
    else:
        spec = with_precision(models.get(args.model), args.train["precision"])
        program = compile_program(spec, args.strategy, global_batch=args.global_batch,
                                  seq_len=args.seq_len or spec.seq_len)
    if args.nprocs is not None and args.nprocs != program.world:
        raise StrategyError(f"strategy {program.strategy} needs {program.world} processes, not --nprocs {args.nprocs}; "
                            f"drop --nprocs or change the strategy")
    if args.steps < 1:
        raise StrategyError(f"--steps {args.steps} must be at least 1")
    from .preflight import prediction, preflight
    data = TokenData(args.data, args.data_seed) if args.data else None
    if data is not None:      # a bad file fails here, in one line, before any process starts
        data.open(StepMeta.of(program).seq_len, StepMeta.of(program).global_batch, spec.vocab)
    pred = prediction(program)
    if not args.force and not under_torchrun():
        preflight(program, peak_per_device=(pred or {}).get("peak_memory"))
    log = _metrics_log(args, program, pred)

    def progress(step: int, loss: float, seconds: float) -> None:
        if not args.json and not log.bar:
            print(f"step {step + 1}/{args.steps}  loss {loss:.6f}  {seconds * 1e3:.1f} ms", file=sys.stderr, flush=True)

    weights = None
    if not args.plan and str(args.model).strip()[:3].lower() == "hf:":   # a Hugging Face model's own weights
        from ..exec.hf import weights_folder
        weights = weights_folder(str(args.model).strip()[3:])
    try:
        res = run_program(program, steps=args.steps, optim=args.optim, timeout=args.timeout, progress=progress,
                          metrics=log, backend={"cpu": "gloo", "cuda": "nccl"}[resolve_device(args)],
                          weights=weights, data=data, checkpoint=checkpoint)
    finally:
        log.close()
    if args.trace and not (under_torchrun() and int(os.environ["RANK"]) != 0):
        res.to_chrome_trace(args.trace)
    out = res.to_json()
    out["train"] = args.train
    if args.data:
        out["data"] = args.data
    if args.metrics:
        out["metrics"] = args.metrics
    out.setdefault("warnings", [])
    out["warnings"] += log.notes
    if args.directives:
        out["directives"] = (StepMeta.of(program).directives or "").splitlines()
        out["streams"] = sorted({s for rp in program.ranks.values() for s in rp.streams})
    if args.trace:
        out["timeline"] = args.trace
    if pred is not None:
        cmp = _compare(pred, res.step_times)
        cmp["warnings"] = out["warnings"] + cmp["warnings"]
        out.update(cmp)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        sys.stdout = open(os.devnull, "w")   # every rank has the gathered result; rank 0 prints it
    return out


def _plan_train(path: str) -> dict | None:
    """The trainer settings a deploy plan records (``meta.deploy.train``), or None."""
    from ..validate import read_json
    obj = read_json(path, "plan")
    deploy = (obj.get("meta") or {}).get("deploy") if isinstance(obj, dict) else None
    train = deploy.get("train") if isinstance(deploy, dict) else None
    return train if isinstance(train, dict) else None


def _metrics_log(args: argparse.Namespace, program, pred: dict | None):
    """The per-step metrics sink: the plan's predicted step time, else the simulator's for this Program."""
    from ..exec.metrics import MetricsLog
    from ..ir.step_meta import StepMeta
    predicted = (pred or {}).get("step_time")
    if predicted is None and (args.metrics or args.tensorboard):
        from ..sim import simulate
        predicted = float(simulate(program, "cpu-local").step_time)
    step = StepMeta.of(program)
    tokens = step.global_batch * (step.seq_len or 0)
    return MetricsLog(args.steps, tokens, path=args.metrics, tensorboard=args.tensorboard, predicted=predicted,
                      bar=not args.json)


def _compare(pred: dict, step_times: list[float]) -> dict:
    """Predicted against measured step time (median after the first, warm-up step), with warnings."""
    import statistics
    measured = statistics.median(step_times[1:] or step_times)
    from ..exec import under_torchrun
    here = pred["cluster"] if under_torchrun() else "cpu-local"  # torchrun: the cluster the plan is for
    warnings = []
    if pred["cluster"] != here:
        warnings.append(f"the plan was predicted for {pred['cluster']} and ran on {here}: the figures are not "
                        "comparable; search for this cluster to compare")
    elif pred["uncalibrated"]:
        warnings.append(f"the prediction uses {here}'s uncalibrated datasheet cost model; run `parashift "
                        "calibrate --out cost.json` and search again with --cost-model cost.json")
    return {"predicted_step_seconds": pred["step_time"], "measured_step_seconds": measured,
            "measured_over_predicted": measured / pred["step_time"] if pred["step_time"] > 0 else None,
            "predicted_cluster": pred["cluster"], "cost_model_calibrated": not pred["uncalibrated"],
            "warnings": warnings}


def render(result: dict, args: argparse.Namespace) -> None:
    if "rollout" in result:
        from .run_rl import render_cli as render_rl
        render_rl(result)
        return
    if "switches" in result:
        from .run_live import render_cli
        render_cli(result)
        return
    times = sorted(result["step_times"])
    print(f"{result['model']} under {result['strategy']} ({result['schedule']}) on {result['nprocs']} processes")
    print(f"  loss          {result['losses'][0]:.6f} -> {result['losses'][-1]:.6f} over {len(result['losses'])} steps")
    print(f"  step time     median {times[len(times) // 2] * 1e3:.1f} ms")
    print(f"  peak memory   {format_bytes(max(result['peak_memory']))} (max over ranks)")
    if result.get("predicted_step_seconds") is not None:
        p, m = result["predicted_step_seconds"], result["measured_step_seconds"]
        print(f"  predicted     {p * 1e3:.1f} ms per step ({result['predicted_cluster']}), measured {m * 1e3:.1f} ms "
              f"(median after the first step): {m / p:.2f}x the prediction")
    if result.get("simulated_step_seconds") is not None:
        print(f"  simulated     {result['simulated_step_seconds'] * 1e3:.1f} ms per step (cpu-local, same Program)")
    for line in result.get("directives", []):
        print(f"  directive     {line}")
    for w in result.get("warnings", []):
        print(f"  warning: {w}")
    if result.get("timeline"):
        print(f"  timeline      {result['timeline']}")
    if result.get("resumed"):
        print(f"  resumed       from step {result['resumed']['step']} ({result['resumed']['strategy']}) in "
              f"{result['resumed']['dir']}")
    if result.get("saved"):
        print(f"  saved         step {result['saved']['step']} in {result['saved']['dir']}")
    if result.get("export_hf"):
        print(f"  exported      Hugging Face safetensors in {result['export_hf']}")
