"""Loaded by Prefect through the `prefect.collections` entry point: registers the `frenzy`
worker type and the FrenzyCluster block type."""

from frenzy_prefect.blocks import FrenzyCluster
from frenzy_prefect.pool.worker import FrenzyWorker

__all__ = ["FrenzyCluster", "FrenzyWorker"]
