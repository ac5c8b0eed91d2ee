"""Live replay of preemption traces: ``parashift.replay.replay(trace, "tiny-gpt", policy="switch-aware")``.

A trace's window is scaled onto local processes and compressed in time; a live job trains and,
at each event (after the trace's notice, for a preemption), hot-switches to the strategy the
search picks for the new device count. The result holds per event the switch's phases and
pause, the loss curve next to a static job trained on the same samples, the final state's
difference to that job, and optionally the same trace replayed by checkpoint-restart (DCP).
"""
from .api import BASELINES, replay
from .result import EVENT_COLUMNS, ReplayResult
from .schedule import DEFAULT_NOTICE, POLICIES, ReplayEvent, ReplaySchedule, replay_schedule

__all__ = ["replay", "ReplayResult", "EVENT_COLUMNS", "BASELINES", "POLICIES", "DEFAULT_NOTICE", "ReplayEvent",
           "ReplaySchedule", "replay_schedule"]
