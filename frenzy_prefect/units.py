"""Sizes, times and costs as people read them: every table, artifact and message of the project
formats them here, so that a plan's time reads the same in the CLI, the UI and the demo."""

import math

MIB = 1024**2
GIB = 1024**3

# (unit, seconds in it, the value at which the next unit reads better)
_TIME_UNITS = (("µs", 1e-6, 1000), ("ms", 1e-3, 100), ("s", 1, 120), ("min", 60, 120), ("h", 3600, 48), ("d", 86400, math.inf))


def gib(n: int | float, digits: int = 3) -> str:
    """Bytes as a number of GiB, e.g. ``gib(3 * 2**29) == "1.500"``."""
    return f"{n / GIB:.{digits}f}"


def significant(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in plain decimals, never an exponent or a trailing
    zero: ``significant(4.68e-05) == "0.0000468"``, ``significant(2.50) == "2.5"``, ``significant(1234.4) == "1234"``."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def duration(seconds: float) -> str:
    """A time in the unit a person reads it in, three significant digits:
    ``duration(0.00241) == "2.41 ms"``, ``duration(0.169) == "0.169 s"``, ``duration(5400) == "90 min"``."""
    if seconds <= 0:
        return "0 s" if seconds == 0 else "-" + duration(-seconds)
    for unit, scale, upper in _TIME_UNITS:
        text = significant(seconds / scale)
        if float(text) < upper:
            return f"{text} {unit}"
    raise AssertionError("unreachable: the last unit has no upper bound")


def usd(amount: float | None) -> str:
    """A cost in US dollars: to the cent from ten cents up (``usd(1234.5) == "$1,234.50"``), three
    significant digits below (``usd(9.459e-05) == "$0.0000946"``); ``"-"`` for no cost (no prices)."""
    if amount is None:
        return "-"
    return f"${amount:,.2f}" if round(amount, 2) >= 0.1 else f"${significant(amount)}"
