"""From timelines (measured or simulated) to calibration samples: what each instruction cost.

A timeline row is one executed instruction; joined with the Program it came from (on
``(rank, id)``) it gains the region, the resolved group or peer and the tag. Three tables come out:

- compute: one row per compute instruction; its cost is ``end - ready``, where ``ready`` is when
  the rank's stream predecessor and the instruction's deps had finished (the simulator starts an
  instruction exactly then, so a dispatch gap in a measured run is charged to the instruction, as
  the cost model's per-region overheads intend);
- comm: one row per executed transfer: a collective instance (every member's row, matched by
  tag and group) costs ``min(end) - max(start)`` (from the last member's arrival to the first
  completion, so waiting for peers is not counted; but see ``jitter`` in :func:`extract`), a
  send/recv pair ``recv end - max(starts)``,
  a local copy its duration;
- steps: one row per timeline and step, its wall time ``max(end) - min(start)``.

Timelines of several steps either carry a ``step`` column or repeat each ``(rank, id)`` once per
step in time order. Times must share one clock across ranks (the simulator's do; a runtime
rebases every rank's times to a common origin).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import pandas as pd

from ..errors import ParashiftError
from ..cost import link_class, topology
from ..traces.timeline import check_timeline

if TYPE_CHECKING:  # pragma: no cover
    from ..cluster import Cluster
    from ..ir.program import Program

__all__ = ["CalibrationError", "Samples", "extract", "extract_normalized", "normalize_inputs", "align_clocks"]

_MIN_SECONDS = 1e-9  # a cost at or below this is a clock artifact, not a sample


class CalibrationError(ParashiftError, ValueError):
    """Calibration input that cannot be fitted (no samples, mismatched programs, bad timelines)."""


@dataclass(frozen=True)
class Samples:
    """Calibration samples of one or more timelines (see the module docstring).

    ``compute``: source, step, rank, id, phase, region, flops, nbytes, state_bytes, measured.
    ``comm``: source, step, op, kind, nbytes, link, topo, members, measured (``kind``: the op, or
    ``p2p`` for a send/recv pair). ``steps``: source, step, measured. ``dropped``: rows or
    instances left out and why (incomplete collective, non-positive cost, no program).
    """

    compute: pd.DataFrame
    comm: pd.DataFrame
    steps: pd.DataFrame
    dropped: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.compute) + len(self.comm)


def normalize_inputs(timelines: "pd.DataFrame | Sequence[pd.DataFrame]",
                     programs: "Program | Sequence[Program | None] | None") -> tuple[list, list]:
    """Timelines as a checked list, programs as a list of the same length (None where unknown)."""
    from ..ir.program import Program
    tls = [timelines] if isinstance(timelines, pd.DataFrame) else list(timelines)
    if not tls:
        raise CalibrationError("no timelines given; pass the profiler's (or simulator's) timeline DataFrames")
    if programs is None or isinstance(programs, Program):
        progs = [programs] * len(tls)
    else:
        progs = list(programs)
        if len(progs) != len(tls):
            raise CalibrationError(f"{len(progs)} programs for {len(tls)} timelines; give one Program per "
                                   f"timeline (the one that ran), or one Program for all")
    out = []
    for k, df in enumerate(tls):
        tl = check_timeline(df, f"timeline {k}")
        if "rank" not in tl:
            tl["rank"] = tl["device"]
        if "step" not in tl:
            tl = tl.sort_values("start", kind="stable")
            tl["step"] = tl.groupby(["rank", "id"], sort=False).cumcount()
            tl = tl.sort_index()
        tl["step"] = pd.to_numeric(tl["step"]).astype(np.int64)
        if len(tl) and progs[k] is not None:
            unknown = sorted(set(int(r) for r in tl["rank"].unique()) - set(progs[k].ranks))
            if unknown:
                raise CalibrationError(f"timeline {k} has ranks {unknown[:8]} that its Program lacks; pass the "
                                       f"Program that produced this timeline")
        out.append(tl)
    return out, progs


def _instr_table(program: "Program", ranks: Sequence[int]) -> pd.DataFrame:
    """rank, id -> region, deps, tag, group/peer (resolved), static bytes; one row per instruction."""
    rows = []
    for r in ranks:
        rp = program.ranks[int(r)]
        state = float(sum(rp.static_memory.values()))
        cls = id(rp)
        for ins in rp.instrs():
            if ins.group is not None:
                who = tuple(sorted(program.resolve_group(int(r), ins)))
            elif ins.op in ("send", "recv"):
                who = (program.resolve_peer(int(r), ins),)
            else:
                who = ()
            rows.append((int(r), ins.id, ins.region, ins.deps, ins.tag, who, state, cls))
    return pd.DataFrame(rows, columns=["rank", "id", "region", "deps", "tag", "who", "state_bytes", "cls"])


def _ready(tl: pd.DataFrame) -> np.ndarray:
    """When each row could start: its stream predecessor's and its deps' latest end (else its start)."""
    order = tl.sort_values(["step", "rank", "stream", "start", "end"], kind="stable")
    prev = order.groupby(["step", "rank", "stream"], sort=False)["end"].shift(1)
    ready = pd.Series(prev, index=order.index).reindex(tl.index).to_numpy(dtype=float, copy=True)
    deps = tl[["step", "rank", "deps"]].reset_index(names="row").explode("deps").dropna(subset=["deps"])
    if len(deps):
        deps["id"] = deps["deps"].astype(np.int64)
        ends = tl[["step", "rank", "id", "end"]]
        got = deps.merge(ends, on=["step", "rank", "id"], how="inner").groupby("row")["end"].max()
        idx = got.index.to_numpy()
        ready[idx] = np.fmax(ready[idx], got.to_numpy())
    start = tl["start"].to_numpy(dtype=float)
    return np.where(np.isfinite(ready), np.minimum(ready, start), start)


_SYMMETRIC = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
_ALIGN_MIN = 5  # shared collectives at which a pair of ranks' offset estimate gets full weight


def align_clocks(tl: pd.DataFrame) -> pd.DataFrame:
    """Remove each rank's clock offset, per step (measured ranks share a clock only to within
    their step barrier's skew, or not at all across machines).

    Collectives first: every member of an all-reduce, all-gather, reduce-scatter or all-to-all
    completes at nearly the same moment, so the end times of ranks that share collectives give
    their offset difference (see :func:`_collective_offsets`). Then send/recv between the sets
    of ranks the collectives connect: the fastest message each way bounds the offset from both
    sides, and the midpoint is taken (as NTP does). Needs the ``tag`` and ``who`` columns of a
    timeline joined with its Program.
    """
    ranks = np.unique(tl["rank"].to_numpy())
    col = np.searchsorted(ranks, tl["rank"].to_numpy())
    steps = tl["step"].to_numpy()
    coll = (tl["op"].isin(_SYMMETRIC) & (tl["who"].map(len) > 1)).to_numpy()
    inst = np.zeros(len(tl), dtype=np.int64)
    if coll.any():  # one code per collective instance of a step: (tag, group)
        tag_code = pd.factorize(tl["tag"].astype(str))[0]
        who_code = pd.factorize(tl["who"].map(str))[0]
        inst = tag_code * (who_code.max() + 1) + who_code
    pairs = _p2p_pairs(tl, col)
    ends = tl["end"].to_numpy(dtype=float)
    shift = np.zeros(len(tl))
    for step in np.unique(steps):
        sel = steps == step
        cs = sel & coll
        off, comp = _collective_offsets(inst[cs], col[cs], ends[cs], len(ranks))
        if pairs is not None:
            ps = pairs[pairs[:, 0] == step]
            off = off + _p2p_offsets(ps[:, 1].astype(np.int64), ps[:, 2].astype(np.int64),
                                     ps[:, 3] - off[ps[:, 2].astype(np.int64)]
                                     - (ps[:, 4] - off[ps[:, 1].astype(np.int64)]), comp)
        shift[sel] = off[col[sel]]
    return tl.assign(start=tl["start"] - shift, end=tl["end"] - shift)


def _collective_offsets(inst: np.ndarray, col: np.ndarray, ends: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets of ``n`` ranks from the ends of symmetric collectives (instance code, rank column,
    end time per row), and the label of the set of ranks each is connected to.

    Each pair of ranks that share collectives gives the median difference of their end times
    (robust to late completion records); a weighted least-squares over those pairs (weight: the
    number of shared instances, capped) gives the offsets, centered within each connected set.
    """
    off, comp = np.zeros(n), np.arange(n)
    if not len(inst):
        return off, comp
    codes, row = np.unique(inst, return_inverse=True)
    E = np.full((len(codes), n), np.nan)
    E[row, col] = ends
    have = np.isfinite(E)
    rows, rhs, wts = [], [], []
    for i in range(n):
        for j in range(i + 1, n):
            both = have[:, i] & have[:, j]
            if both.any():
                r = np.zeros(n)
                r[i], r[j] = 1.0, -1.0
                rows.append(r)
                rhs.append(float(np.median(E[both, i] - E[both, j])))
                wts.append(np.sqrt(min(int(both.sum()), _ALIGN_MIN)))
                comp[comp == comp[j]] = comp[i]
    if not rows:
        return off, comp
    for lab in np.unique(comp):
        rows.append((comp == lab).astype(float))
        rhs.append(0.0)
        wts.append(1.0)
    w = np.array(wts)
    off = np.linalg.lstsq(np.vstack(rows) * w[:, None], np.array(rhs) * w, rcond=None)[0]
    return off, comp


def _p2p_pairs(tl: pd.DataFrame, col: np.ndarray) -> "np.ndarray | None":
    """Matched send/recv pairs as rows (step, src column, dst column, recv end, send start)."""
    is_p2p = tl["op"].isin(("send", "recv")).to_numpy()
    if not is_p2p.any():
        return None
    p = tl[is_p2p]
    peer = p["who"].map(lambda w: w[0] if w else -1).to_numpy()
    is_send = (p["op"] == "send").to_numpy()
    p = p.assign(src=np.where(is_send, p["rank"], peer), dst=np.where(is_send, peer, p["rank"]), col=col[is_p2p])
    m = p[is_send].merge(p[~is_send], on=["step", "tag", "src", "dst"], suffixes=("_s", "_r"))
    return np.column_stack([m["step"], m["col_s"], m["col_r"], m["end_r"], m["start_s"]]).astype(float)


def _p2p_offsets(src: np.ndarray, dst: np.ndarray, delay: np.ndarray, comp: np.ndarray) -> np.ndarray:
    """Offsets between the rank sets ``comp`` from send/recv pairs: ``delay`` is recv end minus
    send start (clocks as corrected so far); the fastest message each way bounds the offset."""
    n = len(comp)
    ca, cb = comp[src], comp[dst]
    cross = ca != cb
    if not cross.any():
        return np.zeros(n)
    d = pd.Series(delay[cross]).groupby([ca[cross], cb[cross]]).min()
    labels = np.unique(comp)
    where = {lab: i for i, lab in enumerate(labels)}
    rows, rhs = [], []
    for (a, b), mab in d.items():
        if a < b and (b, a) in d.index:
            r = np.zeros(len(labels))
            r[where[b]], r[where[a]] = 1.0, -1.0
            rows.append(r)
            rhs.append((mab - d[(b, a)]) / 2)
    if not rows:
        return np.zeros(n)
    A = np.vstack(rows + [np.ones(len(labels))])
    delta = np.linalg.lstsq(A, np.array(rhs + [0.0]), rcond=None)[0]
    return delta[[where[c] for c in comp]]


def _collectives(tl: pd.DataFrame, cluster: "Cluster", jitter: bool) -> tuple[pd.DataFrame, int]:
    coll = tl[tl["who"].map(len) > 1]
    if not len(coll):
        return pd.DataFrame(), 0
    g = coll.groupby(["step", "tag", "who"], sort=False)
    agg = g.agg(op=("op", "first"), nbytes=("nbytes", "first"), first_end=("end", "min"),
                last_start=("start", "max"), mean_start=("start", "mean"), mean_end=("end", "mean"),
                n=("rank", "nunique"), classes=("cls", "nunique"), stream=("stream", "first"))
    agg = agg.reset_index()
    full = agg["n"].to_numpy() == agg["who"].map(len).to_numpy()
    dev = dict(zip(tl["rank"], tl["device"]))
    agg = agg[full]
    topo = [topology(cluster, [dev[m] for m in who]) for who in agg["who"]]
    arrive, finish = agg["last_start"], agg["first_end"]
    if jitter:  # members running the same program: the simulator sees no straggler, so charge it here
        arrive = arrive.where(agg["classes"] > 1, agg["mean_start"])
        finish = finish.where((agg["classes"] > 1) | (agg["stream"] != "compute"), agg["mean_end"])
    out = pd.DataFrame({"step": agg["step"].to_numpy(), "op": agg["op"].to_numpy(), "kind": agg["op"].to_numpy(),
                        "nbytes": agg["nbytes"].to_numpy(dtype=np.int64), "link": None, "topo": topo,
                        "members": agg["who"].map(len).to_numpy(),
                        "measured": (finish - arrive).to_numpy(dtype=float)})
    return out, int((~full).sum())


def _p2p(tl: pd.DataFrame, cluster: "Cluster") -> tuple[pd.DataFrame, int]:
    p = tl[tl["op"].isin(("send", "recv"))]
    if not len(p):
        return pd.DataFrame(), 0
    peer = p["who"].map(lambda w: w[0]).to_numpy()
    is_send = (p["op"] == "send").to_numpy()
    p = p.assign(src=np.where(is_send, p["rank"], peer), dst=np.where(is_send, peer, p["rank"]))
    sends, recvs = p[is_send], p[~is_send]
    pairs = sends.merge(recvs, on=["step", "tag", "src", "dst"], suffixes=("_s", "_r"))
    unmatched = len(p) - 2 * len(pairs)
    dev = dict(zip(tl["rank"], tl["device"]))
    links = [link_class(cluster, dev[a], dev[b]) for a, b in zip(pairs["src"], pairs["dst"])]
    meas = pairs["end_r"].to_numpy(dtype=float) - np.maximum(pairs["start_s"].to_numpy(dtype=float),
                                                              pairs["start_r"].to_numpy(dtype=float))
    out = pd.DataFrame({"step": pairs["step"].to_numpy(), "op": "send", "kind": "p2p",
                        "nbytes": pairs["nbytes_s"].to_numpy(dtype=np.int64), "link": links, "topo": None,
                        "members": 2, "measured": meas})
    return out, unmatched


def extract(timelines: "pd.DataFrame | Sequence[pd.DataFrame]", cluster: "Cluster | str",
            programs: "Program | Sequence[Program | None] | None" = None, *, align: bool = True,
            jitter: bool = True) -> Samples:
    """Calibration samples of ``timelines``; ``programs[k]`` is the Program timeline k ran.

    ``align``: first remove per-rank clock offsets (see :func:`align_clocks`); measured ranks
    share a clock only to within their step barrier's skew.
    ``jitter``: a collective whose members all run the same RankProgram (TP/DP peers) costs from
    their mean arrival, so the early members' wait is included: the simulator runs such peers in
    lockstep while real ones drift, a cost the fitted model should carry. On the ``compute``
    stream, where a rank blocks on it, it lasts until the mean member noticed completion; on
    side streams until the first did (the others' notice waits for their current compute).

    Without a Program a timeline yields compute samples whose region is unknown (counted as one
    layer) and no communication samples.
    """
    from ..cluster import get as get_cluster
    tls, progs = normalize_inputs(timelines, programs)
    return extract_normalized(tls, progs, get_cluster(cluster), align, jitter)


def extract_normalized(tls: list[pd.DataFrame], progs: list, cluster: "Cluster", align: bool = True,
                       jitter: bool = True) -> Samples:
    """:func:`extract` of inputs already through :func:`normalize_inputs`."""
    comp, comm, steps = [], [], []
    dropped = {"incomplete_collective": 0, "unmatched_p2p": 0, "nonpositive": 0, "comm_without_program": 0}
    for k, (tl, prog) in enumerate(zip(tls, progs)):
        if not len(tl):
            continue
        span = tl.groupby("step").agg(first=("start", "min"), last=("end", "max"))
        steps.append(pd.DataFrame({"source": k, "step": span.index.to_numpy(),
                                   "measured": (span["last"] - span["first"]).to_numpy(dtype=float)}))
        if prog is not None:
            info = _instr_table(prog, sorted(tl["rank"].unique()))
            tl = tl.merge(info, on=["rank", "id"], how="left", validate="many_to_one", indicator=True)
            missing = (tl.pop("_merge") != "both").to_numpy()
            if missing.any():
                row = tl[missing].iloc[0]
                raise CalibrationError(f"timeline {k}: rank {row['rank']} ran instruction {row['id']} that its "
                                       f"Program lacks; pass the Program that produced this timeline")
            tl["deps"] = tl["deps"].map(lambda d: d if isinstance(d, tuple) else ())
            tl["who"] = tl["who"].map(lambda w: w if isinstance(w, tuple) else ())
        else:
            tl = tl.assign(region=None, deps=[()] * len(tl), tag=None, who=[()] * len(tl), state_bytes=0.0, cls=0)
        c = tl[tl["op"] == "compute"]
        ready = _ready(tl)[tl["op"].to_numpy() == "compute"]
        comp.append(pd.DataFrame({"source": k, "step": c["step"].to_numpy(), "rank": c["rank"].to_numpy(),
                                  "id": c["id"].to_numpy(), "phase": c["phase"].fillna("fwd").to_numpy(),
                                  "region": c["region"].to_numpy(), "flops": c["flops"].to_numpy(dtype=float),
                                  "nbytes": c["nbytes"].to_numpy(dtype=np.int64),
                                  "state_bytes": c["state_bytes"].to_numpy(dtype=float),
                                  "measured": c["end"].to_numpy(dtype=float) - ready}))
        if prog is None:
            dropped["comm_without_program"] += int((tl["op"] != "compute").sum())
            continue
        if align:
            tl = align_clocks(tl)
        co, bad = _collectives(tl, cluster, jitter)
        dropped["incomplete_collective"] += bad
        pp, bad = _p2p(tl, cluster)
        dropped["unmatched_p2p"] += bad
        cp = tl[tl["op"] == "copy"]
        cps = pd.DataFrame({"step": cp["step"].to_numpy(), "op": "copy", "kind": "copy",
                            "nbytes": cp["nbytes"].to_numpy(dtype=np.int64), "link": "local", "topo": None,
                            "members": 1, "measured": (cp["end"] - cp["start"]).to_numpy(dtype=float)})
        for part in (co, pp, cps):
            if len(part):
                comm.append(part.assign(source=k))
    compute = _concat(comp, ["source", "step", "rank", "id", "phase", "region", "flops", "nbytes", "state_bytes",
                             "measured"])
    comms = _concat(comm, ["source", "step", "op", "kind", "nbytes", "link", "topo", "members", "measured"])
    good_c, good_m = compute["measured"] > _MIN_SECONDS, comms["measured"] > _MIN_SECONDS
    dropped["nonpositive"] = int((~good_c).sum() + (~good_m).sum())
    return Samples(compute[good_c].reset_index(drop=True), comms[good_m].reset_index(drop=True),
                   _concat(steps, ["source", "step", "measured"]), dropped)


def _concat(parts: list, columns: list[str]) -> pd.DataFrame:
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    return pd.concat(parts, ignore_index=True)[columns]
