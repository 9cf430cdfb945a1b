"""The caching allocator replayed (frenzy_prefect/caching_allocator.py) and the engine's step traced on fake
tensors (training/allocation_trace.py): the allocator's rules one by one, the trace against the
engine's measured peak on real ranks, and `frenzy estimate --reserved`. What the replay predicts
against a real GPU's ``max_memory_reserved`` is benchmarks/reserved_replay.py's (docs/memory.md)."""

from __future__ import annotations

import json
import statistics

import pytest

from frenzy_prefect.caching_allocator import LARGE_BUFFER, SMALL_BUFFER, CachingAllocator, replay, round_size, segment_size
from frenzy_prefect.errors import FrenzyError
from frenzy_prefect.memory.calibration import RESERVED_OVER_TENSORS
from frenzy_prefect.spec.plan import ParallelPlan
from frenzy_prefect.spec.workload import Workload
from frenzy_prefect.training.allocation_trace import replayed, tensor_peak, trace_rank
from frenzy_prefect.training.measure import Measurement
from tests.support.cli import frenzy
from tests.support.stack import ROOT
from tests.support.training import NANO

MIB = 1 << 20


def test_requests_are_rounded_and_segments_sized_by_the_allocators_rules():
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert segment_size(MIB) == SMALL_BUFFER  # up to 1 MiB: a 2 MiB small-pool segment
    assert segment_size(MIB + 512) == segment_size(10 * MIB - 512) == LARGE_BUFFER  # 1-10 MiB: 20 MiB, shared
    assert segment_size(10 * MIB + 1) == 12 * MIB  # larger: rounded up to 2 MiB


def test_a_request_takes_the_smallest_cached_block_that_holds_it_and_splits_only_what_is_worth_keeping():
    a = CachingAllocator()
    small = [a.malloc(1000) for _ in range(3)]  # three 1024 B blocks of one 2 MiB segment
    assert (a.reserved, a.allocated) == (SMALL_BUFFER, 3 * 1024)
    first = a.malloc(4 * MIB)  # a 20 MiB segment, split: 16 MiB stay cached
    second = a.malloc(3 * MIB)  # from the cached 16 MiB: nothing new reserved
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER and second == first + 4 * MIB
    a.free(first)  # cached blocks now: 4 MiB (first's) and 13 MiB (the tail)
    assert a.malloc(4 * MIB - 512) == first  # best fit: the 4 MiB block, not the tail
    # 512 B remain of that block: the large pool keeps no remainder of 1 MiB or less, so the
    # whole block is handed out and counted allocated, as torch does.
    assert a.allocated == 3 * 1024 + 4 * MIB + 3 * MIB
    for block in small:
        a.free(block)
    assert a.allocated == 7 * MIB and a.reserved == a.peak_reserved  # freed blocks stay cached: nothing is returned


def test_freed_neighbours_merge_so_a_later_request_reuses_the_whole_segment():
    events = [(1, 12 * MIB), (2, 12 * MIB), (1, -1), (2, -1), (3, 24 * MIB)]
    assert replay(events).reserved == 48 * MIB  # two 12 MiB segments do not merge: 24 MiB needs a third...
    assert replay(events[:4] + [(3, 12 * MIB)]).reserved == 24 * MIB  # ...but each is reused whole
    merged = replay([(1, 30 * MIB), (1, -1), (2, 12 * MIB), (3, 12 * MIB), (2, -1), (3, -1), (4, 30 * MIB)])
    assert merged.reserved == 30 * MIB  # split halves of one segment merge back


def test_expandable_segments_grow_one_segment_by_pages_and_extend_a_free_tail():
    a = replay([(1, 11 * MIB), (2, 11 * MIB)], expandable_segments=True)
    assert a.reserved == 2 * LARGE_BUFFER  # 22 MiB mapped in 20 MiB pages
    a = replay([(1, 11 * MIB), (2, 11 * MIB), (2, -1), (3, 30 * MIB)], expandable_segments=True)
    assert a.reserved == 3 * LARGE_BUFFER  # the freed tail (29 MiB) grows by one page instead of a new 30 MiB
    assert replay([(1, 11 * MIB), (2, 11 * MIB), (2, -1), (3, 30 * MIB)]).reserved == 12 * MIB + 12 * MIB + 30 * MIB


def test_workspaces_are_allocated_before_the_step_and_held_throughout():
    measurement = Measurement(model=NANO, plan=ParallelPlan(), work=Workload(global_batch=1, seq_len=32, precision="fp32"))
    bare, with_workspaces = (trace_rank(measurement, 0, workspace_bytes=w) for w in (0, 64 * MIB))
    assert with_workspaces[:2] == [(0, 32 * MIB), (1, 32 * MIB)]
    assert tensor_peak(with_workspaces) == tensor_peak(bare) + 64 * MIB


def test_plans_whose_reduction_needs_real_buffers_are_refused_with_what_can_be_traced():
    work = Workload(global_batch=4, seq_len=32, precision="fp32")
    for plan in (ParallelPlan(dp=2), ParallelPlan(dp=2, zero=3)):
        with pytest.raises(FrenzyError, match=r"cannot trace .*: .*; plans with dp = 1, or ZeRO-1, can be traced"):
            replayed(Measurement(model=NANO, plan=plan, work=work))


def test_estimate_reserved_reports_each_ranks_reserved_peak_beside_its_tensors():
    options = ("--pp", "2", "--micro-batch", "1", "--global-batch", "4", "--seq-len", "64")
    done = frenzy("estimate", "gpt-nano", *options, "--reserved", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [r["rank"] for r in data["per_rank"]] == [0, 1]
    for r in data["per_rank"]:
        assert r["reserved_bytes"] >= r["peak_bytes"] > 0
    assert data["reserved_bytes"] == max(r["reserved_bytes"] for r in data["per_rank"])
    assert any("caching allocator" in note for note in data["notes"])
    refused = frenzy("estimate", "gpt-nano", "--dp", "2", "--reserved", "--seq-len", "64")
    assert refused.returncode != 0 and "cannot trace" in refused.stderr and "Traceback" not in refused.stderr


def test_the_quoted_replay_figures_and_the_planners_allocator_figure_are_what_the_benchmark_measured():
    root = ROOT
    result = json.loads((root / "benchmarks/results/reserved_replay.json").read_text())
    docs = (root / "docs/memory.md").read_text()
    rows = result["rows"]
    assert sum(abs(r["reserved_error"]) <= 0.0032 for r in rows) == 4 and len(rows) == 8  # "within 0.32% on four of eight"
    planned = sorted(r["device_planned_error"] for r in rows)
    assert planned[0] > 0, "the planner's figure fell below what the GPU held"
    assert f"+{planned[0]:.1%} to +{planned[-1]:.1%}, median +{statistics.median(planned):.1%}" in docs
    # The planner's figure per recomputation mode bounds every replayed configuration of that mode.
    for mode, largest in result["summary"]["largest_reserved_over_tensors_by_recompute"].items():
        assert RESERVED_OVER_TENSORS[mode] >= largest, mode
