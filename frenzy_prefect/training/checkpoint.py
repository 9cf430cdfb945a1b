"""Sharded checkpoints in object storage through torch.distributed.checkpoint (DCP), and resume.

Layout under a run's checkpoint prefix (``TrainingJob.checkpoint_prefix``)::

    head.json          which generation of the run's attempts holds it, and the committed
                       checkpoints, newest first (manifest.Head; written only by a conditional
                       write of the version read: fence.py)
    step-000120/       DCP's files: one ``__<rank>_0.distcp`` per rank that holds pieces, ``.metadata``
                       manifest.json  written last: the step, plan, model, generation, time and losses so far
    step-000135-g2/    a checkpoint by generation 2 (the first generation's carry no suffix)

Every rank writes its own pieces (``FsspecWriter`` over s3fs) into its generation's directory;
``dcp.save`` returns on every rank once the coordinator has written ``.metadata``, after all
ranks' files; then a barrier, rank 0 writes the manifest and commits the checkpoint: a
conditional write of the head that still names its generation (``fence.commit``). A checkpoint
is resumed from only once committed: one whose commit was refused (a newer generation holds the
run) or torn by a crash is never read. Resume walks the committed ones, newest first, and takes
the first intact one (DCP's ``.metadata`` and a manifest that reads; ``manifest``, without
torch): one that is not is named in the run's log and skipped for the one before. The head
keeps the last ``keep`` committed; after its commit, rank 0 deletes the directories of its own
and older generations that the head no longer names (older checkpoints, torn and refused
writes), never a newer generation's.

What is saved is keyed by the WHOLE model's names and shapes (``Decoder`` naming, global layer
indices), each rank describing which pieces of each tensor it holds (``Pieces``), so that DCP
reshards on load: another dp, tp, pp or ZeRO stage reads the pieces it needs. Replicated tensors
(dp replicas, norms on every tp rank, a tied embedding's two copies) are written once, as DCP
deduplicates identical pieces. Saved: the fp32 weights (the masters, with master weights), the
optimizer's per-parameter states under the same names (Adam's exp_avg, exp_avg_sq and step),
the LR schedule and the fp16 loss scaler. The data sampler needs no state: a step's batch is a
function of (seed, step) (data.replica_batches), so the step in the manifest is its position.

Modes: plain/DDP, tp, pp, ZeRO-1 (each replica saves the states it steps, and the masters it
owns), ZeRO-2 (DeepSpeed's own API gathers and scatters each parameter's fp32 weight and states
over its partitions: ``deepspeed.utils.safe_get/set_full_*``) and ZeRO-3 (FSDP2's shards:
DTensor offsets).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.spec.layout import padded_vocab
from frenzy_prefect.spec.request import OptimizerSettings
from frenzy_prefect.storage import Deadline, filesystem, filesystem_options, reaching, write_bound_s, write_bytes
from frenzy_prefect.torch_private import FsspecReader, FsspecWriter, flatten_state_dict
from frenzy_prefect.training.decoder import stage_layers, tp_split
from frenzy_prefect.training.engine import Engine
from frenzy_prefect.training.fence import Fence, Fenced, commit
from frenzy_prefect.training.manifest import MANIFEST, Head, Manifest, generation_of, is_step_dir, step_uri

BYTES_PER_PARAMETER = 12  # the most a checkpoint keeps of a parameter: its fp32 weight and two optimizer states


@dataclass
class Pieces:
    """This rank's pieces of one tensor of the whole model: (offsets in it, local view) each. DCP
    writes and reads them through its checkpointable protocol (the dunder methods below)."""

    shape: torch.Size
    pieces: list[tuple[torch.Size, torch.Tensor]]

    def size(self) -> torch.Size:
        return self.shape

    def at(self, offsets: torch.Size) -> torch.Tensor:
        return next(t for o, t in self.pieces if o == offsets)

    def __create_write_items__(self, fqn: str, _obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.shape,
                ),
            )
            for offsets, t in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.size()) for offsets, t in self.pieces]


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's own first allocates meta tensors, and replaces by None every object
        # it does not know (Pieces): flatten without it.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_tensor(index)


def _whole_name(engine: Engine, name: str) -> str:
    """A parameter's name in the whole model: a stage's block i is layer (first layer + i); a tied
    head on the last stage is the embedding it copies."""
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        first = stage_layers(engine.plan.layer_split(engine.spec.layers), engine.stage).start
        return f"blocks.{first + int(index)}.{rest}"
    if name == "head.weight" and engine.spec.tied_embeddings:
        return "tok_emb.weight"
    return name


def _placing(engine: Engine, name: str, param: torch.Tensor):
    """A function from a tensor shaped as ``param`` (the weight, or one of its optimizer states) to
    its Pieces of the whole model's tensor."""
    if isinstance(param, DTensor):  # FSDP2's shard (ZeRO-3 runs no tp)
        (chunk,) = param.__create_chunk_list__()
        return lambda t: Pieces(param.shape, [(torch.Size(chunk.offsets), t.to_local())] if chunk.sizes.numel() else [])
    tp = engine.groups.tp if engine.groups else None
    rest = name.split(".", 2)[2] if name.startswith("blocks.") else name
    split = (0, [padded_vocab(engine.spec, engine.plan.tp)]) if rest in ("tok_emb.weight", "head.weight") else tp_split(rest, engine.spec)
    if tp is None or tp.size == 1 or split is None:
        return lambda t: Pieces(t.shape, [(torch.Size([0] * t.dim()), t)])
    dim, widths = split
    shape = list(param.shape)
    shape[dim] = sum(widths)
    slots = []  # (offset in the whole tensor, offset in the local one, length) along dim, per part
    for i, width in enumerate(widths):
        part = width // tp.size
        slots.append((sum(widths[:i]) + tp.rank * part, sum(w // tp.size for w in widths[:i]), part))

    def pieces(t: torch.Tensor) -> Pieces:
        out = []
        for whole_at, local_at, length in slots:
            offsets = [0] * t.dim()
            offsets[dim] = whole_at
            out.append((torch.Size(offsets), t.narrow(dim, local_at, length)))
        return Pieces(torch.Size(shape), out)

    return pieces


def _inner_optimizer(engine: Engine) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeRO-1: its share)."""
    return engine.optimizer.optim if isinstance(engine.optimizer, ZeroRedundancyOptimizer) else engine.optimizer


def _fresh_states(engine: Engine) -> None:
    """Optimizer states for every tensor this rank steps, for DCP to load into (torch's optimizers
    create them at their first step)."""
    inner = _inner_optimizer(engine)
    for group in inner.param_groups:
        for t in group["params"]:
            if not inner.state[t]:
                inner.state[t] = _fresh_state(engine.settings, t)


def _fresh_state(settings: OptimizerSettings, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state torch's optimizer keeps for a tensor shaped as ``like``, before any step."""
    if settings.name in ("adam", "adamw"):
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(like), "exp_avg_sq": torch.zeros_like(like)}
    return {"momentum_buffer": torch.zeros_like(like)} if settings.momentum > 0 else {}


def _deepspeed_partitions(engine: Engine) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """DeepSpeed's ZeRO-2: the optimizer it wraps, and the flat fp32 partitions it steps, their
    states created if no step has run yet and linked to the parameters (what DeepSpeed does after
    its first step), so that ``safe_set_full_optimizer_state`` can load into them."""
    zero = engine.deepspeed.optimizer
    inner, partitions = zero.optimizer, list(zero.single_partition_of_fp32_groups)
    for flat in partitions:
        if not inner.state[flat]:
            inner.state[flat] = _fresh_state(engine.settings, flat)
    zero._lazy_init_hp_params_optimizer_state()
    return inner, partitions


def _deepspeed_state(engine: Engine) -> tuple[dict, dict, list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]]]:
    """(model, optimizer states, gathered) of a ZeRO-2 rank: every parameter's fp32 weight
    (DeepSpeed keeps it whole on every replica) and its optimizer states gathered over the
    data-parallel partitions (the replicas' equal pieces are written once); ``gathered``: each
    parameter with those whole states, for a load to scatter back. A collective: every rank calls
    it, parameters in the same order."""
    from deepspeed.utils import safe_get_full_optimizer_state

    inner, partitions = _deepspeed_partitions(engine)
    step = inner.state[partitions[0]].get("step")
    kinds = [k for k, t in inner.state[partitions[0]].items() if t.dim()]  # not the step count
    model, optim, gathered = {}, {}, []
    for name, p in engine.model.named_parameters():
        key, place = _whole_name(engine, name), _placing(engine, name, p)
        states = {k: safe_get_full_optimizer_state(p, k) for k in kinds}
        gathered.append((p, states))
        model[key] = place(p.detach())
        for k, t in states.items():
            optim.setdefault(k, {})[key] = place(t)
        if step is not None:
            optim.setdefault("step", {})[key] = step
    return model, optim, gathered


def _load_deepspeed(engine: Engine, gathered) -> None:
    """After DCP loaded into the weights and ``gathered``'s states in place: scatter them into
    DeepSpeed's fp32 partitions, and give every partition the loaded step count."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    inner, partitions = _deepspeed_partitions(engine)
    for p, states in gathered:
        safe_set_full_fp32_param(p, p.detach())
        for k, t in states.items():
            safe_set_full_optimizer_state(p, t, k)
    for flat in partitions[1:]:
        if "step" in inner.state[flat]:
            inner.state[flat]["step"] = inner.state[partitions[0]]["step"].clone()


def training_state(engine: Engine) -> tuple[dict, list | None]:
    """This rank's share of the training state, keyed by the whole model's names (see module
    doc), and (ZeRO-2) the gathered states a load scatters back (``_deepspeed_state``)."""
    if engine.deepspeed is not None:
        model, optim, gathered = _deepspeed_state(engine)
        return {"model": model, "optim": optim, "schedule": engine.schedule.state_dict()}, gathered
    masters = {id(p): master for p, master in engine.masters}
    inner = _inner_optimizer(engine)
    stepped = {id(t) for group in inner.param_groups for t in group["params"]}
    model: dict[str, object] = {}
    optim: dict[str, dict[str, object]] = {}
    for name, p in engine.model.named_parameters():
        key, place = _whole_name(engine, name), _placing(engine, name, p)
        weight = masters.get(id(p), None if engine.main_grads else p)  # ZeRO-1 masters: their owner's
        if weight is None:
            continue
        model[key] = place(weight.detach())
        if id(weight) in stepped:
            for state, value in inner.state[weight].items():
                optim.setdefault(state, {})[key] = value if value.dim() == 0 else place(value)
    state = {"model": model, "optim": optim, "schedule": engine.schedule.state_dict()}
    if engine.scaler.is_enabled():
        state["scaler"] = engine.scaler.state_dict()
    return state, None


def save(engine: Engine, fence: Fence, step: int, losses: list[float], keep: int) -> tuple[str, float]:
    """Every rank writes its pieces of step ``step``'s checkpoint into its generation's directory,
    then rank 0 the manifest, commits it (``fence.commit``: Fenced on every rank if a newer
    generation holds the run) and prunes to the last ``keep``: all within one bound
    (storage.write_bound_s), which every rank's storage work respects, so that against a stalled
    endpoint every rank fails by then and none waits in a collective for another. Returns (its
    URI, seconds taken)."""
    uri, started = step_uri(fence.prefix, step, fence.generation), time.perf_counter()
    deadline = Deadline(uri, write_bound_s(BYTES_PER_PARAMETER * engine.spec.parameters), "writing the checkpoint")
    _on_rank0(lambda: deadline.run(lambda: _remove(uri)))  # a torn write of this step by this generation
    writer = _BoundedWriter(uri, deadline, **filesystem_options(uri))
    with _storage_failures(uri, deadline.started):
        dcp.save(training_state(engine)[0], storage_writer=writer, planner=_SavePlanner())
    _barrier()  # every rank's files are written
    seconds = time.perf_counter() - started

    def committed() -> None:
        done = Manifest(
            step=step,
            plan=engine.plan,
            model=engine.spec,
            written_at=datetime.now(UTC),
            save_s=seconds,
            losses=losses,
            generation=fence.generation,
        )
        deadline.run(lambda: write_bytes(f"{uri}/{MANIFEST}", done.model_dump_json(indent=2).encode()))
        head = deadline.run(lambda: commit(fence, step, keep))
        deadline.run(lambda: prune(fence, head))

    _on_rank0(committed)
    return uri, seconds


class _BoundedWriter(FsspecWriter):
    """DCP's fsspec writer, its storage work (the directory, this rank's files, the coordinator's
    metadata) within the save's Deadline."""

    def __init__(self, uri: str, deadline: Deadline, **options) -> None:
        super().__init__(uri, sync_files=False, **options)
        self.deadline = deadline

    def prepare_local_plan(self, plan):
        prepare = super().prepare_local_plan
        return self.deadline.run(lambda: prepare(plan))

    def write_data(self, plan, planner):
        write = super().write_data
        return self.deadline.run(lambda: write(plan, planner))

    def finish(self, metadata, results) -> None:
        finish = super().finish
        self.deadline.run(lambda: finish(metadata, results))


def _on_rank0(action: Callable[[], None]) -> None:
    """``action`` on rank 0 while the other ranks wait; if it fails, every rank raises (rank 0
    its own error), so that none is left waiting in a collective rank 0 skipped."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error = None
    if rank0:
        try:
            action()
        except Exception as exc:
            error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = [None if error is None else (isinstance(error, Fenced), f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(said, src=0)
        if said[0] is not None and not rank0:
            fenced, message = said[0]
            raise Fenced(f"rank {dist.get_rank()} stops: {message}") if fenced else RuntimeError(f"rank 0 failed: {message}")
    if error is not None:
        raise error


def load(engine: Engine, uri: str, manifest: Manifest) -> None:
    """Load the checkpoint at ``uri`` into ``engine``, whatever plan wrote it."""
    if manifest.model != engine.spec:
        raise FrenzyError(f"the checkpoint at {uri} is of model {manifest.model.name}, not of {engine.spec.name}")
    rows, ours = padded_vocab(manifest.model, manifest.plan.tp), padded_vocab(engine.spec, engine.plan.tp)
    if rows != ours:
        raise FrenzyError(
            f"the checkpoint at {uri} pads the vocabulary to {rows} rows (tp={manifest.plan.tp}) and this plan to {ours}: "
            "resume with a tp whose padding matches"
        )
    if engine.deepspeed is None:
        _fresh_states(engine)
    state, gathered = training_state(engine)
    with _storage_failures(uri):
        dcp.load(state, storage_reader=FsspecReader(uri, **filesystem_options(uri)), planner=_LoadPlanner())
    if gathered is not None:
        _load_deepspeed(engine, gathered)
    engine.schedule.load_state_dict(state["schedule"])
    for group, lr in zip(engine.optimizer.param_groups, engine.schedule.get_last_lr(), strict=True):
        group["lr"] = lr
    if "scaler" in state:
        engine.scaler.load_state_dict(state["scaler"])
    if engine.main_grads:
        engine._refresh_half_weights()  # the half weights from the loaded masters (ZeRO-1: from their owners)


def prune(fence: Fence, head: Head) -> None:
    """After ``fence``'s commit of ``head``: delete the checkpoint directories of its generation
    and older ones that ``head`` does not name (older checkpoints, torn or refused writes),
    never a newer generation's. A newer generation takes over the very list ``head`` names, so
    a prune that overlaps its claim deletes nothing it reads."""
    named = {step_uri(fence.prefix, c.step, c.generation).rsplit("/", 1)[-1] for c in head.committed}
    fs, path = filesystem(fence.prefix)
    with reaching(fence.prefix):
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=False, refresh=True)]
    for name in names:
        if is_step_dir(name) and name not in named and generation_of(name) <= fence.generation:
            _remove(f"{fence.prefix.rstrip('/')}/{name}")


@contextmanager
def _storage_failures(uri: str, started: float | None = None) -> Iterator[None]:
    """DCP gathers the ranks' failures into one CheckpointException (a BaseException, which
    ``together`` would not catch): the first rank's own exception instead, a stalled or
    unreachable endpoint as a StorageUnreachable naming the URI and the time since ``started``
    (``storage.reaching``)."""
    started = time.monotonic() if started is None else started
    try:
        yield
    except CheckpointException as exc:
        first, _ = next(iter(exc.failures.values()))
        with reaching(uri, started):
            raise first from None


def _remove(uri: str) -> None:
    fs, path = filesystem(uri)
    with reaching(uri):
        if fs.exists(path):
            fs.rm(path, recursive=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
