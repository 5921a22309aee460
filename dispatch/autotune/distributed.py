"""Ranks of a torch.distributed group that tune together and agree on every pick.

Why: the ranks of a tensor-parallel job run the same GEMM shapes; tuning each alone costs
every rank the whole shortlist and can end in different picks (noise differs per GPU),
which a collective then pays for in stragglers. So (`fp4_dispatch.autotune.tuning.Tuner.tune`
with a `Fleet`):

1. every rank computes the same shortlist (the ranking is deterministic: same backends,
   same device, same cost model);
2. rank ``r`` of ``W`` measures the shortlist entries ``i`` with ``i % W == r``
   (round-robin by shortlist index: the likely winners, first in rank order, spread over
   the ranks);
3. the per-tactic measurements are all-gathered (`Fleet.gather`, ``all_gather_object``),
   so every rank holds the same table and picks the same winner by the same rule;
4. the paired never-loses check runs on the group's rank 0 alone and its decision is
   broadcast (`Fleet.broadcast`);
5. every rank adopts that winner; only rank 0 writes the shared cache file;
6. the ranks gather their picks and raise `RanksDisagree` if any differs (`Fleet.agree`).

Works with any backend of torch.distributed that supports object collectives: gloo on
CPU, NCCL on GPUs (object collectives then move through the current CUDA device: set it
per rank, as torchrun jobs do). ``group=None`` or a group of one rank is not
distributed: `fleet_of` returns None and tuning is what it is in one process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)


class RanksDisagree(RuntimeError):
    """Ranks of one tuning group ended with different picks (a bug, never noise)."""


class Fleet:
    """One rank's view of a tuning group: its rank, the group size, the collectives.

    ``group``: a ``torch.distributed`` process group (``torch.distributed.group.WORLD``
    for every rank); the default process group must be initialised.
    """

    def __init__(self, group: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "group: torch.distributed is not initialised (call "
                "torch.distributed.init_process_group first, or pass group=None)"
            )
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        #: the global rank of the group's rank 0 (broadcasts come from it)
        self.root = dist.get_global_rank(group, 0)

    def __repr__(self) -> str:
        return f"Fleet(rank={self.rank}, size={self.size})"

    @property
    def is_root(self) -> bool:
        """Is this the group's rank 0 (the rank that checks pairs and writes the cache)?"""
        return self.rank == 0

    def share(self, count: int) -> list[int]:
        """The shortlist indices this rank measures: ``i % size == rank``."""
        return [i for i in range(count) if i % self.size == self.rank]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in group-rank order (``all_gather_object``: picklable)."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others' argument is ignored)."""
        box = [obj if self.is_root else None]
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        return box[0]

    def agree(self, what: str, value: Any) -> None:
        """Raise `RanksDisagree` unless every rank passes an equal `value`."""
        values = self.gather(value)
        if any(v != values[0] for v in values[1:]):
            listing = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise RanksDisagree(f"ranks of the tuning group disagree on {what}: {listing}")

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on at least one."""
        return any(self.gather(bool(flag)))


def fleet_of(group: Any) -> Fleet | None:
    """The `Fleet` of `group`, or None when tuning is not distributed (None, or 1 rank)."""
    if group is None:
        return None
    fleet = Fleet(group)
    if fleet.size == 1:
        return None
    log.info("distributed tuning: rank %d of %d", fleet.rank, fleet.size)
    return fleet


def merge_shares(shares: Sequence[Sequence[tuple[int, Any]]], count: int) -> list[Any]:
    """The gathered ``(index, item)`` shares as one list in shortlist order.

    Raises ValueError when an index is missing or measured twice (the ranks did not
    split the same shortlist)."""
    merged: dict[int, Any] = {}
    for share in shares:
        for index, item in share:
            if index in merged or not 0 <= index < count:
                raise ValueError(
                    f"shares: index {index} measured twice or out of range 0..{count - 1}"
                )
            merged[index] = item
    missing = [i for i in range(count) if i not in merged]
    if missing:
        raise ValueError(f"shares: no rank measured shortlist indices {missing}")
    return [merged[i] for i in range(count)]
