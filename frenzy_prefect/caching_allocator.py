"""PyTorch's CUDA caching allocator, replayed: how much a GPU *reserves* for a sequence of tensor
allocations and frees, by the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.x), so that
MARP predicts what the GPU holds, not only the live tensors.

The rules, with the allocator's names:

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``, ``round_size``);
- requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones from the large pool;
- a request first takes the smallest cached free block of its pool that holds it (best fit,
  lowest address on ties: ``get_free_block``'s ``lower_bound`` over (size, address));
- with none, a new segment is allocated (``get_allocation_size``): 2 MiB (``kSmallBuffer``) for
  a small request, 20 MiB (``kLargeBuffer``) for one under 10 MiB (``kMinLargeAlloc``), else
  the request rounded up to 2 MiB (``kRoundLarge``);
- the block found is split when what remains is worth keeping (``should_split``): at least 512 B
  in the small pool, more than 1 MiB in the large pool (any 512 B with expandable segments);
- a freed block merges with free neighbours of its segment (``free_block``) and stays cached:
  segments are returned to the driver only by ``empty_cache`` or an out-of-memory retry, which
  a step that fits never reaches; so the reserved peak is the segments' total at the end.

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, torchtitan's
default) each pool is one segment whose end grows by whole pages (2 MiB for the small pool, 20 MiB
for the large: ``ExpandableSegment``'s ``segment_size``) when no cached block fits, a free block
at the end being extended rather than left behind.

One stream and one device, as the training engine allocates; ``max_split_size`` and
``roundup_power2_divisions`` at their defaults.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a segment for a 1-10 MiB request
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(size: int) -> int:
    """``round_size``: the bytes a request of ``size`` takes in a block."""
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a (rounded) request that no cached block holds."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Pool:
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # (size, address), sorted: best fit by bisect
    end: int = 0  # expandable segments: the mapped length of the pool's one segment


class CachingAllocator:
    """The allocator's block bookkeeping without the memory: ``malloc`` returns an address, ``free``
    takes it back; ``reserved``/``allocated`` and their peaks are what torch.cuda.memory_stats reports."""

    def __init__(self, *, expandable_segments: bool = False) -> None:
        self.expandable = expandable_segments
        self.pools = (_Pool(small=True), _Pool(small=False))
        self.blocks: dict[int, tuple[int, bool, int]] = {}  # address -> (size, allocated, segment)
        self.ends: dict[int, int] = {}  # a block's end address -> its address (its right neighbour's left)
        self.segment_pool: dict[int, _Pool] = {}
        self.next_address = 0
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0

    def malloc(self, size: int) -> int:
        size = round_size(size)
        pool = self.pools[0 if size <= SMALL_SIZE else 1]
        i = bisect_left(pool.free, (size, -1))
        if i < len(pool.free):
            block_size, address = pool.free.pop(i)
            segment = self._drop(address)
        else:
            address, block_size, segment = self._grow(pool, size)
        remaining = block_size - size
        if remaining >= MIN_BLOCK if (pool.small or self.expandable) else remaining > SMALL_SIZE:
            self._put_free(pool, address + size, remaining, segment)
        else:
            size = block_size  # the whole block is handed out and counted allocated, as torch does
        self._set(address, size, True, segment)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return address

    def free(self, address: int) -> None:
        size, allocated, segment = self.blocks[address]
        assert allocated, f"double free at {address}"
        self._drop(address)
        self.allocated -= size
        pool = self.segment_pool[segment]
        left = self.ends.get(address)
        if left is not None and self._free_in(left, segment):
            left_size = self.blocks[left][0]
            pool.free.remove((left_size, left))
            self._drop(left)
            address, size = left, left_size + size
        right = address + size
        if self._free_in(right, segment):
            right_size = self.blocks[right][0]
            pool.free.remove((right_size, right))
            self._drop(right)
            size += right_size
        self._put_free(pool, address, size, segment)

    def _grow(self, pool: _Pool, size: int) -> tuple[int, int, int]:
        """A new segment, or with expandable segments the pool's one segment mapped further, that
        holds ``size``: (address, block size, segment)."""
        if not self.expandable:
            block = segment_size(size)
            address, self.next_address = self.next_address, self.next_address + block
            self.segment_pool[address] = pool
            self._reserve(block)
            return address, block, address
        segment = 0 if pool.small else 1 << 60  # each pool's segment in its own address range
        self.segment_pool[segment] = pool
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        tail = self.ends.get(segment + pool.end)
        tail_size = self.blocks[tail][0] if tail is not None and not self.blocks[tail][1] else 0
        if tail_size:  # the free block at the end grows instead of being left behind
            pool.free.remove((tail_size, tail))
            self._drop(tail)
        grow = -(-(size - tail_size) // page) * page
        address = tail if tail_size else segment + pool.end
        pool.end += grow
        self._reserve(grow)
        return address, tail_size + grow, segment

    def _free_in(self, address: int, segment: int) -> bool:
        block = self.blocks.get(address)
        return block is not None and not block[1] and block[2] == segment

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _set(self, address: int, size: int, allocated: bool, segment: int) -> None:
        self.blocks[address] = (size, allocated, segment)
        self.ends[address + size] = address

    def _drop(self, address: int) -> int:
        size, _, segment = self.blocks.pop(address)
        del self.ends[address + size]
        return segment

    def _put_free(self, pool: _Pool, address: int, size: int, segment: int) -> None:
        self._set(address, size, False, segment)
        insort(pool.free, (size, address))


def replay(events: Iterable[tuple[int, int]], *, expandable_segments: bool = False) -> CachingAllocator:
    """Replay ``events``, each (tensor id, bytes) for an allocation or (tensor id, -1) for its free."""
    allocator = CachingAllocator(expandable_segments=expandable_segments)
    addresses: dict[int, int] = {}
    for key, nbytes in events:
        if nbytes < 0:
            allocator.free(addresses.pop(key))
        elif nbytes > 0:  # zero-byte tensors take no block (torch returns a null pointer)
            addresses[key] = allocator.malloc(nbytes)
    return allocator
