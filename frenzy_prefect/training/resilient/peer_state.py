"""A replacement rank receives its stage's state from a live replica (ReCycle's rejoin).

Every replica of a stage holds the same weights and optimizer states (ZeRO-0: they apply the same
averaged gradients), so one live replica broadcasts its own over the stage's data-parallel group:
first the shape of its optimizer state and the learning-rate schedule (small objects), then
every tensor in place. The other replicas receive what they already hold, bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist

from frenzy_prefect.training.engine import Engine


def _tensors(engine: Engine) -> list[torch.Tensor]:
    """Everything of the stage's state that is a tensor, in one order on every replica."""
    state = engine.optimizer.state_dict()["state"]
    optimizer = [v for index in sorted(state) for _, v in sorted(state[index].items()) if torch.is_tensor(v)]
    return [*engine.model.state_dict().values(), *(m for _, m in engine.masters), *optimizer]


def _layout(engine: Engine) -> dict:
    """The optimizer state's structure (tensors as empty tensors of their shape) and the schedule's state."""
    optimizer = engine.optimizer.state_dict()
    shapes = {
        i: {k: torch.empty_like(v, device="meta") if torch.is_tensor(v) else v for k, v in state.items()}
        for i, state in optimizer["state"].items()
    }
    return {"optimizer": {**optimizer, "state": shapes}, "schedule": engine.schedule.state_dict(), "scaler": engine.scaler.state_dict()}


@torch.no_grad()
def share_stage_state(engine: Engine, source: int, replacements: set[int]) -> None:
    """Collective over this rank's data-parallel group: global rank ``source`` sends its stage's
    state, the ``replacements`` (global ranks) load it. ``source`` is a rank's position in the
    current process group (broadcast names ranks so)."""
    me = dist.get_rank()
    layout = [_layout(engine) if me == source else None]
    dist.broadcast_object_list(layout, src=source, group=engine.groups.dp)
    if engine.rank in replacements:
        optimizer = layout[0]["optimizer"]
        optimizer["state"] = {
            i: {k: torch.zeros_like(v, device=engine.device) if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in optimizer["state"].items()
        }
        engine.optimizer.load_state_dict(optimizer)
        engine.schedule.load_state_dict(layout[0]["schedule"])
        engine.scaler.load_state_dict(layout[0]["scaler"])
    for tensor in _tensors(engine):
        dist.broadcast(tensor, src=source, group=engine.groups.dp)
