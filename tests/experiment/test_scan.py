"""SCAN from its grammar: the paper's examples, the dataset's and the length split's sizes, and the
problem the runner trains on (held-out commands, the end token, exact match = greedy decoding)."""

import collections

import pytest
import torch

from relpos.experiment import runner as ex
from relpos.experiment import scan
from relpos.experiment.problems import ScanProblem, _exact_matches

L, R = "I_TURN_LEFT", "I_TURN_RIGHT"


@pytest.mark.parametrize("command, expected", [  # Lake & Baroni 2018, Figure 1
    ("jump", ["I_JUMP"]),
    ("jump left", [L, "I_JUMP"]),
    ("jump around right", [R, "I_JUMP"] * 4),
    ("turn left twice", [L, L]),
    ("jump thrice", ["I_JUMP"] * 3),
    ("jump opposite left and walk thrice", [L, L, "I_JUMP", "I_WALK", "I_WALK", "I_WALK"]),
    ("jump opposite left after walk around left", [L, "I_WALK"] * 4 + [L, L, "I_JUMP"]),
    ("turn around right", [R] * 4),
    ("turn opposite left", [L, L]),
])
def test_the_papers_examples(command, expected):
    assert scan.actions(command) == expected


def test_the_dataset_and_the_length_split_have_the_papers_sizes():
    commands = scan.commands()
    assert len(commands) == len(set(commands)) == 20910
    train, test = scan.length_split()
    assert (len(train), len(test)) == (16990, 3920)
    assert max(len(scan.actions(c)) for c in train) == 22
    lengths = collections.Counter(len(scan.actions(c)) for c in test)
    assert sorted(lengths) == [24, 25, 26, 27, 28, 30, 32, 33, 36, 40, 48]  # no command has 23 actions
    assert max(len(c.split()) for c in commands) == 9


def test_encoding_round_trips_and_ends_with_the_end_token():
    tokens, start = scan.encode("walk around left and jump")
    words = [scan.WORDS[t] for t in tokens[1 : start - 1].tolist()]
    assert words == "walk around left and jump".split() and tokens[start - 1] == scan.SEP
    answer = tokens[start:].tolist()
    assert answer[-1] == scan.EOS
    assert [scan.ACTIONS[t - len(scan.WORDS)] for t in answer[:-1]] == scan.actions("walk around left and jump")


def test_problem_holds_out_training_commands_and_tests_longer_ones():
    problem = ScanProblem(eval_instances=None)
    held = {tuple(t.tolist()) for t, _ in problem._held}
    trained = {tuple(t.tolist()) for t, _ in problem._train}
    assert not held & trained and len(held) + len(trained) == 16990
    assert problem.lengths[0] == 22 and problem.trained_lengths == [22] and problem.lengths[1:][0] == 24
    assert sum(len(problem._groups[n]) for n in problem.lengths[1:]) == 3920
    x, y = problem.batch(0, 64)
    assert x.shape[1] <= problem.train_len and (y != -100).any(dim=1).all()
    assert problem.input_length(48) > problem.train_len


class _Scripted(torch.nn.Module):
    """A "model" that continues each prompt with a fixed sequence (the right answer, or a wrong one)."""

    def __init__(self, continuations: dict) -> None:
        super().__init__()
        self.continuations = continuations
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):  # (B, T) -> (B, T, V): the scripted token after every prefix
        logits = torch.zeros(*x.shape, scan.SCAN_VOCAB)
        for row, tokens in enumerate(x.tolist()):
            full = next(v for k, v in self.continuations.items() if tokens[: len(k)] == list(k))
            for t in range(x.shape[1]):
                logits[row, t, full[t + 1] if t + 1 < len(full) else scan.PAD] = 1.0
        return logits


def test_exact_match_is_greedy_decoding():
    """An instance counts as correct exactly when decoding greedily from the prompt gives the whole
    answer, the end token included: one scripted continuation is right, one stops one action late."""
    right, right_start = scan.encode("jump around right")
    late, late_start = scan.encode("walk twice")
    wrong = late.tolist()[:-1] + [late.tolist()[-2], scan.EOS]  # one action too many before the end
    model = _Scripted({tuple(right[:right_start].tolist()): right.tolist(), tuple(late[:late_start].tolist()): wrong})
    for (tokens, start), expected in (((right, right_start), 1), ((late, late_start), 0)):
        sequence = tokens[:start].tolist()
        while len(sequence) < tokens.numel():
            sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
        assert int(sequence == tokens.tolist()) == expected  # what greedy decoding gives
        assert _exact_matches(model, [(tokens, start)], "cpu", scan.PAD) == expected
    assert _exact_matches(model, [(right, right_start), (late, late_start)], "cpu", scan.PAD) == 1  # padded together


def test_runs_through_the_task_runner(tmp_path):
    config = ex.RunConfig(**{**ex.TASK_PRESETS["smoke"], "task": "scan", "out": str(tmp_path), "progress": False,
                             "plot": False, "encodings": ("alibi",), "rope_scalings": ()})
    report = ex.run(config)
    cells = report["runs"]["alibi"]["0"]["eval"]
    assert set(cells) == {str(n) for n in [22, 24, 25, 26, 27, 28, 30, 32, 33, 36, 40, 48]}
    assert all(c["instances"] == 16 for c in cells.values())
