"""``block_topk``'s plan of one step: what is the same for every layer call
of a step, worked out once, and the device counters it adds to.

Owns ``StepPlan`` (host-side: the step's shapes, whether it can thin at
all, whether it is left dense; device-side, built when a path first needs
them: the per-row tensors ``RowTensors``, the output table and lengths, the
Triton path's scratch, the stale entries), how a step is told from the next
(``step_key``), and the counters: their order on the device (``STATS``,
``SparseStats``' fields) and what a call adds to them.

What it must not do: wait for the device, except where ``stale`` says so
(every shape here comes from host-side facts: rows, the longest row, the
step index), change summaries, or choose blocks (``torch_select.py``,
``triton_select.py``).
"""

from __future__ import annotations

import torch

from .base import AttentionBatch
from .summaries import LayerSummaries, WritePlan
from .topk_options import BlockTopKOptions

# Order of the counters kept on the device (SparseStats' fields).
STATS = ("layer_calls", "decode_rows", "sparse_rows", "blocks_read", "blocks_dense",
         "blocks_summarized_from_pages", "blocks_probed_unchanged", "blocks_kept_unsummarized", "rows_reused")


def step_key(batch: AttentionBatch) -> tuple | None:
    """What the layer calls of one step share and the next step's do not
    (None: unknown, every call is a step of its own).  vLLM refills its
    metadata tensors in place, so the step index tells steps apart, not
    the tensors."""
    if batch.step is None:
        return None
    return (batch.step, batch.seq_lens.shape[0], batch.query.shape[0], batch.max_seq_len, batch.max_query_len,
            batch.block_table.data_ptr(), tuple(batch.block_table.shape), batch.seq_lens.data_ptr())


class StepPlan:
    """What is the same for every layer of a step.  Host-side: its shapes
    (``num_rows``, ``width`` = blocks of the longest row, ``keep_max`` = the
    largest budget) and whether it can thin anything at all; device-side,
    built when a path first needs them, the per-row tensors (``RowTensors``)."""

    def __init__(self, key: tuple | None, batch: AttentionBatch, options: BlockTopKOptions, width: int,
                 dense: bool, query_tokens: int = 1) -> None:
        self.key = key
        self.options = options
        self.query_tokens = query_tokens    # the most query tokens of a decode row (1 + drafts)
        # Held so that the tensors' memory cannot be reused while this plan lives.
        self._alive = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.slot_mapping)
        self.num_rows = batch.seq_lens.shape[0]
        self.width = width
        tail = tail_bound(options, query_tokens, batch.block_size)
        self.keep_max = min(width, max(options.keep_bound(width), options.sink_blocks + tail))
        self.dense = dense
        self.below_threshold = False        # dense because of dense_below alone
        self.step_reqs_noted = False        # this step's requests noted as skipped / rebuilt (SummaryKeeper)
        # One query token in every row, its row's index: a row of none (a
        # request vLLM pads the batch with) would shift the rest.
        self.decode_only = batch.max_query_len == 1 and batch.query.shape[0] == self.num_rows
        self.uncounted_calls = 0            # calls counted on the host, not yet added to the device counters
        self.call_increment: torch.Tensor | None = None    # what each of those adds
        self._write: WritePlan | None = None
        self._tensors: RowTensors | None = None
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._logits: torch.Tensor | None = None
        self._stale_known = False           # _stale worked out (at the step's first layer)
        self._stale: torch.Tensor | None = None

    @classmethod
    def make(cls, key: tuple | None, batch: AttentionBatch, options: BlockTopKOptions,
             thin_from: int | None, query_tokens: int = 1) -> "StepPlan":
        """The plan of the step ``batch`` is a layer call of; ``thin_from``:
        ``options.thin_from()``; ``query_tokens``: the most query tokens
        of a decode row (1, or 1 + the drafts verified at a step)."""
        # Without the host-side bound the longest row has to be read back.
        max_seq_len = batch.max_seq_len if batch.max_seq_len is not None else int(batch.seq_lens.max())
        width = max(1, min(-(-max_seq_len // batch.block_size), batch.block_table.shape[1]))
        unthinnable = (thin_from is None or width < thin_from
                       or batch.key is None or batch.slot_mapping is None)
        below = not unthinnable and max_seq_len < options.dense_below_on(batch.query.device)
        plan = cls(key, batch, options, width, unthinnable or below, query_tokens)
        plan.below_threshold = below
        return plan

    def write_plan(self, batch: AttentionBatch, trash: int) -> WritePlan:
        if self._write is None:
            self._write = WritePlan(batch.slot_mapping, batch.block_size, trash, self.num_rows)
        return self._write

    def tensors(self, batch: AttentionBatch) -> "RowTensors":
        if self._tensors is None:
            self._tensors = RowTensors(batch, self.width, self.keep_max, self.options, self.query_tokens)
        return self._tensors

    def outputs(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table and lengths handed to the kernel: the chosen blocks
        are written into the table's first columns per layer; rows that are
        not thinned keep their own."""
        if self._outputs is None:
            if self._tensors is not None:
                seq_lens = self._tensors.seq_lens
            else:
                seq_lens = torch.empty_like(batch.seq_lens)
            self._outputs = (batch.block_table.clone(), seq_lens)
        return self._outputs

    def logits(self, batch: AttentionBatch) -> torch.Tensor:
        """The Triton path's per-call scratch, shared by the step's layers
        (they run one after another on one stream)."""
        if self._logits is None:
            self._logits = torch.empty((self.num_rows, batch.query.shape[1], self.width), dtype=torch.float32,
                                       device=batch.query.device)
        return self._logits

    def count_call(self, batch: AttentionBatch) -> None:
        """Count a call whose counters the host adds up (dense, or the
        torch path): the same for every layer of the step."""
        if self.call_increment is None:
            self.call_increment = (dense_increment(batch, self.query_tokens) if self.dense
                                   else self.tensors(batch).stat_increment())
        self.uncounted_calls += 1

    def stale(self, layer: LayerSummaries, epochs: torch.Tensor) -> torch.Tensor | None:
        """The (row, position) entries of thinned rows whose blocks'
        summaries are not current, or None; worked out at the step's first
        layer, before any layer refreshes them, and the same for all its
        layers (they share ``made_at``).  Waits for the device."""
        if not self._stale_known:
            t = self._tensors
            assert t is not None, "tensors() first"
            stale = layer.stale(t.table.flatten(), epochs).view_as(t.table) & t.valid & t.thin.unsqueeze(1)
            self._stale = stale if bool(stale.any()) else None
            self._stale_known = True
        return self._stale


class RowTensors:
    """Per-row facts of a step on the device, every one of a shape fixed by
    the host-side plan ([rows] or [rows, width]): computed for every row,
    the thinned ones told apart by ``thin``.

    A decode row has 1 to ``query_tokens`` query tokens (drafts being
    verified after the first).  Its ``tail`` (the blocks from the one that
    holds its first new token to its last, or ``local_blocks`` if more) is
    always read, and its budget grows to hold the sinks and the tail: the
    kernel lines the query tokens up with the end of what it reads."""

    def __init__(self, batch: AttentionBatch, width: int, keep_max: int, options: BlockTopKOptions,
                 query_tokens: int = 1) -> None:
        block_size = batch.block_size
        num_rows = batch.seq_lens.shape[0]
        qsl = batch.query_start_loc
        seq_lens = batch.seq_lens.to(torch.int64)
        device = seq_lens.device
        q_lens = qsl[1:num_rows + 1] - qsl[:num_rows]
        self.is_decode = is_decode(q_lens, query_tokens)
        self.num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        self.keep = options.budget(self.num_blocks)
        # Blocks always read at the end of each row ([rows, 1], or one number
        # for all when every decode row has one query token).
        tail: torch.Tensor | int = options.local_blocks
        if query_tokens > 1:
            first_new = torch.div((seq_lens - q_lens).clamp(min=0), block_size, rounding_mode="floor")
            tail = torch.clamp(self.num_blocks - first_new, min=options.local_blocks)
            self.keep = torch.where(self.is_decode, torch.maximum(self.keep, options.sink_blocks + tail), self.keep)
            tail = tail.unsqueeze(1)
        self.thin = self.is_decode & (self.keep < self.num_blocks) & (seq_lens > 0)
        pos = torch.arange(width, device=device).unsqueeze(0)
        row_blocks = self.num_blocks.unsqueeze(1)                          # [rows, 1]
        self.valid = pos < row_blocks
        self.invalid = ~self.valid
        self.invalid_by_head = self.invalid[:, None, :]                   # [rows, 1, width]: over query heads
        table = batch.block_table[:num_rows, :width].to(torch.int64)
        self.table = torch.where(self.valid, table, torch.zeros_like(table))
        # Rows of the [num_blocks * H, 2D] min/max, in (row, head, position) order.
        heads = torch.arange(batch.num_kv_heads, device=device).view(1, -1, 1)
        self.head_index = (self.table.unsqueeze(1) * batch.num_kv_heads + heads).flatten()
        self._part_index: dict[int, torch.Tensor] = {}
        self._slice_weights: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self.block_size = block_size
        self.width = width
        self.last_fill = seq_lens - (self.num_blocks - 1) * block_size
        self.fills = torch.where(pos == row_blocks - 1, self.last_fill.unsqueeze(1),
                                 torch.full_like(self.table, block_size))
        self.forced = ((pos < options.sink_blocks) | (pos >= row_blocks - tail)) & self.valid
        self.in_budget = torch.arange(keep_max, device=device).unsqueeze(0) < self.keep.unsqueeze(1)
        # A row without query tokens at the end starts past the last token;
        # such a row is not thinned, and any token will do for its scores.
        self.q_index = qsl[:num_rows].to(torch.int64).clamp_(max=max(batch.query.shape[0] - 1, 0))
        self.seq_lens = torch.where(self.thin, (self.keep - 1) * block_size + self.last_fill,
                                    seq_lens).to(batch.seq_lens.dtype)

    def stat_increment(self) -> torch.Tensor:
        """What one layer call adds to each counter of ``STATS``."""
        return increment(self.is_decode, self.num_blocks, self.num_blocks - self.keep, self.thin)

    def part_index(self, parts: int, num_kv_heads: int) -> torch.Tensor:
        """Rows of the [num_blocks * parts * H, D] slice sums, in (row, head,
        position, slice) order."""
        if parts not in self._part_index:
            device = self.table.device
            blocks = self.table.view(self.table.shape[0], 1, self.width, 1)
            slices = torch.arange(parts, device=device).view(1, 1, 1, -1)
            heads = torch.arange(num_kv_heads, device=device).view(1, -1, 1, 1)
            self._part_index[parts] = ((blocks * parts + slices) * num_kv_heads + heads).flatten()
        return self._part_index[parts]

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


def increment(is_decode: torch.Tensor, num_blocks: torch.Tensor, dropped: torch.Tensor | None,
              thin: torch.Tensor | None) -> torch.Tensor:
    """What a layer call that scored (or was left dense) adds to each
    counter of ``STATS``: ``thin`` rows read ``num_blocks - dropped``
    blocks, the other decode rows all of theirs."""
    decode = is_decode.to(torch.int64)
    dense = (num_blocks * decode).sum()
    zero = torch.zeros((), dtype=torch.int64, device=decode.device)
    skipped = (dropped * thin).sum() if thin is not None else zero
    sparse = thin.sum() if thin is not None else zero
    return torch.stack((decode.amax() if decode.numel() else zero, decode.sum(), sparse, dense - skipped, dense,
                        zero, zero, zero, zero))


def dense_increment(batch: AttentionBatch, query_tokens: int = 1) -> torch.Tensor:
    """What a layer call left dense adds to the counters: every decode row
    reads all its blocks."""
    num_rows = batch.seq_lens.shape[0]
    qsl = batch.query_start_loc
    num_blocks = torch.div(batch.seq_lens.to(torch.int64) + batch.block_size - 1, batch.block_size,
                           rounding_mode="floor")
    return increment(is_decode(qsl[1:num_rows + 1] - qsl[:num_rows], query_tokens), num_blocks, None, None)


def is_decode(q_lens: torch.Tensor, query_tokens: int) -> torch.Tensor:
    """Rows that decode: one query token, or up to ``query_tokens`` where
    the engine verifies drafts."""
    return q_lens == 1 if query_tokens == 1 else (q_lens >= 1) & (q_lens <= query_tokens)


def tail_bound(options: BlockTopKOptions, query_tokens: int, block_size: int) -> int:
    """The most blocks a decode row's tail can span: ``query_tokens``
    consecutive tokens touch at most ``1 + ceil((query_tokens - 1) /
    block_size)`` blocks."""
    return max(options.local_blocks, 1 + -(-(query_tokens - 1) // block_size))
