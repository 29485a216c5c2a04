"""``block_topk``: at each decode step, attention reads only the cache blocks
whose keys can matter most to the current query.

For each decode request and layer, every block gets an estimate of the
share of attention it takes: per query head, q . (the block's mean key),
scaled and soft-maxed over the request's blocks, then averaged over heads (the
kernel takes one block list for all heads of a request).  With ``score:
"bound"`` the mean key is replaced by Quest's upper bound of q . k over the
block (from the per-head key min/max); on 128-token blocks the mean predicts
dense attention better (benchmarks/RESULTS.md).  The first ``sink_blocks``
blocks (attention sinks) and the last ``local_blocks`` blocks (the recent
window, which holds the partly filled block) are always read; the rest of
the budget goes to the highest estimates.  Chosen blocks are handed to the
kernel in position order.

Options (``"sparse": {"method": "block_topk", ...}``):

* ``keep_ratio`` (default 0.25): fraction of a request's blocks read, rounded up;
* ``budget_blocks``: a fixed number of blocks instead (give one of the two);
* ``sink_blocks`` (default 1): leading blocks always read (attention sinks);
* ``local_blocks`` (default 1, at least 1): trailing blocks always read (the
  last one is partly filled);
* ``score``: ``"mean"`` (default) or ``"bound"``;
* ``parts`` (default 1, a power of two): with ``"mean"``, each block is
  scored as that many equal slices of its tokens (their mean keys, added up
  in log space): a slice's mean, finer than the block's, keeps a few strong
  keys from being averaged away; finer, and slower.  A block size that
  ``parts`` does not divide is scored whole;
* ``channels`` (default none): score every key of a block on its own, on
  this many of its channels (per KV head, the loudest; see
  ``key_channels``), and add up: a block that one key makes count (the
  token a copy of earlier text continues from) stands out, where its mean
  key does not.  Takes neither ``score: "bound"`` nor ``parts``;
  summaries of ``block_size * channels`` values per block and KV head (in
  a 16-bit model dtype, the keys' own); layers whose pages cannot be read
  stay dense;
* ``min_blocks`` (default 0): requests with fewer blocks are read whole (at
  short contexts the selection costs more than it saves);
* ``dense_below`` (tokens; default: the device's measured crossover,
  ``DENSE_BELOW_DEFAULT``): a layer call whose longest row is shorter stays
  dense as a whole and costs nothing: it neither scores nor folds its keys;
  the first call at or above the threshold rebuilds the summaries of the
  blocks its rows read from their pages (one read of those keys per layer);
* ``reselect_every`` (default 1): a layer scores its blocks at one decode
  step in this many; at the steps in between it scores nothing and each row
  reads the blocks it read at the step before, plus its new last block when
  it has started one (``topk_reuse``).  A row that was not thinned at the
  step before (it joined, or moved in the batch) is read whole at such a
  step.

A request whose budget covers all its blocks reads them all (no sparsity):
short requests are exactly dense.  Prefill and chunked-prefill rows (more
than one query token) are always dense, except under speculative decoding
(``speculate``): there a row of up to 1 + the drafts' query tokens decodes
(it verifies drafts), and it is thinned too, scored with its first query
token; the blocks from the one that holds its first new token on are
always read (the kernel lines its queries up with the end of what it
reads), the budget growing to hold them where ``local_blocks`` does not.
vLLM's metadata does not tell such a row from a prompt's last chunk of as
few tokens (after a prefix-cache hit, say): that chunk is thinned too.

On a GPU a layer call never waits for the device: every shape is fixed by
host-side facts the patch passes in ``AttentionBatch`` (number of rows, the
longest row, the step index), every row is scored and the rows that are not
thinned are put back with ``where`` instead of being filtered out, and
counters stay on the device until ``stats()`` is read.  On CUDA with Triton
a decode layer call is two kernels (``triton_select.py``): score every block
through the block table while folding the new keys into the summaries, then
soft-max / top-k / order / write the selection per row; a call that
reuses a choice (``reselect_every``) is two kernels too: the fold, then one
program per row that copies the choice.  Every variant of them that the
layer can launch is compiled at start-up (``warm_up``), none while serving.
With ``channels`` the call's query, keys and pages are first cut down to
the layer's channels (a few gathers); either path then runs as for mean
keys, with one slice per token.  The torch path
(``torch_select.py``: CPU, or CUDA without Triton) computes the same
selection with a few dozen ops, also without waiting.  Only two rare
situations wait: the steps after the method starts while requests are
already running (their earlier keys went by unseen, so each step checks the
blocks it reads), and caches whose pages cannot be read back (quantized
ones other than FlashAttention's per-tensor fp8).

This module owns the method itself: the order of a layer call's work, which
path selects, and the counters.  The pieces: ``topk_options`` (the options
and the budget), ``topk_plan`` (what a step's layers share), ``summaries``
and ``summary_keeper`` (the key summaries and how current they are),
``torch_select`` and ``triton_select`` (the selection), ``topk_reuse`` (a
choice reused over steps), ``key_channels`` (``channels``: the channels, and
calls, keys and pages cut down to them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import torch

from . import torch_select, triton_select
from .base import AttentionBatch, BlockSelection, SparseMethod, SparseStats, StepInfo
from .key_channels import KeyChannels, LayerChannels
from .summaries import LayerSummaries, to_device
from .summary_keeper import NoRoom, SummaryKeeper
from .topk_options import DENSE_BELOW_DEFAULT, BlockTopKOptions
from .topk_plan import STATS, StepPlan, step_key
from .topk_reuse import KeptChoices

__all__ = ["DENSE_BELOW_DEFAULT", "BlockTopK", "BlockTopKOptions"]

logger = logging.getLogger("vllm.ucm_connector.sparse")


class BlockTopK(SparseMethod):
    name = "block_topk"

    def __init__(self, options: BlockTopKOptions, kernels: str = "auto") -> None:
        self.options = options
        # "auto": Triton on CUDA where it is installed, else torch; "torch"
        # or "triton" force one (benchmarks and tests compare them).
        self.kernels = kernels
        self._channels = KeyChannels(options.channels) if options.channels is not None else None
        self._keeper = SummaryKeeper(parts=None if self._channels is not None else options.parts,
                                     bounds=options.score == "bound")
        self._thin_from = options.thin_from()
        self._plan: StepPlan | None = None
        self._plan_step: int | None = None  # the engine step index of the last plan
        # Counters on the device (see STATS), and those only the host sees.
        self._totals: torch.Tensor | None = None
        self._host_stats = SparseStats()
        self._keep_tables: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._kept = KeptChoices(options.reselect_every)
        self._query_tokens = 1              # the most query tokens of a decode row (1 + drafts verified)

    @classmethod
    def from_config(cls, options: Mapping[str, Any]) -> "BlockTopK":
        return cls(BlockTopKOptions.parse(options))

    @property
    def _layers(self) -> dict[str, LayerSummaries]:
        """Each layer's summaries, by layer name."""
        return self._keeper.layers

    def stats(self) -> SparseStats:
        self._flush_plan()
        out = dataclasses.replace(self._host_stats)
        if self._totals is not None:
            for name, value in zip(STATS, self._totals.tolist()):
                setattr(out, name, getattr(out, name) + value)
        return out

    def reset_stats(self) -> None:
        self._flush_plan()
        self._host_stats = SparseStats()
        if self._totals is not None:
            with torch.inference_mode():
                self._totals.zero_()

    def speculate(self, draft_tokens: int) -> None:
        """Rows of up to ``1 + draft_tokens`` query tokens decode: they are
        thinned like rows of one, scored with their first query token (the
        one that is not a draft), and their tail keeps every block that
        holds one of their tokens."""
        self._query_tokens = 1 + max(0, int(draft_tokens))

    # -- step ----------------------------------------------------------------

    def begin_step(self, step: StepInfo) -> None:
        self._flush_plan()
        self._plan = None
        self._keeper.begin_step(step)

    def _step_plan(self, batch: AttentionBatch) -> StepPlan:
        key = step_key(batch)
        plan = self._plan
        if plan is not None and key is not None and plan.key == key:
            return plan
        self._flush_plan()
        plan = self._plan = StepPlan.make(key, batch, self.options, self._thin_from, self._query_tokens)
        # A choice is reused at the engine's next step: a drafter's forward
        # (EAGLE's, MTP's) runs inside the target's step, with calls of
        # other shapes, and does not make it older.  Without a step index
        # every plan is a step of its own.
        if batch.step is None or batch.step != self._plan_step:
            self._kept.new_step()
        self._plan_step = batch.step
        return plan

    def _flush_plan(self) -> None:
        """Add the counts of the plan's calls counted on the host."""
        self._kept.flush(self._totals)
        plan = self._plan
        if plan is not None and plan.uncounted_calls and plan.call_increment is not None:
            # The counters are made during vLLM's forward, as inference
            # tensors; stats() may come from outside it.
            with torch.inference_mode():
                self._totals += plan.call_increment * plan.uncounted_calls
            plan.uncounted_calls = 0

    # -- start-up ------------------------------------------------------------

    def warm_up(self, example: AttentionBatch) -> int:
        """Launch once, on scratch tensors, every Triton kernel variant that
        calls of ``example``'s layer can launch, so that none is compiled in
        the middle of serving (a compile holds up every running request,
        about a second each on a GPU machine's first run).  A variant is set
        by the layer's shapes and dtypes, these options, the kind of call
        (decode rows only or not; keys folded in the scoring launch or
        before it; a choice reused) and the power of two above the longest
        row's block count: from the first count that can be thinned
        (``dense_below``, the budget) to the block table's width.  Only the
        example's dtypes and shapes matter.  Returns the launches made (0
        where the torch path runs)."""
        device = example.query.device
        if not self._use_triton(device) or example.key is None:
            return 0
        try:
            return self._warm_up(example, device)
        except Exception as exc:  # a kernel that cannot be built here never fails a layer call
            logger.warning("ucm-connector: block_topk's Triton kernels cannot run here (%s: %s)"
                           "; its selection runs as torch ops instead (the same blocks, more launches)",
                           type(exc).__name__, exc)
            self.kernels = "torch"
            return 0

    def _warm_up(self, example: AttentionBatch, device: torch.device) -> int:
        if self._channels is not None:
            # Calls are projected onto a layer's channels before anything
            # launches: the shapes, not which channels, set the variants.
            example = LayerChannels.placeholder(self._channels.count, example.num_kv_heads, example.head_size,
                                                device).project(example)
        block_size, top = example.block_size, example.block_table.shape[1]
        # One decode row with nothing in it: the kernels read and write no block.
        batch = dataclasses.replace(
            example, layer_name="warm-up", query=example.query[:1], key=example.key[:1],
            slot_mapping=torch.full_like(example.slot_mapping[:1], -1),
            query_start_loc=torch.tensor([0, 1], dtype=example.query_start_loc.dtype, device=device),
            seq_lens=torch.zeros(1, dtype=example.seq_lens.dtype, device=device),
            block_table=torch.zeros((1, top), dtype=example.block_table.dtype, device=device),
            num_cache_blocks=1, step=None, max_query_len=1)
        layer = self._keeper.scratch_layer(batch)
        epochs = torch.zeros(2, dtype=torch.int64, device=device)
        totals = torch.zeros(len(STATS), dtype=torch.int64, device=device)
        kept = KeptChoices(self.options.reselect_every)
        # Decode calls fold their keys even where nothing can be thinned.
        triton_select.fold_decode(layer, batch.key, batch.slot_mapping, epochs, batch.pages)
        launches = 1
        if self._thin_from is None:
            return launches
        first = max(self._thin_from, -(-self.options.dense_below_on(device) // block_size))
        wp, last_wp = max(16, triton_select.pow2(first)), max(16, triton_select.pow2(top))
        # (decode rows only, keys folded in the scoring launch): the scoring
        # launch's variants, the same at every width (under speculative
        # decoding keys are never folded there).
        kinds = ((True, (epochs,)), (True, None), (False, None))[1 if self._query_tokens > 1 else 0:]
        while wp <= last_wp:
            plan = StepPlan.make(None, dataclasses.replace(batch, max_seq_len=min(wp, top) * block_size),
                                 self.options, self._thin_from, self._query_tokens)
            table, seq_lens = plan.outputs(batch)
            keep = self._keep_table(plan.width, device)
            for decode_only, fold in kinds:
                choice = kept.buffers(1, plan.keep_max, device)
                triton_select.score_and_select(
                    layer, batch, width=plan.width, keep=keep, sink_blocks=self.options.sink_blocks,
                    local_blocks=self.options.local_blocks, bound=self.options.score == "bound",
                    query_in_order=decode_only, out_table=table, out_seq_lens=seq_lens, totals=totals,
                    logits=plan.logits(batch), fold=fold, choice=choice, query_tokens=self._query_tokens)
                launches += 2
                if choice is not None:
                    kept.keep(batch.layer_name, choice)
            if kept.every > 1:
                kept.new_step()
                kept.reuse(batch.layer_name, batch, plan, (keep, totals))
                launches += 1
            kinds = kinds[-1:]
            wp *= 2
        return launches

    # -- layer ---------------------------------------------------------------

    def _use_triton(self, device: torch.device) -> bool:
        if self.kernels == "torch":
            return False
        if self.kernels == "triton":
            return True
        return device.type == "cuda" and triton_select.available()

    def _device_totals(self, device: torch.device) -> torch.Tensor:
        if self._totals is None or self._totals.device != device:
            self._totals = torch.zeros(len(STATS), dtype=torch.int64, device=device)
        return self._totals

    def before_attention(self, batch: AttentionBatch) -> BlockSelection | None:
        plan = self._step_plan(batch)
        device = batch.query.device
        keeper = self._keeper
        totals = self._device_totals(device)
        if self._channels is not None:
            channels = self._channels.layer(batch.layer_name)
            if channels.chosen is None and not plan.dense and batch.pages is not None:
                t = plan.tensors(batch)
                channels.choose(batch.pages, t.table, t.valid)
            if channels.chosen is None or batch.pages is None:
                # Nothing to thin before the channels are chosen (or no pages
                # to choose them and to catch up from): dense.
                keeper.left_dense(plan)
                plan.count_call(batch)
                return None
            batch = channels.project(batch)
        epochs = keeper.epochs.get(batch.num_cache_blocks, device)
        try:
            layer = keeper.layer(batch)
        except NoRoom:                          # no device memory for its summaries: dense
            plan.count_call(batch)
            return None
        keeper.apply_pending(layer, batch, epochs, totals)
        if plan.below_threshold and batch.pages is not None:
            keeper.leave_behind(layer, plan)
            plan.count_call(batch)
            return None
        triton = self._use_triton(device)
        checking = keeper.checking()
        has_keys = batch.key is not None and batch.slot_mapping is not None
        if not plan.dense and batch.pages is not None and keeper.due(layer):
            keeper.catch_up(layer, batch, plan, epochs, totals)
            has_keys = False                   # the pages already hold this call's keys
        reuse = not plan.dense and not checking and self._kept.reusable(batch.layer_name)
        # A decode-only call on the Triton path folds its keys in the scoring
        # kernel (one launch fewer); otherwise the keys are folded first.
        # Under speculative decoding a slot is written again once its draft
        # is rejected: folding would count both keys, so the blocks a call
        # completes are summarised again from their pages (where they cannot
        # be read, such a block loses its summary and is read whole).
        speculating = self._query_tokens > 1
        fast = triton and plan.decode_only and not speculating
        fused = fast and not plan.dense and not checking and has_keys and not reuse
        if has_keys and not fused:
            if fast:
                triton_select.fold_decode(layer, batch.key, batch.slot_mapping, epochs, batch.pages)
            else:
                write = plan.write_plan(batch, layer.trash)
                layer.add_keys(batch.key, write, epochs, batch.pages)
                if speculating and batch.pages is not None:
                    layer.remake_completed(write, epochs, batch.pages)
                elif speculating:
                    layer.distrust_rewritten(write)
        if plan.dense:
            plan.count_call(batch)
            return None
        if reuse:
            kernel = (self._keep_table(plan.width, device), totals) if triton else None
            return self._kept.reuse(batch.layer_name, batch, plan, kernel)
        unsummarized = keeper.refresh_stale(layer, batch, plan, epochs, self._host_stats) if checking else None
        if triton and unsummarized is None:
            return self._select_triton(layer, batch, plan, (epochs,) if fused else None)
        selection, positions = torch_select.select(layer, batch, plan, self.options.score, unsummarized, totals)
        if unsummarized is None:
            self._kept.record(batch.layer_name, batch, plan, positions)
        return selection

    def _select_triton(self, layer: LayerSummaries, batch: AttentionBatch, plan: StepPlan,
                       fold: tuple | None) -> BlockSelection:
        table, seq_lens = plan.outputs(batch)
        choice = self._kept.buffers(plan.num_rows, plan.keep_max, batch.query.device)
        triton_select.score_and_select(
            layer, batch, width=plan.width, keep=self._keep_table(plan.width, batch.query.device),
            sink_blocks=self.options.sink_blocks, local_blocks=self.options.local_blocks,
            bound=self.options.score == "bound", query_in_order=plan.decode_only,
            out_table=table, out_seq_lens=seq_lens, totals=self._totals, logits=plan.logits(batch), fold=fold,
            choice=choice, query_tokens=self._query_tokens)
        if choice is not None:
            self._kept.keep(batch.layer_name, choice)
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
