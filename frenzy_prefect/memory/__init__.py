"""MARP: predicted per-GPU peak memory of a parallel plan."""

from frenzy_prefect.memory.analytic import estimate, peak_bytes

__all__ = ["estimate", "peak_bytes"]
