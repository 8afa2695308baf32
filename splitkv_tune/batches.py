"""Live lengths of a variable-length batch, from a short text (``compare-batch --lengths``).

Two forms, both giving a tuple of positive ints, one per sequence:

* a list with repeats: ``"65536,1024x15"`` is one 65536 then fifteen 1024;
* a named distribution:

  - ``uniform:N:LEN``: N sequences of LEN;
  - ``skewed:N:LONG:SHORT``: one LONG then N - 1 of SHORT;
  - ``geometric:N:MAX:MIN``: N lengths falling geometrically from MAX to MIN, both included,
    rounded to ints;
  - ``lognormal:N:MEAN:SIGMA[:SEED]``: N log-normal lengths of log-space sigma SIGMA, scaled so
    that their arithmetic mean is MEAN (up to rounding), each at least 1; the same SEED (default
    0) gives the same lengths.

>>> parse_lengths("65536,1024x2")
(65536, 1024, 1024)
>>> parse_lengths("geometric:8:262144:2048")
(262144, 131072, 65536, 32768, 16384, 8192, 4096, 2048)
>>> describe(parse_lengths("skewed:16:65536:1024"))
{'batch': 16, 'min': 1024, 'max': 65536, 'mean': 5056.0, 'total': 80896}

Every sequence has at least one key: a batch is something to time, and an empty sequence reads
nothing. Lengths stay within int32 (``cache_seqlens`` is int32).
"""
from __future__ import annotations

import math
import random

MAX_LENGTH = 2**31 - 1
MAX_BATCH = 1 << 20
FORMS = {"uniform": "uniform:N:LEN", "skewed": "skewed:N:LONG:SHORT",
         "geometric": "geometric:N:MAX:MIN", "lognormal": "lognormal:N:MEAN:SIGMA[:SEED]"}


def _int(token: str, what: str) -> int:
    try:
        return int(token.strip())
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {token.strip()!r}") from None


def _length(token: str, what: str = "length") -> int:
    value = _int(token, what)
    if value < 0:
        raise ValueError(f"{what} is negative ({value})")
    if value == 0:
        raise ValueError(f"{what} is 0: every sequence needs at least one key")
    if value > MAX_LENGTH:
        raise ValueError(f"{what} ({value}) exceeds int32 ({MAX_LENGTH})")
    return value


def _count(token: str, what: str) -> int:
    value = _int(token, what)
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    if value > MAX_BATCH:
        raise ValueError(f"{what} ({value}) exceeds the largest batch, {MAX_BATCH}")
    return value


def _explicit(text: str) -> tuple[int, ...]:
    lengths: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty item in {text!r}: write lengths like 65536,1024x15")
        length, sep, repeat = item.partition("x")
        count = _count(repeat, f"repeat count of {item!r}") if sep else 1
        lengths.extend([_length(length, f"length of {item!r}")] * count)
        if len(lengths) > MAX_BATCH:
            raise ValueError(f"{text!r} has more than {MAX_BATCH} sequences")
    return tuple(lengths)


def geometric(n: int, longest: int, shortest: int) -> tuple[int, ...]:
    """n lengths from ``longest`` down to ``shortest`` with a constant ratio, rounded.

    >>> geometric(3, 400, 100), geometric(1, 7, 7)
    ((400, 200, 100), (7,))
    """
    if shortest > longest:
        raise ValueError(f"geometric: MIN ({shortest}) must not exceed MAX ({longest})")
    if n == 1:
        return (longest,)
    ratio = shortest / longest
    return tuple(max(shortest, round(longest * ratio ** (i / (n - 1)))) for i in range(n))


def lognormal(n: int, mean: float, sigma: float, seed: int = 0) -> tuple[int, ...]:
    """n log-normal lengths of log-space ``sigma``, scaled to the arithmetic ``mean``.

    Scaling the draws (rather than setting the log-space mean to ``log(mean) - sigma**2 / 2``)
    makes the mean exact for any n, so a small batch has the mean it was asked for.

    >>> lengths = lognormal(5, 1000, 0.5, seed=1)
    >>> lengths == lognormal(5, 1000, 0.5, seed=1), len(lengths), min(lengths) >= 1
    (True, 5, True)
    """
    rng = random.Random(seed)
    draws = [math.exp(sigma * rng.gauss(0.0, 1.0)) for _ in range(n)]
    scale = mean * n / sum(draws)
    return tuple(min(MAX_LENGTH, max(1, round(d * scale))) for d in draws)


def _named(text: str) -> tuple[int, ...]:
    name, *args = (part.strip() for part in text.split(":"))
    if name not in FORMS:
        raise ValueError(f"unknown distribution {name!r} in {text!r}; choose from "
                         f"{', '.join(FORMS.values())}, or a list like 65536,1024x15")
    form = FORMS[name]
    arity = form.count(":") - form.count("[")
    if not arity <= len(args) <= form.count(":"):
        raise ValueError(f"{text!r}: expected {form}")
    n = _count(args[0], f"{name}: N")
    if name == "uniform":
        return (_length(args[1], f"{name}: LEN"),) * n
    if name == "skewed":
        return (_length(args[1], f"{name}: LONG"),) + (_length(args[2], f"{name}: SHORT"),) * (n - 1)
    if name == "geometric":
        return geometric(n, _length(args[1], f"{name}: MAX"), _length(args[2], f"{name}: MIN"))
    mean = _length(args[1], f"{name}: MEAN")
    try:
        sigma = float(args[2])
    except ValueError:
        raise ValueError(f"{name}: SIGMA must be a number, got {args[2]!r}") from None
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"{name}: SIGMA must be finite and >= 0, got {args[2]!r}")
    seed = _int(args[3], f"{name}: SEED") if len(args) > 3 else 0
    return lognormal(n, mean, sigma, seed)


def parse_lengths(text: str) -> tuple[int, ...]:
    """The lengths ``text`` describes (see the module); ``ValueError`` says what is wrong.

    >>> parse_lengths("uniform:2:8192")
    (8192, 8192)
    >>> parse_lengths("1024x0")
    Traceback (most recent call last):
    ...
    ValueError: repeat count of '1024x0' must be at least 1, got 0
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError("lengths are empty: write a list like 65536,1024x15 or a distribution "
                         "like skewed:16:65536:1024")
    text = text.strip()
    return _named(text) if ":" in text else _explicit(text)


def describe(lengths) -> dict:
    """Batch size, shortest, longest, mean and total length."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError("describe needs at least one length")
    total = sum(lengths)
    return {"batch": len(lengths), "min": min(lengths), "max": max(lengths),
            "mean": total / len(lengths), "total": total}
