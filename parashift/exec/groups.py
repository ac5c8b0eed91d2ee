"""Worlds: process groups created once and cached by member set (and channel).

``torch.distributed.new_group`` is collective over the whole world, so every rank must create
the same groups in the same order: :meth:`Worlds.prepare` takes the global set of keys (every
rank computes it from the same Program) and creates them sorted. A *channel* separates
communicators of the same members used by different streams (compute, comm, p2p), so that
collectives issued by different streams never interleave on one communicator.

A live job's worlds are not made by ``new_group`` (collective over torch's default world, which
cannot grow, and exists once per process): they come from a *factory*, the job's
:class:`~parashift.exec.job.elastic.ElasticManager`, which builds each communicator on the job's
TCPStore. That lets the next layout's world be built in the background while the current
layout trains on its own.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.distributed as dist

__all__ = ["Worlds", "GroupKey"]

GroupKey = tuple[tuple[int, ...], str]


class Worlds:
    """The process-group cache of one rank: ``(members, channel) -> ProcessGroup``."""

    def __init__(self, rank: int, world: int, backend: str,
                 factory: Callable[[tuple[int, ...], str], Any] | None = None) -> None:
        """``factory(members, channel)``: builds a group this rank is a member of (default:
        ``torch.distributed.new_group`` over the default world)."""
        self.rank, self.world, self.backend, self.factory = rank, world, backend, factory
        self._groups: dict[GroupKey, object] = {}

    @staticmethod
    def key(members: Iterable[int], channel: str = "default") -> GroupKey:
        return tuple(sorted(int(m) for m in members)), channel

    def prepare(self, keys: Iterable[GroupKey]) -> None:
        """Create every group of ``keys`` not yet cached (all ranks must pass the same set; groups
        are created in one sorted order, so that members never wait on each other crosswise)."""
        todo = sorted({k for k in keys if k not in self._groups and len(k[0]) > 1})
        if self.factory is not None:
            for members, channel in todo:
                if self.rank in members:
                    self._groups[(members, channel)] = self.factory(members, channel)
            return
        for members, channel in todo:
            if len(members) == self.world and channel == "default":
                self._groups[(members, channel)] = dist.group.WORLD
                continue
            pg = dist.new_group(list(members), backend=self.backend)
            self._groups[(members, channel)] = pg
        if self.backend == "nccl":
            self._warm_up(todo)

    def _warm_up(self, keys: list[GroupKey]) -> None:
        """NCCL creates communicators lazily and blocks until every member joins; touching every
        new group once, in the same global order on all ranks, keeps that from deadlocking later."""
        import torch
        t = torch.zeros(1, device="cuda")
        for members, channel in keys:
            if self.rank in members and len(members) > 1:
                dist.all_reduce(t, group=self._groups[(members, channel)])
        torch.cuda.synchronize()

    def get(self, members: Iterable[int], channel: str = "default"):
        """The group of ``members`` on ``channel`` (None for a single rank: nothing to communicate)."""
        k = self.key(members, channel)
        if len(k[0]) == 1:
            return None
        g = self._groups.get(k)
        if g is None:
            raise RuntimeError(f"process group {k[0]} on channel {k[1]!r} was not prepared on rank {self.rank}; "
                               f"Worlds.prepare must see every group the program uses")
        return g

    def barrier(self) -> None:
        """Wait for every rank of the world (a no-op for a world of one)."""
        if self.world > 1:
            dist.barrier(group=self.get(range(self.world)))

    def __contains__(self, k: GroupKey) -> bool:
        return k in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def members(self) -> list[GroupKey]:
        """Every cached (members, channel) key, sorted."""
        return sorted(self._groups)

    def destroy(self) -> None:
        """Destroy the groups this cache created (a factory's groups belong to the factory)."""
        if self.factory is not None:
            self._groups.clear()
            return
        for k, g in list(self._groups.items()):
            if g is not dist.group.WORLD and self.rank in k[0]:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
        self._groups.clear()
