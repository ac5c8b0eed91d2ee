"""Reader for the instance-lifecycle logs of "Training on a Dime" (``dime-log``).

Each line is ``[ISO time] message``. An instance is up from ``Created instance ID ...`` (or the
first ``Instance ID running ...``) until ``Instance ID not running ...`` (a preemption),
``Instance ID creation failed`` or ``Successfully deleted instance ID``. Failed creations
without an instance id change nothing. Instances of every GPU type and zone in the log are
pooled; ``attrs['instance_types']`` lists them.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from . import _text as tx
from .schema import fail, finish, from_deltas

__all__ = ["read_dime_log", "LINE"]

#: a log line: the bracketed time and the message
LINE = r"^\[(?P<time>[^\]]+)\]\s+(?P<msg>.*)$"

# message pattern -> the instance's state after it (1 up, 0 down, -1 no instance named)
_MESSAGES = (
    (r"^Created instance (?P<id>\S+) with (?P<gpus>\d+) GPU\(s\) of type (?P<type>\S+) in zone (?P<zone>\S+)$", 1),
    (r"^Instance (?P<id>\S+) running in zone (?P<zone>\S+)$", 1),
    (r"^Instance (?P<id>\S+) not running in zone (?P<zone>\S+)$", 0),
    (r"^Instance (?P<id>\S+) creation failed$", 0),
    (r"^Successfully deleted instance (?P<id>\S+)$", 0),
    (r"^Instance with \d+ GPU\(s\) of type \S+ creation failed$", -1),
)


def read_dime_log(source: str, text: str, notice: float | None = None) -> pd.DataFrame:
    """Read an instance-lifecycle log into pool events (one node = one instance)."""
    lines = tx.lines_of(source, text)
    parts = lines.text.str.extract(LINE)
    bad = np.flatnonzero(parts["time"].isna().to_numpy())
    if bad.size:
        i = bad[0]
        raise fail(source, int(lines.row[i]), "the line is not '[time] message'"
                   + (" (the file looks truncated)" if i == len(lines) - 1 else ""),
                   "every line starts with an ISO time in brackets")
    t = tx.timestamps(lines, parts["time"], "time")
    tx.sorted_or_fail(source, lines.row, t)
    msg = parts["msg"].str.strip()
    state = np.full(len(msg), -2, dtype=np.int64)
    ids = pd.Series(np.full(len(msg), None, dtype=object))
    types = []
    for pattern, s in _MESSAGES:
        hit = msg.str.match(pattern).to_numpy(dtype=bool) & (state == -2)
        state[hit] = s
        if "?P<id>" in pattern and hit.any():
            m = msg[hit].str.extract(pattern)
            ids[hit] = m["id"].to_numpy()
            if "type" in m:
                types += (m["gpus"] + "x" + m["type"]).tolist()
    bad = np.flatnonzero(state == -2)
    if bad.size:
        i = bad[0]
        raise fail(source, int(lines.row[i]), "the message is not a known instance event",
                   "pass the right format= (dime-log reads 'Created instance', 'Instance ... running', "
                   "'... not running', '... creation failed' and 'Successfully deleted instance')")
    named = state >= 0
    ev = pd.DataFrame({"t": t[named], "id": ids[named].to_numpy(), "state": state[named]})
    before = ev.groupby("id", sort=False)["state"].shift(fill_value=0).to_numpy()
    delta = ev["state"].to_numpy() - before
    t0 = float(t[0])
    initial, out = from_deltas(ev["t"].to_numpy() - t0, delta)
    return finish(out, source=source, fmt="dime-log", initial=initial, duration=float(t[-1] - t0),
                  start=pd.Timestamp(t0, unit="s").isoformat(), notice=notice,
                  instance_types=sorted(set(types)))
