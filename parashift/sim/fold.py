"""Symmetry folding: ranks that provably behave the same are simulated once.

Ranks start in one class per shared :class:`RankProgram` object and device-topology signature
(the node layout of every group they use, the link class to every peer). Classes are then
refined until equitable: two ranks stay together only if their peers and group members fall in
the same classes. In an equitable partition every member of a class sees the same event times,
so the class's lowest rank (its representative) stands for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..ir.program import Instr, Program
from ..cost import link_class, topology

__all__ = ["Folding", "fold"]

@dataclass(frozen=True)
class Folding:
    """``rep_of[rank]`` is the representative simulated for ``rank``; ``members[rep]`` its class."""

    rep_of: Mapping[int, int]
    members: Mapping[int, tuple[int, ...]]
    groups: Mapping[tuple[int, object], tuple[int, ...]]   # (rank, group name) -> concrete members
    peers: Mapping[tuple[int, object], int]                # (rank, peer name) -> concrete peer

    @property
    def reps(self) -> list[int]:
        return sorted(self.members)


def scan(prog) -> tuple[tuple, tuple, set]:
    """A RankProgram's group names and peer names (sorted) and the ids its instructions depend on,
    in one pass over its instructions."""
    groups: set = set()
    peers: set = set()
    needed: set = set()
    for instrs in prog.streams.values():
        for ins in instrs:
            x = ins.group
            if x is not None:
                groups.add(x)
            x = ins.peer
            if x is not None:
                peers.add(x)
            x = ins.deps
            if x:
                needed.update(x)
    key = lambda x: (isinstance(x, tuple), str(x))  # noqa: E731
    return tuple(sorted(groups, key=key)), tuple(sorted(peers, key=key)), needed


def fold(program: Program, devices: Mapping[int, int], cluster, enabled: bool = True,
         scans: "dict[int, tuple[tuple, tuple, set]] | None" = None) -> Folding:
    """Partition ``program``'s ranks into equitable classes (one class per rank when disabled).
    ``scans``: id of a RankProgram -> its :func:`scan`, filled for those not in it yet."""
    ranks = sorted(program.ranks)
    refs_by_prog: dict[int, tuple[tuple, tuple, set]] = {} if scans is None else scans
    ranks_of: dict[int, list[int]] = {}
    groups: dict[tuple[int, object], tuple[int, ...]] = {}
    peers: dict[tuple[int, object], int] = {}
    for r in ranks:
        p = program.ranks[r]
        if id(p) not in refs_by_prog:
            refs_by_prog[id(p)] = scan(p)
        ranks_of.setdefault(id(p), []).append(r)
        gnames = refs_by_prog[id(p)][0]
        for g in gnames:
            if (r, g) not in groups:
                members = program.resolve_group(r, Instr(0, "all_reduce", group=g))
                if isinstance(g, tuple):
                    groups[(r, g)] = members
                else:  # an axis partitions the ranks: every member has the same group
                    for m in members:
                        groups[(m, g)] = members
    st = program.strategy
    for pid, rs in ranks_of.items():
        for q in refs_by_prog[pid][1]:
            if st is not None and isinstance(q, str) and q.startswith(("pp", "cp")):
                # symbolic: every rank of the class at once (as Program.resolve_peer does one by one)
                peers.update(zip(((r, q) for r in rs), (int(x) for x in st.peer(np.asarray(rs), q))))
            else:
                for r in rs:
                    peers[(r, q)] = program.resolve_peer(r, Instr(0, "send", peer=q))
    if not enabled or len(set(devices.values())) != len(devices):
        return Folding({r: r for r in ranks}, {r: (r,) for r in ranks}, groups, peers)

    # initial colour: program object and device topology of everything the rank talks to
    keys = []
    topo_cache: dict[tuple[int, ...], tuple] = {}
    for r in ranks:
        gnames, pnames, _ = refs_by_prog[id(program.ranks[r])]
        sig = [id(program.ranks[r])]
        for g in gnames:
            members = groups[(r, g)]
            if members not in topo_cache:
                topo_cache[members] = topology(cluster, [devices[m] for m in members])
            sig.append(topo_cache[members])
        for q in pnames:
            sig.append(link_class(cluster, devices[r], devices[peers[(r, q)]]))
        keys.append(tuple(sig))
    color = _relabel(keys)
    index = {r: i for i, r in enumerate(ranks)}
    while True:
        keys = []
        for i, r in enumerate(ranks):
            gnames, pnames, _ = refs_by_prog[id(program.ranks[r])]
            k = [color[i]]
            for g in gnames:
                k.append(tuple(sorted(color[index[m]] for m in groups[(r, g)])))
            for q in pnames:
                k.append(color[index[peers[(r, q)]]])
            keys.append(tuple(k))
        new = _relabel(keys)
        if new.max() == color.max():
            break
        color = new
    rep_of: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for i, r in enumerate(ranks):
        c = int(color[i])
        rep = first.setdefault(c, r)
        rep_of[r] = rep
        members.setdefault(rep, []).append(r)
    return Folding(rep_of, {k: tuple(v) for k, v in members.items()}, groups, peers)


def _relabel(keys: list) -> np.ndarray:
    ids: dict = {}
    return np.array([ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64)
