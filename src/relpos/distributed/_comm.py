"""The ring: point-to-point messages to the next rank, from the previous one, each wait bounded by a timeout.

Every rank runs the same schedule, so the n-th message with a given tag from rank ``r - 1`` is the n-th
receive with that tag on rank ``r`` (gloo and NCCL both match in order per tag).
"""

from __future__ import annotations

import hashlib
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistributedMismatchError", "Ring", "RingTimeoutError"]

TAG_KV, TAG_GRAD, TAG_FINAL = 11, 12, 13  # keys/values forward, their gradient accumulators, the last hop home


class RingTimeoutError(RuntimeError):
    """A rank waited longer than ``timeout`` for another rank (it stopped, or runs a different schedule)."""


class DistributedMismatchError(ValueError):
    """The ranks of a group called with arguments that disagree; raised on every rank, naming what differs."""


class Ring:
    """The ranks of ``group`` in a ring: ``send`` goes to the next, ``recv`` comes from the previous."""

    def __init__(self, group, timeout: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next, self.prev = self._global((self.rank + 1) % self.size), self._global((self.rank - 1) % self.size)
        self.timeout = timeout

    def _global(self, rank: int) -> int:
        """The world rank of ``rank`` in this group (the sends and receives address world ranks)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def send(self, tensors: tuple[torch.Tensor, ...], tag: int) -> list:
        """Start sending ``tensors`` (contiguous) to the next rank; wait on the result with :meth:`wait`."""
        return [dist.isend(t, self.next, group=self.group, tag=tag) for t in tensors]

    def recv(self, shapes, dtype: torch.dtype, device: torch.device, tag: int) -> tuple[tuple[torch.Tensor, ...], list]:
        """Start receiving tensors of ``shapes`` from the previous rank: (new buffers, pending works)."""
        buffers = tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
        return buffers, [dist.irecv(b, self.prev, group=self.group, tag=tag) for b in buffers]

    def wait(self, works: list, what: str) -> None:
        for work in works:
            try:
                work.wait(timedelta(seconds=self.timeout))
            except RuntimeError as error:
                raise RingTimeoutError(
                    f"rank {self.rank} of {self.size} waited more than timeout={self.timeout:g}s for {what}: "
                    "another rank stopped, called with other arguments or runs slower than the timeout allows "
                    f"(raise timeout=). Cause: {error}"
                ) from error

    def travel(self, tensors: tuple[torch.Tensor, ...], tag: int, what: str):
        """Yield ``(src, tensors)`` for every rank's piece in turn, own first; each piece is passed on to the
        next rank (and the next one received) while the caller works on it."""
        current = tensors
        for step in range(self.size):
            last = step == self.size - 1
            works = [] if last else self.send(current, tag)
            received, recv_works = ((), []) if last else self.recv([t.shape for t in current], current[0].dtype, current[0].device, tag)
            yield (self.rank - step) % self.size, current
            self.wait(works + recv_works, f"{what} of rank {(self.rank - step - 1) % self.size}")
            current = received

    def all_gather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """(P, *tensor.shape): every rank's ``tensor``, the wait bounded by the timeout."""
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))  # (P * n, ...): gloo's layout
        work = dist.all_gather_into_tensor(out, tensor.contiguous(), group=self.group, async_op=True)
        self.wait([work], what)
        return out.unflatten(0, (self.size, tensor.shape[0]))

    def _gather_objects(self, obj, device: torch.device) -> list:
        """Every rank's picklable ``obj``, through two bounded all-gathers (sizes, then padded bytes)."""
        data = torch.tensor(list(pickle.dumps(obj)), dtype=torch.uint8, device=device)  # (n,)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), "every rank's arguments")
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        every = self.all_gather(padded, "every rank's arguments").cpu()  # (P, longest)
        return [pickle.loads(bytes(every[r, : int(sizes[r, 0])].tolist())) for r in range(self.size)]

    def agree(self, fields: dict[str, object], device: torch.device) -> None:
        """Raise :class:`DistributedMismatchError` on every rank unless every rank passed equal ``fields``.

        One bounded all-gather of a hash; only when the hashes differ are the fields themselves gathered (bounded
        too) to name what differs.
        """
        digest = hashlib.sha256(repr(sorted(fields.items())).encode()).digest()[:16]
        mine = torch.tensor(list(digest), dtype=torch.int64, device=device)  # (16,)
        hashes = self.all_gather(mine, "every rank to reach this attention call")
        if bool((hashes == hashes[0]).all()):
            return
        gathered = self._gather_objects(fields, device)
        lines = [
            f"{key}: " + ", ".join(f"rank {r} {gathered[r][key]!r}" for r in range(self.size))
            for key in fields
            if any(g[key] != gathered[0][key] for g in gathered)
        ]
        raise DistributedMismatchError(
            "the ranks of the group called context-parallel attention with different arguments; every rank must pass "
            "the same shapes, dtype, settings and position term (its parameters synchronized):\n  " + "\n  ".join(lines)
        )
