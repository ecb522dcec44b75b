"""Mutation check: seed realistic bugs into relpos, one at a time, and see whether the tests notice.

Each mutant is one patch, ``(file, old text, new text, what the bug is, which tests)``, applied to
a temporary copy of the source tree (never the real one). The copy's tests run against the
mutated copy; a mutant is *caught* when they fail (stopping at the first failure) and *survives*
when they all pass. A patch whose old text is no longer in the file is reported as stale (the
code moved: update the entry). Not part of the default test suite: it runs the relevant test
files once per mutant (minutes).

    python tools/mutate.py                       # every mutant, 2 at a time, writes docs/mutation.md
    python tools/mutate.py --only dropout hf     # mutants whose id starts with one of these
    python tools/mutate.py --list                # the mutants and their tests, nothing run

Adding a mutant is one line in ``MUTANTS``; a new area (vision, families, an encoding) names its
test files once in ``SUITES``. ``old`` is exact text, or a regular expression when it starts with
``re:`` (for code another branch is rewriting: match it robustly).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: area -> the test files that should notice a bug there (paths relative to the repository root)
SUITES: dict[str, tuple[str, ...]] = {
    "buckets": ("tests/encodings/test_buckets.py", "tests/encodings/test_t5_bias.py", "src/relpos/encodings/buckets.py"),
    "bias": ("tests/encodings/test_t5_bias.py", "tests/backends/test_attention.py", "tests/backends/test_backends.py", "src/relpos/core/bias.py"),
    "tiles": ("tests/backends/test_real_inputs.py", "tests/backends/test_backends.py", "src/relpos/backends/_tiles.py"),
    "dropout": ("tests/backends/test_dropout.py", "tests/backends/test_real_inputs.py", "tests/layers/test_mha_matrix.py"),
    "fused": ("tests/backends/test_backends.py", "tests/backends/test_real_inputs.py"),
    "masks": ("tests/backends/test_attention.py", "tests/backends/test_real_inputs.py", "tests/layers/test_mha_matrix.py"),
    "alibi": ("tests/encodings/test_encodings.py", "tests/backends/test_backends.py", "tests/layers/test_mha_matrix.py", "src/relpos/encodings/alibi.py"),
    "rotary": ("tests/encodings/test_encodings.py", "tests/encodings/test_rope_scaling.py", "tests/layers/test_mha_matrix.py"),
    "shaw": ("tests/encodings/test_encodings.py", "tests/layers/test_mha_matrix.py", "src/relpos/encodings/shaw.py"),
    "windows": ("tests/encodings/test_windows.py", "tests/backends/test_attention.py", "tests/layers/test_mha_matrix.py", "src/relpos/encodings/windows.py"),
    "mha": ("tests/layers/test_mha.py", "tests/layers/test_mha_matrix.py"),
    "hf": ("tests/hf/test_hf.py",),
    "kerple": ("tests/encodings/test_kerple.py", "src/relpos/encodings/kerple.py"),
    "sandwich": ("tests/encodings/test_sandwich.py", "src/relpos/encodings/sandwich.py"),
    "fire": ("tests/encodings/test_fire.py", "src/relpos/encodings/fire.py"),
    "xpos": ("tests/encodings/test_xpos.py", "src/relpos/encodings/xpos.py"),
    "forgetting": ("tests/encodings/test_forgetting.py", "src/relpos/encodings/forgetting.py"),
    "cope": ("tests/encodings/test_cope.py", "src/relpos/encodings/cope.py"),
    "decomposed": ("tests/encodings/test_decomposed.py", "src/relpos/encodings/decomposed.py"),
    "rotary2d": ("tests/encodings/test_rotary2d.py", "src/relpos/encodings/rotary2d.py"),
    "window_attention": ("tests/layers/test_window_attention.py", "src/relpos/layers/window_attention.py"),
    "window_bias": ("tests/encodings/test_resize.py", "tests/encodings/test_windows.py", "src/relpos/encodings/resize.py", "src/relpos/encodings/window_bias.py"),
    "hf_alibi": ("tests/hf/test_hf_alibi.py",),
    "hf_udop": ("tests/hf/test_hf_udop.py",),
    "hf_longt5": ("tests/hf/test_hf_longt5.py",),
    "denormals": ("tests/backends/test_denormals.py", "tests/backends/test_backends.py", "src/relpos/backends/_denormals.py"),
    "hf_switch": ("tests/hf/test_hf_switch_transformers.py",),
    "hf_pop2piano": ("tests/hf/test_hf_pop2piano.py",),
    "hf_pix2struct": ("tests/hf/test_hf_pix2struct.py",),
    "hf_sam": ("tests/hf/test_hf_sam.py",),
    "hf_swin": ("tests/hf/test_hf_swin.py",),
    "distributed": ("tests/distributed/test_ring.py",),
    "triton": ("tests/backends/test_triton.py",),
    "padding": ("tests/backends/test_uniform_padding.py", "tests/backends/test_fuzz.py", "tests/backends/test_real_inputs.py"),
    "fuzz_windows": ("tests/layers/test_window_attention.py",),
    "fuzz_hf": ("tests/hf/test_fuzz_hf.py", "tests/hf/test_hf_alibi.py"),
    "hf_static": ("tests/hf/test_hf_static_cache.py", "tests/hf/test_hf_alibi_static_cache.py"),
    "fused_tile": ("tests/backends/test_backends.py", "tests/distributed/test_ring.py"),
    "process": ("tests/distributed/test_exit_process.py",),
    "decomposed_triton": ("tests/encodings/test_decomposed_triton.py",),
    "key_bias": ("tests/backends/test_triton.py::test_key_bias_forward_and_gradients_equal_the_fp64_oracle",
                 "tests/hf/test_hf_alibi.py::test_on_the_kernels_device_a_prompt_takes_the_per_key_alibi_in_the_kernel"),
}


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to src/relpos/
    old: str  # exact text, or "re:<pattern>"
    new: str  # replacement (a regex replacement when old is a pattern)
    bug: str  # what a reviewer would call the bug
    suite: str  # key of SUITES


MUTANTS: list[Mutant] = [
    Mutant("buckets-sign-off-by-one", "encodings/buckets.py", "sign_offset = (relative_position > 0).long() * half", "sign_offset = (relative_position >= 0).long() * half", "t5_bucket: offset 0 counted as a future key (off by one)", "buckets"),
    Mutant("buckets-last-bucket-off-by-one", "encodings/buckets.py", "far = _far_buckets(distance, max_exact, half, max_distance, strategy).clamp(max=half - 1)", "far = _far_buckets(distance, max_exact, half, max_distance, strategy).clamp(max=half)", "t5_bucket: far distances spill one bucket past their half (off by one)", "buckets"),
    Mutant("buckets-round-not-floor", "encodings/buckets.py", "return max_exact + scaled.to(torch.long)", "return max_exact + scaled.round().to(torch.long)", "t5_bucket: the log bucket rounded instead of floored", "buckets"),
    Mutant("bias-dense-flip", "core/bias.py", "return self.hankel().flip(-2)  # (1, H, Lq, Lk)", "return self.hankel().flip(-1)  # (1, H, Lq, Lk)", "OffsetBias.dense flips the keys instead of the queries (offsets mirrored)", "bias"),
    Mutant("bias-row-index", "core/bias.py", "start = self.query_length - 1 - i", "start = i", "OffsetBias.row reads row i of the Hankel view, not of the bias", "bias"),
    Mutant("bias-mask-future-diagonal", "core/bias.py", "future = self.offsets() > 0  # (n,)", "future = self.offsets() >= 0  # (n,)", "mask_future also masks the diagonal (a query cannot see itself)", "bias"),
    Mutant("tiles-hankel-offset", "backends/_tiles.py", "return self.k0 - self.r1 + query_length", "return self.k0 - self.r0 + query_length", "a tile's Hankel view starts at its first row instead of its last", "tiles"),
    Mutant("tiles-group-first-key", "backends/_tiles.py", "if groups and (groups[-1][2], groups[-1][3]) == (s, e):", "if groups and groups[-1][2] == s:", "key-padding tiles group examples by their first kept key only", "tiles"),
    Mutant("tiles-causal-chunk-end", "backends/_tiles.py", "tiles.append(Tile(b0, b1, r0, r1, start, q_offset + r1))", "tiles.append(Tile(b0, b1, r0, r1, start, q_offset + r1 - 1))", "a causal chunk's keys stop one before its last query", "tiles"),
    Mutant("dropout-seed-no-example", "backends/_dropout.py", "gen.manual_seed(hash((seed, b, g)) & (2**63 - 1))", "gen.manual_seed(hash((seed, g)) & (2**63 - 1))", "the keep-mask seed without the example index: every example shares one mask", "dropout"),
    Mutant("dropout-seed-no-group", "backends/_dropout.py", "gen.manual_seed(hash((seed, b, g)) & (2**63 - 1))", "gen.manual_seed(hash((seed, b)) & (2**63 - 1))", "the keep-mask seed without the row group: every 64 rows repeat", "dropout"),
    Mutant("dropout-fused-no-rescale", "backends/_fused.py", "return keep.flip(1).to(dtype) / (1.0 - effective_p(p))", "return keep.flip(1).to(dtype)", "fused dropout: kept weights not scaled by 1/(1-p)", "dropout"),
    Mutant("dropout-eager-no-rescale", "backends/_dropout.py", "return weights * keep / (1.0 - effective_p(p))", "return weights * keep", "eager and Shaw dropout: kept weights not scaled by 1/(1-p)", "dropout"),
    Mutant("fused-backward-no-delta", "backends/_fused.py", "ds = dp.sub_(delta[:, a:c]).mul_(p)", "ds = dp.mul_(p)", "fused backward: dS misses the rowsum(dO * O) term", "fused"),
    Mutant("fused-backward-shared-head0", "backends/_fused.py", "per_head = ds.sum(0, keepdim=True) if shared else ds", "per_head = ds[:1] if shared else ds", "fused backward: a bias shared by all heads gets head 0's gradient only", "fused"),
    Mutant("fused-backward-dropout-dv", "backends/_fused.py", "dvb.baddbmm_(p.mul(z).transpose(1, 2), gb)", "dvb.baddbmm_(p.transpose(1, 2), gb)", "fused backward with dropout: dv ignores the dropout mask", "fused"),
    Mutant("masks-key-mask-inverted", "backends/_masks.py", "keep = key_mask.view(key_mask.shape[0], 1, 1, key_mask.shape[1])", "keep = ~key_mask.view(key_mask.shape[0], 1, 1, key_mask.shape[1])", "key_mask folded in inverted (padding attended, real tokens hidden)", "masks"),
    Mutant("masks-eager-causal-diagonal", "backends/dispatch.py", "blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=query.device) > 0", "blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=query.device) >= 0", "the dense causal mask hides the diagonal", "masks"),
    Mutant("alibi-slopes-off-by-one", "encodings/alibi.py", "return [start ** (k + 1) for k in range(n)]", "return [start ** k for k in range(n)]", "ALiBi slopes start at 1 (k from 0)", "alibi"),
    Mutant("alibi-symmetric-sign", "encodings/alibi.py", "else -relative_position.abs()", "else relative_position.abs()", "symmetric ALiBi rewards distance instead of penalising it", "alibi"),
    Mutant("rotary-layout-swap", "encodings/rotary.py", "if interleaved:\n        pairs = xf.unflatten", "if not interleaved:\n        pairs = xf.unflatten", "RoPE rotates half-split channels as interleaved pairs (and back)", "rotary"),
    Mutant("shaw-index-sign", "encodings/shaw.py", "return rel.clamp(-self.max_distance, self.max_distance) + self.max_distance  # (Lq, Lk)", "return (-rel).clamp(-self.max_distance, self.max_distance) + self.max_distance  # (Lq, Lk)", "Shaw indexes its tables by query - key", "shaw"),
    Mutant("shaw-mha-no-dropout", "layers/mha.py", "q, k, v, causal=causal, attn_mask=attn_mask, scale=self.scale, q_offset=q_offset, dropout_p=self._dropout_p()", "q, k, v, causal=causal, attn_mask=attn_mask, scale=self.scale, q_offset=q_offset, dropout_p=0.0", "MultiheadAttention skips dropout on Shaw's path (the issue's silent bug)", "mha"),
    Mutant("windows-index-sign", "encodings/windows.py", "rel = coords[:, :, None] - coords[:, None, :]  # (ndim, N, N): query - key", "rel = coords[:, None, :] - coords[:, :, None]  # (ndim, N, N): query - key", "Swin's window index built from key - query", "windows"),
    Mutant("windows-index-radix", "encodings/windows.py", "index = index * (2 * size - 1) + rel[axis] + size - 1", "index = index * (2 * sizes[0] - 1) + rel[axis] + size - 1", "Swin's mixed radix uses the window height for every axis", "windows"),
    Mutant("mha-rope-keys-at-zero", "layers/mha.py", "position, k_offset = self.position, 0 if cross else q_offset", "position, k_offset = self.position, 0", "MultiheadAttention rotates cached decoding's new keys as position 0", "mha"),
    Mutant("mha-cross-causal", "layers/mha.py", "causal = self.causal and memory is None", "causal = self.causal", "a causal layer also masks cross-attention to the memory", "mha"),
    Mutant("mha-cache-order", "layers/mha.py", "self.key = torch.cat([self.key, key], dim=-2)", "self.key = torch.cat([key, self.key], dim=-2)", "KVCache puts the new keys before the cached ones", "mha"),
    Mutant("hf-offsets-lengths-swapped", "hf/_t5like.py", "*offset_range(query_length, key_length, q_offset), bidirectional=bidirectional,", "*offset_range(key_length, query_length, q_offset), bidirectional=bidirectional,", "relpos.hf's per-offset bias with query and key lengths swapped (wrong only when decoding)", "hf"),
    # encodings (Kerple, Sandwich, FIRE, xPos, forgetting gates, CoPE)
    Mutant("kerple-log-power-swapped", "encodings/kerple.py", 'if self.kind == "log":', 'if self.kind == "power":', "Kerple: kind='log' computes the power form and vice versa", "kerple"),
    Mutant("kerple-one-sided-distance", "encodings/kerple.py", "distance = relative_position.abs().to(r1.dtype)[None, :]", "distance = (-relative_position).clamp(min=0).to(r1.dtype)[None, :]", "Kerple: |i - j| taken as i - j clamped at 0 (right only when causal: future keys get no penalty)", "kerple"),
    Mutant("kerple-r1-clamp-missing", "encodings/kerple.py", "r1 = self.r1.clamp(min=EPS)[:, None]  # (H, 1)", "r1 = self.r1[:, None]  # (H, 1)", "Kerple: r1 not clamped to [1e-2, inf) (a negative r1 rewards distance)", "kerple"),
    Mutant("sandwich-head-scale-off-by-one", "encodings/sandwich.py", "heads = torch.arange(1, self.num_heads + 1,", "heads = torch.arange(2, self.num_heads + 2,", "Sandwich: the head scale 8 h'/H counts heads from 2 (off by one)", "sandwich"),
    Mutant("fire-normalizer-L-always", "encodings/fire.py", "normalizer = self._psi(torch.maximum(positions, self.threshold())) + self.eps  # (Lq,)", "normalizer = (self._psi(self.threshold()) + self.eps).expand_as(positions)  # (Lq,)", "FIRE: rows past L normalized by psi(L), not psi(max(L, i))", "fire"),
    Mutant("fire-per-offset-boundary", "encodings/fire.py", "return q_offset + query_length - 1 <= float(self.threshold().detach())", "return q_offset + query_length - 2 <= float(self.threshold().detach())", "FIRE: the per-offset path also taken when the last query is at L + 1 (off by one)", "fire"),
    Mutant("xpos-key-scaled-up", "encodings/xpos.py", "scale = self.scale(-positions if downscale else positions)  # (L, d)", "scale = self.scale(positions)  # (L, d)", "xPos: the key scaled up by zeta^(m/gamma) instead of down", "xpos"),
    Mutant("xpos-query-offset-dropped", "encodings/xpos.py", "return self.rotate(q, q_offset), self.rotate(k, 0, downscale=True)", "return self.rotate(q, 0), self.rotate(k, 0, downscale=True)", "xPos: a decoding step's queries at position 0 (offset of cached positions ignored)", "xpos"),
    Mutant("forgetting-exclusive-cumsum", "encodings/forgetting.py", "c = self.log_forget(x).cumsum(-1)  # (B, H, L)", "c = self.log_forget(x).cumsum(-1) - self.log_forget(x)  # (B, H, L)", "forgetting gates: c_i sums log f up to i - 1 (off by one)", "forgetting"),
    Mutant("forgetting-gate-sign", "encodings/forgetting.py", "column = (-key_gate / scale).to(dtype)", "column = (key_gate / scale).to(dtype)", "forgetting gates: the key column carries +c_j instead of -c_j", "forgetting"),
    Mutant("cope-cumsum-direction", "encodings/cope.py", "pos = gates.flip(-1).cumsum(-1).flip(-1)", "pos = gates.cumsum(-1)", "CoPE: gates summed from the first key instead of back from the query", "cope"),
    # vision (decomposed SAM / ViTDet positions, 2D RoPE, windows, table resizing)
    Mutant("decomposed-rel-h-w-swapped", "encodings/decomposed.py", "return (rel_h[..., :, None] + rel_w[..., None, :]).flatten(-2)", "return (rel_w[..., :, None] + rel_h[..., None, :]).flatten(-2)", "decomposed bias: rel_w added along key rows, rel_h along key columns", "decomposed"),
    Mutant("decomposed-fold-key-row-col", "encodings/decomposed.py", "F.one_hot(rows // kw, kh), F.one_hot(rows % kw, kw)", "F.one_hot(rows % kh, kh), F.one_hot(rows // kh, kw)", "decomposed fold: key k's row and column read column-major", "decomposed"),
    Mutant("decomposed-sam-resize-scales", "encodings/decomposed.py", "q_scale, k_scale = max(k_size / q_size, 1.0), max(q_size / k_size, 1.0)", "q_scale, k_scale = max(q_size / k_size, 1.0), max(k_size / q_size, 1.0)", "SAM's get_rel_pos: query and key coordinate scales swapped (q_size != k_size)", "decomposed"),
    Mutant("rotary2d-prefix-rotated", "encodings/rotary2d.py", "prefix, patches = x[..., :num_prefix_tokens, :], x[..., num_prefix_tokens:, :]", "prefix, patches = x[..., x.shape[-2] - num_prefix_tokens:, :], x[..., : x.shape[-2] - num_prefix_tokens, :]", "2D RoPE: the class token rotated as patch 0, the last patch left unrotated", "rotary2d"),
    Mutant("rotary2d-axial-row-col-swapped", "encodings/rotary2d.py", "return torch.cat([y[:, None] * bands, x[:, None] * bands], -1)  # (N, d/2)", "return torch.cat([x[:, None] * bands, y[:, None] * bands], -1)  # (N, d/2)", "axial 2D RoPE: the first quarter of pairs rotated by the column, not the row", "rotary2d"),
    Mutant("rotary2d-dinov3-row-col-swapped", "encodings/rotary2d.py", "torch.cat([centre_y[:, None] * inv_freq, centre_x[:, None] * inv_freq], -1)", "torch.cat([centre_x[:, None] * inv_freq, centre_y[:, None] * inv_freq], -1)", "DINOv3 2D RoPE: row and column coordinates swapped", "rotary2d"),
    Mutant("window-roll-direction", "layers/window_attention.py", "shifts=(-self.shift_size[0], -self.shift_size[1])", "shifts=(self.shift_size[0], self.shift_size[1])", "shifted windows: the map rolled forward instead of back before partitioning", "window_attention"),
    Mutant("window-shift-mask-boundary", "layers/window_attention.py", "(index >= size - shift).long()", "(index > size - shift).long()", "shift mask: the region boundary one row/column late (off by one)", "window_attention"),
    Mutant("window-merge-order", "layers/window_attention.py", "x = windows.view(b, height // wh, width // ww, wh, ww, c).transpose(2, 3)", "x = windows.view(b, height // wh, wh, width // ww, ww, c)", "window_merge: windows reassembled without undoing the partition's transpose", "window_attention"),
    Mutant("resize-class-token-misplaced", "encodings/resize.py", "return torch.cat([resized.reshape(heads, -1).T, tail])  # (T', H)", "return torch.cat([tail, resized.reshape(heads, -1).T])  # (T', H)", "resize_bias_table: BEiT's class-token rows put before the resized grid", "window_bias"),
    Mutant("resize-class-token-dropped", "encodings/resize.py", "return torch.cat([resized.reshape(heads, -1).T, tail])  # (T', H)", "return resized.reshape(heads, -1).T  # (T', H)", "resize_bias_table: BEiT's class-token rows dropped", "window_bias"),
    Mutant("window-bias-class-entries", "encodings/window_bias.py", "index[0, :] = first  # class token -> patches", "index[0, :] = first + 1  # class token -> patches", "BEiT table: class -> patch reads the patch -> class entry", "window_bias"),
    # transformers families: ALiBi (Bloom, MPT, Falcon), T5-like, SAM / ViTDet, Swin
    Mutant("hf-alibi-bloom-slopes-off-by-one", "hf/bloom.py", "alibi = build(torch.ones(1, 2, device=\"cpu\"), module.num_heads, torch.float32)  # (H, 1, 2): slopes * [0, 1]\n    return alibi[:, 0, 1].tolist()", "alibi = build(torch.ones(1, 2, device=\"cpu\"), module.num_heads + 1, torch.float32)  # (H, 1, 2): slopes * [0, 1]\n    return alibi[1:, 0, 1].tolist()", "Bloom adapter: slopes built for H + 1 heads, first dropped (off by one)", "hf_alibi"),
    Mutant("hf-alibi-mpt-slopes-off-by-one", "hf/mpt.py", "(-build(module.n_heads, 2, device=torch.device(\"cpu\"))[:, 0, 0])", "(-build(module.n_heads + 1, 2, device=torch.device(\"cpu\"))[1:, 0, 0])", "MPT adapter: slopes built for H + 1 heads, first dropped (off by one)", "hf_alibi"),
    Mutant("hf-alibi-q-offset-cache", "hf/alibi.py", "    q_offset = key_length - query_length\n", "    q_offset = 0\n", "ALiBi adapters: queries at position 0 during cached decoding (q_offset dropped)", "hf_alibi"),
    Mutant("hf-alibi-left-padding-start", "hf/alibi.py", "dead = (rows[None, :] < first[:, None])[:, None, :, None]  # (B, 1, Lq, 1)", "dead = (rows[None, :] <= first[:, None])[:, None, :, None]  # (B, 1, Lq, 1)", "ALiBi adapters, left padding: the query at the first real token counted as a fully masked row", "hf_alibi"),
    Mutant("hf-attention-q-offset-dropped", "hf/_attention.py", "q_offset = bias.q_offset if isinstance(bias, OffsetBias) else", "q_offset = 0 if isinstance(bias, OffsetBias) else", "relpos attention function: the per-offset bias' query offset dropped (wrong when decoding)", "hf"),
    Mutant("hf-udop-decoder-bidirectional", "hf/udop.py", "bidirectional=lambda module: not module.is_decoder,", "bidirectional=lambda module: True,", "UDOP adapter: decoder buckets bidirectional", "hf_udop"),
    Mutant("hf-udop-layout-bias-ignored", "hf/_attention.py", "return position_bias  # a dense bias", "return None  # a dense bias", "relpos attention function drops a dense bias (UDOP's encoder 1D + 2D layout bias ignored)", "hf_udop"),
    Mutant("hf-longt5-decoder-bidirectional", "hf/longt5.py", "bidirectional=lambda module: not module.is_decoder,", "bidirectional=lambda module: True,", "LongT5 adapter: decoder buckets bidirectional", "hf_longt5"),
    Mutant("denormals-calling-thread-only", "backends/_denormals.py", "    if _TEAM[0] is not None and torch.get_num_threads() > 1:", "    if False:", "denormal flushing set on the calling thread only (torch's OpenMP workers keep computing denormals)", "denormals"),
    Mutant("denormals-not-restored", "backends/_denormals.py", "    finally:\n        _set_everywhere(False)", "    finally:\n        pass", "the caller's denormal setting not restored after relpos's kernel", "denormals"),
    Mutant("fused-frozen-backward-swapped", "backends/_fused.py", "dq[b0:b1, :, a0:a1] = gq", "dq[b0:b1, :, a0:a1] = gq.flip(-2)", "frozen-bias training path: query gradients of a tile written in the wrong row order", "denormals"),
    Mutant("hf-udop-layout-tile-rows", "hf/udop.py", "c.positions[:, start:stop, None]", "c.positions[:, : stop - start, None]", "UDOP adapter: every query tile's layout distances taken from the first tile's boxes", "hf_udop"),
    Mutant("hf-longt5-locality-radius", "hf/longt5.py", "near = (bias.local + torch.where(locality, 0.0, _MASKED))", "near = (bias.local + torch.where(locality, 0.0, 0.0))", "LongT5 adapter: chunks without padding see their whole 3-block window, past local_radius", "hf_longt5"),
    Mutant("hf-longt5-side-block-ids", "hf/longt5.py", "- ids[..., None].long()  # (B, n, G)", "- ids[..., None].long() - 1  # (B, n, G)", "LongT5 adapter: global tokens' offsets from the wrong block", "hf_longt5"),
    Mutant("hf-switch-decoder-bidirectional", "hf/switch_transformers.py", "bidirectional=lambda module: not module.is_decoder,", "bidirectional=lambda module: True,", "Switch Transformers adapter: decoder buckets bidirectional", "hf_switch"),
    Mutant("hf-pop2piano-decoder-bidirectional", "hf/pop2piano.py", "bidirectional=lambda module: not module.is_decoder,", "bidirectional=lambda module: True,", "Pop2Piano adapter: decoder buckets bidirectional", "hf_pop2piano"),
    Mutant("hf-pix2struct-decoder-bidirectional", "hf/pix2struct.py", "bidirectional=lambda module: False,", "bidirectional=lambda module: True,", "Pix2Struct adapter: text decoder buckets bidirectional", "hf_pix2struct"),
    Mutant("hf-sam-grid-swapped", "hf/sam.py", "module.rel_pos_w, (height, width))", "module.rel_pos_w, (width, height))", "SAM / ViTDet adapter: the grid passed as (width, height) (wrong on non-square maps)", "hf_sam"),
    Mutant("hf-sam-dropout-in-eval", "hf/sam.py", "if uses_dropout and module.training else 0.0", "if uses_dropout else 0.0", "SAM adapter: attention dropout applied in eval", "hf_sam"),
    Mutant("hf-swin-shift-mask-ignored", "hf/swin.py", "mask = kind.mask_repeats * attention_mask[:, None]  # (nW, 1, N, N)", "mask = 0 * attention_mask[:, None]  # (nW, 1, N, N)", "Swin adapter: the shifted-window mask not applied", "hf_swin"),
    Mutant("hf-swin-v2-mask-once", "hf/swin.py", "re:\\), 2, continuous=True\\)", "), 1, continuous=True)", "Swin V2 adapter: the shift mask added once (transformers adds it twice)", "hf_swin"),
    # --- added with the Triton kernel, the fuzzing and the batch-of-one fix (issues 34 and 36) ---
    Mutant("padding-single-tile-all-keys", "backends/_fused.py", "query.flip(-2), key[:, :, k0:k1], value[:, :, k0:k1],", "query.flip(-2), key, value,", "one tile for the whole batch (a batch of one, or padding alike): every key handed to SDPA with the kept keys' bias (the issue's crash)", "padding"),
    Mutant("padding-empty-tiles-detached", "backends/_fused.py", "return query.new_zeros(batch, heads, query_length, value.shape[-1]) + anchor.to(query.dtype)", "return query.new_zeros(batch, heads, query_length, value.shape[-1])", "every example all padding: zeros outside the autograd graph (backward raises)", "padding"),
    Mutant("padding-empty-tiles-nan", "backends/_fused.py", "finite = torch.nan_to_num(values, neginf=0.0, posinf=0.0)", "finite = values", "every example all padding, causal: 0 * -inf from the folded causal mask makes the output NaN", "padding"),
    Mutant("windows-shift-mask-width-height", "layers/window_attention.py", "mask = shift_mask(height, width, self.window_size, self.shift_size,", "mask = shift_mask(width, height, self.window_size, self.shift_size,", "Swin's shift mask built for (width, height) (wrong on non-square maps)", "fuzz_windows"),
    Mutant("windows-v2-pretrained-axes-swapped", "encodings/window_bias.py", "for size, base in zip(window, pretrained):", "for size, base in zip(window, pretrained[::-1]):", "Swin V2: the pretrained window's height and width swapped", "window_bias"),
    Mutant("rotary2d-reference-grid-axis", "encodings/rotary2d.py", "y, x = y / height * self.ref_grid[0], x / width * self.ref_grid[1]", "y, x = y / width * self.ref_grid[0], x / height * self.ref_grid[1]", "axial 2D RoPE: the reference grid scaled with the wrong axis (wrong on non-square grids)", "rotary2d"),
    Mutant("sandwich-cache-not-regrown-at-size", "encodings/sandwich.py", "cached.numel() <= farthest:", "cached.numel() < farthest:", "Sandwich: the distance cache not regrown when a length equals its size exactly", "sandwich"),
    Mutant("hf-alibi-all-padding-example-real", "hf/alibi.py", "first = torch.where(key_mask.any(-1), key_mask.int().argmax(-1), key_mask.shape[-1])  # (B,)", "first = key_mask.int().argmax(-1)  # (B,)", "ALiBi adapters: an all-padding example treated like a real one (its rows not dead)", "fuzz_hf"),
    Mutant("t5-bucket-ramp-centre-off-by-one", "encodings/buckets.py", "centre = ramp.numel() // 2  # the index of offset 0", "centre = ramp.numel() // 2 + 1  # the index of offset 0", "T5: the kept buckets read one offset late (every offset takes its right neighbour's bucket)", "buckets"),
    Mutant("bias-flat-indices-off-by-one", "core/bias.py", "base = self.q_offset + self.query_length - 1  # index of offset 0", "base = self.q_offset + self.query_length  # index of offset 0", "OffsetBias.flat_indices one entry late: a tile one past the flat range reads the far value", "triton"),
    Mutant("t5-flat-range-too-near", "encodings/t5.py", "return OffsetBias(values, query_length, key_length, q_offset, flat=(-self.max_distance, far))", "return OffsetBias(values, query_length, key_length, q_offset, flat=(-self.max_distance + 1, far))", "T5 marks offset 1 - max_distance flat, though it has a bucket of its own", "triton"),
    Mutant("triton-flat-segment-late", "backends/_triton.py", "a = t_lo - BN + 1 + m0 - Lq + 1  # the last n0", "a = t_lo - BN + 2 + m0 - Lq + 1  # the last n0", "Triton forward: a key block one past the low flat range takes its scalar", "triton"),
    Mutant("triton-causal-diagonal-visible", "backends/_triton.py", "        keep = keep & (cols <= rows + q_offset)", "        keep = keep & (cols <= rows + q_offset + 1)", "Triton: the causal mask lets each query see the next key", "triton"),
    Mutant("triton-slopes-natural-units", "backends/_triton.py", "slope = tl.load(SLOPES + h) * _LOG2E\n    drop_bh = pid_bh  # dropout", "slope = tl.load(SLOPES + h)\n    drop_bh = pid_bh  # dropout", "Triton, ALiBi: the forward reads the slopes in natural units while the scores are in base 2 (the bias 1/ln 2 too weak)", "triton"),
    Mutant("triton-gather-natural-units", "backends/_triton.py", "padded = torch.nn.functional.pad(values.float(), (PAD, PAD)).mul_(LOG2E)", "padded = torch.nn.functional.pad(values.float(), (PAD, PAD))", "Triton: per-offset values left in natural units while the scores are in base 2", "triton"),
    Mutant("dispatch-mask-memo-ignores-version", "_reuse.py", "tensor.dtype, tensor.device, tensor._version", "tensor.dtype, tensor.device", "a kept result (the SDPA mask of a masked call) reused after its padding mask changed in place", "masks"),
    Mutant("triton-split-flat-fresh-state", "backends/_triton.py", "        m_i = tl.where(lse_1 < float(\"inf\"), lse_1, float(\"-inf\"))", "        m_i = tl.full([BM], float(\"-inf\"), tl.float32)", "Triton forward in two launches: the second starts a fresh softmax instead of from the first's output and log-sum-exp", "triton"),
    Mutant("triton-gather-split-same-keys", "backends/_triton.py", "n0 + part * (BN // GS), lo, hi, stride_kn, stride_vn, q_offset, qk_scale,\n                                          seed, drop_bh, drop_t, kb_row,\n                                          D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, False", "n0, lo, hi, stride_kn, stride_vn, q_offset, qk_scale,\n                                          seed, drop_bh, drop_t, kb_row,\n                                          D, DV, D_PAD, DV_PAD, MAIN, CAUSAL, False", "Triton forward, gather_split 2: both half steps of a gathering block read its first half's keys", "triton"),
    Mutant("triton-dropout-halves-swapped", "backends/_triton.py", "words = tl.join(tl.join(w0, w1), tl.join(w2, w3))", "words = tl.join(tl.join(w1, w0), tl.join(w3, w2))", "Triton dropout: keys j and j + 8 of each 16 x 16 square read each other's Philox word", "triton"),
    Mutant("triton-dropout-group-base", "backends/_triton.py", "gi = m0 // 2 + tl.arange(0, BM // 2)", "gi = m0 // 2 + 8 + tl.arange(0, BM // 2)", "Triton dropout: each 16-row band of queries draws at the next band's counter", "triton"),
    Mutant("dispatch-key-mask-read-back", "backends/dispatch.py", "    if (key_mask is None or attn_mask is not None or compiling or isinstance(bias, torch.Tensor)\n", "    if (True or key_mask is None or attn_mask is not None or compiling or isinstance(bias, torch.Tensor)\n", "a key padding mask on a GPU read back to the CPU as key ranges (a wait for the GPU per call)", "triton"),
    Mutant("triton-mask-bounds-end", "backends/_triton.py", "ends = torch.where(key_mask, index + 1, 0).amax(-1)  # (B,)", "ends = torch.where(key_mask, index, 0).amax(-1)  # (B,)", "Triton, a key mask read on the device: each example's last kept key falls outside its range", "triton"),
    Mutant("triton-dq-at-q-strides", "backends/_triton.py", "tl.store(DQ + pid_bh * Lq * D + offs_m[:, None] * D + offs_d[None, :],", "tl.store(DQ + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],", "Triton backward: dq written at q's strides into a contiguous buffer (fused q/k/v views: past its end)", "triton"),
    Mutant("triton-symmetric-sign", "backends/_triton.py", "t = qk * qk_scale - slope * tl.abs(_as_float(cols - rows, KIND >= 8))", "t = qk * qk_scale + slope * tl.abs(_as_float(cols - rows, KIND >= 8))", "Triton, symmetric ALiBi: the distance added instead of subtracted", "triton"),
    Mutant("triton-dq-no-delta", "backends/_triton.py", "ds = p * (dp - delta[:, None])  # the score gradient, natural units", "ds = p * dp  # the score gradient, natural units", "Triton backward: dS (dq and the bias gradient) misses the rowsum(dO * O) term", "triton"),
    Mutant("triton-diagonal-direction", "backends/_triton.py", "skewed = tl.gather(ds, (j - r) & (BM - 1), axis=0)", "skewed = tl.gather(ds, (r - j) & (BM - 1), axis=0)", "Triton: the bias gradient summed along anti-diagonals instead of diagonals", "triton"),
    Mutant("triton-flat-gradient-dropped", "backends/_triton.py", "        tl.atomic_add(dvals + tl.maximum(t_lo, 0), lo_sum)", "        tl.atomic_add(dvals + tl.maximum(t_lo, 0), 0.0 * lo_sum)", "Triton: the gradient of tiles in the low flat range dropped (the far bucket never trains)", "triton"),
    Mutant("triton-dkdv-causal-start", "backends/_triton.py", "m_start = (tl.maximum(n0 - q_offset, 0) // BM) * BM  # earlier queries", "m_start = (tl.maximum(n0 - q_offset, 0) // BM + 1) * BM  # earlier queries", "Triton dk/dv: causal key blocks skip the query block on their diagonal", "triton"),
    Mutant("triton-dkdv-padding-edge", "backends/_triton.py", "u0 = tl.where((n0 < lo) | (n0 + BN > hi), u1, tl.minimum(u0, u1))", "u0 = tl.minimum(u0, u1)", "Triton dk/dv: a key block cut by a padding edge runs unmasked", "triton"),
    Mutant("triton-key-range-start", "backends/_triton.py", "    keep = (cols >= lo) & (cols < hi)", "    keep = cols < hi", "Triton: left padding ignored in the masked blocks", "triton"),
    Mutant("triton-gqa-head", "backends/_triton.py", "    k_base = K + b * stride_kb + (h // GROUP) * stride_kh\n    v_base = V + b * stride_vb + (h // GROUP) * stride_vh\n    vals = VALS + h * stride_vals + (Lq - 1)  # offset 0", "    k_base = K + b * stride_kb + (h % GROUP) * stride_kh\n    v_base = V + b * stride_vb + (h % GROUP) * stride_vh\n    vals = VALS + h * stride_vals + (Lq - 1)  # offset 0", "Triton forward, grouped KV heads: query head h reads key head h % group instead of h // group", "triton"),
    Mutant("triton-lse-natural-log", "backends/_triton.py", "lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float(\"inf\"))  # base 2", "lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float(\"inf\"))  # base 2", "Triton: the saved log-sum-exp in natural log while the backward works in base 2", "triton"),
    Mutant("dispatch-triton-causal-ignored", "backends/dispatch.py", "return TritonSpec(kind, call.causal, call.scale, call.q_offset, flat, deterministic, call.dropout_p)", "return TritonSpec(kind, False, call.scale, call.q_offset, flat, deterministic, call.dropout_p)", "backend='triton' ignores causal", "triton"),
    Mutant("dispatch-triton-alibi-as-symmetric", "backends/dispatch.py", "kind = BIAS_SYMMETRIC_LINEAR if bias.linear.symmetric else BIAS_CAUSAL_LINEAR", "kind = BIAS_SYMMETRIC_LINEAR", "backend='triton' runs causal ALiBi as its symmetric form", "triton"),
    # context parallelism (relpos.distributed) and this session's transformers fixes
    Mutant("ring-causal-mask-off-by-one", "distributed/ring.py", "values[:, rows + q_off :] = float(\"-inf\")", "values[:, rows + q_off + 1 :] = float(\"-inf\")", "ring attention: the causal mask lets each query see one key of its future", "distributed"),
    Mutant("ring-merge-keeps-stale-weight", "distributed/ring.py", "out.mul_((lse - safe).exp_()[..., None])", "out.mul_((lse - safe).exp_()[..., None].clamp(min=1.0))", "ring attention: the running output is not rescaled when a block raises the log-sum-exp", "distributed"),
    Mutant("ring-bias-slice-off-by-one", "distributed/ring.py", "u0 = (kp.start - qs) - (rows - 1) + (self.length - 1)", "u0 = (kp.start - qs) - rows + (self.length - 1)", "ring attention: each block reads the per-offset values one offset off", "distributed"),
    Mutant("ring-dkv-home-dropped", "distributed/ring.py", "gk, gv = gk.add_(carried[0]), gv.add_(carried[1])", "gk, gv = gk, gv.add_(carried[1])", "ring attention: the key gradients carried from the previous rank are dropped", "distributed"),
    Mutant("hf-stale-stack-configs-kept", "hf/_t5like.py", "    for config, _ in stale:\n        config._attn_implementation = NAME\n", "", "relpos.hf: stacks holding their own config copy (transformers 5.15) keep running transformers' attention", "hf"),
    Mutant("hf-sam-recorded-weights-missing", "hf/sam.py", "if output_attentions or recording_attentions():  # SAM's layers", "if output_attentions:  # SAM's layers", "SAM adapter: no attention weights when transformers records them (config.output_attentions)", "hf_sam"),
    Mutant("hf-static-position-ignored", "hf/_positioned.py", "rel = entries - (query_length - 1) - position  # (n,)", "rel = entries - (query_length - 1)  # (n,)", "static cache: the bias ignores the cache position (every step reads offsets as if at position 0)", "hf_static"),
    Mutant("hf-static-masks-diagonal", "hf/_positioned.py", "masked_fill(rel > 0, float(\"-inf\"))", "masked_fill(rel >= 0, float(\"-inf\"))", "static cache: the folded causal mask also hides each query's own key", "hf_static"),
    Mutant("hf-static-alibi-at-the-end", "hf/alibi.py", "static = position is not None and (torch.is_tensor(position) or position != q_offset)", "static = False", "ALiBi families on a static cache: the queries taken as the last Lq keys (causal mask and bias at the cache's end)", "hf_static"),
    Mutant("hf-static-alibi-position-not-cloned", "hf/alibi.py", "return seen.clone() if isinstance(seen, torch.Tensor) else int(seen)", "return seen if isinstance(seen, torch.Tensor) else int(seen)", "ALiBi families: the static cache's length read by reference, so the update moves the queries' position", "hf_static"),
    Mutant("hf-static-future-keys-diagonal", "hf/_positioned.py", "return torch.arange(key_length, device=device)[None, :] > rows", "return torch.arange(key_length, device=device)[None, :] >= rows", "static cache, dense rows (Falcon's decoding): each query's own key hidden too", "hf_static"),
    Mutant("triton-dropout-dv-unscaled", "backends/_triton.py", "    if DROPOUT:\n        dv = dv * drop_scale\n", "", "Triton dropout: dv misses the 1 / (1 - p) of the kept weights", "triton"),
    Mutant("triton-dropout-dq-unmasked", "backends/_triton.py", "dp = tl.where(_kept(seed, drop_bh, m0, n0, drop_t, BM, offs_n.shape[0]), dp * drop_scale, 0.0)", "dp = dp * drop_scale", "Triton dropout: dq and the bias gradient flow through the dropped weights too", "triton"),
    Mutant("triton-dropout-dkdv-mask-transposed", "backends/_triton.py", "keep = tl.trans(_kept(seed, drop_bh, m0, n0, drop_t, BM, offs_n.shape[0]))  # (BN, BM)", "keep = _kept(seed, drop_bh, n0, m0, drop_t, offs_n.shape[0], BM)  # (BN, BM)", "Triton dropout: dk/dv re-draw the mask of the transposed positions, not the forward's", "triton"),
    Mutant("triton-dropout-counter-stride", "backends/_triton.py", "tl.philox(seed, gj[None, :], bh, gi[:, None], 0", "tl.philox(seed, gi[:, None], bh, gj[None, :], 0", "Triton dropout: the Philox counter of a score is not its documented position (consistent in forward and backward)", "triton"),
    Mutant("hf-per-key-padding-first", "hf/alibi.py", "ones = nn.functional.pad(query.new_ones(*query.shape[:3], 1), (0, zeros))", "ones = nn.functional.pad(query.new_ones(*query.shape[:3], 1), (zeros, 0))", "ALiBi per-key channel padded on CUDA: the query's one lands on a zero channel, the per-key term is lost", "hf_alibi"),
    Mutant("triton-key-terms-skipped-in-dkdv", "backends/_triton.py", "        dk = tl.where(hidden[:, None], 0.0, dk)\n        dv = tl.where(hidden[:, None], 0.0, dv)\n", "", "Triton, a key mask with holes: dk and dv ignore it (the hidden keys get gradients)", "triton"),
    Mutant("triton-key-terms-keep-hidden-keys", "backends/_triton.py", "terms = torch.where(padded, 0.0, float(\"-inf\"))  # fp32", "terms = torch.where(padded, 0.0, 0.0)  # fp32", "Triton, a key mask with holes: the hidden keys are attended to", "triton"),
    Mutant("triton-compiled-table-gradient-dropped", "backends/_triton.py", "bias_grad = bool(ctx.needs_input_grad[3]) and ctx.spec_args[0] == BIAS_OFFSETS", "bias_grad = False", "Triton under torch.compile: the table gets no gradient", "triton"),
    Mutant("triton-dropout-seed-ignored", "backends/_triton.py", "        seed = tl.load(SEED)\n", "        seed = 12345\n", "Triton dropout: the drawn seed is not read (every call drops the same weights)", "triton"),
    Mutant("window-sdpa-mask-heads-first", "layers/window_attention.py", "mask = None if bias is None else bias.expand(nw, h, n, n).reshape(1, nw * h, n, n).to(q.dtype)", "mask = None if bias is None else bias.expand(nw, h, n, n).transpose(0, 1).reshape(1, nw * h, n, n).to(q.dtype)", "window attention's CUDA route: the mask laid out heads-major while q, k, v are windows-major", "fuzz_windows"),
    Mutant("fused-one-tile-bias-rows", "backends/_fused.py", "attn_mask=tile_bias(bias, tiles[0], query_length)", "attn_mask=tile_bias(bias, tiles[0], key.shape[-2])", "tile_forward's one-tile shortcut reads the bias view at the key length (wrong whenever Lq != Lk)", "fused_tile"),
    Mutant("alibi-decoding-terms-ignore-factor", "hf/alibi.py", "key = (tuple(map(storage_key, named)), bias.factor, query_length,", "key = (tuple(map(storage_key, named)), query_length,", "ALiBi decoding rows: the kept per-key term reused for another factor (Bloom's beta, Falcon's 1/sqrt(d))", "hf_alibi"),
    Mutant("alibi-dead-rows-kept-across-positions", "hf/alibi.py", "key = (storage_key(key_mask), query_length, position) if reusable else None", "key = (storage_key(key_mask), query_length) if reusable else None", "ALiBi families: the rows that see no key kept for one mask and reused at another query position", "hf_alibi"),
    Mutant("triton-ramp-row-term-sign", "backends/_triton.py", "r = -slope * tl.arange(0, BM).to(tl.float32)  # (BM,)", "r = slope * tl.arange(0, BM).to(tl.float32)  # (BM,)", "Triton dk/dv, ALiBi's tiles off the diagonal: the per-row term folded into the softmax shift with the wrong sign", "triton"),
    Mutant("triton-ramp-right-slope-not-negated", "backends/_triton.py", "vals, c_hi, -slope, offs_m, offs_d, offs_dv,\n                                      m0, n0", "vals, c_hi, slope, offs_m, offs_d, offs_dv,\n                                      m0, n0", "Triton forward, symmetric ALiBi: the tiles right of the diagonal ramp up instead of down", "triton"),
    Mutant("triton-raw-max-any-scale", "backends/_triton.py", "SCALE_POS=spec.scale >= 0,", "SCALE_POS=True,", "Triton forward: a negative scale's row max taken from q.k's max (the softmax shift below the largest score)", "triton"),
    Mutant("triton-wide-positions-from-bits", "backends/_triton.py", "    return max(key_length, query_length + spec.q_offset) >= EXACT_POSITIONS", "    return False", "Triton, ALiBi: positions past 2**22 formed from float bits (wrong beyond 2**22) instead of converted", "triton"),
    Mutant("triton-ramp-ignores-q-offset", "backends/_triton.py", "cols_f = _as_float(n0 - m0 - q_offset + tl.arange(0, BN), KIND >= 8)", "cols_f = _as_float(n0 - m0 + tl.arange(0, BN), KIND >= 8)", "Triton dk/dv, ALiBi's tiles off the diagonal: key positions taken relative to the rows' places without q_offset (decoding rows)", "triton"),
    Mutant("triton-key-mask-holes-flag-dropped", "backends/_triton.py", "terms[:, -1] = key_mask.sum(-1) < ends - starts", "terms[:, -1] = 0.0", "Triton, a key mask read per key: every example marked as hiding no key inside its kept range (holes unmasked)", "triton"),
    Mutant("triton-diagonal-lower-half-cut", "backends/_triton.py", "tl.atomic_add(dvals + low, lower, mask=(w > 0) & (low >= 0) & (low < n_vals))", "tl.atomic_add(dvals + low, lower, mask=(w > BM - BN) & (low >= 0) & (low < n_vals))", "Triton: a dq tile taller than wide drops the gradient of its farthest negative offsets (the cyclic skew's lower half)", "triton"),
    Mutant("triton-flat-rows-last-tile-only", "backends/_triton.py", "            rows += part\n", "            rows = part\n", "Triton dq: a flat range's gradient keeps only the last tile of each region (its rows' sums overwritten, not added)", "triton"),
    Mutant("triton-dropout-ten-rounds", "backends/_triton.py", "bh, gi[:, None], 0, 7)", "bh, gi[:, None], 0, 10)", "Triton dropout: Philox with 10 rounds while the documented rule (and the oracle) has 7", "triton"),
    Mutant("triton-dropout-threshold-unshifted", "backends/_triton.py", "    bits = threshold << 16\n", "    bits = threshold\n", "Triton dropout: the 32-bit word compared with the 16-bit threshold (almost every weight kept)", "triton"),
    Mutant("triton-dropout-kv-head-counter", "backends/_triton.py", "        drop_bh = b * H + h\n", "        drop_bh = b * H + hk\n", "Triton dropout, grouped heads: dk/dv re-draw the mask at the key/value head's counter, not the query head's", "triton"),
    Mutant("triton-ramp-rows-first-row-sign", "backends/_triton.py", "- slope * tl.arange(0, BM).to(tl.float32)  # (BM,)", "+ slope * tl.arange(0, BM).to(tl.float32)  # (BM,)", "Triton forward and dq, ALiBi's tiles off the diagonal: the per-row term (with the tile's corner) folded into the softmax shift with the wrong sign", "triton"),
    Mutant("triton-ramp-rows-first-ignores-q-offset", "backends/_triton.py", "r = slope * (n0 - m0 - q_offset).to(tl.float32)", "r = slope * (n0 - m0).to(tl.float32)", "Triton forward and dq, ALiBi's tiles off the diagonal: the tile's corner ignores the decoding rows' offset", "triton"),
    Mutant("triton-dkdv-hidden-dv-kept", "backends/_triton.py", "        dv = tl.where(hidden[:, None], 0.0, dv)\n", "", "Triton dk/dv, a key mask with holes: the hidden keys' dv rows kept (their weights, unmasked in the loop, reach dv)", "triton"),
    Mutant("triton-dropout-forward-first-keys-skipped", "backends/_triton.py", "            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, 0.0, slope, offs_m, offs_d, offs_dv,\n                                      m0, first // 16 * 16,", "            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_base, v_base, vals, 0.0, slope, offs_m, offs_d, offs_dv,\n                                      m0, first // 16 * 16 + 16,", "Triton forward with dropout: a left-padded example's keys before its first multiple of 16 not attended (the last step visits the next 16)", "triton"),
    Mutant("triton-dropout-dq-first-keys-skipped", "backends/_triton.py", "                             first // 16 * 16, m0, first, lo, Lq,", "                             first // 16 * 16, m0, lo, lo, Lq,", "Triton dq with dropout: a left-padded example's keys before its first multiple of 16 get no dq (their step sees no key)", "triton"),
    Mutant("triton-row-stats-delta-is-lse", "backends/_triton.py", "    delta = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)", "    delta = (pair & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)", "Triton backward: each row's delta read from the low half of its (lse, delta) word, which holds lse", "triton"),
    # ending a gloo process without interpreter teardown (relpos._process)
    Mutant("process-exit-group-left-open", "_process.py", "    close_process_group()\n    for stream", "    for stream", "exit_process: the process exits with its group open (no barrier: a rank leaves while another still talks)", "process"),
    Mutant("process-exit-unflushed", "_process.py", "            stream.flush()", "            pass", "exit_process: buffered stdout and stderr lost at os._exit (the last lines a run prints never appear)", "process"),
    Mutant("process-exit-code-unchecked", "_process.py", "    if code > 255:", "    if code > 65535:", "exit_process: an exit code above 255 accepted (the shell would read it modulo 256: 256 as success)", "process"),
    # decomposed 2D positions in their own Triton kernel (relpos.backends._triton_decomposed)
    Mutant("decomposed-triton-row-term-dropped", "backends/_triton_decomposed.py", "s + bh[:, None] + bw.to(tl.float32) * _LOG2E", "s + bw.to(tl.float32) * _LOG2E", "decomposed Triton kernel: rel_h (the key row's term) never added to the logits", "decomposed_triton"),
    Mutant("decomposed-triton-no-rescale", "backends/_triton_decomposed.py", "alpha = tl.exp2(m_i - m_new)", "alpha = 1.0 + 0.0 * m_i", "decomposed Triton forward: the running sums not rescaled when a tile raises the row maximum", "decomposed_triton"),
    Mutant("decomposed-triton-rel-h-gradient-dropped", "backends/_triton_decomposed.py", "tl.atomic_add(drh_row + r, tl.sum(ds, 1), mask=rows_ok)", "tl.atomic_add(drh_row + r, 0.0 * tl.sum(ds, 1), mask=rows_ok)", "decomposed Triton dq: d rel_h never accumulated (the row table gets no gradient)", "decomposed_triton"),
    Mutant("decomposed-triton-dk-unscaled", "backends/_triton_decomposed.py", "(dk * scale).to(DK.dtype.element_ty)", "dk.to(DK.dtype.element_ty)", "decomposed Triton dk/dv: dk missing the logit scale", "decomposed_triton"),
    Mutant("decomposed-triton-rel-w-last-block-only", "backends/_triton_decomposed.py", "        drw = tl.zeros([BM, BN], tl.float32)  # d rel_w of these columns, summed over the key rows\n        for r in range(0, Kh):", "        drw = tl.zeros([BM, BN], tl.float32)  # d rel_w of these columns, summed over the key rows\n        for r in range(Kh - 1, Kh):", "decomposed Triton dq: d rel_w (and dq) summed over the last key row only", "decomposed_triton"),
    Mutant("decomposed-triton-columns-unmasked", "backends/_triton_decomposed.py", "return tl.where(cols_ok[None, :], bw, float(\"-inf\"))", "return bw", "decomposed Triton kernels: the columns past the key grid's width not masked (padding keys get weight)", "decomposed_triton"),
    Mutant("decomposed-triton-lse-natural-log", "backends/_triton_decomposed.py", "m_i + tl.log2(l_i)", "m_i + tl.log(l_i)", "decomposed Triton forward: the base-2 log-sum-exp stored with a natural log (the backward's weights wrong)", "decomposed_triton"),
    Mutant("buckets-at-clamp-short", "encodings/buckets.py", "ramp[rel.clamp(-max_distance, max_distance) + max_distance]", "ramp[rel.clamp(-max_distance + 1, max_distance - 1) + max_distance]", "static cache's buckets: offsets clamped one short of max_distance (max_distance itself takes its neighbour's bucket)", "buckets"),
    Mutant("key-bias-dkdv-without-the-term", "backends/_triton.py", "        st = st + kt[:, None]\n", "        st = st\n", "Triton dk/dv: a real per-key term left out of the recomputed scores (dk and dv of the wrong weights)", "key_bias"),
    Mutant("key-bias-flag-no-holes", "backends/_triton.py", "    terms[..., -1] = 1.0  # read as \"holes\": no tile skips the terms", "    terms[..., -1] = 0.0", "per-key terms flagged as a mask without holes: the forward and dq skip the term", "key_bias"),
    Mutant("key-bias-factor-dropped", "hf/alibi.py", ".detach().float() * bias.factor)  # (B, H, Lk)", ".detach().float())  # (B, H, Lk)", "ALiBi families in the kernel: the per-key values without their factor (Bloom's beta, Falcon's 1/sqrt(d))", "key_bias"),
]


def apply(mutant: Mutant, tree: Path) -> str | None:
    """Patch the copy; None when applied, else why not (the old text is gone or ambiguous)."""
    path = tree / "src" / "relpos" / mutant.file
    if not path.exists():
        return f"src/relpos/{mutant.file} does not exist"
    text = path.read_text()
    if mutant.old.startswith("re:"):
        pattern = re.compile(mutant.old[3:])
        count = len(pattern.findall(text))
        patched = pattern.sub(mutant.new.replace("\\", "\\\\"), text, count=1)
    else:
        count = text.count(mutant.old)
        patched = text.replace(mutant.old, mutant.new, 1)
    if count != 1:
        return f"the old text occurs {count} times in src/relpos/{mutant.file} (expected once): update the entry"
    path.write_text(patched)
    return None


def copy_tree(dest: Path) -> Path:
    """The parts of the repository the tests read, copied (the real tree is never patched)."""
    skip = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.pyc", ".pytest_cache", "*.egg-info", "runs")
    for name in ("src", "tests", "docs", "examples", "benchmarks", "tools"):  # tests run benchmarks and tools too
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run_tests(tree: Path, files: tuple[str, ...], timeout: float) -> tuple[str, str, float]:
    """(outcome, first failing test or note, seconds): outcome is 'pass', 'fail' or 'timeout'."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1")
    env.pop("CI", None)  # a missing optional tool skips rather than failing: a mutant must be caught by a real check
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=--doctest-modules", *files]
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout:.0f} s", time.perf_counter() - began
    seconds = time.perf_counter() - began
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "pass", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return "fail", failed[0] if failed else out.strip().splitlines()[-1][:120], seconds


def check_mutant(mutant: Mutant, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"relpos-mutant-{mutant.id}-") as tmp:
        tree = copy_tree(Path(tmp))
        why = apply(mutant, tree)
        if why:
            return {"mutant": mutant, "result": "stale", "note": why, "seconds": 0.0}
        outcome, note, seconds = run_tests(tree, SUITES[mutant.suite], timeout)
    result = {"fail": "caught", "pass": "SURVIVED", "timeout": "timeout"}[outcome]
    return {"mutant": mutant, "result": result, "note": note, "seconds": seconds}


def baseline(suites: set[str], timeout: float) -> None:
    """The unmutated copy must pass every test file used, or 'caught' would mean nothing."""
    files = tuple(sorted({f for s in suites for f in SUITES[s]}))
    with tempfile.TemporaryDirectory(prefix="relpos-mutant-baseline-") as tmp:
        tree = copy_tree(Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(tree / "src"))
        where = subprocess.run([sys.executable, "-c", "import relpos; print(relpos.__file__)"], cwd=tree, env=env,
                               capture_output=True, text=True, check=True).stdout.strip()
        if not where.startswith(str(tree)):
            raise SystemExit(f"relpos is imported from {where}, not from the copy: mutants would go unseen")
        outcome, note, seconds = run_tests(tree, files, timeout * 3)
    if outcome != "pass":
        raise SystemExit(f"baseline: the unmutated tests do not pass ({outcome}: {note}); fix them first")
    print(f"baseline: {len(files)} test files pass unmutated ({seconds:.0f} s)", flush=True)


def table(results: list[dict], command: str) -> str:
    caught = sum(r["result"] == "caught" for r in results)
    lines = [
        "# Mutation check",
        "",
        "Realistic bugs seeded one at a time into a temporary copy of the source tree (tools/mutate.py);",
        "each row names the test files run against the mutant and the first test that failed.",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared with other jobs), Python {platform.python_version()};",
        "the seconds include waiting for the CPU.",
        "",
        f"**{caught} of {len(results)} mutants caught.**",
        "",
        "| # | mutant | module | bug | tests run | result | first failing test | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results, 1):
        m = r["mutant"]
        files = ", ".join(Path(f).name for f in SUITES[m.suite])
        lines.append(
            f"| {i} | `{m.id}` | `{m.file}` | {m.bug} | {files} | {r['result']} | `{r['note']}` | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="mutant ids (or prefixes) to run")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant (default 600)")
    parser.add_argument("--out", default="docs/mutation.md", help="markdown table to write ('' for none)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or any(m.id.startswith(p) for p in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.id:32} src/relpos/{m.file:14} {m.bug}  [{' '.join(SUITES[m.suite])}]")
        return 0
    if not chosen:
        raise SystemExit(f"--only {args.only} matches no mutant (see --list)")
    if not args.no_baseline:
        baseline({m.suite for m in chosen}, args.timeout)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = []
        for r in pool.map(lambda m: check_mutant(m, args.timeout), chosen):
            print(f"{r['result']:9} {r['mutant'].id:32} {r['note']} ({r['seconds']:.0f} s)", flush=True)
            results.append(r)
    command = "python tools/mutate.py" + ("" if not args.only else " --only " + " ".join(args.only))
    if args.out:
        (ROOT / args.out).write_text(table(results, command))
        print(f"wrote {args.out}")
    return 0 if all(r["result"] == "caught" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
