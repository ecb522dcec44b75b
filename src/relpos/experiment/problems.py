"""What a model is trained and tested on: held-out text (bits per byte) or an algorithmic task
(exact-match accuracy). Both give the runner the same four things: the length trained on, a
batch for each step, the evaluation lengths, and an ``evaluate(model, rotary_for)``.

``rotary_for(length)`` (optional) returns the rotary embedding to use for inputs of ``length``
tokens: the RoPE-scaling rows evaluate one trained RoPE model with several scalings this way.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from ..rotary import RotaryEmbedding
from .data import Corpus, eval_windows, sample_batch
from .model import TransformerLM
from .tasks import TASKS, VOCAB, make_batch

__all__ = ["TextProblem", "TaskProblem", "rotary_swapped"]

RotaryFor = Callable[[int], RotaryEmbedding] | None


@contextmanager
def rotary_swapped(model: TransformerLM, rope: RotaryEmbedding):
    """Run ``model`` (a RoPE model) with ``rope`` in place of its rotary embedding, in every layer."""
    old = model.position
    model.position = rope
    for block in model.blocks:
        block.attn.position = rope
    try:
        yield model
    finally:
        model.position = old
        for block in model.blocks:
            block.attn.position = old


def _rotary(model: TransformerLM, rotary_for: RotaryFor, length: int):
    return nullcontext() if rotary_for is None else rotary_swapped(model, rotary_for(length))


class TextProblem:
    """Next-byte prediction on a corpus: trained at ``train_len``, evaluated at its multiples."""

    metric, higher_is_better, vocab = "bits_per_byte", False, 256

    def __init__(self, corpus: Corpus, *, train_len: int, multipliers: tuple[int, ...], eval_tokens: int) -> None:
        self.corpus, self.train_len, self.eval_tokens = corpus, train_len, eval_tokens
        self.lengths = [train_len * m for m in multipliers]
        self.trained_lengths = [train_len]

    def describe(self) -> str:
        return self.corpus.describe()

    def batch(self, step_seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(self.corpus.train, batch, self.train_len, torch.Generator().manual_seed(step_seed))

    @torch.no_grad()
    def evaluate(self, model: TransformerLM, rotary_for: RotaryFor = None) -> dict[str, dict | None]:
        """Bits per byte, perplexity and the standard error over windows at each length (``None``:
        past a learned table)."""
        model.eval()
        device = next(model.parameters()).device
        results: dict[str, dict | None] = {}
        for length in self.lengths:
            limit = model.max_length()
            if limit is not None and length > limit:
                results[str(length)] = None  # positions past the learned table do not exist
                continue
            x, y = eval_windows(self.corpus.val, length, max(1, self.eval_tokens // length))  # (N, L) each
            per_window = []
            with _rotary(model, rotary_for, length):
                for chunk in range(0, x.shape[0], 8):
                    logits = model(x[chunk : chunk + 8].to(device))  # (n, L, 256)
                    nats = F.cross_entropy(logits.transpose(1, 2), y[chunk : chunk + 8].to(device), reduction="none")
                    per_window += nats.mean(dim=1).tolist()  # (n,) mean nats per byte of each window
            bits = [v / math.log(2) for v in per_window]
            mean = sum(bits) / len(bits)
            se = math.sqrt(sum((b - mean) ** 2 for b in bits) / (len(bits) - 1) / len(bits)) if len(bits) > 1 else None
            results[str(length)] = {"bits_per_byte": mean, "perplexity": 2**mean, "se": se, "tokens": x.numel()}
        return results


class TaskProblem:
    """An algorithmic task: trained on instance lengths ``1 .. train_max``, tested at ``test_lengths``."""

    metric, higher_is_better, vocab = "accuracy", True, VOCAB

    def __init__(self, task: str, *, train_max: int, test_lengths: tuple[int, ...], eval_instances: int) -> None:
        self.task = TASKS[task]
        self.train_max, self.eval_instances = train_max, eval_instances
        self.lengths = list(test_lengths)
        self.trained_lengths = [n for n in test_lengths if n <= train_max]
        self.train_len = self.task.sequence_length(train_max) - 1  # the longest input trained on

    def describe(self) -> str:
        return (f"{self.task.name} ({self.task.description}): trained on lengths 1..{self.train_max} "
                f"(inputs up to {self.train_len} tokens), {self.eval_instances} test instances per length")

    def batch(self, step_seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step_seed)
        lengths = torch.randint(1, self.train_max + 1, (batch,), generator=generator)  # (B,)
        return make_batch(self.task, lengths.tolist(), generator)

    def input_length(self, n: int) -> int:
        return self.task.sequence_length(n) - 1

    @torch.no_grad()
    def evaluate(self, model: TransformerLM, rotary_for: RotaryFor = None) -> dict[str, dict | None]:
        """Exact-match accuracy (and its binomial standard error) at each instance length."""
        model.eval()
        device = next(model.parameters()).device
        results: dict[str, dict | None] = {}
        for n in self.lengths:
            length = self.input_length(n)
            limit = model.max_length()
            if limit is not None and length > limit:
                results[str(n)] = None
                continue
            generator = torch.Generator().manual_seed(1_000_003 * n + 17)  # the same test set for every model and seed
            correct = 0
            with _rotary(model, rotary_for, length):
                for start in range(0, self.eval_instances, 64):
                    count = min(64, self.eval_instances - start)
                    x, y = make_batch(self.task, [n] * count, generator)  # (b, T) each
                    predicted = model(x.to(device)).argmax(dim=-1).cpu()  # (b, T)
                    answer = y != -100
                    correct += int(((predicted == y) | ~answer).all(dim=1).sum())
            p = correct / self.eval_instances
            results[str(n)] = {"accuracy": p, "se": math.sqrt(p * (1 - p) / self.eval_instances), "instances": self.eval_instances}
        return results
