"""The simulator's inputs, read from the public traces in their own formats:

- ElasticFlow job traces (``job_id,submission_time,num_iteration,model_name,deadline,batch_size,
  num_gpu,duration``; times in seconds);
- Sia's workloads (``name,time,application,num_replicas,batch_size``: siasosp23/artifacts,
  ``sia-simulator/workloads``; submission seconds, requested GPUs, global batch), whose jobs run
  at a throughput table's speeds (scheduling/throughput.py);
- the Alibaba GPU cluster v2023 node list (``sn,cpu_milli,memory_mib,gpu,model``), as a
  ClusterSpec. Its undisclosed types (G1, G2, G3) must be declared by the caller; V100M16 and
  V100M32 are the catalog's V100-16GB and V100-32GB.

Bad rows fail with the file, line and column; nothing is skipped silently.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError

from frenzy_prefect.errors import FrenzyError, describe_validation_error
from frenzy_prefect.spec.cluster import ClusterSpec, Node
from frenzy_prefect.spec.gpu import GpuType


def shared_traces() -> Path:
    """The team's public traces: $FRENZY_TRACES, or shared/data/traces beside a parent directory
    of this package (where the team's checkouts live)."""
    if os.environ.get("FRENZY_TRACES"):
        return Path(os.environ["FRENZY_TRACES"])
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "data" / "traces").is_dir():
            return parent / "shared" / "data" / "traces"
    return Path("/nonexistent/shared/data/traces")


ALIBABA_ALIASES = {"V100M16": "V100-16GB", "V100M32": "V100-32GB"}


class TraceJob(BaseModel):
    """One job of an ElasticFlow trace, as recorded."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    submission_time: NonNegativeInt
    num_iteration: PositiveInt
    model_name: str
    deadline: NonNegativeInt
    batch_size: PositiveInt
    num_gpu: PositiveInt
    duration: NonNegativeInt


def read_rows(
    path: Path,
    integer_columns: tuple[str, ...],
    text_columns: tuple[str, ...],
    number_columns: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> Iterator[tuple[int, dict[str, object]]]:
    """(line number, row) with the integer columns parsed as non-negative whole numbers and the
    number columns as non-negative floats; an ``optional`` column absent from the header, or left
    blank, reads None. A missing column, or a value that is not such a number, raises naming the
    file, line and column."""
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise FrenzyError(f"cannot read {path}: {exc.strerror}") from None
    with handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [c for c in (*text_columns, *integer_columns, *number_columns) if c not in header and c not in optional]
        if missing:
            raise FrenzyError(f"{path}:1: missing column(s) {', '.join(missing)}; the header is {', '.join(header)}")
        for row in reader:
            line = reader.line_num
            parsed: dict[str, object] = {c: (row[c] or "").strip() for c in text_columns}
            for column in (*integer_columns, *number_columns):
                text = (row.get(column) or "").strip()
                if not text and column in optional:
                    parsed[column] = None
                    continue
                parsed[column] = _number(path, line, column, text, whole=column in integer_columns)
            yield line, parsed


def _number(path: Path, line: int, column: str, text: str, whole: bool) -> float | int:
    try:
        number = float(text)
    except ValueError:
        raise FrenzyError(f"{path}:{line}: column {column}: {text!r} is not a number") from None
    if not math.isfinite(number):
        raise FrenzyError(f"{path}:{line}: column {column}: {text} is not a finite number")
    if number < 0:
        raise FrenzyError(f"{path}:{line}: column {column}: {text} is negative")
    if not whole:
        return number
    if not number.is_integer():
        raise FrenzyError(f"{path}:{line}: column {column}: {text} is not a whole number")
    return int(number)


def load_trace(path: str | Path) -> list[TraceJob]:
    """An ElasticFlow job trace, in submission order."""
    integers = ("submission_time", "num_iteration", "deadline", "batch_size", "num_gpu", "duration")
    jobs = _validated_jobs(Path(path), TraceJob, integers, ("job_id", "model_name"), "job_id", "job ids")
    return sorted(jobs, key=lambda j: (j.submission_time, j.job_id))


def _validated_jobs(path: Path, kind: type[BaseModel], integers: tuple[str, ...], texts: tuple[str, ...], key: str, keys: str) -> list:
    """Every row of ``path`` as a ``kind``; a row that is not one, or whose ``key`` repeats an
    earlier row's, fails naming the file and line; a file without rows fails too."""
    jobs, seen = [], {}
    for line, row in read_rows(path, integers, texts):
        try:
            job = kind.model_validate(row)
        except ValidationError as exc:
            raise FrenzyError(f"{path}:{line}: {describe_validation_error(exc)}") from None
        value = getattr(job, key)
        if value in seen:
            raise FrenzyError(f"{path}:{line}: column {key}: {value!r} repeats line {seen[value]}; {keys} must be unique")
        seen[value] = line
        jobs.append(job)
    if not jobs:
        raise FrenzyError(f"{path} holds no jobs")
    return jobs


class SiaJob(BaseModel):
    """One job of a Sia workload, as recorded (an optional ``category`` column is not read)."""

    model_config = ConfigDict(frozen=True)

    name: str
    time: NonNegativeInt
    application: str
    num_replicas: PositiveInt
    batch_size: PositiveInt


SIA_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


def is_sia_workload(path: str | Path) -> bool:
    """Whether ``path``'s header is a Sia workload's (else it is read as an ElasticFlow trace)."""
    try:
        with Path(path).open(newline="") as handle:
            header = next(csv.reader(handle), [])
    except OSError as exc:
        raise FrenzyError(f"cannot read {path}: {exc.strerror}") from None
    return set(SIA_COLUMNS) <= {c.strip() for c in header}


def load_sia_workload(path: str | Path) -> list[SiaJob]:
    """A Sia workload, in submission order."""
    jobs = _validated_jobs(Path(path), SiaJob, ("time", "num_replicas", "batch_size"), ("name", "application"), "name", "job names")
    return sorted(jobs, key=lambda j: (j.time, j.name))


def load_alibaba_nodes(path: str | Path, gpu_types: dict[str, GpuType] | None = None) -> ClusterSpec:
    """The GPU nodes of an Alibaba v2023 node list (rows without GPUs are left out, being CPU
    nodes), each as a node of its GPU type; ``gpu_types`` declares types the catalog lacks."""
    path = Path(path)
    nodes = []
    for _, row in read_rows(path, ("gpu",), ("sn", "model")):
        if row["gpu"] == 0:
            continue
        model = str(row["model"])
        nodes.append(Node(name=str(row["sn"]), host=str(row["sn"]), gpu_type=ALIBABA_ALIASES.get(model, model), gpu_count=row["gpu"]))
    if not nodes:
        raise FrenzyError(f"{path} lists no GPU nodes")
    try:
        return ClusterSpec(name=path.stem, nodes=nodes, gpu_types=gpu_types or {})
    except ValidationError as exc:
        raise FrenzyError(f"{path}: {describe_validation_error(exc)}") from None


def load_gpu_types(path: str | Path) -> dict[str, GpuType]:
    """A YAML/JSON mapping of type name to GpuType fields, for types the catalog lacks."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise FrenzyError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise FrenzyError(f"{path} is not valid YAML/JSON: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise FrenzyError(f"{path} must map GPU type names to their fields (name, memory_bytes, half_tflops, fp32_tflops, link_gbps, ...)")
    try:
        return {name: GpuType.model_validate({"name": name, **(fields or {})}) for name, fields in data.items()}
    except ValidationError as exc:
        raise FrenzyError(f"{path}: {describe_validation_error(exc)}") from None


def load_cluster(path: str | Path, gpu_types: str | Path | None = None) -> ClusterSpec:
    """An Alibaba v2023 node-list CSV, or the project's YAML/JSON cluster file; ``gpu_types``
    names a file declaring types neither the catalog nor the cluster file has."""
    declared = load_gpu_types(gpu_types) if gpu_types else {}
    if Path(path).suffix.lower() == ".csv":
        return load_alibaba_nodes(path, declared)
    try:
        return ClusterSpec.from_file(path, declared)
    except ValidationError as exc:
        raise FrenzyError(f"{path}: {describe_validation_error(exc)}") from None


def replicate(spec: ClusterSpec, copies: int) -> ClusterSpec:
    """``spec``'s nodes ``copies`` times over, each copy's names and hosts suffixed ``-r0`` to
    ``-r{copies - 1}`` (the Alibaba v2023 list 10 times: 12,130 nodes, 62,120 GPUs)."""
    if copies < 1:
        raise FrenzyError(f"replicate needs at least 1 copy of the cluster; got {copies}")
    if copies == 1:
        return spec
    nodes = [n.model_copy(update={"name": f"{n.name}-r{k}", "host": f"{n.host}-r{k}"}) for k in range(copies) for n in spec.nodes]
    return spec.model_copy(update={"nodes": nodes, "name": f"{spec.name}-x{copies}"})
