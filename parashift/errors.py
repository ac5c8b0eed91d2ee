"""parashift's exceptions: every user-facing error says what is wrong and how to fix it."""
from __future__ import annotations

__all__ = [
    "ParashiftError", "UnknownPresetError", "UnknownGPUError", "StrategyError", "ClusterError", "DeviceListError",
    "PlanError", "MemoryBudgetError", "ProgramError", "DeadlockError", "TraceFormatError",
    "RuntimeFailure", "SwitchAborted", "StoreError", "StoreTimeout", "InputError", "OutputError", "LimitError",
    "DataError",
]


class ParashiftError(Exception):
    """Base class: the message states the problem and the fix, in one line."""


class UnknownPresetError(ParashiftError, KeyError):
    """A model or cluster name that is not a preset."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownGPUError(UnknownPresetError):
    """A GPU kind or device name that is not in parashift's GPU table (:mod:`parashift.gpus`)."""


class StrategyError(ParashiftError, ValueError):
    """A strategy that cannot run the model (divisibility, unknown field, bad schedule)."""


class ModelError(StrategyError):
    """A model description (inline, JSON or Hugging Face config) that cannot be built."""


class ClusterError(ParashiftError, ValueError):
    """A cluster description that is malformed or too small."""


class DeviceListError(ParashiftError, ValueError):
    """A device list that is malformed or does not match the strategy's world size."""


class PlanError(ParashiftError, ValueError):
    """A switch plan or lowering that cannot be built."""


class MemoryBudgetError(PlanError):
    """The new layout (or a staging step) cannot fit the memory budget."""


class ProgramError(ParashiftError, ValueError):
    """A Program that breaks an invariant (ids, deps, matching, collectives)."""


class DeadlockError(ProgramError):
    """A Program whose per-stream orders cannot all complete."""


class TraceFormatError(ParashiftError, ValueError):
    """A preemption/availability trace that cannot be read."""


class RuntimeFailure(ParashiftError, RuntimeError):
    """A rank failed while executing a Program."""


class SwitchAborted(RuntimeFailure):
    """A live switch failed and the job was rolled back to its old layout.

    ``reason``: the first failure (a failed transfer, a checksum mismatch), or None when the
    message says it all; ``peer_failed``: a participant is gone, so the job cannot train on."""

    def __init__(self, message: str, reason: str | None = None, peer_failed: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.peer_failed = peer_failed

    def __reduce__(self):  # keep reason and peer_failed across processes
        return type(self), (str(self), self.reason, self.peer_failed)


class StoreError(RuntimeFailure):
    """The job's store (an etcd cluster) cannot be reached, or refused a request; the message names which."""


class StoreTimeout(StoreError):
    """A key of the job's store was not set within the timeout (a ``wait`` or a blocking ``get``)."""


class InputError(ParashiftError, ValueError):
    """A number or a file the user gave that parashift cannot use (the message names the key)."""


class OutputError(ParashiftError, OSError):
    """An output path that cannot be written (checked before any work starts)."""


class LimitError(ParashiftError, ValueError):
    """Work or memory estimated beyond a limit before starting; the message names the limit."""


class DataError(InputError):
    """A token file (or its sidecar) that is missing, truncated, corrupt or too short for the run."""
