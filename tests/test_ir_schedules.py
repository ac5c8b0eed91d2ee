"""Pipeline schedules: canonical orders, text goldens, custom orders, validation."""
from __future__ import annotations

import pytest

from parashift import Strategy, models
from parashift.errors import ProgramError, StrategyError
from parashift.ir import Action, Order, compile, format_order, parse_order, schedule_steps
from parashift.ir import schedules as S
from parashift.ir.actions import stage_orders

#: 8 layers so pp * vpp = 8 fits; fp32 like the tiny presets.
GPT8 = models.gpt(8, 64, 4, kv_heads=2, ffn=128, vocab=256, seq_len=16, name="gpt8", dtype="fp32", pad_vocab=8)
MOE8 = models.moe(8, 64, 4, kv_heads=2, vocab=256, seq_len=16, experts=4, top_k=2, expert_ffn=64, name="moe8",
                  dtype="fp32", pad_vocab=8)


def torch_style_1f1b(pp: int, m: int, stage: int) -> list[str]:
    """Reference written after torch.distributed.pipelining's Schedule1F1B: fill ``pp - stage``
    forwards, then one backward followed by one forward while forwards remain, then backwards."""
    warm = min(m, pp - stage)
    seq = [f"F{i}" for i in range(warm)]
    f, b = warm, 0
    while b < m:
        seq.append(f"B{b}")
        b += 1
        if f < m:
            seq.append(f"F{f}")
            f += 1
    return seq


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_1f1b_matches_canonical_order(pp, mult):
    m = pp * mult
    orders = S.one_f_one_b(pp, m)
    for s in range(pp):
        got = [f"{a.type}{a.mb}" for (a,) in orders[s]]
        assert got == torch_style_1f1b(pp, m, s)
        # exactly pp - s - 1 warm-up forwards before the first steady forward/backward pair
        first_b = got.index("B0")
        assert first_b == pp - s
        assert all(t.startswith("F") for t in got[:first_b])


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_compiled_program_follows_1f1b(pp):
    m = 2 * pp
    prog = compile(GPT8, f"dp=1,pp={pp}", global_batch=m, seq_len=16).validate()
    orders = stage_orders(prog)
    for s in range(pp):
        assert [f"{a.type}{a.mb}" for a in orders[s]] == torch_style_1f1b(pp, m, s)


GOLDEN = {
    ("1f1b", 4, 1, 8): [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ],
    ("gpipe", 2, 1, 2): ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"],
    # Megatron-LM interleaved: warm-up (pp-s-1)*2 + (vpp-1)*pp, chunk groups of pp micro-batches
    ("interleaved-1f1b", 2, 2, 4): [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ],
    ("interleaved-1f1b", 2, 2, 2): [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ],
    ("zb-h1", 4, 1, 8): [
        "0F0 0F1 0F2 0F3 0I0 0F4 0I1 0F5 0I2 0F6 0I3 0W0 0F7 0I4 0W1 0W2 0I5 0W3 0W4 0I6 0W5 0W6 0I7 0W7",
        "1F0 1F1 1F2 1I0 1F3 1I1 1F4 1I2 1F5 1I3 1W0 1F6 1I4 1W1 1F7 1I5 1W2 1W3 1I6 1W4 1W5 1I7 1W6 1W7",
        "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2F4 2I3 2W0 2F5 2I4 2W1 2F6 2I5 2W2 2F7 2I6 2W3 2W4 2I7 2W5 2W6 2W7",
        "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7",
    ],
    # ZB-2p: ZB-H2's bound, 2(pp-s)-1 forwards in flight; the deferred W's fill the end
    ("zb-2p", 4, 1, 8): [
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0F7 0I1 0W0 0I2 0W1 0I3 0W2 0I4 0W3 0I5 0W4 0I6 0W5 0I7 0W6 0W7",
        "1F0 1F1 1F2 1F3 1F4 1I0 1F5 1I1 1F6 1I2 1F7 1I3 1W0 1I4 1W1 1I5 1W2 1I6 1W3 1I7 1W4 1W5 1W6 1W7",
        "2F0 2F1 2F2 2I0 2F3 2I1 2F4 2I2 2F5 2I3 2F6 2I4 2F7 2I5 2W0 2I6 2W1 2I7 2W2 2W3 2W4 2W5 2W6 2W7",
        "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3F7 3I7 3W0 3W1 3W2 3W3 3W4 3W5 3W6 3W7",
    ],
    # ZB-V: stage s holds chunks s and 2pp-1-s; no & steps (that is DualPipeV)
    ("zb-v", 2, 2, 4): [
        "0F0 0F1 0F2 3F0 3I0 3F1 3I1 0I0 0F3 0I1 3W0 3F2 3I2 3F3 3I3 0W0 0I2 3W1 0W1 3W2 0I3 0W2 3W3 0W3",
        "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 1F2 2F2 1F3 2F3 2I2 2W0 1I2 1W0 2I3 2W1 1I3 1W1 2W2 1W2 2W3 1W3",
    ],
    ("dualpipev", 2, 2, 4): [
        "0F0 0F1 0F2 3F0 3I0 3F1 3I1 0I0 3W0 0F3 0W0 3W1 3F2&0I1 3I2 3F3 3I3 0W1 0I2 3W2 0W2 3W3 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 1I0 1F2&2I1 2W0 2F2&1I1 1W0 1F3 2F3 2I2 2W1 1I2 1W1 2I3 2W2 1I3 1W2 2W3 1W3",
    ],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_schedule_text_goldens(key):
    name, pp, vpp, m = key
    steps = schedule_steps(Strategy(pp=pp, vpp=vpp, schedule=name), m)
    assert [format_order(steps[s]) for s in range(pp)] == GOLDEN[key]
    for s in range(pp):  # the text parses back to the same steps
        assert parse_order(GOLDEN[key][s]) == steps[s]


@pytest.mark.parametrize("name,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1),
                                      ("zb-2p", 1), ("zb-v", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_schedule_is_complete_and_causal(name, pp, vpp):
    m = 2 * pp
    s = Strategy(pp=pp, vpp=vpp, schedule=name)
    steps = schedule_steps(s, m)
    chunks = pp * vpp
    seen: dict[Action, tuple[int, int]] = {}
    for st, ss in steps.items():
        for k, step in enumerate(ss):
            for a in step:
                assert s.chunk_rank_stage(a.chunk) == st
                assert a not in seen
                seen[a] = (st, k)
    split = S.get_schedule(name).split_backward
    types = "FIW" if split else "FB"
    assert len(seen) == chunks * m * len(types)
    for a, (st, k) in seen.items():
        if a.type in "BI":
            assert seen[Action(a.chunk, "F", a.mb)][1] < k or seen[Action(a.chunk, "F", a.mb)][0] != st
        if a.type == "W":
            assert seen[Action(a.chunk, "I", a.mb)][1] < k


@pytest.mark.parametrize("name", [n for n in S.schedule_names() if n not in ("gpipe", "1f1b")])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("mult", [1, 2])
@pytest.mark.parametrize("model", [GPT8, MOE8], ids=["gpt", "moe"])
def test_advanced_schedules_validate(name, pp, mult, model):
    vpp = S.get_schedule(name).vpp_choices((2,))[0]
    ep = 2 if model.is_moe else 1
    strat = Strategy(dp=2, pp=pp, vpp=vpp, ep=ep, schedule=name)
    prog = compile(model, strat, global_batch=2 * pp * mult, seq_len=16).validate()
    assert prog.meta["microbatches"] == pp * mult
    phases = {i.phase for p in prog.ranks.values() for i in p.instrs() if i.op == "compute"}
    if S.get_schedule(name).split_backward:
        assert {"bwd_input", "bwd_weight"} <= phases and "bwd" not in phases
    if S.get_schedule(name).vshape:
        # V shape: stage 0 holds the first and the last chunk (embedding and head)
        regions = {i.region for i in prog.ranks[0].instrs() if i.op == "compute" and i.region}
        assert any(r.startswith("embed") for r in regions) and any("head" in r for r in regions)
        if ep > 1 and name == "dualpipev":  # EP all-to-alls overlap on the comm stream
            assert all(i.stream == "comm" for p in prog.ranks.values() for i in p.instrs() if i.op == "all_to_all")


def test_dualpipev_needs_two_chunks_per_rank():
    with pytest.raises(StrategyError, match="exactly 2 chunks per stage; set vpp=2"):
        Strategy(pp=2, vpp=1, schedule="dualpipev")
    with pytest.raises(StrategyError, match="vpp=2"):
        Strategy(pp=2, vpp=4, schedule="dualpipev")


def test_custom_order_example():
    """A user-written schedule: stage 1 interleaves, stage 0 runs both forwards first."""
    custom = Order({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1"})
    prog = compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16, order=custom).validate()
    orders = stage_orders(prog)
    assert " ".join(map(str, orders[0])) == "0F0 0F1 0B0 0B1"
    assert " ".join(map(str, orders[1])) == "1F0 1B0 1F1 1B1"
    # an order given as a function of (strategy, m) works too
    prog2 = compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16,
                    order=lambda s, m: Order({st: [(Action(st, t, i),) for t in "FB" for i in range(m)]
                                              for st in range(s.pp)})).validate()
    assert " ".join(map(str, stage_orders(prog2)[1])) == "1F0 1F1 1B0 1B1"


def test_order_that_creates_a_cycle_is_rejected():
    bad = Order({0: "0F0 0B0 0F1 0B1", 1: "1B0 1F0 1F1 1B1"})
    with pytest.raises(ProgramError, match=r"cycle: .*1B0 \(stage 1\).*1F0"):
        compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16, order=bad)
    # cross-stage cycle: stage 0 waits for mb 0's gradient before it sends mb 1's activation, while
    # stage 1 wants both forwards before its first backward (each locally fine)
    bad2 = Order({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"})
    with pytest.raises(ProgramError, match=r"cycle: .*stage 0.*stage 1"):
        compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16, order=bad2)


def test_order_must_list_every_action_once():
    with pytest.raises(ProgramError, match="missing 0B1"):
        compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16,
                order=Order({0: "0F0 0F1 0B0", 1: "1F0 1F1 1B0 1B1"}))
    with pytest.raises(ProgramError, match="more than once"):
        compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16,
                order=Order({0: "0F0 0F1 0B0 0B1 0B1", 1: "1F0 1F1 1B0 1B1"}))
    with pytest.raises(ProgramError, match="missing -, not on this stage 0F2"):      # no such micro-batch
        compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16,
                order=Order({0: "0F0 0F1 0F2 0B0 0B1", 1: "1F0 1F1 1B0 1B1"}))
    with pytest.raises(ProgramError, match="stage 1 does not match its actions: missing 1B1, not on this stage 0B1"):
        compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=16,
                order=Order({0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 0B1"}))


def test_action_text_round_trip_and_errors():
    for t in ("0F0", "12B7", "3I10", "5W2"):
        assert str(Action.parse(t)) == t
    assert format_order(parse_order("0F3&5B1 1W0")) == "0F3&5B1 1W0"
    with pytest.raises(ProgramError, match="cannot parse action"):
        Action.parse("F0")
    with pytest.raises(ProgramError, match="not one of"):
        Action(0, "X", 0)


def test_dualpipev_overlapped_steps_interleave_regions():
    prog = compile(MOE8, "dp=2,pp=2,vpp=2,ep=2,schedule=dualpipev", global_batch=8, seq_len=16).validate()
    steps = schedule_steps(prog.strategy, 4)
    pair = next(step for step in steps[0] if len(step) == 2)
    keys = {(a.chunk, a.mb, "fwd" if a.type == "F" else "bwd_input") for a in pair}
    seq = [(i.chunk, i.microbatch) for i in prog.ranks[0].streams["compute"]
           if i.op == "compute" and (i.chunk, i.microbatch, i.phase) in keys]
    assert len(set(seq)) == 2
    switches = sum(1 for x, y in zip(seq, seq[1:]) if x != y)
    assert switches >= 4  # the two micro-batches alternate region by region, not one after the other
