"""``block_topk``'s options: checking them, and the budget of blocks they
give a request.

Owns ``BlockTopKOptions`` (what each option means is in ``block_topk``'s
docstring), its ``parse`` (every bad value is a ``SparseConfigError``
naming the option and what it expects), the budget arithmetic on the device
(``budget``) and the same arithmetic on the host (``keep_of`` and what
follows from it), and the per-device default of ``dense_below``.

What it must not do: hold state, look at summaries or at a batch, or know
vLLM.  ``budget`` and ``keep_of`` must agree to the block: the host sizes
with one what the device fills with the other.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

from .base import SparseConfigError

# Below this longest-row length (tokens) a layer call is left dense: the
# selection's fixed cost is more than the reads it saves.  CUDA: on an H100
# (benchmarks/gpu_sparse_bench.py, batch 8, Llama-3-8B shapes, keep 1/4) a
# layer's hook + attention over the kept blocks, issued eagerly back to back,
# beat dense attention at 32k (0.62x) but not at 16k (1.47x): the hook's
# host time (~110-200 µs a call) dominates below that.  Counting device time
# alone it gains from 4k (0.85x), so where the host keeps ahead of the GPU
# (the rest of the layer in CUDA graphs) a lower value pays.  CPU: sparse
# decode pays from 2k tokens at batch 8 (benchmarks/sparse_bench.py).  See
# benchmarks/RESULTS.md.
DENSE_BELOW_DEFAULT = {"cuda": 32768, "cpu": 0}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class BlockTopKOptions:
    keep_ratio: float | None = 0.25     # fraction of a request's blocks read (None: budget_blocks)
    budget_blocks: int | None = None    # a fixed number of blocks instead
    sink_blocks: int = 1                # leading blocks always read
    local_blocks: int = 1               # trailing blocks always read (the partly filled one included)
    score: str = "mean"                 # "mean" or "bound"
    parts: int = 1                      # slices of a block scored apart (a power of two)
    min_blocks: int = 0                 # requests with fewer blocks are read whole
    dense_below: int | None = None      # tokens; None: DENSE_BELOW_DEFAULT for the device
    reselect_every: int = 1             # decode steps a layer's choice of blocks serves (1: every step chooses)
    channels: int | None = None         # key channels every key is scored on (None: blocks' mean keys)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "BlockTopKOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        for key in options:
            if key not in known:
                raise SparseConfigError(
                    f"block_topk: unknown option {key!r}; known options: {', '.join(sorted(known))}")
        ratio = options.get("keep_ratio")
        budget = options.get("budget_blocks")
        if ratio is not None and budget is not None:
            raise SparseConfigError("block_topk: give keep_ratio or budget_blocks, not both")
        if ratio is None and budget is None:
            ratio = cls.keep_ratio
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
                raise SparseConfigError(f"block_topk: keep_ratio: expected a number in (0, 1], got {ratio!r}")
            ratio = float(ratio)
        if budget is not None and (not _is_int(budget) or budget < 1):
            raise SparseConfigError(f"block_topk: budget_blocks: expected a positive integer, got {budget!r}")
        sink_blocks = options.get("sink_blocks", cls.sink_blocks)
        if not _is_int(sink_blocks) or sink_blocks < 0:
            raise SparseConfigError(f"block_topk: sink_blocks: expected an integer >= 0, got {sink_blocks!r}")
        local_blocks = options.get("local_blocks", cls.local_blocks)
        if not _is_int(local_blocks) or local_blocks < 1:
            raise SparseConfigError(
                f"block_topk: local_blocks: expected an integer >= 1 (the last, partly filled "
                f"block is always read), got {local_blocks!r}")
        score = options.get("score", cls.score)
        if score not in ("mean", "bound"):
            raise SparseConfigError(f"block_topk: score: expected 'mean' or 'bound', got {score!r}")
        min_blocks = options.get("min_blocks", cls.min_blocks)
        if not _is_int(min_blocks) or min_blocks < 0:
            raise SparseConfigError(f"block_topk: min_blocks: expected an integer >= 0, got {min_blocks!r}")
        parts = options.get("parts", cls.parts)
        if not _is_int(parts) or parts < 1 or parts & (parts - 1):
            raise SparseConfigError(f"block_topk: parts: expected a power of two >= 1, got {parts!r}")
        dense_below = options.get("dense_below", cls.dense_below)
        if dense_below is not None and (not _is_int(dense_below) or dense_below < 0):
            raise SparseConfigError(
                f"block_topk: dense_below: expected a number of tokens >= 0, got {dense_below!r}")
        reselect_every = options.get("reselect_every", cls.reselect_every)
        if not _is_int(reselect_every) or reselect_every < 1:
            raise SparseConfigError(
                f"block_topk: reselect_every: expected a number of decode steps >= 1, got {reselect_every!r}")
        channels = options.get("channels", cls.channels)
        if channels is not None:
            if not _is_int(channels) or channels < 1:
                raise SparseConfigError(
                    f"block_topk: channels: expected a number of key channels >= 1, got {channels!r}")
            clash = [f"score: {score!r}"] * (score != "mean") + [f"parts: {parts!r}"] * (parts != 1)
            if clash:
                raise SparseConfigError(
                    f"block_topk: channels scores every key of a block on its own; leave out {' and '.join(clash)}")
        return cls(keep_ratio=ratio, budget_blocks=budget, sink_blocks=sink_blocks, local_blocks=local_blocks,
                   score=score, parts=parts, min_blocks=min_blocks, dense_below=dense_below,
                   reselect_every=reselect_every, channels=channels)

    def budget(self, num_blocks: torch.Tensor) -> torch.Tensor:
        """Blocks to read for requests of ``num_blocks`` blocks (elementwise)."""
        if self.budget_blocks is not None:
            keep = torch.full_like(num_blocks, self.budget_blocks)
        else:
            # A small slack keeps 0.25 * 64 at 16, not 17, despite float error.
            keep = torch.ceil(num_blocks.to(torch.float64) * self.keep_ratio - 1e-9).to(num_blocks.dtype)
        keep = keep.clamp(min=self.sink_blocks + self.local_blocks)
        if self.min_blocks:
            keep = torch.where(num_blocks < self.min_blocks, num_blocks, keep)
        return keep

    def keep_of(self, num_blocks: int) -> int:
        """``budget`` for one request, in host arithmetic (the same float64
        operations, so the same result)."""
        if self.budget_blocks is not None:
            keep = self.budget_blocks
        else:
            keep = math.ceil(num_blocks * self.keep_ratio - 1e-9)
        keep = max(keep, self.sink_blocks + self.local_blocks)
        if self.min_blocks and num_blocks < self.min_blocks:
            keep = num_blocks
        return keep

    def thin_from(self, limit: int = 1 << 20) -> int | None:
        """The fewest blocks a request can have and still be thinned (its
        budget below its block count), or None if none ever is: a
        request's shortfall only grows with its block count."""
        if self.budget_blocks is None and self.keep_ratio >= 1:
            return None
        for n in range(1, limit):
            if self.keep_of(n) < n:
                return n
        return None

    def keep_bound(self, width: int) -> int:
        """The most blocks any thinned request of at most ``width`` blocks
        keeps: the budget grows with the block count."""
        return min(self.keep_of(width), width)

    def dense_below_on(self, device: torch.device) -> int:
        """``dense_below``, or the default for ``device``'s kind."""
        return self.dense_below if self.dense_below is not None else DENSE_BELOW_DEFAULT.get(device.type, 0)
