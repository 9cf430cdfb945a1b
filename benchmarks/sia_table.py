"""Sia's performance model written out as the throughput table `frenzy simulate --throughput-table`
reads (benchmarks/data/sia/throughput.csv), so that HAS and Sia's simulator replay the same jobs
at the same speeds.

Run with the Python of Sia's artifact (siasosp23/artifacts, `sia-simulator/`: Python 3.11 with
its pins, `scripts/sia-setup`), from inside that directory:

    cd $SIA_ARTIFACT/sia-simulator && $SIA_PYTHON /path/to/benchmarks/sia_table.py > throughput.csv

Every number is computed by the artifact's own functions (applications.py), the way its Gavel
port predicts a fixed-batch job's iteration time (gavel.py, ``predict_throughput``): replicas
packed onto nodes, the global batch split evenly with gradient accumulation where a replica's
profiled batch is exceeded, ``step + accum x (step - sync)`` from the measured profiles, times the
calibration slowdown (simulator_config.SLOWDOWNS). Where the profiles do not cover a placement
(NaN) there is no row: that many GPUs of that type cannot run the job, which is how Sia models
memory. Per (model, batch) the row also carries what Sia charges a job for starting
(``rescale_time``) and its work at that fixed batch (``job_steps``: iterations to its target
progress, each worth its statistical gain; Sia's job.py with batch-size tuning off).

Not imported by the project: it needs the artifact's modules on the path."""

import csv
import math
import os
import sys

sys.path.insert(0, os.getcwd())  # the artifact's modules, from where it is run
import simulator_config as cfg  # noqa: E402
from applications import APPLICATIONS  # noqa: E402

TYPES = {"aws": "T4", "rtx": "RTX2080Ti", "dgx-ext": "A100-40GB"}  # Sia's cluster names -> ours
SHAPES = [("cifar10", 2048), ("cifar10", 4096), ("bert", 384), ("deepspeech2", 320), ("deepspeech2", 640),
          ("imagenet", 1600), ("imagenet", 3200), ("yolov3", 64)]  # fmt: skip  # every (model, batch) in its workloads


def iteration_s(app, placement: tuple, global_batch: int) -> float | None:
    """Seconds per iteration of ``global_batch`` on ``placement`` (GPUs per node), as gavel.py predicts it."""
    n = sum(placement)
    local = math.ceil(global_batch / n - 1e-8)
    accum = math.ceil(local / app.get_max_local_bsz(placement) - 1e-8) - 1
    if n == 1:
        accum = max(1, accum)
    atomic = min(math.ceil(local / (accum + 1) - 1e-8), int(app.max_batch_size / (n * (accum + 1))))
    try:
        step, sync = app.get_throughput(placement, atomic)
    except AssertionError:  # outside the profiled hull
        return None
    if not step > 0:
        return None
    return float(step + (step - sync) * accum)


def packed(n: int, per_node: int) -> tuple:
    placement = ()
    while sum(placement) < n:
        placement = (*placement, min(n - sum(placement), per_node))
    return placement


def job_steps(app, global_batch: int) -> int:
    """Iterations a fixed-batch job runs in Sia: each epoch's progress over the batch's statistical gain."""
    steps = 0.0
    for epoch in range(app.get_completion_epoch(global_batch) + 1):
        sqr, var = app.get_grad_stats(global_batch, epoch)
        scale = global_batch / app.init_batch_size
        steps += (app.get_progress(epoch + 1) - app.get_progress(epoch)) / ((var + sqr) / (var / scale + sqr))
    return round(steps)


def main() -> None:
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(["model", "global_batch", "gpu_type", "gpus", "step_s", "spread_step_s", "startup_s", "job_steps"])
    for name, ours in TYPES.items():
        per_node = cfg.cluster_ngpus_per_node[name]
        total = per_node * cfg.cluster_nnodes[name]
        for model, batch in SHAPES:
            app = APPLICATIONS[name][model]
            steps = job_steps(APPLICATIONS[cfg.calibrate_cluster][model], batch)
            for n in range(1, total + 1):
                inside = iteration_s(app, packed(n, per_node), batch)
                if inside is None:
                    continue
                split = iteration_s(app, (n - n // 2, n // 2), batch) if 2 <= n <= per_node else inside
                spread = inside if split is None else split
                slowdown = cfg.SLOWDOWNS[model]
                out.writerow([model, batch, ours, n, f"{inside * slowdown:.6f}", f"{spread * slowdown:.6f}", app.rescale_time, steps])


if __name__ == "__main__":
    main()
