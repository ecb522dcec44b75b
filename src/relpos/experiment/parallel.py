"""How the processes of ``torchrun --nproc_per_node N`` share a run's work.

Two ways (``RunConfig.parallel``):

* ``"runs"`` (the default): each process trains and evaluates whole runs (a model at a learning rate
  and seed) of its own, in one thread, and the processes exchange their results at the end of each
  stage (the sweep, the seeds); until then each process keeps its finished runs in
  ``partial/rank<r>/`` of the output folder, which a resumed run reads. A run is computed exactly as
  a single process computes it, so the results do not depend on the number of processes. On 2 CPU cores the models of this experiment
  are too small for two processes to share one batch well: two single-thread runs side by side take
  1.5x (text, 29 ms per step each) to 2.3x (tasks) less time per run than one run split over both
  (docs/experiments/running.md, "Two processes").
* ``"batch"``: every process takes its slice of each run's batch and DistributedDataParallel averages
  the gradients (the earlier way; the committed text reference was made so).

Runs are given out before a stage starts, longest first to the least loaded process, from the
times rank 0 measured for its estimate (every process gets the same list), so that the processes
end a stage together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Hashable, Literal

import torch.distributed as dist

__all__ = ["PARALLEL", "Parallel", "Share", "dist_context", "assign"]

Parallel = Literal["runs", "batch"]
PARALLEL: tuple[str, ...] = ("runs", "batch")


def dist_context() -> tuple[int, int]:
    """(rank, world size); initialises the process group (gloo: the experiment's models and the
    results the processes exchange live on the CPU) when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def assign(costs: dict[Hashable, float], world: int) -> list[list[Hashable]]:
    """Jobs to ``world`` processes, longest first to the least loaded one (ties: the lower rank,
    then the job's order in ``costs``), so every process computes the same lists.

    >>> assign({"a": 3.0, "b": 2.0, "c": 2.0, "d": 1.0}, 2)
    [['a', 'd'], ['b', 'c']]
    """
    order = sorted(costs, key=lambda job: -costs[job])  # stable: equal costs keep their order
    loads, jobs = [0.0] * world, [[] for _ in range(world)]
    for job in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += costs[job]
        jobs[rank].append(job)
    return jobs


def _merge(into: dict, other: dict) -> None:
    """Nested dictionaries: ``other``'s leaves added to ``into`` (a key both hold keeps ``into``'s)."""
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into.setdefault(key, value)


@dataclass(frozen=True)
class Share:
    """This process's part of the work: ``split`` when whole runs are shared out (``"runs"`` with
    more than one process); otherwise every process takes part in every run."""

    rank: int
    world: int
    split: bool

    @classmethod
    def of(cls, parallel: str) -> "Share":
        rank, world = dist_context()
        return cls(rank, world, world > 1 and parallel == "runs")

    @property
    def logs(self) -> bool:
        """Whether this process prints its runs' lines (its own when split, rank 0's otherwise)."""
        return self.split or self.rank == 0

    @property
    def train_world(self) -> tuple[int, int]:
        """(rank, world) a run is trained with: alone when split, over every process otherwise."""
        return (0, 1) if self.split else (self.rank, self.world)

    def broadcast(self, value):
        """Rank 0's ``value`` on every process (a no-op in one process)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mine(self, costs: dict[Hashable, float]) -> set:
        """The jobs this process runs (all of them unless split)."""
        return set(assign(costs, self.world)[self.rank]) if self.split else set(costs)

    def gather(self, records: dict) -> dict:
        """Every process's ``records`` (nested dictionaries) merged, on every process; unchanged unless split."""
        if not self.split:
            return records
        parts: list = [None] * self.world
        dist.all_gather_object(parts, records)
        merged: dict = {}
        for part in parts:
            _merge(merged, part)
        return merged
