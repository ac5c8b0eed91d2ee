"""A training-step Program is complete: it carries its model (StepMeta), the simulator and the runtime
read only it, and a plan of an older format is refused naming the fix."""
import json

import pytest
import torch

import parashift as ps
from parashift.errors import ProgramError
from parashift.ir.program import FORMAT_VERSION, Program
from parashift.ir.step_meta import PRECISIONS, StepMeta
from parashift.models import ModelSpec, TensorSpec
from parashift.search.result import plan_json

SPECS = [ps.models.get("tiny-gpt"), ps.models.get("tiny-moe"), ps.models.get("llama2-7b"),
         ps.models.gpt(4, 96, 6, kv_heads=2, vocab=300, seq_len=48, name="mine", norm="ln", bias=True, qk_norm=True,
                       pos_emb="learned", tied=True, dtype="fp16", flash_attention=False, dropout=0.25),
         ps.models.moe(2, 64, 4, experts=4, top_k=2, expert_ffn=32, name="m", qkv_bias=True)]


def _json(obj):
    return json.loads(json.dumps(obj))


@pytest.mark.parametrize("spec", SPECS + [ps.models.get(n) for n in ps.models.names()], ids=lambda s: s.name)
def test_model_spec_codec_is_lossless(spec):
    back = ModelSpec.from_json(_json(spec.to_json()))
    assert back == spec and back.tensors == spec.tensors and back.params == spec.params
    assert all(type(t.shape) is tuple for t in back.tensors)
    assert back.to_json() == spec.to_json()


def test_model_spec_codec_takes_defaults_and_refuses_unknown_fields():
    obj = _json(SPECS[0].to_json())
    del obj["dropout"]                   # an older writer: the field takes its default
    assert ModelSpec.from_json(obj).dropout == ModelSpec.__dataclass_fields__["dropout"].default
    with pytest.raises(ProgramError, match="'turbo'.*newer"):
        ModelSpec.from_json({**obj, "turbo": 1})
    with pytest.raises(ProgramError, match="lacks field 'hidden'"):
        ModelSpec.from_json({k: v for k, v in obj.items() if k != "hidden"})
    assert TensorSpec.from_json(_json(SPECS[0].tensors[3].to_json())) == SPECS[0].tensors[3]


def test_step_meta_round_trips_through_a_saved_program(tmp_path):
    spec = SPECS[3]
    prog = ps.ir.compile(spec, "dp=2,pp=2,schedule=interleaved-1f1b,vpp=2", global_batch=8)
    step = StepMeta.of(prog)
    assert step.model is spec and step.precision == "fp16" and step.seq_len == 48 and step.mbs == 1
    assert (step.global_batch, step.microbatches, step.schedule, step.name) == (8, 4, "interleaved-1f1b", "mine")
    prog.save(str(tmp_path / "p.json"))
    back = Program.load(str(tmp_path / "p.json"))
    got = StepMeta.of(back)
    assert got == step and got.model == spec and got.model.tensors == spec.tensors
    with pytest.raises(ProgramError, match="precision 'fp4'"):
        StepMeta(spec, step.strategy, step.schedule, 8, 48, 4, 1, precision="fp4")
    assert "bf16" in PRECISIONS


def test_simulate_prices_the_compiled_model_not_a_name():
    """The model's shape (unfused attention here) comes from the Program: equal to passing it."""
    spec = ps.models.gpt(24, 2304, 24, flash_attention=False)
    prog = ps.ir.compile(spec, "dp=32,tp=1,pp=1,mbs=16,overlap_grad", global_batch=512)
    cl = ps.cluster.get("a100-64x8")
    got, given = ps.sim.simulate(prog, cl).step_time, ps.sim.simulate(prog, cl, model=spec).step_time
    assert got == given
    flash = ps.ir.compile(ps.models.gpt(24, 2304, 24), "dp=32,tp=1,pp=1,mbs=16,overlap_grad", global_batch=512)
    assert ps.sim.simulate(flash, cl).step_time < got     # the shape matters: the test can tell


def test_an_older_plan_is_refused_in_one_line_naming_the_fix(tmp_path):
    obj = ps.ir.compile("tiny-gpt", "dp=2", global_batch=4).to_json()
    assert obj["version"] == FORMAT_VERSION
    old = {**obj, "version": 1, "meta": {k: v for k, v in obj["meta"].items() if k not in ("model_spec", "precision")}}
    for bad in (old, {**old, "version": FORMAT_VERSION}):
        (tmp_path / "old.json").write_text(json.dumps(bad))
        with pytest.raises(ProgramError) as e:
            Program.load(str(tmp_path / "old.json"))
        msg = str(e.value)
        assert "\n" not in msg and "older parashift" in msg and "parashift search" in msg, msg
    with pytest.raises(ProgramError, match="upgrade parashift"):
        Program.from_json({**obj, "version": FORMAT_VERSION + 1})
    edited = {**obj, "meta": {**obj["meta"], "model": "gpt-9"}}
    with pytest.raises(ProgramError, match="names model 'gpt-9'"):
        Program.from_json(edited)


def test_a_saved_deploy_plan_runs_with_no_other_input(tmp_path):
    """A model that is no preset: the plan alone says what to build, and trains as the compiled Program."""
    torch.set_num_threads(1)
    spec = ps.models.gpt(2, 32, 4, kv_heads=2, ffn=64, vocab=64, seq_len=16, name="not-a-preset", dtype="fp32",
                         pad_vocab=8, dropout=0.0)
    prog = ps.ir.compile(spec, "dp=1,pp=2", global_batch=4)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json(prog, model=spec, strategy=prog.strategy, global_batch=4, seq_len=16,
                                         cluster=ps.cluster.get("cpu-local"), devices=2)))
    loaded = ps.exec.load_plan(str(path))
    got = ps.exec.run_program(loaded, steps=2, timeout=120)
    want = ps.exec.run_program(prog, steps=2, model=spec, timeout=120)
    assert got.losses == pytest.approx(want.losses, rel=1e-6) and all(x > 0 for x in got.losses)
    assert got.to_json()["model"] == "not-a-preset"
    with pytest.raises(ProgramError, match="not the given"):
        ps.exec.run_program(loaded, model=ps.models.get("tiny-gpt"))
