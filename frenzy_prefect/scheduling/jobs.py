"""How a trace job becomes an LLM training job: one deterministic rule, the same for every
policy, so every policy is handed identical work.

- The model follows the trace's model name, by size rank (TRACE_MODELS): the small vision
  models become GPT-2 small, the mid-size ones GPT-2 medium/large, ``gpt2`` GPT-2 XL (1.5 B,
  which needs more than 16-24 GB under plain data parallelism: memory matters).
- The global batch is the trace's ``batch_size`` (sequences of SEQ_LEN tokens).
- The work is what the job did in the trace: ``duration`` seconds on ``num_gpu`` GPUs of the
  reference type (REFERENCE_GPU; ElasticFlow's traces come from V100 clusters), at the
  throughput model's per-GPU rate for that model: tokens = duration x num_gpu x rate; steps =
  tokens / (global batch x SEQ_LEN), at least one. ``num_iteration`` is not used: the trace's
  iterations are of other models and batch sizes.
- Arrival is the submission time, shifted so the first job arrives at 0.
- What the owner was asked for: ``duration`` seconds on ``num_gpu`` GPUs (``requested_s``,
  ``requested_gpus``), by the trace's ``deadline`` (shifted likewise; ElasticFlow draws it 0.5-1.5
  durations after submission).
- Training is fp16 mixed precision with AdamW (every catalog GPU runs fp16).
"""

from __future__ import annotations

from dataclasses import dataclass

from frenzy_prefect.allocator.step_time import flops_per_token, saturation
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.scheduling.inputs import TraceJob
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.request import Precision

TRACE_MODELS = {
    "resnet50": "gpt2-small",
    "inception3": "gpt2-small",
    "deepspeech2": "gpt2-medium",
    "bert": "gpt2-medium",
    "vgg16": "gpt2-large",
    "gpt2": "gpt2-xl",
}
SEQ_LEN = 1024
PRECISION: Precision = "fp16"
REFERENCE_GPU = "V100-32GB"


@dataclass(frozen=True, slots=True)
class SimJob:
    job_id: str
    arrival_s: float
    model: str
    global_batch: int
    steps: int
    requested_gpus: int
    requested_s: float  # the trace's duration on requested_gpus reference GPUs
    deadline_s: float  # when the trace wants it done, on the replay's clock


def reference_tokens_per_gpu_s(model: str) -> float:
    """One reference GPU's training rate for ``model`` (micro-batch 1 sequence, no recompute)."""
    gpu = GPU_CATALOG[REFERENCE_GPU]
    return gpu.half_tflops * 1e12 * gpu.achievable_fraction * saturation(SEQ_LEN) / flops_per_token(PRESETS[model], SEQ_LEN)


def to_sim_job(job: TraceJob, t0: int, models: dict[str, str] = TRACE_MODELS) -> SimJob:
    """``job`` as training, its model by ``models`` (a trace model name -> a preset)."""
    model = models.get(job.model_name)
    if model is None:
        raise FrenzyError(f"job {job.job_id}: unknown model_name {job.model_name!r}; known: {', '.join(models)}")
    tokens = job.duration * job.num_gpu * reference_tokens_per_gpu_s(model)
    return SimJob(
        job_id=job.job_id,
        arrival_s=float(job.submission_time - t0),
        model=model,
        global_batch=job.batch_size,
        steps=max(1, round(tokens / (job.batch_size * SEQ_LEN))),
        requested_gpus=job.num_gpu,
        requested_s=float(job.duration),
        deadline_s=float(job.deadline - t0),
    )


def sim_jobs(trace: list[TraceJob], models: dict[str, str] = TRACE_MODELS) -> list[SimJob]:
    t0 = min(j.submission_time for j in trace)
    return [to_sim_job(j, t0, models) for j in trace]


@dataclass(slots=True)
class Waiting:
    """A queued job, how often it ran out of memory, and by how much at least its memory
    estimates proved low (GPU memory / the estimated peak of a plan that ran out of memory)."""

    job: SimJob
    out_of_memory: int = 0
    underestimate: float = 1.0
