"""Bucket function: golden values from the seeds, equality with transformers, properties, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relpos
from relpos import STRATEGIES, bucket_ranges, relative_offsets, relative_position_bucket, relative_positions, t5_bucket

hf_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
hf_bucket = hf_t5.T5Attention._relative_position_bucket


def valid_configs():
    """(bidirectional, num_buckets, max_distance) drawn over every valid shape."""
    return st.booleans().flatmap(
        lambda bidi: st.integers(2 if bidi else 1, 64).flatmap(
            lambda n: st.tuples(
                st.just(bidi),
                st.just(2 * n if bidi else n + 1),
                st.integers(((2 * n if bidi else n + 1) // (2 if bidi else 1)) // 2 + 1, 4096),
            )
        )
    )


# --- golden values ------------------------------------------------------------------------


def test_bucketing_walkthrough_worked_example():
    # T=4, num_buckets=8, max_distance=16, rel[i, j] = j - i
    got = t5_bucket(relative_positions(4, 4), num_buckets=8, max_distance=16)
    assert got.tolist() == [[0, 5, 6, 6], [1, 0, 5, 6], [2, 1, 0, 5], [2, 2, 1, 0]]


def test_t5_explainer_distance_table_corrected():
    # Seed 000 lists buckets for query - key distances with several wrong entries
    # (-100 -> 8, -10 -> 14, -5 -> 11, 0 -> 16, 10 -> 24 under a sign flip ...).
    # The reference (transformers) gives, for relative position = key - query:
    rel = torch.tensor([-100, -50, -10, -5, -1, 0, 1, 5, 10, 50, 100])
    expected = [15, 13, 8, 5, 1, 0, 17, 21, 24, 29, 31]
    assert t5_bucket(rel).tolist() == expected
    assert hf_bucket(rel).tolist() == expected


def test_t5_explainer_exact_and_log_regions():
    # 32 buckets, bidirectional, max_distance 128: exact for |d| < 8, log beyond; past keys in 0-15.
    rel = torch.arange(-200, 201)
    b = t5_bucket(rel)
    assert torch.equal(b[(rel <= 0) & (rel > -8)], -rel[(rel <= 0) & (rel > -8)])
    assert torch.equal(b[(rel > 0) & (rel < 8)], 16 + rel[(rel > 0) & (rel < 8)])
    assert set(b[rel < 0].tolist()) == set(range(1, 16))
    assert set(b[rel > 0].tolist()) == set(range(17, 32))
    assert b[rel == 0].item() == 0  # bucket 16 is never used (distance 0 is not "positive")


def test_bucket_ranges_match_function():
    for r in bucket_ranges(32, 128):
        for d in (r.low, r.high):
            if d is not None:
                assert t5_bucket(torch.tensor([d])).item() == r.bucket
    edges = {r.bucket: (r.low, r.high) for r in bucket_ranges(32, 128)}
    assert edges[15] == (None, -91) and edges[31] == (91, None) and edges[24] == (8, 11)


# --- equality with transformers ---------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(config=valid_configs(), low=st.integers(-10**6, 10**6), span=st.integers(1, 3000))
def test_equals_transformers_on_ranges(config, low, span):
    bidirectional, num_buckets, max_distance = config
    rel = torch.arange(low, low + span)
    kwargs = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(t5_bucket(rel, **kwargs), hf_bucket(rel, **kwargs))


@settings(max_examples=80, deadline=None)
@given(config=valid_configs(), strategy=st.sampled_from(STRATEGIES), low=st.integers(-5000, 5000),
       span=st.integers(1, 5000))
def test_offset_buckets_slice_the_kept_ramp_exactly(config, strategy, low, span):
    """Any range of offsets, read from the kept ramp (which grows past its first 1023 offsets), equals the bucket
    function (transformers' for the log strategy) on the same offsets."""
    from relpos.encodings.buckets import offset_buckets

    bidirectional, num_buckets, max_distance = config
    kwargs = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    high = min(low + span - 1, 5000)
    got = offset_buckets(low, high, strategy=strategy, **kwargs)
    rel = torch.arange(low, high + 1)
    assert torch.equal(got, relative_position_bucket(rel, strategy=strategy, **kwargs))
    if strategy == "log":
        assert torch.equal(got, hf_bucket(rel, **kwargs))


@settings(max_examples=80, deadline=None)
@given(config=valid_configs(), strategy=st.sampled_from(STRATEGIES),
       values=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-300, 300), min_size=1, max_size=60),
       int32=st.booleans())
def test_buckets_at_equal_the_bucket_function_for_any_offsets(config, strategy, values, int32):
    """A tensor of offsets (a static cache's), read from the kept ramp clamped at +-max_distance, equals the bucket
    function on the same offsets, extremes (int64's ends) and int32 tensors included (transformers' for log)."""
    from relpos.encodings.buckets import buckets_at

    bidirectional, num_buckets, max_distance = config
    kwargs = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    rel = torch.tensor(values, dtype=torch.long)
    if int32:
        rel = rel.clamp(-(2**31), 2**31 - 1).int()
    got = buckets_at(rel, strategy=strategy, **kwargs)
    assert got.dtype == torch.long and got.shape == rel.shape
    assert torch.equal(got, relative_position_bucket(rel, strategy=strategy, **kwargs))
    if strategy == "log" and not int32:
        assert torch.equal(got, hf_bucket(rel.clamp(-(2**62), 2**62), **kwargs))


def test_buckets_at_dispatches_three_operators_and_refuses_what_the_bucket_function_refuses():
    """Kept ramp warm: clamp, shift and index (the bucket function dispatches a dozen); under torch.compile it is the
    bucket function; float, boolean and non-tensor offsets and a bad configuration are refused as the bucket function
    refuses them."""
    from operators import dispatched

    from relpos.encodings.buckets import buckets_at

    rel = torch.arange(-40, 41) - torch.tensor(7)
    buckets_at(rel, num_buckets=8, max_distance=16)  # the ramp kept
    ops = {op: n for op, n in dispatched(lambda: buckets_at(rel, num_buckets=8, max_distance=16)).items()
           if "slice" not in op}  # the ramp's view
    full = dispatched(lambda: relative_position_bucket(rel, num_buckets=8, max_distance=16))
    assert sum(ops.values()) == 3 and sum(full.values()) >= 10, (ops, full)
    compiled = torch.compile(lambda r: buckets_at(r, num_buckets=8, max_distance=16), backend="eager", fullgraph=True)
    assert torch.equal(compiled(rel), relative_position_bucket(rel, num_buckets=8, max_distance=16))
    for bad, error in ((rel.float(), TypeError), (rel > 0, TypeError), ([1, 2], TypeError)):
        with pytest.raises(error, match="relative_position"):
            buckets_at(bad)
    with pytest.raises(ValueError, match="num_buckets must be even"):
        buckets_at(rel, num_buckets=7)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_equals_transformers_extreme_values(bidirectional):
    rel = torch.tensor([-(2**62), -(2**31), -(2**24) - 1, -1, 0, 1, 2**24 + 1, 2**31, 2**62])
    for num_buckets, max_distance in [(32, 128), (64, 256), (8, 16), (128, 4096)]:
        kw = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
        assert torch.equal(t5_bucket(rel, **kw), hf_bucket(rel, **kw))


def test_equals_transformers_every_small_config_dense():
    rel = torch.arange(-5000, 5001)
    for bidirectional in (True, False):
        for num_buckets in range(4 if bidirectional else 2, 70, 2 if bidirectional else 1):
            max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
            for max_distance in {max_exact + 1, max_exact + 7, 128, 1000}:
                if max_distance <= max_exact:
                    continue
                kw = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
                assert torch.equal(t5_bucket(rel, **kw), hf_bucket(rel, **kw)), kw


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int64])
def test_integer_dtypes(dtype):
    rel = torch.arange(-300, 300, dtype=dtype)
    assert torch.equal(t5_bucket(rel), hf_bucket(rel.long()))


def test_low_precision_context_does_not_change_buckets():
    # The log in bf16 misplaces +-16, +-32, +-90; relpos always evaluates it in fp32.
    rel = torch.arange(-300, 301)
    expected = hf_bucket(rel)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(t5_bucket(rel), expected)
    bias = relpos.RelativePositionalBias(4, dtype=torch.bfloat16)
    assert torch.equal(bias.bucket(rel), expected)
    # demonstrate the pitfall the fp32 evaluation avoids
    d = torch.tensor([16, 32, 90])
    bf16 = 8 + (torch.log(d.to(torch.bfloat16) / 8) / math.log(16) * 8).long()
    assert not torch.equal(bf16, t5_bucket(d) - 16)


# --- properties ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(config=valid_configs(), strategy=st.sampled_from(STRATEGIES), rel=st.lists(st.integers(-10**9, 10**9), min_size=1))
def test_in_range(config, strategy, rel):
    bidirectional, num_buckets, max_distance = config
    b = relative_position_bucket(
        torch.tensor(rel), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance, strategy=strategy
    )
    assert b.min() >= 0 and b.max() < num_buckets


@settings(max_examples=120, deadline=None)
@given(config=valid_configs(), strategy=st.sampled_from(STRATEGIES))
def test_monotone_in_distance_and_saturating(config, strategy):
    bidirectional, num_buckets, max_distance = config
    kw = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance, strategy=strategy)
    d = torch.arange(0, 2 * max_distance + 3)
    past = relative_position_bucket(-d, **kw)
    assert torch.all(past[1:] >= past[:-1])  # farther in the past: same or later bucket
    half = num_buckets // 2 if bidirectional else num_buckets
    assert torch.all(past[d >= max_distance] == half - 1)
    if bidirectional:
        future = relative_position_bucket(d[1:], **kw)
        assert torch.all(future[1:] >= future[:-1])
        assert torch.all(future >= half)  # the future half
        assert torch.all(future[d[1:] >= max_distance] == num_buckets - 1)


@settings(max_examples=60, deadline=None)
@given(
    config=valid_configs(),
    lq=st.integers(1, 40),
    lk=st.integers(1, 40),
    shift=st.integers(0, 10**5),
)
def test_translation_invariance(config, lq, lk, shift):
    bidirectional, num_buckets, max_distance = config
    kw = dict(bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    qpos = torch.arange(lq)
    kpos = torch.arange(lk)
    base = t5_bucket(kpos[None] - qpos[:, None], **kw)
    moved = t5_bucket((kpos + shift)[None] - (qpos + shift)[:, None], **kw)
    assert torch.equal(base, moved)


@settings(max_examples=60, deadline=None)
@given(config=valid_configs(), rel=st.lists(st.integers(1, 10**9), min_size=1))
def test_causal_blind_to_future(config, rel):
    _, num_buckets, max_distance = config
    max_distance = max(max_distance, num_buckets // 2 + 1)
    b = t5_bucket(torch.tensor(rel), bidirectional=False, num_buckets=num_buckets, max_distance=max_distance)
    assert torch.all(b == 0)  # every future key: bucket 0


@pytest.mark.parametrize("strategy", ["linear", "quadratic", "uniform"])
def test_other_strategies_shape(strategy):
    d = torch.arange(0, 200)
    b = relative_position_bucket(-d, bidirectional=True, num_buckets=32, max_distance=128, strategy=strategy)
    if strategy != "uniform":
        assert torch.equal(b[:8], d[:8])  # exact region like T5
    assert b[127].item() <= 15 and b[128].item() == 15
    if strategy == "linear":  # 8 equal far buckets of width (128 - 8) / 8 = 15
        assert b[8].item() == 8 and b[22].item() == 8 and b[23].item() == 9 and b[127].item() == 15
    if strategy == "uniform":  # 16 buckets of width 8 over [0, 128)
        assert torch.equal(b[:128], d[:128] // 8)
    if strategy == "quadratic":  # far bucket k starts at d = 8 + ceil(120 * (k/8)^2)
        starts = [int(torch.nonzero(b == 8 + k)[0]) for k in range(8)]
        assert starts == [8 + math.ceil(120 * k * k / 64) for k in range(8)] == [8, 10, 16, 25, 38, 55, 76, 100]


def test_relative_positions_and_offsets():
    assert relative_positions(2, 3, q_offset=1).tolist() == [[-1, 0, 1], [-2, -1, 0]]
    offs = relative_offsets(2, 3, q_offset=1)
    assert offs.tolist() == [-2, -1, 0, 1]
    full = relative_positions(5, 7, q_offset=3)
    assert torch.equal(torch.unique(full), relative_offsets(5, 7, q_offset=3))


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(num_buckets=31), ValueError, ["num_buckets", "31", "even"]),
        (dict(num_buckets=2), ValueError, ["num_buckets", ">= 4", "2"]),
        (dict(num_buckets=1, bidirectional=False), ValueError, ["num_buckets", ">= 2"]),
        (dict(num_buckets=32, max_distance=8), ValueError, ["max_distance", "max_exact=8", "8"]),
        (dict(num_buckets=32, max_distance=-5), ValueError, ["max_distance", "-5"]),
        (dict(num_buckets=32.0), TypeError, ["num_buckets", "int"]),
        (dict(max_distance=True), TypeError, ["max_distance"]),
        (dict(strategy="cubic"), ValueError, ["strategy", "cubic", "log"]),
        (dict(bidirectional="yes"), TypeError, ["bidirectional"]),
    ],
)
def test_bad_config(kwargs, exc, words):
    with pytest.raises(exc) as info:
        relative_position_bucket(torch.arange(3), **kwargs)
    for w in words:
        assert w in str(info.value)


def test_bad_relative_position():
    with pytest.raises(TypeError, match="integer dtype"):
        t5_bucket(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        t5_bucket([1, 2])
    with pytest.raises(ValueError, match="query_length must be positive, got 0"):
        relative_positions(0, 3)
    with pytest.raises(ValueError, match="q_offset must be non-negative, got -1"):
        relative_offsets(2, 3, q_offset=-1)


def _brute_force_ranges(num_buckets, max_distance, bidirectional, strategy):
    """The definition: scan every distance up to max_distance + 1 (which stands for all beyond)."""
    from relpos.encodings.buckets import BucketRange

    reach = max_distance + 1
    rel = torch.arange(-reach, reach + 1)
    buckets = relpos.relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance, strategy=strategy
    )
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = 0 if strategy == "uniform" else half // 2
    out = []
    for b in torch.unique(buckets).tolist():
        members = rel[buckets == b]
        low, high = int(members.min()), int(members.max())
        out.append(BucketRange(b, None if low == -reach else low, None if high == reach else high,
                               low == high and abs(low) < max_exact))
    return out


@pytest.mark.parametrize("strategy", relpos.STRATEGIES)
@pytest.mark.parametrize("bidirectional", [True, False])
def test_bucket_ranges_by_binary_search_equal_the_scan(strategy, bidirectional):
    checked = 0
    for num_buckets in range(2, 36):
        for max_distance in (1, 2, 3, 5, 8, 13, 33, 100, 128, 300):
            try:
                relpos.check_bucket_config(num_buckets, max_distance, bidirectional, strategy)
            except ValueError:
                continue
            got = relpos.bucket_ranges(num_buckets, max_distance, bidirectional=bidirectional, strategy=strategy)
            assert got == _brute_force_ranges(num_buckets, max_distance, bidirectional, strategy)
            checked += 1
    assert checked > 50


def test_bucket_tables_are_bounded_by_the_number_of_buckets():
    """O(num_buckets log max_distance): huge distances cost nothing (the scan took minutes and GBs)."""
    table = relpos.bucket_table(4, 10**8)
    assert [b["bucket"] for b in table["buckets"]] == [0, 1, 3] and table["unused_buckets"] == [2]  # no future d = 0
    assert table["buckets"][-1]["high"] is None and table["buckets"][1]["low"] is None
    ranges = relpos.bucket_ranges(2000, 10**9)
    assert len(ranges) == 1999 and ranges[0].low == 0 and ranges[-1].high is None  # bucket 1000 (future d = 0) unused


def test_offset_buckets_bad_ranges():
    from relpos.encodings.buckets import offset_buckets

    with pytest.raises(ValueError, match="low <= high.*low=3, high=2"):
        offset_buckets(3, 2)
    with pytest.raises(TypeError, match="high must be an int, got 2.5"):
        offset_buckets(0, 2.5)
    with pytest.raises(ValueError, match="device must name a device"):
        offset_buckets(0, 2, device="gpu0")


@pytest.mark.parametrize("low,high", [(-1023, 1023), (-1024, 0), (0, 1024), (-1025, 1025), (-2048, -2047), (5, 5)])
def test_offset_buckets_at_the_ramp_edges(low, high):
    """Ranges at the first ramp's reach (offsets up to 1023), one past it and at the doubled one's edge, a single
    offset: the bucket function's values (transformers' for T5's configuration)."""
    from relpos.encodings.buckets import offset_buckets

    for bidirectional in (True, False):
        got = offset_buckets(low, high, bidirectional=bidirectional)
        assert torch.equal(got, hf_bucket(torch.arange(low, high + 1), bidirectional=bidirectional, num_buckets=32,
                                          max_distance=128))
