"""Real training: torch.distributed over gloo in separate processes, data and checkpoints in S3."""

import math

import pytest
import torch

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.profiling.model import PRESETS
from frenzy_prefect.spec.layout import check_engine_plan
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.decoder import Decoder, shard_state
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.layers import positions
from frenzy_prefect.training.tensor_parallel import TensorParallel
from tests.support.training import NANO


@pytest.mark.parametrize("name", ["gpt-nano", "llama-nano"])
def test_master_weights_train_as_fp32_weights_under_autocast(name):
    """bf16 weights with fp32 masters and main gradients follow fp32 weights under bf16 autocast
    within bf16's rounding; the weights are bf16, the optimizer's masters and their gradients fp32."""
    spec = PRESETS[name]
    ids = torch.randint(0, spec.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    batches = [(ids[:, :-1], ids[:, 1:])] * 2
    runs = {}
    for master in (False, True):
        work = Workload(global_batch=4, seq_len=64, precision="bf16", optimizer={"lr": 3e-3}, master_weights=master)
        engine = Engine(spec, ParallelPlan(micro_batch=2), work)
        runs[master] = [engine.step(batches) for _ in range(4)]
    assert runs[True] == pytest.approx(runs[False], abs=2e-2)
    assert runs[True][-1] < runs[True][0] - 0.5
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert {(m.dtype, m.grad.dtype) for m in engine.optimizer.param_groups[0]["params"]} == {(torch.float32, torch.float32)}
    assert {t.dtype for t in engine.state_dict().values()} == {torch.float32}


def test_master_weights_need_half_precision_and_no_deepspeed():
    with pytest.raises(ValueError, match="set precision bf16 or fp16"):
        Workload(global_batch=1, seq_len=16, precision="fp32", master_weights=True)
    with pytest.raises(FrenzyError, match="set precision bf16 or fp16"):
        check_engine_plan(NANO, ParallelPlan(), "fp32", master_weights=True)
    with pytest.raises(FrenzyError, match="ZeRO-2 keeps fp32 weights"):
        check_engine_plan(NANO, ParallelPlan(dp=2, zero=2), "bf16", master_weights=True)


class _NoComm(TensorParallel):
    """A tensor-parallel rank without its group: the partial sums a row-parallel layer would all-reduce."""

    def enter(self, x):
        return x

    def leave(self, x):
        return x


@pytest.mark.parametrize("name", ["gpt-nano", "llama-nano"])
def test_tensor_parallel_shards_sum_to_the_whole_models_attention_and_mlp(name):
    """shard_state slices [q | k | v] (k and v kv_heads wide) and SwiGLU's [gate | up] per part:
    the two ranks' partial outputs add up to the unsplit layer's."""
    spec = PRESETS[name].model_copy(update={"qkv_bias": True, "out_bias": True, "mlp_bias": True})
    torch.manual_seed(0)
    full = Decoder(spec).eval()
    x = torch.randn(2, 16, spec.hidden)
    shared = positions(spec, "flash", 16, x.device)
    block = full.blocks[1]
    parts = []
    for rank in range(2):
        tp = _NoComm(rank=rank, size=2)
        shard = Decoder(spec, tp=tp).eval()
        shard.load_state_dict(shard_state(full.state_dict(), spec, tp, 0, (spec.layers,)))
        parts.append((shard.blocks[1].attn(x, shared), shard.blocks[1].mlp(x)))
    torch.testing.assert_close(parts[0][0] + parts[1][0], block.attn(x, shared))
    torch.testing.assert_close(parts[0][1] + parts[1][1], block.mlp(x))


@pytest.mark.parametrize(
    ("name", "attention", "precision", "recompute"),
    [("llama-nano", "flash", "bf16", "none"), ("llama-nano", "eager", "fp32", "selective"), ("gpt-nano", "eager", "bf16", "full")],
)
def test_the_engine_trains_llama_blocks_and_both_attentions_with_dropout(name, attention, precision, recompute):
    spec = PRESETS[name].model_copy(update={"attention_dropout": 0.1, "hidden_dropout": 0.1})
    work = Workload(global_batch=4, seq_len=32, precision=precision, optimizer={"lr": 3e-3, "schedule": "constant"}, attention=attention)
    engine = Engine(spec, ParallelPlan(micro_batch=4, recompute=recompute), work)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (4, 33), generator=generator)  # a small alphabet, learnable in a few steps
    losses = [engine.step([(ids[:, :-1], ids[:, 1:])]) for _ in range(8)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("name", ["gpt-nano", "llama-nano"])
def test_eager_attention_computes_what_the_fused_one_does(name):
    torch.manual_seed(0)
    flash = Decoder(PRESETS[name]).eval()
    eager = Decoder(PRESETS[name], attention="eager").eval()
    eager.load_state_dict(flash.state_dict())
    ids = torch.randint(0, 256, (2, 24))
    torch.testing.assert_close(eager(ids), flash(ids), atol=1e-5, rtol=1e-4)
