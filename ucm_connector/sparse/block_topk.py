"""``block_topk``: at each decode step, attention reads only the cache blocks
whose keys can matter most to the current query.

For each decode request and layer, every block gets an estimate of the
share of attention it takes: per query head, q . (the block's mean key),
scaled and soft-maxed over the request's blocks, then averaged over heads (the
kernel takes one block list for all heads of a request).  With ``score:
"bound"`` the mean key is replaced by Quest's upper bound of q . k over the
block (from the per-head key min/max); on 128-token blocks the mean predicts
dense attention better (benchmarks/RESULTS.md).  Summaries live in
``summaries.py``.  The first
``sink_blocks`` blocks (attention sinks) and the last ``local_blocks`` blocks
(the recent window, which holds the partly filled block) are always read; the
rest of the budget goes to the highest estimates.  Chosen blocks are handed to
the kernel in position order.

Options (``"sparse": {"method": "block_topk", ...}``):

* ``keep_ratio`` (default 0.25): fraction of a request's blocks read, rounded up;
* ``budget_blocks``: a fixed number of blocks instead (give one of the two);
* ``sink_blocks`` (default 1), ``local_blocks`` (default 1, at least 1);
* ``score``: ``"mean"`` (default) or ``"bound"``;
* ``min_blocks`` (default 0): requests with fewer blocks are read whole (at
  short contexts the selection costs more than it saves).

A request whose budget covers all its blocks reads them all (no sparsity):
short requests are exactly dense.  Prefill and chunked-prefill rows (more
than one query token) are always dense.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from .base import AttentionBatch, BlockSelection, SparseConfigError, SparseMethod, SparseStats, StepInfo
from .summaries import BlockEpochs, LayerSummaries, WritePlan


@dataclasses.dataclass(frozen=True)
class BlockTopKOptions:
    keep_ratio: float | None = 0.25
    budget_blocks: int | None = None
    sink_blocks: int = 1
    local_blocks: int = 1
    score: str = "mean"
    parts: int = 1
    min_blocks: int = 0

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
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise SparseConfigError(f"block_topk: budget_blocks: expected a positive integer, got {budget!r}")
        sinks = options.get("sink_blocks", cls.sink_blocks)
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise SparseConfigError(f"block_topk: sink_blocks: expected an integer >= 0, got {sinks!r}")
        local = options.get("local_blocks", cls.local_blocks)
        if isinstance(local, bool) or not isinstance(local, int) or local < 1:
            raise SparseConfigError(
                f"block_topk: local_blocks: expected an integer >= 1 (the last, partly filled "
                f"block is always read), got {local!r}")
        score = options.get("score", cls.score)
        if score not in ("mean", "bound"):
            raise SparseConfigError(f"block_topk: score: expected 'mean' or 'bound', got {score!r}")
        floor = options.get("min_blocks", cls.min_blocks)
        if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
            raise SparseConfigError(f"block_topk: min_blocks: expected an integer >= 0, got {floor!r}")
        parts = options.get("parts", cls.parts)
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or parts & (parts - 1):
            raise SparseConfigError(f"block_topk: parts: expected a power of two >= 1, got {parts!r}")
        return cls(keep_ratio=ratio, budget_blocks=budget, sink_blocks=sinks, local_blocks=local,
                   score=score, parts=parts, min_blocks=floor)

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


class BlockTopK(SparseMethod):
    name = "block_topk"

    def __init__(self, options: BlockTopKOptions) -> None:
        self.options = options
        self._epochs = BlockEpochs()
        self._layers: dict[str, LayerSummaries] = {}
        # Shared by all layers' summaries: every layer sees the same writes
        # and refreshes the same stale blocks in the same step.
        self._made_at: torch.Tensor | None = None
        self._stats = SparseStats()
        self._plan: _StepPlan | None = None

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> "BlockTopK":
        return cls(BlockTopKOptions.parse(options))

    def stats(self) -> SparseStats:
        return dataclasses.replace(self._stats)

    def reset_stats(self) -> None:
        self._stats = SparseStats()

    # -- step ----------------------------------------------------------------

    def begin_step(self, step: StepInfo) -> None:
        self._plan = None
        for start in step.started:
            if start.num_computed_tokens > 0:
                # These blocks' keys were written without us (prefix cache or
                # connector load): their summaries are checked against the pages.
                num = -(-start.num_computed_tokens // step.block_size)
                self._epochs.bump(start.block_ids[:num])
        if step.block_copies:
            self._epochs.bump(dst for _, dst in step.block_copies)

    # -- layer ---------------------------------------------------------------

    def _layer(self, batch: AttentionBatch) -> LayerSummaries:
        layer = self._layers.get(batch.layer_name)
        if layer is None or layer.num_blocks < batch.num_cache_blocks:
            made_at = self._made_at
            if made_at is None or made_at.numel() < batch.num_cache_blocks or made_at.device != batch.query.device:
                # A bigger cache: every layer starts over.
                self._layers.clear()
                made_at = self._made_at = torch.full((batch.num_cache_blocks,), -1, dtype=torch.int64,
                                                     device=batch.query.device)
            # fp32 summaries: scoring reads them as fp32 without a conversion
            # (bf16 copies measured no faster and lost agreement with parts).
            parts = self.options.parts if batch.block_size % self.options.parts == 0 else 1
            layer = LayerSummaries(batch.num_cache_blocks, batch.block_size, batch.num_kv_heads,
                                   batch.head_size, torch.float32, batch.query.device, parts=parts,
                                   bounds=self.options.score == "bound", made_at=made_at)
            self._layers[batch.layer_name] = layer
        return layer

    def _step_plan(self, batch: AttentionBatch) -> "_StepPlan":
        plan = self._plan
        if plan is None or not plan.matches(batch):
            plan = self._plan = _StepPlan(batch, self.options)
        return plan

    def before_attention(self, batch: AttentionBatch) -> BlockSelection | None:
        plan = self._step_plan(batch)
        epochs = self._epochs.get(batch.num_cache_blocks, batch.query.device)
        layer = self._layer(batch)
        if plan.write is not None:
            layer.add_keys(batch.key, plan.write, epochs, batch.pages)
        stats = self._stats
        if plan.num_decode == 0:
            return None
        stats.layer_calls += 1
        stats.decode_rows += plan.num_decode
        stats.blocks_dense += plan.dense_blocks
        if plan.rows is None:
            stats.blocks_read += plan.dense_blocks
            return None

        forced = plan.forced
        unsummarized = self._refresh(layer, batch, plan, epochs)
        if unsummarized is not None:
            forced = forced | unsummarized
        scores = self._scores(layer, batch, plan).masked_fill(forced, float("inf"))
        if unsummarized is None:
            keep_rows, k, in_budget = plan.keep_rows, plan.k, plan.in_budget
            seq_lens = plan.seq_lens
        else:
            # Blocks with no summary are read on top of the budget.
            keep_rows = torch.maximum(plan.keep_rows, forced.sum(dim=1))
            k = int(keep_rows.max())
            in_budget = torch.arange(k, device=keep_rows.device).unsqueeze(0) < keep_rows.unsqueeze(1)
            seq_lens = batch.seq_lens.clone()
            seq_lens[plan.rows] = ((keep_rows - 1) * batch.block_size + plan.last_fill).to(seq_lens.dtype)
        top = scores.topk(k, dim=1).indices
        top = torch.where(in_budget, top, plan.width)
        chosen = top.sort(dim=1).values.clamp_(max=plan.width - 1)
        plan.block_table[plan.rows, :k] = plan.table.gather(1, chosen).to(plan.block_table.dtype)

        stats.sparse_rows += plan.num_rows
        stats.blocks_read += plan.dense_blocks - (plan.dropped if unsummarized is None
                                                  else int((plan.n_rows - keep_rows).sum()))
        return BlockSelection(block_table=plan.block_table, seq_lens=seq_lens)

    def _refresh(self, layer: LayerSummaries, batch: AttentionBatch, plan: "_StepPlan",
                 epochs: torch.Tensor) -> torch.Tensor | None:
        """Make the summaries of the blocks these rows read current; returns
        the (row, position) entries that still have none (always read), or None."""
        stale = plan.stale(layer, epochs)
        if stale is None:
            return None
        if batch.pages is None:
            self._stats.blocks_kept_unsummarized += int(stale.sum())
            return stale
        kept, rebuilt = layer.refresh(plan.table[stale], plan.fills[stale], epochs, batch.pages)
        self._stats.blocks_probed_unchanged += kept
        self._stats.blocks_summarized_from_pages += rebuilt
        return None

    def _scores(self, layer: LayerSummaries, batch: AttentionBatch, plan: "_StepPlan") -> torch.Tensor:
        """Estimated share of each block in the attention of each row's query."""
        q = batch.query[:plan.num_rows] if plan.q_in_order else batch.query.index_select(0, plan.q_index)
        n, num_heads, d = q.shape
        h, width = batch.num_kv_heads, plan.width
        q = q.float().reshape(n * h, num_heads // h, d)
        if self.options.score == "bound":
            rows = layer.minmax.view(-1, 2 * d).index_select(0, plan.head_index).view(n * h, width, 2 * d)
            q = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
            logits = torch.bmm(q, rows.transpose(1, 2)).view(n, num_heads, width).mul_(batch.scale)
            logits.masked_fill_(plan.invalid3, float("-inf"))
        else:
            parts = layer.parts
            index = plan.part_index(parts, h)
            rows = layer.part_sum.view(-1, d).index_select(0, index).view(n * h, width * parts, d)
            logits = torch.bmm(q, rows.transpose(1, 2)).view(n, num_heads, width, parts)
            # A block's mass ~ sum over its slices of count * exp(scale * q . mean).
            factor, log_count = plan.slice_weights(parts, batch.scale)
            logits.mul_(factor).add_(log_count)
            logits = logits.logsumexp(dim=-1) if parts > 1 else logits.squeeze(-1)
        return logits.softmax(dim=-1).mean(dim=1)


class _StepPlan:
    """What is the same for every layer of a step: which rows are sparse,
    their budgets, block tables and lengths, and where the new keys go."""

    def __init__(self, batch: AttentionBatch, options: BlockTopKOptions) -> None:
        self.refs = _refs(batch)
        # Held so that the ids in refs cannot be reused while this plan lives.
        self._alive = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.slot_mapping)
        block_size = batch.block_size
        self.write = (WritePlan(batch.slot_mapping, block_size)
                      if batch.key is not None and batch.slot_mapping is not None else None)
        qsl, seq_lens = batch.query_start_loc, batch.seq_lens
        num_reqs = seq_lens.shape[0]
        query_lens = qsl[1:num_reqs + 1] - qsl[:num_reqs]
        num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        is_decode = query_lens == 1
        keep = options.budget(num_blocks)
        self.num_decode = int(is_decode.sum())
        self.dense_blocks = int(num_blocks[is_decode].sum()) if self.num_decode else 0
        rows = (is_decode & (keep < num_blocks) & (seq_lens > 0)).nonzero().flatten()
        self.rows = rows if rows.numel() and self.write is not None else None
        if self.rows is None:
            return
        device = rows.device
        self.num_rows = int(rows.numel())
        self.n_rows = num_blocks[rows].to(torch.int64)
        self.keep_rows = keep[rows].to(torch.int64)
        self.dropped = int((self.n_rows - self.keep_rows).sum())
        self.k = int(self.keep_rows.max())
        self.width = int(self.n_rows.max())
        pos = torch.arange(self.width, device=device).unsqueeze(0)
        self.valid = pos < self.n_rows.unsqueeze(1)
        self.invalid3 = ~self.valid[:, None, :]
        table = batch.block_table[rows, :self.width].to(torch.int64)
        self.table = torch.where(self.valid, table, torch.zeros_like(table))
        # Rows of the [num_blocks * H, 2D] min/max, in (row, head, position) order.
        heads = torch.arange(batch.num_kv_heads, device=device).view(1, -1, 1)
        self.head_index = (self.table.unsqueeze(1) * batch.num_kv_heads + heads).flatten()
        self._part_index: dict[int, torch.Tensor] = {}
        self._slice_weights: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self.block_size = block_size
        self.table_flat = self.table.flatten()
        self.last_fill = seq_lens[rows].to(torch.int64) - (self.n_rows - 1) * block_size
        self.fills = torch.where(pos == (self.n_rows - 1).unsqueeze(1), self.last_fill.unsqueeze(1),
                                 torch.full_like(self.table, block_size))
        self.forced = ((pos < options.sink_blocks)
                       | (pos >= (self.n_rows - options.local_blocks).unsqueeze(1))) & self.valid
        self.in_budget = torch.arange(self.k, device=device).unsqueeze(0) < self.keep_rows.unsqueeze(1)
        self.q_index = qsl[rows].to(torch.int64)
        # Pure decode steps: row i's query is token i.
        self.q_in_order = bool(torch.equal(self.q_index, torch.arange(self.num_rows, device=device)))
        self._stale: torch.Tensor | None | bool = False
        # Handed to the kernel; the chosen blocks are written into it per layer.
        self.block_table = batch.block_table.clone()
        self.seq_lens = seq_lens.clone()
        self.seq_lens[rows] = ((self.keep_rows - 1) * block_size + self.last_fill).to(seq_lens.dtype)

    def part_index(self, parts: int, num_kv_heads: int) -> torch.Tensor:
        """Rows of the [num_blocks * parts * H, D] slice sums, in (row, head,
        position, slice) order."""
        if parts not in self._part_index:
            device = self.table.device
            blocks = self.table.view(self.num_rows, 1, self.width, 1)
            slices = torch.arange(parts, device=device).view(1, 1, 1, -1)
            heads = torch.arange(num_kv_heads, device=device).view(1, -1, 1, 1)
            self._part_index[parts] = ((blocks * parts + slices) * num_kv_heads + heads).flatten()
        return self._part_index[parts]

    def stale(self, layer: LayerSummaries, epochs: torch.Tensor) -> torch.Tensor | None:
        """The (row, position) entries whose blocks' summaries are not
        current, or None; worked out at the step's first layer, before any
        layer refreshes them, and the same for all its layers (they share
        ``made_at``)."""
        if self._stale is False:
            stale = layer.stale(self.table_flat, epochs).view_as(self.table) & self.valid
            self._stale = stale if bool(stale.any()) else None
        return self._stale

    def slice_weights(self, parts: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale / count`` and ``log(count)`` of each slice of each row's
        blocks, ``[rows, 1, width, parts]``: a current summary covers exactly
        a block's first ``fill`` tokens.  Empty slices and positions past a
        row's blocks get ``log(0) = -inf``."""
        key = (parts, scale)
        if key not in self._slice_weights:
            part_size = self.block_size // parts
            starts = torch.arange(parts, device=self.table.device) * part_size
            fills = self.fills.masked_fill(~self.valid, 0)
            count = (fills.unsqueeze(2) - starts).clamp_(0, part_size).to(torch.float32).unsqueeze(1)
            self._slice_weights[key] = (scale / count.clamp(min=1), count.log())
        return self._slice_weights[key]

    def matches(self, batch: AttentionBatch) -> bool:
        return self.refs == _refs(batch)


def _refs(batch: AttentionBatch) -> tuple:
    """Identifies a step's metadata across its layers (each layer gets its
    own views of the same tensors)."""
    slots = batch.slot_mapping
    return (id(batch.query_start_loc), id(batch.seq_lens), id(batch.block_table),
            None if slots is None else (slots.data_ptr(), slots.shape[0]))
