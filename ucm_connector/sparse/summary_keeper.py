"""``block_topk``'s bookkeeping of its summaries: which blocks' summaries
can be trusted, in every layer, and bringing the others up to date.

Owns every layer's ``LayerSummaries`` (made on a layer's first call, made
again for a bigger cache; all layers share one ``made_at``), the block
epochs, and what the step hook tells about blocks filled behind the forward
(``begin_step``): blocks a started request found in the cache (checked
against their pages at each layer's next call, ``apply_pending``) and page
copies.  It also keeps the requests whose keys went by unseen: those
running when the method started or its summaries were made again (found by
a census at the next step that names its requests; their blocks are looked
for on the device, ``refresh_stale``, until they finish), and those
scheduled in steps left dense by ``dense_below`` (a layer left behind
rebuilds the blocks its rows read from the pages, ``catch_up``, at its next
thinned call and then at each step that runs a request it has not covered
yet, until every such request has been covered or has finished).

What it must not do: choose blocks, or wait for the device except in
``refresh_stale`` (``checking`` says when that is needed).  Knows tensors
and summaries; nothing of vLLM.
"""

from __future__ import annotations

import logging

import torch

from .base import AttentionBatch, SparseStats, StepInfo
from .summaries import BlockEpochs, LayerSummaries, to_device
from .topk_plan import STATS, StepPlan

_FROM_PAGES = STATS.index("blocks_summarized_from_pages")


logger = logging.getLogger("vllm.ucm_connector.sparse")

#: Device memory left free beside a layer's summaries (CUDA): what the
#: runtime, communication buffers and CUDA graphs may still take.
MEMORY_MARGIN_NBYTES = 512 << 20


class NoRoom(Exception):
    """A layer's summaries do not fit in the device memory vLLM left free:
    the layer stays dense."""


def device_free_nbytes(device: torch.device) -> int | None:
    """Device memory free outside every allocator (None: not a CUDA
    device, whose memory is not split ahead of time).  vLLM sizes its KV
    cache to ``gpu_memory_utilization`` before any summary exists, so
    summaries must fit in what it leaves."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


class PendingBlocks:
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


class SummaryKeeper:
    """The summaries of every layer, and what is known of how current they are."""

    def __init__(self, parts: int | None, bounds: bool) -> None:
        # None: a slice per token (``channels``); such layers are made late
        # (once their channels are chosen), after keys went by, and each
        # starts behind (``catch_up``).
        self._parts = parts
        self._bounds = bounds
        self.epochs = BlockEpochs()
        self.layers: dict[str, LayerSummaries] = {}
        self.no_room: set[str] = set()      # layers left dense: their summaries did not fit
        # Shared by all layers' summaries: every layer sees the same writes
        # and refreshes the same stale blocks in the same step.
        self._made_at: torch.Tensor | None = None
        # Requests running when the method started (or when its summaries
        # were rebuilt for a bigger cache) that have not finished: their
        # earlier keys went by unseen.  None: not known (no step told us yet).
        self._unseen_reqs: set[str] | None = None
        self._census_due = True
        self._no_pages = False              # some layer's pages could not be read
        self._refresh: PendingBlocks | None = None
        self._copies: PendingBlocks | None = None
        # Requests scheduled in steps left dense by dense_below whose keys no
        # rebuild has covered yet, and this step's requests (None: unknown).
        self._skipped_reqs: set[str] = set()
        self._step_reqs: set[str] | None = None

    def begin_step(self, step: StepInfo) -> None:
        """Take note of what the step hook says: blocks filled behind the
        forward, page copies, and which requests run, start and finish."""
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
                self.epochs.bump(blocks)
                full.update(blocks[:-1])
                last_fill = start.num_computed_tokens - (num - 1) * block_size
                if last_fill == block_size:
                    full.add(blocks[-1])
                else:
                    partial[blocks[-1]] = max(partial.get(blocks[-1], 0), last_fill)
        for b in full:
            partial.pop(b, None)
        self._refresh = PendingBlocks(sorted(full), list(partial), list(partial.values())) \
            if full or partial else None
        self._copies = None
        if step.block_copies:
            self.epochs.bump(dst for _, dst in step.block_copies)
            self._copies = PendingBlocks([src for src, _ in step.block_copies],
                                         [dst for _, dst in step.block_copies])
        self._step_reqs = None if step.scheduled_req_ids is None else set(step.scheduled_req_ids)
        self._skipped_reqs -= step.finished_req_ids
        if step.finished_req_ids:
            for layer in self.layers.values():
                if layer.awaited:
                    layer.awaited -= step.finished_req_ids
                    if not layer.awaited:       # every one of them has finished
                        layer.behind, layer.awaited = False, None
        if step.scheduled_req_ids is None:
            self._unseen_reqs, self._census_due = None, False
        elif self._census_due:
            self._unseen_reqs = set(step.scheduled_req_ids) - {s.req_id for s in step.started}
            self._census_due = False
        elif self._unseen_reqs is not None:
            # A request that (re)starts brings its cached blocks through the
            # bumps above; one that finishes takes its blocks with it.
            self._unseen_reqs -= {s.req_id for s in step.started}
            self._unseen_reqs -= step.finished_req_ids

    def checking(self) -> bool:
        """Whether a step must look on the device for blocks whose summaries
        are not current (and so wait for it once per step)."""
        return self._unseen_reqs is None or bool(self._unseen_reqs) or self._no_pages

    def _shape(self, batch: AttentionBatch, num_blocks: int) -> tuple[tuple, int]:
        # Slice sums in fp32: scoring reads them as fp32 without a conversion
        # (bf16 copies of sums measured no faster and lost agreement with
        # parts).  One slice per token (``channels``) holds a key as it is:
        # in a 16-bit model dtype, exact, and half the bytes to score.
        bs = batch.block_size
        parts = bs if self._parts is None else self._parts if bs % self._parts == 0 else 1
        dtype = torch.float32
        if self._parts is None and batch.query.dtype in (torch.bfloat16, torch.float16):
            dtype = batch.query.dtype
        return (num_blocks, bs, batch.num_kv_heads, batch.head_size, dtype), parts

    def scratch_layer(self, batch: AttentionBatch) -> LayerSummaries:
        """Summaries of one block, made as ``batch``'s layer's would be
        (kernels compiled for one serve the other); nothing is kept."""
        shape, parts = self._shape(batch, 1)
        return LayerSummaries(*shape, batch.query.device, parts=parts, bounds=self._bounds)

    def layer(self, batch: AttentionBatch) -> LayerSummaries:
        """The summaries of ``batch``'s layer, made (again) where there are
        none for a cache of this size; notes a layer whose pages cannot be
        read."""
        layer = self.layers.get(batch.layer_name)
        if layer is None or layer.num_blocks < batch.num_cache_blocks:
            if batch.layer_name in self.no_room:
                raise NoRoom(batch.layer_name)
            made_at = self._made_at
            device = batch.query.device
            if made_at is None or made_at.numel() < batch.num_cache_blocks + 1 or made_at.device != device:
                if self.layers:
                    # A bigger cache: every layer starts over, and the keys of
                    # running requests are unseen until the next census.
                    self._unseen_reqs, self._census_due = None, True
                self.layers.clear()
                made_at = self._made_at = torch.full((batch.num_cache_blocks + 1,), -1, dtype=torch.int64,
                                                     device=device)
            shape, parts = self._shape(batch, batch.num_cache_blocks)
            need = LayerSummaries.nbytes(*shape, parts=parts, bounds=self._bounds)
            self._make_room(batch.layer_name, need, device)
            try:
                layer = LayerSummaries(*shape, device, parts=parts, bounds=self._bounds, made_at=made_at)
            except torch.OutOfMemoryError:
                self._no_room(batch.layer_name, need, device)
            # Requests whose keys went by in calls left dense are still
            # to be rebuilt in these summaries too.
            layer.behind = self._parts is None or bool(self._skipped_reqs)
            self.layers[batch.layer_name] = layer
        if batch.pages is None:
            self._no_pages = True
        return layer

    def _make_room(self, layer_name: str, nbytes: int, device: torch.device) -> None:
        free = device_free_nbytes(device)
        if free is not None and nbytes + MEMORY_MARGIN_NBYTES > free:
            self._no_room(layer_name, nbytes, device, free)
        if not self.layers:
            logger.info("ucm-connector: block_topk's block summaries take %.1f MiB of %s memory per layer",
                        nbytes / (1 << 20), device)

    def _no_room(self, layer_name: str, nbytes: int, device: torch.device, free: int | None = None) -> None:
        if not self.no_room:
            logger.warning(
                "ucm-connector: block_topk's block summaries need %.1f MiB of %s memory per layer, and %s; "
                "layer %s and any other that does not fit stay dense. Lower --gpu-memory-utilization "
                "to leave room for them (about %.1f MiB per layer, plus %d MiB), or make them smaller "
                "(block_topk options parts: 1, score: mean)", nbytes / (1 << 20), device,
                "it is out of memory" if free is None else f"{free / (1 << 20):.1f} MiB are free",
                layer_name, nbytes / (1 << 20), MEMORY_MARGIN_NBYTES >> 20)
        self.no_room.add(layer_name)
        raise NoRoom(layer_name)

    def apply_pending(self, layer: LayerSummaries, batch: AttentionBatch, epochs: torch.Tensor,
                      totals: torch.Tensor) -> None:
        """This step's blocks filled behind the forward (known on the host
        from begin_step): checked against their pages, once per layer."""
        pending = self._refresh
        if pending is not None and pending.first_time(batch.layer_name) and batch.pages is not None:
            full, partial, fills = pending.tensors(epochs.device)
            kept_rebuilt = layer.refresh_known(full, partial, fills, epochs, batch.pages)
            # blocks_summarized_from_pages, then blocks_probed_unchanged (STATS' order).
            totals[_FROM_PAGES:_FROM_PAGES + 2] += kept_rebuilt.flip(0)
        copies = self._copies
        if copies is not None and copies.first_time(batch.layer_name):
            src, dst, _ = copies.tensors(epochs.device)
            layer.copy_blocks(src, dst, epochs)

    def leave_behind(self, layer: LayerSummaries, plan: StepPlan) -> None:
        """A call left dense for its length: not even its keys are folded
        (that would cost launches a dense call does not otherwise pay); the
        layer's next thinned call rebuilds what its rows read (``catch_up``)."""
        layer.behind = True
        layer.awaited = None
        self.left_dense(plan)

    def left_dense(self, plan: StepPlan) -> None:
        """A call of this step went by without folding its keys: its
        requests are rebuilt from the pages by the next thinned calls."""
        if not plan.step_reqs_noted:
            plan.step_reqs_noted = True
            self._skipped_reqs |= self._step_reqs if self._step_reqs is not None else set()

    def due(self, layer: LayerSummaries) -> bool:
        """Whether a thinned call of ``layer`` must rebuild what its rows
        read (``catch_up``): the layer is behind, and either it has not
        rebuilt since, or a request whose keys it has not seen runs in this
        step (or which ones run is not known)."""
        if not layer.behind:
            return False
        return layer.awaited is None or self._step_reqs is None or not layer.awaited.isdisjoint(self._step_reqs)

    def catch_up(self, layer: LayerSummaries, batch: AttentionBatch, plan: StepPlan,
                 epochs: torch.Tensor, totals: torch.Tensor) -> None:
        """Rebuild, from the pages (which hold this call's keys too), the
        summaries of every block this call's rows read (counted in
        ``totals``, the device counters)."""
        t = plan.tensors(batch)
        layer.rebuild(t.table, t.valid, t.fills, epochs, batch.pages)
        totals[_FROM_PAGES] += t.valid.sum()
        if not plan.step_reqs_noted:
            # Requests that wrote keys while calls were left dense and
            # are not among this step's rows keep every layer rebuilding
            # at its thinned calls until they have been (or have ended).
            plan.step_reqs_noted = True
            if self._step_reqs is None:
                self._skipped_reqs.clear()
            else:
                self._skipped_reqs -= self._step_reqs
        layer.behind = bool(self._skipped_reqs)
        layer.awaited = set(self._skipped_reqs) if layer.behind else None

    def refresh_stale(self, layer: LayerSummaries, batch: AttentionBatch, plan: StepPlan,
                      epochs: torch.Tensor, host_stats: SparseStats) -> torch.Tensor | None:
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
            host_stats.blocks_kept_unsummarized += int(stale.sum())
            return stale
        kept, rebuilt = layer.refresh(t.table[stale], t.fills[stale], epochs, batch.pages)
        host_stats.blocks_probed_unchanged += kept
        host_stats.blocks_summarized_from_pages += rebuilt
        return None
