"""A generated walk over ``relpos.__all__``: every public callable, every annotated argument, bad values.

For each callable there is one valid call (``VALID``); the walk replaces one argument at a time
by a value its annotation rules out (a string for a bool, a float or a bool for an int, NaN for
a float, an unknown name for a mode, a list for a tensor) and asserts a TypeError/ValueError
whose message names that argument. Anything accepted silently, or refused with another error,
fails the test with the case spelled out.
"""

import inspect
import math

import pytest
import torch

import relpos

Q = torch.randn(1, 4, 5, 8)  # (B, H, L, d)

VALID = {
    "ALiBi": dict(num_heads=4),
    "ClippedRelativeBias": dict(num_heads=4, max_distance=3),
    "ContinuousPositionBias": dict(num_heads=2, window_size=3),
    "WindowAttention": dict(dim=8, num_heads=2, window_size=2),
    "resize_bias_table": dict(table=torch.randn(9, 2), old_window=2, new_window=3),
    "resize_state_dict": dict(state_dict={}, model=torch.nn.Linear(1, 1)),
    "shift_mask": dict(height=4, width=4, window=2, shift=1),
    "window_attention": dict(q=torch.randn(1, 2, 2, 4, 8), k=torch.randn(1, 2, 2, 4, 8), v=torch.randn(1, 2, 2, 4, 8)),
    "projected_window_attention": dict(x=torch.randn(1, 2, 4, 8), weights=[torch.randn(8, 8)] * 3, biases=[None] * 3,
                                       heads=2),
    "window_merge": dict(windows=torch.randn(1, 4, 4, 2), window=2, height=4, width=4),
    "window_partition": dict(x=torch.randn(1, 4, 4, 2), window=2),
    "CoPE": dict(head_dim=8, max_positions=16),
    "AxialRotary2D": dict(head_dim=8),
    "MixedRotary2D": dict(head_dim=8, num_heads=2),
    "DINOv3Rotary2D": dict(head_dim=8),
    "DecomposedRelPos": dict(input_size=4, head_dim=8),
    "decomposed_attention": dict(query=torch.randn(1, 2, 4, 8), key=torch.randn(1, 2, 4, 8), value=torch.randn(1, 2, 4, 8),
                                 rel_h=torch.randn(1, 2, 4, 2), rel_w=torch.randn(1, 2, 4, 2)),
    "FIREBias": dict(num_heads=4),
    "ForgettingGate": dict(dim=16, num_heads=4),
    "KerpleBias": dict(num_heads=4),
    "SandwichBias": dict(num_heads=4, dim=16),
    "XPos": dict(head_dim=8),
    "gated_attention": dict(query=Q, key=Q, value=Q, key_gate=torch.zeros(1, 4, 5)),
    "FactorizedRelativePositionBias": dict(num_heads=2, window_size=3),
    "LearnedAbsolutePositionEmbedding": dict(max_length=8, dim=4),
    "LogDecayBias": dict(scale=0.3, num_heads=1),
    "MultiheadAttention": dict(embed_dim=16, num_heads=4),
    "OffsetBias": dict(values=torch.zeros(4, 9), query_length=5, key_length=5),
    "RelativePositionBias": dict(num_heads=2, window_size=3),
    "RelativePositionalBias": dict(num_heads=4),
    "RotaryEmbedding": dict(head_dim=8),
    "ShawRelativePosition": dict(head_dim=8, max_distance=2),
    "SinusoidalPositionEmbedding": dict(dim=4),
    "T5Attention": dict(dim=16, num_heads=4),
    "T5Block": dict(dim=16, num_heads=4, ff_dim=32, relative_bias=None, causal=False),
    "T5Stack": dict(num_layers=1, dim=16, num_heads=4, ff_dim=32),
    "alibi_slopes": dict(num_heads=4),
    "attention": dict(query=Q, key=Q, value=Q),
    "bucket_ranges": dict(),
    "bucket_table": dict(),
    "check_bucket_config": dict(num_buckets=32, max_distance=128),
    "cross_attention_with_bias": dict(query=Q, key=Q, value=Q, relative_bias=relpos.RelativePositionalBias(4)),
    "relative_offsets": dict(query_length=4, key_length=4),
    "relative_position_bucket": dict(relative_position=torch.arange(-3, 4)),
    "relative_positions": dict(query_length=4, key_length=4),
    "resolve_bias": dict(bias=None, query_length=4, key_length=4, num_heads=4),
    "select_backend": dict(query=Q, key=Q, value=Q),
    "t5_bucket": dict(relative_position=torch.arange(-3, 4)),
    "table_size": dict(window_size=3),
    "window_coords": dict(window_size=3),
    "window_relative_position_index": dict(window_size=3),
}

# not callables with arguments to probe: constants, abstract bases, plain records
NOT_PROBED = {"__version__", "STRATEGIES", "AdditiveBias", "RelativeBias", "BackendChoice", "BucketRange", "KVCache",
              "T5RelativeBias", "WindowRelativeBias"}  # aliases: the classes are probed under their names

# arguments whose bad value has a different meaning (documented), with the reason
EXEMPT = {
    ("T5Block", "relative_bias"), ("T5Attention", "relative_bias"), ("MultiheadAttention", "position"),
    ("resolve_bias", "bias"), ("attention", "bias"), ("select_backend", "bias"),  # any BiasLike; tested elsewhere
    ("RotaryEmbedding", "inv_freq"), ("RotaryEmbedding", "scaling"),  # sequences / dicts: tests in test_encodings, test_rope_scaling
    ("ALiBi", "slopes"),
}


def _bad_values(annotation: str):
    a = annotation.replace(" ", "")
    if a.startswith("bool"):
        return [("no", TypeError), (1, TypeError)]
    if a in ("int", "int|None"):
        return [(1.5, TypeError), (True, TypeError), (-1, ValueError)]
    if a.startswith("int|Sequence"):
        return [(1.5, TypeError), (0, ValueError)]
    if a in ("float", "float|None"):
        return [(math.nan, ValueError), ("1", TypeError)]
    if a.startswith(("Literal", "BucketStrategy", "Backend", "Convention")):
        return [("nonsense", ValueError)]
    if a.startswith("torch.Tensor") and "Sequence" not in a:
        return [([1.0, 2.0], TypeError)]
    if a.startswith("torch.device"):
        return [("no-such-device", ValueError)]
    if a.startswith("torch.dtype"):
        return [("float32", TypeError)]
    return []


def _cases():
    for name in relpos.__all__:
        if name in NOT_PROBED:
            continue
        assert name in VALID, f"{name} is public but has no valid call in VALID: add one"
        target = getattr(relpos, name)
        for pname, param in inspect.signature(target).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or (name, pname) in EXEMPT:
                continue
            annotation = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
            for value, error in _bad_values(annotation):
                yield pytest.param(name, pname, value, error, id=f"{name}-{pname}={value!r}")


# public methods that take sizes and offsets: (class, method, valid keyword arguments)
METHODS = [
    (cls, method, dict(query_length=4, key_length=4))
    for cls in ("RelativePositionalBias", "ClippedRelativeBias", "ALiBi", "LogDecayBias")
    for method in ("forward", "materialize", "offsets")
] + [
    ("RotaryEmbedding", "forward", dict(q=Q, k=Q)),
    ("RotaryEmbedding", "rotate", dict(x=Q)),
    ("ShawRelativePosition", "attention", dict(q=Q, k=Q, v=Q)),
    ("MultiheadAttention", "forward", dict(x=torch.randn(1, 5, 16))),
]


def _method_cases():
    for cls, method, valid in METHODS:
        target = getattr(getattr(relpos, cls)(**VALID[cls]), method)
        for pname, param in inspect.signature(target).parameters.items():
            annotation = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or annotation.startswith("torch.Tensor|None"):
                continue
            for value, error in _bad_values(annotation):
                yield pytest.param(cls, method, valid, pname, value, error, id=f"{cls}.{method}-{pname}={value!r}")


@pytest.mark.parametrize("cls,method,valid,pname,value,error", list(_method_cases()))
def test_bad_value_to_a_method_is_refused_naming_the_argument(cls, method, valid, pname, value, error):
    target = getattr(getattr(relpos, cls)(**VALID[cls]), method)
    target(**valid)  # the valid call works
    _expect_refusal(f"{cls}.{method}", target, {**valid, pname: value}, pname, value, error)


def _expect_refusal(label, target, kwargs, pname, value, error):
    try:
        target(**kwargs)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        assert pname in message, f"{label}({pname}={value!r}) refused, but the message does not name {pname!r}: {message}"
        if error is TypeError and isinstance(exc, ValueError) and not isinstance(value, str):
            pytest.fail(f"{label}({pname}={value!r}) raised ValueError, expected TypeError (wrong kind of value): {message}")
    except Exception as exc:  # noqa: BLE001: any other error is an unclear one
        pytest.fail(f"{label}({pname}={value!r}) raised {type(exc).__name__}: {exc}")
    else:
        pytest.fail(f"{label}({pname}={value!r}) was silently accepted")


def test_every_public_callable_has_a_valid_call():
    for name in VALID:
        getattr(relpos, name)(**VALID[name])


@pytest.mark.parametrize("name,pname,value,error", list(_cases()))
def test_bad_value_is_refused_naming_the_argument(name, pname, value, error):
    _expect_refusal(name, getattr(relpos, name), {**VALID[name], pname: value}, pname, value, error)
