"""Directives as the user's programming interface: Place (uneven, V), Replicate, Shard, Split,
Order, Stream and Recompute on a user's annotated torch model, alone and combined, train equal to a
single-process AdamW run; a Strategy expands to a directive list that compiles to its own Program;
errors name the region and the directive; user-named streams are real in Program, simulator and runtime."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parashift import directives as d
from parashift.errors import ProgramError
from parashift.exec.user_model import compile_user_model, run_user_model
from parashift.ir.annotate import trace
from parashift.ir.compile_graph import compile_graph
from parashift.ir.placement import PlacedStrategy
from parashift.ir.step_meta import StepMeta

from test_exec_user_model import _CLI_MODULE, EXAMPLE, GB, OPT, batches, check_mlp_losses, lm_loss, reference, tiny_lm

STEPS = 2
UNEVEN = d.Place({"embed": 0, "layers.0": 0, "layers.1-3": 1, "head": 1})           # layers -> stages 0,1,1,1
V = d.Place({"embed": 0, "layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 3, "head": 3},
            stages=(0, 1, 1, 0))
# a V with split backward whose weight-grads are all deferred to the end of the step (written by hand)
V_DEFER_W = d.Order({0: "0F0 0F1 3F0 3I0 3F1 3I1 0I0 0I1 3W0 3W1 0W0 0W1",
                     1: "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 1W1"})
GPIPE_4 = d.Order({0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3", 1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3"})
GRADS = d.Stream("grads", ops=("all_reduce", "reduce_scatter"))

_REF: dict = {}


def _check(strategy: str, directives: list) -> object:
    if "ref" not in _REF:
        _REF["ref"] = reference(tiny_lm, STEPS)
    ref_losses, ref_params = _REF["ref"]
    r = run_user_model(tiny_lm, strategy, directives=directives, example_input=EXAMPLE, data=batches,
                       loss_fn=lm_loss, steps=STEPS, global_batch=GB, params=True, optim=OPT, timeout=120)
    assert len(r.to_frame()) == sum(len(r.program.ranks[k]) for k in range(r.nprocs))   # every instruction ran
    for got, want in zip(r.losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (directives, r.losses, ref_losses)
    for n, want in ref_params.items():
        torch.testing.assert_close(r.params[n], want, rtol=1e-5, atol=1e-5, msg=f"{directives}: {n}")
    return r


def test_custom_place_that_used_to_crash_runs():
    r = _check("dp=1", [UNEVEN])
    assert isinstance(r.program.strategy, PlacedStrategy) and r.program.strategy.chunk_stages == (0, 1)
    assert r.program.meta["regions"]["layers.0.mlp"] == 0 and r.program.meta["regions"]["layers.1.attn"] == 1


def test_combined_v_place_zero2_split_backward_deferred_w_and_a_user_stream():
    r = _check("dp=1", [V, d.Shard(level=2, ways=2), d.Split(microbatches=2, backward=True), V_DEFER_W, GRADS])
    assert r.program.world == 4 and r.program.strategy.zero == 2
    assert "grads" in r.program.ranks[0].streams
    assert all(i.op == "reduce_scatter" for i in r.program.ranks[0].streams["grads"])
    assert "grads" in set(r.to_frame()["stream"])                 # measured on its own lane


@pytest.mark.slow
@pytest.mark.parametrize("strategy,directives", [
    ("dp=1", [V]),
    ("dp=1", [d.Replicate("*", over="dp", ways=2)]),
    ("dp=1", [d.Shard("*", level=3, ways=2)]),
    ("dp=2", [d.Split(microbatches=2)]),
    ("pp=2", [d.Split(backward=True)]),
    ("pp=2,mbs=2", [GPIPE_4]),
    ("dp=2", [GRADS]),
    ("pp=2", [d.Recompute("full")]),
    ("dp=1", [d.Replicate(ways=2, fuse_accum=True), d.Split(microbatches=2)]),
    ("pp=2,vpp=2,schedule=interleaved-1f1b", [d.Replicate(ways=2, overlap_reduce=True)]),
    ("pp=2", [d.Shard(level=1, ways=2, overlap_reduce=True, overlap_gather=True)]),
    ("dp=1", [UNEVEN, d.Replicate(ways=2), d.Split(microbatches=4), d.Recompute("full"), GPIPE_4, GRADS]),
])
def test_every_directive_alone_and_combined_matches_single_process(strategy, directives):
    _check(strategy, directives)


@pytest.fixture(scope="module")
def graph():
    return trace(tiny_lm(), EXAMPLE)


@pytest.mark.parametrize("strategy", ["dp=2,pp=2,zero=1", "dp=4,zero=1,shard=2", "pp=2,vpp=2,schedule=interleaved-1f1b",
                                      "pp=2,schedule=zb-h1", "dp=2,recompute=full", "pp=2,vpp=2,schedule=dualpipev",
                                      "dp=2,grad_fusion", "dp=2,pp=2,vpp=2,schedule=interleaved-1f1b,overlap_grad",
                                      "dp=2,pp=2,zero=1,overlap_grad,overlap_param"])
def test_a_strategy_expands_to_directives_that_compile_to_its_program(graph, strategy):
    ds = d.strategy_directives(strategy, layers=4, global_batch=GB)
    text = d.format_directives(ds)
    assert text.splitlines()[0].startswith("Place(")
    assert d.format_directives(d.parse_directives(text)) == text          # printable, and read back
    want = compile_graph(graph, strategy, global_batch=GB)
    got = compile_graph(graph, "dp=1", global_batch=GB, directives=d.parse_directives(text))
    assert str(got.strategy) == str(want.strategy) and type(got.strategy) is type(want.strategy)

    def key(p):
        return {r: {s: [(i.op, i.phase, i.chunk, i.microbatch, i.tag, i.deps) for i in ins]
                    for s, ins in p.ranks[r].streams.items()} for r in p.ranks}
    assert key(got) == key(want)


def test_errors_name_the_region_and_the_directive(graph):
    with pytest.raises(ProgramError, match=r"Place\(.*'layers.3.attn'"):
        compile_graph(graph, global_batch=GB, directives=[d.Place({"embed": 0, "layers.0-2": 0, "head": 1})])
    with pytest.raises(ProgramError, match=r"sends data backwards: region 'layers.0.mlp' \(chunk 1\)"):
        compile_graph(graph, global_batch=GB, directives=[d.Place({"*": 0, "layers.0": 1})])
    with pytest.raises(ProgramError, match=r"region 'embed' trains at ZeRO level 3 .*region 'layers.0.attn' at 1"):
        compile_graph(graph, "dp=2", global_batch=GB, directives=[d.Shard("embed", level=3), d.Shard("layers", level=1),
                                                                  d.Replicate("head")])
    with pytest.raises(ProgramError, match=r"region 'head' is neither replicated nor sharded"):
        compile_graph(graph, "dp=2", global_batch=GB, directives=[d.Replicate(("embed", "layers"))])
    with pytest.raises(ProgramError, match=r"Replicate\('\*', over='tp'\)"):
        compile_graph(graph, global_batch=GB, directives=[d.Replicate(over="tp")])
    with pytest.raises(ProgramError, match=r"Stream\('mine'.*collectives"):
        compile_graph(graph, global_batch=GB, directives=[d.Stream("mine", ops=("compute",))])
    with pytest.raises(ProgramError, match=r"Split\(microbatches=3\)"):
        compile_graph(graph, global_batch=GB, directives=[d.Split(microbatches=3)])
    with pytest.raises(ProgramError, match=r"entry 'layer.0' matches no region; the regions are embed, layers.0.attn"):
        compile_graph(graph, global_batch=GB, directives=[d.Place({"*": 0, "layer.0": 1})])
    with pytest.raises(ProgramError, match=r"Shard\('blocks', level=2.*'blocks' matches no region"):
        compile_graph(graph, "dp=2", global_batch=GB, directives=[d.Replicate(), d.Shard("blocks", level=2)])
    with pytest.raises(ProgramError, match="cannot read the directives"):
        d.parse_directives("[Place(]")


def test_user_streams_appear_in_the_program_and_the_simulated_timeline():
    from parashift.sim import simulate
    program, _ = compile_user_model(tiny_lm, "dp=2", example_input=EXAMPLE, global_batch=GB,
                                    directives=[d.Stream("grads", ops=("all_reduce",))])
    program.validate()
    assert [i.op for i in program.ranks[0].streams["grads"]] == ["all_reduce"]
    assert not any(i.op == "all_reduce" for i in program.ranks[0].streams.get("comm", ()))
    tl = simulate(program, "cpu-local").timeline
    assert "grads" in set(tl["stream"])


def test_schedule_cli_prints_the_directives_a_strategy_expands_to(capsys):
    import json

    from parashift.cli import main
    assert main(["schedule", "--model", "tiny-gpt", "--strategy", "dp=2,pp=2,zero=1", "--global-batch", "8",
                 "--directives", "--json"]) == 0
    lines = json.loads(capsys.readouterr().out)["directives"]
    assert lines == ["Place({'embed': 0, 'layers.0-1': 0, 'layers.2-3': 1, 'head': 1}, stages=(0, 1))",
                     "Split(microbatches=4)", "Shard('*', level=1, over='dp', ways=2)",
                     "Order({0: '0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3', 1: '1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3'})"]
    assert main(["run", "--model", "tiny-gpt", "--directives", "Split(microbatches=2)", "--switch-at", "1:dp=2"]) != 0
    assert "--directives refines --model/--strategy for one run" in capsys.readouterr().err




def test_run_cli_takes_a_directives_file_and_runs_the_program_it_simulated(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from parashift.cli import main
    (tmp_path / "dirmlp.py").write_text(_CLI_MODULE)
    (tmp_path / "plan.py").write_text("directives = [\n    Place({'embed': 0, 'layers.0': 0, '*': 1}),\n"
                                      "    Shard(level=2, ways=2),\n    Split(microbatches=2),\n"
                                      "    Stream('grads', ops=('reduce_scatter',)),\n]\n")
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["run", "--model", "dirmlp:job", "--directives", "plan.py", "--steps", "2", "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["nprocs"] == 4 and res["streams"] == ["comm", "compute", "grads", "p2p"]
        assert res["directives"][0] == "Place({'embed': 0, 'layers.0': 0, '*': 1})"
        assert res["simulated_step_seconds"] > 0
        import dirmlp
        check_mlp_losses(dirmlp, res["losses"])
        assert main(["run", "--model", "dirmlp:job", "--directives", "Place({'embed': 1, '*': 0})"]) != 0
        err = capsys.readouterr().err
        assert "region 'layers.0'" in err and "Place(" in err and "Traceback" not in err
    finally:
        sys.modules.pop("dirmlp", None)
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))


def test_a_preset_with_a_custom_place_runs_like_one_process():
    """The crash of #21: tiny-gpt with layers placed 0,1,1,1 used to fail with KeyError (0, 0)."""
    import sys

    import parashift as ps
    from parashift.ir.recipe import base_graph as _base, directives
    from parashift.ir.memory import static_memory
    D = sys.modules["parashift.ir.directives"]
    spec, s = ps.models.get("tiny-gpt"), ps.Strategy.parse("pp=2")
    ds = [D.Place((0, 1, 1, 1), x.chunk_stage, x.act_bytes, x.optim) if isinstance(x, D.Place) else x
          for x in directives(spec, s, global_batch=4, seq_len=spec.seq_len)]
    meta = StepMeta.build(spec, s, global_batch=4, seq_len=spec.seq_len, microbatches=4).encode()
    prog = ps.ir.lower(D.apply_all(_base(spec, s, spec.seq_len), ds), s, static_memory=static_memory(spec, s),
                       meta=meta)
    prog = ps.ir.Program.from_json(prog.to_json())
    assert prog.strategy.chunk_starts == (0, 1) and list(prog.strategy.layer_stages(4)) == [0, 1, 1, 1]
    got = ps.exec.run_program(prog, steps=2)
    want = ps.exec.run("tiny-gpt", "dp=1", steps=2, global_batch=4)
    assert got.losses == pytest.approx(want.losses, rel=1e-5)


@pytest.mark.gpu
def test_user_streams_on_their_own_cuda_streams_match_single_process():
    """On NCCL a user-named stream runs on a CUDA stream of its own (parashift.exec.lanes)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL runs one rank per GPU)")
    ref_losses, _ = reference(tiny_lm, STEPS)
    r = run_user_model(tiny_lm, "dp=2", directives=[GRADS, d.Shard(level=2)], example_input=EXAMPLE, data=batches,
                       loss_fn=lm_loss, steps=STEPS, global_batch=GB, optim=OPT, backend="nccl", timeout=300)
    assert r.losses == pytest.approx(ref_losses, rel=1e-4)
    assert "grads" in set(r.to_frame()["stream"])


PRESET_CASES = [("tiny-gpt", "dp=2,pp=2,zero=1"), ("tiny-gpt", "pp=2,vpp=2,schedule=dualpipev"),
                ("tiny-gpt", "tp=2,sp,pp=2,schedule=zb-h1"), ("tiny-gpt", "dp=2,pp=2,cp=2,recompute=full"),
                ("tiny-moe", "dp=2,ep=2,pp=2,zero=2"), ("llama2-7b", "dp=2,tp=2,pp=4,vpp=2"),
                ("tiny-gpt", "dp=2,tp=2,pp=2,zero=1,tp_async,grad_fusion"),
                ("tiny-gpt", "dp=2,pp=2,vpp=2,schedule=interleaved-1f1b,zero=1,overlap_grad,overlap_param")]


@pytest.mark.parametrize("model,strategy", PRESET_CASES)
def test_a_preset_strategy_is_sugar_for_its_directive_list(model, strategy):
    """Printed, read back and compiled on the preset, the list gives the strategy's own Program."""
    import parashift as ps
    from parashift.ir.compile import planning_costs
    from parashift.ir.schedules import schedule_order
    spec, s = ps.models.get(model), ps.Strategy.parse(strategy)
    want = ps.ir.compile(spec, s, global_batch=16, seq_len=64)
    order = schedule_order(s, want.meta["microbatches"], planning_costs(spec, s, 64))
    text = d.format_directives(d.strategy_directives(s, layers=spec.layers, global_batch=16, order=order))
    got = ps.ir.compile(spec, "dp=1", global_batch=16, seq_len=64, directives=d.parse_directives(text))

    def key(p):
        return {r: {st: [(i.op, i.phase, i.chunk, i.microbatch, i.tag, i.deps, i.nbytes, i.flops) for i in ins]
                    for st, ins in p.ranks[r].streams.items()} for r in p.ranks}
    assert str(got.strategy) == str(want.strategy) and key(got) == key(want)


def _program_key(p):
    return {r: {st: [(i.op, i.phase, i.chunk, i.microbatch, i.tag, i.deps, i.nbytes, i.flops) for i in ins]
                for st, ins in p.ranks[r].streams.items()} for r in p.ranks}


@pytest.mark.parametrize("strategy,directives", [
    ("dp=2,tp=2,tp_async,grad_fusion", [d.Replicate(ways=2, fuse_accum=True),
                                        d.Shard(over="tp", ways=2, async_bwd=True)]),
    ("tp=2,sp,zero=2,tp_async", [d.Shard(level=2), d.Shard(over="sp", ways=2, async_bwd=True)]),
    ("dp=2,zero=1,grad_fusion", [d.Shard("embed", fuse_accum=True, ways=2),
                                 d.Shard(("layers", "head"), fuse_accum=True)])])
def test_tp_async_and_grad_fusion_as_directives_compile_to_the_strategys_program(strategy, directives):
    """async_bwd on the tp (sp) Shard is tp_async, fuse_accum on the dp directives grad_fusion."""
    import parashift as ps
    text = d.format_directives(directives)
    assert d.format_directives(d.parse_directives(text)) == text
    want = ps.ir.compile("tiny-gpt", strategy, global_batch=8, seq_len=32)
    got = ps.ir.compile("tiny-gpt", "dp=1", global_batch=8, seq_len=32, directives=d.parse_directives(text))
    assert str(got.strategy) == str(want.strategy) and _program_key(got) == _program_key(want)
    assert ("tp" in got.ranks[0].streams) == want.strategy.tp_async
    # the directives state the option: on a base strategy that has it, leaving it out turns it off
    plain = [replace(x, fuse_accum=False, **({"async_bwd": False} if isinstance(x, d.Shard) else {}))
             for x in directives]
    off = ps.ir.compile("tiny-gpt", strategy, global_batch=8, seq_len=32, directives=plain)
    assert not off.strategy.tp_async and not off.strategy.grad_fusion


def test_tp_async_and_grad_fusion_directive_misuse_is_one_line():
    import parashift as ps
    cases = [([d.Shard(over="tp", ways=1, async_bwd=True)], r"Shard\('\*', over='tp', ways=1, async_bwd=True\): "
                                                             r"async_bwd .* needs ways > 1"),
             ([d.Shard(over="cp", ways=2, async_bwd=True)], r"over='cp'.*not over cp"),
             ([d.Shard(level=1, async_bwd=True)], r"level=1.*async_bwd.*not of the dp directive"),
             ([d.Shard(over="tp", ways=2, fuse_accum=True)], r"fuse_accum is how gradients accumulate.*dp directive"),
             ([d.Replicate("embed", fuse_accum=True), d.Replicate(("layers", "head"))],
              r"Replicate\('embed', over='dp', fuse_accum=True\) fuses .* but Replicate\(\('layers', 'head'\)")]
    for ds, msg in cases:
        with pytest.raises(ProgramError, match=msg) as e:
            ps.ir.compile("tiny-gpt", "dp=1", global_batch=4, directives=ds)
        assert "\n" not in str(e.value)
    with pytest.raises(ProgramError, match="over 'dp' only"):   # a user model has no tp group to overlap
        compile_graph(trace(tiny_lm(), EXAMPLE), global_batch=GB,
                      directives=[d.Shard(over="tp", ways=2, async_bwd=True)])


OVERLAP_CASES = [
    ("pp=2,vpp=2,schedule=interleaved-1f1b", "dp=2,pp=2,vpp=2,schedule=interleaved-1f1b,overlap_grad",
     [d.Replicate(ways=2, overlap_reduce=True)]),
    ("pp=2", "dp=2,pp=2,zero=2,overlap_grad,overlap_param",
     [d.Shard("embed", level=2, ways=2, overlap_reduce=True, overlap_gather=True),
      d.Shard(("layers", "head"), level=2, overlap_reduce=True, overlap_gather=True)])]


@pytest.mark.parametrize("base,strategy,directives", OVERLAP_CASES)
def test_overlap_grad_and_overlap_param_as_directives_compile_to_the_strategys_program(graph, base, strategy,
                                                                                        directives):
    """overlap_reduce on the dp directives is overlap_grad, overlap_gather on a level 1-2 Shard
    overlap_param, on a preset and on a traced model; leaving them out turns them off."""
    import parashift as ps
    text = d.format_directives(directives)
    assert d.format_directives(d.parse_directives(text)) == text
    plain = [replace(x, overlap_reduce=False, **({"overlap_gather": False} if isinstance(x, d.Shard) else {}))
             for x in directives]
    for build in (lambda s, ds: ps.ir.compile("tiny-gpt", s, global_batch=8, seq_len=32, directives=ds),
                  lambda s, ds: compile_graph(graph, s, global_batch=GB, directives=ds)):
        want = build(strategy, ())
        got = build(base, d.parse_directives(text))
        assert str(got.strategy) == str(want.strategy) and _program_key(got) == _program_key(want)
        off = build(strategy, plain)                 # on a base strategy that has them, the list turns them off
        assert not off.strategy.overlap_grad and not off.strategy.overlap_param
        assert _program_key(off) != _program_key(want)


def test_a_traced_model_reduces_each_chunk_when_overlap_grad_says(graph):
    """Without overlap_grad every gradient all-reduce of a stage waits for the stage's whole backward;
    with it, a chunk's waits for that chunk's backward only (the traced path used to overlap always)."""
    def waits(strategy):
        p = compile_graph(graph, strategy, global_batch=GB)
        ins = {i.id: i for i in p.ranks[0].instrs()}
        out = {}
        for s in p.ranks[0].streams["comm"]:
            if s.op == "all_reduce":
                assert len(s.deps) == 1
                out[s.chunk] = ins[s.deps[0]]
        return out
    base = "dp=2,pp=2,vpp=2,schedule=interleaved-1f1b"
    off, on = waits(base), waits(base + ",overlap_grad")
    assert sorted(off) == sorted(on) == [0, 2]
    assert off[0].id == off[2].id and off[0].phase == "bwd"              # the stage's last backward
    assert all(on[c].phase == "bwd" and on[c].chunk == c for c in on) and on[0].id == off[0].id
    assert on[2].id < off[2].id


def test_overlap_param_on_a_traced_model_hides_the_later_chunks_gathers_in_simulation(graph):
    """A chunk is a traced model's bucket: with two chunks a stage, the second chunk's gather runs
    behind the first chunk's forward."""
    from parashift.sim import simulate
    base = "dp=2,pp=2,vpp=2,schedule=interleaved-1f1b,zero=1"
    off, on = (simulate(compile_graph(graph, s, global_batch=GB), "cpu-local").step_time
               for s in (base, base + ",overlap_param"))
    assert on < 0.99 * off


def test_overlap_directive_misuse_is_one_line(graph):
    import parashift as ps
    from parashift.ir.user_directives import resolve
    cases = [([d.Shard(level=3, ways=2, overlap_gather=True)], r"level=3.*overlap_gather.*use level=1 or 2"),
             ([d.Shard(over="tp", ways=2, overlap_reduce=True)], r"overlap_reduce .* an option of the dp directive"),
             ([d.Shard(over="tp", ways=2, overlap_gather=True)], r"overlap_gather .* Shard\('\*', level=1 or 2"),
             ([d.Replicate("embed", overlap_reduce=True), d.Replicate(("layers", "head"))],
              r"Replicate\('embed', over='dp', overlap_reduce=True\) overlaps the gradient reduction but "
              r"Replicate\(\('layers', 'head'\), over='dp'\) does not"),
             ([d.Shard("embed", ways=2, overlap_gather=True), d.Shard(("layers", "head"))],
              r"overlaps the parameter gathers but Shard\(\('layers', 'head'\), level=1.*every dp Shard")]
    for ds, msg in cases:
        traced = [] if ds[0].over == "tp" else [lambda: compile_graph(graph, "dp=1", global_batch=GB, directives=ds)]
        for build in [lambda: ps.ir.compile("tiny-gpt", "dp=1", global_batch=4, directives=ds)] + traced:
            with pytest.raises(ProgramError, match=msg) as e:
                build()
            assert "\n" not in str(e.value)
    with pytest.raises(ProgramError, match=r"overlap_gather=True\) overlaps parameter gathers but the regions "
                                           r"with parameters are replicated"):
        resolve([d.Replicate("a"), d.Shard("b", overlap_gather=True)], ps.Strategy(dp=2), ["a", "b"],
                global_batch=8, param_regions=["a"])


def test_overlap_param_on_a_traced_model_trains_equal_to_one_process():
    """Directives with both overlaps on a traced model (ZeRO-2, 2 gloo processes): the parameter
    gathers a step leaves to the next one are finished before the parameters are read."""
    r = _check("dp=1", [d.Shard(level=2, ways=2, overlap_reduce=True, overlap_gather=True)])
    assert r.program.strategy.overlap_param and r.program.strategy.overlap_grad
    comm = r.program.ranks[0].streams["comm"]
    assert comm[0].op == "all_gather" and comm[0].tag == "dp.param.c0"      # at the head of the step


def test_preset_directive_errors_name_the_layer_and_the_axis():
    import parashift as ps
    with pytest.raises(ProgramError, match=r"layer 1 on chunks \[0, 1\]"):
        ps.ir.compile("tiny-gpt", "dp=1", global_batch=4, directives=[d.Place({"*": 0, "layers.1.mlp": 1, "layers.2-3": 1,
                                                                       "head": 1})])
    with pytest.raises(ProgramError, match=r"Shard\('layers', over='tp', ways=2\) leaves region 'embed' out"):
        ps.ir.compile("tiny-gpt", "dp=1", global_batch=4, directives=[d.Shard("layers", over="tp", ways=2)])


def test_run_cli_programs_a_preset_with_directives(capsys):
    import json

    import parashift as ps
    from parashift.cli import main
    text = ("Place({'embed': 0, 'layers.0': 0, '*': 1}); Shard(level=2, ways=2); "
            "Split(microbatches=2, backward=True); Stream('grads', ops=('reduce_scatter', 'all_gather'))")
    assert main(["run", "--model", "tiny-gpt", "--global-batch", "8", "--steps", "2", "--directives", text,
                 "--json", "--force"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["nprocs"] == 4 and res["streams"] == ["compute", "grads", "p2p"]     # every dp collective moved
    want = ps.exec.run("tiny-gpt", "dp=1", steps=2, global_batch=8)
    assert res["losses"] == pytest.approx(want.losses, rel=1e-5)
