"""What a model is trained and tested on: held-out text (bits per byte) or an algorithmic task
(exact-match accuracy). Both give the runner the same four things: the length trained on, a
batch for each step, the evaluation lengths, and an ``evaluate(model, rotary_for)``.

``rotary_for(length)`` (optional) returns the rotary embedding to use for inputs of ``length``
tokens: the RoPE-scaling rows evaluate one trained RoPE model with several scalings this way.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from ..encodings.rotary import RotaryEmbedding
from .data import Corpus, file_windows, sample_batch
from .model import TransformerLM
from . import scan
from .tasks import PAD, TASKS, VOCAB, make_batch, pad_instances

__all__ = ["TextProblem", "TaskProblem", "ScanProblem", "rotary_swapped"]

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


#: bytes per evaluation forward pass: windows are batched up to this many tokens (8 windows of 64
#: bytes a call made short lengths cost as much per byte as long ones)
EVAL_TOKENS_PER_CALL = 8192


def _rows(length: int) -> int:
    return max(1, EVAL_TOKENS_PER_CALL // length)


class TextProblem:
    """Next-byte prediction on a corpus: trained at ``train_len``, evaluated at its multiples on the
    held-out test files (and on a second corpus's, if given), window by window."""

    metric, higher_is_better, vocab = "bits_per_byte", False, 256

    def __init__(self, corpus: Corpus, *, train_len: int, multipliers: tuple[int, ...], eval_tokens: int,
                 second: Corpus | None = None, second_tokens: int | None = None, val_windows: int = 64) -> None:
        self.corpus, self.train_len, self.eval_tokens = corpus, train_len, eval_tokens
        self.second, self.val_windows = second, val_windows
        self.lengths = [train_len * m for m in multipliers]
        self.trained_lengths = [train_len]
        self.test_sets = {"main": corpus.test, **({"second": second.test} if second is not None else {})}
        val = corpus.val
        count = max(1, min(val_windows, (val.numel() - 1) // train_len))
        starts = torch.linspace(0, val.numel() - train_len - 1, count).long()  # (N,) evenly spread
        window = val[starts[:, None] + torch.arange(train_len + 1)[None, :]].long()  # (N, L + 1)
        self._validation = (window[:, :-1], window[:, 1:])
        budget = {"main": eval_tokens, "second": second_tokens or eval_tokens}
        self._windows = {(which, n): file_windows(files, n, budget[which])
                         for which, files in self.test_sets.items() for n in self.lengths}

    def describe(self) -> str:
        return self.corpus.describe()

    def windows(self, which: str = "main") -> dict:
        """The files and which file each window of each length comes from (the same for every model)."""
        return {"files": [name for name, _ in self.test_sets[which]],
                "window_file": {str(n): self._windows[which, n][2] for n in self.lengths}}

    def attention_windows(self, length: int, count: int = 4) -> torch.Tensor:
        """The first ``count`` held-out windows at ``length`` (the attention diagnostic's input): (n, L)."""
        return self.held_out(length, count)[0]

    def held_out(self, length: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` held-out windows at ``length`` and their next bytes: (n, L) each."""
        x, y, _ = self._windows["main", length]
        return x[:count], y[:count]

    def batch(self, step_seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(self.corpus.train, batch, self.train_len, torch.Generator().manual_seed(step_seed))

    @torch.no_grad()
    def validate(self, model: TransformerLM) -> float:
        """In-distribution validation: bits per byte on ``val_windows`` windows at the training length
        spread evenly over the validation files (learning curves and the learning-rate choice)."""
        model.eval()
        device = next(model.parameters()).device
        x, y = self._validation  # (N, L) each
        nats = F.cross_entropy(model(x.to(device)).transpose(1, 2), y.to(device))
        model.train()
        return float(nats) / math.log(2)

    @torch.no_grad()
    def estimate_eval(self, model: TransformerLM) -> float:
        """Seconds one full evaluation (every length, every test set) should take: one chunk timed per length."""
        model.eval()
        total = 0.0
        limit = model.max_length()
        for (which, length), (x, _, _) in self._windows.items():
            if limit is not None and length > limit:
                continue
            began = time.perf_counter()
            rows = _rows(length)
            model(x[:rows])
            total += (time.perf_counter() - began) * math.ceil(x.shape[0] / rows)
        model.train()
        return total

    @torch.no_grad()
    def evaluate(self, model: TransformerLM, rotary_for: RotaryFor = None, which: str = "main") -> dict[str, dict | None]:
        """Bits per byte at each length (``None``: past a learned table): the mean over windows, its
        standard error, each window's value, and the loss by position (the mean over windows of
        each ``train_len``-long stretch of the window: where an encoding breaks)."""
        model.eval()
        device = next(model.parameters()).device
        results: dict[str, dict | None] = {}
        for length in self.lengths:
            limit = model.max_length()
            if limit is not None and length > limit:
                results[str(length)] = None  # positions past the learned table do not exist
                continue
            x, y, owner = self._windows[which, length]  # (N, L) each
            per_window, by_position = [], torch.zeros(length, dtype=torch.float64)
            with _rotary(model, rotary_for, length):
                rows = _rows(length)
                for chunk in range(0, x.shape[0], rows):
                    logits = model(x[chunk : chunk + rows].to(device))  # (n, L, 256)
                    nats = F.cross_entropy(logits.transpose(1, 2), y[chunk : chunk + rows].to(device), reduction="none")  # (n, L)
                    per_window += (nats.mean(dim=1) / math.log(2)).tolist()  # (n,) bits per byte of each window
                    by_position += nats.double().sum(0).cpu()  # (L,)
            bits = per_window
            mean = sum(bits) / len(bits)
            se = math.sqrt(sum((b - mean) ** 2 for b in bits) / (len(bits) - 1) / len(bits)) if len(bits) > 1 else None
            stretches = (by_position / (len(bits) * math.log(2))).view(-1, self.train_len).mean(1)  # (L / train_len,)
            files = sorted(set(owner))
            column = torch.tensor([files.index(f) for f in owner])  # (N,)
            sums = torch.zeros(len(files), dtype=torch.float64).index_add_(0, column, torch.tensor(bits, dtype=torch.float64))
            means = sums / torch.bincount(column, minlength=len(files))  # (F,) each file's mean over its windows
            results[str(length)] = {"bits_per_byte": mean, "perplexity": 2**mean, "se": se, "tokens": x.numel(),
                                    "file_means": [round(v, 6) for v in means.tolist()],
                                    "windows": [round(b, 5) for b in bits], "by_position": [round(v, 6) for v in stretches.tolist()]}
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

    def validate(self, model: TransformerLM) -> float:
        """In-distribution validation: the answer tokens' cross-entropy on 256 fixed instances of the
        trained lengths (learning curves and the learning-rate choice)."""
        generator = torch.Generator().manual_seed(7_777_777)  # never a training or test seed's stream
        lengths = torch.randint(1, self.train_max + 1, (256,), generator=generator)  # (256,)
        return _answer_loss(model, *make_batch(self.task, lengths.tolist(), generator))

    def evaluate(self, model: TransformerLM, rotary_for: RotaryFor = None) -> dict[str, dict | None]:
        """Exact-match accuracy (and its binomial standard error) at each instance length."""
        return _accuracy_by_length(model, rotary_for, self.lengths, self.input_length, self._test_instances, PAD)

    def _test_instances(self, n: int) -> list[tuple[torch.Tensor, int]]:
        generator = torch.Generator().manual_seed(1_000_003 * n + 17)  # the same test set for every model and seed
        return [self.task.sample(n, generator) for _ in range(self.eval_instances)]


@torch.no_grad()
def _answer_loss(model: TransformerLM, x: torch.Tensor, y: torch.Tensor) -> float:
    """The answer tokens' cross-entropy of a padded batch ``x``, ``y``: (B, T) each."""
    model.eval()
    device = next(model.parameters()).device
    loss = F.cross_entropy(model(x.to(device)).flatten(0, 1), y.flatten().to(device), ignore_index=-100)
    model.train()
    return float(loss)


@torch.no_grad()
def _accuracy_by_length(model: TransformerLM, rotary_for: RotaryFor, lengths, input_length, instances, pad: int) -> dict:
    """Exact-match accuracy and its binomial standard error per length ``n`` (``None`` past a learned
    table), on the ``instances(n)`` of each, the model's inputs up to ``input_length(n)`` tokens."""
    model.eval()
    device = next(model.parameters()).device
    results: dict[str, dict | None] = {}
    for n in lengths:
        length, limit = input_length(n), model.max_length()
        if limit is not None and length > limit:
            results[str(n)] = None  # positions past the learned table do not exist
            continue
        group = instances(n)
        with _rotary(model, rotary_for, length):
            p = _exact_matches(model, group, device, pad) / len(group)
        results[str(n)] = {"accuracy": p, "se": math.sqrt(p * (1 - p) / len(group)), "instances": len(group)}
    model.train()
    return results


def _exact_matches(model: TransformerLM, instances: list, device, pad: int, chunk: int = 64) -> int:
    """Instances whose every answer token is the model's most likely next token (= greedy decoding)."""
    correct = 0
    for start in range(0, len(instances), chunk):
        x, y = pad_instances(instances[start : start + chunk], pad)  # (b, T) each
        predicted = model(x.to(device)).argmax(dim=-1).cpu()  # (b, T)
        correct += int(((predicted == y) | (y == -100)).all(dim=1).sum())
    return correct


class ScanProblem:
    """SCAN's length split (:mod:`relpos.experiment.scan`): trained on commands of at most 22 actions,
    tested on the commands of 24 to 48 actions, by action count (``eval_instances`` per count, a fixed
    random sample; ``None``: all 3,920). A tenth of the training commands (a fixed
    draw) is held out: the validation loss and the in-distribution accuracy (reported at length 22,
    "at most 22 actions"). The answer ends with an end token, so stopping at the right length is
    part of being correct (Newman et al. 2020 find that decision to be where length generalization fails)."""

    metric, higher_is_better, vocab = "accuracy", True, scan.SCAN_VOCAB
    task = "scan"

    def __init__(self, *, eval_instances: int | None = None) -> None:
        train, test = scan.length_split()
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
        held = set(order[: len(train) // 10])
        self._train = [scan.encode(c) for k, c in enumerate(train) if k not in held]
        self._held = [scan.encode(c) for k, c in enumerate(train) if k in held]
        self._groups: dict[int, list] = {scan.TRAIN_MAX_ACTIONS: self._held}
        for command in test:
            self._groups.setdefault(len(scan.actions(command)), []).append(scan.encode(command))
        for n, group in self._groups.items():  # a fixed shuffle: the first ``eval_instances`` are a fair sample
            order = torch.randperm(len(group), generator=torch.Generator().manual_seed(n)).tolist()
            self._groups[n] = [group[k] for k in order]
        self.lengths = sorted(self._groups)
        self.trained_lengths = [scan.TRAIN_MAX_ACTIONS]
        self.train_len = max(t.numel() for t, _ in self._train) - 1  # the longest input trained on
        self.eval_instances = eval_instances

    def describe(self) -> str:
        return (f"SCAN, length split (Lake & Baroni 2018): trained on {len(self._train)} commands of at most "
                f"{scan.TRAIN_MAX_ACTIONS} actions (inputs up to {self.train_len} tokens; {len(self._held)} more held out, "
                f"column {scan.TRAIN_MAX_ACTIONS}), tested on {self._tested()} of the "
                f"{sum(len(g) for n, g in self._groups.items() if n > scan.TRAIN_MAX_ACTIONS)} commands of 24 to 48 actions "
                f"({'all' if not self.eval_instances else f'at most {self.eval_instances} per action count, a fixed random sample'})")

    def _tested(self) -> int:
        return sum(len(self._test_instances(n)) for n in self.lengths if n > scan.TRAIN_MAX_ACTIONS)

    def batch(self, step_seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        pick = torch.randint(0, len(self._train), (batch,), generator=torch.Generator().manual_seed(step_seed))  # (B,)
        return pad_instances([self._train[k] for k in pick.tolist()], scan.PAD)

    def input_length(self, n: int) -> int:
        return max(t.numel() for t, _ in self._groups[n]) - 1

    def validate(self, model: TransformerLM) -> float:
        """The answer tokens' cross-entropy on the first 512 held-out training commands."""
        return _answer_loss(model, *pad_instances(self._held[:512], scan.PAD))

    def evaluate(self, model: TransformerLM, rotary_for: RotaryFor = None) -> dict[str, dict | None]:
        """Exact-match accuracy per action count (22: the held-out in-distribution commands)."""
        return _accuracy_by_length(model, rotary_for, self.lengths, self.input_length, self._test_instances, scan.PAD)

    def _test_instances(self, n: int) -> list[tuple[torch.Tensor, int]]:
        return self._groups[n][: self.eval_instances] if self.eval_instances else self._groups[n]
