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
  short contexts the selection costs more than it saves);
* ``dense_below`` (tokens; default: the device's measured crossover,
  ``DENSE_BELOW_DEFAULT``): a layer call whose longest row is shorter stays
  dense as a whole and costs nothing: it neither scores nor folds its keys;
  the first call at or above the threshold rebuilds the summaries of the
  blocks its rows read from their pages (one read of those keys per layer).

A request whose budget covers all its blocks reads them all (no sparsity):
short requests are exactly dense.  Prefill and chunked-prefill rows (more
than one query token) are always dense.

On a GPU a layer call never waits for the device: every shape is fixed by
host-side facts the patch passes in ``AttentionBatch`` (number of rows, the
longest row, the step index), every row is scored and the rows that are not
thinned are put back with ``where`` instead of being filtered out, and
counters stay on the device until ``stats()`` is read.  On CUDA with Triton
a decode layer call is two kernels (``triton_select.py``): score every block
through the block table while folding the new keys into the summaries, then
soft-max / top-k / order / write the selection per row.  The torch path
(CPU, or CUDA without Triton) computes the same selection with a few dozen
ops, also without waiting.  Only two rare situations wait: the steps after
the method starts while requests are already running (their earlier keys
went by unseen, so each step checks the blocks it reads), and caches whose
pages cannot be read back (quantized).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

from . import triton_select
from .base import AttentionBatch, BlockSelection, SparseConfigError, SparseMethod, SparseStats, StepInfo
from .summaries import BlockEpochs, LayerSummaries, WritePlan, to_device

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

# Order of the counters kept on the device (SparseStats' fields).
_STATS = ("layer_calls", "decode_rows", "sparse_rows", "blocks_read", "blocks_dense",
          "blocks_summarized_from_pages", "blocks_probed_unchanged", "blocks_kept_unsummarized")


@dataclasses.dataclass(frozen=True)
class BlockTopKOptions:
    keep_ratio: float | None = 0.25
    budget_blocks: int | None = None
    sink_blocks: int = 1
    local_blocks: int = 1
    score: str = "mean"
    parts: int = 1
    min_blocks: int = 0
    dense_below: int | None = None

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
        dense_below = options.get("dense_below", cls.dense_below)
        if dense_below is not None and (isinstance(dense_below, bool) or not isinstance(dense_below, int)
                                        or dense_below < 0):
            raise SparseConfigError(
                f"block_topk: dense_below: expected a number of tokens >= 0, got {dense_below!r}")
        return cls(keep_ratio=ratio, budget_blocks=budget, sink_blocks=sinks, local_blocks=local,
                   score=score, parts=parts, min_blocks=floor, dense_below=dense_below)

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


class BlockTopK(SparseMethod):
    name = "block_topk"

    def __init__(self, options: BlockTopKOptions, kernels: str = "auto") -> None:
        self.options = options
        # "auto": Triton on CUDA where it is installed, else torch; "torch"
        # or "triton" force one (benchmarks and tests compare them).
        self.kernels = kernels
        self._epochs = BlockEpochs()
        self._layers: dict[str, LayerSummaries] = {}
        # Shared by all layers' summaries: every layer sees the same writes
        # and refreshes the same stale blocks in the same step.
        self._made_at: torch.Tensor | None = None
        self._thin_from = options.thin_from()
        self._plan: _StepPlan | None = None
        # Counters on the device (see _STATS), and those only the host sees.
        self._totals: torch.Tensor | None = None
        self._host_stats = SparseStats()
        # Requests running when the method started (or when its summaries
        # were rebuilt for a bigger cache) that have not finished: their
        # earlier keys went by unseen.  None: not known (no step told us yet).
        self._unseen: set[str] | None = None
        self._census_due = True
        self._no_pages = False
        self._refresh: _PendingBlocks | None = None
        self._copies: _PendingBlocks | None = None
        # Requests scheduled in steps left dense by dense_below whose keys no
        # rebuild has covered yet, and this step's requests (None: unknown).
        self._skipped: set[str] = set()
        self._step_reqs: set[str] | None = None
        self._keep_tables: dict[tuple[int, torch.device], torch.Tensor] = {}

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> "BlockTopK":
        return cls(BlockTopKOptions.parse(options))

    def stats(self) -> SparseStats:
        self._flush_plan()
        out = dataclasses.replace(self._host_stats)
        if self._totals is not None:
            for name, value in zip(_STATS, self._totals.tolist()):
                setattr(out, name, getattr(out, name) + value)
        return out

    def reset_stats(self) -> None:
        self._flush_plan()
        self._host_stats = SparseStats()
        if self._totals is not None:
            with torch.inference_mode():
                self._totals.zero_()

    # -- step ----------------------------------------------------------------

    def begin_step(self, step: StepInfo) -> None:
        self._flush_plan()
        self._plan = None
        block_size = step.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}
        for start in step.started:
            if start.num_computed_tokens > 0:
                # These blocks' keys were written without us (prefix cache or
                # connector load): their summaries are checked against the
                # pages at this step's layer calls, before any decode row
                # reads them.  Which blocks, and how full, the host knows.
                num = -(-start.num_computed_tokens // block_size)
                blocks = [int(b) for b in start.block_ids[:num]]
                self._epochs.bump(blocks)
                full.update(blocks[:-1])
                last_fill = start.num_computed_tokens - (num - 1) * block_size
                if last_fill == block_size:
                    full.add(blocks[-1])
                else:
                    partial[blocks[-1]] = max(partial.get(blocks[-1], 0), last_fill)
        for b in full:
            partial.pop(b, None)
        self._refresh = _PendingBlocks(sorted(full), list(partial), list(partial.values())) \
            if full or partial else None
        self._copies = None
        if step.block_copies:
            self._epochs.bump(dst for _, dst in step.block_copies)
            self._copies = _PendingBlocks([src for src, _ in step.block_copies],
                                          [dst for _, dst in step.block_copies])
        self._step_reqs = None if step.scheduled_req_ids is None else set(step.scheduled_req_ids)
        self._skipped -= step.finished_req_ids
        if step.scheduled_req_ids is None:
            self._unseen, self._census_due = None, False
        elif self._census_due:
            self._unseen = set(step.scheduled_req_ids) - {s.req_id for s in step.started}
            self._census_due = False
        elif self._unseen is not None:
            # A request that (re)starts brings its cached blocks through the
            # bumps above; one that finishes takes its blocks with it.
            self._unseen -= {s.req_id for s in step.started}
            self._unseen -= step.finished_req_ids

    def _checking(self) -> bool:
        """Whether a step must look on the device for blocks whose summaries
        are not current (and so wait for it once per step)."""
        return self._unseen is None or bool(self._unseen) or self._no_pages

    # -- layer ---------------------------------------------------------------

    def _layer(self, batch: AttentionBatch) -> LayerSummaries:
        layer = self._layers.get(batch.layer_name)
        if layer is None or layer.num_blocks < batch.num_cache_blocks:
            made_at = self._made_at
            device = batch.query.device
            if made_at is None or made_at.numel() < batch.num_cache_blocks + 1 or made_at.device != device:
                if self._layers:
                    # A bigger cache: every layer starts over, and the keys of
                    # running requests are unseen until the next census.
                    self._unseen, self._census_due = None, True
                self._layers.clear()
                made_at = self._made_at = torch.full((batch.num_cache_blocks + 1,), -1, dtype=torch.int64,
                                                     device=device)
            # fp32 summaries: scoring reads them as fp32 without a conversion
            # (bf16 copies measured no faster and lost agreement with parts).
            parts = self.options.parts if batch.block_size % self.options.parts == 0 else 1
            layer = LayerSummaries(batch.num_cache_blocks, batch.block_size, batch.num_kv_heads,
                                   batch.head_size, torch.float32, device, parts=parts,
                                   bounds=self.options.score == "bound", made_at=made_at)
            self._layers[batch.layer_name] = layer
        if self._totals is None or self._totals.device != batch.query.device:
            self._totals = torch.zeros(len(_STATS), dtype=torch.int64, device=batch.query.device)
        return layer

    def _step_plan(self, batch: AttentionBatch) -> "_StepPlan":
        num_reqs = batch.seq_lens.shape[0]
        key = None if batch.step is None else (
            batch.step, num_reqs, batch.query.shape[0], batch.max_seq_len, batch.max_query_len,
            batch.block_table.data_ptr(), tuple(batch.block_table.shape), batch.seq_lens.data_ptr())
        plan = self._plan
        if plan is not None and key is not None and plan.key == key:
            return plan
        self._flush_plan()
        # Without the host-side bound the longest row has to be read back.
        max_seq_len = batch.max_seq_len if batch.max_seq_len is not None else int(batch.seq_lens.max())
        width = max(1, min(-(-max_seq_len // batch.block_size), batch.block_table.shape[1]))
        dense_below = self.options.dense_below
        if dense_below is None:
            dense_below = DENSE_BELOW_DEFAULT.get(batch.query.device.type, 0)
        unthinnable = (self._thin_from is None or width < self._thin_from
                       or batch.key is None or batch.slot_mapping is None)
        below = not unthinnable and max_seq_len < dense_below
        plan = self._plan = _StepPlan(key, batch, self.options, width, unthinnable or below)
        plan.below_threshold = below
        return plan

    def _flush_plan(self) -> None:
        """Add the counts of the plan's calls counted on the host."""
        plan = self._plan
        if plan is not None and plan.calls and plan.inc is not None:
            # The counters are made during vLLM's forward, as inference
            # tensors; stats() may come from outside it.
            with torch.inference_mode():
                self._totals += plan.inc * plan.calls
            plan.calls = 0

    def _use_triton(self, device: torch.device) -> bool:
        if self.kernels == "torch":
            return False
        if self.kernels == "triton":
            return True
        return device.type == "cuda" and triton_select.available()

    def before_attention(self, batch: AttentionBatch) -> BlockSelection | None:
        plan = self._step_plan(batch)
        device = batch.query.device
        epochs = self._epochs.get(batch.num_cache_blocks, device)
        layer = self._layer(batch)
        if batch.pages is None and not self._no_pages:
            self._no_pages = True
        self._apply_pending(layer, batch, epochs)
        if plan.below_threshold and batch.pages is not None:
            # Left dense for its length: not even the keys are folded (that
            # would cost launches a dense call does not otherwise pay); the
            # next thinned call rebuilds what its rows read from the pages.
            layer.behind = True
            if not plan.skip_noted:
                plan.skip_noted = True
                self._skipped |= self._step_reqs if self._step_reqs is not None else set()
            plan.count_call(batch)
            return None
        triton = self._use_triton(device)
        checking = self._checking()
        has_keys = batch.key is not None and batch.slot_mapping is not None
        if layer.behind and not plan.dense and batch.pages is not None:
            t = plan.tensors(batch)
            layer.rebuild(t.table, t.valid, t.fills, epochs, batch.pages)
            has_keys = False                   # the pages already hold this call's keys
            if not plan.skip_noted:
                # Requests that wrote keys while calls were left dense and
                # are not among this step's rows keep every layer rebuilding
                # at its thinned calls until they have been (or have ended).
                plan.skip_noted = True
                if self._step_reqs is None:
                    self._skipped.clear()
                else:
                    self._skipped -= self._step_reqs
            layer.behind = bool(self._skipped)
        # A decode-only call on the Triton path folds its keys in the scoring
        # kernel (one launch fewer); otherwise the keys are folded first.
        fused = triton and plan.decode_only and not plan.dense and not checking and has_keys
        if has_keys and not fused:
            if triton and plan.decode_only:
                triton_select.fold_decode(layer, batch.key, batch.slot_mapping, epochs, batch.pages)
            else:
                layer.add_keys(batch.key, plan.write_plan(batch, layer.trash), epochs, batch.pages)
        if plan.dense:
            plan.count_call(batch)
            return None
        unsummarized = self._refresh_stale(layer, batch, plan, epochs) if checking else None
        if triton and unsummarized is None:
            return self._select_triton(layer, batch, plan, (epochs,) if fused else None)
        return self._select_torch(layer, batch, plan, unsummarized)

    def _apply_pending(self, layer: LayerSummaries, batch: AttentionBatch, epochs: torch.Tensor) -> None:
        """This step's blocks filled behind the forward (known on the host
        from begin_step): checked against their pages, once per layer."""
        pending = self._refresh
        if pending is not None and pending.first_time(batch.layer_name) and batch.pages is not None:
            full, partial, fills = pending.tensors(epochs.device)
            counts = layer.refresh_known(full, partial, fills, epochs, batch.pages)
            self._totals[5:7] += counts.flip(0)
        copies = self._copies
        if copies is not None and copies.first_time(batch.layer_name):
            src, dst, _ = copies.tensors(epochs.device)
            layer.copy_blocks(src, dst, epochs)

    def _refresh_stale(self, layer: LayerSummaries, batch: AttentionBatch, plan: "_StepPlan",
                       epochs: torch.Tensor) -> torch.Tensor | None:
        """Make the summaries of the blocks these rows read current; returns
        the (row, position) entries that still have none (always read), or
        None.  Only while some block may have been filled unseen: this
        looks at values, so it waits for the device (once per step, plus
        once per layer that has blocks to rebuild)."""
        t = plan.tensors(batch)
        stale = plan.stale(layer, epochs)
        if stale is None:
            return None
        if batch.pages is None:
            self._host_stats.blocks_kept_unsummarized += int(stale.sum())
            return stale
        kept, rebuilt = layer.refresh(t.table[stale], t.fills[stale], epochs, batch.pages)
        self._host_stats.blocks_probed_unchanged += kept
        self._host_stats.blocks_summarized_from_pages += rebuilt
        return None

    def _select_triton(self, layer: LayerSummaries, batch: AttentionBatch, plan: "_StepPlan",
                       fold: tuple | None) -> BlockSelection:
        table, seq_lens = plan.outputs(batch)
        triton_select.score_and_select(
            layer, batch, width=plan.width, keep=self._keep_table(plan.width, batch.query.device),
            sink_blocks=self.options.sink_blocks, local_blocks=self.options.local_blocks,
            bound=self.options.score == "bound", query_in_order=plan.decode_only,
            out_table=table, out_seq_lens=seq_lens, totals=self._totals, logits=plan.logits(batch), fold=fold)
        return BlockSelection(block_table=table, seq_lens=seq_lens)

    def _keep_table(self, width: int, device: torch.device) -> torch.Tensor:
        """``budget(n)`` for n = 0 .. a power of two >= width, on the device,
        from the host's float64 arithmetic (the kernel looks it up)."""
        size = 1 << max(4, width.bit_length())
        key = (size, device)
        if key not in self._keep_tables:
            keep = self.options.budget(torch.arange(size + 1, dtype=torch.int64))
            self._keep_tables[key] = to_device(keep.tolist(), device).to(torch.int32)
        return self._keep_tables[key]

    def _select_torch(self, layer: LayerSummaries, batch: AttentionBatch, plan: "_StepPlan",
                      unsummarized: torch.Tensor | None) -> BlockSelection:
        t = plan.tensors(batch)
        table, seq_lens = plan.outputs(batch)
        forced = t.forced if unsummarized is None else t.forced | unsummarized
        scores = self._scores(layer, batch, plan).masked_fill(forced, float("inf"))
        # Positions past a row's blocks never win, even over blocks whose
        # share underflowed to zero.
        scores.masked_fill_(t.invalid, float("-inf"))
        k, keep, in_budget = plan.keep_max, t.keep, t.in_budget
        if unsummarized is not None:
            # Blocks with no summary are read on top of the budget (this
            # path waits for the device anyway: see _refresh_stale).
            keep = torch.where(t.thin, torch.maximum(t.keep, forced.sum(dim=1)), t.keep)
            k = int(torch.where(t.thin, keep, 0).max())
            in_budget = torch.arange(k, device=keep.device).unsqueeze(0) < keep.unsqueeze(1)
            seq_lens = torch.where(t.thin, (keep - 1) * batch.block_size + t.last_fill,
                                   batch.seq_lens).to(batch.seq_lens.dtype)
            self._totals[3] += ((keep - t.keep) * t.thin).sum()
        top = scores.topk(k, dim=1).indices
        top = torch.where(in_budget, top, plan.width)
        chosen = top.sort(dim=1).values.clamp_(max=plan.width - 1)
        rows = plan.num_reqs
        blocks = t.table.gather(1, chosen).to(table.dtype)
        table[:rows, :k] = torch.where(t.thin.unsqueeze(1), blocks, batch.block_table[:rows, :k])
        plan.count_call(batch)
        return BlockSelection(block_table=table, seq_lens=seq_lens)

    def _scores(self, layer: LayerSummaries, batch: AttentionBatch, plan: "_StepPlan") -> torch.Tensor:
        """Estimated share of each block in the attention of each row's
        query, ``[rows, width]`` (every row: the caller keeps what it needs)."""
        t = plan.tensors(batch)
        rows = plan.num_reqs
        q = batch.query[:rows] if plan.decode_only else batch.query.index_select(0, t.q_index)
        n, num_heads, d = q.shape
        h, width = batch.num_kv_heads, plan.width
        q = q.float().reshape(n * h, num_heads // h, d)
        if self.options.score == "bound":
            summaries = layer.minmax.view(-1, 2 * d).index_select(0, t.head_index).view(n * h, width, 2 * d)
            q = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
            logits = torch.bmm(q, summaries.transpose(1, 2)).view(n, num_heads, width).mul_(batch.scale)
            logits.masked_fill_(t.invalid3, float("-inf"))
        else:
            parts = layer.parts
            index = t.part_index(parts, h)
            summaries = layer.part_sum.view(-1, d).index_select(0, index).view(n * h, width * parts, d)
            logits = torch.bmm(q, summaries.transpose(1, 2)).view(n, num_heads, width, parts)
            # A block's mass ~ sum over its slices of count * exp(scale * q . mean).
            factor, log_count = t.slice_weights(parts, batch.scale)
            logits.mul_(factor).add_(log_count)
            logits = logits.logsumexp(dim=-1) if parts > 1 else logits.squeeze(-1)
        return logits.softmax(dim=-1).mean(dim=1)


class _PendingBlocks:
    """Block ids the step hook learnt on the host (blocks to check against
    their pages, or page copies), applied once to each layer's summaries;
    copied to the device once, without waiting."""

    def __init__(self, first: list[int], second: list[int], fills: list[int] | None = None) -> None:
        self._host = (first, second, fills)
        self._device: tuple | None = None
        self._done: set[str] = set()

    def first_time(self, layer_name: str) -> bool:
        if layer_name in self._done:
            return False
        self._done.add(layer_name)
        return True

    def tensors(self, device: torch.device) -> tuple:
        if self._device is None or self._device[0] != device:
            self._device = (device,) + tuple(
                to_device(v, device) if v else None for v in self._host)
        return self._device[1:]


class _StepPlan:
    """What is the same for every layer of a step.  Host-side: its shapes
    (rows, ``width`` = blocks of the longest row, ``keep_max`` = the largest
    budget) and whether it can thin anything at all; device-side, built
    when a path first needs them, the per-row tensors (``_RowTensors``)."""

    def __init__(self, key: tuple | None, batch: AttentionBatch, options: BlockTopKOptions, width: int,
                 dense: bool) -> None:
        self.key = key
        self._options = options
        # Held so that the tensors' memory cannot be reused while this plan lives.
        self._alive = (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.slot_mapping)
        self.num_reqs = batch.seq_lens.shape[0]
        self.width = width
        self.keep_max = options.keep_bound(width)
        self.dense = dense
        self.below_threshold = False        # dense because of dense_below alone
        self.skip_noted = False             # this step's requests counted as skipped / rebuilt
        self.decode_only = batch.max_query_len == 1
        self.calls = 0                      # calls whose counts are inc (added up at flush)
        self.inc: torch.Tensor | None = None
        self._write: WritePlan | None = None
        self._tensors: _RowTensors | None = None
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._logits: torch.Tensor | None = None
        self._stale: torch.Tensor | None | bool = False

    def write_plan(self, batch: AttentionBatch, trash: int) -> WritePlan:
        if self._write is None:
            self._write = WritePlan(batch.slot_mapping, batch.block_size, trash, self.num_reqs)
        return self._write

    def tensors(self, batch: AttentionBatch) -> "_RowTensors":
        if self._tensors is None:
            self._tensors = _RowTensors(batch, self.width, self.keep_max, self._options)
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
            self._logits = torch.empty((self.num_reqs, batch.query.shape[1], self.width), dtype=torch.float32,
                                       device=batch.query.device)
        return self._logits

    def count_call(self, batch: AttentionBatch) -> None:
        """Count a call whose counters the host adds up (dense, or the
        torch path): the same for every layer of the step."""
        if self.inc is None:
            self.inc = _dense_increment(batch) if self.dense else self.tensors(batch).stat_increment()
        self.calls += 1

    def stale(self, layer: LayerSummaries, epochs: torch.Tensor) -> torch.Tensor | None:
        """The (row, position) entries of thinned rows whose blocks'
        summaries are not current, or None; worked out at the step's first
        layer, before any layer refreshes them, and the same for all its
        layers (they share ``made_at``)."""
        if self._stale is False:
            t = self._tensors
            assert t is not None, "tensors() first"
            stale = layer.stale(t.table.flatten(), epochs).view_as(t.table) & t.valid & t.thin.unsqueeze(1)
            self._stale = stale if bool(stale.any()) else None
        return self._stale


class _RowTensors:
    """Per-row facts of a step on the device, every one of a shape fixed by
    the host-side plan ([rows] or [rows, width]): computed for every row,
    the thinned ones told apart by ``thin``."""

    def __init__(self, batch: AttentionBatch, width: int, keep_max: int, options: BlockTopKOptions) -> None:
        block_size = batch.block_size
        rows = batch.seq_lens.shape[0]
        qsl = batch.query_start_loc
        seq_lens = batch.seq_lens.to(torch.int64)
        device = seq_lens.device
        self.is_decode = (qsl[1:rows + 1] - qsl[:rows]) == 1
        self.num_blocks = torch.div(seq_lens + block_size - 1, block_size, rounding_mode="floor")
        self.keep = options.budget(self.num_blocks)
        self.thin = self.is_decode & (self.keep < self.num_blocks) & (seq_lens > 0)
        pos = torch.arange(width, device=device).unsqueeze(0)
        n = self.num_blocks.unsqueeze(1)
        self.valid = pos < n
        self.invalid = ~self.valid
        self.invalid3 = self.invalid[:, None, :]
        table = batch.block_table[:rows, :width].to(torch.int64)
        self.table = torch.where(self.valid, table, torch.zeros_like(table))
        # Rows of the [num_blocks * H, 2D] min/max, in (row, head, position) order.
        heads = torch.arange(batch.num_kv_heads, device=device).view(1, -1, 1)
        self.head_index = (self.table.unsqueeze(1) * batch.num_kv_heads + heads).flatten()
        self._part_index: dict[int, torch.Tensor] = {}
        self._slice_weights: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}
        self.block_size = block_size
        self.width = width
        self.last_fill = seq_lens - (self.num_blocks - 1) * block_size
        self.fills = torch.where(pos == n - 1, self.last_fill.unsqueeze(1), torch.full_like(self.table, block_size))
        self.forced = ((pos < options.sink_blocks) | (pos >= n - options.local_blocks)) & self.valid
        self.in_budget = torch.arange(keep_max, device=device).unsqueeze(0) < self.keep.unsqueeze(1)
        self.q_index = qsl[:rows].to(torch.int64)
        self.seq_lens = torch.where(self.thin, (self.keep - 1) * block_size + self.last_fill,
                                    seq_lens).to(batch.seq_lens.dtype)

    def stat_increment(self) -> torch.Tensor:
        """What one layer call adds to each counter of ``_STATS``."""
        return _increment(self.is_decode, self.num_blocks, self.num_blocks - self.keep, self.thin)

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


def _increment(is_decode: torch.Tensor, num_blocks: torch.Tensor, dropped: torch.Tensor | None,
               thin: torch.Tensor | None) -> torch.Tensor:
    decode = is_decode.to(torch.int64)
    dense = (num_blocks * decode).sum()
    zero = torch.zeros((), dtype=torch.int64, device=decode.device)
    skipped = (dropped * thin).sum() if thin is not None else zero
    return torch.stack((decode.amax() if decode.numel() else zero, decode.sum(),
                        thin.sum() if thin is not None else zero, dense - skipped, dense, zero, zero, zero))


def _dense_increment(batch: AttentionBatch) -> torch.Tensor:
    """What a layer call left dense adds to the counters: every decode row
    reads all its blocks."""
    rows = batch.seq_lens.shape[0]
    qsl = batch.query_start_loc
    num_blocks = torch.div(batch.seq_lens.to(torch.int64) + batch.block_size - 1, batch.block_size,
                           rounding_mode="floor")
    return _increment((qsl[1:rows + 1] - qsl[:rows]) == 1, num_blocks, None, None)
