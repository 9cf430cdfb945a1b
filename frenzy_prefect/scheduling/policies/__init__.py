"""Scheduling policies for the simulator, one module each, behind ``base.Policy``."""

from __future__ import annotations

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.policies.base import Policy
from frenzy_prefect.scheduling.policies.fastest_type import FastestType
from frenzy_prefect.scheduling.policies.first_fit import FirstFit
from frenzy_prefect.scheduling.policies.frenzy import Frenzy
from frenzy_prefect.scheduling.policies.ilp import Ilp

POLICIES: dict[str, type] = {p.name: p for p in (Frenzy, FirstFit, FastestType, Ilp)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise FrenzyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name]()
