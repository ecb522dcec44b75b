"""One command for a lent GPU: the GPU tests and every GPU benchmark, each step's results written to OUT.

    PYTHONPATH=src:tests python benchmarks/gpu_session.py --out OUT [--only kernel,t5,bloom,mpt,falcon,tests_kernel,tests_models,sam,sam_layer,swin] [--budget 540]
        [--limits kernel=120,t5=150] [--kernel-cases t5_forward,alibi_forward]

GPU time is scarce (a session gets minutes), so the steps run in order of what they decide, each under
its own time limit and never past ``--budget`` seconds in all; a step that fails or runs out of time
is recorded and the next one starts. ``OUT/session.json`` says, per step, the command, its exit
status, its seconds and its log file (``OUT/<step>.log``); it is rewritten after every step, so a
session cut short keeps what it finished. The benchmarks write their own JSON and tables into OUT;
commit them with ``tools/bench_tables.py`` (docs/benchmarks/gpu/index.md says where each one goes).

Steps:

* ``kernel``: benchmarks/gpu_kernel.py: a tile sweep at L = 16384 (its fastest shapes then serve the rest,
  ``gather_split`` included), then L = 4096 and 16384 (the floor, the kernel, the earlier routes, the
  FlashBias fold, hand-written FlexAttention at 4096; the dropout training step; the anatomy of a T5 term's
  cost), with ``--profile`` (torch.profiler's CPU and CUDA time per call at L = 4096) and ``--throughput 10``
  (10 back-to-back calls per sample, as inside a model); ``--kernel-cases`` keeps some cases (FlexAttention
  compiles per shape for 10-20 s, so all cases take about 250 s after the sweep's 90 s);
* ``t5``, ``bloom``, ``mpt``, ``falcon``: benchmarks/t5_model.py, the model against transformers' fastest on the same GPU
  (T5 and Bloom with compiled static-cache generation, which transformers compiles itself on CUDA), with
  ``--profile``: per variant and point, the GPU's busy time against the wall time, the attention kernels' share,
  the host syncs and the top kernels (where a target is missed, that says why);
* ``tests_kernel``, ``tests_models``: ``pytest -m gpu -v`` over ``GPU_KERNEL_TEST_FILES`` (the Triton kernel at
  real sizes, dropout included, then the backends' fp32 oracle cases) and over ``GPU_MODEL_TEST_FILES`` (every
  accelerated family on CUDA against transformers), each under its own limit so that neither spends the other's
  minutes; each test's name and result in the log as it finishes, the 40 slowest at the end; a step past its limit
  is interrupted first (SIGINT), so pytest still writes that summary, then killed.
* ``t5_grid``, ``bloom_grid`` (only when named in ``--only``): the whole model grid of issue 35 (L = 1024 to 8192,
  B = 1 and 4, forward, training, greedy and compiled static-cache generation of 64 tokens), several minutes each;
* ``sam``, ``sam_layer``, ``swin``: benchmarks/sam.py (the SAM ViT-B image encoder at 1024 x 1024, forward; one
  global layer's training step, the fold and the decomposed Triton kernel beside transformers') and benchmarks/swin.py
  (Swin V2-tiny at 256 x 256, windows 8 and 16, forward and training step) against transformers on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

#: Every file with GPU tests, in two steps with a time limit each, so that one cannot spend the other's minutes: the
#: models on CUDA (``tests_models``) and the backends: the Triton kernel at real sizes first, then the fp32 oracle cases
#: (``tests_kernel``; pytest runs a folder's files in its own order, hence the lists; tests/tools/test_gpu_session.py
#: checks they are whole)
GPU_MODEL_TEST_FILES = ("tests/hf/test_hf_cuda.py",)
GPU_KERNEL_TEST_FILES = ("tests/backends/test_triton_gpu.py", "tests/backends/test_cuda.py",
                         "tests/backends/test_triton.py", "tests/backends/test_backends.py")
GPU_TEST_FILES = GPU_KERNEL_TEST_FILES + GPU_MODEL_TEST_FILES
#: pytest over the GPU tests of ``files``, each test's result in the log as it finishes, the 40 slowest at the end (a
#: timed-out run too: _wait interrupts it first)
_PYTEST = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "--durations=40"]

STEPS = {  # name -> (seconds at most, command); run in this order
    "kernel": (360, [sys.executable, "benchmarks/gpu_kernel.py", "--out", "{out}", "--rounds", "10",
                     "--lengths", "4096,16384", "--sweep", "--sweep-length", "16384", "--profile", "--throughput", "10",
                     "--flex-lengths", "4096", "--cases", "{kernel_cases}"]),
    "t5": (150, [sys.executable, "benchmarks/t5_model.py", "--family", "t5", "--lengths", "2048,4096", "--batches", "2",
                 "--modes", "forward,train,generate,generate_static", "--rounds", "5", "--d-model", "512", "--heads", "8",
                 "--layers", "2", "--device", "cuda", "--dtype", "bfloat16", "--memory-limit-gib", "60",
                 "--profile", "--json", "{out}/t5.json", "--markdown", "{out}/t5.md"]),
    "bloom": (90, [sys.executable, "benchmarks/t5_model.py", "--family", "bloom", "--lengths", "2048", "--batches", "2",
                   "--modes", "forward,train,generate_static", "--rounds", "5", "--d-model", "512", "--heads", "8",
                   "--layers", "2", "--device", "cuda", "--dtype", "bfloat16", "--memory-limit-gib", "60",
                   "--profile", "--json", "{out}/bloom.json", "--markdown", "{out}/bloom.md"]),
    "mpt": (90, [sys.executable, "benchmarks/t5_model.py", "--family", "mpt", "--lengths", "2048", "--batches", "2",
                 "--modes", "forward,train,generate", "--rounds", "5", "--d-model", "512", "--heads", "8", "--layers", "2",
                 "--device", "cuda", "--dtype", "bfloat16", "--memory-limit-gib", "60",
                 "--profile", "--json", "{out}/mpt.json", "--markdown", "{out}/mpt.md"]),
    "falcon": (90, [sys.executable, "benchmarks/t5_model.py", "--family", "falcon", "--lengths", "2048", "--batches", "2",
                    "--modes", "forward,train", "--rounds", "5", "--d-model", "512", "--heads", "8", "--layers", "2",
                    "--device", "cuda", "--dtype", "bfloat16", "--memory-limit-gib", "60", "--profile",
                    "--json", "{out}/falcon.json", "--markdown", "{out}/falcon.md"]),
    "tests_kernel": (90, [*_PYTEST, *GPU_KERNEL_TEST_FILES]),
    "tests_models": (90, [*_PYTEST, *GPU_MODEL_TEST_FILES]),
    "sam": (90, [sys.executable, "benchmarks/sam.py", "--mode", "encoder", "--rounds", "5", "--device", "cuda",
                 "--dtype", "bfloat16", "--json", "{out}/sam.json", "--markdown", "{out}/sam.md"]),
    "sam_layer": (90, [sys.executable, "benchmarks/sam.py", "--mode", "train", "--rounds", "5", "--device", "cuda",
                       "--dtype", "bfloat16", "--json", "{out}/sam.json", "--markdown", "{out}/sam.md"]),
    "swin": (120, [sys.executable, "benchmarks/swin.py", "--family", "swinv2", "--windows", "8", "16", "--modes", "forward",
                   "train", "--rounds", "5", "--device", "cuda", "--dtype", "bfloat16", "--json", "{out}/swin.json",
                   "--markdown", "{out}/swin.md"]),
}
#: issue 35's whole model grid (L = 1024 to 8192, B = 1 and 4; greedy generation of 64 tokens), for a session with more
#: device time than the two calls of docs/benchmarks/gpu/index.md: not in the default steps
GRID_STEPS = {
    f"{family}_grid": (540, [sys.executable, "benchmarks/t5_model.py", "--family", family, "--lengths", "1024,2048,4096,8192",
                             "--batches", "1,4", "--modes", "forward,train,generate,generate_static", "--new-tokens", "64",
                             "--rounds", "3", "--d-model", "512", "--heads", "8", "--layers", "2", "--device", "cuda",
                             "--dtype", "bfloat16", "--memory-limit-gib", "60", "--json", f"{{out}}/{family}-grid.json",
                             "--markdown", f"{{out}}/{family}-grid.md"])
    for family in ("t5", "bloom")
}
STEPS |= GRID_STEPS


def write_json(path: str, payload: dict) -> None:
    """Atomically: a temporary file in the same folder, then renamed over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as fh:
        json.dump(payload, fh, indent=1)
    os.replace(fh.name, path)


def run_step(name: str, limit: float, command: list[str], out: str) -> dict:
    """Run one step with its output in OUT/<name>.log (and echoed as plain lines); its record."""
    log_path = os.path.join(out, f"{name}.log")
    started = time.time()
    print(f"[gpu_session] {time.strftime('%H:%M:%S')} {name}: {' '.join(command)} (at most {limit:.0f} s)", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_environment())
        status = _wait(process, limit)
    seconds = round(time.time() - started, 1)
    with open(log_path) as log:
        tail = log.read()[-600:]
    print(f"[gpu_session] {name}: status {status} after {seconds} s\n{tail}", flush=True)
    return {"command": " ".join(command), "status": status, "seconds": seconds, "log": f"{name}.log"}


#: seconds a timed-out step gets, after SIGINT, to write what it has (pytest its summary and --durations, a benchmark
#: its last point) before it is killed
GRACE_SECONDS = 15.0


def _wait(process: subprocess.Popen, limit: float) -> int | str:
    """The step's exit status, or ``"timed out"``: past ``limit`` it is interrupted (SIGINT, as Ctrl-C: pytest then
    prints which tests ran and the slowest), then killed if it has not ended within :data:`GRACE_SECONDS`."""
    try:
        return process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return "timed out"


def _environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["src", "tests", env.get("PYTHONPATH", "")]))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for every result and log (created)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated steps, among {', '.join(STEPS)} (default: all but the grids)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all steps together (default 540)")
    parser.add_argument("--limits", default="", help="per-step seconds replacing the defaults, e.g. kernel=120,t5=150")
    parser.add_argument("--kernel-cases", default="", help="the kernel step's --cases (default: every case)")
    args = parser.parse_args(argv)
    try:
        limits = {name: float(sec) for name, sec in (item.split("=") for item in args.limits.split(",") if item)}
    except ValueError:
        parser.error(f"--limits must read STEP=SECONDS,...; got {args.limits!r}")
    if set(limits) - set(STEPS) or any(sec <= 0 for sec in limits.values()):
        parser.error(f"--limits must name steps among {', '.join(STEPS)} with positive seconds; got {args.limits!r}")
    wanted = [s for s in STEPS if s not in GRID_STEPS] if args.only is None else [s for s in args.only.split(",") if s]
    unknown = sorted(set(wanted) - set(STEPS))
    if unknown:
        parser.error(f"--only must name steps among {', '.join(STEPS)}; got {', '.join(unknown)}")
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    os.makedirs(args.out, exist_ok=True)
    import torch

    session = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
               "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
    deadline = time.time() + args.budget
    for name in (s for s in STEPS if s in wanted):
        limit, template = STEPS[name]
        limit = limits.get(name, limit)
        left = deadline - time.time()
        if left < 20:
            session["steps"][name] = {"status": "not run: the budget was spent", "seconds": 0}
            continue
        command = [part.format(out=args.out, kernel_cases=args.kernel_cases) for part in template]
        session["steps"][name] = run_step(name, min(limit, left), command, args.out)
        write_json(os.path.join(args.out, "session.json"), session)
    write_json(os.path.join(args.out, "session.json"), session)
    failed = [n for n, s in session["steps"].items() if s["status"] != 0]
    print(f"[gpu_session] done; steps not passed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
