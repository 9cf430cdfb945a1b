"""MARP: predicted per-GPU peak memory of a parallel plan."""

from frenzy_prefect.memory.analytic import estimate

__all__ = ["estimate"]
