"""`frenzy estimate`, `measure`, `calibrate` and `presets`: a plan's per-GPU memory, predicted or
measured (the same options, the same schema: docs/architecture.md, Contracts), and the estimator's calibration."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

from frenzy_prefect.cli.common import ATTENTION, MASTER_WEIGHTS, echo_json, gpu_type, plain_table
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.frameworks import FsdpOptions, MegatronOptions, check_framework
from frenzy_prefect.memory.report import Ranks, estimated_ranks, group_ranks, memory_report
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.units import gib, significant


class MemoryOptions:
    """The options ``estimate`` and ``measure`` share, validated once (the same options, the same
    schema: docs/architecture.md, Contracts): the model, the plan and the workload."""

    def __init__(
        self, model, plan: ParallelPlan, global_batch, seq_len, precision, optimizer, gpu, attention="flash", master_weights=False
    ):
        from frenzy_prefect.profiling.model import resolve_model

        self.spec = resolve_model(model, seq_len=seq_len)
        self.seq_len_default = seq_len is None
        self.plan = plan
        if plan.stage_layers is not None:
            plan.layer_split(self.spec.layers)  # names what would be accepted
        self.work = Workload(
            global_batch=self.plan.dp * self.plan.micro_batch if global_batch is None else global_batch,
            seq_len=self.spec.max_seq_len if seq_len is None else seq_len,
            precision=precision,
            optimizer={"name": optimizer},
            attention=attention,
            master_weights=master_weights,
        )
        self.gpu = gpu_type(gpu) if gpu else None  # the plan itself is checked by estimate/measure
        self.framework = "frenzy"
        self.options: MegatronOptions | FsdpOptions | None = None
        self.reserved: dict[int, int] = {}  # rank -> the caching allocator's reserved peak, where known
        self.notes: list[str] = []
        self.measured = False

    def setting(self) -> list[str]:
        """The plan, and the workload, a line each."""
        w = self.work
        precision = f"{w.precision} weights, fp32 masters" if w.master_weights else w.precision
        return [f"plan {self.plan.label()}", f"{precision}, {w.attention} attention, seq_len {w.seq_len}"]

    def text_notes(self) -> list[str]:
        """The notes, led by the default sequence length's (text only: --json has seq_len_default)."""
        default = [f"seq_len {self.work.seq_len}: the model's max_seq_len (--seq-len sets the one you train at)"]
        return (default if self.seq_len_default else []) + self.notes

    def emit(self, groups: list[Ranks], as_json: bool) -> None:
        out = memory_report(
            self.spec, self.plan, self.work, groups, framework=self.framework, gpu=self.gpu, measured=self.measured, reserved=self.reserved
        )
        if as_json:
            echo_json(out | {"seq_len_default": self.seq_len_default, "notes": self.notes})
            return
        what = "measured" if self.measured else f"as {self.framework} runs it"
        # The figure first, then what it is of: a line each, not one of 150-210 characters.
        typer.echo(f"peak {gib(out['peak_bytes'])} GiB per GPU ({what}): {self.spec.name}, {self.spec.parameters:,} parameters")
        for line in self.setting():
            typer.echo(f"  {line}")
        if self.gpu is None and not self.measured:
            typer.echo("  figure: tensor bytes only (no CUDA context, NCCL buffers or allocator fragmentation; --gpu adds an overhead)")
        else:
            typer.echo(f"  figure: {out['figure']}")
        for note in self.text_notes():
            typer.echo(f"  {note}")
        table = plain_table(caption="GiB per GPU; ranks that hold the same bytes share a row")
        columns = ("ranks", "stage", "params", "grads", "optimizer", "activations", "other") + (("reserved",) if self.reserved else ())
        for column in columns:
            table.add_column(column, justify="right")
        for g in groups:
            b = g.breakdown
            ranks = str(g.first) if g.count == 1 else f"{g.first}-{g.last}"
            reserved = (gib(self.reserved[g.first]),) if self.reserved else ()
            table.add_row(ranks, str(g.stage), *map(gib, (b.params, b.grads, b.optimizer, b.activations, b.other)), *reserved)
        Console().print(table)


MODEL_ARG = typer.Argument(..., help="Preset name or path/URI of an HF-style config.json.")
DP = typer.Option(1, "--dp", help="Data-parallel replicas.")
TP = typer.Option(1, "--tp", help="Tensor-parallel ranks (must divide heads, kv_heads, hidden and ffn).")
PP = typer.Option(1, "--pp", help="Pipeline stages (1F1B), at most the number of layers.")
STAGE_LAYERS = typer.Option(
    None, "--stage-layers", help="Layers of each pipeline stage, e.g. 3,1 (an uneven split, as across GPU types); default: even."
)
MICRO_BATCH = typer.Option(1, "--micro-batch")
GLOBAL_BATCH = typer.Option(None, "--global-batch", help="Default: dp * micro-batch.")
SEQ_LEN = typer.Option(
    None, "--seq-len", help="Tokens per sequence. Default: the model's max_seq_len (stated in the output; 131072 for Llama 3.1)."
)
ZERO = typer.Option(0, "--zero", help="ZeRO stage 0-3.")
RECOMPUTE = typer.Option("none", "--recompute", help="none, selective or full.")
PRECISION = typer.Option("bf16", "--precision", help="fp32, bf16 or fp16.")
OPTIMIZER = typer.Option("adamw", "--optimizer", help="adamw, adam or sgd.")
GPU = typer.Option(
    None, "--gpu", help="GPU type: estimate adds its calibrated overhead (default: tensors only); measure only checks the name."
)
JSON = typer.Option(False, "--json")
FRAMEWORK = typer.Option(
    "frenzy",
    "--framework",
    help="Whose execution of the plan: frenzy (this engine), megatron (Megatron-LM) or fsdp (torchtitan FSDP2); measure: frenzy.",
)
SEQUENCE_PARALLEL = typer.Option(
    None,
    "--sequence-parallel/--no-sequence-parallel",
    help="megatron: Megatron's sequence parallelism (default: on when tp > 1, as Megatron runs are usually launched).",
)
VPP = typer.Option(None, "--vpp", help="megatron: model chunks per pipeline rank (interleaved 1F1B); default: plain 1F1B.")
RESERVED = typer.Option(
    False,
    "--reserved",
    help="estimate: also what PyTorch's caching allocator would reserve, each stage's step traced on fake tensors and "
    "replayed through the allocator's rules (seconds; plans without DDP, DeepSpeed or FSDP2). measure: reported on CUDA anyway.",
)
CE_FUSION = typer.Option(
    False,
    "--cross-entropy-fusion",
    help="megatron: --cross-entropy-loss-fusion (its torch.compile'd backward keeps an fp32 copy of the softmax).",
)


def _memory_command(per_rank: Callable[[MemoryOptions], list[Ranks]], doc: str) -> Callable[..., None]:
    """``estimate`` or ``measure``: the same options and the same schema (docs/architecture.md, Contracts)."""

    def command(
        model: str = MODEL_ARG,
        dp: int = DP,
        tp: int = TP,
        pp: int = PP,
        stage_layers: str | None = STAGE_LAYERS,
        micro_batch: int = MICRO_BATCH,
        global_batch: int | None = GLOBAL_BATCH,
        seq_len: int | None = SEQ_LEN,
        zero: int = ZERO,
        recompute: str = RECOMPUTE,
        precision: str = PRECISION,
        optimizer: str = OPTIMIZER,
        gpu: str | None = GPU,
        as_json: bool = JSON,
        framework: str = FRAMEWORK,
        attention: str = ATTENTION,
        master_weights: bool = MASTER_WEIGHTS,
        sequence_parallel: bool | None = SEQUENCE_PARALLEL,
        vpp: int | None = VPP,
        cross_entropy_fusion: bool = CE_FUSION,
        reserved: bool = RESERVED,
    ) -> None:
        plan = ParallelPlan(
            dp=dp, tp=tp, pp=pp, stage_layers=_stage_layers(stage_layers), micro_batch=micro_batch, zero=zero, recompute=recompute
        )
        w = MemoryOptions(model, plan, global_batch, seq_len, precision, optimizer, gpu, attention, master_weights)
        _framework(w, framework, MegatronOptions(sequence_parallel=sequence_parallel, vpp=vpp, cross_entropy_fusion=cross_entropy_fusion))
        groups = per_rank(w)
        if reserved and not w.measured:
            _replay_allocator(w)
        w.emit(groups, as_json)

    command.__doc__ = doc
    return command


def _stage_layers(text: str | None) -> tuple[int, ...] | None:
    """``--stage-layers 3,1`` as (3, 1); FrenzyError naming what is accepted."""
    if text is None:
        return None
    try:
        split = tuple(int(part) for part in text.split(","))
    except ValueError:
        split = ()
    if not split or min(split) < 1:
        raise FrenzyError(f"--stage-layers takes each stage's layers, at least one each, as 3,1 (one per --pp stage); got {text!r}")
    return split


def _framework(w: MemoryOptions, framework: str, options: MegatronOptions) -> None:
    """The framework and its options, checked: ``options`` (sequence parallelism, vpp, the fused loss) are Megatron's."""
    check_framework(framework)
    w.framework = framework
    if framework != "frenzy" and w.plan.stage_layers is not None:
        raise FrenzyError(f"--stage-layers is this engine's (--framework frenzy); {framework} is estimated with an even split")
    if framework != "frenzy" and w.work.master_weights:
        raise FrenzyError(f"--master-weights is this engine's choice (--framework frenzy); {framework} keeps its own fp32 masters")
    if framework != "megatron":
        if options != MegatronOptions():
            raise FrenzyError(
                f"--sequence-parallel, --vpp and --cross-entropy-fusion apply to --framework megatron only (got --framework {framework})"
            )
        if framework == "fsdp" and w.plan.tp > 1:
            w.notes.append("fsdp: tp as torchtitan's 2D parallelism (sequence-parallel norms, loss parallel)")
        return
    w.options = options
    sp = options.sp(w.plan.tp)
    default = " (default with tp > 1)" if options.sequence_parallel is None and sp else ""
    chunks = f"vpp {options.vpp}" if options.vpp else "plain 1F1B"
    fused = "; fused cross entropy" if options.cross_entropy_fusion else ""
    w.notes.append(f"megatron: sequence parallelism {'on' if sp else 'off'}{default}; {chunks}{fused}")
    w.notes.append(f"megatron: distributed optimizer {'on (zero=1)' if w.plan.zero == 1 else 'off (zero=0)'}")


def _estimated(w: MemoryOptions) -> list[Ranks]:
    return estimated_ranks(w.spec, w.plan, w.work, w.gpu, framework=w.framework, options=w.options)


def _replay_allocator(w: MemoryOptions) -> None:
    """Each rank's reserved peak, from its stage's traced step replayed through the caching allocator."""
    from frenzy_prefect.memory.calibration import default_calibration
    from frenzy_prefect.training.allocation_trace import replayed  # torch: imported here
    from frenzy_prefect.training.measure import Measurement

    if w.framework != "frenzy":
        raise FrenzyError(f"--reserved traces this project's engine: --framework frenzy only (got {w.framework})")
    workspace = default_calibration().for_gpu(w.gpu).workspace_bytes if w.gpu else 0
    stages = {r.stage: r.reserved_bytes for r in replayed(Measurement(model=w.spec, plan=w.plan, work=w.work), workspace_bytes=workspace)}
    per_stage = w.plan.dp * w.plan.tp
    w.reserved = {rank: stages[rank // per_stage] for rank in range(w.plan.gpus)}
    w.notes.append(
        "reserved: each stage's first rank traced on fake tensors and replayed through PyTorch's caching allocator"
        + (f" with {w.gpu.name}'s cuBLAS workspaces" if w.gpu else " (no GPU type: no library workspaces)")
        + "; the GPU also holds the CUDA context"
        + (" and NCCL's buffers" if w.plan.gpus > 1 else "")
    )


def _measured(w: MemoryOptions) -> list[Ranks]:
    from frenzy_prefect.training.measure import Measurement, measure  # torch: imported here, never by `import frenzy_prefect.cli`

    if w.framework != "frenzy":
        raise FrenzyError(f"measure runs this project's engine: --framework frenzy only (got {w.framework}); estimate takes megatron, fsdp")
    w.measured = True
    ranks = measure(Measurement(model=w.spec, plan=w.plan, work=w.work))
    w.reserved = {m.rank: m.cuda_max_reserved for m in ranks if m.cuda_max_reserved is not None}
    return group_ranks(w.plan, ((m.rank, m.breakdown) for m in ranks))


estimate = _memory_command(_estimated, "Predicted per-GPU peak memory of one plan, per rank and by category.")
measure = _memory_command(
    _measured,
    """The same plan executed here by the training engine (one process per GPU, three steps), with
    each rank's measured peak by category (MemTracker; on CUDA also the allocator's peaks).""",
)


# What `frenzy calibrate` runs on one GPU: sizes from a few hundred MB to tens of GB, both
# precisions, with and without recomputation, so the fit sees overhead and fragmentation apart.
CALIBRATION_RUNS = [
    ("gpt2-small", 4, 1024, "fp32", "none"),
    ("gpt2-small", 8, 1024, "bf16", "none"),
    ("gpt2-small", 16, 1024, "bf16", "full"),
    ("gpt2-medium", 4, 1024, "bf16", "none"),
    ("gpt2-medium", 8, 1024, "bf16", "selective"),
    ("gpt2-large", 4, 1024, "bf16", "full"),
]


def calibrate(
    gpu: str | None = typer.Option(None, "--gpu", help="The GPU type this machine has (a catalog name); with --from-runs, only that type."),
    out: Path | None = typer.Option(None, "--out", help="Calibration file to update; default: $FRENZY_CALIBRATION or the packaged one."),
    from_runs: str | None = typer.Option(
        None,
        "--from-runs",
        help="A calibration store (JSON path or URI: a cluster's runs, or scripts/gpu-check's): show and refit it.",
    ),
) -> None:
    """Measure this machine's GPU on a fixed set of runs, fit its overhead and fragmentation, and
    store them in the calibration file the estimator loads; prints the error before and after.
    With --from-runs, no GPU: what a calibration store's runs measured, and what they teach."""
    if from_runs is not None:
        _calibrate_from_runs(from_runs, gpu, out)
        return
    if gpu is None:
        raise FrenzyError("--gpu TYPE names this machine's GPU (or give --from-runs STORE)")
    gpu_type_ = gpu_type(gpu)
    import torch

    from frenzy_prefect.memory import peak_bytes
    from frenzy_prefect.memory.calibration import ENV, PACKAGED, Calibration, GpuConstants, fit, save
    from frenzy_prefect.profiling.model import resolve_model
    from frenzy_prefect.training.measure import Measurement
    from frenzy_prefect.training.measure import measure as run

    if not torch.cuda.is_available():
        raise FrenzyError("calibration measures a GPU and this machine has no CUDA device; the constants stay documented assumptions")
    path = out or os.environ.get(ENV) or PACKAGED
    current = Calibration.load(path) if Path(path).exists() else Calibration()
    runs, measured = [], []
    for model, batch, seq_len, precision, recompute in CALIBRATION_RUNS:
        spec, plan_ = resolve_model(model, seq_len=seq_len), ParallelPlan(micro_batch=batch, recompute=recompute)
        work = Workload(global_batch=batch, seq_len=seq_len, precision=precision)
        (rank,) = run(Measurement(model=spec, plan=plan_, work=work))
        runs.append((spec, plan_, work))
        measured.append(rank.device_peak)
        typer.echo(f"{model} mb={batch} seq={seq_len} {precision} recompute={recompute}: device peak {gib(rank.device_peak)} GiB")

    def predicted(calibration: Calibration) -> list[int]:
        return [peak_bytes(spec, plan_, work, gpu=gpu_type_, calibration=calibration) for spec, plan_, work in runs]

    tensors = predicted(Calibration(gpus={gpu: GpuConstants()}))
    constants = fit(tensors, measured, note=f"{len(measured)} runs of `frenzy calibrate` on {torch.cuda.get_device_name()}")
    save(current.model_copy(update={"gpus": current.gpus | {gpu: constants}}), path)
    for label, calibration in (("before (catalog assumption)", Calibration()), ("after (fitted)", Calibration(gpus={gpu: constants}))):
        errors = sorted(abs(p - m) / m for p, m in zip(predicted(calibration), measured, strict=True))
        typer.echo(f"{label}: median error {errors[len(errors) // 2]:.2%}, worst {errors[-1]:.2%}")
    typer.echo(f"{gpu}: overhead {gib(constants.overhead_bytes)} GiB, fragmentation x{constants.fragmentation:.4f} -> {path}")


def _calibrate_from_runs(source: str, gpu: str | None, out: Path | None) -> None:
    """Each run of the store, predicted against measured, then per GPU type what is learned."""
    from frenzy_prefect.allocator.learning import learn
    from frenzy_prefect.memory.calibration import ENV, PACKAGED, Calibration, save
    from frenzy_prefect.memory.run_records import CalibrationStore

    store = CalibrationStore.load(source)
    table = plain_table(caption=f"calibration store of {store.cluster}: {len(store.records)} runs, GiB and seconds")
    for column in ("run", "gpu", "model", "plan", "tensors predicted", "tensors measured", "GPU held", "step predicted", "step measured"):
        table.add_column(column, justify="right")
    for r in store.records:
        rank = r.worst_rank
        held = rank.device_bytes
        table.add_row(
            r.source,
            r.gpu_type or "cpu",
            r.model.name,
            r.plan.label(),
            gib(rank.predicted_tensors_bytes),
            gib(rank.measured_tensors_bytes) if rank.measured_tensors_bytes is not None else "-",
            gib(held) if held is not None else "-",
            significant(r.predicted_step_s) if r.predicted_step_s else "-",
            significant(r.measured_step_s) if r.measured_step_s else "-",
        )
    Console().print(table)
    types = sorted({r.gpu_type for r in store.records if r.gpu_type and (gpu is None or r.gpu_type == gpu)})
    path = out or os.environ.get(ENV) or PACKAGED
    learned = [learn(store, gpu_type(name)) for name in types]
    for result in learned:
        typer.echo(f"{result.gpu.name}: {result.summary()}")
    fitted = {r.gpu.name: r.constants for r in learned if r.constants is not None}
    if fitted and out is not None:
        current = Calibration.load(path) if Path(path).exists() else Calibration()
        save(current.model_copy(update={"gpus": current.gpus | fitted}), path)
        typer.echo(f"fitted {', '.join(fitted)} -> {path}")


def presets() -> None:
    """The model presets and their sizes."""
    from frenzy_prefect.profiling.model import PRESETS

    table = plain_table()
    for column in ("preset", "parameters", "layers", "hidden", "heads", "vocab"):
        table.add_column(column, justify="left" if column == "preset" else "right")
    for name, spec in PRESETS.items():
        n = spec.parameters
        size = f"{significant(n / 1e9)} B" if n >= 1e9 else f"{significant(n / 1e6)} M"
        table.add_row(name, size, *map(str, (spec.layers, spec.hidden, spec.heads, spec.vocab_size)))
    Console().print(table)
