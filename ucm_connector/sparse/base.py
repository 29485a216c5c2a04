"""The interface between vLLM's attention path and a sparse-attention method.

A method sees two things, both described here in vLLM-neutral terms:

* a **step** (``StepInfo``), once per model-runner step, before the forward:
  which requests start (and how much of their KV they found already in the
  cache, from vLLM's prefix cache or from a KV connector), which ones finish,
  which blocks vLLM copied;
* a **layer call** (``AttentionBatch``), once per attention layer per step,
  after the step's new keys are in the paged cache and before the kernel
  reads it.  The method may answer with a ``BlockSelection``: for some decode
  rows, the blocks and the number of tokens the kernel reads instead.

The method never mutates vLLM's metadata.  The patch hands the kernel a copy
of the step's metadata with the selection swapped in and keeps the original
untouched, so "restore after the call" holds by construction; ``after_attention``
is there for methods that keep per-call state.

This module owns only the data types and the abstract class; it must not know
how a backend lays out its metadata or its pages (that is ``patches/``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping


class SparseConfigError(ValueError):
    """A ``sparse`` option is unknown or has a bad value."""


@dataclasses.dataclass(frozen=True)
class RequestStart:
    """A request that (re)enters the running batch this step.

    ``num_computed_tokens`` tokens of it are already in the cache, written by
    someone other than this request's forward passes (vLLM's prefix cache, a
    KV connector's load, or an earlier run before preemption): the method has
    not seen their keys go by.
    """

    req_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the model runner is told about one step, before its forward."""

    block_size: int
    started: tuple[RequestStart, ...] = ()
    finished_req_ids: frozenset[str] = frozenset()
    # (src, dst) block ids whose content vLLM copies before the forward.
    block_copies: tuple[tuple[int, int], ...] = ()
    # Every request the step runs (new, resumed and continuing ones); None
    # when the caller cannot tell.  A method that starts while requests are
    # already running learns from it which of them wrote keys it never saw.
    scheduled_req_ids: frozenset[str] | None = None


@dataclasses.dataclass
class AttentionBatch:
    """One attention layer's call for one step (decoder self-attention only).

    Rows are the step's requests in batch order.  ``query_start_loc``,
    ``seq_lens`` and ``block_table`` are the tensors the kernel would read;
    ``key``/``slot_mapping`` are the keys written into the cache by this
    step for this layer (already in the pages when the method is called).
    """

    layer_name: str
    layer_index: int | None       # position of the layer in the model, when its name tells
    query: Any                    # [num_tokens, num_heads, head_size]
    key: Any | None               # [num_tokens, num_kv_heads, head_size]
    slot_mapping: Any | None      # [num_tokens], -1 for padding
    query_start_loc: Any          # [num_reqs + 1]
    seq_lens: Any                 # [num_reqs]
    block_table: Any              # [num_reqs, max_blocks_per_req]
    block_size: int
    num_cache_blocks: int
    num_kv_heads: int
    head_size: int
    scale: float
    # The keys in the paged cache, for blocks the method did not see being
    # written; None when the backend's page packing cannot be read (the
    # method must then read those blocks rather than guess about them).
    pages: "KeyPages | None" = None
    # Host-side facts vLLM already keeps beside the tensors: reading them
    # costs no device synchronisation, and they fix the shapes of a layer
    # call's work.  ``step`` counts model-runner steps (the same for every
    # layer of a step, never repeated); ``max_seq_len`` / ``max_query_len``
    # bound ``seq_lens`` and the query lengths (an upper bound is fine).
    # None: unknown (a method then works them out, at a synchronisation, or
    # treats every call as a step of its own).
    step: int | None = None
    max_seq_len: int | None = None
    max_query_len: int | None = None


class KeyPages(abc.ABC):
    """Read access to the keys of a layer's paged cache, whatever the
    backend's packing.  ``block_ids`` is a 1-D integer tensor."""

    @abc.abstractmethod
    def read(self, block_ids: Any) -> Any:
        """Keys of whole blocks: ``[n, block_size, num_kv_heads, head_size]``
        (a quantized cache's scaled back: the keys the model wrote, give or
        take the quantization)."""

    def reduce(self, block_ids: Any, parts: int) -> tuple[Any, Any, Any]:
        """For full blocks: elementwise min and max over all tokens
        (``[n, num_kv_heads, head_size]`` each) and the fp32 sum over each
        of ``parts`` equal slices of the tokens (``[n, parts, num_kv_heads,
        head_size]``)."""
        keys = self.read(block_ids)
        n, block_size = keys.shape[:2]
        sums = keys.float().view(n, parts, block_size // parts, *keys.shape[2:]).sum(dim=2)
        return keys.amin(dim=1), keys.amax(dim=1), sums

    @abc.abstractmethod
    def probe(self, block_ids: Any) -> Any:
        """One key element per token, ``[n, block_size]``: token t's element
        at kv head 0, dim ``t % head_size``, as the cache stores it (a
        quantized cache's value, not scaled back).  Cheap; tells whether a
        block still holds the keys a summary was made from."""

    def key_view(self) -> Any | None:
        """The keys as a strided view ``[num_blocks, block_size,
        num_kv_heads, head_size]`` of the cache itself (no copy, values as
        stored), for kernels that read probes from pages directly; None
        where pages are packed (the CPU backend) and only ``read`` can
        unpack them."""
        return None


@dataclasses.dataclass
class BlockSelection:
    """Replacement ``block_table``/``seq_lens`` for one layer call.

    Rows left alone keep their own table row and length.  A changed row lists
    the chosen blocks in position order, the partly filled last block last,
    and its length counts only the chosen tokens: the kernel reads exactly
    those.  The kernel lines a row's query tokens up with the end of its
    keys (causally), so a row of several query tokens (drafts being
    verified) must keep every block that holds one of them.  Positions
    were applied to q and k (RoPE) before attention, so dropping blocks
    changes which keys are read, not where they are.
    """

    block_table: Any
    seq_lens: Any


@dataclasses.dataclass
class SparseStats:
    """Counters since the method was built (decode rows only: prefill is dense)."""

    layer_calls: int = 0            # attention calls that had decode rows
    decode_rows: int = 0            # (row, layer) pairs of decode requests (drafts verified included)
    sparse_rows: int = 0            # ... of which read fewer blocks than dense
    blocks_read: int = 0            # blocks handed to the kernel for decode rows
    blocks_dense: int = 0           # blocks dense attention would have read
    blocks_summarized_from_pages: int = 0   # (block, layer) summaries read back from the cache
    blocks_probed_unchanged: int = 0        # (block, layer) refilled with the same keys: kept
    blocks_kept_unsummarized: int = 0       # (block, layer) kept because no summary could be made
    rows_reused: int = 0            # sparse (row, layer) pairs that read an earlier step's choice of blocks

    @property
    def read_fraction(self) -> float:
        return self.blocks_read / self.blocks_dense if self.blocks_dense else 1.0


class SparseMethod(abc.ABC):
    """A sparse-attention method.  One instance lives in each worker process.

    ``from_config`` must be cheap and pure (it is also how options are
    validated when the connector's config is parsed); allocate tensors lazily
    on the first layer call.
    """

    #: the name under ``"sparse": {"method": NAME}``
    name: str = ""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, options: Mapping[str, Any]) -> "SparseMethod":
        """Build from the options (everything but ``method``); raise
        ``SparseConfigError`` naming a bad option."""

    def warm_up(self, example: AttentionBatch) -> int:
        """Called at start-up, once per kind of attention layer, with a call
        of it that carries vLLM's shapes and dtypes (no tokens of any
        request): do now what would otherwise hold up a step in the middle
        of serving (compiling kernels).  Returns how many launches that
        took; must leave the method's state as it was."""
        return 0

    def speculate(self, draft_tokens: int) -> None:
        """Called at start-up where the engine decodes speculatively: a
        request then verifies up to ``draft_tokens`` drafted tokens at a
        step, and its decode row carries 1 to ``1 + draft_tokens`` query
        tokens (the token it sampled last, then the drafts)."""

    def begin_step(self, step: StepInfo) -> None:
        """Called once per model-runner step, before its forward."""

    @abc.abstractmethod
    def before_attention(self, batch: AttentionBatch) -> BlockSelection | None:
        """Called for each attention layer, after the step's keys are written
        and before the kernel.  None: the kernel reads what it would have."""

    def after_attention(self, batch: AttentionBatch, selection: BlockSelection | None) -> None:
        """Called after the kernel, with what ``before_attention`` returned."""

    def stats(self) -> SparseStats:
        return SparseStats()
