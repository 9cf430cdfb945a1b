"""The analytic estimator: exact on model states, the published activation formula, and the
invariants every plan must keep."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory import estimate
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.training.gpt import GPT

NANO = PRESETS["gpt-nano"]


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(("name", "kwargs", "state_bytes"), [("adamw", {}, 8), ("sgd", {"momentum": 0.9}, 4)])
def test_model_states_equal_the_real_tensors_after_a_step(name, kwargs, state_bytes):
    torch.manual_seed(0)
    model = GPT(NANO)
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
    b = estimate(NANO, ParallelPlan(micro_batch=2), global_batch=2, seq_len=16, precision="fp32", optimizer_bytes_per_param=state_bytes).per_stage[0]
    assert (b.params, b.grads, b.optimizer) == measured


def test_activations_follow_korthikanti_table_2():
    # s=64, b=2, h=128, a=4, t=1, 16-bit: per layer s*b*h*(34 + 5*a*s/h) = 16384 * 44 bytes, 4 layers,
    # plus the embedding output (s*b*h*2) and the logits with their fp32 copy (s*b*V*(2+4)).
    b = estimate(NANO, ParallelPlan(micro_batch=2), global_batch=2, seq_len=64, precision="bf16", optimizer_bytes_per_param=8).per_stage[0]
    assert b.activations == 4 * 16384 * 44 + 64 * 2 * 128 * 2 + 64 * 2 * 256 * 6


def test_gpu_overhead_is_counted_only_for_a_gpu_type():
    plan = ParallelPlan()
    bare = estimate(NANO, plan, global_batch=1, seq_len=32, precision="fp32", optimizer_bytes_per_param=8)
    on_a10 = estimate(NANO, plan, global_batch=1, seq_len=32, precision="fp32", optimizer_bytes_per_param=8, gpu=GPU_CATALOG["A10"])
    assert bare.peak_stage.other == 0
    assert on_a10.peak_bytes - bare.peak_bytes == GPU_CATALOG["A10"].runtime_overhead_bytes


@pytest.mark.parametrize(
    ("plan", "global_batch", "message"),
    [
        (ParallelPlan(tp=3), 1, r"tp \(3\) must divide heads \(4\) and hidden \(128\); accepted: \[1, 2, 4\]"),
        (ParallelPlan(pp=5), 1, r"pp \(5\) must not exceed the number of layers \(4\)"),
        (ParallelPlan(dp=2, micro_batch=2), 6, r"global_batch \(6\) must be divisible by dp \* micro_batch \(2 \* 2 = 4\)"),
    ],
)
def test_impossible_plans_are_rejected_with_the_accepted_values(plan, global_batch, message):
    with pytest.raises(FrenzyError, match=message):
        estimate(NANO, plan, global_batch=global_batch, seq_len=32, precision="fp32", optimizer_bytes_per_param=8)


plans = st.builds(
    ParallelPlan,
    dp=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4]),
    micro_batch=st.sampled_from([1, 2, 4]),
    recompute=st.sampled_from(["none", "selective", "full"]),
)


def _predict(plan, **overrides):
    kwargs = dict(global_batch=64 * plan.dp * plan.micro_batch, seq_len=128, precision="bf16", optimizer_bytes_per_param=8) | overrides
    return estimate(PRESETS["gpt2-small"], plan, **kwargs)


@settings(max_examples=60, deadline=None)
@given(plans)
def test_each_zero_stage_never_needs_more_memory(plan):
    peaks = [_predict(plan.model_copy(update={"zero": z})).peak_bytes for z in range(4)]
    assert peaks == sorted(peaks, reverse=True)
    if plan.dp > 1:
        assert peaks[3] < peaks[0]


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
