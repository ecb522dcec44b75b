"""Train a T5-style encoder with its sequence sharded across processes (context parallelism, CPU, gloo).

Every process holds L / P tokens of each sequence; attention runs as a ring (relpos.distributed) with T5's
bucketed relative position bias evaluated at global positions. The task needs positions: predict, at each
position, the token 3 positions earlier (padding at the end of the second sequence). The example shows the
mechanics, not a trained model: in its few steps the loss falls from its initial value to the uniform level
(ln 64 = 4.16; learning the copy takes thousands of steps). ``--check`` also runs the same model on the whole
sequence in one process (rank 0) and prints how far the sharded loss and every gradient are from it.

    torchrun --nproc_per_node 2 examples/context_parallel_t5.py                     # L = 2048, 20 steps
    torchrun --nproc_per_node 2 examples/context_parallel_t5.py --check --dtype float64 --steps 1
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import relpos
import relpos.distributed as rd

VOCAB, SHIFT = 64, 3


class Encoder(nn.Module):
    """Embedding, a relpos T5 encoder stack (one shared bucketed bias), a token classifier."""

    def __init__(self, dim: int, heads: int, layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, dtype=dtype)
        self.stack = relpos.T5Stack(layers, dim, heads, 4 * dim, num_buckets=32, max_distance=128, dtype=dtype)
        self.head = nn.Linear(dim, VOCAB, dtype=dtype)

    def forward(self, tokens: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.embed(tokens), key_mask=key_mask))  # (B, L, VOCAB)


def batch(length: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L) tokens, their (B, L) key mask (the second sequence ends in padding) and the (B, L) targets."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, length), generator=g)
    keep = torch.ones(2, length, dtype=torch.bool)
    keep[1, length - length // 8 :] = False
    targets = torch.full_like(tokens, -100)  # -100: no loss (the first SHIFT positions and the padding)
    targets[:, SHIFT:] = tokens[:, :-SHIFT]
    targets[~keep] = -100
    return tokens, keep, targets


def loss_of(model, tokens, keep, targets, count: int) -> torch.Tensor:
    """Sum of this part's token losses over the whole batch's count: the parts' losses add up to the mean."""
    logits = model(tokens, keep)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--length", type=int, default=2048, help="tokens per sequence (a multiple of 2 x processes)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--layout", choices=rd.LAYOUTS, default="contiguous", help="how the sequence is cut across processes")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--check", action="store_true", help="rank 0 also runs the whole sequence in one process and compares")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)  # every rank builds the same weights
    model = Encoder(64, 4, 2, dtype)
    reference = Encoder(64, 4, 2, dtype) if args.check and rank == 0 else None
    if reference is not None:
        reference.load_state_dict(model.state_dict())
    handle = rd.context_parallel(model, layout=args.layout)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    worst = 0.0
    for step in range(args.steps):
        tokens, keep, targets = batch(args.length, step)
        count = int((targets != -100).sum())
        part = lambda t: rd.shard(t, 1, rank, world, args.layout)  # noqa: E731  this rank's (B, L / P) rows
        loss = loss_of(model, part(tokens), part(keep), part(targets), count)
        optimizer.zero_grad()
        loss.backward()
        rd.all_reduce_grads(model)  # every rank: the gradient of the whole sequence's loss
        total = loss.detach().clone()
        dist.all_reduce(total)
        if reference is not None:
            worst = max(worst, compare(reference, model, tokens, keep, targets, count, total))
        optimizer.step()
        if reference is not None:
            reference.load_state_dict(model.state_dict())  # follow the sharded run's weights
        if rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {float(total):.4f}", flush=True)
    handle.undo()
    if reference is not None:
        print(f"largest difference from one process (loss and every gradient): {worst:.3g}", flush=True)
    return 0


def compare(reference, model, tokens, keep, targets, count: int, total: torch.Tensor) -> float:
    """Largest |difference| between the one-process loss and gradients and the sharded run's."""
    reference.zero_grad()
    loss = loss_of(reference, tokens, keep, targets, count)
    loss.backward()
    sharded = dict(model.named_parameters())
    diffs = [abs(float(loss.detach()) - float(total))]
    diffs += [float((p.grad - sharded[name].grad).abs().max()) for name, p in reference.named_parameters()]
    return max(diffs)


if __name__ == "__main__":
    rd.exit_process(main())  # a barrier, the group destroyed, then no interpreter teardown (gloo can abort it)
