"""``splitkv_tune.batches``: every form's exact lengths, the log-normal mean and seed, every error."""
import math
import statistics

import pytest

from splitkv_tune.batches import MAX_BATCH, describe, parse_lengths


@pytest.mark.parametrize("text,expected", [
    ("65536,1024x15", (65536,) + (1024,) * 15),
    ("7", (7,)),
    (" 3 , 5x2 ,1 ", (3, 5, 5, 1)),
    ("2x1,1x3", (2, 1, 1, 1)),
    ("uniform:16:8192", (8192,) * 16),
    ("uniform:1:1", (1,)),
    ("skewed:16:65536:1024", (65536,) + (1024,) * 15),
    ("skewed:256:131072:512", (131072,) + (512,) * 255),
    ("skewed:1:9:3", (9,)),
    ("geometric:8:262144:2048", (262144, 131072, 65536, 32768, 16384, 8192, 4096, 2048)),
    ("geometric:3:1000:10", (1000, 100, 10)),
    ("geometric:4:100:100", (100,) * 4),
    ("geometric:1:50:50", (50,)),
])
def test_exact_lengths(text, expected):
    assert parse_lengths(text) == expected


def test_the_issue_batches():
    assert parse_lengths("65536,1024x15") == parse_lengths("skewed:16:65536:1024")
    big = parse_lengths("skewed:256:131072:512")
    assert describe(big) == {"batch": 256, "min": 512, "max": 131072,
                             "mean": (131072 + 255 * 512) / 256, "total": 131072 + 255 * 512}
    geo = parse_lengths("geometric:8:262144:2048")
    assert geo[0] == 262144 and geo[-1] == 2048 and len(geo) == 8
    assert all(a == 2 * b for a, b in zip(geo, geo[1:]))


def test_geometric_rounds_between_the_ends():
    lengths = parse_lengths("geometric:5:1000:1")
    assert lengths == (1000, 178, 32, 6, 1)  # 1000 * 10**(-3 i / 4), rounded


@pytest.mark.parametrize("mean,sigma", [(4096, 1.0), (1000, 0.3), (65536, 2.0)])
def test_lognormal_mean_and_spread(mean, sigma):
    lengths = parse_lengths(f"lognormal:2000:{mean}:{sigma}")
    assert len(lengths) == 2000 and min(lengths) >= 1
    assert all(isinstance(n, int) for n in lengths)
    assert abs(statistics.fmean(lengths) / mean - 1) <= 0.02
    spread = statistics.stdev(math.log(n) for n in lengths)
    assert abs(spread - sigma) <= 0.1 * sigma


def test_lognormal_is_deterministic_by_seed():
    a = parse_lengths("lognormal:50:2048:1.5:7")
    assert a == parse_lengths("lognormal:50:2048:1.5:7")
    assert a != parse_lengths("lognormal:50:2048:1.5:8")
    assert parse_lengths("lognormal:50:2048:1.5") == parse_lengths("lognormal:50:2048:1.5:0")


def test_lognormal_edge_cases():
    assert parse_lengths("lognormal:10:300:0") == (300,) * 10
    tiny = parse_lengths("lognormal:100:1:3")
    assert min(tiny) == 1  # every length at least 1, even when most draws round to 0


@pytest.mark.parametrize("text,message", [
    ("", "lengths are empty"),
    ("   ", "lengths are empty"),
    ("abc", "length of 'abc' must be an integer, got 'abc'"),
    ("1024,,5", "empty item in '1024,,5'"),
    ("1024,", "empty item"),
    ("-5", "length of '-5' is negative (-5)"),
    ("0", "length of '0' is 0: every sequence needs at least one key"),
    ("3000000000", "exceeds int32"),
    ("1024x0", "repeat count of '1024x0' must be at least 1, got 0"),
    ("1024x-2", "repeat count of '1024x-2' must be at least 1, got -2"),
    ("1024xabc", "repeat count of '1024xabc' must be an integer, got 'abc'"),
    ("1024x15x2", "must be an integer, got '15x2'"),
    ("x3", "length of 'x3' must be an integer, got ''"),
    (f"1x{MAX_BATCH + 1}", "exceeds the largest batch"),
    (f"1x{MAX_BATCH},1", "more than"),
    ("normal:4:10", "unknown distribution 'normal'"),
    ("uniform:16", "expected uniform:N:LEN"),
    ("uniform:16:8:9", "expected uniform:N:LEN"),
    ("skewed:16:65536", "expected skewed:N:LONG:SHORT"),
    ("geometric:8:2048", "expected geometric:N:MAX:MIN"),
    ("lognormal:8:100", "expected lognormal:N:MEAN:SIGMA[:SEED]"),
    ("lognormal:8:100:1:2:3", "expected lognormal"),
    ("uniform:0:8192", "uniform: N must be at least 1, got 0"),
    ("uniform:-3:8192", "uniform: N must be at least 1, got -3"),
    ("uniform:many:8192", "uniform: N must be an integer, got 'many'"),
    ("uniform:4:-1", "uniform: LEN is negative (-1)"),
    ("skewed:4:65536:0", "skewed: SHORT is 0"),
    ("skewed:4:-1:5", "skewed: LONG is negative"),
    ("geometric:8:2048:262144", "MIN (262144) must not exceed MAX (2048)"),
    ("geometric:8:2048:-2", "geometric: MIN is negative"),
    ("lognormal:8:0:1", "lognormal: MEAN is 0"),
    ("lognormal:8:100:wide", "lognormal: SIGMA must be a number, got 'wide'"),
    ("lognormal:8:100:-1", "SIGMA must be finite and >= 0"),
    ("lognormal:8:100:nan", "SIGMA must be finite and >= 0"),
    ("lognormal:8:100:1:s", "lognormal: SEED must be an integer, got 's'"),
])
def test_errors_name_the_problem(text, message):
    with pytest.raises(ValueError) as info:
        parse_lengths(text)
    assert message in str(info.value)


def test_describe():
    assert describe([3, 1, 2]) == {"batch": 3, "min": 1, "max": 3, "mean": 2.0, "total": 6}
    with pytest.raises(ValueError, match="at least one length"):
        describe([])
