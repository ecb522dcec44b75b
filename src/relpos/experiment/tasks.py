"""Algorithmic length-generalization tasks: train on instances of length <= N, test on longer ones.

Each instance is a digit string ``x`` of length ``n``, a separator, and the answer:

* ``copy``: ``x`` again;
* ``reverse``: ``x`` reversed;
* ``sort``: the digits of ``x`` in ascending order;
* ``addition``: ``x`` is ``a + b`` with two ``n``-digit numbers written least significant digit
  first, the answer ``a + b`` in ``n + 1`` digits, least significant first (the order in which
  carries are computed);
* ``parity``: ``x`` is ``n`` bits, the answer one token, their sum mod 2 (Kazemnejad et al. 2023);
* ``summation``: the sum of the ``n`` digits mod 10, one token (Kazemnejad et al. 2023).

The model reads ``[BOS, x, "=", answer]`` left to right (the start token gives a model without
position encoding something to count from, as in Kazemnejad et al. 2023) and is trained on the answer's tokens only.
An instance is correct when every answer token is the model's most likely next token (with the
correct prefix fed in, which is exactly when greedy decoding reproduces the whole answer). The
answer's length is a function of ``n``, so no end-of-answer token is predicted.

Every instance is drawn from a ``torch.Generator`` seeded by the caller: the same seed gives the
same instances on every machine.

>>> task = TASKS["reverse"]
>>> tokens, answer_start = task.instance([3, 1, 4])
>>> tokens.tolist(), answer_start            # <s> 3 1 4 = 4 1 3
([13, 3, 1, 4, 11, 4, 1, 3], 5)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["PLUS", "SEP", "PAD", "BOS", "VOCAB", "Task", "TASKS", "make_batch", "pad_instances"]

PLUS, SEP, PAD, BOS = 10, 11, 12, 13  # digits are tokens 0 .. 9
VOCAB = 14


def _add_lsb_first(digits: Sequence[int]) -> tuple[list[int], list[int]]:
    """Prompt ``a + b`` and the answer, both least significant digit first (``digits`` = a then b)."""
    n = len(digits) // 2
    a, b = list(digits[:n]), list(digits[n:])
    out, carry = [], 0
    for da, db in zip(a, b):
        carry, digit = divmod(da + db + carry, 10)
        out.append(digit)
    return a + [PLUS] + b, out + [carry]


@dataclass(frozen=True)
class Task:
    """One task: how many random digits an instance of length ``n`` draws, and its prompt and answer."""

    name: str
    description: str
    digits: Callable[[int], int]  # random digits drawn for length n
    solve: Callable[[list[int]], tuple[list[int], list[int]]]  # digits -> (prompt, answer)
    base: int = 10  # digits are drawn from 0 .. base - 1

    def instance(self, digits: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Tokens ``[BOS, prompt, SEP, answer]`` (int64) and the index where the answer starts."""
        prompt, answer = self.solve([int(d) for d in digits])
        tokens = [BOS] + prompt + [SEP] + answer
        return torch.tensor(tokens, dtype=torch.long), len(prompt) + 2

    def sequence_length(self, n: int) -> int:
        """Tokens in an instance of length ``n`` (start, prompt, separator, answer)."""
        return self.instance([0] * self.digits(n))[0].numel()

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
        digits = torch.randint(0, self.base, (self.digits(n),), generator=generator)
        return self.instance(digits.tolist())


TASKS: dict[str, Task] = {
    "copy": Task("copy", "repeat the digits", lambda n: n, lambda d: (d, d)),
    "reverse": Task("reverse", "the digits in reverse order", lambda n: n, lambda d: (d, d[::-1])),
    "sort": Task("sort", "the digits in ascending order", lambda n: n, lambda d: (d, sorted(d))),
    "addition": Task("addition", "sum of two n-digit numbers, least significant digit first", lambda n: 2 * n, _add_lsb_first),
    "parity": Task("parity", "parity of n bits", lambda n: n, lambda d: (d, [sum(d) % 2]), base=2),
    "summation": Task("summation", "sum of n digits mod 10", lambda n: n, lambda d: (d, [sum(d) % 10])),
}


def make_batch(task: Task, lengths: Sequence[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(B, T)`` and targets ``(B, T)`` for instances of the given lengths.

    Right-padded with ``PAD`` (a causal model never looks at it); targets are ``-100`` (ignored
    by ``cross_entropy``) everywhere but on the answer's tokens.
    """
    return pad_instances([task.sample(int(n), generator) for n in lengths])


def pad_instances(instances: Sequence[tuple[torch.Tensor, int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(B, T)`` and answer targets ``(B, T)`` of ``(tokens, answer start)`` instances (see :func:`make_batch`)."""
    width = max(t.numel() for t, _ in instances) - 1
    x = torch.full((len(instances), width), pad, dtype=torch.long)  # (B, T)
    y = torch.full((len(instances), width), -100, dtype=torch.long)  # (B, T)
    for row, (tokens, start) in enumerate(instances):
        x[row, : tokens.numel() - 1] = tokens[:-1]
        y[row, start - 1 : tokens.numel() - 1] = tokens[start:]  # predict each answer token from its prefix
    return x, y
