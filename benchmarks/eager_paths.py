"""The eager encodings (Shaw, CoPE) in the experiment's model, against two without an (L, L) term:
docs/benchmarks/encodings/index.md, "Eager paths".

One thread. For each encoding, the reference preset's model (width 64, 2 layers, 4 heads):
one evaluation forward of the experiment's chunk at the longest length (8 windows x 1,024 bytes,
``torch.no_grad``) and the median of 30 training steps (batch 32 x 64 bytes, AdamW). Prints one JSON
line. Two trees are compared by running this file with each on ``PYTHONPATH``, alternately:

    for i in 1 2; do
      PYTHONPATH=/path/to/old/src python benchmarks/eager_paths.py --label old
      PYTHONPATH=src python benchmarks/eager_paths.py --label new
    done
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from relpos.experiment.model import LMConfig, TransformerLM
from relpos.experiment.problems import _rows


def measure(encoding: str, length: int = 1024, steps: int = 30) -> dict:
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(encoding=encoding, dim=64, layers=2, heads=4, train_len=64, max_distance=64,
                                   clip_distance=64))
    windows = torch.randint(0, 256, (_rows(length), length))  # (8, 1024): one evaluation call
    model.eval()
    with torch.no_grad():
        model(windows[:1])  # warm-up
        began = time.perf_counter()
        model(windows)
        evaluation = time.perf_counter() - began
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (32, 64))  # (B, L)
    times = []
    for step in range(steps + 5):
        began = time.perf_counter()
        loss = F.cross_entropy(model(batch).flatten(0, 1), batch.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= 5:  # the first steps warm up
            times.append(time.perf_counter() - began)
    return {"eval_ms": evaluation * 1000, "eval_rows": windows.shape[0], "step_ms": statistics.median(times) * 1000}


def markdown(records: list[dict], before: str = "old", after: str = "new") -> str:
    """The before/after table of the JSON lines (one per run; the median of each label's runs), as in
    docs/benchmarks/encodings/eager-paths.md (``tools/bench_tables.py`` renders it from the committed lines)."""
    def median(label: str, encoding: str, key: str) -> float:
        return statistics.median(r[encoding][key] for r in records if r["label"] == label)

    encodings = [k for k in records[0] if isinstance(records[0][k], dict)]
    lines = ["| encoding | evaluation call, before (ms) | after (ms) | speed-up | training step, before (ms) | after (ms) | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for name in encodings:
        (e0, e1), (s0, s1) = ((median(before, name, k), median(after, name, k)) for k in ("eval_ms", "step_ms"))
        lines.append(f"| {name} | {e0:.0f} | {e1:.0f} | {e0 / e1:.2f}x | {s0:.1f} | {s1:.1f} | {s0 / s1:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", default="shaw,cope,none,t5")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"label": args.label, "torch": torch.__version__,
                      **{name: measure(name) for name in args.encodings.split(",")}}))


if __name__ == "__main__":
    main()
