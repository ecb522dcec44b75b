"""A small byte-level decoder-only transformer whose only variable is its position encoding.

``TransformerLM(LMConfig(encoding="t5"))``: embeddings, ``layers`` pre-norm blocks of relpos
:class:`MultiheadAttention` (causal) and a GELU MLP, a final RMSNorm, and an output layer tied to
the embeddings. Each encoding is built from its :mod:`relpos.registry` record: relative biases and rotary
embeddings once, shared by every layer (T5's convention); Shaw's relative vectors, forgetting
gates and CoPE's position vectors per layer, as in their papers; absolute embeddings are added to
the token embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .. import registry
from .._checks import check_choice, check_int
from ..encodings.buckets import STRATEGIES
from ..layers.mha import KVCache, MultiheadAttention
from ..encodings.rotary import RotaryEmbedding, apply_rotation

__all__ = ["ENCODINGS", "DEFAULT_ENCODINGS", "LMConfig", "RandomizedRotary", "TransformerLM"]

#: every encoding a sequence model can use (relpos.registry's ``sequence=True`` records)
ENCODINGS: tuple[str, ...] = registry.names(sequence=True)
#: those the experiment's default run trains (the others are selected with ``--encodings``)
DEFAULT_ENCODINGS: tuple[str, ...] = registry.names(sequence=True, default_run=True)


@dataclass(frozen=True)
class LMConfig:
    encoding: str = "t5"
    dim: int = 128
    layers: int = 2
    heads: int = 4
    ff_mult: int = 4
    train_len: int = 64  # the learned absolute table has exactly this many positions
    num_buckets: int = 32
    max_distance: int = 64  # T5: distances at or past it share the last bucket
    strategy: str = "log"
    clip_distance: int = 32  # clipped bias and Shaw vectors: offsets beyond share the end value
    log_decay_scale: float = 0.3
    vocab: int = 256
    randomized_positions: int = 0  # > 0: RoPE at randomized positions drawn from 0 .. this - 1 (Ruoss et al. 2023)

    def __post_init__(self) -> None:
        check_choice("encoding", self.encoding, ENCODINGS)
        check_choice("strategy", self.strategy, STRATEGIES)
        for name in ("dim", "layers", "heads", "ff_mult", "train_len", "vocab"):
            check_int(name, getattr(self, name), minimum=1)
        if self.dim % self.heads:
            raise ValueError(f"dim={self.dim} must be divisible by heads={self.heads}")
        check_int("randomized_positions", self.randomized_positions, minimum=0)
        if self.randomized_positions and self.encoding != "rope":
            raise ValueError(f"randomized_positions applies to encoding='rope' only, got encoding={self.encoding!r}")

    def with_(self, **changes) -> "LMConfig":
        return replace(self, **changes)


def _build(config: LMConfig, head_dim: int):
    """The configured encoding's module (``None`` for NoPE), its options read from the config's fields."""
    encoding = registry.get(config.encoding)
    fields = {o.name: o.config_field or o.name for o in encoding.options}
    options = {name: getattr(config, field) for name, field in fields.items() if hasattr(config, field)}
    return encoding.create(config.heads, head_dim, causal=True, **options)


class RandomizedRotary(RotaryEmbedding):
    """RoPE at randomized positions (Ruoss et al. 2023): for an input of ``L`` tokens the positions
    are ``L`` distinct integers drawn from ``0 .. max_positions - 1`` and sorted, so the model sees
    the large positions of long inputs while training on short ones. Training draws anew for every
    batch (from a counter saved with the model, so a resumed run draws the same); evaluation uses
    one fixed draw per length, the same for every model and seed."""

    def __init__(self, head_dim: int, max_positions: int) -> None:
        super().__init__(head_dim)
        self.max_positions = check_int("max_positions", max_positions, minimum=1)
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))
        self._positions: torch.Tensor | None = None

    def draw(self, length: int, *, training: bool) -> None:
        """Positions for the next forward pass of ``length`` tokens."""
        if length > self.max_positions:
            raise ValueError(f"an input of {length} tokens needs more than max_positions={self.max_positions} positions; "
                             "train with a larger randomized_positions")
        seed = 1_000_003 * int(self.draws) + 17 if training else 7_919 * length + 3
        generator = torch.Generator().manual_seed(seed)
        self._positions = torch.randperm(self.max_positions, generator=generator)[:length].sort().values  # (L,)
        if training:
            self.draws += 1

    def rotate(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        if self._positions is None:
            raise ValueError("RandomizedRotary.rotate before draw(length): the model draws the positions in forward")
        positions = self._positions[start : start + x.shape[-2]].to(x.device)  # (L,)
        cos, sin = self.cos_sin(positions)  # (L, d) each
        return apply_rotation(x, cos, sin, interleaved=self.interleaved)  # (..., L, d)


class Block(nn.Module):
    def __init__(self, config: LMConfig, position) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim)
        self.attn = MultiheadAttention(config.dim, config.heads, position=position, causal=True)
        self.mlp_norm = nn.RMSNorm(config.dim)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, config.ff_mult * config.dim), nn.GELU(), nn.Linear(config.ff_mult * config.dim, config.dim)
        )

    def forward(self, x: torch.Tensor, position_bias=None, cache: KVCache | None = None):
        h, position_bias = self.attn(self.attn_norm(x), position_bias=position_bias, cache=cache)
        x = x + h  # (B, L, D)
        return x + self.mlp(self.mlp_norm(x)), position_bias


class TransformerLM(nn.Module):
    """Byte-level causal LM; ``forward(tokens (B, L)) -> logits (B, L, vocab)``."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        head_dim = config.dim // config.heads
        # The shared layers draw from the generator first, the encoding's own parameters after them:
        # under one seed every model starts from the same embeddings, attention and MLP weights,
        # whatever extra parameters its encoding has (a learned table, T5's buckets, Shaw's vectors).
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config, None) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        scope = registry.get(config.encoding).scope
        self.absolute = _build(config, head_dim) if scope == "input" else None
        self.position = _build(config, head_dim) if scope == "shared" else None
        if config.randomized_positions:
            self.position = RandomizedRotary(head_dim, config.randomized_positions)
        for block in self.blocks:  # a per-layer encoding (Shaw, forgetting gates, CoPE) is built for each block
            position = _build(config, head_dim) if scope == "layer" else self.position
            block.attn._check_position(position)
            block.attn.position = position

    def shared_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters every encoding's model has (all but the encoding's own), by name."""
        own = ("absolute.", "position.")
        return {n: p for n, p in self.named_parameters() if not n.startswith(own) and ".attn.position." not in n}

    def max_length(self) -> int | None:
        """The longest input this model can represent (``None``: unbounded)."""
        if self.config.randomized_positions:
            return self.config.randomized_positions
        return self.config.train_len if self.config.encoding == "learned" else None

    def embed_tokens(self, tokens: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        """Token embeddings times ``sqrt(dim)``, plus the absolute embedding if any: ``(B, L, D)``.

        The scale is Vaswani et al.'s (section 3.4; fairseq, the ALiBi paper's code, does the same):
        the tied table is initialised at std 0.02, so unscaled token vectors (norm ~0.02 sqrt(D))
        would be drowned by a sinusoidal table whose rows have norm sqrt(D / 2). Every model gets
        the scale, so the encoding stays the only difference between them.
        """
        x = self.embed(tokens) * self.config.dim**0.5  # (B, L, D)
        if self.absolute is not None:
            x = self.absolute(x, offset=offset)
        return x

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        offset = 0 if caches is None else caches[0].length
        if isinstance(self.position, RandomizedRotary) and offset == 0:
            self.position.draw(tokens.shape[1], training=self.training)
        x = self.embed_tokens(tokens, offset=offset)  # (B, L, D)
        position_bias = None
        for i, block in enumerate(self.blocks):
            x, position_bias = block(x, position_bias, None if caches is None else caches[i])
        return F.linear(self.norm(x), self.embed.weight)  # (B, L, vocab), tied output layer
