"""The analytic estimator: exact on model states, within 3% of the engine's measured peak, the
calibration of GPU constants, and the invariants every plan must keep."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory import estimate, peak_bytes
from frenzy_prefect.memory.analytic import optimizer_shares, zero_layout
from frenzy_prefect.memory.calibration import PACKAGED, RESERVED_OVER_TENSORS, UNKNOWN, Calibration, GpuConstants, fit
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.gpu import MemoryMargin
from frenzy_prefect.spec.layout import (
    block_tensors,
    deal_out,
    head_shapes,
    largest_tensor,
    parameter_sizes,
    stage_parameters,
    stage_tensor_sizes,
)
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.spec.workload import OptimizerSettings, Workload
from frenzy_prefect.training.decoder import Decoder
from frenzy_prefect.units import GIB
from tests.support.stack import ROOT
from tests.support.training import NANO


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(("name", "kwargs", "state_bytes"), [("adamw", {}, 8), ("sgd", {"momentum": 0.9}, 4)])
def test_model_states_equal_the_real_tensors_after_a_step(name, kwargs, state_bytes):
    torch.manual_seed(0)
    model = Decoder(NANO)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.SGD
    opt = cls(model.parameters(), lr=1e-3, **kwargs)
    x = torch.randint(0, NANO.vocab_size, (2, 16))
    model(x, x).backward()
    opt.step()
    measured = (
        _bytes(model.parameters()),
        _bytes(p.grad for p in model.parameters()),
        _bytes(t for s in opt.state.values() for k, t in s.items() if k != "step"),
    )
    work = Workload(global_batch=2, seq_len=16, precision="fp32", optimizer=OptimizerSettings(name=name, **kwargs))
    assert work.optimizer_bytes_per_param == state_bytes
    b = estimate(NANO, ParallelPlan(micro_batch=2), work).per_stage[0]
    assert (b.params, b.grads, b.optimizer) == measured


def test_master_weights_model_states_are_the_engines_tensors_after_a_step():
    """Half weights, fp32 main gradients, fp32 masters beside Adam's states, counted on the engine's own tensors."""
    from frenzy_prefect.training.engine import Engine

    plan = ParallelPlan(micro_batch=2)
    work = Workload(global_batch=2, seq_len=16, precision="bf16", master_weights=True)
    engine = Engine(NANO, plan, work)
    x = torch.randint(0, NANO.vocab_size, (2, 16))
    engine.step([(x, x)])
    masters, states = [m for _, m in engine.masters], engine.optimizer.state.values()
    measured = (
        _bytes(engine.model.parameters()),
        _bytes(m.grad for m in masters),
        _bytes(masters) + _bytes(t for s in states for k, t in s.items() if k != "step"),
    )
    b = estimate(NANO, plan, work).per_stage[0]
    assert (b.params, b.grads, b.optimizer) == measured


def test_master_weights_are_refused_with_fp32_and_under_zero_2():
    kwargs = {"global_batch": 4, "seq_len": 16, "master_weights": True}
    with pytest.raises(FrenzyError, match="zero 0, 1 or 3"):
        estimate(NANO, ParallelPlan(dp=2, micro_batch=2, zero=2), Workload(precision="bf16", **kwargs))
    with pytest.raises(ValueError, match="set precision bf16 or fp16"):
        Workload(precision="fp32", **kwargs)
    with pytest.raises(ValueError, match="set precision bf16 or fp16"):
        TrainingRequest(model="gpt-nano", dataset="s3://b/d.txt", steps=1, precision="fp32", **kwargs)


@pytest.mark.parametrize(("base", "tied"), [("gpt-nano", True), ("gpt-nano", False), ("llama-nano", False), ("qwen2-0.5b", True)])
def test_parameter_sizes_follow_the_modules_order_as_deepspeed_flattens_it(base, tied):
    spec = PRESETS[base].model_copy(update={"tied_embeddings": tied, "vocab_size": 250, "vocab_multiple": 64})
    with torch.device("meta"):
        model = Decoder(spec)
    assert parameter_sizes(spec) == [p.numel() for p in model.parameters()]


def test_gpu_constants_come_from_the_calibration_and_are_zero_without_a_gpu():
    plan, a10 = ParallelPlan(), GPU_CATALOG["A10"]
    work = Workload(global_batch=1, seq_len=32, precision="fp32")
    assert estimate(NANO, plan, work).peak_stage.other < 2**20  # CPU: tensors only
    tensors = estimate(NANO, plan, work, gpu=a10, calibration=Calibration(gpus={"A10": GpuConstants()})).peak_bytes
    # No entry: the packaged assumption for the type, context, NCCL and cuBLAS workspaces apart.
    constants = Calibration().for_gpu(a10)
    assert constants.source == "assumed"
    assert all(constants.sources[k].startswith("assumed: ") for k in ("cuda_context", "nccl", "workspace"))
    # One GPU opens no NCCL communicator; the caching allocator's share is its replayed figure
    # for the plan's recomputation (the same on every CUDA GPU).
    assumed = estimate(NANO, plan, work, gpu=a10, calibration=Calibration())
    overhead = constants.cuda_context_bytes + constants.workspace_bytes
    assert constants.fragmentation is None
    assert assumed.peak_bytes - tensors == overhead + math.ceil((RESERVED_OVER_TENSORS["none"] - 1) * tensors)
    full = plan.model_copy(update={"recompute": "full"})
    tensors_full = estimate(NANO, full, work, gpu=a10, calibration=Calibration(gpus={"A10": GpuConstants()})).peak_bytes
    assert estimate(NANO, full, work, gpu=a10).peak_bytes - tensors_full == overhead + math.ceil(0.2 * tensors_full)
    two, work_two = ParallelPlan(dp=2), work.model_copy(update={"global_batch": 2})  # a communicator: NCCL's buffers too
    tensors_two = estimate(NANO, two, work_two, gpu=a10, calibration=Calibration(gpus={"A10": GpuConstants()})).peak_bytes
    assert estimate(NANO, two, work_two, gpu=a10).peak_bytes - tensors_two == (
        overhead + constants.nccl_bytes + math.ceil((RESERVED_OVER_TENSORS["none"] - 1) * tensors_two)
    )
    fitted = Calibration(gpus={"A10": GpuConstants(overhead_bytes=1000, fragmentation=1.5, source="fitted")})
    assert estimate(NANO, plan, work, gpu=a10, calibration=fitted).peak_bytes == 1000 + tensors + math.ceil(0.5 * tensors)


def test_fit_recovers_overhead_and_fragmentation_from_measured_runs():
    predicted = [10_000_000, 40_000_000, 90_000_000]
    measured = [round(1.08 * p) + 500_000_000 for p in predicted]
    constants = fit(predicted, measured)
    assert constants.source == "fitted"
    assert constants.fragmentation == pytest.approx(1.08)
    assert constants.overhead_bytes == pytest.approx(500_000_000, abs=2)
    with pytest.raises(FrenzyError, match="one prediction per measured run"):
        fit([1, 2], [1])


def test_a_calibration_file_is_loaded_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(Calibration(gpus={"H200": GpuConstants(overhead_bytes=7)}).model_dump_json())
    assert Calibration.load(path).for_gpu(GPU_CATALOG["H200"]).overhead_bytes == 7
    path.write_text("{not json")
    with pytest.raises(FrenzyError, match=f"calibration file {path} is not valid"):
        Calibration.load(path)
    with pytest.raises(FrenzyError, match="cannot read calibration file"):
        Calibration.load(tmp_path / "absent.json")


def test_every_catalog_type_has_documented_assumptions_for_each_term():
    packaged = Calibration.load(PACKAGED)
    assert set(packaged.gpus) == set(GPU_CATALOG)
    for name, constants in packaged.gpus.items():
        assert constants.source == "assumed", name
        assert set(constants.sources) == {"cuda_context", "nccl", "workspace", "fragmentation"}, name
        terms = {k: v for k, v in constants.sources.items() if k != "fragmentation"}
        # Each term assumed with its sources (published, or another type's measurement), or
        # measured on a GPU, with the measurement's file.
        assert all(
            (text.startswith("assumed: ") and ("https://" in text or "benchmarks/results/" in text))
            or (text.startswith("measured: ") and "benchmarks/results/" in text)
            for text in terms.values()
        ), name
        assert constants.sources["fragmentation"].startswith("replayed: ") and constants.fragmentation is None, name
        assert constants.overhead_bytes == constants.cuda_context_bytes + constants.nccl_bytes + constants.workspace_bytes
        assert 0.5 * GIB <= constants.overhead_bytes <= 2 * GIB, name
    # Hopper's cuBLAS workspaces are 32 MiB, NVLink parts run more NCCL channels than PCIe ones.
    h100, a10 = packaged.gpus["H100"], packaged.gpus["A10"]
    assert h100.workspace_bytes > a10.workspace_bytes and h100.nccl_bytes > a10.nccl_bytes
    assert packaged.gpus["H200"].sources["cuda_context"].startswith("measured: ")


def test_an_older_file_with_one_overhead_still_loads_and_the_terms_must_add_up(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"gpus": {"A10": {"overhead_bytes": 700, "fragmentation": 1.1, "source": "fitted", "note": "v1"}}}')
    old = Calibration.load(path).for_gpu(GPU_CATALOG["A10"])
    assert (old.overhead_bytes, old.cuda_context_bytes, old.nccl_bytes, old.fragmentation) == (700, 700, 0, 1.1)
    path.write_text(Calibration.load(path).model_dump_json())  # written back with the terms apart, and the sum
    assert Calibration.load(path).for_gpu(GPU_CATALOG["A10"]) == old
    path.write_text('{"gpus": {"A10": {"overhead_bytes": 5, "cuda_context_bytes": 3, "nccl_bytes": 1}}}')
    with pytest.raises(FrenzyError, match=r"overhead_bytes \(5\) must be the sum"):
        Calibration.load(path)


def test_a_fitted_type_keeps_the_assumed_nccl_term_and_unlisted_types_fall_back(tmp_path):
    h100 = GPU_CATALOG["H100"]
    fitted = fit([10_000_000, 40_000_000], [600_000_000, 640_000_000])
    path = tmp_path / "fitted.json"
    path.write_text(Calibration(gpus={"H100": fitted}).model_dump_json())
    constants = Calibration.load(path).for_gpu(h100)  # single-GPU runs open no communicator
    assert constants.source == "fitted" and constants.nccl_bytes == Calibration.load(PACKAGED).gpus["H100"].nccl_bytes
    assert constants.overhead_bytes == fitted.overhead_bytes + constants.nccl_bytes
    assert Calibration.load(path).for_gpu(GPU_CATALOG["T4"]) == Calibration.load(PACKAGED).gpus["T4"]
    declared = h100.model_copy(update={"name": "G3", "runtime_overhead_bytes": 123})
    assert Calibration().for_gpu(declared).overhead_bytes == 123
    assert Calibration().for_gpu(h100.model_copy(update={"name": "G4"})) == UNKNOWN
    assert GpuConstants().overhead_bytes == 0 and GpuConstants().fragmentation == 1.0  # neutral: what calibrate fits against


@pytest.mark.parametrize(
    ("plan", "global_batch", "message"),
    [
        (
            ParallelPlan(tp=3),
            1,
            r"tp \(3\) must divide heads \(4\), kv_heads \(4\), hidden \(128\) and ffn_hidden \(512\); accepted: \[1, 2, 4\]",
        ),
        (ParallelPlan(pp=5), 1, r"pp \(5\) must not exceed the number of layers \(4\); accepted: 1..4"),
        (ParallelPlan(dp=2, micro_batch=2), 6, r"global_batch \(6\) must be divisible by dp \* micro_batch \(2 \* 2 = 4\)"),
    ],
)
def test_impossible_plans_are_rejected_with_the_accepted_values(plan, global_batch, message):
    with pytest.raises(FrenzyError, match=message):
        estimate(NANO, plan, Workload(global_batch=global_batch, seq_len=32, precision="fp32"))


plans = st.builds(
    ParallelPlan,
    dp=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4, 12]),
    micro_batch=st.sampled_from([1, 2, 4]),
    recompute=st.sampled_from(["none", "selective", "full"]),
)


def _predict(plan):
    return estimate(PRESETS["gpt2-small"], plan, Workload(global_batch=64 * plan.dp * plan.micro_batch, seq_len=128, precision="bf16"))


@settings(max_examples=60, deadline=None)
@given(plans)
def test_zero_partitions_what_deepspeed_partitions(plan):
    plan = plan.model_copy(update={"tp": 1, "pp": 1, "dp": max(plan.dp, 4)})
    n = PRESETS["gpt2-small"].parameters
    by_stage = {z: _predict(plan.model_copy(update={"zero": z})) for z in range(4)}
    zero0, zero1, zero2, zero3 = (by_stage[z].per_stage[0] for z in range(4))
    assert zero0.optimizer == 8 * n
    # ZeRO-1 (ZeroRedundancyOptimizer) deals whole tensors out: Adam's moments of the worst rank's share.
    largest = max(parameter_sizes(PRESETS["gpt2-small"]))
    assert 8 * n / plan.dp <= zero1.optimizer <= 8 * (n / plan.dp + largest)
    assert zero1.params == zero1.grads == 4 * n
    # DeepSpeed's ZeRO-2 keeps an fp32 master slice beside the Adam moments: 12 bytes per parameter of the slice.
    assert zero2.optimizer == pytest.approx(12 * n / plan.dp, rel=1e-4)
    assert zero2.params >= 4 * n  # the flattened (padded) fp32 weights stay whole
    assert zero3.optimizer < zero0.optimizer


@settings(max_examples=60, deadline=None)
@given(plans)
def test_zero1_shares_every_stage_tensor_once_over_data_parallel_ranks(plan):
    model = PRESETS["gpt2-small"]
    plan = plan.model_copy(update={"zero": 1})
    for stage in range(plan.pp):
        sizes = stage_tensor_sizes(model, plan, stage)
        owners = deal_out(list(sizes), plan.dp)
        shares = [([n for n, o in zip(sizes, owners, strict=True) if o == rank] or [0]) for rank in range(plan.dp)]
        assert sum(map(sum, shares)) == stage_parameters(model, plan, stage)
        # Dealt largest first to the emptiest rank: no two shares differ by more than the largest tensor.
        owned = [sum(s) for s in shares]
        assert max(owned) - min(owned) <= largest_tensor(model, plan, stage)
        # The estimator's view: each distinct (elements, largest tensor), in rank order.
        distinct = list(dict.fromkeys((sum(s), max(s)) for s in shares))
        assert list(optimizer_shares(model, plan.tp, plan.layer_split(model.layers), plan.dp, stage)) == distinct


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 40))
def test_deal_out_deals_as_zero_redundancy_optimizer_does(sizes, ranks):
    """The heap gives each tensor, largest first, to the rank holding the fewest elements (ties:
    the lowest rank), as a scan of every rank would."""
    owners, totals = [0] * len(sizes), [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        owners[i] = totals.index(min(totals))
        totals[owners[i]] += sizes[i]
    assert deal_out(sizes, ranks) == owners


@pytest.mark.parametrize("preset", ["gpt-nano", "llama-micro"])
@pytest.mark.parametrize("tp", [1, 2])
def test_zero2_layout_finds_the_worst_rank_without_visiting_every_rank(preset, tp):
    """The largest overlap of the ranks that own the tail and of those that do not, as a visit of
    every rank's slice finds them, for dp from 1 to past the tensor count."""
    model = PRESETS[preset]
    sizes = parameter_sizes(model, tp)
    # reduced by the end of the last block's backward: the last block, the final norm and the head
    tail = sum(block_tensors(model, tp)) + sum(r * c for r, c in head_shapes(model, tp, own_head=not model.tied_embeddings))
    for dp in [*range(1, 80), 255, 256, 1000, 4096]:
        layout = zero_layout(model, dp, tp)
        low_tail = layout.total - tail
        overlaps = []
        for rank in range(dp):
            low, high, offset, total = rank * layout.part, (rank + 1) * layout.part, 0, 0
            for n in sizes:
                total += n if offset < high and offset + n > low else 0
                offset += n
            overlaps.append((total, high > low_tail))
        assert layout.overlap_tail == max((o for o, owns in overlaps if owns), default=-1)
        assert layout.overlap_rest == max((o for o, owns in overlaps if not owns), default=-1)


@settings(max_examples=60, deadline=None)
@given(plans)
def test_recomputation_never_needs_more_activation_memory(plan):
    per_mode = [_predict(plan.model_copy(update={"recompute": r})).per_stage for r in ("none", "selective", "full")]
    for stage in range(plan.pp):
        acts = [stages[stage].activations for stages in per_mode]
        assert acts == sorted(acts, reverse=True)


@settings(max_examples=60, deadline=None)
@given(plans)
def test_splitting_the_model_never_adds_parameters_per_gpu(plan):
    whole = _predict(plan.model_copy(update={"tp": 1, "pp": 1})).per_stage[0].params
    assert max(b.params for b in _predict(plan).per_stage) <= whole


@settings(max_examples=200, deadline=None)
@given(plans, st.sampled_from(["fp32", "bf16"]), st.booleans())
def test_the_search_path_finds_the_itemised_peak(plan, precision, on_gpu):
    # peak_bytes skips the middle pipeline stages, claiming the second bounds them.
    model = PRESETS["gpt2-small"]
    work = Workload(global_batch=64 * plan.dp * plan.micro_batch, seq_len=128, precision=precision)
    gpu = GPU_CATALOG["A100-80GB"] if on_gpu else None
    assert peak_bytes(model, plan, work, gpu=gpu) == estimate(model, plan, work, gpu=gpu).peak_bytes


def test_the_quoted_tensor_accuracy_is_what_the_accuracy_benchmark_measured():
    """The margin's docstring and docs/memory.md quote the tensors' error on this engine: the
    median and worst of benchmarks/memory_accuracy's last results, not a figure of their own."""
    root = ROOT
    frenzy = json.loads((root / "benchmarks/results/memory_accuracy.json").read_text())["frenzy"]
    median, worst = (f"{100 * frenzy[k]:.2f}%" for k in ("median_abs_error", "worst_abs_error"))
    docs = (root / "docs/memory.md").read_text()
    for text in (MemoryMargin.__doc__, docs.split("## Safety margin")[1].split("##")[0]):
        flat = " ".join(text.split())
        assert f"median {median}" in flat and f"at worst {worst}" in flat, flat
    assert f"| this estimator (`frenzy estimate`) | {median} | {worst} " in docs
