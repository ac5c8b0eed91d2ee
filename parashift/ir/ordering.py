"""Ordering directives: :class:`Order` (each stage's order of actions), :class:`Stream` (move nodes
to another logical stream) and :class:`Fuse` (merge a chunk's regions where no communication sits
between them). Like every directive, each is a pure rewrite ``apply(graph) -> graph``.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from typing import ClassVar, Mapping, Sequence

import numpy as np

from ..errors import ProgramError
from .actions import AFTER, END, OPTIM, POST, Action, Step, action_ids, as_steps, format_order
from .graph import DATA, ORDER, SAVED, Graph, distinct, equals as _equals, take as _take

__all__ = ["Order", "Stream", "Fuse"]


def _clone(g: Graph, src: Graph, i: int, **over) -> int:
    attrs = {k: v[i] for k, v in src.cols.items()}
    attrs.update(over)
    return g.add(**attrs)


@dataclass(frozen=True)
class Stream:
    """Move nodes whose op is in ``ops`` and whose tag starts with ``tag_prefix`` to ``stream``."""

    stream: str
    ops: tuple[str, ...] = ()
    tag_prefix: str = ""
    stampable: ClassVar[bool] = True     # see :mod:`parashift.ir.stamp`

    def apply(self, g: Graph) -> Graph:
        out = g.owned()
        c = out.cols
        for i in range(len(out)):
            if (not self.ops or c["op"][i] in self.ops) and (c["tag"][i] or "").startswith(self.tag_prefix):
                if self.tag_prefix or self.ops:
                    c["stream"][i] = self.stream
        return out


#: ZeRO-2/3 gradient buckets one rank holds at once: the compute node that allocates a bucket waits
#: for the reduce-scatter of the bucket its stage allocated this many before (reduce-scatters overlap
#: the backward, and however slowly they run the buckets stay bounded).
GRAD_BUCKETS_IN_FLIGHT = 2


def _bound_grad_buckets(g: Graph, in_order: np.ndarray) -> None:
    """Per stage, in the order its compute runs: the node allocating gradient buckets (``zg`` /
    ``zge``) waits for the communication freeing the buckets ``GRAD_BUCKETS_IN_FLIGHT`` allocations before."""
    c = g.cols
    n = len(g)
    freer: dict[str, int] = {}
    allocs: dict[int, list[tuple[tuple, int, list[str]]]] = {}
    alloc, free, op = c["alloc"], c["free"], c["op"]
    for i in compress(range(n), free):
        if op[i] != "compute":
            for name in free[i]:
                if name.startswith(("zg.", "zge.")):
                    freer[name] = i
    if not freer:           # no bucket is ever freed: nothing to wait for
        return
    comp = _equals(op, "compute")
    held = np.zeros(n, bool)
    held[list(compress(range(n), alloc))] = True
    for i in np.flatnonzero(comp & in_order & held).tolist():
        names = [a for a, _ in alloc[i] if a.startswith(("zg.", "zge."))]
        if names:
            allocs.setdefault(c["stage"][i], []).append((c["slot"][i], i, names))
    for lst in allocs.values():
        lst.sort(key=lambda e: (e[0], e[1]))
        for k in range(GRAD_BUCKETS_IN_FLIGHT, len(lst)):
            for name in lst[k - GRAD_BUCKETS_IN_FLIGHT][2]:
                if name in freer:
                    g.edge(freer[name], lst[k][1], ORDER)


def _small_ints(col: list) -> np.ndarray:
    """A column of small non-negative integers (such as edge kinds) as an array."""
    try:
        return np.frombuffer(bytes(col), np.uint8)
    except (ValueError, TypeError):
        return np.asarray(col, np.int64)


def _group_ends(keys: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct integer key, ascending: the key, its first row, and its rows of least and of
    greatest value (ties: the first such row). One sort of the keys (a lexsort is several times slower)."""
    n = len(keys)
    if keys.min() < 0 or int(keys.max()) >= (1 << 62) // n:
        o = np.argsort(keys, kind="stable")
    else:
        o = np.sort(keys * n + np.arange(n)) % n        # rows by key, then row
    k, v = keys[o], vals[o]
    lead = np.concatenate([[True], k[1:] != k[:-1]])
    starts = np.flatnonzero(lead)
    grp = np.cumsum(lead) - 1
    ends = []
    for best in (np.minimum.reduceat(v, starts), np.maximum.reduceat(v, starts)):
        at = np.flatnonzero(v == best[grp])             # rows attaining their key's extreme, in order
        ends.append(o[at[np.concatenate([[True], grp[at][1:] != grp[at][:-1]])]])
    return k[starts], o[starts], ends[0], ends[1]


@dataclass(frozen=True)
class Order:
    """Fix each listed stage's order of actions: ``orders[stage]`` is a text order
    (``"0F0 0F1 0B0 ..."``) or a list of steps. Every action of the stage must appear exactly once;
    an order that contradicts a data dependency (a cycle) is rejected naming the actions."""

    orders: Mapping[int, "str | Sequence[Step | Action]"]

    def __post_init__(self) -> None:
        if not isinstance(self.orders, Mapping) or not all(str(k).strip().isdigit() for k in self.orders):
            raise ProgramError(f"Order({self.orders!r}): give a dict of stage -> order, e.g. "
                               f"Order({{0: '0F0 0B0', 1: '1F0 1B0'}})")

    def steps(self) -> dict[int, list[Step]]:
        return {int(st): as_steps(o) for st, o in self.orders.items()}

    def __str__(self) -> str:
        return "\n".join(f"stage {st}: {format_order(s)}" for st, s in sorted(self.steps().items()))

    def apply(self, g: Graph) -> Graph:
        out = g.owned()
        c = out.cols
        n = len(out)
        steps = self.steps()
        acts_col, stage_col = c["action"], c["stage"]
        aid, alist = action_ids(acts_col)
        amap = {a: k for k, a in enumerate(alist)}
        stage = np.asarray(stage_col, np.int64)
        has = aid >= 0
        na = max(len(alist), 1)
        pairs = distinct(stage[has] * na + aid[has])      # (stage, action) of every node, keyed stage * na + id
        # each listed stage's actions (ids, -1: no node has it) and their steps' positions
        ids = [amap.get(a, -1) for ss in steps.values() for step in ss for a in step]
        ks = [k for ss in steps.values() for k, step in enumerate(ss) for _ in step]
        sts = [st for st, ss in steps.items() for step in ss for _ in step]
        listed = np.asarray(sts, np.int64) * na + np.asarray(ids, np.int64)
        held = pairs[np.isin(pairs // na, np.fromiter(steps, np.int64, len(steps)))]
        if len(listed) != len(held) or (min(ids, default=0) < 0) or (np.sort(listed) != held).any():
            self._mismatch(steps, pairs, na, alist)     # raises, naming the stage and its actions
        kpos = np.full(len(alist) + 1, -1, np.int64)     # step position of each action (-1: none)
        if len(set(ids)) == len(ids):
            kpos[ids] = ks
        else:                   # an action on two stages: the later stage's position, as listed
            for i, k in zip(ids, ks):
                kpos[i] = k
        if not self._acyclic(out, steps, aid, len(alist), ids, ks):
            self._check_acyclic(out, steps)      # names the cycle
        pos_col = c["pos"]
        spread = _spread(steps, acts_col, pos_col)
        in_order = np.isin(stage, np.fromiter(steps, np.int64, len(steps)))
        kk = kpos[aid]
        placed = in_order & has
        act_nodes = np.flatnonzero(placed)
        slot = c["slot"]
        if 2 * len(act_nodes) > n:        # most nodes: one column of (step, pos), the rest as they were
            old, slot = slot, list(zip(kk.tolist(), pos_col))
            c["slot"] = slot
            for i in np.flatnonzero(~placed).tolist():
                slot[i] = old[i]
            posv = np.asarray(pos_col, np.float64)[act_nodes]     # the position in slot of each of act_nodes
        else:
            ai = act_nodes.tolist()
            ps = _take(pos_col, ai) if ai else []
            for i, v in zip(ai, zip(kk[act_nodes].tolist(), ps)):
                slot[i] = v
            posv = np.asarray(ps, np.float64)
        for i, p in spread.items():
            if in_order[i]:
                slot[i] = (int(kk[i]), p)
                posv[np.searchsorted(act_nodes, i)] = p
        _slot_anchored(out, slot, in_order & ~has, alist, kpos)
        _chain_steps(out, act_nodes, posv, kk, stage, placed)
        _bound_grad_buckets(out, in_order)
        return out

    @staticmethod
    def _mismatch(steps: dict[int, list[Step]], pairs: np.ndarray, na: int, alist: list) -> None:
        """Raise for the first stage whose order does not list each of its actions once."""
        have: dict[int, set] = {}
        for st, j in zip((pairs // na).tolist(), (pairs % na).tolist()):
            have.setdefault(st, set()).add(alist[j])
        for st, ss in steps.items():
            listed = [a for step in ss for a in step]
            dup = {str(a) for a in listed if listed.count(a) > 1} if len(set(listed)) != len(listed) else set()
            if dup:
                raise ProgramError(f"Order for stage {st} lists {', '.join(sorted(dup))} more than once")
            missing = have.get(st, set()) - set(listed)
            extra = set(listed) - have.get(st, set())
            if missing or extra:
                raise ProgramError(
                    f"Order for stage {st} does not match its actions: missing "
                    f"{' '.join(map(str, sorted(missing))) or '-'}, not on this stage "
                    f"{' '.join(map(str, sorted(extra))) or '-'}; list every action of the stage once")
        raise AssertionError("an Order listing found wrong is right")

    @staticmethod
    def _acyclic(g: Graph, steps: dict[int, list[Step]], aid: np.ndarray, na: int, ids: list[int],
                 ks: list[int]) -> bool:
        """Whether the graph of the ``na`` actions (data edges between actions plus each stage's order:
        ``ids``, the listed actions stage by stage, at step positions ``ks``) is acyclic (Kahn's algorithm;
        :meth:`_check_acyclic` finds and names a cycle)."""
        su, du = aid[np.asarray(g.src, np.int64)], aid[np.asarray(g.dst, np.int64)]
        m = (su >= 0) & (du >= 0) & (su != du) & (_small_ints(g.ekind) != ORDER)
        su, du = su[m], du[m]
        # every action of a step before every action of the next step of its stage
        a, k = np.asarray(ids, np.int64), np.asarray(ks, np.int64)
        nxt = np.flatnonzero(k[1:] == k[:-1] + 1)       # consecutive listed actions one step apart
        if all(len(step) == 1 for ss in steps.values() for step in ss):
            eu, ev = a[nxt], a[nxt + 1]
        else:
            pu, pv = [], []
            at = 0
            for ss in steps.values():
                for prev, step in zip(ss, ss[1:]):
                    pu += [a[at + x] for x in range(len(prev)) for _ in step]
                    pv += [a[at + len(prev) + y] for _ in prev for y in range(len(step))]
                    at += len(prev)
                at += len(ss[-1]) if ss else 0
            eu, ev = np.asarray(pu, np.int64), np.asarray(pv, np.int64)
        su, du = np.concatenate([su, eu]), np.concatenate([du, ev])
        key = distinct(su * na + du)
        su, du = key // max(na, 1), key % max(na, 1)
        indeg = np.bincount(du, minlength=na).tolist()
        start = np.searchsorted(su, np.arange(na + 1)).tolist()
        succ = du.tolist()
        stack = [v for v in range(na) if indeg[v] == 0]
        done = 0
        while stack:
            u = stack.pop()
            done += 1
            for v in succ[start[u]:start[u + 1]]:
                indeg[v] -= 1
                if not indeg[v]:
                    stack.append(v)
        return done == na

    @staticmethod
    def _check_acyclic(g: Graph, steps: dict[int, list[Step]]) -> None:
        """Cycle check on the action graph (data edges between actions plus each stage's order)."""
        c = g.cols
        acts: dict[Action, int] = {}
        aid = np.full(len(g), -1, np.int64)
        for i, a in enumerate(c["action"]):
            if isinstance(a, Action):
                aid[i] = acts.setdefault(a, len(acts))
        s, d = g.edges((DATA, SAVED))
        su, du = aid[s], aid[d]
        m = (su >= 0) & (du >= 0) & (su != du)
        pairs = set(zip(su[m].tolist(), du[m].tolist()))
        for ss in steps.values():
            for prev, nxt in zip(ss, ss[1:]):
                for a in prev:
                    for b in nxt:
                        if a in acts and b in acts:
                            pairs.add((acts[a], acts[b]))
        adj: dict[int, list[int]] = {}
        for u, v in pairs:
            adj.setdefault(u, []).append(v)
        names = {v: k for k, v in acts.items()}
        stage_of = {}
        for i, a in enumerate(c["action"]):
            if isinstance(a, Action):
                stage_of[a] = c["stage"][i]
        color = dict.fromkeys(range(len(acts)), 0)
        for root in range(len(acts)):
            if color[root]:
                continue
            stack = [(root, iter(adj.get(root, ())))]
            path = [root]
            color[root] = 1
            while stack:
                u, it = stack[-1]
                v = next(it, None)
                if v is None:
                    color[u] = 2
                    stack.pop()
                    path.pop()
                elif color[v] == 0:
                    color[v] = 1
                    stack.append((v, iter(adj.get(v, ()))))
                    path.append(v)
                elif color[v] == 1:
                    cyc = path[path.index(v):] + [v]
                    txt = " -> ".join(f"{names[x]} (stage {stage_of[names[x]]})" for x in cyc)
                    raise ProgramError(f"this Order creates a cycle: {txt}; move the later action after "
                                       f"the one it depends on")


@dataclass(frozen=True)
class Fuse:
    """Merge, per action and phase, the compute nodes of actions with no communication on the
    compute stream into one node (region ``"embed+layers.0-3"``, ``"layers.4-7+head"``); see
    :func:`_fused_alloc` for a fused recompute's memory."""

    def apply(self, g: Graph) -> Graph:
        c = g.cols
        n = len(g)
        blocked = {c["action"][i] for i in range(n) if c["op"][i] != "compute" and c["stream"][i] == "compute"}
        groups: dict[tuple, list[int]] = {}
        for i in range(n):
            a = c["action"][i]
            if c["op"][i] == "compute" and isinstance(a, Action) and a not in blocked:
                groups.setdefault((a, c["phase"][i]), []).append(i)
        out = Graph()
        new = np.full(n, -1, np.int64)
        for i in range(n):
            key = (c["action"][i], c["phase"][i])
            members = groups.get(key) if c["op"][i] == "compute" else None
            if members and len(members) > 1:
                if members[0] != i:
                    continue
                new[members] = len(out)
                _clone(out, g, i, region=_fused_name(c, members), kind="fused",
                       flops=float(sum(c["flops"][j] for j in members)),
                       nbytes=int(sum(c["nbytes"][j] for j in members)),
                       act=int(sum(c["act"][j] for j in members)),
                       params=int(sum(c["params"][j] for j in members)),
                       pos=float(min(c["pos"][j] for j in members)),
                       alloc=_fused_alloc(c, members),
                       free=tuple(x for j in members for x in c["free"][j]),
                       layer=min(c["layer"][j] for j in members))
            else:
                new[i] = len(out)
                _clone(out, g, i)
        seen = set()
        for u, v, k in zip(new[np.asarray(g.src, np.int64)].tolist() if g.src else [],
                           new[np.asarray(g.dst, np.int64)].tolist() if g.dst else [], g.ekind):
            if u != v and (u, v, k) not in seen:
                seen.add((u, v, k))
                out.edge(u, v, k)
        return out


def _fused_alloc(c: dict, members: list[int]) -> tuple:
    """Buffers a fused node allocates. A fused recompute charges only its largest region's buffer:
    the backward it feeds runs layer by layer and frees each layer's recomputed tensors before the
    next layer's are needed (Megatron recomputes one layer at a time); the other names stay, empty,
    so the backward's frees still match."""
    allocs = [x for j in members for x in c["alloc"][j]]
    if c["phase"][members[0]] != "recompute" or not allocs:
        return tuple(allocs)
    big = max(range(len(allocs)), key=lambda k: allocs[k][1])
    return tuple((name, nb if k == big else 0) for k, (name, nb) in enumerate(allocs))


def _fused_name(c: dict, members: list[int]) -> str:
    kinds = {c["kind"][j] for j in members}
    layers = sorted({c["layer"][j] for j in members if c["kind"][j] not in ("embed", "head")})
    parts = []
    if "embed" in kinds:
        parts.append("embed")
    if layers:
        parts.append(f"layers.{layers[0]}-{layers[-1]}")
    if "head" in kinds:
        parts.append("head")
    return "+".join(parts)


def _spread(steps: dict, acts_col: list, pos_col: list) -> dict[int, float]:
    """Overlapped steps (several actions in one step): per node of such an action, its rank among the
    action's placed nodes scaled to [0, 1), so the actions' regions interleave."""
    overlapped = {a for ss in steps.values() for step in ss if len(step) > 1 for a in step}
    spread: dict[int, float] = {}
    if overlapped:
        members: dict[Action, list[int]] = {}
        for i in range(len(acts_col)):
            if acts_col[i] in overlapped and pos_col[i] >= 0:
                members.setdefault(acts_col[i], []).append(i)
        for nodes in members.values():
            nodes.sort(key=lambda i: pos_col[i])
            for r, i in enumerate(nodes):
                spread[i] = r / len(nodes)
    return spread


def _slot_anchored(out: Graph, slot: list, anchored: np.ndarray, alist: list, kpos: np.ndarray) -> None:
    """Slot the nodes of a listed stage that belong to no action by their anchor: after a chunk's last
    backward, at the step's end, at the optimizer step or after it."""
    acts_col = out.cols["action"]
    big = 1 << 40
    last_bwd: dict[int, int] = {}     # chunk -> the position of its last listed backward action
    for i in np.flatnonzero(anchored).tolist():
        a = acts_col[i]
        if a is None:
            raise ProgramError(f"node {out.node(i)} belongs to no action; place the graph first")
        elif a[0] == AFTER:  # behind the gather for the next step, so it overlaps that step
            if not last_bwd:
                for b, k in zip(alist, kpos.tolist()):
                    if k >= 0 and b.type != "F":
                        last_bwd[b.chunk] = max(last_bwd.get(b.chunk, -1), k)
            slot[i] = (last_bwd[a[1]] + 1, -0.5)
        elif a[0] == END:
            slot[i] = (big, float(a[1]))
        elif a[0] == OPTIM:
            slot[i] = (big + 1, 0.0)
        elif a[0] == POST:
            slot[i] = (big + 2, float(a[1]))


def _chain_steps(out: Graph, act_nodes: np.ndarray, posv: np.ndarray, kk: np.ndarray, stage: np.ndarray,
                 placed: np.ndarray) -> None:
    """Order edges between steps: each (stage, step)'s first compute node waits for the step before's last;
    a step's last "tp" reduction ends before the next step's first compute; ZeRO-3 gathers prefetch one
    step ahead."""
    c = out.cols
    # per (stage, step), keyed stage * width + step: its compute-stream node first and last in position
    # (ties: lowest index); each step's first waits for the step before's last, in the order the
    # (stage, step)s first show such a node
    on = _equals(c["stream"], "compute")[act_nodes]
    comp = act_nodes[on]
    keys, firsts, width = np.zeros(0, np.int64), np.zeros(0, np.int64), 1
    if len(comp):
        pv = posv[on]
        width = int(kk[comp].max()) + 2
        gk = stage[comp] * width + kk[comp]
        keys, seen, lo, hi = _group_ends(gk, pv)
        firsts, lasts = comp[lo], comp[hi]
        keyed = np.argsort(seen, kind="stable")
        prev = np.minimum(np.searchsorted(keys, keys - 1), len(keys) - 1)
        js = keyed[(keys[prev] == keys - 1)[keyed]]
        out.add_edges(lasts[prev[js]].tolist(), firsts[js].tolist(), ORDER)
        # tp_async: a step's last reduction on stream "tp" ends before the next step's first compute
        # (Megatron's backward waits for its asynchronous all-reduce before it returns)
        on = _equals(c["stream"], "tp")[act_nodes] if "tp" in c["stream"] else np.zeros(len(act_nodes), bool)
        tpn = act_nodes[on]
        if len(tpn):
            tv = posv[on]
            tk = stage[tpn] * width + kk[tpn]
            o = np.lexsort((-tpn, -tv, tk))
            lead = np.ones(len(o), bool)
            lead[1:] = tk[o][1:] != tk[o][:-1]
            last_tp, nxt = tpn[o][lead], tk[o][lead] + 1
            at = np.minimum(np.searchsorted(keys, nxt), len(keys) - 1)
            ok = keys[at] == nxt
            out.add_edges(last_tp[ok].tolist(), firsts[at[ok]].tolist(), ORDER)
    # ZeRO-3 prefetch depth 1: the gather for step k waits for step k-1 to start
    gathers = np.flatnonzero(placed & _equals(c["op"], "all_gather")) if "all_gather" in c["op"] else []
    if len(gathers) and len(keys):
        want = kk[gathers] - 1
        ok = (want >= 0) & (want < width)
        at = np.minimum(np.searchsorted(keys, stage[gathers] * width + want), len(keys) - 1)
        ok &= keys[at] == stage[gathers] * width + want
        out.add_edges(firsts[at[ok]].tolist(), gathers[ok].tolist(), ORDER)
