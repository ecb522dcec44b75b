"""Attention backends: ``dispatch`` (``relpos.attention``: validation, the backend choice, eager and SDPA),
the fused CPU kernels, FlexAttention, tiles, masks, dropout and denormal flushing."""
