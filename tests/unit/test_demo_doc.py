"""docs/demo.md shows what the demo prints: its table of ranked plans is the one
examples/quickstart.py prints (``plan_lines``) from the rows a fresh demo's `train-llm` run ranks
(the memory-estimates artifact: the demo's request on blocks/local-hetero.yaml, a calibration
store with no runs yet), with the artifact's units."""

from __future__ import annotations

import importlib.util
import re

from frenzy_prefect.allocator.learning import applied
from frenzy_prefect.allocator.plans import candidate_plans
from frenzy_prefect.memory.run_records import CalibrationStore
from frenzy_prefect.profiling.model import resolve_model
from frenzy_prefect.spec.cluster import ClusterSpec
from frenzy_prefect.spec.request import TrainingRequest
from frenzy_prefect.units import duration, gib, usd
from tests.support.stack import EXAMPLE_CLUSTER, ROOT

ARTIFACT_ROWS = 25  # flows/tasks.py: the memory-estimates artifact's rows


def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def artifact_rows(demo) -> list[dict[str, str]]:
    """The memory-estimates rows of the demo's run, with the cells the demo prints (flows/tasks.py's formats)."""
    request = TrainingRequest.model_validate(demo.demo_request() | {"dataset": demo.INCOMING})
    cluster = ClusterSpec.from_file(EXAMPLE_CLUSTER)
    taught, calibration, _ = applied(CalibrationStore(cluster=cluster.name), cluster)
    candidates = candidate_plans(resolve_model(request.model), request, taught, calibration)
    return [
        {
            "#": str(rank),
            "gpu": c.gpu_type,
            "gpus": str(c.plan.gpus),
            "plan": c.plan.label(),
            "peak GiB": gib(c.memory.peak_stage.total),
            "fits": "yes" if c.fits else "no",
            "step time (predicted)": duration(c.step_time_s),
            "total time (predicted)": duration(c.total_time_s),
            "cost (predicted)": usd(c.cost),
        }
        for rank, c in enumerate(candidates[:ARTIFACT_ROWS], 1)
    ]


def documented_plans() -> list[str]:
    """The "Plans:" lines of docs/demo.md's output block, up to the approval."""
    text = (ROOT / "docs" / "demo.md").read_text()
    block = re.search(r"^Plans: .*?(?=^Approved:)", text, re.S | re.M)
    assert block, "docs/demo.md has no Plans: block before Approved:"
    return block.group(0).rstrip("\n").splitlines()


def test_the_demo_docs_plan_table_is_what_the_demo_prints():
    demo = quickstart()
    printed = demo.plan_lines(artifact_rows(demo))
    assert documented_plans() == printed, "docs/demo.md's plan table should read:\n" + "\n".join(printed)


def test_the_demo_docs_predictions_are_the_approved_plans():
    """Plan #1 approved: its peak, step time, total time and cost as the report lines print them."""
    first = artifact_rows(quickstart())[0]
    text = (ROOT / "docs" / "demo.md").read_text()
    assert f"Chosen plan:    {first['gpus']} x {first['gpu']}, {first['plan']}" in text
    assert f"Predicted peak: {first['peak GiB']} GiB per GPU (of 22.5 GiB)" in text
    step, total, cost = first["step time (predicted)"], first["total time (predicted)"], first["cost (predicted)"]
    assert f"Predicted time: {step} a step on the modelled GPUs, {total} in all, {cost} at the cluster file's prices" in text
