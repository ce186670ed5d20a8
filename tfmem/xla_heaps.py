"""XLA's temporaries in heaps of bounded size: one process-wide XLA flag, set and checked.

XLA packs a compiled program's temporaries into one block and asks the allocator for it
in one piece. An allocator that grew in regions (TensorFlow's BFC, as on the CPU) can hold
enough memory in all and still not that much in one piece. GPflow's VGP loss and
gradients at N=2000 (q_sqrt is [2000, 2000]): tfmem's rewrite plans 156.6 MiB under a
192 MiB limit, but building the model had grown the allocator's regions to the limit, and
the 126 MiB block found no room (`Budget.block_room`). XLA's flag
`--xla_multiheap_size_constraint_per_heap` makes its buffer assignment pack the
temporaries into several heaps of at most that size, each allocated apart: with heaps of
31 MiB, one [2000, 2000] float64 matrix wide each, the same program plans 170.0 MiB and
runs under the 192 MiB limit at a real peak of 174.9 MiB (`benchmarks/XLA_HEAPS.md`).

The flag is process-wide, and XLA reads it once, when the process first compiles. So it
is not a per-function config key: call `limit_xla_heaps` before anything compiles (or set
`XLA_FLAGS=--xla_multiheap_size_constraint_per_heap=N` before Python starts). The report
of a program whose block finds no room in one piece says so, with a size.

Choose the size no smaller than the program's largest temporaries: a buffer larger than
the limit gets a heap of its own, which no other buffer of its size may share, even one
alive at another time (the VGP program with heaps of 16 MiB plans 397.0 MiB, not 156.6).

Example:
    >>> import tfmem.xla_heaps as xla_heaps
    >>> xla_heaps.requested_heap_bytes("--xla_cpu_use_thunk_runtime=false --xla_multiheap_size_constraint_per_heap=33554432")
    33554432
    >>> xla_heaps.with_heap_flag("--xla_dump_to=/tmp/x", 1 << 25)
    '--xla_dump_to=/tmp/x --xla_multiheap_size_constraint_per_heap=33554432'
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from tfmem.config import format_size, parse_size
from tfmem.errors import TfmemError

if TYPE_CHECKING:  # the plan's type only
    from tfmem.memory import XlaPlan

FLAG = "xla_multiheap_size_constraint_per_heap"
# XLA declares the flag an int32.
MAX_HEAP_BYTES = 2**31 - 1
_MIB = 1 << 20
_FLAG_RE = re.compile(rf"--{FLAG}=(-?\d+)")


def requested_heap_bytes(xla_flags: str | None = None) -> int | None:
    """The heap size XLA_FLAGS (or `xla_flags`) asks for; None when it asks for none
    (unset, or XLA's "no constraint", -1). The last setting wins, as in XLA's parser."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    values = [int(v) for v in _FLAG_RE.findall(flags)]
    return values[-1] if values and values[-1] > 0 else None


def with_heap_flag(xla_flags: str, nbytes: int) -> str:
    """`xla_flags` with the heap size set to `nbytes` (any earlier setting of it removed)."""
    rest = _FLAG_RE.sub("", xla_flags).split()
    return " ".join([*rest, f"--{FLAG}={nbytes}"])


def suggested_heap_bytes(plan: XlaPlan) -> int | None:
    """The heap limit to try for a plan whose one block of temporaries finds no room: its
    largest buffer at XLA's peak, up to a whole MiB; None when XLA already packed it in
    heaps, this process set a heap limit already (it cannot change), its peak is
    unknown, or that is no smaller than the block.

    Not up to a power of two: XLA's heaps can come out a few bytes over the limit, and the
    allocator gives a request just over a power of two a region of twice that (VGP's
    heaps of 32 MiB + 24 B would each take a 64 MiB region in a fresh process); heaps of
    31 MiB fit a 32 MiB region, or two a 64 MiB one.

    Example:
        >>> from tfmem.memory import LiveTensor, MemoryEstimate, XlaPlan
        >>> matrix = LiveTensor("dot", 2000 * 2000 * 8, (2000, 2000), "float64")   # 30.5 MiB
        >>> peak = MemoryEstimate(4 * matrix.nbytes, "dot", (matrix,) * 4)
        >>> suggested_heap_bytes(XlaPlan(160 << 20, 126 << 20, peak, temp_bytes=126 << 20, heap_bytes=(126 << 20,))) >> 20
        31
    """
    if len(plan.heap_bytes) > 1 or requested_heap_bytes() is not None or plan.peak is None \
            or not plan.peak.live_at_peak:
        return None
    largest = max(t.nbytes for t in plan.peak.live_at_peak)
    size = -(-largest // _MIB) * _MIB
    return size if size < plan.block_bytes else None


def heaps_in_effect(nbytes: int) -> bool:
    """Whether XLA packs temporaries in heaps of at most `nbytes` in this process.

    Compiles (and does not run: its argument is a spec) a probe with float32 matrices of
    just over `nbytes / 2`, two of them alive at once (XLA fuses plain products into their
    readers; a Cholesky factor and the product it factors stay buffers): XLA packs them
    in one heap, or, under the limit, in one heap each. Nothing of that size is allocated.
    """
    import tensorflow as tf

    from tfmem.memory import xla_plan_from_hlo_proto

    side = int((nbytes // 2 // 4) ** 0.5) + 1  # side² float32 > nbytes / 2

    @tf.function(jit_compile=True)
    def probe(a: tf.Tensor) -> tf.Tensor:
        b = a @ a
        return tf.reduce_sum(tf.linalg.cholesky(b) @ b)

    compiler_ir = probe.experimental_get_compiler_ir(tf.TensorSpec([side, side], tf.float32))
    plan = xla_plan_from_hlo_proto(compiler_ir(stage="optimized_hlo_proto_serialized"))
    return sum(heap >= side * side * 4 for heap in plan.heap_bytes) > 1


def limit_xla_heaps(size: int | str) -> int:
    """Makes XLA pack every program's temporaries in heaps of at most `size` bytes, for
    the rest of this process (see the module); returns the size in bytes.

    Call it before anything compiles with XLA: XLA reads its flags once.

    Example:
        >>> import tfmem
        >>> tfmem.limit_xla_heaps("32MiB")       # doctest: +SKIP
        33554432

    Raises:
        ValueError: the size is not a size, or out of the flag's range (1 B to 2 GiB).
        TfmemError: XLA already read its flags in this process (something compiled
            first), or XLA_FLAGS already asks for another heap size.
    """
    nbytes = parse_size(size, key="heap size")
    if nbytes is None or nbytes > MAX_HEAP_BYTES:
        raise ValueError(f"heap size: expected 1 B to {format_size(MAX_HEAP_BYTES)} (XLA's flag is an int32), "
                         f"got {size!r}")
    flags = os.environ.get("XLA_FLAGS", "")
    requested = requested_heap_bytes(flags)
    if requested is not None and requested != nbytes:
        raise TfmemError(f"XLA_FLAGS already sets --{FLAG}={requested} ({format_size(requested)}); "
                         f"not changing it to {format_size(nbytes)}")
    os.environ["XLA_FLAGS"] = with_heap_flag(flags, nbytes)
    if not heaps_in_effect(nbytes):
        os.environ["XLA_FLAGS"] = flags
        raise TfmemError(f"XLA's heaps of at most {format_size(nbytes)} did not take effect: XLA reads its flags once "
                         f"per process, and something compiled with XLA before this call. Call "
                         f"tfmem.limit_xla_heaps first, or start Python with XLA_FLAGS=--{FLAG}={nbytes}")
    return nbytes
