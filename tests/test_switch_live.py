"""Live hot switches on gloo processes: bit-exact states, unchanged losses, and faults.

Each job runs a chain of switches (one training step between them, so moments are non-zero)
and exports every process's flat state buffers before and after each switch. The expected
state after a switch is what a job started directly in the new layout from the same full state
would hold (:func:`store_from_full`); the comparison is on raw bytes, ZeRO padding included.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from parashift import models
from parashift.errors import StrategyError
from parashift.cli.run_live import parse_switch_at
from parashift.exec.switch import full_from_arrays, generations, run_live, store_arrays, store_from_full
from parashift.strategy import Strategy
from parashift.vps.transition import SwitchMeta, plan_live_switch
from switch_faults import Corrupt, Kill

# kv_heads=4 so that tp=4 is legal; fp32 so the loss comparison is tight
GPT = models.gpt(4, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="sw-gpt", dtype="fp32", pad_vocab=8)


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def assert_rolled_back(res, static) -> None:
    """Every process of ``res`` ended in the first layout with the final state, byte for byte, of
    the job ``static`` that never switched."""
    for r, s in zip(sorted(res.reports.values(), key=lambda r: r["device"]),
                    sorted(static.reports.values(), key=lambda r: r["device"])):
        assert r["final_gen"] == 0
        a, b = r["exports"]["final"]["arrays"], s["exports"]["final"]["arrays"]
        assert all(_bytes(a[f][k]) == _bytes(b[f][k]) for f in b for k in b[f])


def check_switches(spec, result) -> int:
    """Every committed switch left exactly the state a fresh job in the new layout would hold."""
    gens = result.generations
    checked = 0
    for g in range(1, len(gens)):
        before = {r["exports"][f"before{g}"]["rank"]: r["exports"][f"before{g}"]["arrays"]
                  for r in result.reports.values() if r and f"before{g}" in r.get("exports", {})}
        after = {r["exports"][f"after{g}"]["rank"]: r["exports"][f"after{g}"]["arrays"]
                 for r in result.reports.values() if r and f"after{g}" in r.get("exports", {})}
        assert sorted(before) == list(range(gens[g - 1].strategy.world)), (g, sorted(before))
        assert sorted(after) == list(range(gens[g].strategy.world)), (g, sorted(after))
        full = full_from_arrays(spec, gens[g - 1].strategy, before)
        for (name, kind), arr in full.items():
            assert not np.isnan(arr).any(), f"{name} {kind}: the old layout does not cover every element"
        for rank, arrays in after.items():
            want = store_arrays(store_from_full(spec, gens[g].strategy, rank, full))
            assert arrays.keys() == want.keys()
            for fam in want:
                assert arrays[fam].keys() == want[fam].keys()
                for kind in want[fam]:
                    assert _bytes(arrays[fam][kind]) == _bytes(want[fam][kind]), \
                        f"switch {g} ({gens[g - 1].strategy} -> {gens[g].strategy}) rank {rank} {fam} {kind}"
        checked += 1
    return checked


def test_dense_chain_reshapes_shrinks_and_grows_bit_exactly():
    chain = [(1, "tp=4", None),                          # tp and zero change, same devices
             (2, "dp=2,pp=2", None),                     # pp and dp
             (3, "dp=2,zero=3", (0, 2)),                 # shrink 4 -> 2 (devices 1 and 3 leave)
             (4, "dp=2,tp=2,pp=2,zero=2", None),         # grow 2 -> 8: everything at once
             (5, "pp=2,tp=2,zero=1", (5, 1, 2, 7))]      # shrink 8 -> 4 onto a permuted device set
    res = run_live(GPT, "dp=2,tp=2,zero=1", steps=7, switches=chain, export=True, timeout=240,
                   switch_timeout=30, big_piece=4096)     # small enough that the tiny model has big pieces
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(GPT, res) == len(chain)
    assert len(res.losses) == 7 and all(np.isfinite(res.losses))
    # every switch recorded its phases; planning and world creation ran in the background
    for s in res.switches:
        assert s["pause_seconds"] < s["seconds"]
        assert s["transfer_seconds"] > 0 and s["world_seconds"] > 0
    # large contiguous pieces were sent from / received into the state buffers without packing
    assert sum(sw["zero_copy"] for r in res.reports.values() if r for sw in r["switches"]) > 0
    tl = res.timeline()
    steps, worlds = tl[tl.op == "step"], tl[tl.op == "world"]
    overlap = [(w.device, w.step) for w in worlds.itertuples() for s in steps[steps.device == w.device].itertuples()
               if s.start < w.end and w.start < s.end]
    assert overlap, "world creation never overlapped a training step"
    # leaving processes exited, joiners trained: the last generation's devices finished the job
    finals = {r["device"] for r in res.reports.values() if r and r["final_gen"] == len(chain)}
    assert finals == {5, 1, 2, 7}


def test_moe_chain_changes_ep_bit_exactly():
    chain = [(1, "dp=2,tp=2,ep=2,zero=3", None), (2, "dp=2,ep=2", (2, 3)), (3, "dp=4,ep=2,zero=2,tp=2", None)]
    res = run_live("tiny-moe", "dp=4,ep=4,zero=1", steps=4, switches=chain, export=True, timeout=240,
                   switch_timeout=30)
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(models.get("tiny-moe"), res) == len(chain)


def test_grow_from_one_device_and_shrink_to_one_through_promoted_collectives():
    chain = [(1, "dp=4,zero=1", None), (2, "tp=4", None), (3, "dp=1", (2,))]
    # priced as an H100 job (its switches' collectives), run by gloo processes: the GPU job's CPU twin (since a
    # send costs its link's latency and bytes, not a fitted 1.6 ms, the A100 preset sends these pieces point to point)
    planned = [plan_live_switch(GPT, Strategy.parse(a), Strategy.parse(b), da, db, cluster="h100-1x8")
               for a, da, b, db in [("dp=1", (0,), "dp=4,zero=1", (0, 1, 2, 3)), ("tp=4", (0, 1, 2, 3), "dp=1", (2,))]]
    assert planned[0].program.meta["collectives"]["scatter"] >= 1
    assert planned[1].program.meta["collectives"]["gather"] >= 1
    res = run_live(GPT, "dp=1", steps=5, switches=chain, export=True, timeout=240, switch_timeout=30,
                   big_piece=4096, cluster="h100-1x8")
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(GPT, res) == len(chain)
    assert [s["cluster"] for s in res.switches] == ["h100-1x8"] * len(chain)       # priced as asked
    for r in res.reports.values():
        for sw in (r or {}).get("switches", []):
            # the memory high-water mark: both layouts' states whole, plus the staging in use at once
            assert sw["peak_bytes"] == sw["old_bytes"] + sw["new_bytes"] + sw["staging_peak_bytes"]
            assert sw["old_bytes"] > 0 or sw["joining"]
            assert {"keep", "pack", "unpack", "checksum", "idle"} <= set(sw["phases"])
            ops = {row[1]: row for row in sw["rows"]}
            assert {"plan", "world", "transfer", "verify", "rebuild"} <= set(ops)
            if sw["device"] in res.generations[[g.step for g in res.generations].index(sw["step"])].devices:
                # the next layout's training world is built in the background, before the pause's transfer
                assert "train-world" in ops and ops["train-world"][3] <= ops["transfer"][2]
    # communicators are cached by member set: the 4-process world of switch 2 is reused by switch 3
    assert max(r["groups_reused"] for r in res.reports.values() if r) >= 1


def test_tp_to_replicas_through_an_all_gather_is_bit_exact():
    """tp=4 -> dp=4: each device sends its quarter to the three others; the planner promotes the
    twelve messages to one all_gather (the op table's newest entry; gloo jobs take it only when
    asked, ``promote=True``, as GPU jobs do by default), which gloo runs bit-exactly."""
    planned = plan_live_switch(GPT, "tp=4", "dp=4", (0, 1, 2, 3), (0, 1, 2, 3), promote=True)
    assert SwitchMeta.of(planned.program).collectives["all_gather"] == 1
    assert sum(plan_live_switch(GPT, "tp=4", "dp=4", (0, 1, 2, 3), (0, 1, 2, 3)).meta.collectives.values()) == 0
    res = run_live(GPT, "tp=4", steps=3, switches=[(1, "dp=4", None)], export=True, timeout=120, switch_timeout=30,
                   promote=True)
    assert [s.get("aborted") for s in res.switches] == [None]
    assert check_switches(GPT, res) == 1
    # every device sent its own chunk once and received the full buffer
    sent = [sw["bytes_sent"] for r in res.reports.values() if r for sw in r["switches"]]
    assert len(sent) == 4 and len(set(sent)) == 1 and sent[0] > 0
    # a corrupted chunk is caught by its owner's checksum and the job rolls back
    bad = run_live(GPT, "tp=4", steps=3, switches=[(1, "dp=4", None)], timeout=120, switch_timeout=30,
                   faults=Corrupt(device=2, switch=1, op="all_gather"), promote=True)
    (sw,) = bad.switches
    assert "checksum" in sw["aborted"] and "rolled back" in sw["aborted"], sw["aborted"]
    assert len(bad.losses) == 3


def test_keep_placement_reorders_devices_moves_less_and_trains_alike():
    chain = [(1, "tp=4", None), (2, "tp=2,dp=2,zero=1", None)]
    given = run_live(GPT, "tp=2,dp=2,zero=1", steps=3, switches=chain, timeout=240, placement="given")
    kept = run_live(GPT, "tp=2,dp=2,zero=1", steps=3, switches=chain, export=True, timeout=240)
    assert [g.devices for g in given.generations] == [(0, 1, 2, 3)] * 3
    # each device takes the TP quarter inside the half it holds, then the half holding its quarter
    assert [g.devices for g in kept.generations] == [(0, 1, 2, 3), (0, 2, 1, 3), (0, 1, 2, 3)]
    assert check_switches(GPT, kept) == 2
    moved = [[s["bytes_moved"] for s in r.switches] for r in (given, kept)]
    assert moved[1][0] * 1.9 < moved[0][0] and moved[1][1] * 1.4 < moved[0][1], moved   # 1/2 and 2/3
    np.testing.assert_array_equal(kept.losses, given.losses)


def test_switching_every_5_steps_keeps_the_loss_curve(tmp_path):
    chain = [(5, "tp=2,pp=2", None), (10, "dp=2,zero=3", (1, 3)), (15, "dp=4,zero=1", None),
             (20, "dp=2,tp=2,zero=2", None), (25, "pp=2,dp=2", (3, 2, 1, 0))]
    live = run_live(GPT, "dp=2,tp=2,zero=1", steps=30, switches=chain, timeout=300, switch_timeout=30)
    static = run_live(GPT, "dp=2,tp=2,zero=1", steps=30, timeout=300)
    assert len(live.losses) == len(static.losses) == 30
    np.testing.assert_allclose(live.losses, static.losses, rtol=1e-5, atol=0)
    assert live.losses[-1] < live.losses[0]
    tl = live.timeline()
    assert {"plan", "world", "transfer", "verify", "rebuild", "step"} <= set(tl["op"])
    live.to_chrome_trace(str(tmp_path / "live.json"))
    events = json.loads((tmp_path / "live.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"world", "transfer", "step"}


@pytest.mark.slow
def test_overlap_param_switches_with_whole_parameters():
    """An overlap_param step leaves its parameter gathers to the next step: a switch finishes them
    first, so the job trains as one that never switched (and never overlapped)."""
    chain = [(2, "dp=4,zero=2,overlap_param", None), (4, "tp=2,pp=2", None)]
    live = run_live(GPT, "dp=2,tp=2,zero=1,overlap_param", steps=6, switches=chain, export=True, timeout=240,
                    switch_timeout=30)
    static = run_live(GPT, "dp=2,tp=2,zero=1", steps=6, timeout=240)
    assert [s.get("aborted") for s in live.switches] == [None] * len(chain)
    assert check_switches(GPT, live) == len(chain)
    np.testing.assert_allclose(live.losses, static.losses, rtol=1e-5, atol=0)


def test_corrupted_buffer_rolls_back_and_training_continues_unchanged():
    static = run_live(GPT, "dp=2,tp=2", steps=4, export=True, timeout=120)
    res = run_live(GPT, "dp=2,tp=2", steps=4, switches=[(2, "dp=4,zero=1", None)], export=True, timeout=120,
                   switch_timeout=20, faults=Corrupt(device=1, switch=1))
    (sw,) = res.switches
    assert "checksum" in sw["aborted"] and "rolled back" in sw["aborted"]
    assert res.losses == static.losses               # same layout throughout: bit-identical
    assert_rolled_back(res, static)


def test_broadcast_goes_message_by_message_from_the_state_and_a_corrupted_part_rolls_back():
    # the benchmark's shrink: the leaving device broadcasts its TP half to two of the three new ranks
    src, dst, chain = "dp=2,tp=2,zero=1", "dp=3,zero=1", [(1, "dp=3,zero=1", (0, 1, 2))]
    planned = plan_live_switch(GPT, Strategy.parse(src), Strategy.parse(dst), (0, 1, 2, 3), (0, 1, 2), promote=True)
    (bcast,) = [i for v in planned.program.ranks[3].streams.values() for i in v if i.op == "broadcast"]
    kw = dict(steps=3, export=True, timeout=120, global_batch=12, promote=True)
    ok = run_live(GPT, src, switches=chain, switch_timeout=20, big_piece=4096, **kw)
    assert check_switches(GPT, ok) == 1
    (root,) = [sw for r in ok.reports.values() if r for sw in r["switches"] if sw["device"] == 3]
    # its large pieces went out straight from the state: only the small ones were staged
    assert root["staging_peak_bytes"] < bcast.nbytes // 4 and root["zero_copy"] > 0
    static = run_live(GPT, src, **kw)
    bad = run_live(GPT, src, switches=chain, switch_timeout=20, big_piece=4096,
                   faults=Corrupt(device=2, switch=1, op="broadcast"), **kw)
    (sw,) = bad.switches
    assert "checksum" in sw["aborted"] and bcast.tag in sw["aborted"], sw["aborted"]
    assert bad.losses == static.losses
    assert_rolled_back(bad, static)


def test_a_shard_sent_to_both_replicas_of_its_new_cell_is_packed_and_summed_once():
    # ZeRO-1 shards -> dp=2,tp=2: a device sends the part of its moment shard in the other tp half to both
    # replicas of that half, straight from its state; the sender sums those parts once, both receivers check them
    src, dst = "dp=4,zero=1", "dp=2,tp=2"
    planned = plan_live_switch(GPT, Strategy.parse(src), Strategy.parse(dst), (0, 1, 2, 3), (0, 1, 2, 3))
    P = SwitchMeta.of(planned.program).pieces
    sent = P.transfer >= 0
    boxes = np.column_stack([P.src, P.tensor, P.kind, P.lo, P.hi])[sent]
    assert len(np.unique(boxes, axis=0)) < len(boxes)          # some piece goes to two peers
    ok = run_live(GPT, src, steps=2, switches=[(1, dst, None)], export=True, timeout=120, switch_timeout=20,
                  big_piece=1024)
    assert check_switches(GPT, ok) == 1
    recs = [sw for r in ok.reports.values() if r for sw in r["switches"]]
    assert sum(sw["sums_reused"] for sw in recs) > 0 and not any(sw.get("aborted") for sw in recs)
    assert sum(sw["packs_shared"] for sw in recs) > 0          # strided pieces for both replicas are packed once


def test_killed_leaving_rank_ends_in_a_clean_error_with_survivors_intact():
    static = run_live(GPT, "dp=4,zero=1", steps=2, export=True, timeout=120)
    res = run_live(GPT, "dp=4,zero=1", steps=4, switches=[(2, "dp=2", (0, 1))], timeout=120, switch_timeout=6,
                   faults=Kill(device=3, switch=1))
    assert res.reports["3.0"] is None                              # it died mid-switch
    survivors = [r for k, r in res.reports.items() if k != "3.0"]
    assert len(survivors) == 3
    want = {r["exports"]["final"]["rank"]: r["exports"]["final"]["arrays"] for r in static.reports.values()}
    for r in survivors:
        assert r["error"] and "aborted" in r["error"]
        rank, arrays = r["intact"]["rank"], r["intact"]["arrays"]
        assert all(_bytes(arrays[f][k]) == _bytes(want[rank][f][k]) for f in want[rank] for k in want[rank][f])
    assert len(res.losses) == 2


def test_schedule_parsing_and_errors():
    assert parse_switch_at("10:tp=2,dp=2")[0] == 10
    step, s, devs = parse_switch_at("3:dp=3:0,2,5")
    assert (step, s.dp, devs) == (3, 3, (0, 2, 5))
    with pytest.raises(StrategyError, match="STEP:STRATEGY"):
        parse_switch_at("tp=2")
    with pytest.raises(StrategyError, match="3 ranks but 2 devices"):
        parse_switch_at("3:dp=3:0,1")
    gens = generations(GPT, "dp=4", 10, [(3, "dp=2", None), (6, "dp=4,zero=1", None)])
    assert [g.devices for g in gens] == [(0, 1, 2, 3), (0, 1), (0, 1, 2, 3)]
    with pytest.raises(StrategyError, match="outside the run"):
        generations(GPT, "dp=4", 5, [(5, "dp=2", None)])
    with pytest.raises(StrategyError, match="distinct device ids"):
        generations(GPT, "dp=2", 5, [(2, "dp=2", (1, 1))])
    with pytest.raises(StrategyError, match="unknown placement 'best'"):
        generations(GPT, "dp=2", 5, [(2, "dp=2", None)], placement="best")
    # kept placement: the device holding TP half 1 takes the quarters inside it (given order otherwise)
    assert generations(GPT, "tp=2,dp=2,zero=1", 5, [(2, "tp=4", None)])[1].devices == (0, 2, 1, 3)
    assert generations(GPT, "tp=2,dp=2,zero=1", 5, [(2, "tp=4", None)], "given")[1].devices == (0, 1, 2, 3)
    assert Strategy.parse("dp=2").world == 2


@pytest.mark.slow
@pytest.mark.parametrize("model,start,chain", [
    ("tiny-gpt", "dp=8", [(1, "tp=2,dp=2,pp=2,zero=3", None), (2, "dp=4,pp=2,zero=2", None),
                          (3, "pp=2,vpp=2,dp=2", (7, 6, 5, 4)), (4, "tp=2,dp=4,zero=1", None),
                          (5, "tp=2,pp=4", None), (6, "dp=2,pp=2,vpp=2,zero=1", (0, 2, 4, 6))]),
    ("tiny-moe", "dp=8,ep=8,zero=1", [(1, "dp=4,ep=4,pp=2", None), (2, "dp=2,ep=2,tp=2,pp=2,zero=3", None),
                                      (3, "tp=2,ep=4,dp=4,zero=2", (7, 6, 5, 4, 3, 2, 1, 0)),
                                      (4, "dp=2,ep=2", (1, 6))]),
])
def test_eight_process_matrix_bit_exact(model, start, chain):
    spec = models.get(model)
    res = run_live(spec, start, steps=len(chain) + 2, switches=chain, export=True, timeout=600, switch_timeout=60)
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(spec, res) == len(chain)
