"""Program.validate(): ids, deps, matching, collectives, deadlock detection."""
from __future__ import annotations

from dataclasses import replace

import pytest

from parashift import Strategy
from parashift.errors import DeadlockError, ProgramError
from parashift.ir import Instr, Program, RankProgram, compile


def P(ranks, strategy=None):
    return Program(ranks, strategy)


def rp(**streams):
    return RankProgram({k: tuple(v) for k, v in streams.items()})


def send(i, peer, tag, n=4, deps=()):
    return Instr(i, "send", stream="p2p", peer=peer, tag=tag, nbytes=n, deps=deps)


def recv(i, peer, tag, n=4, deps=()):
    return Instr(i, "recv", stream="p2p", peer=peer, tag=tag, nbytes=n, deps=deps)


def fwd(i, deps=()):
    return Instr(i, "compute", phase="fwd", deps=deps)


def test_two_stages_waiting_on_each_others_recv_deadlock():
    s = Strategy(pp=2)
    a = rp(compute=[fwd(0, deps=(1,))], p2p=[recv(1, "pp+1", "g"), send(2, "pp+1", "a", deps=(0,))])
    b = rp(compute=[fwd(0, deps=(1,))], p2p=[recv(1, "pp-1", "a"), send(2, "pp-1", "g", deps=(0,))])
    with pytest.raises(DeadlockError) as e:
        P({0: a, 1: b}, s).validate()
    msg = str(e.value)
    assert "ranks [0, 1]" in msg
    assert "rank 0 [1 recv" in msg and "tag=g" in msg and "rank 1 [1 recv" in msg and "tag=a" in msg


def test_compiled_program_made_inconsistent_is_rejected():
    prog = compile("tiny-gpt", "dp=2,pp=2", global_batch=8, seq_len=16).validate()
    st0 = prog.ranks[0]
    p2p = list(st0.streams["p2p"])
    first_recv = next(k for k, i in enumerate(p2p) if i.op == "recv")
    # stage 0 now waits for micro-batch 0's gradient before sending any activation
    p2p.insert(0, p2p.pop(first_recv))
    bad0 = RankProgram({**st0.streams, "p2p": tuple(p2p)}, st0.static_memory)
    ranks = {r: (bad0 if p is st0 else p) for r, p in prog.ranks.items()}
    with pytest.raises(DeadlockError) as e:
        Program(ranks, prog.strategy, prog.meta).validate()
    msg = str(e.value)
    assert "recv" in msg and "grad.c0.m0" in msg and "act.c0.m0" in msg
    assert "rank 0" in msg and "rank 2" in msg   # stage 0 and stage 1 of the same DP replica


def test_unmatched_and_mismatched_p2p():
    s = Strategy(pp=2)
    ok = {0: rp(p2p=[send(0, "pp+1", "x")]), 1: rp(p2p=[recv(0, "pp-1", "x")])}
    P(ok, s).validate()
    with pytest.raises(ProgramError, match="no matching recv with tag 'x'"):
        P({0: rp(p2p=[send(0, "pp+1", "x")]), 1: rp(p2p=[recv(0, "pp-1", "y")])}, s).validate()
    with pytest.raises(ProgramError, match="sizes must be equal"):
        P({0: rp(p2p=[send(0, "pp+1", "x", 4)]), 1: rp(p2p=[recv(0, "pp-1", "x", 8)])}, s).validate()
    with pytest.raises(ProgramError, match="2 matching"):
        P({0: rp(p2p=[send(0, 1, "x")]), 1: rp(p2p=[recv(0, 0, "x"), recv(1, 0, "x")])}).validate()
    with pytest.raises(ProgramError, match="no matching send"):  # a recv nobody sends
        P({0: rp(p2p=[recv(0, 1, "x")]), 1: rp(compute=[fwd(0)])}).validate()


def test_structural_errors():
    with pytest.raises(ProgramError, match="appears twice"):
        P({0: rp(compute=[fwd(0), fwd(0)])}).validate()
    with pytest.raises(ProgramError, match="does not exist"):
        P({0: rp(compute=[fwd(0, deps=(7,))])}).validate()
    with pytest.raises(ProgramError, match="cycle"):
        P({0: rp(compute=[fwd(0, deps=(1,))], comm=[Instr(1, "all_reduce", stream="comm", group=(0,), tag="t",
                                                            deps=(0,))])}).validate()
    with pytest.raises(ProgramError, match="names stream"):
        P({0: rp(comm=[fwd(0)])}).validate()
    with pytest.raises(ProgramError, match="phase"):
        P({0: rp(compute=[Instr(0, "compute", phase="sideways")])}).validate()
    with pytest.raises(ProgramError, match="no tag"):
        P({0: rp(comm=[Instr(0, "all_reduce", stream="comm", group=(0,))])}).validate()


def test_collective_consistency():
    def ar(i, group, tag="t", n=8):
        return Instr(i, "all_reduce", stream="comm", group=group, tag=tag, nbytes=n)
    P({0: rp(comm=[ar(0, (0, 1))]), 1: rp(comm=[ar(0, (0, 1))])}).validate()
    with pytest.raises(ProgramError, match="issues 0 all_reduce"):
        P({0: rp(comm=[ar(0, (0, 1))]), 1: rp(comm=[ar(0, (0, 1), tag="u")])}).validate()
    with pytest.raises(ProgramError, match="different bytes"):
        P({0: rp(comm=[ar(0, (0, 1))]), 1: rp(comm=[ar(0, (0, 1), n=16)])}).validate()
    with pytest.raises(ProgramError, match="same group"):
        P({0: rp(comm=[ar(0, (0, 1))]), 1: rp(comm=[ar(0, (0, 1, 2))]), 2: rp(comm=[ar(0, (0, 1, 2))])}).validate()
    with pytest.raises(ProgramError, match="not a member"):
        P({0: rp(comm=[ar(0, (1,))]), 1: rp(comm=[ar(0, (1,))])}).validate()
    # two collectives issued in opposite orders by two members deadlock
    a = rp(comm=[ar(0, (0, 1), "t1"), ar(1, (0, 1), "t2")])
    b = rp(comm=[ar(0, (0, 1), "t2"), ar(1, (0, 1), "t1")])
    with pytest.raises(DeadlockError, match="ranks \\[0, 1\\]"):
        P({0: a, 1: b}).validate()


def test_shared_program_with_concrete_xor_rounds():
    """All ranks share one program; int peers differ per rank, so classes are refined to single ranks."""
    n = 8
    progs = {}
    for r in range(n):
        ins, k = [], 0
        for s in range(1, n):
            q = r ^ s
            first, second = (send, recv) if r < q else (recv, send)
            ins += [first(k, q, f"r{s}"), second(k + 1, q, f"r{s}")]
            k += 2
        progs[r] = rp(p2p=ins)
    P(progs).validate()
    # tags are per (sender, receiver): a rank sending its round-1 message to the wrong peer is caught
    bad = dict(progs)
    bad[0] = rp(p2p=[replace(i, peer=2) if i.tag == "r1" else i for i in progs[0].streams["p2p"]])
    with pytest.raises(ProgramError, match="matching"):
        P(bad).validate()


def test_symbolic_groups_without_strategy_are_an_error():
    with pytest.raises(ProgramError, match="no strategy"):
        P({0: rp(comm=[Instr(0, "all_reduce", stream="comm", group="dp", tag="t")])}).validate()


def test_large_shared_program_validates():
    prog = compile("llama2-7b", "dp=8,tp=4,pp=4,zero=1", global_batch=64, seq_len=256).validate()
    assert prog.world == 128 and len(prog.classes()) == 4
