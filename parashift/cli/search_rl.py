"""`parashift search-rl`: the (training, rollout) layout pair that makes an RL iteration fastest."""
from __future__ import annotations

import argparse
import sys

from ..validate import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, arg_int
from .options import add_cost_model, load_cost_model, positive_int, strategy_text

HELP = ("choose the training and rollout layouts of an RL job: simulated training step, rollout (prefill and "
        "decode) and both weight switches per iteration, against one layout for both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model preset, e.g. llama2-7b (see `parashift models`)")
    p.add_argument("--cluster", required=True, help="cluster preset, e.g. h100-16x8")
    p.add_argument("--devices", type=positive_int, required=True, help="devices the job trains on")
    p.add_argument("--prompts", type=arg_int(1, MAX_GLOBAL_BATCH), required=True,
                   help="sequences per iteration (the batch)")
    p.add_argument("--prompt-len", type=arg_int(1, MAX_SEQ_LEN), required=True, help="tokens of each prompt")
    p.add_argument("--rollout-tokens", type=arg_int(1, MAX_SEQ_LEN), required=True,
                   help="tokens generated per sequence")
    p.add_argument("--rollout-dtype", choices=("fp32", "bf16"), default="bf16", help="the rollout copy's (default bf16)")
    p.add_argument("--train", action="append", type=strategy_text, metavar="STRATEGY",
                   help="a training layout to consider (repeatable; default: the most promising of the space)")
    p.add_argument("--rollout", action="append", type=strategy_text, metavar="STRATEGY",
                   help="a rollout layout to consider (repeatable; default: every TP x replicas layout)")
    p.add_argument("--keep-weights", action="store_true",
                   help="the training weights stay during the rollout (no switch back)")
    p.add_argument("--top", type=positive_int, default=8, help="pairs to show (default 8)")
    add_cost_model(p)


def run(args: argparse.Namespace) -> dict:
    from ..search.rl import plan_rl
    cost = load_cost_model(args.cost_model)

    def progress(msg: str) -> None:
        if not args.json:
            print(f"  {msg}", file=sys.stderr, flush=True)
    plan = plan_rl(args.model, args.cluster, devices=args.devices, prompts=args.prompts, prompt_len=args.prompt_len,
                   rollout_tokens=args.rollout_tokens, dtype=args.rollout_dtype, release=not args.keep_weights,
                   train=args.train, rollout=args.rollout, cost_model=cost, progress=progress)
    out = plan.to_json()
    out["pairs"] = out["pairs"][:args.top]
    return out


def render(result: dict, args: argparse.Namespace) -> None:
    b, s = result["best"], result["single_layout"]
    print(f"{result['model']} on {result['devices']} devices: {result['prompts']} prompts of {result['prompt_len']} "
          f"tokens, {result['rollout_tokens']} generated")
    print(f"  best pair     train {b['train']}  rollout {b['rollout']}  {b['iteration_seconds']:.4f} s/iteration "
          f"(train {b['train_seconds']:.4f}, rollout {b['rollout_seconds']:.4f}, switches "
          f"{b['to_rollout_seconds']:.4f} + {b['to_train_seconds']:.4f})")
    if s is not None:
        print(f"  one layout    {s['train']}  {s['iteration_seconds']:.4f} s/iteration  -> the pair is "
              f"{result['speedup_over_single_layout']:.3f}x faster")
    for r in result["pairs"]:
        print(f"    {r['iteration_seconds']:.4f} s  train {r['train']:<40} rollout {r['rollout']}")
