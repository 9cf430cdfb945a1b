"""memory.frameworks: Megatron-LM's and torchtitan FSDP2's model states and refusals (pure, fast)."""

import json

import pytest

from benchmarks import memory_published as published
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.frameworks import MegatronOptions, estimate
from frenzy_prefect.memory.frameworks import megatron as mg
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from tests.support.stack import ROOT

LLAMA = PRESETS["llama-3.1-8b"]


GPT = PRESETS["gpt2-small"]


def _run(framework, plan, model=GPT, options=None, **work):
    work = dict(global_batch=plan.dp * plan.micro_batch * plan.pp, seq_len=1024, precision="bf16") | work
    return estimate(framework, model, plan, Workload(**work), options=options)


def test_megatron_model_states_are_18_bytes_per_parameter_without_the_distributed_optimizer():
    plan = ParallelPlan(dp=4)
    b = _run("megatron", plan).per_stage[0]
    n = mg.stage_parameters(GPT, plan, GPT.layers, 0)
    assert (b.params, b.grads, b.optimizer) == (2 * n, 4 * n, 12 * n)


def test_megatron_distributed_optimizer_shards_master_and_adam_over_dp_with_tp_and_pp():
    plan = ParallelPlan(dp=4, tp=2, pp=2, zero=1)
    est = _run("megatron", plan)
    for stage, b in enumerate(est.per_stage):
        n = mg.stage_parameters(GPT, plan, GPT.layers // 2, stage)
        assert b.params + b.grads + b.optimizer == pytest.approx((6 + 12 / 4) * n, abs=1)


def test_megatron_pads_the_vocabulary_to_128_times_tp_and_splits_it():
    assert mg.padded_vocab(GPT, 1) == 50304 and mg.padded_vocab(GPT, 4) == 50688


def test_megatron_sequence_parallel_and_flash_lower_activations():
    plan = ParallelPlan(tp=4, micro_batch=2)
    acts = {
        (sp, att): _run("megatron", plan, attention=att, options=MegatronOptions(sequence_parallel=sp)).per_stage[0].activations
        for sp in (False, True)
        for att in ("flash", "eager")
    }
    assert acts[(True, "flash")] < acts[(False, "flash")] < acts[(False, "eager")]


def test_megatron_interleaving_holds_more_on_the_last_stage_than_plain_1f1b():
    plan = ParallelPlan(dp=1, pp=4)
    plain = _run("megatron", plan, global_batch=8).per_stage[-1].activations
    inter = _run("megatron", plan, global_batch=8, options=MegatronOptions(vpp=3)).per_stage[-1].activations
    assert inter > plain  # 9 one-layer chunks in flight against 3 layers of one micro-batch


def test_megatron_fused_cross_entropy_keeps_one_more_fp32_copy_of_the_last_stages_logits():
    # The compiled backward clones the saved fp32 softmax (4 bytes per logit of the tp rank's
    # vocabulary slice); the last stage's peak is the loss backward when the logits are this large.
    plan = ParallelPlan(dp=2, tp=2, pp=2, micro_batch=4)
    plain, fused = (_run("megatron", plan, options=MegatronOptions(cross_entropy_fusion=f)).per_stage[-1].total for f in (False, True))
    assert fused - plain == 4 * 1024 * 4 * mg.padded_vocab(GPT, 2) // 2


def test_megatron_deferred_output_wgrad_keeps_input_and_gradient_of_the_deferred_micro_batches_on_the_last_stage():
    # --defer-embedding-wgrad-compute: min(limit, micro-batches - 1) earlier micro-batches' output-layer
    # input (2 s b h) and 16-bit logits gradient (2 s b V/t) are alive while the last one runs; 0 means all.
    plan = ParallelPlan(dp=2, tp=2, pp=2, micro_batch=4)
    pair = 2 * 1024 * 4 * (mg.padded_vocab(GPT, 2) // 2) + 2 * 1024 * 4 * GPT.hidden // 2  # sequence parallel input
    off = _run("megatron", plan, global_batch=32).per_stage  # 4 micro-batches
    for limit, pairs in ((2, 2), (0, 3), (9, 3)):
        deferred = _run("megatron", plan, global_batch=32, options=MegatronOptions(wgrad_deferral=limit)).per_stage
        assert deferred[-1].total - off[-1].total == pairs * pair
        assert deferred[0].total == off[0].total  # the output layer is the last stage's
    for refused, options in ((ParallelPlan(dp=2, tp=2, micro_batch=4), {}), (plan, {"grad_accumulation_fusion": False})):
        with pytest.raises(FrenzyError, match="needs pp >= 2 and gradient-accumulation fusion"):  # as Megatron refuses them
            _run("megatron", refused, global_batch=32, options=MegatronOptions(wgrad_deferral=2, **options))


def test_megatron_qk_layernorm_saves_the_query_and_key_inputs_and_statistics_per_layer():
    plan = ParallelPlan(dp=1, tp=2, micro_batch=1)
    plain, normed = (_run("megatron", plan, global_batch=1, options=MegatronOptions(qk_layernorm=q)).per_stage[0] for q in (False, True))
    per_token = (2 * (GPT.hidden + GPT.kv_width) + 8 * (GPT.heads + GPT.kv_heads)) // 2  # bf16 inputs, LayerNorm's two fp32 statistics
    assert normed.activations - plain.activations == GPT.layers * 1024 * per_token


def test_fsdp_states_of_llama_are_16_bytes_per_parameter_over_dp_at_the_step():
    plan = ParallelPlan(dp=8, micro_batch=1, zero=3, recompute="full")
    b = _run("fsdp", plan, model=LLAMA, seq_len=512).per_stage[0]
    n = LLAMA.parameters
    assert b.params == pytest.approx(4 * n / 8, rel=1e-6) and b.optimizer == pytest.approx(8 * n / 8, rel=1e-6)
    assert b.params + b.optimizer + 4 * n / 8 == pytest.approx(16 * n / 8, rel=1e-6)


@pytest.mark.parametrize(
    ("framework", "plan", "message"),
    [
        ("fsdp", ParallelPlan(dp=2, zero=1), "fsdp models torchtitan's FSDP2: zero=3 with pp=1"),
        ("fsdp", ParallelPlan(dp=2, pp=2, zero=3), "got zero=3, pp=2"),
        ("megatron", ParallelPlan(dp=2, zero=2), "megatron models zero=0 (DDP) and zero=1 (its distributed optimizer)"),
        ("deepspeed", ParallelPlan(), "unknown framework 'deepspeed'; supported: frenzy, megatron, fsdp"),
    ],
)
def test_refusals_name_what_is_supported(framework, plan, message):
    with pytest.raises(FrenzyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _run(framework, plan)


def test_frenzy_is_the_engine_estimate_unchanged():
    from frenzy_prefect.memory.analytic import estimate as engine

    plan = ParallelPlan(dp=2, micro_batch=2)
    work = Workload(global_batch=4, seq_len=256, precision="bf16")
    assert _run("frenzy", plan, global_batch=4, seq_len=256) == engine(GPT, plan, work)


def test_the_published_points_keep_a_held_out_split_and_the_docs_quote_both_figures():
    """Each published GPU point says whether the modules were built against it (in-sample) or it
    is held out; no measurement is in both; docs/memory.md quotes MARP's median and worst
    |error| on each split as the benchmark computes them now."""
    points = json.loads(published.DATA.read_text())["points"]
    assert {p["role"] for p in points} == set(published.ROLES)
    sources = {role: {p["source"]["path"] for p in points if p["role"] == role} for role in published.ROLES}
    assert not sources["modelling"] & sources["held_out"]
    stats = published.per_framework([published.row_of(p, {}) for p in points])
    assert stats["megatron"]["held_out"]["points"] > 0
    docs = (ROOT / "docs" / "memory.md").read_text()
    for framework, roles in stats.items():
        for role, s in roles.items():
            if s["points"]:
                figures = f"{s['frenzy']['median_abs_error']:.1%} / {s['frenzy']['worst_abs_error']:.1%}"
                quoted = f"| {framework} | {role.replace('_', ' ')} | {s['points']} | {figures} |"
                assert quoted in docs, quoted
