"""Regions recorded from a torch model on meta tensors equal the preset's DAG."""
from __future__ import annotations

import subprocess
import sys

import pytest

from parashift import models
from parashift.errors import ProgramError
from parashift.ir import model_graph

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, i: int, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.i, self.heads = i, heads
        self.n1, self.n2 = RMSNorm(h), RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.fc1 = nn.Linear(h, 2 * ffn, bias=False)
        self.fc2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        import parashift
        b, s, h = x.shape
        with parashift.region(f"layers.{self.i}.attn"):
            q, k, v = self.qkv(self.n1(x)).split(h, -1)
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        with parashift.region(f"layers.{self.i}.mlp"):
            g, u = self.fc1(self.n2(x)).chunk(2, -1)
            x = x + self.fc2(F.silu(g) * u)
        return x


class TinyGPT(nn.Module):
    def __init__(self, layers=2, h=32, heads=4, ffn=64, vocab=64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(i, h, heads, ffn) for i in range(layers))
        self.norm = RMSNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        import parashift
        with parashift.region("embed"):
            x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        with parashift.region("head"):
            return self.head(self.norm(x))


def test_trace_equals_preset_graph():
    from parashift.ir.annotate import trace
    spec = models.gpt(2, 32, 4, ffn=64, vocab=64, seq_len=16, name="t", pad_vocab=8)
    model = TinyGPT()
    g = trace(model, torch.zeros(2, 16, dtype=torch.long))
    ref = model_graph(spec, mbs=2, seq_len=16)
    assert g.col("region") == ref.col("region")
    assert sorted(zip(g.src, g.dst)) == sorted(zip(ref.src, ref.dst))
    assert g.col("layer") == ref.col("layer")
    assert g.col("kind") == ref.col("kind")
    for a, b in zip(g.col("flops"), ref.col("flops")):
        assert a == pytest.approx(b, rel=1e-9)
    assert g.col("params") == [p // 2 * 4 for p in ref.col("params")]  # preset bf16, torch fp32
    assert g.col("shape")[-1] == (2, 16, 64)
    # the real model is untouched and annotated regions are no-ops outside a trace
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 64)


def test_annotate_submodules_and_skip_edges_are_reduced():
    from parashift.ir.annotate import annotate, trace
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = annotate(lin1, "layers.0.attn"), annotate(lin2, "layers.0.mlp")

        def forward(self, x):
            y = x + self.a(x)
            return y + self.b(y)

    g = trace(M(), torch.zeros(4, 8))
    assert g.col("region") == ["layers.0.attn", "layers.0.mlp"]
    assert list(zip(g.src, g.dst)) == [(0, 1)]
    assert g.col("flops") == [2 * 4 * 8 * 8, 2 * 4 * 8 * 8]
    assert g.col("params") == [(64 + 8) * 4, (64 + 8) * 4]


def test_trace_without_regions_is_an_error():
    from parashift.ir.annotate import trace
    with pytest.raises(ProgramError, match="no parashift.region"):
        trace(nn.Linear(4, 4), torch.zeros(2, 4))


def test_importing_ir_does_not_import_torch():
    code = ("import sys, parashift.ir, parashift.ir.annotate, parashift.ir.validate; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("strategy", ["dp=2,pp=2,zero=3", "dp=1,pp=2,vpp=2,schedule=interleaved-1f1b",
                                      "dp=2,pp=2,schedule=zb-h1,recompute=full", "dp=1,pp=1"])
def test_traced_model_compiles_for_dp_pp_zero(strategy):
    from parashift.ir import Program, compile
    from parashift.ir.annotate import trace
    from parashift.ir.actions import stage_orders
    g = trace(TinyGPT(layers=4), torch.zeros(1, 16, dtype=torch.long))
    prog = compile(g, strategy, global_batch=8).validate()
    assert Program.from_json(prog.to_json()) == prog
    regions = {i.region for p in prog.ranks.values() for i in p.instrs() if i.op == "compute" and i.region}
    assert any(r.startswith("embed") for r in regions) and any(r.endswith("head") for r in regions)
    assert sum(len(v) for v in stage_orders(prog).values()) > 0
    mem = prog.ranks[0].static_memory
    assert mem["param"] > 0 and 2 * mem["param"] - 1 <= mem["optim"] <= 2 * mem["param"]  # fp32 AdamW moments
    assert mem["master"] == 0


def test_traced_model_rejects_tp():
    from parashift.errors import StrategyError
    from parashift.ir import compile
    from parashift.ir.annotate import trace
    g = trace(TinyGPT(), torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(StrategyError, match="tp=2"):
        compile(g, "tp=2", global_batch=1)
    with pytest.raises(StrategyError, match="exceeds"):
        compile(g, "pp=4", global_batch=4)
