"""The event-driven list scheduler (zb-h1, dualpipev) against a brute-force reference that looks at
every stage at every event time; and the search's bounds replay the order the compiler plans."""
from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from parashift import Strategy, models, search
from parashift.ir import Action
from parashift.ir import schedules as S
from parashift.ir.compile import planning_costs
from parashift.search import bounds


def _reference(pp, m, chunk_stage, limit, wlimit, overlap, cost):
    """Every stage checked at every event time; candidates sorted in full (slow and obvious)."""
    chunks = len(chunk_stage)
    eps = 1e-9 * max(cost.f + cost.i + cost.w)
    done, nxt = {}, {(c, t): 0 for c in range(chunks) for t in "FIW"}
    busy, inflight, pending_w = [0.0] * pp, [0] * pp, [0] * pp
    out = {s: [] for s in range(pp)}
    mine = {s: [c for c in range(chunks) if chunk_stage[c] == s] for s in range(pp)}
    events, remaining = [0.0], 3 * chunks * m

    def ok(d, a, t):
        lat = cost.p2p if chunk_stage[d.chunk] != chunk_stage[a.chunk] else 0.0
        return d in done and done[d] + lat <= t + eps

    def ready(a, t):
        if a.type == "F":
            return a.chunk == 0 or ok(Action(a.chunk - 1, "F", a.mb), a, t)
        if a.type == "I":
            return ok(Action(a.chunk, "F", a.mb), a, t) and (
                a.chunk == chunks - 1 or ok(Action(a.chunk + 1, "I", a.mb), a, t))
        return ok(Action(a.chunk, "I", a.mb), a, t)

    def eta(s, t, typ):
        """Earliest time the stage's next action of ``typ`` could start, from scheduled dependencies."""
        best = float("inf")
        for c in mine[s]:
            i = nxt[(c, typ)]
            if i >= m:
                continue
            if typ == "I":
                deps = [Action(c, "F", i)] + ([Action(c + 1, "I", i)] if c < chunks - 1 else [])
            elif c > 0 and (inflight[s] < limit(s) or c > min(mine[s])):
                deps = [Action(c - 1, "F", i)]
            else:
                continue
            if all(d in done for d in deps):
                a = Action(c, typ, i)
                best = min(best, max(done[d] + (cost.p2p if chunk_stage[d.chunk] != chunk_stage[a.chunk] else 0.0)
                                     for d in deps))
        return best

    while remaining:
        t = heapq.heappop(events)
        while events and events[0] <= t + eps:
            heapq.heappop(events)
        for s in range(pp):
            if busy[s] > t + eps:
                continue
            cand = {typ: [Action(c, typ, nxt[(c, typ)]) for c in mine[s]
                          if nxt[(c, typ)] < m and ready(Action(c, typ, nxt[(c, typ)]), t)] for typ in "FIW"}
            fs = sorted((a for a in cand["F"] if inflight[s] < limit(s) or a.chunk > min(mine[s])),
                        key=lambda a: (-a.chunk, a.mb))
            is_ = sorted(cand["I"], key=lambda a: (a.mb, -a.chunk))
            ws = sorted(cand["W"], key=lambda a: (a.mb, -a.chunk))
            if ws and pending_w[s] > wlimit(s):
                step = (ws[0],)
            elif overlap and fs and is_ and fs[0].chunk != is_[0].chunk:
                step = (fs[0], is_[0])
            elif is_:
                step = (is_[0],)
            elif fs and eta(s, t, "I") >= t + cost.of(fs[0]) / 2:
                step = (fs[0],)
            elif not fs and ws and min(eta(s, t, "I"), eta(s, t, "F")) >= t + cost.of(ws[0]) / 2:
                step = (ws[0],)
            else:
                continue
            end = t + sum(cost.of(a) for a in step)
            busy[s] = end
            heapq.heappush(events, end)
            heapq.heappush(events, end + cost.p2p)
            for a in step:
                done[a] = end
                nxt[(a.chunk, a.type)] += 1
                inflight[s] += {"F": 1, "I": -1, "W": 0}[a.type]
                pending_w[s] += {"F": 0, "I": 1, "W": -1}[a.type]
                remaining -= 1
            out[s].append(step)
    return out


_dur = st.sampled_from([0.5, 1.0, 1.0, 1.5, 2.0, 3.0, 0.25, 1.25])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 10), st.booleans(), st.data())
def test_event_driven_scheduler_matches_the_reference(pp, m, v_shape, data):
    chunks = 2 * pp if v_shape else pp
    cost = S.ScheduleCosts(tuple(data.draw(st.lists(_dur, min_size=chunks, max_size=chunks))),
                           tuple(data.draw(st.lists(_dur, min_size=chunks, max_size=chunks))),
                           tuple(data.draw(st.lists(_dur, min_size=chunks, max_size=chunks))),
                           data.draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 0.3])))
    if v_shape:
        stages = [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)]
        want = _reference(pp, m, stages, lambda s: 2 * pp, lambda s: pp, True, cost)
        assert S.dualpipev(pp, m, cost) == want
    else:
        want = _reference(pp, m, list(range(pp)), lambda s: pp - s, lambda s: pp - 1, False, cost)
        assert S.zb_h1(pp, m, cost) == want


def test_bounds_replay_the_compiled_cost_planned_order():
    """Under TP the planned zb-h1 order differs from the unit-cost one; the bounds replay the
    planned one, and stay under the simulation."""
    model, seq, gb = models.get("tiny-gpt"), 32, 16
    s = Strategy.parse("dp=1,tp=2,pp=4,schedule=zb-h1")
    m = s.num_microbatches(gb)
    planned = S.schedule_steps(s, m, planning_costs(model, s, seq))
    assert planned != S.schedule_steps(s, m)
    assert bounds._steps(model, s, m, seq)[1] == planned
    ev = search.SimEvaluator(model, "a800-1x8", global_batch=gb, seq_len=seq, precheck=False)
    out = ev(s)
    assert 0 < bounds.step_time_lower_bound(model, s, global_batch=gb, seq_len=seq, cost_model=ev.costs()) \
        <= out.step_time
    assert 0 < bounds.peak_memory_lower_bound(model, s, global_batch=gb, seq_len=seq) <= out.peak_memory
