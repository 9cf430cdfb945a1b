"""Frameworks' predicted per-GPU peak memory against published measurements.

Every point of ``benchmarks/data/memory_published.json`` (collected with its sources and
derivations in ``memory_published.md``: Megatron-LM functional-test golden values, torchtitan's
benchmark tables) is predicted by ``frenzy_prefect.memory.frameworks`` under the point's own
framework, and beside it by Megatron-LM's theoretical formula (``memory_baselines.megatron``)
and by llm-analysis (in-process when importable, else with ``$LLM_ANALYSIS_PYTHON``, else
"n/a" and why). The quantity compared is the one measured:

- ``max_allocated`` (torch's allocated peak): the predicted tensors, on the reporting rank's
  pipeline stage (Megatron logs the last global rank: the last stage);
- ``max_reserved``: the tensors plus the allocator's unusable cached block that the framework
  module names (``fsdp.reserved_allowance``); no other fragmentation allowance is added.

The error is (predicted - measured) / measured. Beside it, the planner's figure (what the fit
test compares with the GPU: the tensors with the caching allocator's figure, the CUDA context,
workspaces and NCCL of the point's GPU type, ``analytic.on_device``) and whether it, and it plus
the default memory margin, covers the measurement. Prints a table, per-framework median and
worst |error|, in-sample and held out, the same per measured quantity (allocated, reserved) with
how many predictions were low, and writes JSON. Each point's ``role`` says which:
``modelling`` points were looked at while the framework modules were built (their errors are
in-sample); ``held_out`` points were added after, only to report, and no constant is ever
tuned to them (a point moves to ``modelling`` the moment one is).

    python -m benchmarks.memory_published [--json benchmarks/results/memory_published.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import memory_baselines, write_result
from frenzy_prefect.memory.analytic import on_device
from frenzy_prefect.memory.frameworks import FsdpOptions, MegatronOptions, estimate, fsdp
from frenzy_prefect.spec.catalog import GPU_CATALOG
from frenzy_prefect.spec.gpu import GpuType, MemoryMargin
from frenzy_prefect.spec.model import ModelSpec
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload

DATA = Path(__file__).resolve().parent / "data" / "memory_published.json"
GIB = 2**30


def model_of(point: dict) -> ModelSpec:
    m, r = point["model"], point["run"]
    dropout = r.get("dropout") or {}
    bias = bool(m.get("bias", False))
    gated = bool(m.get("gated_mlp")) or m.get("hidden_act") == "silu"
    return ModelSpec(
        name=m.get("name", point["id"]),
        layers=m["num_hidden_layers"],
        hidden=m["hidden_size"],
        heads=m["num_attention_heads"],
        kv_heads=m.get("num_key_value_heads") or m["num_attention_heads"],
        # Megatron pads the unpadded vocabulary itself (to 128 * tp); others take it as published.
        vocab_size=m.get("vocab_size_unpadded") or m["vocab_size"] if point["framework"] == "megatron" else m["vocab_size"],
        max_seq_len=max(m.get("max_position_embeddings") or 0, r["seq_len"]),
        ffn_hidden=m["intermediate_size"],
        norm=m.get("norm", "layernorm"),
        mlp="swiglu" if gated else "gelu",
        position=m.get("position", "learned"),
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bias,
        tied_embeddings=bool(m.get("tie_word_embeddings", False)),
        attention_dropout=dropout.get("attention") or 0.0,
        hidden_dropout=dropout.get("hidden") or 0.0,
    )


def _flag(other: str, name: str) -> int | None:
    found = re.search(rf"--{name}\s+(\d+)", other)
    return int(found.group(1)) if found else None


def options_of(point: dict) -> MegatronOptions | FsdpOptions | None:
    r, other = point["run"], point["run"].get("other") or ""
    if point["framework"] == "megatron":
        return MegatronOptions(
            sequence_parallel=bool(r.get("sequence_parallel")),
            vpp=r.get("vpp"),
            microbatch_group=_flag(other, "microbatch-group-size-per-virtual-pipeline-stage"),
            grad_accumulation_fusion="--no-gradient-accumulation-fusion" not in other,
            masked_softmax_fusion="--no-masked-softmax-fusion" not in other,
            first_stage_layers=_flag(other, "decoder-first-pipeline-num-layers"),
            last_stage_layers=_flag(other, "decoder-last-pipeline-num-layers"),
            cross_entropy_fusion="--cross-entropy-loss-fusion" in other,
            wgrad_deferral=(_flag(other, "wgrad-deferral-limit") or 0) if "--defer-embedding-wgrad-compute" in other else None,
            qk_layernorm="--qk-layernorm" in other,
        )
    if point["framework"] == "fsdp":
        return FsdpOptions(reduce_dtype="bf16" if "reduce bf16" in other else "fp32")
    return None


def plan_of(point: dict) -> ParallelPlan:
    r = point["run"]
    return ParallelPlan(dp=r["dp"], tp=r["tp"], pp=r["pp"], micro_batch=r["micro_batch"], zero=r["zero"], recompute=r["recompute"])


def tensors(point: dict) -> tuple[int, str]:
    """The predicted tensors of the measured rank's stage, and which stage that is."""
    r, spec, plan = point["run"], model_of(point), plan_of(point)
    work = Workload(global_batch=r["global_batch"], seq_len=r["seq_len"], precision=r["precision"], attention=r.get("attention", "flash"))
    result = estimate(point["framework"], spec, plan, work, options=options_of(point))
    if "last" in point["measured"].get("rank", ""):
        return result.per_stage[-1].total, "tensors (last stage)"
    return result.peak_bytes, "tensors (peak stage)"


def predicted(point: dict) -> tuple[int, str]:
    """(bytes comparable with the measurement, what they are)."""
    stage_bytes, quantity = tensors(point)
    if point["measured"]["kind"] == "max_reserved" and point["framework"] == "fsdp":
        allowance = fsdp.reserved_allowance(model_of(point), plan_of(point), point["run"]["seq_len"])
        return stage_bytes + allowance, quantity + " + cached logits block"
    return stage_bytes, quantity


# Parts the catalog lacks, by the vendors' published capacity per GPU (the points do not state
# it): GB200 NVL72 13.4 TB HBM3e over 72 GPUs, DGX B200 1,440 GB over 8, MI300X 192 GB. Their
# GPU terms are the calibration's for an unknown type (calibration.UNKNOWN); throughput unused here.
OUTSIDE_CATALOG = {"GB200": 186, "B200": 180, "AMD MI300X": 192}


def gpu_of(point: dict) -> GpuType:
    """The type of the point's GPU with the point's memory size (torchtitan's H100s have 96 GB)."""
    name = point["gpu"]
    for part, gb in OUTSIDE_CATALOG.items():
        if name.startswith(part + " "):
            return GpuType(name=part, memory_bytes=gb * 10**9, half_tflops=1, fp32_tflops=1, link_gbps=1)
    kind = "H100" if name.startswith("H100") else "A100-80GB" if name.startswith("A100 80GB") else None
    size = re.match(r"\S+ (\d+)GB", name)
    if kind is None or size is None:
        known = ", ".join(sorted(OUTSIDE_CATALOG))
        raise ValueError(f"{point['id']}: GPU {name!r} is neither an H100 or A100 80GB with its size in GB nor one of {known}")
    return GPU_CATALOG[kind].model_copy(update={"memory_bytes": int(size.group(1)) * 10**9})


def planner(point: dict) -> tuple[int, int]:
    """(the planner's figure for the measured rank, the default memory margin on the point's GPU)."""
    gpu = gpu_of(point)
    return on_device(tensors(point)[0], plan_of(point), gpu), MemoryMargin().bytes_for(gpu.memory_bytes)


def megatron_formula(point: dict) -> int:
    r, spec, plan = point["run"], model_of(point), plan_of(point)
    t = r["tp"]
    vocab = -(-spec.vocab_size // (128 * t)) * 128 * t if point["framework"] == "megatron" else spec.vocab_size
    return memory_baselines.megatron(
        spec,
        plan,
        seq_len=r["seq_len"],
        precision=r["precision"],
        micro_batches=plan.accumulation(r["global_batch"]),
        sequence_parallel=bool(r.get("sequence_parallel")),
        vpp=r.get("vpp"),
        vocab=vocab,
    )


def llm_analysis(points: list[dict]) -> tuple[dict[str, int | str], str]:
    """llm-analysis's peaks by point id, and where they came from (or why there are none)."""
    try:
        import llm_analysis  # noqa: F401

        from benchmarks.llm_analysis_baseline import predict_all

        return predict_all(points), "llm-analysis in-process"
    except ImportError:
        python = os.environ.get("LLM_ANALYSIS_PYTHON")
        if not python:
            return {}, "n/a: llm-analysis is not importable here and LLM_ANALYSIS_PYTHON is unset"
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [python, "-m", "benchmarks.llm_analysis_baseline"], input=json.dumps(points), capture_output=True, text=True, cwd=root, timeout=600
    )
    if done.returncode:
        return {}, f"n/a: {python} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return json.loads(done.stdout), f"llm-analysis via {python}"


def error(predicted_bytes: int | str | None, measured: int) -> float | None:
    return (predicted_bytes - measured) / measured if isinstance(predicted_bytes, int) else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def summary(rows: list[dict], key: str) -> dict:
    errors = [abs(r[key]) for r in rows if r[key] is not None]
    if not errors:
        return {"points": 0, "median_abs_error": None, "worst_abs_error": None}
    return {"points": len(errors), "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}


ROLES = ("modelling", "held_out")


def row_of(point: dict, lla: dict) -> dict:
    measured = point["measured"]["bytes"]
    ours, quantity = predicted(point)
    planned, margin = planner(point)
    formula = megatron_formula(point)
    r = point["run"]
    plan = f"dp{r['dp']} tp{r['tp']} pp{r['pp']}" + (f" vpp{r['vpp']}" if r.get("vpp") else "") + f" mb{r['micro_batch']} z{r['zero']}"
    return {
        "id": point["id"],
        "role": point["role"],
        "framework": point["framework"],
        "model": point["model"].get("name", ""),
        "plan": plan + f" {r['recompute']} {r.get('attention')}",
        "measured_kind": point["measured"]["kind"],
        "measured_bytes": measured,
        "compared": quantity,
        "frenzy_bytes": ours,
        "megatron_formula_bytes": formula,
        "llm_analysis_bytes": lla.get(point["id"]),
        "frenzy_error": error(ours, measured),
        "planner_bytes": planned,
        "planner_error": error(planned, measured),
        "margin_bytes": margin,
        "planner_with_margin_covers": planned + margin >= measured,
        "megatron_formula_error": error(formula, measured),
        "llm_analysis_error": error(lla.get(point["id"]), measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/memory_published.json"))
    args = parser.parse_args()
    points = json.loads(args.data.read_text())["points"]
    lla, lla_source = llm_analysis(points)
    rows = [row_of(p, lla) for p in points]
    print(f"{'id':<56} {'role':<9} {'framework':<9} {'plan':<36} {'measured GiB':>12} {'frenzy':>8} {'megatron-f':>10} {'llm-anal.':>9}")
    for r in rows:
        print(
            f"{r['id']:<56} {r['role']:<9} {r['framework']:<9} {r['plan']:<36} {r['measured_bytes'] / GIB:>12.2f}"
            f" {_pct(r['frenzy_error']):>8} {_pct(r['megatron_formula_error']):>10} {_pct(r['llm_analysis_error']):>9}"
        )
    print(f"\nllm-analysis: {lla_source}")
    result = {
        "points": len(rows),
        "llm_analysis_source": lla_source,
        "per_framework": per_framework(rows),
        "per_quantity": per_quantity(rows),
        "rows": rows,
    }
    for framework, roles in result["per_framework"].items():
        for role in ROLES:
            for key, s in roles[role].items():
                if key == "points":
                    continue
                figures = f"median |error| {s['median_abs_error']:.1%}   worst |error| {s['worst_abs_error']:.1%}" if s["points"] else "n/a"
                print(f"{framework:<9} {role:<9} {key:<17} n={s['points']:<3} {figures}")
    for kind, s in result["per_quantity"].items():
        print(
            f"{kind:<13} n={s['points']:<3} median |error| {s['median_abs_error']:.1%}   worst |error| {s['worst_abs_error']:.1%}"
            f"   low {s['low']}   planner low {s['planner_low']}   planner + margin low {s['planner_with_margin_low']}"
        )
    write_result(result, args.json)


def per_quantity(rows: list[dict]) -> dict:
    """Per measured quantity (max_allocated, max_reserved), all roles: frenzy's median and worst
    |error|, how many predictions were below the measurement, and how many planner's figures
    without and with the default margin."""
    out = {}
    for kind in sorted({r["measured_kind"] for r in rows}):
        subset = [r for r in rows if r["measured_kind"] == kind]
        out[kind] = summary(subset, "frenzy_error") | {
            "low": sum(r["frenzy_error"] < 0 for r in subset),
            "planner_low": sum(r["planner_error"] < 0 for r in subset),
            "planner_with_margin_low": sum(not r["planner_with_margin_covers"] for r in subset),
        }
    return out


def per_framework(rows: list[dict]) -> dict:
    """Per framework and role (in-sample ``modelling``, ``held_out``): each predictor's median and worst |error|."""
    out = {}
    for framework in sorted({r["framework"] for r in rows}):
        out[framework] = {}
        for role in ROLES:
            subset = [r for r in rows if r["framework"] == framework and r["role"] == role]
            stats = {key: summary(subset, f"{key}_error") for key in ("frenzy", "megatron_formula", "llm_analysis")}
            out[framework][role] = {"points": len(subset), **stats}
    return out


if __name__ == "__main__":
    sys.exit(main())
