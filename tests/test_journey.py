"""The user's journey end to end (issue #39): a tiny Llama saved by ``transformers``, a token file prepared
from the shipped text, ``parashift run --model hf:DIR --data PATH`` with warmup + cosine, clipping and a hot
switch at step 10. Its losses, gradient norms and rates equal a plain single-process ``transformers`` +
``torch.optim.AdamW`` loop on the same sequences in the same order, and its ``--export-hf`` folder loads in
``transformers`` with the loop's logits (fp32, CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from parashift import Strategy                       # noqa: E402
from parashift.cli import main                       # noqa: E402
from parashift.data import open_tokens               # noqa: E402
from parashift.exec.reference import OptimConfig     # noqa: E402
from parashift.exec.train import TokenData           # noqa: E402
from parashift.train import LRSchedule               # noqa: E402
from parashift.train.schedule import decays          # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "data" / "lighthouse.txt"
STEPS, GB, SEQ, VOCAB = 20, 8, 16, 320
LR, WARMUP, MIN_LR, CLIP, WD = 3e-3, 3, 3e-4, 1.0, 0.1
TRAIN = ["--lr", str(LR), "--lr-warmup-steps", str(WARMUP), "--lr-decay", "cosine", "--min-lr", str(MIN_LR),
         "--clip-grad", str(CLIP), "--weight-decay", str(WD)]
RTOL = 1e-5


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """(model folder, token file): a BPE tokenizer trained on the shipped text, the text prepared with it
    by ``parashift data prepare``, and a tiny Llama (norm gains moved off one) saved by ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tmp = tmp_path_factory.mktemp("journey")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(TEXT)], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    data = tmp / "lighthouse.bin"
    assert main(["data", "prepare", str(TEXT), "--tokenizer", str(tmp / "tok"), "--out", str(data),
                 "--split", "paragraph"]) == 0
    assert json.loads(data.with_suffix(".json").read_text())["vocab_size"] <= VOCAB
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp / "model")
    assert list((tmp / "model").glob("*.safetensors"))
    return tmp / "model", data


def _lr_schedule() -> LRSchedule:
    return LRSchedule(LR, warmup_steps=WARMUP, decay="cosine", min_lr=MIN_LR, decay_steps=STEPS)


def _loop(model_dir: Path, data: Path, samples: list[list[int]]):
    """The plain loop: transformers' model, torch's AdamW (decay on matrices and embeddings), the same
    schedule, ``clip_grad_norm_``, mean token cross-entropy over the global batch of the given sequences."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    named = list(model.named_parameters())
    opt_defaults = OptimConfig()         # parashift's AdamW defaults, passed explicitly to torch
    groups = [{"params": [p for n, p in named if decays(n, p.shape)], "weight_decay": WD},
              {"params": [p for n, p in named if not decays(n, p.shape)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(opt_defaults.beta1, opt_defaults.beta2), eps=opt_defaults.eps,
                            foreach=False)
    sched = _lr_schedule()
    rates = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: sched.at(k) / LR)   # the rate of update k
    tf = open_tokens(str(data), SEQ)
    rows = []
    for seqs in samples:
        x = torch.from_numpy(tf.sequences(np.asarray(seqs), SEQ).astype(np.int64))
        opt.zero_grad()
        logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        rows.append((float(loss.detach()), float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP,
                                                                              foreach=False)),
                     opt.param_groups[0]["lr"]))
        opt.step()
        rates.step()
    losses, norms, lrs = (list(c) for c in zip(*rows))
    return model.eval(), losses, norms, lrs


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize("strategy,switch", [("tp=2,pp=2", "10:dp=2,zero=1"), ("dp=2,zero=1", "10:tp=2")],
                         ids=["tp2pp2-to-dp2zero1", "dp2zero1-to-tp2"])
def test_hf_model_trains_like_a_plain_transformers_loop(journey, strategy, switch, tmp_path, capsys):
    model_dir, data = journey
    out_dir = tmp_path / "export"
    assert main(["run", "--model", f"hf:{model_dir}", "--data", str(data), "--strategy", strategy,
                 "--switch-at", switch, "--steps", str(STEPS), "--global-batch", str(GB), "--seq-len", str(SEQ),
                 *TRAIN, "--export-hf", str(out_dir), "--json", "--timeout", "240"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in run["switches"]] == [10] and not run["switches"][0].get("aborted")
    assert run["strategies"] == [str(Strategy.parse(strategy)), str(Strategy.parse(switch.split(":", 1)[1]))]
    # the sequences: the sampler's global order, whatever the layout
    feed = TokenData(str(data)).open(SEQ, GB, VOCAB)
    assert run["samples"] == [feed.indices(k) for k in range(STEPS)]
    assert run["tokens"] == [GB * SEQ] * STEPS
    model, losses, norms, lrs = _loop(model_dir, data, run["samples"])
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(LR, rel=1e-12)          # Megatron's warmup: step 0 trains at 0, step 3 at --lr
    assert max(norms) > CLIP                           # clipping is exercised
    np.testing.assert_allclose(run["lr"], lrs, rtol=1e-12)
    loss_rel, norm_rel = _rel(run["losses"], losses), _rel(run["grad_norm"], norms)
    print(f"{strategy} -> {switch}: max relative difference losses {loss_rel:.2e}, grad norms {norm_rel:.2e}")
    assert loss_rel <= RTOL and norm_rel <= RTOL, (run["losses"], losses, run["grad_norm"], norms)
    assert losses[-1] < losses[0]
    # the exported folder loads in transformers and computes the loop's logits
    assert run["export_hf"] == str(out_dir)
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    x = torch.from_numpy(open_tokens(str(data), SEQ).sequences(np.arange(4), SEQ).astype(np.int64))[:, :-1]
    with torch.no_grad():
        want, got = model(x).logits, back(x).logits
    diff = float((got - want).abs().max())
    print(f"exported logits: max abs difference {diff:.2e} (max |logit| {float(want.abs().max()):.2f})")
    assert diff <= RTOL * max(1.0, float(want.abs().max()))
