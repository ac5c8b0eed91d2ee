"""Fault hooks live-switch tests inject through ``run_live(..., faults=...)`` (never shipped in
the runtime). Top-level classes: the job's processes are spawned and unpickle them.

Both hit only transfers of ``stage`` or later and, with ``op``, only transfers of that op (a
point-to-point transfer is ``send`` at both ends); which transfers those are comes from the
Program's decoded metadata.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from parashift.vps.transition import SwitchMeta


@dataclass(frozen=True)
class _Fault:
    device: int
    switch: int
    stage: int = 0
    op: str | None = None

    def _late(self, device: int, program) -> set[str]:
        meta = SwitchMeta.of(program)
        P = meta.pieces
        late = {meta.transfers[int(x)] for x in np.unique(P.transfer[(P.transfer >= 0) & (P.stage >= self.stage)])}
        if self.op is not None:
            rp = program.ranks.get(device)
            late &= {i.tag for i in (rp.instrs() if rp else ()) if i.tag is not None
                     and ("send" if i.op == "recv" else i.op) == self.op}
        return late

    def kills(self) -> bool:
        return False


@dataclass(frozen=True)
class Corrupt(_Fault):
    """Flip one byte of the first buffer ``device`` receives in switch ``switch``."""

    def hooks(self, switch: int, device: int, program):
        if (switch, device) != (self.switch, self.device):
            return None, None
        late, hit = self._late(device, program), []

        def on_received(tag: str, buf: torch.Tensor) -> None:
            if not hit and buf.numel() and tag in late:
                hit.append(tag)
                buf.view(torch.uint8)[0] ^= 0xFF
        return on_received, None


@dataclass(frozen=True)
class Kill(_Fault):
    """``device``'s process dies right after issuing its first send of switch ``switch``."""

    def kills(self) -> bool:
        return True

    def hooks(self, switch: int, device: int, program):
        if (switch, device) != (self.switch, self.device):
            return None, None
        late = self._late(device, program)
        sending = ("send", "broadcast", "scatter", "gather", "all_gather")

        def on_issue(ins) -> None:
            if ins.op in sending and ins.tag in late:
                os._exit(17)
        return None, on_issue
