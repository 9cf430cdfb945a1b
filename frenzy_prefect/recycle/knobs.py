"""Every constant of the resilience simulation, with its default and why.

These are assumptions, not measurements: change them to match a cluster. The same knobs apply
to every policy, so a comparison never hinges on one policy getting a cheaper constant.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Knobs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    detection_s: float = Field(
        2.0,
        ge=0,
        description="From a worker's death to the survivors running the adapted schedule. The launcher's waitpid "
        "or a heartbeat sees a dead rank in under a second, and survivors re-form gloo/NCCL groups in "
        "milliseconds; 2 s leaves room for a plan-cache lookup. The whole job stalls meanwhile.",
    )
    restart_s: float = Field(
        120.0,
        ge=0,
        description="Stop-the-world restart: relaunch every rank, rendezvous, initialise NCCL, load the last "
        "checkpoint. Minutes for multi-GB model states; 2 min is at the fast end of what Oobleck and Bamboo report.",
    )
    checkpoint_interval_s: float = Field(
        1800.0,
        gt=0,
        description="Training time between checkpoints (taken at the first iteration end past the interval). "
        "30 min is common for large models, whose checkpoints take minutes to write.",
    )
    checkpoint_write_s: float = Field(
        0.0,
        ge=0,
        description="Pause to take a checkpoint. 0: asynchronous checkpointing (torch.distributed.checkpoint "
        "async_save, CheckFreq) overlaps the write with training.",
    )
    state_copy_s: float = Field(
        10.0,
        ge=0,
        description="A node that takes a slot copies its stage's model states from a live peer: 16 B/parameter of "
        "mixed-precision Adam, e.g. a 1.3B-parameter stage is 21 GB, about 2 s at 100 Gb/s, plus process start and "
        "group join. The others keep training meanwhile (ReCycle re-routes until it is ready).",
    )
    reconfigure_s: float = Field(
        30.0,
        ge=0,
        description="Re-forming pipelines without a checkpoint load (Oobleck's template re-instantiation, a "
        "re-partitioned grid): layers move between live nodes and groups re-form. Tens of seconds assumed; "
        "the in-flight iteration is lost.",
    )
    drop_reform_s: float = Field(
        60.0,
        ge=0,
        description="Drop-the-pipeline baseline: pause to relaunch the re-formed pipelines' ranks when returning "
        "nodes complete a pipeline (states copied from survivors, no checkpoint load).",
    )
    bamboo_overhead: float = Field(
        1.3,
        ge=1,
        description="Bamboo's fault-free slowdown from redundant computation: each node also runs its successor "
        "stage's forward pass, in bubbles where it fits and on the critical path where it does not, and holds "
        "the extra activations. An assumption in the range its NSDI'23 evaluation implies (not a measured number).",
    )
    bamboo_failover_slowdown: float = Field(
        2.0,
        ge=1,
        description="After a failover the shadow node runs two stages, so the bottleneck stage's time doubles; with "
        "many micro-batches per iteration a pipeline's time is micro-batches x bottleneck, so close to 2x. "
        "Data parallel pipelines synchronise, so the whole grid runs at the slowest pipeline.",
    )
    min_stages: int | None = Field(
        None,
        ge=1,
        description="Fewest pipeline stages a re-formed grid may have (memory: fewer stages hold more layers each). "
        "None: half the original stages, rounded up -- the original pp was chosen to fit memory, so a deeper cut "
        "is assumed not to fit.",
    )
    expected_gap_s: float | None = Field(
        None,
        gt=0,
        description="Adaptive policy: expected time to the next membership change, over which a reconfiguration's "
        "cost is amortised. None: the mean gap observed so far, starting from 1 h.",
    )

    def stages_floor(self, pp: int) -> int:
        return min(pp, self.min_stages or -(-pp // 2))
