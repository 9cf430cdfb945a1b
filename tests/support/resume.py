"""Helpers shared by the tests of resume."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from frenzy_prefect.spec.plan import TrainingJob
from frenzy_prefect.spec.result import TrainingResult
from frenzy_prefect.storage import filesystem, filesystem_options, open_uri
from frenzy_prefect.training import checkpoint
from frenzy_prefect.training.manifest import step_uri


def files_of(uri: str) -> dict[str, object]:
    """Every object of the checkpoint at ``uri``, with when it was last written."""
    fs, path = filesystem(uri)
    fs.invalidate_cache()
    return {name: info["LastModified"] for name, info in fs.find(path, detail=True).items()}


def assert_resumed_after(job: TrainingJob, step: int, files_before: dict[str, object], generation: int = 1) -> None:
    """The job's last attempt resumed from its checkpoint of ``step`` (written by ``generation``),
    not from scratch (training is deterministic, so the losses alone cannot tell): the first step
    it trained is the next one, it trained each later step once, and that checkpoint's files are
    as they were."""
    with open_uri(job.metrics_uri, "r") as f:
        result = TrainingResult.model_validate_json(f.read())
    assert result.first_step == step + 1, f"the attempt trained from step {result.first_step}, not step {step + 1}"
    assert len(result.step_s) == job.request.steps - step, f"it trained {len(result.step_s)} steps after step {step}"
    assert files_of(step_uri(job.checkpoint_uri, step, generation)) == files_before, "the checkpoint it resumed from was written again"


def _whole_weights(uri: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights read whole, as DCP stores them (no engine, no resharding of ours)."""
    reader = checkpoint.FsspecReader(uri, **filesystem_options(uri))
    metadata = reader.read_metadata()
    state = {k: torch.empty(md.size) for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    dcp.load(state, storage_reader=checkpoint.FsspecReader(uri, **filesystem_options(uri)), no_dist=True)
    return {k.removeprefix("model."): t for k, t in state.items()}
