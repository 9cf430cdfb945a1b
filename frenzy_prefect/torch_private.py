"""The private torch APIs the project relies on, in one place (the core's side; Prefect's are
``prefect_private``). Each is reached only through this module and checked by
tests/unit/test_private_apis.py for the signature and behaviour used here, so that a torch upgrade that
changes one fails there by name, with the range pyproject.toml vouches for (it stops before torch's
next minor release for that reason).

- DCP's fsspec storage (``_fsspec_filesystem``): sharded checkpoints written to and read from
  s3fs; the public ``FileSystemWriter`` writes local paths only.
- DCP's nested-dict helper (``_nested_dict.flatten_state_dict``): the load planner flattens the
  state itself, because ``DefaultLoadPlanner`` replaces objects it does not know by None.
- pipelining's split backward (``_backward.stage_backward_input`` / ``stage_backward_weight``):
  B and W apart, weight gradients equal to one full backward; torch's schedule runtime, their
  only public user, binds a stage to one rank (see DESIGN section 8).
- MemTracker (``_tools.mem_tracker``) and the internals ``StepTracker`` drives: per-category
  storage accounting, over whole steps, with ``torch._C._current_graph_task_id`` telling a
  backward pass from a forward without module hooks.
- FakeTensorMode and the fake process group (``_subclasses.fake_tensor``,
  ``testing._internal.distributed.fake_pg``): a rank's training step traced without memory,
  compute or peers (training/allocation_trace.py), as torchtitan's memory estimation does.

One more is used outside this module, where importing this one would cost more: torchrun's
``SubprocessContext.close``, ``_failures`` and ``envs``, which ``launch.agent`` wraps in the torchrun
agent (a process that imports no DCP); test_private_apis checks it as it checks these.

pipelining and MemTracker are imported at first use: each imports torch._dynamo (about 1.3 s of a
process's start on our cores), which a training rank whose plan never splits B from W, and every
rank that does not measure, would otherwise pay at every start and restart.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

__all__ = [  # and, through __getattr__, StepTracker and MemRefType
    "FsspecReader",
    "FsspecWriter",
    "flatten_state_dict",
    "in_backward",
    "stage_backward_input",
    "stage_backward_weight",
]


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class _InBackward:
    """Stands in for MemTracker's ModTracker: tells whether autograd is running a backward pass,
    without module hooks. ModTracker's hooks refuse a module called once per micro-batch and keep
    a pipeline stage's inputs alive until the step ends, which would inflate what is measured."""

    parents: set[str] = set()

    @property
    def is_bw(self) -> bool:
        return in_backward()

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _InBackward:
        return self

    def __exit__(self, *exc) -> None:
        pass


def stage_backward_input(*args: Any, **kwargs: Any) -> Any:
    """pipelining's B: the stage input's gradient only, keeping what W needs."""
    from torch.distributed.pipelining._backward import stage_backward_input as backward_input

    return backward_input(*args, **kwargs)


def stage_backward_weight(*args: Any, **kwargs: Any) -> Any:
    """pipelining's W: the weight gradients B left to compute."""
    from torch.distributed.pipelining._backward import stage_backward_weight as backward_weight

    return backward_weight(*args, **kwargs)


def fake_tensors() -> Any:
    """A FakeTensorMode: tensors with shapes, dtypes and storage sizes, and no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: collectives that return at once (importing
    the module registers the "fake" backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def __getattr__(name: str) -> Any:
    """``StepTracker`` and ``MemRefType``, defined at first use (MemTracker's import is the heavy one)."""
    if name not in ("StepTracker", "MemRefType"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(_memory_tracking())
    return globals()[name]


def _memory_tracking() -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mem_tracker import _MemRefType as MemRefType

    class StepTracker(MemTracker):
        """MemTracker's storage accounting (every tensor storage created in its context, by category)
        over whole training steps. Gradients are categorised through hooks on ``modules``' parameters."""

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _InBackward()

        def track_modules(self, *modules: torch.nn.Module) -> None:
            """Categorise these modules' parameters, and (through hooks) their gradients."""
            for module in modules:
                self._track_module_params_and_buffers(module, install_grad_hooks=True)

        def categorise(self, tensors, reftype: MemRefType) -> None:
            """Count these tensors' storage under ``reftype`` from now on."""
            for t in tensors:
                self._update_and_maybe_create_winfos(t, reftype)

        def restart_peak(self) -> None:
            """Forget the peak so far (building the model is not training)."""
            self._peak_mem = {dev: snap["Total"] for dev, snap in self._curr_mem_snap.items()}
            self._peak_mem_snap = self.get_tracker_snapshot()

    StepTracker.__qualname__ = "StepTracker"  # (defined in here, named as a module-level class)
    return {"StepTracker": StepTracker, "MemRefType": MemRefType}
