"""SCAN (Lake & Baroni, ICML 2018), generated from its grammar: commands such as
``jump around left twice after walk`` translated into actions, and its *length* split (train on
action sequences of at most 22 actions, test on 24 to 48). Nothing is downloaded: the whole
dataset is every command the grammar produces (20,910), each with the one action sequence its
interpretation function gives.

The grammar and interpretation (Lake & Baroni 2018, their Figure 6)::

    C -> S and S | S after S | S            [[x1 and x2]] = [[x1]] [[x2]],  [[x1 after x2]] = [[x2]] [[x1]]
    S -> V twice | V thrice | V             [[x twice]] = [[x]] [[x]],      [[x thrice]] = [[x]] [[x]] [[x]]
    V -> X opposite R | X around R | D | U  [[u opposite left]] = LTURN LTURN [[u]], [[turn opposite left]] = LTURN LTURN
                                            [[u around left]] = (LTURN [[u]]) x 4,   [[turn around left]] = LTURN x 4
    D -> X R                                [[u left]] = LTURN [[u]],       [[turn left]] = LTURN
    X -> U | turn,  R -> left | right,  U -> walk | look | run | jump

>>> actions("jump around left twice after walk")
['I_WALK', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP', 'I_TURN_LEFT', 'I_JUMP']
>>> len(commands()), [len(s) for s in length_split()]
(20910, [16990, 3920])
"""

from __future__ import annotations

import functools
import itertools

import torch

__all__ = ["WORDS", "ACTIONS", "SCAN_VOCAB", "TRAIN_MAX_ACTIONS", "commands", "actions", "length_split", "encode"]

WORDS = ("walk", "look", "run", "jump", "turn", "left", "right", "opposite", "around", "twice", "thrice", "and", "after")
ACTIONS = ("I_WALK", "I_LOOK", "I_RUN", "I_JUMP", "I_TURN_LEFT", "I_TURN_RIGHT")
#: token ids: the words, the actions, then start, separator, end of the answer, padding
BOS, SEP, EOS, PAD = len(WORDS) + len(ACTIONS) + 0, len(WORDS) + len(ACTIONS) + 1, len(WORDS) + len(ACTIONS) + 2, len(WORDS) + len(ACTIONS) + 3
SCAN_VOCAB = PAD + 1
#: the length split: training commands have at most this many actions (the test ones 24 to 48)
TRAIN_MAX_ACTIONS = 22

_PRIMITIVES = ("walk", "look", "run", "jump")
_TURN = {"left": "I_TURN_LEFT", "right": "I_TURN_RIGHT"}


def _verb_phrases() -> list[str]:
    """Every V: 4 primitives, 10 directed, 10 opposite, 10 around (34)."""
    doers = (*_PRIMITIVES, "turn")
    return ([*_PRIMITIVES] + [f"{x} {r}" for x in doers for r in _TURN]
            + [f"{x} {m} {r}" for m in ("opposite", "around") for x in doers for r in _TURN])


@functools.lru_cache(maxsize=1)
def commands() -> tuple[str, ...]:
    """Every command of the grammar, in a fixed order (20,910)."""
    sentences = [f"{v}{times}" for v in _verb_phrases() for times in ("", " twice", " thrice")]  # 102
    pairs = [f"{a} {join} {b}" for join in ("and", "after") for a, b in itertools.product(sentences, repeat=2)]
    return tuple(sentences + pairs)


def _verb(words: list[str]) -> list[str]:
    doer = [] if words[0] == "turn" else ["I_" + words[0].upper()]
    if len(words) == 1:
        return doer
    turn = _TURN[words[-1]]
    if len(words) == 2:
        return [turn] + doer
    if words[1] == "opposite":
        return [turn, turn] + doer
    return ([turn] + doer) * 4  # around


def _sentence(words: list[str]) -> list[str]:
    times = {"twice": 2, "thrice": 3}.get(words[-1])
    return _verb(words[:-1]) * times if times else _verb(words)


def actions(command: str) -> list[str]:
    """The interpretation of a command: its action sequence."""
    words = command.split()
    for join in ("and", "after"):
        if join in words:
            k = words.index(join)
            first, second = _sentence(words[:k]), _sentence(words[k + 1:])
            return first + second if join == "and" else second + first
    return _sentence(words)


@functools.lru_cache(maxsize=1)
def length_split() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(training commands: at most 22 actions, test commands: more), in :func:`commands`' order."""
    train = tuple(c for c in commands() if len(actions(c)) <= TRAIN_MAX_ACTIONS)
    test = tuple(c for c in commands() if len(actions(c)) > TRAIN_MAX_ACTIONS)
    return train, test


def encode(command: str) -> tuple[torch.Tensor, int]:
    """Tokens ``[BOS, words, SEP, actions, EOS]`` (int64) and the index where the answer starts.

    >>> tokens, start = encode("walk twice")
    >>> tokens.tolist(), start
    ([19, 0, 9, 20, 13, 13, 21], 4)
    """
    words = [WORDS.index(w) for w in command.split()]
    answer = [len(WORDS) + ACTIONS.index(a) for a in actions(command)] + [EOS]
    return torch.tensor([BOS, *words, SEP, *answer], dtype=torch.long), len(words) + 2
