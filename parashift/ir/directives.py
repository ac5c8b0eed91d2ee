"""Scheduling directives: pure rewrites of a :class:`~parashift.ir.graph.Graph`.

Each directive is a small frozen dataclass with ``apply(graph) -> graph`` (a new graph; the input is
not changed) that adds the communication its placement implies:

- :class:`Split` makes micro-batches (forward, backward, loss edge, stashed activations) and can split
  every backward into input-grad and weight-grad halves (zero-bubble schedules);
- :class:`Place` assigns regions to chunks (virtual stages) and chunks to pipeline stages, adds the
  send/recv pairs where data crosses stages and one optimizer step per stage;
- :class:`Shard` divides regions over a TP group (adding the TP all-reduces, or with sequence
  parallelism reduce-scatters and all-gathers), experts over an EP group (adding dispatch/combine
  all-to-alls), or the sequence over a CP ring (adding the K/V ring exchanges of ring attention);
- :class:`Recompute` re-runs region forwards right before their backward;
- :class:`Replicate` adds DP gradient sync (all-reduce, or ZeRO reduce-scatter plus parameter
  all-gathers) and the tied-embedding all-reduce;
- :class:`Order` fixes every stage's order of actions (see :mod:`parashift.ir.actions`) and rejects
  an order that would create a cycle; :class:`Stream` moves nodes to another logical stream;
  :class:`Fuse` merges a chunk's regions into one node where no communication sits between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import add
from typing import ClassVar, Mapping, Sequence

import numpy as np

from ..collectives import ACTIVATION_PHASES, BACKWARD_PHASES
from ..errors import ProgramError
from ..states import ZeroStage, zero_stage
from .actions import AFTER, END, OPTIM, POST, Action
from .graph import DATA, SAVED, Graph, equals as _equals, take as _take
from .ordering import Fuse, Order, Stream
from . import stamp as _stamp, tags as T

__all__ = ["Split", "Place", "Shard", "Recompute", "Replicate", "Order", "Stream", "Fuse", "apply_all",
           "END", "OPTIM", "POST", "AFTER"]

_TYPE_OF_PHASE = {"fwd": "F", "bwd": "B", "bwd_input": "I", "bwd_weight": "W"}
_BWD = BACKWARD_PHASES


def _comm(g: Graph, u: int, *, op: str, tag: str, group: "str | None" = None, peer: "str | None" = None,
          nbytes: int = 0, stream: str = "compute", dpos: float = 0.5, key: "str | None" = None) -> int:
    """A comm node serving node ``u`` (same stage/chunk/mb/phase/action), placed after it."""
    c = g.cols
    return g.add(op=op, phase=c["phase"][u], region=c["region"][u], kind=c["kind"][u], layer=c["layer"][u],
                 chunk=c["chunk"][u], mb=c["mb"][u], stage=c["stage"][u], action=c["action"][u],
                 pos=c["pos"][u] + dpos, group=group, peer=peer, tag=tag, nbytes=int(nbytes), stream=stream,
                 key=key)


def _comm_many(g: Graph, us: list[int], *, op: "str | list[str]", tags: list[str], group: "str | None" = None,
               peer: "list[str] | None" = None, nbytes: int = 0, stream: "str | list[str]" = "compute",
               dpos: "float | list[float]" = 0.5, key: "str | None" = None) -> range:
    """Comm nodes serving nodes ``us`` (one each, same stage/chunk/mb/phase/action), placed after
    them by ``dpos`` (``op``, ``peer`` and ``dpos``: one for all or a list, one per node)."""
    c = g.cols
    cols = {k: _take(c[k], us) for k in ("phase", "region", "kind", "layer", "chunk", "mb", "stage", "action")}
    pos = _take(c["pos"], us)
    cols["pos"] = list(map(add, pos, dpos)) if isinstance(dpos, list) else [p + dpos for p in pos]
    return g.extend(len(us), op=op, group=group, peer=peer, tag=tags, nbytes=int(nbytes), stream=stream, key=key,
                    **cols)


def _tag(made: dict, mb: int, cls: type, *head) -> str:
    """``str(cls(*head, mb))`` (a per-micro-batch tag), each distinct ``(cls, *head)`` built and checked
    once (``made``: the cache)."""
    key = (cls, *head)
    f = made.get(key)
    if f is None:
        f = made[key] = T.mb_namer(lambda m: cls(*head, m))
    return f(mb)


def _neighbours(g: Graph) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """DATA predecessors and successors of every node."""
    preds: dict[int, list[int]] = {}
    succs: dict[int, list[int]] = {}
    for u, v, k in zip(g.src, g.dst, g.ekind):
        if k == DATA:
            preds.setdefault(v, []).append(u)
            succs.setdefault(u, []).append(v)
    return preds, succs


def _alongside(g: Graph, nbrs: tuple[dict, dict], u: int, node: int) -> None:
    """Run ``node`` beside ``u``: it starts with u (after u's inputs) and u's consumers wait for both."""
    for p in nbrs[0].get(u, []):
        g.edge(p, node, DATA)
    for v in nbrs[1].get(u, []):
        g.edge(node, v, DATA)


def _weight_halves(g: Graph) -> dict[int, int]:
    """``bwd_input`` node -> the ``bwd_weight`` node split from it (see :class:`Split`)."""
    c = g.cols
    ph = c["phase"]
    return {u: v for u, v, k in zip(g.src, g.dst, g.ekind)
            if k == SAVED and ph[v] == "bwd_weight" and ph[u] == "bwd_input"
            and c["region"][u] == c["region"][v] and c["mb"][u] == c["mb"][v]}


def _clone(g: Graph, src: Graph, i: int, **over) -> int:
    attrs = {k: v[i] for k, v in src.cols.items()}
    attrs.update(over)
    return g.add(**attrs)


@dataclass(frozen=True)
class Split:
    """``microbatches=m``: turn a single-device forward graph into a training DAG of m micro-batches
    (fwd chain, reversed bwd chain, loss edge, stashed activations). ``backward=True``: split every
    ``bwd`` node into ``bwd_input`` (on the gradient chain) and ``bwd_weight`` (off it), each in an
    action of its own (I and W: zero-bubble schedules). ``kinds``: split only the regions of these
    kinds; ``keep_action``: both halves stay in the node's B action, the weight half right after the
    input half (how ``tp_async`` overlaps a TP reduction with the weight gradients)."""

    microbatches: int | None = None
    backward: bool = False
    kinds: tuple[str, ...] | None = None
    keep_action: bool = False
    #: treats every micro-batch alike: :func:`apply_all` may stamp it (see :mod:`parashift.ir.stamp`)
    stampable: ClassVar[bool] = True

    def apply(self, g: Graph) -> Graph:
        out = g
        if self.microbatches is not None:
            out = self._microbatches(out)
        if self.backward:
            out = self._split_backward(out, self.kinds, self.keep_action)
        return out

    def _microbatches(self, g: Graph) -> Graph:
        m = self.microbatches
        if not isinstance(m, int) or m < 1:
            raise ProgramError(f"Split(microbatches={m!r}) needs a positive integer")
        if any(p != "fwd" for p in g.cols["phase"]) or any(x != -1 for x in g.cols["mb"]):
            raise ProgramError("Split(microbatches=...) applies to a single-device forward graph; "
                               "build one with ir.model_graph or ir.annotate.trace")
        n = len(g)
        topo = g.topo_order((DATA,))
        rank = np.empty(n, np.int64)
        rank[topo] = np.arange(n)
        sinks = set(range(n)) - set(g.src)
        fpos = [float(x) for x in rank]
        bpos = [float(n - 1 - x) for x in rank]
        bflops = [2.0 * f for f in g.cols["flops"]]
        base = {k: v for k, v in g.cols.items() if k not in ("mb", "pos")}
        # one micro-batch's forward then backward nodes, stamped m times
        bwd = {"phase": ["bwd"] * n, "flops": bflops, "act": [0] * n}
        out = Graph()
        for k, v in g.cols.items():
            out.cols[k] = (v + bwd.get(k, v)) * m
        out.cols["mb"] = [mb for mb in range(m) for _ in range(2 * n)]
        out.cols["pos"] = (fpos + bpos) * m
        # per micro-batch: fwd u -> v and bwd v -> u per edge, then fwd i -> bwd i per node
        src, dst = np.asarray(g.src, np.int64), np.asarray(g.dst, np.int64)
        e = len(src)
        one_s = np.concatenate([np.stack([src, n + dst], 1).reshape(-1), np.arange(n)])
        one_d = np.concatenate([np.stack([dst, n + src], 1).reshape(-1), n + np.arange(n)])
        kind = [DATA] * (2 * e) + [DATA if i in sinks else SAVED for i in range(n)]
        off = (2 * n * np.arange(m, dtype=np.int64))[:, None]
        out.src = (off + one_s).reshape(-1).tolist()
        out.dst = (off + one_d).reshape(-1).tolist()
        out.ekind = kind * m
        return out

    @staticmethod
    def _split_backward(g: Graph, kinds: "tuple[str, ...] | None" = None, keep_action: bool = False) -> Graph:
        out = g.owned()
        c = out.cols
        bw = [i for i, (op, ph) in enumerate(zip(c["op"], c["phase"])) if op == "compute" and ph == "bwd"]
        if not bw:
            raise ProgramError("Split(backward=True) found no 'bwd' compute node; split micro-batches first")
        if kinds is not None:
            bw = [i for i in bw if c["kind"][i] in kinds]
        weight = {}
        for i in bw:
            half = c["flops"][i] / 2.0
            c["phase"][i] = "bwd_input"
            c["flops"][i] = half
            a = c["action"][i]
            if keep_action:
                if not isinstance(a, Action):
                    raise ProgramError("Split(backward=True, keep_action=True) splits placed backward actions; "
                                       "apply it after Place")
                w = _clone(out, out, i, phase="bwd_weight", flops=half, pos=c["pos"][i] + 0.01)
            else:
                w = _clone(out, out, i, phase="bwd_weight", flops=half,
                           action=Action(a.chunk, "W", a.mb) if isinstance(a, Action) else None)
                if isinstance(a, Action):
                    c["action"][i] = Action(a.chunk, "I", a.mb)
            weight[i] = w
        for e in range(len(out.src)):
            u, v, k = out.src[e], out.dst[e], out.ekind[e]
            if k != SAVED:
                continue
            if u in weight:  # parameter gradients leave from the weight half
                out.src[e] = weight[u]
            elif v in weight and c["phase"][u] in ("fwd", "recompute"):
                out.edge(u, weight[v], SAVED)
        for i in weight:  # buffers the backward frees live until the weight half
            c["free"][i] = ()
        for i, w in weight.items():
            out.edge(i, w, SAVED)
        return out


@dataclass(frozen=True)
class Place:
    """Place regions on chunks and chunks on pipeline stages; add send/recv where data crosses stages.

    ``layer_chunk[i]``: chunk of layer i (embedding: chunk 0, head: the last chunk);
    ``chunk_stage[c]``: pipeline stage of chunk c; ``act_bytes``: bytes of one activation message;
    ``optim``: per stage (flops, nbytes) of its optimizer step.
    """

    layer_chunk: tuple[int, ...]
    chunk_stage: tuple[int, ...]
    act_bytes: int
    optim: tuple[tuple[float, int], ...] = ()
    vshape: bool = False
    stampable: ClassVar[bool] = True

    def _peer(self, cu: int, cv: int) -> str:
        """Symbolic peer for data moving from chunk cu to the adjacent chunk cv (a custom placement
        that skips stages: ``pp+k``, k the stage distance)."""
        up = not self.vshape or (min(cu, cv) // self.pp) % 2 == 0
        if cv < cu:
            up = not up
        su, sv = self.chunk_stage[cu], self.chunk_stage[cv]
        if (su + (1 if up else -1)) % self.pp == sv:
            return "pp+1" if up else "pp-1"
        return f"pp+{sv - su}" if sv > su else f"pp-{su - sv}"

    @property
    def pp(self) -> int:
        return max(self.chunk_stage) + 1

    def apply(self, g: Graph) -> Graph:
        n0 = len(g)
        out = g.owned()
        c = out.cols
        last = len(self.chunk_stage) - 1
        L = len(self.layer_chunk)
        lc, cs = self.layer_chunk, self.chunk_stage
        chunks = c["chunk"] = [0 if layer < 0 else last if layer >= L else lc[layer] for layer in c["layer"]]
        stages = c["stage"] = [cs[ch] for ch in chunks]
        acts, made = c["action"], {}     # one Action object per (chunk, type, mb)
        for i, (ch, ph, mb) in enumerate(zip(chunks, c["phase"], c["mb"])):
            t = _TYPE_OF_PHASE.get(ph)
            if t is not None and mb >= 0:
                a = made.get((ch, t, mb))
                if a is None:
                    a = made[(ch, t, mb)] = Action(ch, t, mb)
                acts[i] = a
        c["stream"] = ["compute" if x is None else x for x in c["stream"]]
        st_arr = np.asarray(stages, np.int64)
        src, dst = np.asarray(out.src, np.int64), np.asarray(out.dst, np.int64)
        cross = np.flatnonzero((np.asarray(out.ekind) == DATA) & (st_arr[src] != st_arr[dst])) if len(src) else []
        # per cross-stage edge u -> v: a send after u and a recv before v (nodes added in pairs)
        anchors, ops, tags, peers, dpos = [], [], [], [], []
        s = len(out)
        made: dict = {}
        for e in np.asarray(cross).tolist():
            u, v = out.src[e], out.dst[e]
            cu, cv, mb = chunks[u], chunks[v], c["mb"][u]
            tag = _tag(made, mb, T.P2PTag, T.Payload.ACT, cu) if cv > cu else _tag(made, mb, T.P2PTag, T.Payload.GRAD, cv)
            peer = self._peer(cu, cv)
            anchors += [u, v]
            ops += ["send", "recv"]
            tags += [tag, tag]
            peers += [peer, peer.replace("+", "-") if "+" in peer else peer.replace("-", "+")]
            dpos += [0.75, -0.75]
            out.dst[e] = s
            out.edge(s, s + 1, DATA)
            out.edge(s + 1, v, DATA)
            s += 2
        if anchors:
            _comm_many(out, anchors, op=ops, tags=tags, peer=peers, nbytes=self.act_bytes, stream="p2p", dpos=dpos)
        optim = self.optim or tuple((0.0, 0) for _ in range(self.pp))
        opt_node = {st: out.add(op="compute", phase="optim", stage=st, flops=float(optim[st][0]),
                                nbytes=int(optim[st][1]), stream="compute", action=(OPTIM,))
                    for st in range(self.pp)}
        bwd = [i for i, (op, ph) in enumerate(zip(c["op"][:n0], c["phase"])) if op == "compute" and ph in _BWD]
        out.add_edges(bwd, [opt_node[stages[i]] for i in bwd], SAVED)
        return out


@dataclass(frozen=True)
class Shard:
    """Shard regions over a group. ``axis="tp"``: divide FLOPs and parameters by ``ways`` and add the
    TP all-reduces (row-parallel outputs in fwd, column-parallel input grads in bwd) plus the
    vocab-parallel loss statistics all-gather after the head. With ``sp`` (Megatron sequence
    parallelism) every such all-reduce becomes a reduce-scatter into sequence shards (the norms and
    dropouts between blocks run on ``s/t`` tokens) and an all-gather before the next block; the
    backward of a column-parallel block also re-gathers its saved sequence-sharded input for the
    weight gradient, on the comm stream beside the backward compute (Megatron overlaps it with the
    input-gradient GEMM). ``nbytes`` is the full activation (the all-reduced tensor).
    ``async_bwd`` (``tp_async``; the backward already split by ``Split(backward=True)``): the backward's
    reduction of a column-parallel block's input gradient (all-reduce, with ``sp`` reduce-scatter) and the
    ``sp`` re-gather run on stream ``"tp"``, beside the block's ``bwd_weight``, which waits for the re-gather
    only (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``); the gradient chain waits for it.
    ``axis="ep"``: spread experts over ``ways`` ranks and add dispatch/combine all-to-alls around
    ``moe.experts``. ``axis="cp"``: every rank holds ``s/ways`` tokens, so compute FLOPs are divided by
    ``ways`` (balanced causal chunks), and each attention gathers the K/V blocks (``nbytes`` per rank)
    of the CP group: forward an all-gather, backward an all-gather of K/V and a reduce-scatter of their
    gradients. Each rank moves ``(ways - 1)`` blocks per pass, the bytes the p2p ring of ring attention
    moves (this is Megatron/TransformerEngine's ``cp_comm_type="all_gather"``, as Llama 3 trained);
    the exchanges sit on the comm stream between the attention's parts, exposed (see ``_ring``)."""

    axis: str
    ways: int
    nbytes: int
    stats_bytes: int = 0
    sp: bool = False
    async_bwd: bool = False
    stampable: ClassVar[bool] = True

    def apply(self, g: Graph) -> Graph:
        if self.axis not in ("tp", "ep", "cp"):
            raise ProgramError(f"Shard axis {self.axis!r} is not supported; use 'tp', 'ep' or 'cp'")
        out = g.owned()
        if self.ways == 1:
            return out
        if self.axis == "cp":
            return self._ring(out)
        if self.axis == "tp" and self.sp:
            return self._sequence_parallel(out)
        c = out.cols
        n = len(out)
        plan: dict[tuple, list] = {}   # (op, key) -> [(node, tag)]
        made: dict = {}
        if self.axis == "tp":
            comp = _equals(c["op"], "compute") & ~_equals(c["phase"], "optim")
            _divide(c, np.flatnonzero(comp), self.ways)
            # per node: 1 an all-reduce follows it, 2 the head's loss-statistics all-gather
            cat = np.fromiter(map(_TP_AFTER.get, zip(c["phase"], c["kind"]), repeat(0)), np.int64, n) * comp
            found = []
            for k, step in ((1, ("all_reduce", None)), (2, ("all_gather", "ce_stats"))):
                nodes = np.flatnonzero(cat == k).tolist()
                if nodes:
                    heads = list(zip(_take(c["region"], nodes), _take(c["phase"], nodes))) if k == 1 else \
                        [("head", "fwd")] * len(nodes)
                    tags = T.mb_names(heads, _take(c["mb"], nodes),
                                      lambda h: T.mb_head(lambda m: T.TPTag(*h, m)))
                    found.append((nodes[0], step, list(zip(nodes, tags))))
            plan = {step: items for _, step, items in sorted(found)}      # in the order they first show
        else:
            for i in range(n):
                if c["op"][i] != "compute":
                    continue
                kind, ph, mb, layer = c["kind"][i], c["phase"][i], c["mb"][i], c["layer"][i]
                if kind == "moe.experts":
                    c["params"][i] //= self.ways
                ph_tag = "bwd" if ph == "bwd_input" else ph
                what = None
                if ph == "fwd" and kind == "moe.route":
                    what = "dispatch"
                elif ph == "fwd" and kind == "moe.experts":
                    what = "combine"
                elif ph in ("bwd", "bwd_input") and kind == "moe.combine":
                    what = "combine"
                elif ph in ("bwd", "bwd_input") and kind == "moe.experts":
                    what = "dispatch"
                if what:
                    plan.setdefault(("all_to_all", None), []).append(
                        (i, _tag(made, mb, T.EPTag, layer, T.A2A(what), ph_tag)))
        ins: list[tuple[int, int]] = []
        for (op, key), items in plan.items():
            us = [u for u, _ in items]
            nb = self.stats_bytes if key == "ce_stats" else self.nbytes
            new = _comm_many(out, us, op=op, tags=[t for _, t in items], group=self.axis, nbytes=nb, key=key,
                             stream=self._streams(c, us))
            ins += list(zip(us, new))
        out.insert_after(ins)
        return out

    def _streams(self, c: dict, us: list[int]) -> "str | list[str]":
        """Stream of the TP reduction after each of ``us``: ``"tp"`` after a backward under ``async_bwd``."""
        if not (self.async_bwd and self.axis == "tp"):
            return "compute"
        return ["tp" if c["phase"][u] in ("bwd", "bwd_input") else "compute" for u in us]

    def _sequence_parallel(self, out: Graph) -> Graph:
        """TP with sequence parallelism: reduce-scatter + all-gather where TP all-reduces."""
        c = out.cols
        steps: list[list[tuple[int, str, str, str]]] = [[], []]   # per hop: (node, op, tag, key)
        regather: list[tuple[int, str]] = []
        nbrs = _neighbours(out)
        made: dict = {}
        for i in range(len(out)):
            if c["op"][i] != "compute" or c["phase"][i] == "optim":
                continue
            c["flops"][i] /= self.ways
            c["params"][i] //= self.ways
            kind, ph, mb, reg = c["kind"][i], c["phase"][i], c["mb"][i], c["region"][i]
            if ph == "fwd" and kind == "head":
                steps[0].append((i, "all_gather", _tag(made, mb, T.TPTag, "head", "fwd"), "ce_stats"))
            elif (ph == "fwd" and kind in ("embed", "attn", "mlp", "moe.combine")) or \
                    (ph in ("bwd", "bwd_input") and kind in TP_BWD_KINDS):
                steps[0].append((i, "reduce_scatter", _tag(made, mb, T.SPTag, reg, ph, "rs"), "sp_scatter"))
                steps[1].append((i, "all_gather", _tag(made, mb, T.SPTag, reg, ph, "ag"), "sp_gather"))
                if ph != "fwd" and kind in ("head", "mlp", "attn"):
                    regather.append((i, _tag(made, mb, T.SPTag, reg, ph, "input")))
        last: dict[int, int] = {}       # region node -> its latest comm node
        for items in steps:
            by_key: dict[tuple[str, str], list[tuple[int, str]]] = {}
            for u, op, tag, key in items:
                by_key.setdefault((op, key), []).append((u, tag))
            ins = []
            for (op, key), rows in by_key.items():
                anchors = [last.get(u, u) for u, _ in rows]
                nb = self.stats_bytes if key == "ce_stats" else self.nbytes
                new = _comm_many(out, anchors, op=op, tags=[t for _, t in rows], group="tp", nbytes=nb,
                                 key=str(T.StepKey(key)), dpos=0.05,
                                 stream=self._streams(c, [u for u, _ in rows]) if op == "reduce_scatter" else "compute")
                ins += list(zip(anchors, new))
                last.update({u: int(x) for (u, _), x in zip(rows, new)})
            out.insert_after(ins)
        weight = _weight_halves(out) if self.async_bwd else {}
        preds = _neighbours(out)[0] if weight else {}      # after the reduce-scatters and all-gathers went in
        for u, tag in regather:   # overlapped with the input-grad GEMM on the comm stream, as Megatron does
            node = _comm(out, u, op="all_gather", tag=tag, group="tp", nbytes=self.nbytes,
                         stream="tp" if self.async_bwd else "comm", dpos=-0.3, key=str(T.StepKey("sp_input")))
            if u in weight:       # async: only the weight gradient waits for it
                out.add_edges(preds.get(u, []), [node] * len(preds.get(u, [])), DATA)
                out.edge(node, weight[u], DATA)
            else:
                _alongside(out, nbrs, u, node)
        return out

    def _ring(self, out: Graph) -> Graph:
        """Context parallelism: FLOPs over ``ways`` ranks and the K/V exchanges of each attention, in
        the order TransformerEngine's ``cp_comm_type="all_gather"`` runs them (and the runtime does):
        forward, the K/V all-gather follows the attention node (whose QKV projection makes K/V) and
        the next node waits for it; backward, the K/V all-gather precedes the attention node and
        the K/V-gradient reduce-scatter follows it (a split backward's weight half waits for it too).
        The exchanges are exposed, as they are there."""
        c = out.cols
        n = len(out)
        after: list[tuple[int, int]] = []
        before: list[tuple[int, int]] = []
        made: dict = {}
        weight = {(c["region"][i], c["mb"][i]): i for i in range(n)
                  if c["op"][i] == "compute" and c["phase"][i] == "bwd_weight" and c["kind"][i] == "attn"}
        for i in range(n):
            if c["op"][i] != "compute" or c["phase"][i] == "optim":
                continue
            c["flops"][i] /= self.ways
            ph = c["phase"][i]
            if c["kind"][i] != "attn" or ph not in ACTIVATION_PHASES:
                continue
            reg, mb = c["region"][i], c["mb"][i]
            kv = _comm(out, i, op="all_gather", tag=_tag(made, mb, T.CPTag, reg, ph, "kv"), group="cp",
                       nbytes=self.nbytes * self.ways, stream="comm", dpos=0.3 if ph == "fwd" else -0.3,
                       key=str(T.StepKey("cp_kv")))
            if ph == "fwd":
                after.append((i, kv))
                continue
            before.append((i, kv))
            rs = _comm(out, i, op="reduce_scatter", tag=_tag(made, mb, T.CPTag, reg, ph, "dkv"), group="cp",
                       nbytes=self.nbytes * self.ways, stream="comm", dpos=0.5, key=str(T.StepKey("cp_dkv")))
            after.append((i, rs))
            if (reg, mb) in weight:          # the QKV weight gradient needs the K/V gradients it returns
                out.edge(rs, weight[(reg, mb)], SAVED)
        out.insert_after(after)
        _insert_before(out, before)
        return out


def _insert_before(g: Graph, items: list[tuple[int, int]]) -> None:
    """For each (u, c): reroute u's DATA in-edges through c (old sources -> c -> u)."""
    via = dict(items)
    g.dst = [via[v] if k == DATA and v in via else v for v, k in zip(g.dst, g.ekind)]
    for u, c in items:
        g.edge(c, u, DATA)


@dataclass(frozen=True)
class Recompute:
    """Re-run region forwards right before their backward. ``mode="full"``: every region but the
    embedding (the output layer too: a chunk's recomputed regions form one graph); ``"selective"``: attention regions only, re-running ``selective_flops`` (core
    attention; 0: the region's forward FLOPs). ``rc_bytes``: region kind -> bytes a recompute materializes (freed by the backward).
    A recompute waits for a reduction on stream ``"tp"`` its backward waits for (``tp_async``: Megatron's
    backward waits for the asynchronous all-reduce before the next kernels it queues)."""

    mode: str
    selective_flops: float = 0.0
    rc_bytes: Mapping[str, int] = field(default_factory=dict)
    stampable: ClassVar[bool] = True

    def apply(self, g: Graph) -> Graph:
        if self.mode not in ("none", "selective", "full"):
            raise ProgramError(f"recompute mode {self.mode!r} is not none, selective or full")
        out = g.owned()
        if self.mode == "none":
            return out
        c = out.cols
        fwd: dict[tuple, int] = {}
        weight: dict[tuple, int] = {}
        for i, (op, ph, region, mb) in enumerate(zip(c["op"], c["phase"], c["region"], c["mb"])):
            if op == "compute":
                if ph == "fwd":
                    fwd[(region, mb)] = i
                elif ph == "bwd_weight":
                    weight[(region, mb)] = i
        rows: list[int] = []
        rc_name: dict = {}
        flops: list[float] = []
        bufs: list[tuple] = []
        edges: list[tuple[int, int]] = []
        n = len(out)
        for i, (op, ph, kind, region, mb) in enumerate(zip(c["op"], c["phase"], c["kind"], c["region"], c["mb"])):
            if op != "compute" or ph not in ("bwd", "bwd_input"):
                continue
            if kind == "embed" or (self.mode == "selective" and kind != "attn"):
                continue
            key = (region, mb)
            f = fwd[key]
            r = n + len(rows)               # the recompute node cloned from i (appended below)
            rows.append(i)
            flops.append(float(c["flops"][f] if self.mode == "full" or self.selective_flops <= 0
                               else self.selective_flops))
            fmt = rc_name.get(region)
            if fmt is None:
                fmt = rc_name[region] = T.mb_namer(lambda m, r=region: T.StepBuffer("rc", m, region=r))
            buf = fmt(mb)
            bufs.append(((buf, int(self.rc_bytes.get(kind, 0))),))
            last = weight.get(key, i)
            c["free"][last] = c["free"][last] + (buf,)
            edges += [(f, r), (r, i)] + ([(r, last)] if last != i else [])
        if rows and "tp" in c["stream"]:
            preds = _neighbours(out)[0]
            stream = c["stream"]
            edges += [(u, n + k) for k, i in enumerate(rows) for u in preds.get(i, ()) if stream[u] == "tp"]
        out.clone(rows, phase="recompute", flops=flops, act=0, pos=[c["pos"][i] - 0.25 for i in rows], alloc=bufs,
                  free=())
        out.add_edges([u for u, _ in edges], [v for _, v in edges], SAVED)
        return out


@dataclass(frozen=True)
class Replicate:
    """Replicate every stage over a DP group of ``ways`` ranks with ZeRO stage ``zero``.

    Per chunk: ``dense_bytes[c]`` / ``expert_bytes[c]`` are the chunk's parameter bytes on one rank
    (TP/EP shard, before ZeRO) and ``grad_dense[c]`` / ``grad_expert[c]`` its gradient bytes. Expert
    gradients sync over ``edp`` when ``ep > 1``; dense gradients over ``axis`` (``dp``, or ``dpcp``: the
    data-parallel group with context parallelism, as Megatron reduces them; ``shard``: hybrid sharding's
    group of ``ways`` ranks, whose ``replicas`` copies then all-reduce each chunk's reduce-scattered
    gradient shard over the ``replica`` axis, tag ``dp.replica.c<c>``). ``tied_bytes``: the tied word embedding's grad bytes
    (0: untied), all-reduced over the ``embed`` group when embedding and head sit on different stages.
    ``overlap``: a chunk's gradient sync waits only for that chunk's backward (it overlaps the stage's
    other chunks); False: for the whole backward of its stage (Megatron without ``--overlap-grad-reduce``).

    ZeRO-2/3 (``zero >= 2``) reduce-scatter each micro-batch's gradients of a chunk into the owner's
    shard right after that micro-batch's backward (``dp.grad.c<c>.m<mb>``): the chunk's full-size
    gradient (buffer ``zg.c<c>.m<mb>``) lives from its first node that writes gradients (B, or W
    under split backwards) until the reduce-scatter completes, and only the shard lives for the whole
    step (on dense models per region bucket, see ``buckets``; ``Order`` bounds how many a rank holds
    at once). With a tied embedding split across
    stages the chunks sync once per step, as with ZeRO-1, so the embedding all-reduce sees whole gradients.
    """

    ways: int
    zero: int
    dense_bytes: tuple[int, ...]
    expert_bytes: tuple[int, ...]
    grad_dense: tuple[int, ...]
    grad_expert: tuple[int, ...]
    ep: int = 1
    tied_bytes: int = 0
    axis: str = "dp"
    overlap: bool = True
    buckets: tuple[tuple[str, int, int], ...] = ()   # ZeRO-2/3: (atomic region, param bytes, grad bytes), dense
    prefetch: int = 1     # ZeRO-3 per-region gathers issued ahead of the running region (0: none)
    replicas: int = 1     # hybrid sharding: copies of each ZeRO shard (``ways`` is then the shard group)
    overlap_param: bool = False   # ZeRO-1/2: the parameter gathers run in the step's forward, see _forward_gathers
    stampable: ClassVar[bool] = True

    @property
    def zero_stage(self) -> ZeroStage:
        """The ZeRO stage record of ``zero``."""
        return zero_stage(self.zero)

    def apply(self, g: Graph) -> Graph:
        out = g.owned()
        c = out.cols
        z = self.zero_stage
        chunks = len(self.dense_bytes)
        stage_of: dict[int, int] = {}
        optim: dict[int, int] = {}
        bwd_of_chunk: dict[int, list[int]] = {}
        first_of_action: dict[Action, int] = {}
        last_of_action: dict[Action, int] = {}
        pos = c["pos"]
        for i, (op, ph, ch, st, a) in enumerate(zip(c["op"], c["phase"], c["chunk"], c["stage"], c["action"])):
            if op != "compute":
                continue
            if ph == "optim":
                optim[st] = i
                continue
            stage_of[ch] = st
            if ph in _BWD:
                bwd_of_chunk.setdefault(ch, []).append(i)
            if isinstance(a, Action):
                j = first_of_action.get(a)
                if j is None or pos[i] < pos[j]:
                    first_of_action[a] = i
                j = last_of_action.get(a)
                if j is None or pos[i] > pos[j]:
                    last_of_action[a] = i
        if len(stage_of) != chunks:
            raise ProgramError("Replicate needs a placed graph (apply Place first)")
        edp = self.ways // self.ep
        last = chunks - 1
        tied = bool(self.tied_bytes) and stage_of[0] != stage_of[last]
        sync_nodes: dict[int, list[int]] = {}
        replica_after: list[tuple[int, int]] = []
        rs_of: dict[int, list[int]] = {}      # chunk -> its ZeRO-2/3 per-micro-batch reduce-scatters
        if z.grad_buckets and not tied:
            rs_of = self._per_microbatch(out, stage_of, optim, bwd_of_chunk, first_of_action, last_of_action, edp)
        for ch in (range(0) if z.grad_buckets and not tied else range(chunks)):
            st = stage_of[ch]
            anchor = (AFTER, ch)
            for grp, nb, what in self._specs(ch, edp):
                s = out.add(op=z.grad_sync, group=grp, chunk=ch,
                            stage=st, tag=str(T.SyncTag(T.Axis("edp" if what == "expert" else "dp"), T.Sync.GRAD, ch)),
                            key=str(T.StepKey("grad", ch, what)), nbytes=int(nb),
                            stream="comm", action=anchor)
                sync_nodes.setdefault(ch, []).append(s)
            if self.replicas > 1 and self.grad_dense[ch]:     # hybrid: the shard's copies sum their gradients
                r = self._replica_sync(out, ch, st)
                for u in sync_nodes.get(ch, []):
                    replica_after.append((u, r))
                sync_nodes.setdefault(ch, []).append(r)
        if z.grad_buckets and not tied and self.replicas > 1:   # after the chunk's last micro-batch
            for ch in range(chunks):
                if self.grad_dense[ch]:
                    r = self._replica_sync(out, ch, stage_of[ch])
                    for u in rs_of.get(ch) or bwd_of_chunk.get(ch, []):
                        out.edge(u, r, SAVED)
                    out.edge(r, optim[stage_of[ch]], SAVED)
        # reroute bwd -> optim edges through the chunk's syncs
        syncs_by_node = {}
        for ch, nodes in sync_nodes.items():
            for i in bwd_of_chunk.get(ch, []):
                syncs_by_node[i] = nodes
        if syncs_by_node and out.src:
            synced = np.zeros(len(out), bool)
            synced[list(syncs_by_node)] = True
            src, dst = np.asarray(out.src, np.int64), np.asarray(out.dst, np.int64)
            drop = (np.asarray(out.ekind) == SAVED) & synced[src] & _equals(c["phase"], "optim")[dst]
            if drop.any():
                keep = (~drop).tolist()
                out.src, out.dst, out.ekind = (list(compress(x, keep)) for x in (out.src, out.dst, out.ekind))
        bwd_of_stage: dict[int, list[int]] = {}
        for ch, nodes in bwd_of_chunk.items():
            bwd_of_stage.setdefault(stage_of[ch], []).extend(nodes)
        for ch, nodes in sync_nodes.items():
            waits = bwd_of_chunk[ch] if self.overlap else bwd_of_stage[stage_of[ch]]
            for s in nodes:
                out.add_edges(waits, [s] * len(waits), SAVED)
                out.edge(s, optim[stage_of[ch]], SAVED)
        for u, r in replica_after:
            out.edge(u, r, SAVED)
        self._wait_async_tp(out, optim, sync_nodes, rs_of)
        # tied embedding: all-reduce between the first and the last stage, at the end of the comm stream
        if tied:
            for ch, kind in ((0, "embed"), (last, "head")):
                st = stage_of[ch]
                t = out.add(op="all_reduce", group="embed", chunk=ch, stage=st, tag=str(T.EmbedTag()),
                            key=str(T.StepKey("grad", None, "embed")), nbytes=int(self.tied_bytes), stream="comm", action=(END, 0))
                for i in bwd_of_chunk[ch]:
                    if c["kind"][i] == kind:
                        out.edge(i, t, SAVED)
                for k, s in enumerate(sync_nodes.get(ch, [])):
                    c["action"][s] = (END, 1 + k)
                    out.edge(t, s, SAVED)
                if not sync_nodes.get(ch):
                    out.edge(t, optim[st], SAVED)
        # ZeRO parameter all-gathers
        if z.gathers_after_step and self.overlap_param:
            self._forward_gathers(out, first_of_action, optim, edp)
        elif z.gathers_after_step:
            for ch in range(chunks):
                for grp, nb, pfx in ((self.axis, self.dense_bytes[ch], "dp"), ("edp", self.expert_bytes[ch], "edp")):
                    size = self.ways if grp == self.axis else (edp if self.ep > 1 else 1)
                    if size > 1 and nb:
                        a = out.add(op="all_gather", group=grp, chunk=ch, stage=stage_of[ch],
                                    tag=str(T.SyncTag(T.Axis(pfx), T.Sync.PARAM, ch)),
                                    key=str(T.StepKey("param", ch, "dense" if grp == self.axis else "expert")),
                                    nbytes=int(nb), stream="comm", action=(POST, ch))
                        out.edge(optim[stage_of[ch]], a, SAVED)
        elif z.gathers_around_use and not self._region_gathers(out):
            for a, first in first_of_action.items():
                if a.type == "W":
                    continue
                ph = "fwd" if a.type == "F" else "bwd"
                users = [first]
                end = last_of_action[a]     # a weight-gradient node needs no parameters
                for grp, nb, pfx, buf in ((self.axis, self.dense_bytes[a.chunk], "z3.param", "z3"),
                                          ("edp", self.expert_bytes[a.chunk], "z3.eparam", "z3e")):
                    size = self.ways if grp == self.axis else (edp if self.ep > 1 else 1)
                    if size <= 1 or not nb:
                        continue
                    name = str(T.StepBuffer(buf, a.mb, chunk=a.chunk, phase=ph))
                    n = out.add(op="all_gather", group=grp, chunk=a.chunk, stage=c["stage"][first],
                                phase=ph, mb=a.mb, tag=str(T.Z3Tag(grp == "edp", a.chunk, ph, a.mb)), nbytes=int(nb),
                                key=str(T.StepKey("param", a.chunk, "dense" if grp == self.axis else "expert")),
                                stream="comm", action=a, pos=-1.0, alloc=((name, int(nb)),))
                    for u in users:
                        out.edge(n, u, SAVED)
                    c["free"][end] = c["free"][end] + (name,)
        return out

    def _forward_gathers(self, out: Graph, first_of_action: dict, optim: dict[int, int], edp: int) -> None:
        """ZeRO-1/2 with ``overlap_param``: the gathers of the previous optimizer step's parameters run
        at the head of this step, one per bucket (a region's parameters where the graph is unfused and
        dense, else a chunk's), in the chunk's first forward action right before the bucket's first
        node, which alone waits for it. A chunk's buckets are issued together, as Megatron's aligned
        parameter sync dispatches a model chunk's; ``Order`` makes a later action's gathers wait for
        the stage's step before it to start. The optimizer waits for every gather: it overwrites
        the shard they read."""
        if self.ways <= 1:
            return
        c = out.cols
        psize = {r: p for r, p, _ in self.buckets}
        own: dict[Action, dict[str | None, list[int]]] = {}
        for a in first_of_action:
            if a.type == "F" and a.mb == 0:
                own[a] = {}
        for i in range(len(out)):
            a = c["action"][i]
            if c["op"][i] == "compute" and a in own:
                own[a].setdefault(c["region"][i], []).append(i)
        region_wise = bool(psize) and not any(self.expert_bytes) and \
            all(r in psize for users in own.values() for r in users)
        for a, by_region in own.items():
            ch, st = a.chunk, c["stage"][first_of_action[a]]
            if region_wise:
                buckets = [(self.axis, "dp", r, int(psize[r]), users) for r, users in by_region.items() if psize[r]]
            else:
                every = [i for users in by_region.values() for i in users]
                buckets = [(grp, pfx, None, int(nb), every)
                           for grp, nb, pfx in ((self.axis, self.dense_bytes[ch], "dp"),
                                                ("edp", self.expert_bytes[ch], "edp"))
                           if nb and (self.ways if grp == self.axis else (edp if self.ep > 1 else 1)) > 1]
            for grp, pfx, region, nb, users in buckets:
                n = out.add(op="all_gather", group=grp, chunk=ch, stage=st,
                            tag=str(T.SyncTag(T.Axis(pfx), T.Sync.PARAM, ch, None, region)),
                            key=str(T.StepKey("param", ch, "dense" if grp == self.axis else "expert")),
                            nbytes=nb, stream="comm", action=a, pos=min(c["pos"][i] for i in users) - 0.5)
                for u in users:
                    out.edge(n, u, SAVED)
                out.edge(n, optim[st], SAVED)

    def _region_gathers(self, out: Graph) -> bool:
        """ZeRO-3 on an unfused dense graph: gather each region's parameters right before its nodes
        of an action and free them after its last one (weight-gradient nodes need no parameters: they
        multiply output gradients by stashed inputs); the j-th region's gather waits until region
        ``j - 1 - prefetch`` of the action has run. False (nothing added) where regions are not atomic."""
        c = out.cols
        psize = {r: p for r, p, _ in self.buckets}
        if not psize or self.ways <= 1 or any(self.expert_bytes):
            return False
        nodes: dict[Action, list[int]] = {}
        for i in range(len(out)):
            a = c["action"][i]
            if c["op"][i] == "compute" and isinstance(a, Action):
                if c["region"][i] not in psize:
                    return False
                nodes.setdefault(a, []).append(i)
        for a, ids in nodes.items():
            if a.type == "W":
                continue
            ph = "fwd" if a.type == "F" else "bwd"
            own: dict[str, list[int]] = {}
            for i in sorted(ids, key=lambda i: c["pos"][i]):
                own.setdefault(c["region"][i], []).append(i)
            regions = list(own)
            for j, r in enumerate(regions):
                users, end = own[r], own[r][-1]
                name = str(T.StepBuffer("z3", a.mb, chunk=a.chunk, phase=ph, region=r))
                n = out.add(op="all_gather", group=self.axis, chunk=a.chunk, stage=c["stage"][own[r][0]],
                            phase=ph, mb=a.mb, tag=str(T.Z3Tag(False, a.chunk, ph, a.mb, r)), nbytes=int(psize[r]),
                            key=str(T.StepKey("param", a.chunk, "dense")), stream="comm", action=a,
                            pos=float(c["pos"][own[r][0]]) - 0.5, alloc=((name, int(psize[r])),))
                for u in users:
                    out.edge(n, u, SAVED)
                if j - 1 - self.prefetch >= 0:
                    out.edge(own[regions[j - 1 - self.prefetch]][-1], n, SAVED)
                c["free"][end] = c["free"][end] + (name,)
        return True

    def _specs(self, ch: int, edp: int) -> list[tuple[str, int, str]]:
        """(group, gradient bytes, family) of chunk ``ch``'s gradient syncs."""
        specs = []
        if self.ways > 1:
            specs.append((self.axis, self.grad_dense[ch], "dense"))
        if self.ep > 1 and edp > 1 and self.grad_expert[ch]:
            specs.append(("edp", self.grad_expert[ch], "expert"))
        return specs

    def _replica_sync(self, out: Graph, ch: int, stage: int) -> int:
        """Hybrid sharding: the all-reduce of chunk ``ch``'s gradient shard over its replicas."""
        return out.add(op="all_reduce", group="replica", chunk=ch, stage=stage,
                       tag=str(T.SyncTag(T.Axis.DP, T.Sync.REPLICA, ch)), key=str(T.StepKey("grad", ch, "dense")),
                       nbytes=-(-int(self.grad_dense[ch]) // self.ways), stream="comm", action=(AFTER, ch))

    @staticmethod
    def _wait_async_tp(out: Graph, optim: dict[int, int], sync_nodes: dict[int, list[int]],
                       rs_of: dict[int, list[int]]) -> None:
        """``tp_async``: a region's gradients are whole only when its backward TP all-reduce on stream
        ``"tp"`` ends (the norm before its column-parallel GEMM takes the reduced gradient), so the
        chunk's gradient syncs (ZeRO-2/3: the region's micro-batch bucket) and the optimizer wait for it."""
        c = out.cols
        if "tp" not in c["stream"]:
            return
        late = [i for i, (op, st, ph) in enumerate(zip(c["op"], c["stream"], c["phase"]))
                if st == "tp" and op == "all_reduce" and ph in _BWD]
        if not late:
            return
        rs_key: dict[tuple, list[int]] = {}       # (chunk, mb, bucket region or None) -> its reduce-scatters
        for nodes in rs_of.values():
            for r in nodes:
                rs_key.setdefault((c["chunk"][r], c["mb"][r], T.parse_tag(c["tag"][r]).region), []).append(r)
        src: list[int] = []
        dst: list[int] = []
        for u in late:
            ch, mb = c["chunk"][u], c["mb"][u]
            waits = [optim[c["stage"][u]]] + sync_nodes.get(ch, []) + \
                rs_key.get((ch, mb, c["region"][u]), rs_key.get((ch, mb, None), []))   # its bucket, else the chunk's
            src += [u] * len(waits)
            dst += waits
        out.add_edges(src, dst, SAVED)

    def _per_microbatch(self, out: Graph, stage_of: dict[int, int], optim: dict[int, int],
                        bwd_of_chunk: dict[int, list[int]], first_of_action: dict, last_of_action: dict,
                        edp: int) -> dict[int, list[int]]:
        """ZeRO-2/3: one reduce-scatter per gradient bucket and micro-batch into the shard, right
        after the bucket's last backward node, its buffer allocated at its first node that writes
        gradients (the full backward, or under split backwards the weight-gradient node: an
        input-gradient node leaves its weight gradients' inputs for it and writes none).

        A bucket is one region's gradients (``buckets``, on an unfused graph) or else the chunk's.
        Once the stage's order is known, :class:`~parashift.ir.ordering.Order` bounds the buckets a
        rank holds at once (``GRAD_BUCKETS_IN_FLIGHT``). Returns chunk -> its reduce-scatter nodes."""
        c = out.cols
        sizes = {r: g for r, _, g in self.buckets}
        made: dict[int, list[int]] = {}
        for ch, nodes in bwd_of_chunk.items():
            specs = self._specs(ch, edp)
            if not specs:
                continue
            region_wise = bool(sizes) and all(c["region"][i] in sizes for i in nodes)
            groups: dict[tuple[int, str | None], list[int]] = {}
            for i in nodes:
                groups.setdefault((c["mb"][i], c["region"][i] if region_wise else None), []).append(i)
            for (mb, region), users in sorted(groups.items(), key=lambda kv: (kv[0][0], min(c["pos"][i] for i in kv[1]))):
                acts = {c["action"][i] for i in users if isinstance(c["action"][i], Action)}
                if region_wise:       # the first node that writes gradients: B, or W under split backwards
                    # (tp_async's I half in a B action writes the row-parallel GEMM's: Strategy.column_wgrad)
                    first = min(users, key=lambda i: (c["phase"][i] == "bwd_input"
                                                      and getattr(c["action"][i], "type", "I") == "I", c["pos"][i]))
                    end = max(users, key=lambda i: (c["phase"][i] != "bwd_input", c["pos"][i]))
                else:
                    starts = [first_of_action[a] for a in acts if a.type in ("B", "W")] or users
                    ends = [last_of_action[a] for a in acts if a.type in ("B", "W")] or users
                    first = min(starts, key=lambda i: c["pos"][i])
                    end = max(ends, key=lambda i: c["pos"][i])
                for grp, nb, what in specs:
                    expert = what == "expert"
                    name = str(T.StepBuffer("zge" if expert else "zg", mb, chunk=ch, region=region))
                    nbytes = int(sizes[region]) if region is not None else int(nb)
                    c["alloc"][first] = c["alloc"][first] + ((name, nbytes),)
                    axis = T.Axis("edp" if expert else "dp")
                    s = out.add(op="reduce_scatter", group=grp, chunk=ch, stage=stage_of[ch], mb=mb,
                                tag=str(T.SyncTag(axis, T.Sync.GRAD, ch, mb, region)),
                                key=str(T.StepKey("grad", ch, what)), nbytes=nbytes, stream="comm",
                                action=c["action"][end], pos=float(c["pos"][end]) + 0.5, free=(name,))
                    for i in users:
                        out.edge(i, s, SAVED)
                    out.edge(s, optim[stage_of[ch]], SAVED)
                    made.setdefault(ch, []).append(s)
        return made


#: Region kinds whose backward ends in a column-parallel GEMM: a TP reduction of the input gradient follows
TP_BWD_KINDS = ("head", "mlp", "attn", "moe.route")
#: (phase, kind) of the compute nodes a TP all-reduce (1) or the loss-statistics all-gather (2) follows
_TP_AFTER = {**{("fwd", k): 1 for k in ("embed", "attn", "mlp", "moe.combine")}, ("fwd", "head"): 2,
             **{(ph, k): 1 for ph in ("bwd", "bwd_input") for k in TP_BWD_KINDS}}


def _divide(c: dict, nodes: np.ndarray, ways: int) -> None:
    """Divide the FLOPs (``/``) and parameter bytes (``//``) of ``nodes`` by ``ways``, as Python would."""
    idx = nodes.tolist()
    flops, params = c["flops"], c["params"]
    fl, pa = _take(flops, idx), _take(params, idx)
    if set(map(type, fl)) - {float} or set(map(type, pa)) - {int}:      # not plain floats and ints
        for i in idx:
            flops[i] /= ways
            params[i] //= ways
        return
    for col, vals in ((flops, (np.asarray(fl, np.float64) / ways).tolist()),
                      (params, (np.asarray(pa, np.int64) // ways).tolist())):
        for i, v in zip(idx, vals):
            col[i] = v


def _stampable(directives: Sequence) -> int:
    """How many leading directives :mod:`~parashift.ir.stamp` may apply: a ``Split(microbatches=m)``
    and the stampable directives right after it (0: none)."""
    if not directives or not isinstance(directives[0], Split) or not isinstance(directives[0].microbatches, int) \
            or directives[0].microbatches < 1:
        return 0
    k = 1
    while k < len(directives) and getattr(type(directives[k]), "stampable", False):
        k += 1
    return k


def apply_all(g: Graph, directives: Sequence, *, stamp: "bool | None" = None) -> Graph:
    """Apply directives in order (each returns a new graph; ``g`` is not changed). The graphs between
    two directives are scratch: the next directive rewrites them in place instead of copying.

    ``stamp``: apply a leading ``Split(microbatches=m)`` and the stampable directives after it for two
    micro-batches and stamp the result to m (see :mod:`parashift.ir.stamp`; the same graph, checked);
    None: where m is at least ``stamp.STAMP_FROM``."""
    first = g
    k = _stampable(directives) if stamp is not False else 0
    if k and (stamp or directives[0].microbatches >= _stamp.STAMP_FROM):
        out, k = _stamp.apply_stamped(g, directives[:k], directives[0].microbatches)
        if out is not None:
            g, directives = out, directives[k:]
    try:
        for d in directives:
            g._scratch = g is not first
            g = d.apply(g)
    finally:
        first._scratch = g._scratch = False
    return g
