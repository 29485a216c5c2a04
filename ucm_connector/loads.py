"""The three ways of loading a step's blocks, one per ``LoadMode``.

* ``SyncLoads``: before the step's forward pass, in the engine's thread;
  ``start_load_kv`` returns when done;
* ``AsyncLoads`` (``load_kv_async``): on a loader thread while the engine
  runs other requests; ``get_finished`` reports each request when its
  blocks are in;
* ``LayerLoads`` (``load_layerwise``): read on the loader thread, copied
  layer by layer, so layer i's attention waits only for layer i's pages.

Every way answers the same questions (start, wait for a layer, this step's
failures, what finished, the errors to report), so the worker reads the
same for each.  This module decides when and on which thread blocks are
read; reading, checking and copying them is ``BlockReader``'s.  It must not
import vLLM.
"""

from __future__ import annotations

import threading
import time

from .blockio import JobThread
from .config import LoadMode
from .plans import BlockPlan
from .reader import BlockReader
from .transfer import Transfer


def _engine_stream():
    """The stream the forward pass runs on (CUDA), captured on the engine's
    thread so that a loader thread can order its copies after it."""
    import torch

    return torch.cuda.current_stream() if torch.cuda.is_available() else None


class SyncLoads:
    """Loads done before the forward pass, in the engine's thread: the copy
    into the pages is ordered before the forward pass on the device, the
    host does not wait for it."""

    mode = LoadMode.SYNC

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._errors: set[int] = set()

    def start(self, plans: list[BlockPlan]) -> None:
        t0 = time.perf_counter()
        _, bad, _, _ = self.reader.read(plans)
        self._errors |= bad
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        pass

    def step_failures(self) -> set[int]:
        """Blocks whose load failed in this step, known before its saves."""
        return set(self._errors)

    def finished(self) -> set[str] | None:
        return None

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        pass

class AsyncLoads:
    """Loads on a loader thread; the request waits (vLLM keeps it out of the
    batch) until ``finished`` reports it, its bad blocks with it.  Nothing
    reads a page of an asynchronous load in the step that starts it, and a
    request is reported only once its pages are written."""

    mode = LoadMode.ASYNC

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._recv_errors: set[int] = set()
        self._errors: set[int] = set()
        self._thread = JobThread(self._run)

    def start(self, plans: list[BlockPlan]) -> None:
        stream = _engine_stream() if self.reader.transfer.on_cuda else None
        self._thread.put(*[(plan, stream) for plan in plans])

    def _run(self, job) -> None:
        plan, stream = job
        t0 = time.perf_counter()
        bad: set[int] = set(plan.block_ids)
        try:
            _, bad, _, copies = self.reader.read([plan], after=stream)
            for copy in copies:
                copy.synchronize()   # this thread may wait; the engine does not
        except Exception as exc:  # the loader must outlive any one bad job
            self.reader.report.failed("block load", exc)
        with self._lock:
            self._finished.add(plan.req_id)
            self._recv_errors |= bad
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        pass

    def step_failures(self) -> set[int]:
        return set()

    def finished(self) -> set[str] | None:
        with self._lock:
            finished, self._finished = self._finished, set()
            self._errors |= self._recv_errors
            self._recv_errors = set()
        return finished or None

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._thread.close()


class _LayerJob:
    """One step's loads, copied layer by layer as the forward pass goes."""

    def __init__(self, plans: list[BlockPlan], num_layers: int, stream) -> None:
        self.plans = plans
        self.stream = stream
        self.layer_done = [threading.Event() for _ in range(num_layers)]
        self.done = threading.Event()
        self.bad_block_ids: set[int] = set()
        self.copies: list[Transfer] = []


class LayerLoads:
    """Reads a step's blocks on the loader thread and copies them layer by
    layer; the forward pass of layer i waits only for layer i's pages.  On
    CUDA the upload of every layer is one copy, and layer i's attention
    waits for it on the device (an event), not on the host."""

    mode = LoadMode.LAYER

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._job: _LayerJob | None = None
        self._thread = JobThread(self._run)

    def start(self, plans: list[BlockPlan]) -> None:
        stream = _engine_stream() if self.reader.transfer.on_cuda else None
        self._job = _LayerJob(plans, self.reader.transfer.num_layers, stream)
        self._thread.put(self._job)

    def _run(self, job: _LayerJob) -> None:
        t0 = time.perf_counter()
        transfer = self.reader.transfer
        num_blocks = sum(len(plan.block_ids) for plan in job.plans)
        try:
            if transfer.on_cuda or num_blocks > self.reader.pool.capacity:
                # One upload of every layer (or more rows than the pool
                # holds at once): the layers are ready together.
                _, job.bad_block_ids, _, job.copies = self.reader.read(job.plans, after=job.stream)
            else:
                _, job.bad_block_ids, chunks, _ = self.reader.read(job.plans, scatter=False)
                try:
                    for i in range(transfer.num_layers):
                        for chunk in chunks:
                            if chunk.good:
                                transfer.scatter(chunk.good_ids, chunk.rows.payload, range(i, i + 1),
                                                 row_ids=chunk.good)
                        job.layer_done[i].set()
                finally:
                    for chunk in chunks:
                        chunk.rows.release()
        except Exception as exc:  # every block of the job counts as failed
            self.reader.report.failed("block load", exc)
            job.bad_block_ids = {b for plan in job.plans for b in plan.block_ids}
        finally:
            for event in job.layer_done:
                event.set()
            job.done.set()
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        job = self._job
        if job is not None:
            job.layer_done[layer].wait()
            for copy in job.copies:
                copy.order_stream()

    def step_failures(self) -> set[int]:
        job = self._job
        if job is None:
            return set()
        job.done.wait()
        return set(job.bad_block_ids)

    def finished(self) -> set[str] | None:
        return None

    def take_errors(self) -> set[int]:
        job, self._job = self._job, None
        if job is None:
            return set()
        job.done.wait()
        return set(job.bad_block_ids)

    def close(self) -> None:
        self._thread.close()


LOADS = {LoadMode.SYNC: SyncLoads, LoadMode.ASYNC: AsyncLoads, LoadMode.LAYER: LayerLoads}
