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
        description="ReCycle's pause after a worker's death: survivors detect it (well under a second), re-form their "
        "process groups in-process and look up the adapted schedule; then they redo the interrupted iteration from "
        "its start. 2 s is an allowance until the live runtime measures it. The whole job stalls meanwhile.",
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
    join_delay_s: float = Field(
        45.0,
        ge=0,
        description="A node added by the trace starts up (instance creation, process start) this long before any "
        "policy can use it; the others keep training meanwhile. 45 s is Oobleck's artifact simulator's "
        "spot_instance_creation_time (SymbioticLab/Oobleck, branch sosp23-artifact, "
        "tools/simulator/oobleck_simulator.py line 203, applied at lines 993-996).",
    )
    state_copy_s: float = Field(
        10.0,
        ge=0,
        description="ReCycle's re-join: once a started replacement reaches an iteration boundary, the job pauses while a "
        "live peer of its stage sends it weights and optimizer state (16 B/parameter of mixed-precision Adam, e.g. a "
        "1.3B-parameter stage is 21 GB, about 2 s at 100 Gb/s, plus group re-forming); then the fault-free schedule "
        "resumes. No work is lost (the copy is at a boundary).",
    )
    reconfigure_s: float = Field(
        30.0,
        ge=0,
        description="Re-forming pipelines without a checkpoint load, other than Oobleck's templates (ReCycle's re-formed "
        "grid and its return to the original grid, Bamboo taking in nodes): layers move between live nodes and "
        "groups re-form. Tens of seconds assumed; the interrupted iteration is lost.",
    )
    oobleck_reconfigure_s: float = Field(
        10.0,
        ge=0,
        description="Oobleck's pause per reconfiguration (re-instantiating pipelines from templates; also the adaptive "
        "policy's when it re-forms). Oobleck's artifact simulator sets it by model: 2 s for BERT-large and GPT-2, 3 s "
        "GPT-3 medium, 6 s GPT-3 2.7B, 10 s GPT-3 6.7B (local_rendezvous_timeout_delta, "
        "tools/simulator/oobleck_simulator.py lines 253, 266, 282, 295, 307 on branch sosp23-artifact; added per "
        "failure at lines 883-887). Default: the 6.7B model's 10 s; set 2 for models of BERT-large's size.",
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
        "cost is amortised. None: estimated from the trace as it arrives -- the time since the job started divided "
        "by the changes seen so far (the maximum-likelihood mean gap of a Poisson process; no prior constant).",
    )

    def stages_floor(self, pp: int) -> int:
        return min(pp, self.min_stages or -(-pp // 2))
