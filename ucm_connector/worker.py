"""Worker role: move whole blocks between the paged KV cache and the store.

``UCMWorker`` composes small parts, one job each, and answers vLLM's worker
hooks with them:

* ``BlockReader`` (``reader.py``) reads a batch of blocks with one
  ``get_into`` straight into rows of a pool, checks every envelope and
  checksum, copies the good blocks into their pages and deletes bad ones
  from the store;
* one way of loading, by ``LoadMode`` (``loads.py``): ``SyncLoads``,
  ``AsyncLoads`` or ``LayerLoads``;
* ``Saves`` (``saves.py``) gathers a step's new blocks out of the cache into
  rows of a bounded pool and hands them to one background writer, so the
  engine never waits on the store's I/O;
* with ``load_policy: auto``, measurements for the scheduler's decision
  (``measure.py``): every store read timed per tier, every step's forward
  pass timed, and ``Prober`` (here), which reads a few blocks of a tier the
  scheduler does not load from on a thread of its own, for the timing only.

A device-specific copy path only changes how the reader and the saves move
bytes (``BlockTransfer``).  This module wires the parts together and times
steps; it moves no bytes itself, and must not import vLLM (the worker side
runs where vLLM cannot).  ``BlockReader``, ``SyncLoads``, ``AsyncLoads``,
``LayerLoads`` and ``Saves`` stay importable from here.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from store_backends import KVStore, StoreError

from . import blockfmt
from .blockio import JobThread, Reporter, logger
from .config import LoadMode
from .counters import StatsCollector
from .hashing import keys_for_rank
from .loads import LOADS, AsyncLoads, LayerLoads, SyncLoads
from .measure import LoadObserver, StepClock, observe_reads, tiers_of
from .outcomes import NOT_STORED, OutcomeLog
from .plans import BlockPlan, BlockProbe
from .reader import BlockReader
from .saves import Saves
from .transfer import BlockTransfer

__all__ = ["AsyncLoads", "BlockReader", "LayerLoads", "Prober", "Saves", "SyncLoads", "UCMWorker"]


# -- probes ---------------------------------------------------------------------


class Prober:
    """Reads a few blocks of one tier into scratch buffers, on a thread of
    its own, so that the reads are timed (the store given is the timed one):
    how ``load_policy: auto`` keeps measuring a tier it does not load from.
    Nothing read is checked or copied anywhere; at most one probe per tier
    waits or runs, further ones are dropped."""

    def __init__(self, store: KVStore, block_nbytes: int, tp_rank: int) -> None:
        self.tiers = tiers_of(store)
        self.block_nbytes = block_nbytes
        self.tp_rank = tp_rank
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._thread = JobThread(self._run)

    def probe(self, probes: list[BlockProbe]) -> None:
        for probe in probes:
            if not probe.keys or not 0 <= probe.tier < len(self.tiers):
                continue
            with self._lock:
                if probe.tier in self._busy:
                    continue
                self._busy.add(probe.tier)
            self._thread.put(probe)

    def _run(self, probe: BlockProbe) -> None:
        keys = keys_for_rank(probe.keys, self.tp_rank)
        while len(self._buffers) < len(keys):
            self._buffers.append(bytearray(self.block_nbytes))
        try:
            self.tiers[probe.tier].get_into(keys, [memoryview(b) for b in self._buffers[:len(keys)]])
        except StoreError:
            pass   # a store that fails is the loads' business; a probe only times
        finally:
            with self._lock:
                self._busy.discard(probe.tier)

    def close(self) -> None:
        self._thread.close()


# -- the worker -------------------------------------------------------------------


class UCMWorker:
    """The worker role's hooks, over one way of loading and the saves."""

    def __init__(self, *, store: KVStore, namespace_digest: bytes, tp_rank: int, num_blocks: int,
                 max_pending_nbytes: int, stats: StatsCollector, blocks_per_request: int = 0,
                 load_mode: LoadMode | str = LoadMode.SYNC, events: OutcomeLog | None = None,
                 share_failures: Callable[[set[int]], set[int]] | None = None,
                 observer: LoadObserver | None = None, save_layerwise: bool | None = False,
                 copies: tuple[bool, bool] = (True, True)) -> None:
        self.store = store
        # (loads, saves): which ways this engine copies KV at all.
        self.copies = copies
        self.namespace_digest = namespace_digest
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.max_pending_nbytes = max_pending_nbytes
        self.stats = stats
        self.blocks_per_request = blocks_per_request
        self.load_mode = LoadMode(load_mode)
        # None: layer by layer on CUDA, after the forward pass on CPU (the
        # faster way on each, benchmarks/RESULTS.md); decided at registration.
        self._save_layerwise_asked = save_layerwise
        self.save_layerwise = bool(save_layerwise)
        self.events = events or OutcomeLog(enabled=False)
        self._share_failures = share_failures
        self._report = Reporter(stats)
        self.transfer: BlockTransfer | None = None
        self.loads: SyncLoads | AsyncLoads | LayerLoads | None = None
        self.saves: Saves | None = None
        self._layer_index: dict[str, int] = {}
        # load_policy auto: what the scheduler's decision is made of.
        self.observer = observer
        self.clock: StepClock | None = None
        self.prober: Prober | None = None
        self._suspended = False         # sleep mode: the KV cache is unmapped

    def register_kv_caches(self, kv_caches) -> None:
        self.transfer = BlockTransfer(kv_caches, self.num_blocks)
        if self._save_layerwise_asked is None:
            self.save_layerwise = self.transfer.on_cuda
        self.payload_nbytes = self.transfer.payload_nbytes
        self.block_nbytes = blockfmt.block_nbytes(self.payload_nbytes)
        self._layer_index = {layer.name: i for i, layer in enumerate(self.transfer.layers)}
        parts = dict(store=self.store, transfer=self.transfer, namespace_digest=self.namespace_digest,
                     tp_rank=self.tp_rank, stats=self.stats, events=self.events, report=self._report)
        # Loads: a whole prompt's blocks at once where they fit in 512 MiB
        # (more are loaded a pool's worth at a time), touched now rather
        # than during the first hit.  Saves: the backlog bound itself, its
        # pages mapped as they are first used on CPU.
        load_rows = max(1, min(self.blocks_per_request or 1, (512 << 20) // self.block_nbytes))
        self.load_pool = self.transfer.row_pool(self.block_nbytes, blockfmt.HEADER_NBYTES,
                                                load_rows * self.block_nbytes)
        self.save_pool = self.transfer.row_pool(self.block_nbytes, blockfmt.HEADER_NBYTES,
                                                self.max_pending_nbytes, prefault=self.transfer.on_cuda)
        reader = dict(parts)
        if self.observer is not None:
            reader["store"] = observe_reads(self.store, self.observer)
            self.clock = StepClock(self.observer, on_cuda=self.transfer.on_cuda)
            self.prober = Prober(reader["store"], self.block_nbytes, self.tp_rank)
        self._reserve_staging()
        if self.transfer.on_cuda and (self.save_layerwise or self.load_mode is LoadMode.LAYER):
            # Tried here, once, at start-up rather than in a step.  A warning
            # where a layerwise way was asked for; save_layerwise's auto
            # default only says so.
            if not self.transfer.can_copy_by_layer:
                asked = self._save_layerwise_asked is True or self.load_mode is LoadMode.LAYER
                (logger.warning if asked else logger.info)(
                    "ucm-connector: the CUDA runtime's pitched copies are unavailable here; "
                    "load_layerwise uploads all layers at once and save_layerwise copies after "
                    "the forward pass")
        self.loads = LOADS[self.load_mode](BlockReader(**reader, pool=self.load_pool))
        self.saves = Saves(**parts, pool=self.save_pool, share_failures=self._share_failures,
                           layerwise=self.save_layerwise)
        logger.info("ucm-connector: %d layers registered, %d bytes of KV per block and rank",
                    self.transfer.num_layers, self.payload_nbytes)

    def _reserve_staging(self) -> None:
        """At start-up (and waking up), where a shortage is seen at once,
        not at the first copy.  On a thread of its own: vLLM 0.33 registers
        the caches inside a pool of its sleep-mode allocator (``runtime``,
        copied to the host at every sleep and back at wake-up), and torch
        routes only the calling thread's allocations to a pool.  Buffers
        taken in there and given back at a sleep would stay in that pool,
        and waking up would take another set."""
        loads, saves = self.copies
        failed: list[BaseException] = []

        def reserve() -> None:
            try:
                self.transfer.bind_thread()
                self.transfer.reserve_staging(self.save_pool.row_nbytes, gather=saves, scatter=loads)
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=reserve, name="ucm-staging")
        thread.start()
        thread.join()
        try:
            if failed:
                raise failed[0]
        except torch.OutOfMemoryError:
            logger.warning("ucm-connector: no room on the GPU for the KV staging buffers (%d"
                           " MiB) after vLLM took its KV cache; each copy tries again, and a save or load that"
                           " finds none is skipped (the blocks are recomputed). Lower --gpu-memory-utilization",
                           (loads + saves) * self.transfer.staging_nbytes >> 20)

    # -- the hooks, in the order vLLM calls them in a step ------------------------

    def begin_step(self, num_tokens: int, plans: list[BlockPlan], probes: list[BlockProbe],
                   saves: list[BlockPlan] | None = None) -> None:
        """A step's plan is bound: its forward pass is about to run
        (``saves``: the blocks it will save, for ``save_layerwise``)."""
        if self.clock is not None:
            loads_first = bool(plans) and self.load_mode is not LoadMode.ASYNC
            self.clock.begin(num_tokens, loads_first=loads_first)
        if probes and self.prober is not None:
            self.prober.probe(probes)
        if self.loads is not None:
            self.loads.begin_step()
        if self.saves is not None and self.saves.layerwise:
            self.saves.begin(saves or [])

    def load(self, plans: list[BlockPlan]) -> None:
        """``start_load_kv``: start (sync: do) this step's loads."""
        if plans and self.loads is not None:
            if self.clock is None:
                self.loads.start(plans)
                return
            with self.clock.excluded():
                self.loads.start(plans)
            self.clock.loads_done()

    def wait_for_layer(self, layer_name: str) -> None:
        if self.loads is not None:
            if self.clock is None:
                self._wait_for_layer(layer_name)
                return
            with self.clock.excluded():
                self._wait_for_layer(layer_name)

    def _wait_for_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self.loads.wait_for_layer(layer)
            return
        # A layer without a cache of its own (one that reads another
        # layer's) or a name we do not know: wait for every layer.
        for i in range(len(self._layer_index)):
            self.loads.wait_for_layer(i)

    def save_layer(self, layer_name: str) -> None:
        """``save_kv_layer``: that layer's KV of the step is written."""
        if self.saves is not None and self.saves.layerwise:
            layer = self._layer_index.get(layer_name)
            if layer is not None:
                self.saves.layer_done(layer)

    def end_step(self) -> None:
        """``wait_for_save``: the step's forward pass is done."""
        if self.clock is not None:
            self.clock.end()

    def take_measurements(self):
        """``(reads, steps)`` measured since the last call, or None."""
        return self.observer.take() if self.observer is not None else None

    def save(self, plans: list[BlockPlan]) -> None:
        """``wait_for_save``: this step's saves.  Called every step, with or
        without plans, so that load failures are seen step by step."""
        if self.saves is None:
            if plans:
                self.events.add(NOT_STORED, keys_for_rank([k for p in plans for k in p.keys], self.tp_rank))
            return
        self.saves.save(self.saves.drop_tainted(plans, self.loads.step_failures()))

    def get_finished(self) -> set[str] | None:
        """Requests whose asynchronous loads are done; their bad blocks go
        out with this step's load errors."""
        return self.loads.finished() if self.loads is not None else None

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors() if self.loads is not None else set()

    # -- sleep mode (vLLM 0.33's unregister_kv_caches / restore_kv_caches) ---------

    def suspend(self) -> None:
        """Before vLLM unmaps the KV cache: return once no copy into or out
        of the pages is queued or running (an asynchronous load of a request
        aborted by the pause included; a copy into unmapped pages is a
        device fault), and give the device staging buffers back.  The saves'
        writer goes on writing rows already on the host.  Idempotent."""
        if self.transfer is None or self._suspended:
            return
        self._suspended = True
        if self.loads is not None:
            self.loads.drain()
        released = self.transfer.release_staging()
        if released:
            logger.info("ucm-connector: KV cache released for sleep mode; %d MiB of staging buffers "
                        "given back", released >> 20)

    def resume(self) -> None:
        """After vLLM maps the KV cache again (at the same addresses): the
        staging buffers are taken again, as at start-up.  Idempotent."""
        if not self._suspended:
            return
        self._suspended = False
        self._reserve_staging()

    # -- the rest ------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is written."""
        return self.saves.flush(timeout) if self.saves is not None else True

    def close(self) -> None:
        if self.saves is not None:
            self.saves.close()
        if self.loads is not None:
            self.loads.close()
        if self.prober is not None:
            self.prober.close()
        if self.transfer is not None:
            self.save_pool.close()
            self.load_pool.close()
