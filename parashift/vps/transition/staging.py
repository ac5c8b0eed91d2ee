"""Memory-aware staging: split a switch into stages that fit every device's memory budget.

Memory is tracked per *state buffer*: a device's region of one tensor of one kind, old
(``old:<kind>:<tensor>``, the source layout) or new (``new:<kind>:<tensor>``). A buffer whose old
and new regions coincide is reused in place and never copied. Work is organized in *tasks*, one
per (tensor, kind): a task reads only the old buffers of its tensor and kind, writes its new
buffers, and needs staging space for what its devices send and receive. Tasks are taken in
order of how much they free where memory is tight; a stage takes tasks while every device stays
within its budget, counting everything a stage allocates as live at once (old buffers, new
buffers, staging); at the end of a stage its staging buffers and the old buffers of its
tasks are freed (garbage collection), and the next stage starts from what is left.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import MemoryBudgetError
from ..plan import SwitchPlan
from .transfers import ALIGN

__all__ = ["Buffers", "Staging", "state_buffers", "assign_stages", "budget_array", "stage_peaks", "check_fit"]


@dataclass(frozen=True, eq=False)
class Buffers:
    """Per (device, kind, tensor) state buffer: old/new bytes, whether it is reused in place."""

    dev: np.ndarray
    kind: np.ndarray
    tensor: np.ndarray
    old: np.ndarray
    new: np.ndarray
    reused: np.ndarray
    sent: np.ndarray       # staging bytes the device packs for this buffer's task
    received: np.ndarray   # staging bytes the device receives for it

    @property
    def task(self) -> np.ndarray:
        return self.tensor * 8 + self.kind


@dataclass(frozen=True, eq=False)
class Staging:
    """Stage of every piece and of every task (``tensor * 8 + kind``), and the buffers."""

    piece_stage: np.ndarray
    task_stage: dict
    stages: int
    buffers: Buffers


def _key(dev: np.ndarray, kind: np.ndarray, tensor: np.ndarray, n_t: int) -> np.ndarray:
    return (dev.astype(np.int64) * 8 + kind) * n_t + tensor


def state_buffers(plan: SwitchPlan) -> Buffers:
    """Old/new bytes, reuse and staging bytes of every (device, kind, tensor) the switch touches."""
    n_t = plan.src_layout.table.count
    parts = []
    for lay, devs in ((plan.src_layout, plan.src_devices), (plan.dst_layout, plan.dst_devices)):
        reg = lay.regions(kinds=plan.kinds)
        kmap = np.array([plan.kinds.index(k) if k in plan.kinds else 0 for k in lay.kinds])
        k = kmap[reg.kind]
        kb = np.array([plan.model.kind_bytes(x) for x in plan.kinds])[k]
        parts.append((_key(np.asarray(devs)[reg.rank], k, reg.tensor, n_t), reg.numel * kb))
    kept = ~plan.moved
    sent = plan.moved
    keys = [parts[0][0], parts[1][0], _key(plan.dst[kept], plan.kind[kept], plan.tensor[kept], n_t),
            _key(plan.src[sent], plan.kind[sent], plan.tensor[sent], n_t),
            _key(plan.dst[sent], plan.kind[sent], plan.tensor[sent], n_t)]
    wire = -(-plan.nbytes[sent] // ALIGN) * ALIGN          # staging buffers hold aligned pieces
    vals = [parts[0][1], parts[1][1], plan.nbytes[kept], wire, wire]
    uniq, inv = np.unique(np.concatenate(keys), return_inverse=True)
    cols = []
    start = 0
    for k, v in zip(keys, vals):
        cols.append(np.bincount(inv[start:start + len(k)], weights=v, minlength=len(uniq)).astype(np.int64))
        start += len(k)
    old, new, keep, out, inn = cols
    tensor = uniq % n_t
    rest = uniq // n_t
    return Buffers(dev=rest // 8, kind=rest % 8, tensor=tensor, old=old, new=new,
                   reused=(old == new) & (keep == new) & (new > 0), sent=out, received=inn)


def budget_array(budget: "int | float | dict | np.ndarray | None", n_dev: int) -> np.ndarray | None:
    """Per-device budget in bytes (a number for all devices, or a device -> bytes mapping)."""
    if budget is None:
        return None
    if isinstance(budget, dict):
        out = np.full(n_dev, np.inf)
        for d, b in budget.items():
            if 0 <= int(d) < n_dev:
                out[int(d)] = float(b)
        return out
    arr = np.asarray(budget, dtype=float)
    if arr.ndim == 0:
        if arr <= 0:
            raise MemoryBudgetError(f"memory budget {float(arr):.0f} must be positive (bytes per device)")
        return np.full(n_dev, float(arr))
    out = np.full(n_dev, np.inf)
    out[:len(arr)] = arr[:n_dev]
    return out


def _size(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def assign_stages(plan: SwitchPlan, budget: np.ndarray | None, buffers: Buffers | None = None) -> Staging:
    """Stage of every piece: one stage without a budget, else the fewest greedy stages that fit.

    Raises MemoryBudgetError, before anything moves, when the old or the new layout alone, or
    one task on its own, does not fit a device's budget; the message says by how much.
    """
    buf = buffers if buffers is not None else state_buffers(plan)
    n_dev = int(max(buf.dev.max(initial=0), 0)) + 1
    task = buf.task
    tasks = np.unique(task)
    if budget is None:
        return Staging(np.zeros(len(plan), dtype=np.int64), {int(t): 0 for t in tasks}, 1, buf)
    budget = budget[:n_dev] if len(budget) >= n_dev else np.concatenate([budget, np.full(n_dev - len(budget), np.inf)])
    old_total = np.bincount(buf.dev, weights=buf.old, minlength=n_dev)
    new_total = np.bincount(buf.dev, weights=buf.new, minlength=n_dev)
    for what, total in (("new", new_total), ("current", old_total)):
        over = total - budget
        d = int(np.argmax(over))
        if over[d] > 0:
            raise MemoryBudgetError(
                f"the {what} layout needs {_size(total[d])} of state on device {d}, {_size(over[d])} more than its "
                f"budget of {_size(budget[d])}; raise the budget by at least {int(np.ceil(over[d]))} bytes"
                + (" or pick a strategy that shards more (larger tp/pp, higher zero)" if what == "new" else ""))
    # per task: what each device allocates (new buffers + staging) and frees at the end of the stage
    alloc = (np.where(buf.reused, 0, buf.new) + buf.sent + buf.received).astype(float)
    free = (np.where(buf.reused, 0, buf.old) + buf.sent + buf.received).astype(float)
    order = np.lexsort((buf.dev, task))
    t_sorted = task[order]
    bounds = np.append(np.searchsorted(t_sorted, tasks), len(order))
    rows = [order[bounds[j]:bounds[j + 1]] for j in range(len(tasks))]
    cur = old_total.astype(float)
    task_stage: dict[int, int] = {}
    remaining = list(range(len(tasks)))
    stage = 0
    while remaining:
        # tasks that free memory where memory is tight go first (ties: model order)
        pressure = cur / budget
        gain = [float(((free[r] - alloc[r]) * pressure[buf.dev[r]]).sum()) for r in (rows[j] for j in remaining)]
        todo = [remaining[i] for i in sorted(range(len(remaining)), key=lambda i: (-gain[i], remaining[i]))]
        add = np.zeros(n_dev)
        rel = np.zeros(n_dev)
        left = []
        for j in todo:
            r = rows[j]
            d = buf.dev[r]
            if np.any(cur[d] + add[d] + alloc[r] > budget[d]):
                left.append(j)
                continue
            np.add.at(add, d, alloc[r])
            np.add.at(rel, d, free[r])
            task_stage[int(tasks[j])] = stage
        if len(left) == len(remaining):
            over = [(float((cur[buf.dev[rows[j]]] + alloc[rows[j]] - budget[buf.dev[rows[j]]]).max()), j) for j in left]
            amount, j = min(over)
            r = rows[j]
            k = int(np.argmax(cur[buf.dev[r]] + alloc[r] - budget[buf.dev[r]]))
            dev = int(buf.dev[r][k])
            t = int(tasks[j])
            names = plan.src_layout.table.names
            raise MemoryBudgetError(
                f"no order of the switch fits: moving {names[t // 8]} ({plan.kinds[t % 8]}) needs "
                f"{_size(cur[dev] + alloc[r][k])} at once on device {dev}, {_size(amount)} over its budget of "
                f"{_size(budget[dev])}; raise the budget by at least {int(np.ceil(amount))} bytes")
        cur += add - rel
        remaining = sorted(left)
        stage += 1
    stage -= 1
    piece_task = plan.tensor * 8 + plan.kind
    lookup = np.array([task_stage.get(int(t), 0) for t in range(int(piece_task.max(initial=0)) + 1)])
    return Staging(lookup[piece_task] if len(plan) else np.zeros(0, dtype=np.int64), task_stage, stage + 1, buf)


def stage_peaks(st: Staging) -> np.ndarray:
    """Per-device peak bytes of ``st``'s switch as :func:`assign_stages` counts them: the state left
    by the earlier stages plus everything a stage allocates (new buffers, staging), all live at once."""
    buf = st.buffers
    n_dev = int(max(buf.dev.max(initial=0), 0)) + 1
    alloc = (np.where(buf.reused, 0, buf.new) + buf.sent + buf.received).astype(float)
    free = (np.where(buf.reused, 0, buf.old) + buf.sent + buf.received).astype(float)
    stage = np.array([st.task_stage.get(int(t), 0) for t in buf.task], dtype=np.int64)
    cur = np.bincount(buf.dev, weights=buf.old, minlength=n_dev).astype(float)
    peak = cur.copy()
    for k in range(st.stages):
        m = stage == k
        peak = np.maximum(peak, cur + np.bincount(buf.dev[m], weights=alloc[m], minlength=n_dev))
        cur += np.bincount(buf.dev[m], weights=alloc[m] - free[m], minlength=n_dev)
    return peak


def check_fit(plan: SwitchPlan, device_memory: float, budget=None) -> dict:
    """Whether ``plan``'s switch fits ``device_memory`` bytes per device: staged under ``budget``
    when given, else in one stage when that fits and otherwise staged under ``device_memory``.

    Returns ``fits``, ``peak_bytes`` (the largest per-device peak; the one-stage peak when no
    staging fits), ``peak_device``, ``device_memory``, ``memory_budget`` (the staging budget used,
    None for one stage), ``budget_auto``, ``stages`` and, when it does not fit, ``problem``.
    """
    buf = state_buffers(plan)
    one = stage_peaks(assign_stages(plan, None, buf))
    auto = budget is None
    use = None if auto and float(one.max(initial=0)) <= device_memory else (device_memory if auto else budget)
    shown = None if use is None else int(use) if np.ndim(use) == 0 and not isinstance(use, dict) else "per-device"
    out = {"device_memory": int(device_memory), "memory_budget": shown, "budget_auto": auto}
    try:
        st = assign_stages(plan, budget_array(use, len(one)), buf)
    except MemoryBudgetError as e:
        d = int(np.argmax(one))
        return {**out, "fits": False, "peak_bytes": int(one[d]), "peak_device": d, "stages": None,
                "problem": str(e)}
    peak = stage_peaks(st)
    d = int(np.argmax(peak))
    fits = bool(peak[d] <= device_memory)
    res = {**out, "fits": fits, "peak_bytes": int(peak[d]), "peak_device": d, "stages": st.stages}
    if not fits:
        res["problem"] = (f"the switch needs {_size(peak[d])} on device {d}, {_size(peak[d] - device_memory)} more "
                          f"than its {_size(device_memory)} of memory; lower or drop --switch-memory-budget")
    return res
