"""The blocks a benchmark puts and the buffers it reads them back into.

Owns their memory: page-aligned like a caller's pinned buffers, values
reproducible from a seed and pairwise distinct, so that a store returning
another block's bytes is caught.  Must not touch a store.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096


def aligned_empty(num_blocks: int, block_nbytes: int) -> np.ndarray:
    """An uninitialised (blocks, nbytes) uint8 array starting on a page.

    numpy's large arrays start 16 bytes into a page, and the kernel's and
    libc's copies run at half speed or less into such a destination (seen:
    6 GB/s against 12 GB/s for file reads).  Real callers use page-aligned
    buffers (pinned tensors, mmaps), so the benchmark does too; otherwise the
    ratio would mostly measure which side happened to meet a better offset."""
    nbytes = num_blocks * block_nbytes
    backing = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-backing.ctypes.data) % PAGE
    return backing[start:start + nbytes].reshape(num_blocks, block_nbytes)


def make_values(num_blocks: int, block_nbytes: int, seed: int) -> np.ndarray:
    """Reproducible, pairwise-distinct blocks: each is a window at its own
    offset into one random stream, stamped with its index at both ends, so
    a store that returns another block's bytes is caught too."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 256, size=2 * block_nbytes, dtype=np.uint8)
    values = aligned_empty(num_blocks, block_nbytes)
    for i in range(num_blocks):
        offset = (i * 4099) % block_nbytes
        values[i] = stream[offset:offset + block_nbytes]
    stamp = np.arange(num_blocks, dtype="<u8").view(np.uint8).reshape(num_blocks, 8)
    width = min(8, block_nbytes)
    values[:, :width] = stamp[:, :width]
    values[:, block_nbytes - width:] = stamp[:, :width]
    return values
