"""The pipeline executor: fault-free schedules from one builder, executed on real gloo ranks, give
what plain data parallelism gives; B then W give a plain backward's gradients; a worker can run
another pipeline's micro-batches (ReCycle's re-routing) and the update is unchanged."""

from contextlib import nullcontext

import pytest
import torch

from frenzy_prefect.pipeline.builder import BACKWARDS, one_f_one_b
from frenzy_prefect.pipeline.costs import StageCosts
from frenzy_prefect.pipeline.in_flight import in_flight_peak
from frenzy_prefect.pipeline.schedule import Action, ActionKind
from frenzy_prefect.pipeline.timeline import iteration_s
from frenzy_prefect.pipeline.validate import validate
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.training.decoder import Decoder
from frenzy_prefect.training.executor import StageExecutor, _Run
from tests.support.training import NANO

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize(("dp", "pp", "microbatches"), [(1, 2, 1), (2, 2, 4), (1, 4, 8), (3, 4, 2)])
def test_both_fault_free_schedules_are_valid(dp, pp, microbatches, backward):
    schedule = one_f_one_b(dp, pp, microbatches, backward)
    validate(schedule)
    # Fused: stage s holds pp - s in flight (1F1B); split (ZB-H1): pp on every stage.
    held = [in_flight_peak(schedule, (0, s)) for s in range(pp)]
    assert held == [min(microbatches, pp - s if backward == "fused" else pp) for s in range(pp)]


def test_deferring_w_shortens_the_iteration():
    costs = StageCosts.uniform(4, p2p=0.1)
    assert iteration_s(one_f_one_b(1, 4, 8, "split"), costs) < iteration_s(one_f_one_b(1, 4, 8), costs)


@pytest.mark.parametrize(("stage", "stages"), [(1, 3), (1, 2)], ids=["middle stage", "last stage"])
def test_b_gives_only_the_input_gradient_and_w_then_a_plain_backwards_weight_gradients(stage, stages):
    torch.manual_seed(0)
    model = Decoder(NANO, stage=stage, split=ParallelPlan(pp=stages).layer_split(NANO.layers))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, NANO.vocab_size, (2, 17), generator=generator)
    targets = ids[:, 1:]
    hidden = torch.randn(2, 16, NANO.hidden, generator=generator)
    last = stage == stages - 1
    grad = None if last else torch.randn(2, 16, NANO.hidden, generator=generator)
    received = hidden.clone().requires_grad_()
    model(received, targets if last else None).backward(grad)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    executor = StageExecutor(
        model, stage=stage, pp=stages, dp=1, rank_of=None, autocast=nullcontext, scale=lambda t: t, hidden=(NANO.hidden, torch.float32)
    )
    run = _Run(executor, 1, lambda q, j: (ids[:, :-1], targets), fused=set())
    run.received[(0, 0)] = hidden.clone().requires_grad_()
    run.forward(Action(ActionKind.F, 0, 0))
    run.held[(0, 0)].grad = grad
    run.backward_input(Action(ActionKind.B, 0, 0))
    torch.testing.assert_close(run.held[(0, 0)].received.grad, received.grad)
    assert [name for name, p in model.named_parameters() if p.grad is not None] == []
    run.backward_weight(Action(ActionKind.W, 0, 0))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)
