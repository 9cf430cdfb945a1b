"""HAS: rank MARP's plans per GPU type by predicted step time, take the first the cluster can
satisfy now, and bin-pack it onto nodes."""

from frenzy_prefect.allocator.has import allocate
from frenzy_prefect.allocator.plans import candidate_plans

__all__ = ["allocate", "candidate_plans"]
