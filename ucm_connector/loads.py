"""The three ways of loading a step's blocks, one per ``LoadMode``.

* ``SyncLoads``: before the step's forward pass, in the engine's thread;
  ``start_load_kv`` returns when done;
* ``AsyncLoads`` (``load_kv_async``): on a loader thread while the engine
  runs other requests; ``get_finished`` reports each request when its
  blocks are in;
* ``LayerLoads`` (``load_layerwise``): read on the loader thread, copied
  layer by layer, so layer i's attention waits only for layer i's pages.

Every way answers the same questions (a step begins, start, wait for a
layer, this step's failures, what finished, the errors to report), so the
worker reads the same for each.  This step's failures and the errors to
report are kept apart: vLLM may take the errors before the step's saves
(with a speculator it calls ``wait_for_save`` after the draft model), and
the saves must still see them.  This module decides when and on which
thread blocks are read; reading, checking and copying them is
``BlockReader``'s.  It must not import vLLM.
"""

from __future__ import annotations

import threading
import time

from .blockio import JobThread
from .config import LoadMode
from .layer_copies import LayerScatter
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
        self._step: set[int] = set()

    def begin_step(self) -> None:
        self._step = set()

    def start(self, plans: list[BlockPlan]) -> None:
        t0 = time.perf_counter()
        try:
            _, bad, _, _ = self.reader.read(plans)
        except Exception as exc:  # a copy that fails costs a recompute, never the step
            self.reader.report.failed("block load", exc)
            bad = {b for plan in plans for b in plan.block_ids}
        self._errors |= bad
        self._step |= bad
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        pass

    def step_failures(self) -> set[int]:
        """Blocks whose load failed in this step, known before its saves
        (taking the errors to report does not clear them)."""
        return set(self._step)

    def finished(self) -> set[str] | None:
        return None

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def drain(self) -> None:
        """Return once no copy into the pages is queued or running."""

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
        self._thread = JobThread(self._run, on_start=reader.transfer.bind_thread)

    def begin_step(self) -> None:
        pass

    def start(self, plans: list[BlockPlan]) -> None:
        stream = _engine_stream() if self.reader.transfer.on_cuda else None
        self._thread.put(*[(plan, stream) for plan in plans])

    def _run(self, job) -> None:
        plan, stream = job
        t0 = time.perf_counter()
        bad: set[int] = set(plan.block_ids)
        try:
            # The engine's stream is not made to wait for these copies: the
            # request is reported (and scheduled) only once they are done.
            _, bad, _, copies = self.reader.read([plan], after=stream, ordered=False)
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

    def drain(self) -> None:
        self._thread.flush()

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
        self.scatters: list[LayerScatter] = []


class LayerLoads:
    """Reads a step's blocks on the loader thread and copies them into the
    pages layer by layer; the forward pass of layer i waits only for layer
    i's pages.  On CPU the loader thread copies layer after layer; on CUDA
    it issues each layer's upload on a side stream, and layer i's attention
    waits for it on the device (an event), not on the host.  A load larger
    than the pool, or a CUDA device where layer copies cannot be made
    (``can_copy_by_layer``), is copied whole: every layer is ready at once."""

    mode = LoadMode.LAYER

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._job: _LayerJob | None = None       # its errors not yet reported
        self._step_job: _LayerJob | None = None  # this step's
        self._thread = JobThread(self._run, on_start=reader.transfer.bind_thread)

    def begin_step(self) -> None:
        self._step_job = None

    def start(self, plans: list[BlockPlan]) -> None:
        stream = _engine_stream() if self.reader.transfer.on_cuda else None
        self._job = self._step_job = _LayerJob(plans, self.reader.transfer.num_layers, stream)
        self._thread.put(self._job)

    def _run(self, job: _LayerJob) -> None:
        t0 = time.perf_counter()
        transfer = self.reader.transfer
        num_blocks = sum(len(plan.block_ids) for plan in job.plans)
        try:
            if num_blocks > self.reader.pool.capacity or not transfer.can_copy_by_layer:
                # More rows than the pool holds at once: read and copy a
                # pool's worth at a time; the layers are ready together.
                _, job.bad_block_ids, _, job.copies = self.reader.read(job.plans, after=job.stream)
            else:
                _, job.bad_block_ids, chunks, _ = self.reader.read(job.plans, scatter=False)
                made: dict[int, LayerScatter] = {}
                try:
                    for k, chunk in enumerate(chunks):
                        if chunk.good:
                            made[k] = transfer.layer_scatter(chunk.good_ids, chunk.rows, row_ids=chunk.good,
                                                             after=job.stream)
                            # Known at once: the engine orders after it even if a later one fails.
                            job.scatters.append(made[k])
                    for i in range(transfer.num_layers):
                        for scatter in job.scatters:
                            scatter.layer(i)
                        job.layer_done[i].set()
                finally:
                    # Each chunk's rows come back once what was issued from
                    # them is done (after a failure, nothing more is issued).
                    for k, chunk in enumerate(chunks):
                        chunk.rows.release(after=made[k].abort() if k in made else None)
        except Exception as exc:  # every block of the job counts as failed
            self.reader.report.failed("block load", exc)
            job.bad_block_ids = {b for plan in job.plans for b in plan.block_ids}
        finally:
            for event in job.layer_done:
                event.set()
            job.done.set()
        self.reader.stats.add(load_seconds=time.perf_counter() - t0)

    def wait_for_layer(self, layer: int) -> None:
        job = self._step_job
        if job is not None:
            job.layer_done[layer].wait()
            for scatter in job.scatters:
                scatter.order(layer)
            for copy in job.copies:
                copy.order_stream()

    @staticmethod
    def _settled(job: _LayerJob | None) -> set[int]:
        """The job's bad blocks, once it is done; what the engine queues
        from now on (this step's saves, the next step) comes after every
        layer's copy, also after that of a layer whose attention never
        waited for it."""
        if job is None:
            return set()
        job.done.wait()
        for scatter in job.scatters:
            scatter.abort().order_stream()
        for copy in job.copies:
            copy.order_stream()
        return set(job.bad_block_ids)

    def step_failures(self) -> set[int]:
        return self._settled(self._step_job)

    def finished(self) -> set[str] | None:
        return None

    def take_errors(self) -> set[int]:
        job, self._job = self._job, None
        return self._settled(job)

    def drain(self) -> None:
        self._thread.flush()

    def close(self) -> None:
        self._thread.close()


LOADS = {LoadMode.SYNC: SyncLoads, LoadMode.ASYNC: AsyncLoads, LoadMode.LAYER: LayerLoads}
