"""A user's own torch model, annotated with parashift.region / annotate, trained by the runtime under
dp, pp (1f1b) and ZeRO-1/2/3 on gloo processes equals a single-process torch.optim.AdamW run."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import parashift
from parashift.errors import StrategyError
from parashift.exec import OptimConfig
from parashift.exec.user_model import compile_user_model, run_user_model
from parashift.ir.annotate import annotate
from parashift.train import decays

VOCAB, D, SEQ, LAYERS, GB, STEPS = 16, 16, 6, 4, 8, 4


class Block(nn.Module):
    """Pre-norm attention + MLP, regions marked inside forward."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.i = i
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        # no in-projection bias: the key bias has an exactly-zero gradient, so AdamW turns rounding noise
        # (which differs between any two summation orders) into +-lr updates of a parameter with no effect
        self.attn = nn.MultiheadAttention(D, 2, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with parashift.region(f"layers.{self.i}.attn"):
            z = self.norm1(h)
            h = h + self.attn(z, z, z, need_weights=False)[0]
        with parashift.region(f"layers.{self.i}.mlp"):
            h = h + self.mlp(self.norm2(h))
        return h


def tiny_lm() -> nn.Module:
    """A tiny transformer as an nn.Sequential of annotated blocks (pipeline-splittable)."""
    return nn.Sequential(annotate(nn.Embedding(VOCAB, D), "embed"), *[Block(i) for i in range(LAYERS)],
                         annotate(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, VOCAB)), "head"))


class SkipNet(nn.Module):
    """Not a Sequential, and the head reads the embedding too: fine for dp/zero, not for pp."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.out = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with parashift.region("embed"):
            e = self.emb(tokens)
        h = e
        for i, b in enumerate(self.blocks):
            with parashift.region(f"layers.{i}"):
                h = torch.tanh(b(h))
        with parashift.region("head"):
            return self.out(h + e)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (GB, SEQ + 1), generator=g)
    x[:, 1:] = (3 * x[:, :-1] + 1) % VOCAB
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


EXAMPLE = torch.zeros(1, SEQ, dtype=torch.int64)
OPT = OptimConfig()


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch.optim.AdamW with weight decay on matrices only (the runtime's rule, parashift.train.decays)."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, p.shape) == d], "weight_decay": OPT.weight_decay * d}
              for d in (True, False)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=OPT.lr, betas=(OPT.beta1, OPT.beta2),
                             eps=OPT.eps, foreach=False)


def reference(factory, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training: the model on the whole global batch, torch.optim.AdamW."""
    torch.manual_seed(0)
    model = factory()
    opt = adamw(model)
    losses = []
    for step in range(steps):
        x, y = batches(step)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


_REF: dict = {}


def _ref(factory):
    if factory not in _REF:
        _REF[factory] = reference(factory)
    return _REF[factory]


def _check(factory, strategy: str) -> None:
    ref_losses, ref_params = _ref(factory)
    r = run_user_model(factory, strategy, example_input=EXAMPLE, data=batches, loss_fn=lm_loss, steps=STEPS,
                       global_batch=GB, params=True, timeout=120)
    assert r.nprocs == r.program.world
    assert len(r.to_frame()) == sum(len(r.program.ranks[k]) for k in range(r.nprocs))   # every instruction ran
    assert len(r.losses) == STEPS and ref_losses[-1] < ref_losses[0]
    for got, want in zip(r.losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (strategy, r.losses, ref_losses)
    assert set(r.params) == set(ref_params)
    for n, want in ref_params.items():
        torch.testing.assert_close(r.params[n], want, rtol=1e-5, atol=1e-5, msg=f"{strategy}: {n}")


@pytest.mark.parametrize("strategy", ["dp=2", "dp=2,pp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3"])
def test_user_transformer_matches_single_process(strategy):
    _check(tiny_lm, strategy)


def test_any_annotated_module_runs_data_parallel_with_zero():
    _check(SkipNet, "dp=2,zero=2")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["pp=2,vpp=2,schedule=interleaved-1f1b", "pp=2,schedule=zb-h1",
                                      "pp=2,vpp=2,schedule=dualpipev", "dp=2,pp=2,zero=3,recompute=full",
                                      "pp=4,schedule=gpipe", "dp=2,pp=2,zero=1,schedule=zb-h1"])
def test_user_transformer_more_schedules(strategy):
    _check(tiny_lm, strategy)


def test_plan_places_children_on_chunks_and_shards_flat_buffers():
    program, plan = compile_user_model(tiny_lm, "dp=2,pp=2,zero=1", example_input=EXAMPLE, global_batch=GB)
    program.validate()
    assert plan.children == ((0, 1, 2), (3, 4, 5))         # embed + 2 blocks | 2 blocks + head
    assert plan.boundary == (((1, SEQ, D), "float32"),)
    assert {n for n, _ in tiny_lm().named_parameters()} == {t.name for t in plan.spec.tensors}
    from parashift.exec.state import StateStore
    stores = [StateStore(plan.spec, program.strategy, r, torch.device("cpu"), init=False) for r in range(4)]
    for st in stores:               # each DP pair shards its stage's flat buffer in two even halves
        b = st.buffers["dense"]
        assert b.padded == 2 * b.q and b.numel == sum(p.numel for p in b.pieces)
    names0 = {p.name for p in stores[0].buffers["dense"].pieces}
    assert "0.weight" in names0 and not any(n.startswith("5.") for n in names0)
    gapped = compile_user_model(_gapped, "pp=2", example_input=EXAMPLE, global_batch=GB)[1]
    assert gapped.children == ((0, 1, 2), (3, 4))           # a region-less child joins the chunk before it


def _gapped() -> nn.Module:
    return nn.Sequential(annotate(nn.Embedding(VOCAB, D), "embed"), Block(0), nn.Identity(), Block(1),
                         annotate(nn.Linear(D, VOCAB), "head"))


def test_unsupported_strategies_raise_clear_errors():
    with pytest.raises(StrategyError, match="tp=2"):
        run_user_model(tiny_lm, "dp=2,tp=2", example_input=EXAMPLE, data=batches, loss_fn=lm_loss)
    with pytest.raises(StrategyError, match="nn.Sequential"):
        compile_user_model(SkipNet, "pp=2", example_input=EXAMPLE, global_batch=GB)
    with pytest.raises(StrategyError, match="pipeline cut must fall between children"):
        compile_user_model(_one_block_model, "pp=2", example_input=EXAMPLE, global_batch=GB)


def _one_block_model() -> nn.Module:
    """Both layers' regions inside one child: no pipeline cut between them."""
    return nn.Sequential(nn.Embedding(VOCAB, D), nn.Sequential(Block(0), Block(1)))


_CLI_MODULE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

from parashift.exec import UserModel
from parashift.ir.annotate import annotate


def make():
    return nn.Sequential(annotate(nn.Linear(4, 16), "embed"),
                         *[annotate(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), f"layers.{i}") for i in range(4)],
                         annotate(nn.Linear(16, 2), "head"))


def data(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    return x, torch.stack([x.sum(1), x[:, 0] * x[:, 1]], 1)


job = UserModel(make, torch.zeros(1, 4), data, F.mse_loss, name="mlp")
'''


def check_mlp_losses(module, losses: list[float]) -> None:
    """``losses`` equal a single-process AdamW run of ``module.make()`` on ``module.data`` (MSE)."""
    torch.manual_seed(0)
    model = module.make()
    opt = adamw(model)
    for step, got in enumerate(losses):
        x, y = module.data(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        assert abs(got - loss.item()) <= 1e-5 * loss.item()


def test_cli_runs_a_user_model_by_module_name(tmp_path, monkeypatch, capsys):
    """`parashift run --model mymlp:job` in the folder of mymlp.py, in-process through the CLI's entry
    point: the module is found from the working directory (the CLI puts it on sys.path, as a console
    script needs) and the workers import it."""
    import json
    import sys
    from parashift.cli import main
    (tmp_path / "mymlp.py").write_text(_CLI_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    argv = ["run", "--model", "mymlp:job", "--strategy", "dp=2,pp=2,zero=1", "--steps", "3", "--json"]
    try:
        rc = main(argv)
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        res = json.loads(cap.out)
        assert res["model"] == "mlp" and res["nprocs"] == 4 and len(res["losses"]) == 3
        import mymlp
        check_mlp_losses(mymlp, res["losses"])
        assert main(argv[:4] + ["tp=2"]) != 0
        err = capsys.readouterr().err
        assert "tp=2" in err and "Traceback" not in err
    finally:
        sys.modules.pop("mymlp", None)
