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
    "buckets": ("tests/test_buckets.py", "tests/test_t5_bias.py", "src/relpos/buckets.py"),
    "bias": ("tests/test_t5_bias.py", "tests/test_attention.py", "tests/test_backends.py", "src/relpos/bias.py"),
    "tiles": ("tests/test_real_inputs.py", "tests/test_backends.py", "src/relpos/_tiles.py"),
    "dropout": ("tests/test_dropout.py", "tests/test_real_inputs.py", "tests/test_mha_matrix.py"),
    "fused": ("tests/test_backends.py", "tests/test_real_inputs.py"),
    "masks": ("tests/test_attention.py", "tests/test_real_inputs.py", "tests/test_mha_matrix.py"),
    "alibi": ("tests/test_encodings.py", "tests/test_backends.py", "tests/test_mha_matrix.py", "src/relpos/alibi.py"),
    "rotary": ("tests/test_encodings.py", "tests/test_rope_scaling.py", "tests/test_mha_matrix.py"),
    "shaw": ("tests/test_encodings.py", "tests/test_mha_matrix.py", "src/relpos/shaw.py"),
    "windows": ("tests/test_windows.py", "tests/test_attention.py", "tests/test_mha_matrix.py", "src/relpos/windows.py"),
    "mha": ("tests/test_mha.py", "tests/test_mha_matrix.py"),
    "hf": ("tests/test_hf.py",),
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
    Mutant("buckets-sign-off-by-one", "buckets.py", "sign_offset = (relative_position > 0).long() * half", "sign_offset = (relative_position >= 0).long() * half", "t5_bucket: offset 0 counted as a future key (off by one)", "buckets"),
    Mutant("buckets-last-bucket-off-by-one", "buckets.py", "far = _far_buckets(distance, max_exact, half, max_distance, strategy).clamp(max=half - 1)", "far = _far_buckets(distance, max_exact, half, max_distance, strategy).clamp(max=half)", "t5_bucket: far distances spill one bucket past their half (off by one)", "buckets"),
    Mutant("buckets-round-not-floor", "buckets.py", "return max_exact + scaled.to(torch.long)", "return max_exact + scaled.round().to(torch.long)", "t5_bucket: the log bucket rounded instead of floored", "buckets"),
    Mutant("bias-dense-flip", "bias.py", "return self.hankel().flip(-2)  # (1, H, Lq, Lk)", "return self.hankel().flip(-1)  # (1, H, Lq, Lk)", "OffsetBias.dense flips the keys instead of the queries (offsets mirrored)", "bias"),
    Mutant("bias-row-index", "bias.py", "start = self.query_length - 1 - i", "start = i", "OffsetBias.row reads row i of the Hankel view, not of the bias", "bias"),
    Mutant("bias-mask-future-diagonal", "bias.py", "future = self.offsets() > 0  # (n,)", "future = self.offsets() >= 0  # (n,)", "mask_future also masks the diagonal (a query cannot see itself)", "bias"),
    Mutant("tiles-hankel-offset", "_tiles.py", "return self.k0 - self.r1 + query_length", "return self.k0 - self.r0 + query_length", "a tile's Hankel view starts at its first row instead of its last", "tiles"),
    Mutant("tiles-group-first-key", "_tiles.py", "if groups and (groups[-1][2], groups[-1][3]) == (s, e):", "if groups and groups[-1][2] == s:", "key-padding tiles group examples by their first kept key only", "tiles"),
    Mutant("tiles-causal-chunk-end", "_tiles.py", "tiles.append(Tile(b0, b1, r0, r1, start, q_offset + r1))", "tiles.append(Tile(b0, b1, r0, r1, start, q_offset + r1 - 1))", "a causal chunk's keys stop one before its last query", "tiles"),
    Mutant("dropout-seed-no-example", "_dropout.py", "gen.manual_seed(hash((seed, b, g)) & (2**63 - 1))", "gen.manual_seed(hash((seed, g)) & (2**63 - 1))", "the keep-mask seed without the example index: every example shares one mask", "dropout"),
    Mutant("dropout-seed-no-group", "_dropout.py", "gen.manual_seed(hash((seed, b, g)) & (2**63 - 1))", "gen.manual_seed(hash((seed, b)) & (2**63 - 1))", "the keep-mask seed without the row group: every 64 rows repeat", "dropout"),
    Mutant("dropout-fused-no-rescale", "_fused.py", "return keep.flip(1).to(dtype) / (1.0 - effective_p(p))", "return keep.flip(1).to(dtype)", "fused dropout: kept weights not scaled by 1/(1-p)", "dropout"),
    Mutant("dropout-eager-no-rescale", "_dropout.py", "return weights * keep / (1.0 - effective_p(p))", "return weights * keep", "eager and Shaw dropout: kept weights not scaled by 1/(1-p)", "dropout"),
    Mutant("fused-backward-no-delta", "_fused.py", "ds = dp.sub_(delta[:, a:c]).mul_(p)", "ds = dp.mul_(p)", "fused backward: dS misses the rowsum(dO * O) term", "fused"),
    Mutant("fused-backward-shared-head0", "_fused.py", "per_head = ds.sum(0, keepdim=True) if shared else ds", "per_head = ds[:1] if shared else ds", "fused backward: a bias shared by all heads gets head 0's gradient only", "fused"),
    Mutant("fused-backward-dropout-dv", "_fused.py", "dvb.baddbmm_(p.mul(z).transpose(1, 2), gb)", "dvb.baddbmm_(p.transpose(1, 2), gb)", "fused backward with dropout: dv ignores the dropout mask", "fused"),
    Mutant("masks-key-mask-inverted", "_masks.py", "keep = key_mask[:, None, None, :]  # (B, 1, 1, Lk)", "keep = ~key_mask[:, None, None, :]  # (B, 1, 1, Lk)", "key_mask folded in inverted (padding attended, real tokens hidden)", "masks"),
    Mutant("masks-eager-causal-diagonal", "attention.py", "blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=query.device) > 0", "blocked = relative_positions(query_length, key_length, q_offset=q_offset, device=query.device) >= 0", "the dense causal mask hides the diagonal", "masks"),
    Mutant("alibi-slopes-off-by-one", "alibi.py", "return [start ** (k + 1) for k in range(n)]", "return [start ** k for k in range(n)]", "ALiBi slopes start at 1 (k from 0)", "alibi"),
    Mutant("alibi-symmetric-sign", "alibi.py", "else -relative_position.abs()", "else relative_position.abs()", "symmetric ALiBi rewards distance instead of penalising it", "alibi"),
    Mutant("rotary-layout-swap", "rotary.py", "if self.interleaved:\n            pairs = xf.unflatten", "if not self.interleaved:\n            pairs = xf.unflatten", "RoPE rotates half-split channels as interleaved pairs (and back)", "rotary"),
    Mutant("shaw-index-sign", "shaw.py", "return rel.clamp(-self.max_distance, self.max_distance) + self.max_distance  # (Lq, Lk)", "return (-rel).clamp(-self.max_distance, self.max_distance) + self.max_distance  # (Lq, Lk)", "Shaw indexes its tables by query - key", "shaw"),
    Mutant("shaw-mha-no-dropout", "mha.py", "dropout_p=self.dropout if self.training else 0.0,\n            )  # (B, H, Lq, dh)", "dropout_p=0.0,\n            )  # (B, H, Lq, dh)", "MultiheadAttention skips dropout on Shaw's path (the issue's silent bug)", "mha"),
    Mutant("windows-index-sign", "windows.py", "rel = coords[:, :, None] - coords[:, None, :]  # (ndim, N, N): query - key", "rel = coords[:, None, :] - coords[:, :, None]  # (ndim, N, N): query - key", "Swin's window index built from key - query", "windows"),
    Mutant("windows-index-radix", "windows.py", "index = index * (2 * size - 1) + rel[axis] + size - 1", "index = index * (2 * sizes[0] - 1) + rel[axis] + size - 1", "Swin's mixed radix uses the window height for every axis", "windows"),
    Mutant("mha-rope-keys-at-zero", "mha.py", "position.rotate(k, q_offset if memory is None else 0)", "position.rotate(k, 0)", "MultiheadAttention rotates cached decoding's new keys as position 0", "mha"),
    Mutant("mha-cross-causal", "mha.py", "causal = self.causal and memory is None", "causal = self.causal", "a causal layer also masks cross-attention to the memory", "mha"),
    Mutant("mha-cache-order", "mha.py", "self.key = torch.cat([self.key, key], dim=-2)", "self.key = torch.cat([key, self.key], dim=-2)", "KVCache puts the new keys before the cached ones", "mha"),
    Mutant("hf-offsets-lengths-swapped", "hf/t5.py", r"re:relative_offsets\(\s*query_length\s*,\s*key_length\s*,", "relative_offsets(key_length, query_length,", "relpos.hf's per-offset bias with query and key lengths swapped (wrong only when decoding)", "hf"),
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
    for name in ("src", "tests", "docs", "examples"):
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
