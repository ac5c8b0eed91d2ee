"""Switch Programs: validated, simulated, and executed byte for byte by a numpy interpreter.

``execute`` runs a switch Program the way a runtime would, knowing only the Program: it
registers and frees buffers as instructions say, packs and unpacks by key using the decoded
``SwitchMeta`` pieces and the op table ``T.OPS``, matches sends with receives by tag and runs
collectives when every member arrived. Every element of every state is random bits of its kind's width, so a byte out of
place is caught; the destination devices must end with exactly their reference shards.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from parashift import Strategy, models, sim, vps
from parashift.errors import MemoryBudgetError, PlanError
from parashift.vps import transition as T
from test_vps_layout import reference_holdings
from test_vps_plan import switches

DT = {2: np.uint16, 4: np.uint32}


def _truth(model, kinds, seed=0):
    rng = np.random.default_rng(seed)
    return {(i, k): rng.integers(0, 2**(8 * model.kind_bytes(k)), size=t.shape, dtype=np.uint64)
            .astype(DT[model.kind_bytes(k)]) for k in kinds for i, t in enumerate(model.tensors)}


def _memory(model, s, devices, kinds, truth):
    mem: dict[int, dict] = {}
    for (rank, i, k), idx in reference_holdings(model, s).items():
        if k in kinds:
            mask = np.zeros(model.tensors[i].numel, dtype=bool)
            mask[idx] = True
            mem.setdefault(devices[rank], {})[(i, k)] = mask.reshape(model.tensors[i].shape)
    return mem


def execute(prog, model, src, dst, sdev, ddev):
    """Run a switch Program on numpy memories; check the destination bit for bit."""
    meta = T.SwitchMeta.of(prog)
    kinds, names = meta.kinds, meta.tensors
    Pt = meta.pieces
    P = {c: getattr(Pt, c) for c in ("tensor", "kind", "src", "dst", "lo", "hi", "nbytes", "stage", "transfer",
                                     "offset")}
    tags = {t: i for i, t in enumerate(meta.transfers)}
    truth = _truth(model, kinds)
    held = _memory(model, src, sdev, kinds, truth)
    want = _memory(model, dst, ddev, kinds, truth)
    old = {d: {key: np.where(m, truth[(key[0], key[1])], 0) for key, m in mm.items()} for d, mm in held.items()}
    new: dict[int, dict] = {d: {} for d in prog.ranks}
    written: dict[int, dict] = {d: {} for d in prog.ranks}
    live: dict[int, set] = {d: set() for d in prog.ranks}
    freed: dict[int, set] = {d: set() for d in prog.ranks}
    bufs: dict[tuple[int, str], np.ndarray] = {}
    mailbox: dict[str, np.ndarray] = {}
    in_place: set = set()
    assert len(tags) == len(meta.transfers), "transfer tags must be unique"

    def box(i):
        n = len(model.tensors[int(P["tensor"][i])].shape)
        return tuple(slice(a, b) for a, b in zip(P["lo"][i][:n], P["hi"][i][:n]))

    def read_old(d, i):
        t, k = int(P["tensor"][i]), kinds[int(P["kind"][i])]
        name = f"old:{k}:{names[t]}"
        assert name not in freed[d], f"device {d} reads {name} after freeing it"
        mask = held[d][(t, k)][box(i)]
        assert mask.all(), f"device {d} does not hold piece {i}"
        return old[d][(t, k)][box(i)]

    def write_new(d, i, vals):
        t, k = int(P["tensor"][i]), kinds[int(P["kind"][i])]
        name = f"new:{k}:{names[t]}"
        assert name in live[d], f"device {d} writes {name} before allocating it"
        arr = new[d].setdefault((t, k), np.zeros(model.tensors[t].shape, DT[model.kind_bytes(k)]))
        cnt = written[d].setdefault((t, k), np.zeros(model.tensors[t].shape, np.int64))
        arr[box(i)] = vals
        cnt[box(i)] += 1

    def local_offset(t_idx, d, i):
        info = xinfo[meta.transfers[t_idx]]
        return int(P["offset"][i]) - T.OPS[info["op"]].local_offset(d, info["root"], info["group"], info["chunk"])

    xinfo: dict[str, dict] = {}
    for d, rp in prog.ranks.items():
        for ins in rp.instrs():
            if ins.tag and ins.op in T.COLLECTIVE_OPS:
                chunk = ins.nbytes // len(ins.group) if T.OPS[ins.op].chunked else 0
                xinfo[ins.tag] = {"op": ins.op, "root": ins.root, "group": tuple(ins.group), "chunk": chunk}
            elif ins.tag:
                xinfo.setdefault(ins.tag, {"op": "send", "root": None, "group": (), "chunk": 0})

    def pack(d, key):
        tag = key.split(":", 1)[1]
        x = tags[tag]
        buf = bufs[(d, f"buf:{tag}")]
        for i in np.flatnonzero((P["transfer"] == x) & (P["src"] == d)):
            raw = np.ascontiguousarray(read_old(d, i)).view(np.uint8).ravel()
            off = local_offset(x, d, i)
            assert off % 16 == 0 and off + len(raw) <= len(buf)
            buf[off:off + len(raw)] = raw

    def unpack(d, key):
        tag = key.split(":", 1)[1]
        x = tags[tag]
        buf = bufs[(d, f"buf:{tag}")]
        for i in np.flatnonzero((P["transfer"] == x) & (P["dst"] == d)):
            k = kinds[int(P["kind"][i])]
            shape = tuple(s.stop - s.start for s in box(i))
            off = local_offset(x, d, i)
            n = int(P["nbytes"][i])
            write_new(d, i, buf[off:off + n].view(DT[model.kind_bytes(k)]).reshape(shape))

    def keep(d, stage):
        for i in np.flatnonzero((P["transfer"] == -1) & (P["dst"] == d) & (P["stage"] == stage)):
            assert P["src"][i] == d
            t, k = int(P["tensor"][i]), kinds[int(P["kind"][i])]
            if f"new:{k}:{names[t]}" not in live[d]:     # a buffer reused in place: nothing to copy
                assert f"old:{k}:{names[t]}" not in live[d] | freed[d]
                in_place.add((d, t, k))
                continue
            write_new(d, i, read_old(d, i))

    def start(d, ins):
        for name, nb in ins.alloc:
            assert name not in live[d], f"device {d} allocates {name} twice"
            live[d].add(name)
            if name.startswith("buf:"):
                bufs[(d, name)] = np.zeros(nb, np.uint8)

    def run(d, ins) -> bool:
        """Execute one point-to-point or copy instruction; False when a recv has no message yet."""
        if ins.op == "recv" and ins.tag not in mailbox:
            return False
        start(d, ins)
        if ins.op == "copy":
            if ins.key.startswith("keep:"):
                keep(d, int(ins.key.split(":")[1]))
            elif ins.key.startswith("pack:"):
                pack(d, ins.key)
            elif ins.key.startswith("unpack:"):
                unpack(d, ins.key)
        elif ins.op == "send":
            mailbox[ins.tag] = bufs[(d, ins.key)].copy()
        elif ins.op == "recv":
            data = mailbox.pop(ins.tag)
            assert len(data) == ins.nbytes
            bufs[(d, ins.key)][:] = data
        return True

    def finish(d, ins):
        for name in ins.free:
            assert name in live[d], f"device {d} frees {name}, which is not allocated"
            live[d].discard(name)
            freed[d].add(name)

    def run_collective(ins):
        """Every chunk (or the whole buffer) from its sender to its receivers, as the op table says."""
        o, root, group, key = T.OPS[ins.op], ins.root, tuple(ins.group), f"buf:{ins.tag}"
        chunk = xinfo[ins.tag]["chunk"]

        def part(m, owner):
            a = group.index(owner) * chunk - o.local_offset(m, root, group, chunk)
            return slice(a, a + chunk)
        if not o.chunked:
            for m in o.receivers(root, group):
                bufs[(m, key)][:] = bufs[(root, key)]
            return
        for owner in group:
            for src in o.senders(root, group):
                if owner in o.chunks_sent(src, root, group):
                    for m in group:
                        if owner in o.chunks_received(m, root, group):
                            bufs[(m, key)][part(m, owner)] = bufs[(src, key)][part(src, owner)]

    pos = {(d, s): 0 for d, rp in prog.ranks.items() for s in rp.streams}
    done: dict[int, set] = {d: set() for d in prog.ranks}
    arrived: dict[str, set] = {}
    ran: set = set()
    progress = True
    while progress:
        progress = False
        for (d, s), k in list(pos.items()):
            instrs = prog.ranks[d].streams[s]
            while k < len(instrs):
                ins = instrs[k]
                if not all(x in done[d] for x in ins.deps):
                    break
                if ins.is_collective:
                    members = arrived.setdefault(ins.tag, set())
                    if d not in members:
                        start(d, ins)
                        members.add(d)
                    if len(members) < len(ins.group):
                        break
                    if ins.tag not in ran:
                        run_collective(ins)
                        ran.add(ins.tag)
                elif not run(d, ins):
                    break
                finish(d, ins)
                done[d].add(ins.id)
                k += 1
                progress = True
            pos[(d, s)] = k
    stuck = [(d, s) for (d, s), k in pos.items() if k < len(prog.ranks[d].streams[s])]
    assert not stuck, f"execution stuck at {stuck[:4]}"
    assert not mailbox
    # every destination device holds exactly its reference shards
    for d, mm in want.items():
        for (t, k), mask in mm.items():
            name = f"new:{k}:{names[t]}"
            if (t, k) in new[d]:
                assert name in live[d]
                assert np.array_equal(written[d][(t, k)], mask.astype(np.int64)), (d, names[t], k)
                assert np.array_equal(new[d][(t, k)][mask], truth[(t, k)][mask]), (d, names[t], k)
            else:   # reused in place: the old buffer is exactly the new one, and its pieces are listed
                assert (d, t, k) in in_place
                assert (t, k) in held.get(d, {}) and np.array_equal(held[d][(t, k)], mask), (d, names[t], k)
                assert f"old:{k}:{names[t]}" not in freed[d]
    # nothing else left: staging buffers freed, old buffers freed unless reused
    for d in prog.ranks:
        assert not [b for b in live[d] if b.startswith(("buf:", "old:"))], (d, live[d])


def _state_totals(plan):
    buf = T.state_buffers(plan)
    n = int(buf.dev.max()) + 1
    return (np.bincount(buf.dev, weights=buf.old, minlength=n), np.bincount(buf.dev, weights=buf.new, minlength=n))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(switches(), st.data())
def test_random_switch_programs_validate_and_move_state_exactly(case, data):
    model, src, dst, sdev, ddev, clus, kinds = case
    if "master" in kinds and model.dtype == "fp32" and kinds != vps.DEFAULT_KINDS:
        kinds = tuple(k for k in kinds if k != "master")
    plan = vps.plan_switch(model, src, dst, cluster=clus, src_devices=sdev, dst_devices=ddev, kinds=kinds)
    opts = {k: data.draw(st.booleans(), label=k) for k in ("select_sources", "promote", "coalesce", "xor_order")}
    factor = data.draw(st.sampled_from([None, 1.0, 1.2, 2.0]), label="budget")
    budget = None
    if factor is not None:
        old, new = _state_totals(plan)
        budget = int(max(old.max(), new.max()) * factor) + 64
    try:
        prog = T.lower(plan, memory_budget=budget, **opts)
    except MemoryBudgetError as e:
        assert factor is not None and "at once" in str(e)
        assume(False)
    prog.validate()
    assert prog.meta["kind"] == "switch"
    if opts["xor_order"]:
        info = T.build_transfers(plan, np.zeros(len(plan), dtype=np.int64), plan.cluster,
                                 sim.CostModel.for_cluster(plan.cluster))
        assert T.round_matchings(info.items)
    execute(prog, model, src, dst, sdev, ddev)
    if budget is not None:
        res = sim.simulate_switch(prog, plan.cluster)
        assert res.peak_memory_max <= budget


def test_tiny_switches_execute_exactly_with_every_pass():
    for name, s, d, sd, dd in [("tiny-gpt", "dp=2,tp=2,pp=2,zero=1", "dp=4,pp=2,zero=2", None, None),
                               ("tiny-moe", "dp=4,ep=4,zero=1", "dp=2,tp=2,ep=2,zero=3", None, "4-7"),
                               ("tiny-gpt", "dp=1", "dp=4", None, "0-3")]:
        model = models.get(name)
        plan = vps.plan_switch(model, s, d, cluster="a100-2x4", src_devices=sd, dst_devices=dd)
        prog = T.lower(plan).validate()
        execute(prog, model, Strategy.parse(s), Strategy.parse(d), plan.src_devices, plan.dst_devices)


def test_budget_forces_stages_and_simulated_peak_stays_under_it():
    model = models.get("tiny-gpt")
    plan = vps.plan_switch(model, "pp=4", "dp=2,tp=2", cluster="a100-1x4")
    one = T.lower(plan)
    peak_one = sim.simulate_switch(one, "a100-1x4").peak_memory_max
    old, new = _state_totals(plan)
    budget = int(max(old.max(), new.max()) * 1.3)
    assert budget < peak_one, "the budget must bind for this test to mean anything"
    prog = T.lower(plan, memory_budget=budget).validate()
    assert prog.meta["stages"] > 1
    res = sim.simulate_switch(prog, "a100-1x4")
    assert res.peak_memory_max <= budget < peak_one
    execute(prog, model, Strategy.parse("pp=4"), Strategy.parse("dp=2,tp=2"), plan.src_devices, plan.dst_devices)


def test_new_layout_that_cannot_fit_fails_before_moving_and_says_by_how_much():
    plan = vps.plan_switch("llama2-7b", "dp=8,zero=1", "dp=2,tp=2,pp=2,zero=1", cluster="a800-1x8")
    old, new = _state_totals(plan)
    budget = int(new.max()) - 2**20
    with pytest.raises(MemoryBudgetError) as e:
        T.lower(plan, memory_budget=budget)
    msg = str(e.value)
    assert "the new layout needs" in msg and "1048576 bytes" in msg and "more than its budget" in msg
    with pytest.raises(MemoryBudgetError, match="must be positive"):
        T.lower(plan, memory_budget=0)


def test_coalescing_and_promotion_counts():
    model = models.get("tiny-gpt")
    plan = vps.plan_switch(model, "dp=2,tp=2,zero=1", "tp=2,pp=2,zero=2", cluster="a100-1x4")
    cost = sim.CostModel.for_cluster(plan.cluster)
    stage = np.zeros(len(plan), dtype=np.int64)
    co = T.build_transfers(plan, stage, plan.cluster, cost, promote=False)
    pairs = {(int(s), int(d)) for s, d in zip(plan.src[plan.moved], plan.dst[plan.moved])}
    assert co.count("send") == len(pairs)
    single = T.build_transfers(plan, stage, plan.cluster, cost, promote=False, coalesce=False)
    assert single.count("send") == int(plan.moved.sum())
    for x in (co, single):
        assert (x.piece_xfer[plan.moved] >= 0).all() and (x.piece_xfer[~plan.moved] == -1).all()
    # one holder, three new replicas: the same pieces go to every new device -> one broadcast
    grow = vps.plan_switch(model, "dp=1", "dp=4", cluster="a100-1x4")
    b = T.build_transfers(grow, np.zeros(len(grow), dtype=np.int64), grow.cluster, cost)
    assert b.count("broadcast") == 1 and b.count("send") == 0
    assert b.items[0].group == (0, 1, 2, 3) and b.items[0].root == 0
    nb = T.build_transfers(grow, np.zeros(len(grow), dtype=np.int64), grow.cluster, cost, promote=False)
    assert nb.count("broadcast") == 0 and nb.count("send") == 3


def test_promotion_follows_the_cost_model():
    # one device holds everything and hands distinct TP/PP shards to three others
    plan = vps.plan_switch("tiny-gpt", "dp=1", "tp=2,pp=2", cluster="a100-1x4")
    stage = np.zeros(len(plan), dtype=np.int64)
    base = sim.CostModel.for_cluster(plan.cluster)
    # no per-message cost: a scatter pads every chunk to the largest, so it never wins
    free_msgs = base.replace(latency={"local": 0.0, "intra": 0.0, "inter": 0.0}, comm_overhead=0.0)
    assert T.build_transfers(plan, stage, plan.cluster, free_msgs).count("scatter") == 0
    # a large cost per message: one scatter beats three messages
    dear_msgs = base.replace(comm_overhead=1.0)
    x = T.build_transfers(plan, stage, plan.cluster, dear_msgs)
    assert x.count("scatter") >= 1 and x.count("send") < T.build_transfers(plan, stage, plan.cluster,
                                                                            free_msgs).count("send")


def test_source_selection_prefers_node_then_balances_nics():
    model = models.gpt(2, 32, 4, vocab=64, seq_len=8, name="m", pad_vocab=8)
    # 4 replicas on nodes 0 and 1 (two each), 2 new devices on node 2: the two NICs share the load
    plan = vps.plan_switch(model, "dp=4", "dp=2", cluster="a100-3x2", src_devices="0-3", dst_devices="4-5")
    cost = sim.CostModel.for_cluster(plan.cluster)
    sel = T.select_sources(plan, plan.cluster, cost)
    node = sel.src[sel.moved] // 2
    sent = np.bincount(node, weights=sel.nbytes[sel.moved], minlength=2)
    assert sent[0] > 0 and sent[1] > 0 and max(sent) / min(sent) < 1.3
    assert T.link_loads(sel, cost)["inter_node"] <= T.link_loads(plan, cost)["inter_node"] * 1.001
    for i in np.flatnonzero(sel.moved):
        assert sel.src[i] in sel.holder_devices(i)
    # a holder on the destination's node always wins
    local = vps.plan_switch(model, "dp=2", "dp=2", cluster="a100-2x2", src_devices="0,2", dst_devices="1,3")
    sel = T.select_sources(local, local.cluster, cost)
    assert (sel.src[sel.moved] // 2 == sel.dst[sel.moved] // 2).all()


def test_half_duplex_devices_even_out_sends_plus_receives():
    """On CPU processes a device's sends and receives share its cores: the shrink tp=2,dp=2 ->
    dp=3 sends the leaving device's replica rather than loading a device that also receives."""
    import dataclasses
    from parashift import cluster as clusters
    model = models.gpt(2, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="hd", dtype="fp32", pad_vocab=8)
    cpu = clusters.get("cpu-local").with_devices(8)
    full = dataclasses.replace(cpu, gpu=dataclasses.replace(cpu.gpu, duplex=True))
    plan = vps.plan_switch(model, "tp=2,dp=2,zero=1", "dp=3,zero=1", cluster=cpu, src_devices="0-3",
                           dst_devices="0-2")

    def busiest(p) -> int:
        m = p.moved
        io = np.bincount(p.src[m], weights=p.nbytes[m], minlength=4) + np.bincount(p.dst[m], weights=p.nbytes[m],
                                                                                 minlength=4)
        return int(io.max())
    half = T.select_sources(plan, cpu, sim.CostModel.for_cluster(cpu))
    duplex = T.select_sources(plan, full, sim.CostModel.for_cluster(full))
    assert busiest(half) < 0.85 * busiest(duplex)
    half.verify()


def test_xor_rounds_are_perfect_matchings():
    assert [T.rounds(n) for n in (1, 2, 3, 4, 5, 128, 129)] == [0, 1, 3, 3, 7, 127, 255]
    items = tuple(T.Transfer("send", 0, i, j, (), 1, 0, f"{i}>{j}") for i in range(6) for j in range(6) if i != j)
    assert T.round_matchings(items)
    sends, recvs = T.p2p_order(items)
    assert [items[k].peer for k in sends[0]] == [1, 2, 3, 4, 5]          # 0 XOR s
    # 5 XOR s for s = 1, 4, 5, 6, 7; rounds 2 and 3 pair 5 with 7 and 6, which are absent
    assert [items[k].root for k in recvs[5]] == [4, 1, 0, 3, 2]
    bad = items + (T.Transfer("send", 0, 2, 2, (), 1, 0, "self"),)
    assert not T.round_matchings(bad)


def test_unknown_option_and_cluster_too_small():
    plan = vps.plan_switch("tiny-gpt", "dp=2", "dp=4")
    with pytest.raises(PlanError, match="unknown lowering option"):
        T.lower(plan, fast=True)
    from parashift.errors import ClusterError
    with pytest.raises(ClusterError):
        T.lower(plan, "a100-1x2")


def test_lowering_1024_device_llama():
    """(Its speed is measured by benchmarks/switch_bench.py, not here.)"""
    plan = vps.plan_switch("llama2-70b", "dp=32,tp=8,pp=4,zero=1", "dp=16,tp=8,pp=8,zero=1", cluster="a800-128x8")
    prog = T.lower(plan)
    assert prog.meta["lower_seconds"] > 0
    assert prog.world == 1024 and prog.meta["bytes_moved"] == plan.stats()["bytes_moved"]


def test_xor_rounds_of_a_small_switch_spread_over_lanes():
    """Each XOR round has one lane at both ends, and a 4-device switch's rounds use several lanes."""
    plan = vps.plan_switch("tiny-gpt", "dp=2,tp=2", "dp=4,zero=1", cluster="a100-1x4")
    df = T.lower(plan).to_frame()
    sends, recvs = df[df["op"] == "send"], df[df["op"] == "recv"]
    assert sends["stream"].nunique() >= 2
    lane = {tag: s[len("send"):] for tag, s in zip(sends["tag"], sends["stream"])}
    assert {tag: s[len("recv"):] for tag, s in zip(recvs["tag"], recvs["stream"])} == lane


def test_all_gather_is_promoted_when_messages_are_dear_and_moves_state_exactly():
    """tp=4 -> dp=4: every device sends its quarter to the three others; one all_gather over the
    four beats twelve messages, and the Program stays bit-exact."""
    model = models.gpt(2, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="ag", dtype="fp32", pad_vocab=8)
    plan = vps.plan_switch(model, "tp=4", "dp=4", cluster="a100-1x4")
    dear = sim.CostModel.for_cluster(plan.cluster).replace(comm_overhead=1.0)
    prog = T.lower(plan, cost_model=dear).validate()
    meta = T.SwitchMeta.of(prog)
    assert meta.collectives["all_gather"] >= 1
    (ag,) = {i.tag: i for rp in prog.ranks.values() for i in rp.instrs() if i.op == "all_gather"}.values()
    assert ag.group == (0, 1, 2, 3)
    execute(prog, model, Strategy.parse("tp=4"), Strategy.parse("dp=4"), plan.src_devices, plan.dst_devices)
    # without promotion: messages only, the same bytes moved
    plain = T.SwitchMeta.of(T.lower(plan, cost_model=dear, promote=False))
    assert plain.collectives["all_gather"] == 0 and plain.messages == 12 and plain.bytes_moved == meta.bytes_moved
    res = sim.simulate_switch(prog, "a100-1x4", dear)
    assert res.switch_time > 0


def test_collectives_are_taken_where_the_simulator_finds_them_faster():
    """On H100s a member of an all_gather packs its chunk before it and unpacks the others' after it,
    where twelve messages overlap their copies: ``dp=4,zero=1 -> dp=4`` simulated 1.36x slower
    promoted, and is now point to point; the scatter of a 1 -> 4 grow stays promoted and faster
    (``benchmarks/promotion_bench.py`` runs 156 switches of two models)."""
    model = models.gpt(2, 768, 12, ffn=3072, vocab=8192, seq_len=256, name="w768", dtype="fp32", pad_vocab=64)

    def both(src, dst, sd, dd):
        p, q = (T.plan_live_switch(model, src, dst, sd, dd, cluster="h100-1x8", **kw) for kw in ({}, {"promote": False}))
        t = [sim.simulate(x.program, x.meta.cluster).step_time for x in (p, q)]
        return {k: v for k, v in p.meta.collectives.items() if v}, t[0] / t[1]
    assert both("dp=4,zero=1", "dp=4", (0, 1, 2, 3), (0, 1, 2, 3)) == ({}, 1.0)
    used, ratio = both("dp=1", "dp=4,zero=1", (0,), (0, 1, 2, 3))
    assert used and ratio < 0.99


def test_op_table_agrees_with_itself():
    """Every chunk a member sends is received by someone, bytes per member match what it holds."""
    g = (1, 4, 6, 9)
    for name, o in T.OPS.items():
        if name == "send":
            assert o.senders(2, (), 5) == (2,) and o.receivers(2, (), 5) == (5,)
            continue
        root = g[1]
        sent = {m: set(o.chunks_sent(m, root, g)) for m in g}
        got = {m: set(o.chunks_received(m, root, g)) for m in g}
        if o.chunked:
            assert set().union(*sent.values()) == set().union(*got.values())
            for m in g:
                assert o.member_bytes(m, root, 40, 10) == (40 if o.holds_whole(m, root) else 10)
                assert o.local_offset(m, root, g, 10) in (0, g.index(m) * 10)
        assert set(o.senders(root, g)) <= set(g) and set(o.receivers(root, g)) <= set(g)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 6), st.integers(0, 40), st.data())
def test_switch_meta_codec_round_trips_through_json(n, dims_extra, data):
    import json
    dims = 1 + dims_extra % 4
    ints = st.integers(-1, 2**40)
    col = lambda k: np.asarray(data.draw(st.lists(ints, min_size=n * k, max_size=n * k)), dtype=np.int64)  # noqa: E731
    pieces = T.PieceTable(*(col(1) for _ in range(4)), col(dims).reshape(-1, dims), col(dims).reshape(-1, dims),
                          *(col(1) for _ in range(4)))
    names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
    meta = T.SwitchMeta(model=data.draw(names), src="dp=2", dst="tp=2", src_devices="0-1", dst_devices="0,2",
                        kinds=tuple(data.draw(st.lists(names, max_size=3))),
                        tensors=tuple(data.draw(st.lists(names, max_size=3))), stages=data.draw(st.integers(1, 9)),
                        align=16, dims=dims, transfers=tuple(data.draw(st.lists(names, max_size=4))), pieces=pieces,
                        bytes_moved=data.draw(ints), bytes_kept=data.draw(ints), messages=data.draw(st.integers(0, 9)),
                        collectives={o: data.draw(st.integers(0, 9)) for o in T.COLLECTIVE_OPS},
                        staged=data.draw(st.booleans()), options={"lanes": 4}, memory_budget=None)
    back = T.SwitchMeta.decode(json.loads(json.dumps(meta.encode())))
    assert back.encode() == meta.encode()
    for c in ("tensor", "lo", "hi", "offset"):
        np.testing.assert_array_equal(getattr(back.pieces, c), getattr(meta.pieces, c))
        assert getattr(back.pieces, c).shape == getattr(meta.pieces, c).shape


@given(st.sampled_from(sorted(T.meta.NAMES)), st.data())
def test_switch_names_parse_back(what, data):
    name = st.text(st.characters(blacklist_categories=("Cs", "Z", "Cc")), min_size=1, max_size=8)
    if what == "keep":
        parts = [str(data.draw(st.integers(0, 99)))]
    elif what in ("old", "new"):
        parts = [data.draw(name.filter(lambda x: ":" not in x)), data.draw(name)]
    else:   # pack/unpack/buf name a transfer by its tag
        members = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=4, unique=True))
        op = data.draw(st.sampled_from(sorted(T.OPS)))
        parts = [T.switch_name(op, data.draw(st.integers(0, 9)), data.draw(st.integers(0, 63)),
                               members[:1] if op == "send" else members)]
    assert T.parse_switch_name(T.switch_name(what, *parts)) == (what, tuple(parts))


@given(st.sampled_from(sorted(T.OPS)), st.integers(0, 9), st.integers(0, 63),
       st.lists(st.integers(0, 63), min_size=1, max_size=5, unique=True))
def test_transfer_tags_follow_the_one_grammar(op, stage, root, members):
    from parashift.ir.tags import TransferTag
    members = members[:1] if op == "send" else members
    tag = T.switch_name(op, stage, root, members)
    assert TransferTag.parse(tag) == TransferTag(op, stage, root, tuple(members))


def test_lowered_meta_lists_every_destination_piece():
    plan = vps.plan_switch("tiny-gpt", "dp=2,tp=2", "dp=4,zero=1", cluster="a100-1x4")
    meta = T.SwitchMeta.of(T.lower(plan))
    assert len(meta.pieces) == len(plan)
    assert int(meta.pieces.nbytes[meta.pieces.transfer == -1].sum()) == meta.bytes_kept
    assert (meta.pieces.src[meta.pieces.transfer == -1] == meta.pieces.dst[meta.pieces.transfer == -1]).all()
    with pytest.raises(Exception, match="not a switch Program"):
        T.SwitchMeta.decode({"kind": "train"})


def test_simulated_switch_reports_what_its_meta_says():
    plan = vps.plan_switch("tiny-gpt", "dp=2,tp=2", "dp=4,zero=1", cluster="a100-1x4")
    res = sim.simulate_switch(T.lower(plan), "a100-1x4")
    assert res.bytes_moved == plan.stats()["bytes_moved"] and res.bytes_kept + res.bytes_moved == int(plan.nbytes.sum())
    assert res.summary()["stages"] == 1
