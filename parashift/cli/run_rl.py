"""`parashift run --rollout`: a live job with RL phases (rollout in one layout, training in another)."""
from __future__ import annotations

import argparse
import sys

from ..errors import StrategyError
from .options import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rollout", metavar="STRATEGY",
                   help="RL phases: every iteration switch the weights to this rollout layout (e.g. 'tp=2' or "
                        "'tp=2,dp=2', on the first devices), generate, switch back and train on the sequences")
    p.add_argument("--rollout-tokens", type=positive_int, default=8, metavar="K",
                   help="tokens generated per sequence each iteration (with --rollout; default 8)")
    p.add_argument("--rollout-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the rollout copy of the weights (with --rollout; default fp32)")
    p.add_argument("--rollout-keep-weights", action="store_true",
                   help="keep the training copy of the weights during the rollout (default: free it and restore "
                        "it from the rollout copy when that has the training dtype)")
    p.add_argument("--prompt-len", type=positive_int, default=8,
                   help="tokens of each prompt (with --rollout; default 8)")
    p.add_argument("--iterations", type=positive_int, help="RL iterations (with --rollout; default --steps)")


def run_cli(args: argparse.Namespace) -> dict:
    from ..exec.rl.job import run_rl
    if args.plan or args.switch_at:
        raise StrategyError("--rollout runs an RL job from --model/--strategy; drop the plan file and --switch-at")
    if getattr(args, "device", "auto") == "cuda":
        raise StrategyError("--rollout jobs run on CPU processes (gloo) in this version; drop --device cuda")
    iterations = args.iterations or args.steps

    def progress(it: int, loss: float) -> None:
        if not args.json:
            print(f"iteration {it + 1}/{iterations}  loss {loss:.6f}", file=sys.stderr, flush=True)
    res = run_rl(args.model, args.strategy, args.rollout, iterations=iterations, rollout_tokens=args.rollout_tokens,
                 prompts=args.global_batch, prompt_len=args.prompt_len, dtype=args.rollout_dtype,
                 release=False if args.rollout_keep_weights else None,
                 optim=args.optim, timeout=args.timeout, progress=progress)
    if args.trace:
        res.timeline().to_csv(args.trace, index=False)
    out = res.to_json()
    if args.trace:
        out["trace"] = args.trace
    return out


def render_cli(result: dict) -> None:
    its = result["iterations"]
    print(f"{result['model']}: training {result['strategy']}, rollout {result['rollout']} "
          f"({result['rollout_dtype']}), {result['rollout_tokens']} tokens per sequence")
    for r in its:
        print(f"  iteration {r['iteration']}  loss {r['loss']:.6f}  rollout switch {r['rollout_switch_seconds'] * 1e3:.1f}"
              f" ms  generate {r['generate_seconds'] * 1e3:.1f} ms  train switch {r['train_switch_seconds'] * 1e3:.1f}"
              f" ms  train {r['train_seconds'] * 1e3:.1f} ms  generated = reference: {r['generated_equal_reference']}")
