"""FIRE's loss past the training length with its position normalization fixed, from a finished run.

FIRE divides each query's log-distances by ``psi(max(L, i))``: past its threshold ``L`` the same
distance reaches its MLP as a smaller input at every later position. This evaluates every trained
FIRE seed of a run folder (``results.json`` and ``checkpoints/``) on held-out windows at the
longest length twice, as trained and with every query normalized by ``psi(L)``
(``relpos.experiment.diagnostics.fixed_fire_normalizer``), and writes ``fire-normalizer.json``
(atomically) beside ``results.json``. New runs record the same ablation in results.json
(``fire_normalizer``); this tool adds it to runs made before it existed.

    python tools/fire_normalizer.py docs/extrapolate/reference --checkpoints /path/to/run/checkpoints
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from relpos._io import write_text
from relpos.experiment.diagnostics import fire_normalizer_ablation
from relpos.experiment.model import LMConfig, TransformerLM
from relpos.experiment.runner import FIRE_PROBE_WINDOWS, RunConfig, _checkpoint_path, make_problem


def _config(saved: dict) -> RunConfig:
    fields = RunConfig.__dataclass_fields__
    return RunConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="folder with results.json")
    parser.add_argument("--checkpoints", help="folder of the run's checkpoints (default: RUN/checkpoints)")
    parser.add_argument("--windows", type=int, default=FIRE_PROBE_WINDOWS, help="held-out windows at the longest length")
    args = parser.parse_args(argv)
    run = pathlib.Path(args.run)
    saved = json.loads((run / "results.json").read_text())
    if "fire" not in saved["runs"]:
        raise ValueError(f"{run / 'results.json'} has no FIRE model (its encodings: {saved['config']['encodings']})")
    checkpoints = pathlib.Path(args.checkpoints) if args.checkpoints else run / "checkpoints"
    config = _config(saved["config"])
    problem = make_problem(config)
    x, y = problem.held_out(problem.lengths[-1], args.windows)
    out = {}
    for seed, result in sorted(saved["runs"]["fire"].items()):
        model = TransformerLM(LMConfig(**result["model"]))
        path = checkpoints / _checkpoint_path(config, "fire", int(seed), result["lr"]).name  # the runner's file name
        model.load_state_dict(torch.load(path, weights_only=True)["model"])
        out[seed] = fire_normalizer_ablation(model, x, y, problem.train_len)
        first, last = out[seed]["as_trained"], out[seed]["fixed_normalizer"]
        print(f"seed {seed}: last stretch {first[-1]:.3f} as trained, {last[-1]:.3f} with psi(L) for every query "
              f"(L = {out[seed]['threshold'][0]:.1f})", flush=True)
    write_text(run / "fire-normalizer.json", json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
