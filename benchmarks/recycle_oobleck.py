"""Side by side with Oobleck's own artifact simulator (SOSP'23, SymbioticLab/Oobleck, branch
sosp23-artifact, tools/simulator/): our simulator on the artifact's traces and settings, next to
the artifact's Oobleck figures.

Traces (``benchmarks/data/oobleck_artifact/traces``, copied from the artifact, MIT licence): 30
nodes at the start, one leaving every 6 h, 3 h, 1 h, 30 min or 10 min until 15 are left (the run
stops at the last event, so training sees 30 down to 16 nodes), and the EC2 p3 spot trace scaled
to 15-30 nodes. Models: GPT-3 6.7B (1,024 samples per step) and BERT-large (8,192), with the
artifact's own step time at each node count (its ``*_simulate_step_delta`` tables, 0 where its
throughput is 0: cannot run) as our step-time table, and its reconfiguration pause (10 s / 2 s)
as ``oobleck_reconfigure_s``; every other knob at its default (join delay 45 s as the artifact).
Our grid is dp x pp = 30 workers (5 x 6 and 3 x 10; ReCycle's re-routed iterations from the
planner with 16 micro-batches per pipeline, never faster than the table's time for the alive
workers). Throughput is over the training span (first iteration's start to the last iteration's
end), which is what the artifact reports as average performance.

The artifact's figures come from running its simulator, unmodified, from a fetched snapshot:
``--run-artifact DIR`` (DIR: the snapshot's tools/simulator) re-runs it with the settings of its
eval_tput_vs_freq.py and eval_gcp_ec2.py and rewrites ``artifact.json`` (figures, step times,
provenance); otherwise the recorded file is used.

    python -m benchmarks.recycle_oobleck [--grids 5x6,3x10] [--json PATH] [--run-artifact DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import logging
from pathlib import Path

from benchmarks import write_result
from frenzy_prefect.recycle.iteration import StepTimeTable, from_step_time_table
from frenzy_prefect.recycle.knobs import Knobs
from frenzy_prefect.recycle.policies import make_policy
from frenzy_prefect.recycle.replay import simulate
from frenzy_prefect.recycle.traces import load_failure_trace

DATA = Path(__file__).parent / "data" / "oobleck_artifact"
ARTIFACT = DATA / "artifact.json"
MODELS = {"GPT-3-6_7b": 10.0, "BERT-large": 2.0}  # the artifact's local_rendezvous_timeout_delta, s (see Knobs)
TRACES = ["6h", "3h", "1h", "30m", "10m", "scale_p3-trace"]
POLICIES = ["oobleck", "recycle", "adaptive", "checkpoint_restart", "ceiling"]  # ceiling: free switches, no policy above it
MICROBATCHES = 16
COMMIT = "796655600207cfb59fae5804740ff720f7428fc5"  # branch sosp23-artifact when fetched


def run_artifact(simulator_dir: Path) -> dict:
    """Run the artifact's Oobleck simulator on every model and trace; also read its step time at
    each node count by calling its own step-time method."""
    spec = importlib.util.spec_from_file_location("oobleck_simulator", simulator_dir / "oobleck_simulator.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    logging.getLogger(module.__name__).setLevel(logging.WARNING)
    models, figures = {}, []
    for model in MODELS:
        sim = module.Simulator(seed=None, start_hour=0, model=model)
        steps = {}
        for nodes in range(15, 31):
            sim.spot_instances = {f"node{k}": module.SpotInstance(f"node{k}", 0) for k in range(nodes)}
            for instance in sim.spot_instances.values():
                instance.set_running()
            sim.simulate_step_delta()
            steps[str(nodes)] = 0.0 if sim.step_delta >= 1e12 else sim.step_delta / 1000  # its 1e12 ms: throughput 0
        models[model] = {"samples_per_step": sim.samples_per_step, "step_s_by_nodes": steps}
        for trace in TRACES:
            path = simulator_dir / "traces" / ("scaled/" if trace.startswith("scale") else "") / f"{trace}.csv"
            # eval_tput_vs_freq.py lines 120-131 (utils.py: seed None, steps_per_run 200000, hard stop);
            # eval_gcp_ec2.py lines 137-148 for the spot trace
            steps_per_run = 2_000_000_000 if trace.startswith("scale") else 200_000
            with path.open() as f, contextlib.redirect_stdout(io.StringIO()) as printed:
                sim = module.Simulator(
                    seed=None,
                    start_hour=0,
                    generate_addition_probabilities=None,
                    removal_probability=None,
                    generate_graphs=False,
                    spot_instance_trace=f,
                    model=model,
                    steps_per_run=steps_per_run,
                    time_hard_stop=True,
                )
                result = sim.simulate()
            figures.append(
                {
                    "model": model,
                    "trace": trace,
                    "samples_per_s": result.average_performance,
                    "steps": result.num_steps_complete,
                    "reconfigurations": result.num_fatal_failures,
                    "time_breakdown": printed.getvalue().split(),
                }
            )
    return {
        "source": {
            "repository": "https://github.com/SymbioticLab/Oobleck",
            "branch": "sosp23-artifact",
            "commit": COMMIT,
            "simulator": "tools/simulator/oobleck_simulator.py, unmodified",
            "command": "python -m benchmarks.recycle_oobleck --run-artifact <snapshot>/tools/simulator",
            "settings": "eval_tput_vs_freq.py (frequency traces) and eval_gcp_ec2.py (scale_p3-trace) Simulator arguments",
            "measure": "Result.average_performance: samples over the span from the first rendezvous to the last step",
        },
        "models": models,
        "oobleck": figures,
    }


def ours(model: str, spec: dict, trace: str, grid: tuple[int, int]) -> dict:
    dp, pp = grid
    table = StepTimeTable({int(n): s for n, s in spec["step_s_by_nodes"].items()})
    times = from_step_time_table(table, dp=dp, pp=pp, microbatches=MICROBATCHES)
    knobs = Knobs(oobleck_reconfigure_s=MODELS[model])
    nodes = load_failure_trace(DATA / "traces" / f"{trace}.csv")
    out = {}
    for policy in POLICIES:
        r = simulate(times, nodes, make_policy(policy), samples_per_iteration=spec["samples_per_step"], knobs=knobs)
        out[policy] = {"span": r.span_throughput, "window": r.throughput, "events": {k: n for k, n in r.counts.items() if k != "start"}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grids", default="5x6,3x10", help="dp x pp grids of 30 workers, comma-separated")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/recycle_oobleck.json"))
    parser.add_argument("--run-artifact", type=Path, help="the artifact snapshot's tools/simulator: re-run it and rewrite artifact.json")
    args = parser.parse_args()
    if args.run_artifact:
        ARTIFACT.write_text(json.dumps(run_artifact(args.run_artifact), indent=1) + "\n")
        print(f"artifact figures: {ARTIFACT}")
    artifact = json.loads(ARTIFACT.read_text())
    grids = [tuple(int(x) for x in g.split("x")) for g in args.grids.split(",")]
    figure = {(f["model"], f["trace"]): f["samples_per_s"] for f in artifact["oobleck"]}

    rows = []
    print(f"{'model':<11}{'trace':<16}{'grid':<6}{'artifact':>9}" + "".join(f"{p:>20}" for p in POLICIES) + f"{'recycle/art':>12}")
    for model, spec in artifact["models"].items():
        for trace in TRACES:
            for grid in grids:
                result = ours(model, spec, trace, grid)
                theirs = figure[(model, trace)]
                row = {"model": model, "trace": trace, "grid": f"{grid[0]}x{grid[1]}", "artifact_oobleck": theirs, **result}
                rows.append(row)
                cells = "".join(f"{result[p]['span']:>11.3f} ({result[p]['span'] / theirs:>5.2f}x)" for p in POLICIES)
                print(f"{model:<11}{trace:<16}{row['grid']:<6}{theirs:>9.3f}{cells}{result['recycle']['span'] / theirs:>12.2f}")
    write_result(
        {
            "artifact_source": artifact["source"],
            "microbatches": MICROBATCHES,
            "measure": "samples/s over the training span; 'window' over the trace's whole span",
            "knobs": {m: Knobs(oobleck_reconfigure_s=s).model_dump() for m, s in MODELS.items()},
            "rows": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
