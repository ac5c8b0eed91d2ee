"""Hot switch of a live job, by phase: plan (``vps.transition``), prepare, execute, verify,
restore, rebuild — without a checkpoint.

- :mod:`.session`: a live job's process (:class:`LiveSession`, :class:`LiveOptions`,
  :func:`run_live`): announces switches, runs them between iterations, rebuilds the runtime;
- :mod:`.protocol`: one switch on one process: :func:`prepare` (planning and world creation in
  the background), :func:`execute_switch` (transfer and the verification round, stage by stage
  when staged), restore after an abort;
- :mod:`.executor`: :class:`SwitchExecutor` runs one device's streams of the switch Program,
  one handler per transfer op;
- :mod:`.staged`: which old regions a staged switch releases, and how they are restored;
- :mod:`.memory`: staging buffer pool, state buffer allocation, page release, RSS;
- :mod:`.stores` / :mod:`.wire`: box views of state stores, whole-model arrays; message parts,
  checksums and waiter threads.
"""
from ...vps.transition import SwitchPlanned, place, plan_live_switch
from .executor import ExecStats, SwitchExecutor
from .memory import BufferPool, bytes_of, lazy_alloc, state_alloc
from .protocol import Prepared, SwitchRecord, execute_switch, prepare, training_worlds
from .session import (Generation, LiveOptions, LiveResult, LiveSession, SwitchFaults, generations, run_live,
                      step_times)
from .staged import Releases, restore
from .stores import STATE_KINDS, full_from_arrays, kind_tensor, layout_store, piece_view, store_arrays, store_from_full
from .wire import BIG, CHUNK, checksum, crc, reserve_waiters

__all__ = ["run_live", "LiveSession", "LiveOptions", "LiveResult", "Generation", "generations", "SwitchFaults",
           "step_times", "prepare", "Prepared", "execute_switch", "training_worlds", "SwitchRecord",
           "SwitchExecutor", "ExecStats", "Releases", "restore", "BufferPool", "state_alloc", "lazy_alloc",
           "bytes_of", "STATE_KINDS", "piece_view", "kind_tensor", "layout_store", "store_arrays",
           "full_from_arrays", "store_from_full", "checksum", "crc", "reserve_waiters", "BIG", "CHUNK",
           "plan_live_switch", "place", "SwitchPlanned"]
