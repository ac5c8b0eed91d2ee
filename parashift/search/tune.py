"""Strategy search with Optuna's ask/tell interface.

Each trial draws a point of the :class:`~parashift.search.space.Space`. A point that is not a
valid strategy is told ``PRUNED`` with its reason and never scored. A valid point is scored by
the evaluator (cached by strategy string, so a resumed study or a repeated point costs
nothing); a strategy that does not fit in memory is *infeasible*: it carries an Optuna
constraint (the relative memory overflow), so TPE learns to avoid it, and it never becomes the
best. With ``objective=("throughput", "memory")`` the study has two directions (tokens/s up,
peak memory down) and the result holds the Pareto front.

Every trial records ``strategy``, ``status`` (ok / infeasible / invalid), ``reason`` and the
simulated figures as Optuna user attributes, so a study in RDB storage can be inspected with
Optuna's own tools and resumed (the cache is rebuilt from it).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..cluster import Cluster, get as get_cluster
from ..errors import ParashiftError
from ..models import ModelSpec, get as get_model
from .evaluate import CachedEvaluator, Evaluator, Outcome, SimEvaluator
from .result import Candidate, SearchResult, rank_key
from .space import Space, canonical, make_space, neighbor, params_of

if TYPE_CHECKING:  # pragma: no cover
    import optuna

__all__ = ["tune", "SearchError", "OBJECTIVES"]

#: objective name -> (Optuna direction, outcome field)
OBJECTIVES = {"throughput": ("maximize", "tokens_per_s"), "memory": ("minimize", "peak_memory")}
_ATTRS = ("step_time", "tokens_per_s", "peak_memory", "mfu", "bubble_fraction", "memory_budget", "compute",
          "exposed_comm", "bubble")
#: axes the last trials vary on the leaders, to find lighter strategies (and break ties by memory)
_POLISH_AXES = ("zero", "recompute", "mbs")
#: share of the trials kept for that sweep, and how many leaders it varies
_POLISH_SHARE, _POLISH_LEADERS = 0.2, 5


class SearchError(ParashiftError, ValueError):
    """A search that cannot run as asked (bad objective or sampler, a study of other settings)."""


def tune(model: "str | ModelSpec", cluster: "str | Cluster", *, devices: int, global_batch: int, seq_len: int,
         n_trials: int, objective: "str | Sequence[str]" = "throughput", storage: "str | Any | None" = None,
         seed: int | None = None, cost_model: Any = None, study_name: str | None = None,
         sampler: "str | optuna.samplers.BaseSampler" = "tpe", space: Space | None = None,
         space_options: "dict[str, Any] | None" = None,
         evaluate: Evaluator | None = None, cache: "dict[str, Outcome] | None" = None,
         prune_dominated: bool = True, local_search: bool = True, all_devices: bool = False,
         progress: "Callable[[int, int, Candidate | None], None] | None" = None) -> SearchResult:
    """Search the strategies of ``model`` on ``devices`` devices of ``cluster`` for ``n_trials`` trials.

    ``objective``: ``"throughput"`` (tokens/s, the default) or ``("throughput", "memory")`` for
    the Pareto front of tokens/s against peak memory. ``storage``: an Optuna storage or RDB URL
    (``"sqlite:///s.db"``); with ``study_name`` an existing study of the same setting is resumed
    and ``n_trials`` more trials run. ``sampler``: ``"tpe"`` (default), ``"random"`` or an Optuna
    sampler. ``space`` (or ``space_options``, the axes of :func:`make_space`) restricts the
    strategies. ``evaluate``: a ``Strategy -> Outcome`` callable replacing the simulator;
    ``cache``: a dict shared between searches of the same setting. ``prune_dominated``: with the
    throughput objective, a strategy whose tokens/s upper bound (the evaluator's
    ``throughput_bound``) is below the best found so far is pruned unscored (status
    ``dominated``); this never loses the optimum. ``local_search``: after the first 30% of the
    trials, every other trial probes an unvisited neighbor of the incumbent (one axis changed,
    or two of tp/pp/dp traded) that could still beat it, highest upper bound first, through
    ``study.enqueue_trial``; the sampler drives the rest; the last trials (up to 20%) score
    unvisited ZeRO, recomputation and micro-batch variants of the five best strategies, so that
    ties are broken by memory and the Pareto front has lighter points. ``all_devices``: only strategies that use every device (default: any device
    count up to ``devices``, idle devices reported). The best strategy is the fastest, ties
    (tokens/s within 1e-6) broken by peak memory then simplicity (:func:`.result.rank_key`).
    ``progress(done, total, best)`` is called after each trial.
    """
    import optuna

    m, c = get_model(model), get_cluster(cluster)
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 0:
        raise SearchError(f"n_trials={n_trials!r} must be a non-negative integer")
    objectives = _objectives(objective)
    space = space or make_space(m, c, devices=devices, global_batch=global_batch, seq_len=seq_len,
                                **{"all_devices": all_devices, **(space_options or {})})
    if (space.model.name, space.devices, space.global_batch, space.seq_len) != (m.name, devices, global_batch,
                                                                                 seq_len):
        raise SearchError(f"the space is for {space.model.name} on {space.devices} devices with global batch "
                          f"{space.global_batch} x {space.seq_len} tokens, not {m.name} on {devices} with "
                          f"{global_batch} x {seq_len}; build it with search.make_space for the same setting")
    base = evaluate or SimEvaluator(m, c, global_batch=global_batch, seq_len=seq_len, cost_model=cost_model)
    ev = CachedEvaluator(base, cache)
    use_constraint = hasattr(optuna.trial.Trial, "set_constraint")
    study = _open_study(optuna, storage, study_name, objectives, _sampler(optuna, sampler, seed, use_constraint),
                        space)
    for ft in study.get_trials(deepcopy=False):  # a resumed study: nothing is scored twice
        key, out = ft.user_attrs.get("strategy"), _outcome_of(ft)
        if key and out is not None:
            ev.cache.setdefault(key, out)

    bound = getattr(base, "throughput_bound", None) if prune_dominated else None
    t0 = time.perf_counter()
    best = _incumbent(study)  # a resumed study's best (never a shared cache's: that would leak)
    visited = {ft.user_attrs["strategy"] for ft in study.get_trials(deepcopy=False) if ft.user_attrs.get("strategy")}
    local_from = max(10, int(0.3 * n_trials)) if local_search else n_trials
    polish_from = n_trials - int(_POLISH_SHARE * n_trials) if local_search else n_trials
    leaders: list[Candidate] = [] if best is None else [best]
    with _quiet(optuna):
        for i in range(n_trials):
            polish = _polish(space, leaders, visited, getattr(base, "could_fit", None)) \
                if i >= polish_from else None
            if polish is not None:
                study.enqueue_trial(polish, skip_if_exists=False)
            elif i >= local_from and i % 2 and best is not None:
                move = neighbor(space, best.strategy, visited, getattr(base, "throughput_bound", None),
                                getattr(base, "could_fit", None), best.tokens_per_s)
                if move is not None:
                    study.enqueue_trial(move, skip_if_exists=False)
            trial = study.ask()
            strat, reason = space.build(space.suggest(trial))
            if strat is not None:
                visited.add(str(strat))
            if strat is None:
                _tell_invalid(optuna, study, trial, reason)
            elif bound is not None and best is not None and (ub := float(bound(strat))) < best.tokens_per_s:
                _tell_invalid(optuna, study, trial, f"cannot beat the best so far: at most {ub:,.0f} tokens/s "
                              f"< {best.tokens_per_s:,.0f}", str(strat), status="dominated")
            else:
                out, cached = ev(strat)
                _tell(optuna, study, trial, strat, out, cached, objectives, use_constraint)
                cand = Candidate.from_outcome(strat, out)
                if out.ok and (best is None or rank_key(cand) < rank_key(best)):
                    best = cand
                if out.ok and not cached:
                    leaders = sorted(leaders + [cand], key=rank_key)[:_POLISH_LEADERS]
            if progress is not None:
                progress(i + 1, n_trials, best)
    seconds = time.perf_counter() - t0
    return SearchResult.from_study(study, model=m, cluster=c, devices=devices, global_batch=global_batch,
                                   seq_len=seq_len, objective=objectives, cost_model=cost_model, evaluator=ev,
                                   search_seconds=seconds, evaluations=ev.calls)


def _polish(space: Space, leaders: "list[Candidate]", visited: "set[str]",
            could_fit: Any) -> "dict[str, Any] | None":
    """An unvisited point of ``space`` that differs from a leader on one of :data:`_POLISH_AXES`."""
    for lead in leaders:
        for axis in _POLISH_AXES:
            for v in getattr(space, axis):
                try:
                    m = canonical(lead.strategy.replace(**{axis: v}))
                except ParashiftError:
                    continue
                if str(m) in visited or space.problems(m) or (could_fit is not None and not could_fit(m)):
                    continue
                p = params_of(space, m)
                if p is not None and space.build(p)[0] == m:
                    return p
    return None


# ---- telling Optuna ---------------------------------------------------------------------------------
def _incumbent(study: "optuna.Study") -> Candidate | None:
    """The best feasible strategy among the study's finished trials."""
    from ..strategy import Strategy
    best: Candidate | None = None
    for ft in study.get_trials(deepcopy=False):
        out = _outcome_of(ft)
        if out is not None and out.ok:
            cand = Candidate.from_outcome(Strategy.parse(ft.user_attrs["strategy"]), out)
            if best is None or rank_key(cand) < rank_key(best):
                best = cand
    return best


def _tell_invalid(optuna: Any, study: "optuna.Study", trial: "optuna.trial.Trial", reason: str,
                  strategy: str | None = None, status: str = "invalid") -> None:
    trial.set_user_attr("status", status)
    trial.set_user_attr("reason", reason)
    if strategy:
        trial.set_user_attr("strategy", strategy)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)


def _tell(optuna: Any, study: "optuna.Study", trial: "optuna.trial.Trial", strat: Any, out: Outcome,
          cached: bool, objectives: tuple[str, ...], use_constraint: bool) -> None:
    if out.status == "invalid":
        _tell_invalid(optuna, study, trial, out.reason, str(strat))
        return
    trial.set_user_attr("strategy", str(strat))
    trial.set_user_attr("status", out.status)
    trial.set_user_attr("reason", out.reason)
    trial.set_user_attr("cached", cached)
    trial.set_user_attr("simulated", out.simulated)
    trial.set_user_attr("eval_seconds", out.seconds)
    for a in _ATTRS:
        v = getattr(out, a)
        trial.set_user_attr(a, v if math.isfinite(v) else None)
    violation = 0.0 if out.ok else _violation(out)
    if use_constraint:
        trial.set_constraint("memory", violation)
    else:
        trial.set_user_attr("constraint", [violation])
    value = out.tokens_per_s  # the sampler maximizes tokens/s whatever the objective (module doc)
    if math.isfinite(value):
        study.tell(trial, value)
    else:  # rejected before simulation (memory lower bound): no figures to tell
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)


def _violation(out: Outcome) -> float:
    """Relative memory overflow of an infeasible outcome (1.0 when unknown)."""
    if not (math.isfinite(out.peak_memory) and math.isfinite(out.memory_budget) and out.memory_budget > 0):
        return 1.0
    return max(1e-6, out.peak_memory / out.memory_budget - 1.0)


def _outcome_of(ft: "optuna.trial.FrozenTrial") -> Outcome | None:
    ua = ft.user_attrs
    if ua.get("status") not in ("ok", "infeasible", "invalid") or "strategy" not in ua:
        return None
    return Outcome.from_dict({"status": ua["status"], "reason": ua.get("reason", ""),
                              "seconds": ua.get("eval_seconds", 0.0), "simulated": ua.get("simulated", False),
                              **{a: ua.get(a) for a in _ATTRS}})


# ---- study set-up ---------------------------------------------------------------------------------------
def _objectives(objective: "str | Sequence[str]") -> tuple[str, ...]:
    names = tuple(o.strip() for o in objective.split(",")) if isinstance(objective, str) else tuple(objective)
    bad = [o for o in names if o not in OBJECTIVES]
    if not names or bad or len(set(names)) != len(names) or names[0] != "throughput":
        raise SearchError(f"objective {objective!r} is not supported; use 'throughput' or "
                          "('throughput', 'memory') for the Pareto front of tokens/s against peak memory")
    return names


def _sampler(optuna: Any, sampler: Any, seed: int | None, use_constraint: bool) -> Any:
    if not isinstance(sampler, str):
        return sampler
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler == "tpe":
        kw: dict[str, Any] = {"seed": seed, "multivariate": True, "group": True}
        if not use_constraint:
            kw["constraints_func"] = lambda ft: ft.user_attrs.get("constraint", [0.0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate/group are marked experimental
            return optuna.samplers.TPESampler(**kw)
    raise SearchError(f"unknown sampler {sampler!r}; use 'tpe', 'random' or an optuna sampler object")


def _open_study(optuna: Any, storage: Any, study_name: str | None, objectives: tuple[str, ...], sampler: Any,
                space: Space) -> "optuna.Study":
    directions = ["maximize"]
    desc = {**space.describe(), "objective": list(objectives)}
    shown = _redact(storage) if isinstance(storage, str) else storage
    with _quiet(optuna), _storage_lock(storage):
        storage = _open_storage(optuna, storage)
        try:
            study = optuna.create_study(storage=storage, study_name=study_name, directions=directions,
                                        sampler=sampler, load_if_exists=True)
        except ValueError as e:  # e.g. an existing study with other directions
            raise SearchError(f"cannot open study {study_name!r} in {shown}: {e}; use another study name") from None
        old = study.user_attrs.get("parashift.setting")
        if old is None:
            study.set_user_attr("parashift.setting", desc)
        else:   # a study stored before the tp_async and grad_fusion axes existed searched them off
            old = {"tp_async": [False], "grad_fusion": [False], **old}
    if old is not None and old != desc:
        diff = sorted(k for k in desc if old.get(k) != desc[k])
        raise SearchError(f"study {study.study_name!r} in {shown} was made for another setting (differs in "
                          f"{', '.join(diff)}); resume it with the same model, devices, batch and objective, "
                          "or pass a new study name")
    return study


def _redact(url: str) -> str:
    """A storage URL without its password."""
    import re
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def _sqlite_path(url: str) -> "str | None":
    return url[len("sqlite:///"):] if url.startswith("sqlite:///") else None


def _open_storage(optuna: Any, storage: Any) -> Any:
    """An Optuna storage from a URL (checked, with a generous SQLite busy timeout), or ``storage`` as is."""
    if not isinstance(storage, str):
        return storage
    import os
    import re
    if not re.match(r"^[a-z][a-z0-9+]*://", storage):
        raise SearchError(f"--storage {_redact(storage)!r} is not an RDB URL; write e.g. sqlite:///study.db or "
                          "postgresql://user@host/db")
    path = _sqlite_path(storage)
    kw: dict[str, Any] = {}
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if not path or path == ":memory:" or not os.path.isdir(folder):
            raise SearchError(f"--storage {storage!r}: the SQLite file's folder does not exist; write "
                              "sqlite:///FILE with FILE in an existing folder")
        if os.path.isdir(path):
            raise SearchError(f"--storage {storage!r} names a folder; name a database file")
        kw["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    last: Exception | None = None
    for attempt in range(5):   # several workers may create the schema of a fresh database at once
        try:
            return optuna.storages.RDBStorage(storage, **kw)
        except ImportError as e:
            raise SearchError(f"--storage {_redact(storage)!r} needs a database driver that is not installed "
                              f"({e.name or e}); install it or use sqlite:///FILE") from None
        except Exception as e:  # noqa: BLE001 - sqlalchemy errors: a bad URL, a busy or foreign database
            last = e
            if "locked" not in str(e) and "already exists" not in str(e):
                break
            time.sleep(0.2 * (attempt + 1))
    raise SearchError(f"cannot open --storage {_redact(storage)!r} ({type(last).__name__}: "
                      f"{' '.join(str(last).split())[:160]}); check the URL and that the database is one "
                      "Optuna wrote") from None


@contextlib.contextmanager
def _storage_lock(storage: Any) -> Iterator[None]:
    """An exclusive lock on a SQLite database's folder while its study is created (no-op otherwise);
    locking the folder leaves no lock file behind."""
    path = _sqlite_path(storage) if isinstance(storage, str) else None
    if not path or path == ":memory:":
        yield
        return
    import fcntl
    import os
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        yield      # a read-only folder: no lock; the storage's own errors say what is wrong
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _quiet(optuna: Any) -> Iterator[None]:
    """Silence Optuna's per-trial INFO log lines for the duration of a search."""
    logger = logging.getLogger("optuna")
    old = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(old)
