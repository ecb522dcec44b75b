"""Train short, test long: the length-generalization experiments.

The layout follows the experiment:

* ``data``: byte corpora (the Python standard library by default) and their batches;
* ``tasks``: algorithmic tasks (copy, reverse, sort, addition) generated from a seed;
* ``model``: the small decoder-only transformer whose only variable is its position encoding;
* ``variants``: which models a run compares (encodings, T5 settings, ablations, RoPE scalings);
* ``problems``: text or a task, each with its batches and its evaluation;
* ``runner``: training once per seed, checkpoints, resume, results files;
* ``stats`` and ``report``: mean and spread over seeds, significance, tables, plots, rankings;
* ``cli``: ``relpos extrapolate`` and ``relpos tasks``.
"""

from .model import ENCODINGS, LMConfig, TransformerLM
from .runner import PRESETS, TASK_PRESETS, RunConfig, run
from .tasks import TASKS

__all__ = ["ENCODINGS", "LMConfig", "TransformerLM", "PRESETS", "TASK_PRESETS", "RunConfig", "run", "TASKS"]
