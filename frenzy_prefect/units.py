"""Memory sizes as people read them."""

MIB = 1024**2
GIB = 1024**3


def gib(n: int | float, digits: int = 3) -> str:
    """Bytes as a number of GiB, e.g. ``gib(3 * 2**29) == "1.500"``."""
    return f"{n / GIB:.{digits}f}"
