"""Slurm as the source of truth for a cluster's GPUs: its nodes, their typed GPU GRES, and how
many of those are free now, read from Slurm's own CLI (``scontrol -d show node -o``).

A node's GRES ``gpu:a10:2`` becomes a Node of 2 x A10: Slurm's type name is mapped to a GPU type
of the catalog (or of the cluster's declared ``gpu_types``) by name, ignoring case and
punctuation (``a100_80gb`` is A100-80GB); a type that matches none is refused, naming it. What
is free now is what GresUsed (``gpu:a10:1(IDX:0)``) leaves, on nodes that take jobs: jobs that
are not ours are respected. Slurm picks the indices itself, so only the counts are kept.
Standard library and the core only: no Prefect, no pyslurm (it must match libslurm's version).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.catalog import GPU_CATALOG, catalog_type
from frenzy_prefect.spec.cluster import ClusterSpec, Node
from frenzy_prefect.spec.gpu import GpuType

CLI_TIMEOUT_S = 30.0
# Node states (the base state, before any '+FLAG') in which a node takes new jobs.
_SCHEDULABLE = {"IDLE", "MIXED", "ALLOCATED", "COMPLETING"}
_UNSCHEDULABLE_FLAGS = {
    "DRAIN",
    "DRAINING",
    "DRAINED",
    "NOT_RESPONDING",
    "POWERED_DOWN",
    "POWERING_DOWN",
    "MAINTENANCE",
    "FAIL",
    "REBOOT_ISSUED",
}
_GRES = re.compile(r"^(?P<name>[^:(]+)(?::(?P<type>[^:(]+))?(?::(?P<count>\d+))?(?:\((?P<extra>[^)]*)\))?$")


def slurm_env(conf: Path | None) -> dict[str, str]:
    """The environment Slurm's commands run in: this one, with ``SLURM_CONF`` when given."""
    return {**os.environ, "SLURM_CONF": str(conf)} if conf else dict(os.environ)


def run_cli(argv: list[str], conf: Path | None = None, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    """A Slurm command's stdout (``env``: its environment, else this one with ``conf``);
    FrenzyError with Slurm's own message in one line when it fails."""
    try:
        done = subprocess.run(  # in a session of its own: a signal to its caller's process group is not its failure
            argv, env=env or slurm_env(conf), input=stdin, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, start_new_session=True
        )
    except FileNotFoundError:
        raise FrenzyError(f"{argv[0]} not found: the slurm launcher needs Slurm's client commands on the worker's PATH") from None
    except subprocess.TimeoutExpired:
        raise FrenzyError(f"{argv[0]} did not answer within {CLI_TIMEOUT_S:.0f} s (is slurmctld up?)") from None
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or f"exit {done.returncode}"
        raise FrenzyError(f"{' '.join(argv[:3])} failed: {message}")
    return done.stdout


def parse_records(text: str) -> list[dict[str, str]]:
    """``scontrol -o`` output: one record a line of ``Key=Value`` words (values with spaces,
    such as OS=, are cut at the space: none of the fields read here has one)."""
    records = []
    for line in text.splitlines():
        record: dict[str, str] = {}
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep:
                record[key] = value
        if record:
            records.append(record)
    return records


@dataclass(frozen=True)
class Gres:
    name: str  # gpu
    type: str | None  # a10, or None for untyped GRES
    count: int
    indices: tuple[int, ...] = ()  # (IDX:0-1), in GresUsed and a job's GRES


def parse_indices(spec: str) -> tuple[int, ...]:
    """``0-1,3`` -> (0, 1, 3); ``N/A`` -> ()."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def parse_gres(value: str) -> list[Gres]:
    """``gpu:a10:2(S:0),gpu:h100:1(IDX:0)`` -> the GRES it names (``(null)`` -> none)."""
    out = []
    for item in re.split(r",(?![^(]*\))", value):  # commas outside parentheses
        m = _GRES.match(item.strip())
        if not m or item in ("(null)", "N/A"):
            continue
        extra = m["extra"] or ""
        idx = extra.split("IDX:", 1)[1] if "IDX:" in extra else ""
        type_, count = m["type"], m["count"]
        if count is None and type_ is not None and type_.isdigit():  # gpu:2, untyped
            type_, count = None, type_
        out.append(Gres(m["name"], type_, int(count) if count is not None else 1, parse_indices(idx)))
    return out


def _gpus(value: str) -> list[Gres]:
    return [g for g in parse_gres(value) if g.name == "gpu"]


@dataclass(frozen=True)
class SlurmNode:
    name: str
    addr: str
    state: str
    partitions: tuple[str, ...]
    gpu_type: str | None  # Slurm's GRES type of the node's GPUs
    gpus: int
    gpus_used: int

    @property
    def schedulable(self) -> bool:
        base, *flags = self.state.upper().split("+")
        return base in _SCHEDULABLE and not set(flags) & _UNSCHEDULABLE_FLAGS

    @property
    def gpus_free(self) -> int:
        return max(0, self.gpus - self.gpus_used) if self.schedulable else 0

    @property
    def address(self) -> str:
        return self.addr


def node_of(record: dict[str, str]) -> SlurmNode:
    gres, used = _gpus(record.get("Gres", "")), _gpus(record.get("GresUsed", ""))
    types = sorted({g.type for g in gres if g.type})
    if len(types) > 1:
        raise FrenzyError(f"Slurm node {record['NodeName']} has GPUs of several types ({', '.join(types)}); a node has one type here")
    return SlurmNode(
        name=record["NodeName"],
        addr=record.get("NodeAddr") or record["NodeName"],
        state=record.get("State", "UNKNOWN"),
        partitions=tuple(p for p in record.get("Partitions", "").split(",") if p),
        gpu_type=types[0] if types else None,
        gpus=sum(g.count for g in gres),
        gpus_used=sum(g.count for g in used),
    )


def read_nodes(conf: Path | None = None, names: list[str] | None = None) -> list[SlurmNode]:
    """Slurm's nodes (all, or ``names``), in Slurm's order, with what their GPUs hold now."""
    argv = ["scontrol", "-d", "-o", "show", "node"] + ([",".join(names)] if names else [])
    return [node_of(r) for r in parse_records(run_cli(argv, conf)) if "NodeName" in r]


def cluster_from_slurm(
    nodes: list[SlurmNode], name: str, partition: str | None = None, gpu_types: dict[str, GpuType] | None = None
) -> ClusterSpec:
    """A ClusterSpec of the GPU nodes (of ``partition``); FrenzyError naming the Slurm GPU types
    that match no known type, or saying that no node has typed GPUs."""
    chosen = [n for n in nodes if n.gpus and (partition is None or partition in n.partitions)]
    where = f" in partition {partition!r}" if partition else ""
    if not chosen:
        raise FrenzyError(f"no Slurm node{where} has GPU GRES (gres.conf's Name=gpu); found nodes: {', '.join(n.name for n in nodes)}")
    untyped = [n.name for n in chosen if n.gpu_type is None]
    if untyped:
        raise FrenzyError(f"Slurm nodes {', '.join(untyped)} have untyped GPUs; give them Type= in gres.conf so a GPU type is known")
    known = {**GPU_CATALOG, **(gpu_types or {})}
    mapped = {n.gpu_type: catalog_type(n.gpu_type, known) for n in chosen}  # type: ignore[arg-type]
    unknown = sorted(t for t, m in mapped.items() if m is None)
    if unknown:
        raise FrenzyError(
            f"Slurm GPU type(s) {', '.join(unknown)}{where} match no known GPU type (known: {', '.join(sorted(known))}); "
            "declare them in a GPU types file (--gpu-types) named as Slurm names them"
        )
    return ClusterSpec(
        name=name,
        nodes=[Node(name=n.name, host=n.addr, gpu_type=mapped[n.gpu_type], gpu_count=n.gpus) for n in chosen],  # type: ignore[index]
        gpu_types=gpu_types or {},
    )


def free_counts(nodes: list[SlurmNode]) -> dict[str, int]:
    """GPUs free now on each node, as Slurm books them."""
    return {n.name: n.gpus_free for n in nodes}


def narrow_to_slurm(free: dict[str, list[int]], counts: dict[str, int]) -> dict[str, list[int]]:
    """The pool's free GPUs (its reservations' indices) cut to what Slurm has free on each node:
    a GPU held by a job that is not ours is not planned on. A node Slurm does not know has none."""
    return {node: gpus[: counts.get(node, 0)] for node, gpus in free.items()}


def capacity_shortfall(cluster: ClusterSpec, gpu_type: str, gpus: int, nodes: list[SlurmNode]) -> str | None:
    """Why Slurm can never hold ``gpus`` GPUs of ``gpu_type`` on the cluster's nodes (counting
    every GPU, busy or not, of nodes that take jobs), or None when it can: such a run is refused
    at once rather than waiting for GPUs that do not exist."""
    slurm = {n.name: n for n in nodes}
    wanted = [n.name for n in cluster.nodes if n.gpu_type == gpu_type]
    have = {name: slurm[name].gpus for name in wanted if name in slurm and slurm[name].schedulable}
    if sum(have.values()) >= gpus:
        return None
    missing = [name for name in wanted if name not in slurm]
    down = [name for name in wanted if name in slurm and not slurm[name].schedulable]
    why = "".join([f"; not Slurm nodes: {', '.join(missing)}" if missing else "", f"; down or drained: {', '.join(down)}" if down else ""])
    return f"the run needs {gpus} x {gpu_type} but Slurm has {sum(have.values())} on cluster {cluster.name!r}'s {gpu_type} nodes{why}"
