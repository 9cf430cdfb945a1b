"""Scheduling policies for the simulator, one module each, behind ``base.Policy``."""

from __future__ import annotations

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.scheduling.policies.base import Policy
from frenzy_prefect.scheduling.policies.fastest_type import FastestType
from frenzy_prefect.scheduling.policies.first_fit import FirstFit
from frenzy_prefect.scheduling.policies.frenzy import Frenzy
from frenzy_prefect.scheduling.policies.frenzy_mixed import FrenzyMixed
from frenzy_prefect.scheduling.policies.ilp import Ilp

POLICIES: dict[str, type] = {p.name: p for p in (Frenzy, FrenzyMixed, FirstFit, FastestType, Ilp)}


def make_policy(name: str, **options: object) -> Policy:
    """The policy ``name``; ``options`` (frenzy's objective and stretch bound) only for a policy that takes them."""
    if name not in POLICIES:
        raise FrenzyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    if options and not issubclass(POLICIES[name], Frenzy):
        raise FrenzyError(f"{', '.join(options)} applies to policies {Frenzy.name!r} and {FrenzyMixed.name!r} only, not {name!r}")
    return POLICIES[name](**options)
