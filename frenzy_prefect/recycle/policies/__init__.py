"""Resilience policies for the failure replay (``recycle.replay``), one module each, behind ``base.Policy``."""

from __future__ import annotations

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.recycle.policies.adaptive import Adaptive
from frenzy_prefect.recycle.policies.bamboo import Bamboo
from frenzy_prefect.recycle.policies.base import Policy
from frenzy_prefect.recycle.policies.ceiling import Ceiling
from frenzy_prefect.recycle.policies.checkpoint_restart import CheckpointRestart
from frenzy_prefect.recycle.policies.drop_pipeline import DropPipeline
from frenzy_prefect.recycle.policies.oobleck import Oobleck
from frenzy_prefect.recycle.policies.recycle import ReCycle

POLICIES: dict[str, type] = {p.name: p for p in (ReCycle, CheckpointRestart, DropPipeline, Oobleck, Bamboo, Adaptive)}
# What no policy can beat on a trace (free switches): replayed like a policy, reported beside them.
REFERENCES: dict[str, type] = {Ceiling.name: Ceiling}


def make_policy(name: str) -> Policy:
    known = POLICIES | REFERENCES
    if name not in known:
        raise FrenzyError(f"unknown policy {name!r}; known: {', '.join(known)}")
    return known[name]()
