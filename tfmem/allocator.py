"""TensorFlow's BFC allocator, replayed: where a sequence of allocations lands, and whether
it all finds room under a limit.

Without XLA every tensor TensorFlow's executor makes is an allocation of its own, and the
allocator (best-fit with coalescing, "BFC": `xla/tsl/framework/bfc_allocator.cc`) does not
hand out exactly what is asked for. It grows its pool in regions that double (2, 4, 8 MiB,
... as needed), never gives a region back, and gives a request the whole free chunk it
picked when that chunk is under twice the request. So three float64 [1500, 1500] matrices
(17.2 MiB each, 51.5 MiB in all) need 81.2 MiB: after a small input took the first 2 MiB
region, the first two each take a 32 MiB region whole, and the third a piece of a 64 MiB
one. Under an 82 MiB limit the third finds no room: 82 − 2 − 32 − 32 = 16 MiB is left to
grow, under 17.2. A static estimate that counts live bytes cannot see this; replaying its
allocations here does (`Budget.fits_without_xla`).

Example:
    >>> matrix = 1500 * 1500 * 8
    >>> events = [Allocate("x", 12_000), Allocate("K", matrix), Allocate("L", matrix), Allocate("solve", matrix)]
    >>> replayed = replay(events, limit=82 << 20)
    >>> replayed.fits, replayed.failed
    (False, 'solve')
    >>> print(replayed.why())
    the allocator finds no room for solve (17.2 MiB): its regions of 2.0 + 32.0 + 32.0 MiB are in use or split too small, and 16.0 MiB is left to grow
    >>> replay(events, limit=1 << 30).peak_bytes / 2**20   # K and L each hold a 32 MiB chunk
    81.177734375
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Union

from tfmem.config import format_size

# What TensorFlow's BFC allocator rounds every request up to (`kMinAllocationSize`).
MIN_ALLOCATION_BYTES = 256
# Its first region (`min(limit, 2 MiB)`): regions double from there.
FIRST_REGION_BYTES = 2 << 20
# A free chunk at least this much over the request is split even when under twice it
# (`max_internal_fragmentation_bytes_`: 128 MiB unless a fraction is set).
MAX_INTERNAL_FRAGMENTATION_BYTES = 128 << 20


@dataclasses.dataclass(frozen=True)
class Allocate:
    """A tensor of `nbytes` is allocated, under the unique `name`."""

    name: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Free:
    """The tensor allocated under `name` is freed."""

    name: str


AllocatorEvent = Union[Allocate, Free]


def rounded_bytes(nbytes: int) -> int:
    """A request as the allocator sizes it: a multiple of `MIN_ALLOCATION_BYTES`, at least one."""
    return max(1, -(-nbytes // MIN_ALLOCATION_BYTES)) * MIN_ALLOCATION_BYTES


@dataclasses.dataclass
class _Chunk:
    region: int
    offset: int
    size: int
    owner: str | None = None  # the allocation in it; None when free


class BfcAllocator:
    """A model of one BFC allocator with growth (as TensorFlow's CPU allocator under
    `TF_CPU_ALLOCATOR_USE_BFC=1`): its regions, its chunks, bytes in use and their peak.

    `bytes_in_use` counts whole chunks, as TensorFlow's `get_memory_info(...)["peak"]` does.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.regions: list[list[_Chunk]] = []  # each region's chunks, by offset
        self._next_region = rounded_bytes(min(limit, FIRST_REGION_BYTES))
        self._where: dict[str, _Chunk] = {}
        self.bytes_in_use = 0
        self.peak_bytes = 0

    @property
    def region_sizes(self) -> list[int]:
        """The size of each region (its last chunk's end), in the order they were grown."""
        return [chunks[-1].offset + chunks[-1].size for chunks in self.regions]

    @property
    def pool_bytes(self) -> int:
        """What the allocator holds in regions."""
        return sum(self.region_sizes)

    def grow_to(self, nbytes: int) -> None:
        """Grows regions as allocations that reached `nbytes` in use would have (each
        region the next in the doubling, the last capped by the limit), and leaves them free.

        Example:
            >>> allocator = BfcAllocator(limit=192 << 20)
            >>> allocator.grow_to(183 << 20)
            >>> [size >> 20 for size in allocator.region_sizes]
            [2, 4, 8, 16, 32, 64, 66]
        """
        while self.pool_bytes < nbytes:
            left = (self.limit - self.pool_bytes) // MIN_ALLOCATION_BYTES * MIN_ALLOCATION_BYTES
            if left < MIN_ALLOCATION_BYTES or not self._extend(min(self._next_region, left)):
                return

    def allocate(self, name: str, nbytes: int) -> bool:
        """Allocates `nbytes` under `name`; False when nothing fits and no region can grow."""
        size = rounded_bytes(nbytes)
        chunk = self._best_fit(size)
        if chunk is None and self._extend(size):
            chunk = self._best_fit(size)
        if chunk is None:
            return False
        if chunk.size >= 2 * size or chunk.size - size >= MAX_INTERNAL_FRAGMENTATION_BYTES:
            chunks = self.regions[chunk.region]
            rest = _Chunk(chunk.region, chunk.offset + size, chunk.size - size)
            chunks.insert(chunks.index(chunk) + 1, rest)
            chunk.size = size
        chunk.owner = name
        self._where[name] = chunk
        self.bytes_in_use += chunk.size
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        return True

    def free(self, name: str) -> None:
        """Frees what `name` holds (nothing when it holds nothing) and merges free neighbours."""
        chunk = self._where.pop(name, None)
        if chunk is None:
            return
        chunk.owner = None
        self.bytes_in_use -= chunk.size
        chunks = self.regions[chunk.region]
        i = chunks.index(chunk)
        if i + 1 < len(chunks) and chunks[i + 1].owner is None:
            chunk.size += chunks.pop(i + 1).size
        if i > 0 and chunks[i - 1].owner is None:
            chunks[i - 1].size += chunks.pop(i).size

    def _best_fit(self, size: int) -> _Chunk | None:
        # The smallest free chunk that holds it, the lowest first among equals (BFC's bins
        # are sorted by size, then address).
        free = [c for chunks in self.regions for c in chunks if c.owner is None and c.size >= size]
        return min(free, key=lambda c: (c.size, c.region, c.offset), default=None)

    def _extend(self, size: int) -> bool:
        available = (self.limit - self.pool_bytes) // MIN_ALLOCATION_BYTES * MIN_ALLOCATION_BYTES
        if size > available:
            return False
        grew = False
        while size > self._next_region:
            self._next_region *= 2
            grew = True
        region = min(self._next_region, available)
        if not grew:
            self._next_region *= 2
        self.regions.append([_Chunk(len(self.regions), 0, region)])
        return True


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the allocator did with a sequence of allocations under `limit`.

    Attributes:
        fits: whether every allocation found room.
        peak_bytes: the most bytes in use at once, in whole chunks (TensorFlow's "peak"),
            up to the allocation that failed.
        failed: the allocation that found no room ("" when all did), and its bytes.
        regions: the regions the allocator held then.
    """

    limit: int
    fits: bool
    peak_bytes: int
    failed: str = ""
    failed_bytes: int = 0
    regions: tuple[int, ...] = ()

    def why(self) -> str:
        """Why an allocation found no room, in words ("" when all did)."""
        if self.fits:
            return ""
        held = " + ".join(f"{size / 2**20:.1f}" for size in self.regions) or "none"
        left = max(0, self.limit - sum(self.regions))
        return (f"the allocator finds no room for {self.failed} ({format_size(self.failed_bytes)}): its regions "
                f"of {held} MiB are in use or split too small, and {format_size(left)} is left to grow")


def replay(events: Iterable[AllocatorEvent], limit: int, *, grown_to: int = 0) -> Replay:
    """Replays `events` through a `BfcAllocator` under `limit` bytes (see the module): a
    fresh one, or one whose regions earlier allocations grew to `grown_to` bytes in use
    (`BfcAllocator.grow_to`)."""
    allocator = BfcAllocator(limit)
    allocator.grow_to(grown_to)
    for event in events:
        if isinstance(event, Free):
            allocator.free(event.name)
        elif event.nbytes > 0 and not allocator.allocate(event.name, event.nbytes):
            return Replay(limit, False, allocator.peak_bytes, event.name, event.nbytes,
                          tuple(allocator.region_sizes))
    return Replay(limit, True, allocator.peak_bytes, regions=tuple(allocator.region_sizes))
