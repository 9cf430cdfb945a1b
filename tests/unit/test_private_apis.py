"""The private torch and Prefect APIs the project uses (frenzy_prefect/torch_private.py and
prefect_private.py), each checked for the signature and behaviour relied on: after an upgrade that
changes one, its test fails naming the API and the range pyproject.toml vouches for. And the ranges
themselves: every lower bound is the version constraints.txt pins (the one CI runs), and the
packages whose private APIs are used stop before their next untested minor release."""

from __future__ import annotations

import re

import pytest
import torch

from tests.support.private_apis import RANGES, relying_on
from tests.support.stack import ROOT


def test_dcp_fsspec_writer_and_reader_round_trip_a_checkpoint_with_filesystem_options(tmp_path):
    with relying_on("torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter/FsspecReader", "torch"):
        import torch.distributed.checkpoint as dcp

        from frenzy_prefect.torch_private import FsspecReader, FsspecWriter

        uri = f"file://{tmp_path}/nested/checkpoint"
        saved = {"weight": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(7)}
        writer = FsspecWriter(uri, sync_files=False, auto_mkdir=True)  # keyword arguments go to the fsspec filesystem
        assert writer.fs.fs.auto_mkdir is True
        dcp.save(saved, storage_writer=writer, no_dist=True)
        loaded = {"weight": torch.zeros(2, 3), "step": torch.tensor(0)}
        dcp.load(loaded, storage_reader=FsspecReader(uri), no_dist=True)
        assert torch.equal(loaded["weight"], saved["weight"]) and loaded["step"].item() == 7


def test_dcp_flatten_state_dict_flattens_nested_dicts_and_says_where_each_came_from():
    with relying_on("torch.distributed.checkpoint._nested_dict.flatten_state_dict", "torch"):
        from frenzy_prefect.torch_private import flatten_state_dict

        w, b = torch.ones(2), torch.zeros(1)
        flat, mappings = flatten_state_dict({"model": {"w": w, "inner": {"b": b}}, "step": 3})
        assert flat == {"model.w": w, "model.inner.b": b, "step": 3}
        assert mappings == {"model.w": ("model", "w"), "model.inner.b": ("model", "inner", "b"), "step": ("step",)}


def test_pipelining_split_backward_gives_one_full_backwards_gradients():
    """B (input gradient, keeping what W needs) then W (weight gradients): the gradients of one
    ordinary backward, which is what the executor's deferred W relies on."""
    with relying_on("torch.distributed.pipelining._backward.stage_backward_input/stage_backward_weight", "torch"):
        from frenzy_prefect.torch_private import stage_backward_input, stage_backward_weight

        torch.manual_seed(0)
        stage = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        received = torch.randn(5, 4)
        grad_out = torch.randn(5, 3)
        reference = received.clone().requires_grad_()
        stage(reference).backward(grad_out)
        expected = [p.grad.clone() for p in stage.parameters()]
        stage.zero_grad(set_to_none=True)

        x = received.clone().requires_grad_()
        out = stage(x)
        input_grads, param_groups = stage_backward_input([out], [grad_out], [x], iter(stage.parameters()))
        assert torch.allclose(input_grads[0], reference.grad)
        assert all(p.grad is None for p in stage.parameters())  # W not run yet
        stage_backward_weight(iter(stage.parameters()), param_groups)
        assert all(torch.allclose(p.grad, e) for p, e in zip(stage.parameters(), expected, strict=True))


def test_torchruns_failures_are_what_the_agents_account_reads_and_a_signal_is_the_root_cause(tmp_path):
    """launch.agent wraps SubprocessContext.close and reads its ``_failures`` and ``envs``. Rank 0
    whose collective failed when rank 1 was killed leaves an error file stamped (whole seconds)
    before torchrun's poll saw rank 1 gone: the account names rank 1, the one killed by a signal."""
    import inspect
    import json
    import time

    with relying_on("torch.distributed.elastic SubprocessContext.close/_failures/envs and ProcessFailure", "torch"):
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        from frenzy_prefect.launch.agent import root_cause

        assert callable(SubprocessContext.close) and "self._failures[" in inspect.getsource(SubprocessContext)
        assert "self.envs" in inspect.getsource(SubprocessContext.__mro__[1])  # PContext's
        error_file = tmp_path / "error.json"
        stamp = str(int(time.time()) - 1)
        message = {"message": "RuntimeError: Connection closed by peer", "extraInfo": {"py_callstack": "", "timestamp": stamp}}
        error_file.write_text(json.dumps({"message": message}))
        peer = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(error_file))
        killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "absent.json"))
    assert peer.timestamp < killed.timestamp  # torchrun's own root cause (the smallest timestamp) would be rank 0
    assert root_cause([peer, killed]) is killed
    assert root_cause([peer]) is peer


def test_graph_task_id_tells_a_backward_pass_from_a_forward():
    with relying_on("torch._C._current_graph_task_id", "torch"):
        from frenzy_prefect.torch_private import in_backward

        seen: list[bool] = []
        t = torch.ones(3, requires_grad=True)
        y = t * 2
        y.register_hook(lambda grad: seen.append(in_backward()))
        assert not in_backward()
        y.sum().backward()
        assert seen == [True] and not in_backward()


def test_mem_tracker_counts_a_training_steps_storage_by_category():
    """StepTracker drives MemTracker's internals (its ModTracker slot, parameter tracking, storage
    categorisation, the peak): parameters, gradients, optimizer states and activations land in
    their categories, and a restarted peak forgets what came before."""
    with relying_on("torch.distributed._tools.mem_tracker.MemTracker (and _MemRefType)", "torch"):
        from frenzy_prefect.torch_private import MemRefType, StepTracker

        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters())
        extra = torch.ones(1000)  # made before the tracker: only counted once categorised
        tracker = StepTracker()
        with tracker:
            tracker.track_modules(model)
            tracker.categorise([extra], MemRefType.OPT)
            tracker.restart_peak()
            for _ in range(2):
                model(torch.randn(64, 256)).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        assert set(MemRefType) >= {MemRefType.PARAM, MemRefType.GRAD, MemRefType.OPT, MemRefType.ACT, MemRefType.TEMP, MemRefType.OTH}
        assert peak[MemRefType.PARAM] >= weights and peak[MemRefType.GRAD] >= weights
        assert peak[MemRefType.OPT] >= 2 * weights + extra.numel() * 4  # AdamW's two moments, and what was categorised
        assert peak[MemRefType.ACT] > 0


def test_fake_tensors_and_the_fake_process_group_trace_a_step_without_memory_or_peers():
    """What training/allocation_trace.py relies on: a FakeTensorMode's tensors have storage sizes
    (and one Python storage object while they live) but no data, and the "fake" backend's
    collectives return at once for a world no other process joins."""
    import torch.distributed as dist

    with relying_on("torch._subclasses.fake_tensor.FakeTensorMode, torch.testing._internal.distributed.fake_pg.FakeStore", "torch"):
        from frenzy_prefect.torch_private import fake_store, fake_tensors

        dist.init_process_group("fake", store=fake_store(), rank=1, world_size=4)
        try:
            with fake_tensors():
                big = torch.empty(1 << 30, dtype=torch.float32)  # 4 GiB that nothing allocates
                assert big.untyped_storage().nbytes() == 4 << 30 and big.untyped_storage() is big.untyped_storage()
                grad = torch.ones(8, requires_grad=True)
                (grad * 3).sum().backward()
                dist.all_reduce(grad.grad)
                assert grad.grad.shape == (8,)
        finally:
            dist.destroy_process_group()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, pinned = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = pinned.strip()
    return pins


def test_every_lower_bound_is_the_version_ci_pins():
    pins = _pins()
    for name, spec in RANGES.items():
        lower = re.search(r">=([^,]+)", spec)
        assert lower, f"{name}: no lower bound in pyproject.toml ({spec!r})"
        assert pins.get(name) == lower.group(1), (
            f"{name}: pyproject.toml's lower bound {lower.group(1)}, constraints.txt pins {pins.get(name)}"
        )


@pytest.mark.parametrize("package", ["torch", "prefect"])
def test_packages_whose_private_apis_are_used_stop_at_their_next_minor(package):
    major, minor = _pins()[package].split(".")[:2]
    assert RANGES[package] == f">={_pins()[package]},<{major}.{int(minor) + 1}", (
        f"{package}: its private APIs are used (frenzy_prefect/{package}_private.py), so its range ends before the next, untested, "
        f"minor release; got {RANGES[package]!r}"
    )
