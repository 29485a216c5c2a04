"""Copying values between callers' buffers and an shm data segment.

Owns the copies themselves: one value into a run of chunks or out of it,
into or out of a list of parts (a block's header and pages), through numpy
for large copies so that other threads run meanwhile.  Must not know keys,
the server or generations: the client (``client``) decides what to copy
where, and whether a copy stands.
"""

from __future__ import annotations

import numpy as np

#: Copies at least this large go through numpy, which drops the GIL.
_NUMPY_COPY_MIN = 65536


def copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, letting other threads run meanwhile: numpy drops the
    GIL for a large copy, a memoryview assignment does not (a caller may read
    the next blocks on one thread while it copies the last ones on another)."""
    if src.nbytes >= _NUMPY_COPY_MIN:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def copy_run_into_parts(dsts: list[memoryview], data: memoryview, off: int) -> None:
    """Copy the value that starts at ``off`` in the segment, one run of
    chunks, into ``dsts`` in order (a block into its header and pages): one
    view of the source, and per part only what the part needs."""
    src = np.frombuffer(data, np.uint8, count=sum(d.nbytes for d in dsts), offset=off)
    pos = 0
    for dst in dsts:
        n = dst.nbytes
        if n >= _NUMPY_COPY_MIN:
            np.copyto(np.frombuffer(dst, np.uint8), src[pos:pos + n])
        else:
            dst[:] = data[off + pos:off + pos + n]
        pos += n


def value_slices(data: memoryview, chunk: int, runs, pos: int, end: int, nbytes: int) -> list[memoryview]:
    """Views of the segment holding the first ``nbytes`` bytes of a value
    whose runs are ``runs[pos:end]`` (pairs of first chunk and chunk count),
    in order."""
    slices = []
    done = 0
    for j in range(pos, end, 2):
        if done >= nbytes:
            break
        n = min(runs[j + 1] * chunk, nbytes - done)
        off = runs[j] * chunk
        slices.append(data[off:off + n])
        done += n
    return slices
