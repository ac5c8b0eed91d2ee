"""Step 6, real data: the commands a user types to deploy a Hugging Face model on real text.

A tiny Llama ``config.json``, a BPE tokenizer trained on the shipped public-domain ``data/lighthouse.txt``,
``parashift data prepare``, ``parashift search`` on ``cpu-local``, ``parashift run --data`` across a hot
switch next to a static run (which writes ``--export-hf`` weights), and ``parashift export --to
megatron|torchtitan``. Every command runs through the CLI's entry function and is listed in the summary.
"""
from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core import DemoError, require

if TYPE_CHECKING:  # pragma: no cover
    from .core import DemoContext, StepResult

__all__ = ["REAL", "TEXT", "tiny_llama_config", "train_tokenizer", "switch_target", "step_real_data"]

#: The shipped public-domain text (data/PROVENANCE.md).
TEXT = Path(__file__).resolve().parents[2] / "data" / "lighthouse.txt"

#: The job: 2 CPU processes, 12 steps of 8 sequences of 32 tokens, a hot switch before step 7.
REAL = {"devices": 2, "steps": 12, "switch_at": 6, "global_batch": 8, "seq_len": 32, "trials": 8, "vocab": 512,
        "train": "--lr 3e-3 --lr-warmup-steps 2 --lr-decay cosine --min-lr 3e-4 --clip-grad 1.0"}


def tiny_llama_config(vocab: int) -> dict:
    """A 4-layer Llama ``config.json`` (hidden 64, 4 heads, 2 KV heads) for a vocabulary of ``vocab``."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32"}


def train_tokenizer(text: Path, folder: Path, vocab: int) -> int:
    """Train a byte-level BPE tokenizer of at most ``vocab`` tokens on ``text`` into ``folder/tokenizer.json``;
    return its vocabulary size."""
    tk = require("tokenizers", "Tokenizer", "decoders", "models", "pre_tokenizers", "trainers")
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(text)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def switch_target(ranked: list[str]) -> str:
    """The best-ranked strategy whose dp/tp/pp shape differs from the first's (the winner's)."""
    from ..strategy import Strategy
    shapes = [Strategy.parse(s) for s in ranked]
    for s, text in zip(shapes[1:], ranked[1:]):
        if (s.dp, s.tp, s.pp) != (shapes[0].dp, shapes[0].tp, shapes[0].pp):
            return text
    raise DemoError(f"the search ranked only one dp/tp/pp shape ({ranked}); run more trials")


def _cli(command: str, commands: list[str]) -> Any:
    """Run ``parashift ...`` through the CLI's entry function; its ``--json`` output (or text)."""
    from ..cli import main
    commands.append(command)
    argv = shlex.split(command)[1:]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc != 0:
        raise DemoError(f"`{command}` exited {rc}; its error is on stderr above")
    return json.loads(buf.getvalue()) if "--json" in argv else buf.getvalue()


def step_real_data(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 6: tokenizer, token file, search, live run across a hot switch vs static, exports."""
    from ..plots import plot_losses
    require("tokenizers", "Tokenizer")
    r = REAL
    work = ctx.out / "real"
    work.mkdir(parents=True, exist_ok=True)
    ctx.say(f"training a {r['vocab']}-token BPE tokenizer on {TEXT.name}")
    vocab = train_tokenizer(TEXT, work / "tokenizer", r["vocab"])
    (work / "llama").mkdir(exist_ok=True)
    (work / "llama" / "config.json").write_text(json.dumps(tiny_llama_config(vocab), indent=1) + "\n")
    w = f"{ctx.out}/real"
    model = f"hf:{w}/llama"
    shape = f"--global-batch {r['global_batch']} --seq-len {r['seq_len']}"
    commands: list[str] = []
    ctx.say("parashift data prepare")
    data = _cli(f"parashift data prepare {shlex.quote(str(TEXT))} --tokenizer {w}/tokenizer --out {w}/lighthouse.bin "
                f"--split paragraph --json", commands)
    ctx.say(f"parashift search on cpu-local, {r['devices']} processes, {r['trials']} trials")
    found = _cli(f"parashift search --model {model} --cluster cpu-local --devices {r['devices']} {shape} "
                 f"--trials {r['trials']} --seed 0 --out {w}/plan.json --json", commands)
    ranked = [t["strategy"] for t in found["top"]]
    best, other = ranked[0], switch_target(ranked)
    run = (f"parashift run --model {model} --data {w}/lighthouse.bin --steps {r['steps']} {shape} {r['train']} "
           f"--strategy {best} --json")
    ctx.say(f"live run: {best}, hot switch to {other} before step {r['switch_at'] + 1}")
    live = _cli(f"{run} --switch-at {r['switch_at']}:{other} --switch-notice 0", commands)
    ctx.say("static run (the reference curve), exporting Hugging Face weights")
    static = _cli(f"{run} --export-hf {w}/hf-export", commands)
    for target in ("megatron", "torchtitan"):
        ctx.say(f"parashift export --to {target}")
        text = _cli(f"parashift export {w}/plan.json --to {target} {r['train']} --steps {r['steps']}", commands)
        (work / ("megatron_args.sh" if target == "megatron" else "torchtitan.toml")).write_text(text)
    losses, ref = live["losses"], static["losses"]
    if len(losses) != r["steps"] or len(live["switches"]) != 1 or live["samples"] != static["samples"]:
        raise DemoError(f"the live run trained {len(losses)} of {r['steps']} steps with {len(live['switches'])} "
                        f"switches, or on other samples than the static run")
    diff = max(abs(a - b) for a, b in zip(losses, ref))
    plot_losses({f"hot switch {best} -> {other}": losses, f"static {best}": ref}, ctx.path("real_data_loss.png"),
                marks=[(r["switch_at"], "hot switch")], title=f"tiny Llama on {TEXT.name}: switched vs static")
    shards = sorted(p.name for p in (work / "hf-export").glob("*.safetensors"))
    (work / "commands.sh").write_text("\n".join(commands) + "\n")
    res.add("tokens in the prepared file", data["tokens"], "tokens")
    res.add("search trials", found["trials"], "trials")
    res.add("first loss", losses[0], "")
    res.add("last loss (switched run)", losses[-1], "")
    res.add("largest loss difference, switched vs static", diff, "")
    res.add("exported safetensors shards", len(shards), "pieces")
    res.files.update({"loss: hot-switched vs static run on real tokens": "real_data_loss.png",
                      "the commands": "real/commands.sh", "Megatron-LM arguments": "real/megatron_args.sh",
                      "torchtitan TOML": "real/torchtitan.toml",
                      "exported Hugging Face config": "real/hf-export/config.json"})
    res.body = (f"A tiny Llama `config.json` (vocabulary {vocab}, from a BPE tokenizer trained on the shipped "
                f"public-domain `{TEXT.name}`) is searched on `cpu-local` ({r['devices']} processes): `{best}` wins. "
                f"It trains {r['steps']} steps on the prepared tokens, switching in memory to `{other}` before step "
                f"{r['switch_at'] + 1}; a static run of `{best}` on the same samples writes the Hugging Face weights "
                f"({', '.join(shards)}). The commands, in order, are in `real/commands.sh`.")
    res.data.update(real={"losses": losses, "static_losses": ref, "best": best, "other": other, "live": live,
                          "static": static, "commands": commands})
