"""What relpos's Triton kernels compile to on a GPU, without one: registers, spills, shared memory and the
instruction mix of every loop, per kernel variant.

    python tools/kernel_anatomy.py                       # the variants below, for an H100 (sm_90), as a table
    python tools/kernel_anatomy.py --arch 80 --json out.json
    PYTHONPATH=/path/to/triton-3.6 python tools/kernel_anatomy.py   # the Triton the GPU machine runs
    python tools/kernel_anatomy.py --decomposed          # SAM's decomposed-positions kernels instead

Triton compiles for a CUDA target on a machine with no GPU (its wheel ships ptxas and cuobjdump): this script
makes the CUDA target current with a stand-in driver, calls relpos's own launch code (``_launch_forward``,
``_launch_backward``) on CPU tensors with the GPU tile shapes (``GPU_BLOCKS``), and has every kernel launch
compile instead of run (Triton's ``warmup``). So it checks that each variant compiles for the GPU (the
interpreter that runs the kernels in the CPU tests does not compile them), and shows what a tile costs in
instructions: a loop's ``HGMMA`` (tensor-core steps), ``MUFU`` (exp2), FP32 arithmetic, global loads
(``LDG``, ``LDGSTS``: asynchronous copies) per score. It times nothing: timings come from
``benchmarks/gpu_session.py`` on a GPU (docs/benchmarks/gpu/kernel.md).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

#: SASS opcodes reported per loop (the rest are counted in ``other``).
OPCODES = ("HGMMA", "MUFU", "I2F", "I2FP", "FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "LDG", "LDGSTS", "LDS", "STS", "SHFL", "BAR",
           "LDL", "STL")  # LDL / STL: spilled registers read and written back
KERNELS = ("_fwd_kernel", "_delta_kernel", "_dkdv_kernel", "_dq_kernel")
DECOMPOSED_KERNELS = ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel")  # relpos.backends._triton_decomposed

#: Per-SM limits by compute capability (NVIDIA's CUDA C++ Programming Guide, "Compute Capabilities"): 32-bit
#: registers, shared memory a block may use (KiB; 1 KiB more is reserved per block), resident warps and blocks.
SM_LIMITS = {80: (65536, 164, 64, 32), 86: (65536, 100, 48, 16), 89: (65536, 100, 48, 24), 90: (65536, 228, 64, 32)}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One call of the kernels: the bias kind and options of :class:`relpos.backends._triton.TritonSpec`."""

    name: str
    bias: str = "none"  # none | offsets | causal_linear | symmetric_linear
    causal: bool = False
    flat: bool = False  # T5's flat ranges (the values constant beyond max_distance)
    ranges: bool = False  # per-example key ranges (padding skipped by tiles)
    key_mask: bool = False  # a key mask read per key (KEYBIAS)
    key_bias: bool = False  # a real-valued term per key and head (key_bias_attention: Bloom's, Falcon's ALiBi; KEYREAL)
    dropout: float = 0.0
    backward: bool = False  # also the three backward kernels, with the values' gradient for per-offset values
    deterministic: bool = False
    dtype: str = "bfloat16"
    head_dim: int = 64
    q_offset: int = 0  # 2**23: ALiBi's positions past EXACT_POSITIONS, converted instead of formed from bits


#: What benchmarks/gpu_session.py times (docs/benchmarks/gpu/kernel.md), plus the options it does not.
VARIANTS = (
    Variant("no term"),
    Variant("T5 (flat ranges)", "offsets", flat=True),
    Variant("per-offset, no flat range", "offsets"),
    Variant("ALiBi", "symmetric_linear"),
    Variant("causal ALiBi", "causal_linear", causal=True),
    Variant("ALiBi, positions past 2**22", "symmetric_linear", q_offset=1 << 23),
    Variant("causal T5", "offsets", causal=True, flat=True),
    Variant("T5, key ranges", "offsets", flat=True, ranges=True),
    Variant("T5, key mask on the device", "offsets", flat=True, key_mask=True),
    Variant("T5, dropout 0.1", "offsets", flat=True, dropout=0.1),
    Variant("T5 table, training", "offsets", flat=True, backward=True),
    Variant("causal T5 table, training", "offsets", causal=True, flat=True, backward=True),
    Variant("T5 table, training, deterministic", "offsets", flat=True, backward=True, deterministic=True),
    Variant("T5 table, training, dropout 0.1", "offsets", flat=True, backward=True, dropout=0.1),
    Variant("T5 table, training, key mask on the device", "offsets", flat=True, key_mask=True, backward=True),
    Variant("per-key ALiBi (Bloom, Falcon), causal, training", causal=True, key_mask=True, key_bias=True, backward=True),
    Variant("T5, fp16", "offsets", flat=True, dtype="float16"),
    Variant("T5, fp32", "offsets", flat=True, dtype="float32"),
    Variant("T5, d = 128", "offsets", flat=True, head_dim=128),
)


class _TargetDriver:
    """Triton's active driver while compiling: a CUDA target of compute capability ``arch``, nothing to launch on."""

    def __init__(self, arch: int, warp_size: int = 32):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, warp_size)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty


@contextlib.contextmanager
def compiling_for(arch: int, blocks=None, ptxas_logs: bool = False):
    """Inside: relpos's kernel launches compile for ``sm_<arch>`` and return the compiled kernels instead of
    running; ``(kernel name, CompiledKernel)`` pairs are appended to the yielded list. ``blocks``: the
    :class:`~relpos.backends._triton._Blocks` to compile with (the GPU's for d = 64 by default). ``ptxas_logs``: keep
    ptxas's log of each compile in :data:`PTXAS_LOGS` (every kernel compiled again, Triton's disk cache bypassed; the
    log is captured around each launch, which a timing of the launch path must not pay)."""
    from triton.runtime.driver import driver

    from relpos.backends import _triton, _triton_decomposed

    import triton

    compiled: list = []
    saved_driver, saved_blocks = driver._active, _triton._blocks
    kernels = [(_triton, name) for name in KERNELS] + [(_triton_decomposed, name) for name in DECOMPOSED_KERNELS]
    saved_runs = {(module, name): getattr(module, name).run for module, name in kernels}
    saved_knobs = triton.knobs.nvidia.dump_ptxas_log, triton.knobs.compilation.always_compile

    def compile_only(name, run):
        def launch(*args, **kwargs):
            kwargs["warmup"] = True  # Triton's own compile-without-launch
            if not ptxas_logs:
                kernel = run(*args, **kwargs)
            else:
                log = io.StringIO()
                with contextlib.redirect_stdout(log):  # Triton prints ptxas's log as it assembles
                    kernel = run(*args, **kwargs)
                PTXAS_LOGS.setdefault(kernel.hash, log.getvalue())  # compiled earlier in this process: no log
            compiled.append((name, kernel))
            return kernel

        return launch

    if ptxas_logs:
        triton.knobs.nvidia.dump_ptxas_log = True
        triton.knobs.compilation.always_compile = True  # Triton's disk cache would skip ptxas, and its log
    driver.set_active(_TargetDriver(arch))
    _triton._blocks = lambda head_dim, device: blocks or saved_blocks(head_dim, torch.device("cuda"))
    for (module, name), run in saved_runs.items():
        label = name if module is _triton else f"decomposed{name}"  # decomposed_fwd_kernel, ...
        getattr(module, name).run = compile_only(label, run)
    try:
        yield compiled
    finally:
        for (module, name), run in saved_runs.items():
            getattr(module, name).run = run
        _triton._blocks = saved_blocks
        driver._active = saved_driver
        triton.knobs.nvidia.dump_ptxas_log, triton.knobs.compilation.always_compile = saved_knobs


def _spec(variant: Variant, length: int):
    from relpos.backends import _triton

    kinds = {"none": _triton.BIAS_NONE, "offsets": _triton.BIAS_OFFSETS,
             "causal_linear": _triton.BIAS_CAUSAL_LINEAR, "symmetric_linear": _triton.BIAS_SYMMETRIC_LINEAR}
    flat = (length - 1 - 128, length - 1 + 128) if variant.flat else None  # T5's values constant past +-128
    return _triton.TritonSpec(kinds[variant.bias], variant.causal, variant.head_dim ** -0.5, variant.q_offset, flat,
                              variant.deterministic, variant.dropout, key_real=variant.key_bias)


def compile_variant(variant: Variant, arch: int = 90, blocks=None, length: int = 1024) -> list[tuple[str, object]]:
    """The compiled kernels of one variant: ``[(kernel name, CompiledKernel), ...]`` (forward, then backward)."""
    from relpos.backends import _triton

    dtype = getattr(torch, variant.dtype)
    q = torch.zeros(2, 4, length, variant.head_dim, dtype=dtype)  # (B, H, L, d): never read, only described
    values = torch.zeros(4, 2 * length - 1)  # (H, 2L - 1)
    slopes = torch.ones(4)
    starts = ends = key_terms = None
    if variant.ranges or variant.key_mask:
        starts, ends = torch.zeros(2, dtype=torch.int32), torch.full((2,), length, dtype=torch.int32)
    if variant.key_mask:
        key_terms = torch.zeros(2, 4 if variant.key_bias else 1, length + _triton.KEY_PAD)  # (B, H|1, Lk + KEY_PAD)
    seed = torch.zeros(1, dtype=torch.int64)
    spec = _spec(variant, length)
    padded = _triton._padded_values(values, spec)
    with compiling_for(arch, blocks, ptxas_logs=True) as compiled:
        out, lse = _triton._launch_forward(q, q, q, padded, slopes, starts, ends, key_terms, seed, spec)
        if variant.backward:
            _triton._launch_backward(q, q, q, q, out, lse, padded, slopes, starts, ends, key_terms, seed, spec,
                                     bias_grad=variant.bias == "offsets")
    return compiled


def compile_decomposed(arch: int = 90, dtype: torch.dtype = torch.bfloat16) -> list:
    """The decomposed-positions kernels (relpos.backends._triton_decomposed), forward and backward, compiled for
    ``sm_<arch>`` at SAM ViT-B's global layer (64 x 64 keys, head dim 64): ``(name, CompiledKernel)`` pairs."""
    from relpos.backends._triton_decomposed import decomposed_triton

    n, grid, d = 4096, 64, 64
    leaves = [torch.zeros(1, 2, n, width, dtype=dtype, requires_grad=True) for width in (d, d, d, grid, grid)]
    with compiling_for(arch, ptxas_logs=True) as compiled:
        decomposed_triton(*leaves, d ** -0.5).sum().backward()  # launches stop at the compile: no real values
    return compiled


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def blocks_per_sm(registers: int, shared_bytes: int, warps: int, arch: int) -> int:
    """How many blocks of a kernel one SM holds at once, from its registers (allocated per warp in units of 256),
    its shared memory and its warps (the occupancy calculator's rules)."""
    regs, smem_kib, max_warps, max_blocks = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (regs // per_warp) // warps
    by_shared = int(smem_kib * 1024 // (shared_bytes + 1024))
    return min(by_registers, by_shared, max_warps // warps, max_blocks)


def resources(kernel, arch: int = 90) -> dict:
    """Registers per thread, the stack frame per thread (where ptxas spills registers: bytes), whether ptxas
    serialized the tensor-core steps (Hopper's wgmma), shared memory (bytes), and the SASS loops."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    return {
        "registers": registers,
        "spill_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)) + int(re.search(r"LOCAL:(\d+)", usage).group(1)),
        "ptxas_log": bool(PTXAS_LOGS.get(kernel.hash)),  # whether the remarks below were read at all
        "wgmma_serialized": WGMMA_SERIALIZED in PTXAS_LOGS.get(kernel.hash, ""),
        "shared_bytes": kernel.metadata.shared,
        "warps": kernel.metadata.num_warps,
        "stages": kernel.metadata.num_stages,
        "blocks_per_sm": blocks_per_sm(registers, kernel.metadata.shared, kernel.metadata.num_warps, arch),
        "loops": sass_loops(sass),
    }


#: ptxas's remark (C7515) when it makes each Hopper tensor-core step (wgmma) wait for the one before: the tile's matrix
#: products no longer overlap its other instructions.
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"
PTXAS_LOGS: dict[str, str] = {}  # ptxas's log (Triton's own assembly) per compiled kernel's hash


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BACK_BRANCH = re.compile(r"\bBRA\b[^;]*?(0x[0-9a-f]+)")


def sass_loops(sass: str) -> list[dict]:
    """Each loop of a SASS listing (a branch to an earlier address), in address order: its instruction count and
    the count of each of :data:`OPCODES` (predicates and modifiers stripped: ``@P0 FFMA.FTZ`` counts as FFMA)."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in _INSTRUCTION.finditer(sass)]
    loops = []
    for address, text in instructions:
        branch = _BACK_BRANCH.search(text)
        if branch is None or int(branch.group(1), 16) >= address:
            continue
        start = int(branch.group(1), 16)
        counts = collections.Counter(_opcode(t) for a, t in instructions if start <= a <= address)
        mix = {op: counts.pop(op, 0) for op in OPCODES}
        loops.append({"start": start, "instructions": sum(mix.values()) + sum(counts.values()), **mix,
                      "other": sum(counts.values())})
    return sorted(loops, key=lambda loop: loop["start"])


def _opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text.strip())
    return text.split()[0].split(".")[0] if text else ""


def anatomy(variants=VARIANTS, arch: int = 90, blocks=None) -> list[dict]:
    """One row per compiled kernel of each variant (a failed compile is a row with its error)."""
    rows = []
    tile = "GPU_BLOCKS" if blocks is None else _tile_name(blocks)
    for variant in variants:
        try:
            kernels = compile_variant(variant, arch, blocks)
        except Exception as error:  # noqa: BLE001 - the report names the variant that does not compile
            rows.append({"variant": variant.name, "tile": tile, "kernel": "-",
                         "error": f"{type(error).__name__}: {error}"[:300]})
            continue
        for name, kernel in kernels:
            rows.append({"variant": variant.name, "tile": tile, "kernel": name.strip("_"), **resources(kernel, arch)})
    return rows


DECOMPOSED_VARIANT = "SAM ViT-B global layer (decomposed positions), bf16"


def decomposed_anatomy(arch: int = 90) -> list[dict]:
    """The rows of :func:`compile_decomposed`'s kernels (``--decomposed``), as :func:`anatomy`'s."""
    try:
        kernels = compile_decomposed(arch)
    except Exception as error:  # noqa: BLE001 - the report names what does not compile
        return [{"variant": DECOMPOSED_VARIANT, "tile": "its own", "kernel": "-", "error": f"{type(error).__name__}: {error}"[:300]}]
    return [{"variant": DECOMPOSED_VARIANT, "tile": "its own", "kernel": name.strip("_").removeprefix("decomposed_"),
             **resources(kernel, arch)} for name, kernel in kernels]


def _tile_name(blocks) -> str:
    """What ``blocks`` changes from ``GPU_BLOCKS[64]``, e.g. ``dq 64x32, 4 warps, 3 stages``."""
    from relpos.backends import _triton

    base = _triton.GPU_BLOCKS[64]
    changed = []
    for kernel in ("fwd", "fwd_offsets", "dkdv", "dq", "dkdv_dropout"):
        tile = getattr(blocks, kernel)
        offsets_changed = (blocks.gather_split, blocks.split_flat) != (base.gather_split, base.split_flat)
        if tile is not None and (tile != getattr(base, kernel) or (kernel == "fwd_offsets" and offsets_changed)):
            bm, bn, warps, stages = tile
            split = f", gather split {blocks.gather_split}" if kernel == "fwd_offsets" else ""
            split += ", flat blocks in their own launch" if kernel == "fwd_offsets" and blocks.split_flat else ""
            changed.append(f"{'' if kernel == 'fwd_offsets' else kernel + ' '}{bm}x{bn}, {warps} warps, {stages} stages{split}")
    return "; ".join(changed) or "GPU_BLOCKS"


def table(rows: list[dict]) -> str:
    """Markdown: one line per kernel, its loops as ``instructions (HGMMA, MUFU, I2F, FP32 ops, global loads)``."""
    tiles = len({row["tile"] for row in rows}) > 1
    head = "| variant | " + ("per-offset forward tile | " if tiles else "")
    lines = [head + "kernel | registers | spilled bytes | wgmma serialized | shared KiB | blocks per SM | loops: "
             "instructions (HGMMA, MUFU, I2F, FFMA+FADD+FMUL, loads) |",
             "|---|" + ("---|" if tiles else "") + "---|---|---|---|---|---|---|"]
    for row in rows:
        first = f"| {row['variant']} | " + (f"{row['tile']} | " if tiles else "")
        if "error" in row:
            lines.append(first + f"does not compile | | | | | | {row['error']} |")
            continue
        loops = "; ".join(
            f"{lp['instructions']} ({lp['HGMMA']}, {lp['MUFU']}, {lp['I2F'] + lp['I2FP']}, "
            f"{lp['FFMA'] + lp['FADD'] + lp['FMUL']}, {lp['LDG'] + lp['LDGSTS']})" for lp in row["loops"]
        )
        serialized = {True: "yes", False: "no"}.get(row.get("wgmma_serialized"), "not read")
        lines.append(first + f"{row['kernel'].removesuffix('_kernel')} | {row['registers']} | {row['spill_bytes']} "
                     f"| {serialized} | {row['shared_bytes'] / 1024:.0f} | {row['blocks_per_sm']} | {loops} |")
    return "\n".join(lines)


def page(payload: dict) -> str:
    """The region of docs/benchmarks/gpu/kernel-anatomy.md rendered from one run's JSON."""
    return (f"Triton {payload['triton']}, sm_{payload['arch']}, relpos at {payload['commit']}: "
            f"`{payload['command']}`\n\n{table(payload['rows'])}\n")


def _blocks_arg(text: str):
    """``[KERNEL=]BM,BN,warps,stages[,gather_split]``: one kernel's tile (KERNEL among fwd, fwd_offsets, dkdv, dq,
    dkdv_dropout; fwd_offsets, the forward that reads per-offset values, by default), the others as in
    GPU_BLOCKS[64]."""
    from relpos.backends import _triton

    kernel, _, numbers = text.rpartition("=")
    kernel = kernel or "fwd_offsets"
    split = kernel == "fwd_offsets" and numbers.endswith(",split")
    numbers = numbers.removesuffix(",split") if split else numbers
    bad = kernel not in ("fwd", "fwd_offsets", "dkdv", "dq", "dkdv_dropout") or not re.fullmatch(
        r"\d+(,\d+){3,4}" if kernel == "fwd_offsets" else r"\d+(,\d+){3}", numbers)
    if bad:
        raise argparse.ArgumentTypeError(
            f"a tile is [KERNEL=]BM,BN,warps,stages (fwd_offsets: [,gather_split][,split]) with KERNEL among fwd, "
            f"fwd_offsets, dkdv, dq, dkdv_dropout; got {text!r}")
    values = [int(x) for x in numbers.split(",")]
    fields = {kernel: tuple(values[:4])}
    if kernel == "fwd_offsets":
        fields.update(gather_split=values[4] if len(values) == 5 else 1, split_flat=split)
    return dataclasses.replace(_triton.GPU_BLOCKS[64], **fields)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SM_LIMITS),
                        help="CUDA compute capability times ten (90: H100/H200)")
    parser.add_argument("--offsets-tile", "--tile", dest="tiles", type=_blocks_arg, action="append", default=None,
                        help="[KERNEL=]BM,BN,warps,stages[,gather_split][,split]: one kernel's tile (fwd, fwd_offsets (the "
                             "default; split: the flat blocks in their own launch), dkdv, dq); repeat to compare tiles "
                             "(default: GPU_BLOCKS)")
    parser.add_argument("--only", nargs="*", default=None, metavar="VARIANT", help="variant names to compile (default: all)")
    parser.add_argument("--decomposed", action="store_true",
                        help="the decomposed-positions kernels (SAM's global layers, relpos.backends._triton_decomposed) "
                             "instead of the variants")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.decomposed and (args.only is not None or args.tiles):
        parser.error("--decomposed compiles the decomposed kernels at their own tiles: drop --only and --tile")
    names = [v.name for v in VARIANTS]
    unknown = [n for n in args.only or () if n not in names]
    if unknown:
        parser.error(f"--only: no variant named {', '.join(map(repr, unknown))}; the variants are {'; '.join(names)}")
    import triton

    from relpos._measure import checkout_commit

    variants = [v for v in VARIANTS if args.only is None or v.name in args.only]
    if args.decomposed:
        rows = decomposed_anatomy(args.arch)
    else:
        rows = [row for blocks in args.tiles or [None] for row in anatomy(variants, args.arch, blocks)]
    payload = {"triton": triton.__version__, "arch": args.arch, "commit": checkout_commit(Path(__file__).resolve().parents[1]),
               "command": shlex.join(["python", "tools/kernel_anatomy.py", *argv]), "rows": rows}
    print(page(payload))
    if args.json is not None:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(args.json)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
