"""``block_topk`` on a GPU, per attention layer call, without vLLM: what the
selection costs against the attention it thins.

    PYTHONPATH=. python3 benchmarks/gpu_sparse_bench.py [--contexts 8192 32768] [--json PATH]

Llama-3-8B attention shapes by default (32 query / 8 KV heads of 128, bf16,
16-token blocks as vLLM uses on CUDA), batch 8, keep 1/4.  For each context:

* the paged KV cache of ``--layers`` layers in FlashAttention's layout (vLLM
  0.33's default LBNHC: ``[blocks, kv heads, block size, 2 x head]`` over a
  token-major page), random keys with a few blocks per request lined up with
  its query, random block tables;
* the method learns every block from its page (the requests "start" with a
  prefix-cache hit of all but their last token), then decode steps run: a
  step is ``begin_step`` plus one layer call for each of 32 layers (32 sets
  of summaries over the ``--layers`` caches), the step index changing;
* *selection*: ``before_attention`` alone per layer call (the step's first
  layer included), timed with CUDA events around back-to-back eager steps
  (the host issues every launch, so this is the host's cost where it is the
  larger) and as one CUDA-graph replay per step (the device's work alone);
  host syncs per call (``torch.cuda.set_sync_debug_mode("warn")``) and
  kernels per call and their device time (the profiler); through the Triton
  kernels, and at ``--torch-at`` contexts through the torch path;
* *a layer's attention part*: dense attention alone (torch's SDPA over
  contiguous K/V of the whole context), against the hook followed by SDPA
  over a quarter of the context (what FlashAttention costs reading the kept
  blocks through the table), and against the hook left dense (below
  ``dense_below``: it folds nothing, and the next thinned call rebuilds the
  summaries its rows read from the pages, timed as "catch-up") followed by
  dense SDPA; also a
  paged split-K decode kernel (here, in Triton) reading the cache through
  the block table, dense and with the selection's table and lengths (its
  output checked against attention over the chosen blocks).  Eager and as
  CUDA graphs;
* the same two for a method that reuses the step before's choice at every
  step after its first (``reselect_every``: a reused call folds the new keys
  and copies the choice, scoring nothing); the last column averages a
  scoring and a reusing step, what ``reselect_every: 2`` costs;
* the selection where every row verifies drafts (``--verify-tokens``, 4 by
  default: speculative decoding with 3 drafts), against rows of one token;
* first of all, ``warm_up`` at start-up (``measure_warm_up``): its seconds,
  and the Triton variants compiled during it and, at a few steps of every
  context after it, since (0 is the design);
* at the smallest context, the CPU torch path on copies of the same inputs
  chooses the same blocks as CUDA (rows equal; rows that differ show how
  many blocks were swapped).

Prints two tables last; ``main(argv)`` returns the results as a dict (for
benchmarks/gpu_bench.py) and ``--json`` keeps them, written after every
context.  Needs torch (and Triton for the kernels); never imports vLLM.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from patches.attention import FlashKeyPages  # noqa: E402
from ucm_connector.sparse import AttentionBatch, RequestStart, StepInfo, triton_select  # noqa: E402
from ucm_connector.sparse.block_topk import BlockTopK, BlockTopKOptions  # noqa: E402

LAYERS_PER_STEP = 32
DEVICE = "cuda"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- a paged decode attention kernel (reads K/V through the block table) -----------

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _paged_partial(q_ptr, kv_ptr, kv_s0, kv_s1, kv_s2, table_ptr, table_s0, seq_ptr,
                       m_ptr, l_ptr, acc_ptr, scale, SPLITS,
                       BS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                       NBLK: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        seq = tl.load(seq_ptr + r)
        n = (seq + BS - 1) // BS
        per = (n + SPLITS - 1) // SPLITS
        start = s * per
        end = tl.minimum(n, start + per)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (r * H * G + h * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
        m = tl.full((GP,), float("-inf"), tl.float32)
        l_sum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        t = tl.arange(0, NBLK * BS)
        for jb in range(start, end, NBLK):
            pos = jb + t // BS
            live = pos < end
            block = tl.load(table_ptr + r * table_s0 + pos, mask=live, other=0).to(tl.int64)
            token = pos * BS + t % BS
            live = live & (token < seq)
            rows = kv_ptr + block[:, None] * kv_s0 + (t % BS)[:, None] * kv_s1 + h * kv_s2 + d[None, :]
            k = tl.load(rows, mask=live[:, None], other=0.0)
            v = tl.load(rows + D, mask=live[:, None], other=0.0)
            logits = tl.dot(q, tl.trans(k)) * scale
            logits = tl.where(live[None, :], logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            p = tl.exp(logits - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        at = (r * H + h) * SPLITS + s
        tl.store(m_ptr + at * GP + g, m)
        tl.store(l_ptr + at * GP + g, l_sum)
        tl.store(acc_ptr + (at * GP + g[:, None]) * D + d[None, :], acc)

    @triton.jit
    def _paged_reduce(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      H: tl.constexpr, D: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        base = (r * H + h) * SPLITS + sp
        m = tl.load(m_ptr + base[:, None] * GP + g[None, :])                        # [S, GP]
        l_sum = tl.load(l_ptr + base[:, None] * GP + g[None, :])
        top = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top[None, :]))
        denom = tl.sum(w * l_sum, axis=0)                                          # [GP]
        acc = tl.load(acc_ptr + (base[:, None, None] * GP + g[None, :, None]) * D + d[None, None, :])
        out = tl.sum(w[:, :, None] * acc, axis=0) / denom[:, None]
        tl.store(out_ptr + ((r * H + h) * G + g[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g[:, None] < G)


class PagedAttention:
    """Decode attention over a paged cache through a block table: split-K,
    ``splits`` programs per (row, KV head), then one reduce per (row, head)."""

    def __init__(self, rows: int, heads: int, kv_heads: int, head: int, splits: int = 16, device="cuda"):
        self.rows, self.heads, self.kv_heads, self.head, self.splits = rows, heads, kv_heads, head, splits
        self.group = heads // kv_heads
        self.gp = max(16, 1 << (self.group - 1).bit_length())
        shape = (rows * kv_heads * splits, self.gp)
        self.m = torch.empty(shape, dtype=torch.float32, device=device)
        self.l = torch.empty(shape, dtype=torch.float32, device=device)
        self.acc = torch.empty(shape + (head,), dtype=torch.float32, device=device)

    def __call__(self, q, kv_view, table, seq_lens, out, scale):
        # kv_view: [blocks, block_size, kv_heads, 2 * head] (token-major pages)
        _paged_partial[(self.rows, self.kv_heads, self.splits)](
            q, kv_view, kv_view.stride(0), kv_view.stride(1), kv_view.stride(2), table, table.stride(0), seq_lens,
            self.m, self.l, self.acc, scale, self.splits,
            BS=kv_view.shape[1], G=self.group, GP=self.gp, H=self.kv_heads, D=self.head, NBLK=4, num_warps=4)
        _paged_reduce[(self.rows, self.kv_heads)](
            self.m, self.l, self.acc, out, SPLITS=self.splits, G=self.group, GP=self.gp, H=self.kv_heads,
            D=self.head, num_warps=4)
        return out


# -- the workload -------------------------------------------------------------------

@dataclasses.dataclass
class Shapes:
    rows: int = 8
    heads: int = 32
    kv_heads: int = 8
    head: int = 128
    block_size: int = 16
    keep_ratio: float = 0.25
    channels: int | None = None     # block_topk's option: every key scored on this many channels


class Workload:
    """``rows`` requests of about ``context`` tokens (the i-th 13 * i shorter,
    so that last blocks are partial) over ``layers`` paged caches, each
    step's row ``query_tokens`` tokens (more than 1: a request verifying
    drafts under speculative decoding)."""

    def __init__(self, shapes: Shapes, context: int, layers: int, device: str, seed: int = 0,
                 query_tokens: int = 1):
        self.s, self.context, self.device = shapes, context, torch.device(device)
        self.query_tokens = q_len = query_tokens
        gen = torch.Generator(device="cpu").manual_seed(seed)
        bs, kvh, d = shapes.block_size, shapes.kv_heads, shapes.head
        self.lens = [context - 13 * i for i in range(shapes.rows)]
        counts = [_cdiv(n, bs) for n in self.lens]
        self.num_blocks = sum(counts) + 16
        order = torch.randperm(self.num_blocks, generator=gen)
        width = max(counts) + 8
        table = torch.zeros(shapes.rows, width, dtype=torch.int32)
        self.tables, at = [], 0
        for i, c in enumerate(counts):
            self.tables.append(order[at:at + c].tolist())
            table[i, :c] = order[at:at + c].to(torch.int32)
            at += c
        self.table = table.to(self.device)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=self.device)
        direction = torch.randn(shapes.rows, kvh, d, generator=gen)
        q = 2 * direction.repeat_interleave(shapes.heads // kvh, dim=1) + torch.randn(shapes.rows, shapes.heads, d,
                                                                                       generator=gen)
        self.query = q.to(torch.bfloat16).repeat_interleave(q_len, dim=0).to(self.device)
        self.caches, self.views = [], []
        for layer in range(layers):
            g = torch.Generator(device=self.device).manual_seed(seed * 1000 + layer)
            pages = torch.randn(self.num_blocks, bs, kvh, 2 * d, generator=g, device=self.device,
                                dtype=torch.float32).to(torch.bfloat16)
            for i, t in enumerate(self.tables):
                hot = torch.tensor(t, device=self.device)[torch.randperm(len(t), generator=gen)[:max(1, len(t) // 16)]
                                                          .to(self.device)]
                pages[hot, :, :, :d] += (2.0 * direction[i]).to(pages.dtype).to(self.device)
            self.views.append(pages)                       # token-major [blocks, B, H, 2D]
            self.caches.append(pages.permute(0, 2, 1, 3))  # FlashAttention's logical [blocks, H, B, 2D]
        slots = [self.tables[i][p // bs] * bs + p % bs for i, n in enumerate(self.lens) for p in range(n - q_len, n)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.qsl = torch.arange(shapes.rows + 1, dtype=torch.int32, device=self.device) * q_len
        self.req_ids = frozenset(f"r{i}" for i in range(shapes.rows))

    def batches(self, layers_per_step: int) -> list[AttentionBatch]:
        """One decode step's layer calls: the layers share vLLM's metadata."""
        s, out = self.s, []
        for i in range(layers_per_step):
            cache = self.caches[i % len(self.caches)]
            view = self.views[i % len(self.views)]
            key = view[self.slot_mapping // s.block_size, self.slot_mapping % s.block_size, :, :s.head]
            out.append(AttentionBatch(
                layer_name=f"model.layers.{i}.self_attn.attn", layer_index=i, query=self.query, key=key,
                slot_mapping=self.slot_mapping, query_start_loc=self.qsl, seq_lens=self.seq_lens,
                block_table=self.table, block_size=s.block_size, num_cache_blocks=self.num_blocks,
                num_kv_heads=s.kv_heads, head_size=s.head, scale=1 / math.sqrt(s.head),
                pages=FlashKeyPages(cache, s.head), step=0, max_seq_len=max(self.lens),
                max_query_len=self.query_tokens))
        return out

    def started(self) -> StepInfo:
        """The requests start with all but their step's tokens already cached
        (a prefix-cache hit): the method reads those blocks from the pages."""
        return StepInfo(self.s.block_size, started=tuple(
            RequestStart(f"r{i}", tuple(t), n - self.query_tokens)
            for i, (t, n) in enumerate(zip(self.tables, self.lens))),
            scheduled_req_ids=self.req_ids)

    def step(self, method: BlockTopK, batches: list[AttentionBatch], step: int, info: StepInfo | None = None):
        """One decode step: the step hook, then every layer's call."""
        method.begin_step(info or StepInfo(self.s.block_size, scheduled_req_ids=self.req_ids))
        selection = None
        for b in batches:
            b.step = step
            selection = method.before_attention(b)
        return selection


# ``reselect_every`` so large that after its first step a method only reuses.
ALWAYS_REUSE = 1 << 30


def _method(kernels: str, shapes: Shapes, dense_below: int = 0, reselect_every: int = 1) -> BlockTopK:
    options = {"keep_ratio": shapes.keep_ratio, "dense_below": dense_below, "reselect_every": reselect_every}
    if shapes.channels is not None:
        options["channels"] = shapes.channels
    return BlockTopK(BlockTopKOptions.parse(options), kernels=kernels)


# -- timing -------------------------------------------------------------------------

def _events_ms(fn, iters: int) -> float:
    """Median over 5 rounds of the mean time of ``iters`` back-to-back calls."""
    rounds = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        rounds.append(start.elapsed_time(stop) / iters)
    return sorted(rounds)[2]


def _graph_ms(fn, iters: int) -> float:
    """``fn`` captured once as a CUDA graph; median time of a replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return _events_ms(graph.replay, iters)


def _syncs(fn) -> int:
    """Host synchronisations while ``fn`` runs, as torch's sync debug mode
    reports them (one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _kernels(fn) -> tuple[int, dict[str, float]] | None:
    """Kernels ``fn`` launches (copies and fills excluded) and the device
    time of each kind, µs in all, by the profiler."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        count, by_name = 0, {}
        for e in prof.events():
            if e.device_type.name != "CUDA" or "memcpy" in e.name.lower() or "memset" in e.name.lower():
                continue
            count += 1
            us = getattr(e, "device_time", None)
            if us is None:
                us = getattr(e, "cuda_time", 0.0)
            name = e.name if len(e.name) < 40 else e.name[:37] + "..."
            by_name[name] = by_name.get(name, 0.0) + float(us or 0.0)
        return count, by_name
    except Exception:
        traceback.print_exc()
        return None


class Stepper:
    """Runs decode steps of one method over a workload's 32 layer calls,
    optionally with an attention call after each layer's hook."""

    def __init__(self, work: Workload, method: BlockTopK, attention=None):
        self.work, self.method, self.attention = work, method, attention
        self.batches = work.batches(LAYERS_PER_STEP)
        self.step_index = 1
        work.step(method, self.batches, 1, work.started())
        self()

    def __call__(self):
        self.step_index += 1
        self.method.begin_step(StepInfo(self.work.s.block_size, scheduled_req_ids=self.work.req_ids))
        selection = None
        for i, b in enumerate(self.batches):
            b.step = self.step_index
            selection = self.method.before_attention(b)
            if self.attention is not None:
                self.attention(i, selection)
        return selection


def _per_layer(fn, steps: int, graph: bool = True) -> dict:
    out = {"eager_ms": _events_ms(fn, steps) / LAYERS_PER_STEP}
    if graph:
        try:
            out["graph_ms"] = _graph_ms(fn, steps) / LAYERS_PER_STEP
        except Exception as exc:
            out["graph_ms"] = None
            out["graph_error"] = f"{type(exc).__name__}: {exc}"
    return out


def measure_selection(work: Workload, kernels: str, steps: int) -> dict:
    """The hook alone, per layer call."""
    method = _method(kernels, work.s)
    step = Stepper(work, method)
    out = {"kernels": kernels}
    out.update(_per_layer(step, steps))
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    out["host_ms"] = (time.perf_counter() - t0) * 1e3 / steps / LAYERS_PER_STEP
    torch.cuda.synchronize()
    out["syncs_per_call"] = _syncs(step) / LAYERS_PER_STEP
    launched = _kernels(step)
    if launched is not None:
        out["kernels_per_call"] = launched[0] / LAYERS_PER_STEP
        out["kernel_us_per_call"] = {k: v / LAYERS_PER_STEP for k, v in launched[1].items()}
    left_dense = Stepper(work, _method(kernels, work.s, dense_below=1 << 30))
    out["left_dense_eager_ms"] = _events_ms(left_dense, steps) / LAYERS_PER_STEP

    # A thinned call after calls left dense rebuilds, from the pages, every
    # block its rows read (catch_up): what crossing dense_below costs, once.
    def after_dense():
        for layer in method._keeper.layers.values():
            layer.behind, layer.awaited = True, None
        step()

    out["catch_up_eager_ms"] = _events_ms(after_dense, max(1, steps // 5)) / LAYERS_PER_STEP
    # A call that reuses the step before's choice (reselect_every): the fold
    # and a few small ops, no scoring.
    reusing = _method(kernels, work.s, reselect_every=ALWAYS_REUSE)
    reused = Stepper(work, reusing)
    timed = _per_layer(reused, steps)
    out["reused_eager_ms"], out["reused_graph_ms"] = timed["eager_ms"], timed.get("graph_ms")
    out["reused_syncs_per_call"] = _syncs(reused) / LAYERS_PER_STEP
    launched = _kernels(reused)
    if launched is not None:
        out["reused_kernels_per_call"] = launched[0] / LAYERS_PER_STEP
    out["reused_rows"] = reusing.stats().rows_reused
    selection = step()
    out["selection"] = (selection.block_table.clone(), selection.seq_lens.clone())
    out["read_fraction"] = method.stats().read_fraction
    out["method"] = method
    return out


def measure_verify(shapes: Shapes, context: int, layers: int, kernels: str, steps: int, query_tokens: int) -> dict:
    """Selection per layer call where every row verifies ``query_tokens - 1``
    drafts (the method told so): its keys folded in torch ops and the
    blocks they complete summarised again from their pages, then scored
    and selected as a decode call is."""
    work = Workload(shapes, context, layers, DEVICE, query_tokens=query_tokens)
    method = _method(kernels, shapes)
    method.speculate(query_tokens - 1)
    step = Stepper(work, method)
    out = {"kernels": kernels, "query_tokens": query_tokens}
    out.update(_per_layer(step, steps))
    torch.cuda.synchronize()
    out["syncs_per_call"] = _syncs(step) / LAYERS_PER_STEP
    launched = _kernels(step)
    if launched is not None:
        out["kernels_per_call"] = launched[0] / LAYERS_PER_STEP
    out["read_fraction"] = method.stats().read_fraction
    return out


def measure_layers(work: Workload, method: BlockTopK, kernels: str, steps: int) -> dict:
    """A layer's attention part, per layer: dense attention alone against
    the hook followed by attention over the kept blocks, and the hook left
    dense (below ``dense_below``) followed by dense attention.  Eager (the
    host issues every launch, hook and attention overlap as they would in
    an engine) and as CUDA graphs (device time alone)."""
    s = work.s
    rows, kvh, d = s.rows, s.kv_heads, s.head
    scale = 1 / math.sqrt(d)
    q4 = work.query.view(rows, s.heads, 1, d)
    full = [torch.randn(rows, kvh, work.context, d, device=work.device, dtype=torch.bfloat16) for _ in range(2)]
    kept = [torch.randn(rows, kvh, work.context // 4, d, device=work.device, dtype=torch.bfloat16)
            for _ in range(2)]

    def sdpa(k, v):
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    out = {}

    def dense():
        for _ in range(LAYERS_PER_STEP):
            sdpa(*full)

    out["dense_sdpa"] = _per_layer(dense, steps)
    out["sparse_sdpa"] = _per_layer(lambda: [sdpa(*kept) for _ in range(LAYERS_PER_STEP)], steps)
    sparse = Stepper(work, method, lambda i, sel: sdpa(*kept))
    out["hook+sparse_sdpa"] = _per_layer(sparse, steps)
    fallback = Stepper(work, _method(kernels, s, dense_below=1 << 30), lambda i, sel: sdpa(*full))
    out["hook_dense+dense_sdpa"] = _per_layer(fallback, steps)
    reusing = Stepper(work, _method(kernels, s, reselect_every=ALWAYS_REUSE), lambda i, sel: sdpa(*kept))
    out["reused+sparse_sdpa"] = _per_layer(reusing, steps)
    if triton is not None:
        paged = PagedAttention(rows, s.heads, kvh, d, device=work.device)
        result = torch.empty(rows, s.heads, d, device=work.device, dtype=torch.bfloat16)
        views = work.views

        def dense_paged():
            for i in range(LAYERS_PER_STEP):
                paged(work.query, views[i % len(views)], work.table, work.seq_lens, result, scale)

        out["dense_paged"] = _per_layer(dense_paged, steps)
        sparse_paged = Stepper(work, method, lambda i, sel: paged(
            work.query, views[i % len(views)], sel.block_table, sel.seq_lens, result, scale))
        out["hook+sparse_paged"] = _per_layer(sparse_paged, steps)
        reused_paged = Stepper(work, _method(kernels, s, reselect_every=ALWAYS_REUSE),
                               lambda i, sel: paged(work.query, views[i % len(views)], sel.block_table,
                                                    sel.seq_lens, result, scale))
        out["reused+sparse_paged"] = _per_layer(reused_paged, steps)
        # The paged kernel over the selection equals attention over exactly
        # the chosen blocks (fp32 reference, two rows).
        selection = sparse_paged()
        torch.cuda.synchronize()
        table, seq_lens = selection.block_table, selection.seq_lens
        paged(work.query, views[(LAYERS_PER_STEP - 1) % len(views)], table, seq_lens, result, scale)
        view = views[(LAYERS_PER_STEP - 1) % len(views)]
        worst = 0.0
        for r in (0, rows - 1):
            n_kept = _cdiv(int(seq_lens[r]), s.block_size)
            toks = view[table[r, :n_kept].long()]
            length = int(seq_lens[r])
            keys = toks[..., :d].reshape(-1, kvh, d)[:length].float()
            vals = toks[..., d:].reshape(-1, kvh, d)[:length].float()
            q = work.query[r].float().view(kvh, s.heads // kvh, d)
            w = torch.einsum("hgd,lhd->hgl", q, keys).mul(scale).softmax(-1)
            ref = torch.einsum("hgl,lhd->hgd", w, vals).reshape(s.heads, d)
            worst = max(worst, float((result[r].float() - ref).norm() / ref.norm()))
        out["paged_sparse_rel_err"] = worst
    del full, kept
    return out


def same_blocks_cpu_vs_cuda(work: Workload, kernels: str, steps: int = 2) -> dict:
    """The CPU torch path and the CUDA path on the same inputs: chosen
    blocks compared row by row over ``steps`` steps of 4 layers."""
    cpu = torch.device("cpu")
    methods = {"cuda": _method(kernels, work.s), "cpu": _method("torch", work.s)}
    cuda_batches = work.batches(4)
    cpu_batches = []
    views_cpu = [v.cpu() for v in work.views]
    for i, b in enumerate(cuda_batches):
        view = views_cpu[i % len(views_cpu)]
        cpu_batches.append(dataclasses.replace(
            b, query=b.query.cpu(), key=b.key.cpu(), slot_mapping=b.slot_mapping.cpu(),
            query_start_loc=b.query_start_loc.cpu(), seq_lens=b.seq_lens.cpu(), block_table=b.block_table.cpu(),
            pages=FlashKeyPages(view.permute(0, 2, 1, 3), b.head_size)))
    # Share metadata across layers on the CPU side too.
    for b in cpu_batches[1:]:
        b.query, b.slot_mapping, b.query_start_loc = cpu_batches[0].query, cpu_batches[0].slot_mapping, \
            cpu_batches[0].query_start_loc
        b.seq_lens, b.block_table = cpu_batches[0].seq_lens, cpu_batches[0].block_table
    bs = work.s.block_size
    rows = equal = 0
    differing = []
    for step in range(1, steps + 1):
        for m in methods.values():
            m.begin_step(work.started() if step == 1 else StepInfo(bs, scheduled_req_ids=work.req_ids))
        for bc, bh in zip(cuda_batches, cpu_batches):
            bc.step = bh.step = step
            got = methods["cuda"].before_attention(bc)
            want = methods["cpu"].before_attention(bh)
            assert torch.equal(got.seq_lens.cpu(), want.seq_lens), "lengths differ"
            for r in range(work.s.rows):
                kept = _cdiv(int(want.seq_lens[r]), bs)
                a, b = got.block_table[r, :kept].cpu().tolist(), want.block_table[r, :kept].tolist()
                rows += 1
                if a == b:
                    equal += 1
                else:
                    differing.append(len(set(a) ^ set(b)) // 2)
    return {"rows": rows, "equal": equal, "blocks_swapped_in_differing_rows": differing}


def measure_warm_up(shapes: Shapes, contexts: list[int]) -> dict:
    """``block_topk.warm_up`` on the longest context's block table, then a
    prefix-hit step and two decode steps at every context: the warm-up's
    seconds and launches, and the Triton kernel variants compiled (or loaded
    from Triton's disk cache) during it and after it.  After it, 0 is the
    design: serving compiles nothing."""
    compiled: list[str] = []

    def note(*, repr, **_):
        compiled.append(repr)

    knobs = triton.knobs.runtime
    before, knobs.jit_post_compile_hook = knobs.jit_post_compile_hook, note
    try:
        method = _method("triton", shapes)
        works = [Workload(shapes, c, 1, DEVICE) for c in sorted(contexts)]
        t0 = time.perf_counter()
        launches = method.warm_up(works[-1].batches(1)[0])
        torch.cuda.synchronize()
        seconds, at_warm_up = time.perf_counter() - t0, len(compiled)
        for work in works:
            batches = work.batches(2)
            work.step(method, batches, 1, work.started())
            for step in (2, 3):
                work.step(method, batches, step)
        torch.cuda.synchronize()
    finally:
        knobs.jit_post_compile_hook = before
    return {"seconds": round(seconds, 2), "launches": launches, "compiled_at_warm_up": at_warm_up,
            "compiled_after": len(compiled) - at_warm_up, "after": compiled[at_warm_up:]}


def run_context(shapes: Shapes, context: int, args, partial: list[dict]) -> dict:
    work = Workload(shapes, context, args.layers, DEVICE)
    res = {"context": context}
    partial.append(res)
    paths = [p for p in args.paths if p != "triton" or triton_select.available()]
    for k in paths:
        if k == "torch" and context not in args.torch_at:
            continue
        try:
            sel = measure_selection(work, k, args.steps)
            method = sel.pop("method")
            selection = sel.pop("selection")
            res[k] = sel
            print(f"  {context}: selection {k}: {sel}", flush=True)
            if k == paths[0]:
                res["layers"] = measure_layers(work, method, k, args.steps)
                print(f"  {context}: layers {res['layers']}", flush=True)
                del selection
        except Exception:
            traceback.print_exc()
            res[k] = {"error": traceback.format_exc(limit=3)}
        _save(args, partial)
    if args.verify_tokens > 1:
        try:
            res["verify"] = measure_verify(shapes, context, args.layers, paths[0], args.steps, args.verify_tokens)
            print(f"  {context}: verifying rows {res['verify']}", flush=True)
        except Exception:
            traceback.print_exc()
            res["verify"] = {"error": traceback.format_exc(limit=3)}
        _save(args, partial)
    if context == min(args.contexts) and not args.skip_cpu_check:
        try:
            res["cpu_vs_cuda"] = same_blocks_cpu_vs_cuda(work, paths[0])
            print(f"  {context}: cpu vs cuda {res['cpu_vs_cuda']}", flush=True)
        except Exception:
            traceback.print_exc()
        _save(args, partial)
    del work
    torch.cuda.empty_cache()
    return res


def _save(args, results: list[dict]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": getattr(triton, "__version__", None), "results": results}, f, indent=1,
                      default=str)


def _layer_ratio(layers: dict, sparse: str, dense: str, kind: str = "eager_ms") -> float:
    try:
        return layers[sparse][kind] / layers[dense][kind]
    except (KeyError, TypeError, ZeroDivisionError):
        return float("nan")


def crossover(results: list[dict]) -> int | None:
    """The shortest context from which every measured longer one gains: the
    hook plus attention over the kept blocks faster than dense attention
    (SDPA, eager)."""
    best = None
    for r in sorted(results, key=lambda r: -r["context"]):
        if not _layer_ratio(r.get("layers", {}), "hook+sparse_sdpa", "dense_sdpa") < 1:
            break
        best = r["context"]
    return best


def _us(x) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def table(results: list[dict]) -> str:
    lines = ["Selection (block_topk.before_attention) per layer call, µs:", "",
             "| context | path | eager | host | graph (device) | left dense, eager | catch-up, eager | syncs/call "
             "| kernels/call "
             "| reusing the step before's choice: eager / graph | its syncs/call | its kernels/call |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for k in ("triton", "torch"):
            sel = r.get(k)
            if not sel or "eager_ms" not in sel:
                continue
            launched = sel.get("kernels_per_call")
            reused = sel.get("reused_kernels_per_call")
            lines.append(f"| {r['context']} | {k} | {_us(sel['eager_ms'])} | {_us(sel.get('host_ms'))} | "
                         f"{_us(sel.get('graph_ms'))} | {_us(sel.get('left_dense_eager_ms'))} | "
                         f"{_us(sel.get('catch_up_eager_ms'))} | "
                         f"{sel['syncs_per_call']:.2f} | {'-' if launched is None else f'{launched:.2f}'} | "
                         f"{_us(sel.get('reused_eager_ms'))} / {_us(sel.get('reused_graph_ms'))} | "
                         f"{sel.get('reused_syncs_per_call', float('nan')):.2f} | "
                         f"{'-' if reused is None else f'{reused:.2f}'} |")
    lines += ["", "Selection per layer call where every row verifies drafts, µs, against rows of one token:", "",
              "| context | path | query tokens | eager | graph (device) | syncs/call | kernels/call | "
              "eager / one token's | blocks read |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ver, one = r.get("verify"), r.get(r.get("verify", {}).get("kernels", ""), {})
        if not ver or "eager_ms" not in ver:
            continue
        launched = ver.get("kernels_per_call")
        ratio = ver["eager_ms"] / one["eager_ms"] if one.get("eager_ms") else float("nan")
        lines.append(f"| {r['context']} | {ver['kernels']} | {ver['query_tokens']} | {_us(ver['eager_ms'])} | "
                     f"{_us(ver.get('graph_ms'))} | {ver['syncs_per_call']:.2f} | "
                     f"{'-' if launched is None else f'{launched:.2f}'} | {ratio:.2f} | "
                     f"{ver['read_fraction']:.3f} |")
    lines += ["", "A layer's attention part, per layer, µs (eager / graph):", "",
              "| context | dense SDPA | hook + SDPA over the kept quarter | ratio | hook left dense + dense SDPA "
              "| dense paged | hook + paged over the selection | ratio | reusing + paged | ratio "
              "| reselect_every 2: mean ratio |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lay = r.get("layers")
        if not lay:
            continue

        def both(name):
            x = lay.get(name, {})
            return f"{_us(x.get('eager_ms'))} / {_us(x.get('graph_ms'))}"

        def ratios(sparse, dense):
            return f"{_layer_ratio(lay, sparse, dense):.2f} / {_layer_ratio(lay, sparse, dense, 'graph_ms'):.2f}"

        def mean2(kind):
            return (_layer_ratio(lay, "hook+sparse_paged", "dense_paged", kind)
                    + _layer_ratio(lay, "reused+sparse_paged", "dense_paged", kind)) / 2

        lines.append(f"| {r['context']} | {both('dense_sdpa')} | {both('hook+sparse_sdpa')} | "
                     f"{ratios('hook+sparse_sdpa', 'dense_sdpa')} | {both('hook_dense+dense_sdpa')} | "
                     f"{both('dense_paged')} | {both('hook+sparse_paged')} | "
                     f"{ratios('hook+sparse_paged', 'dense_paged')} | {both('reused+sparse_paged')} | "
                     f"{ratios('reused+sparse_paged', 'dense_paged')} | "
                     f"{mean2('eager_ms'):.2f} / {mean2('graph_ms'):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4, help="physical caches the 32 layer calls cycle over")
    ap.add_argument("--steps", type=int, default=10, help="decode steps (of 32 layer calls) per timing round")
    ap.add_argument("--keep-ratio", type=float, default=0.25)
    ap.add_argument("--channels", type=int, help="block_topk's channels option (default: blocks' mean keys)")
    ap.add_argument("--paths", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    ap.add_argument("--torch-at", type=int, nargs="*", default=[8192, 32768],
                    help="contexts at which the torch path is timed too")
    ap.add_argument("--skip-cpu-check", action="store_true")
    ap.add_argument("--verify-tokens", type=int, default=4,
                    help="also time calls whose rows verify drafts, this many query tokens each (1: not)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sparse_bench needs CUDA")
    shapes = Shapes(rows=args.rows, keep_ratio=args.keep_ratio, channels=args.channels)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {getattr(triton, '__version__', None)}; {shapes}", flush=True)
    warm_up = None
    if "triton" in args.paths and triton_select.available():
        # First, while no kernel has been compiled in this process.
        try:
            warm_up = measure_warm_up(shapes, args.contexts)
        except Exception as exc:        # the timings below still stand
            traceback.print_exc()
            warm_up = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"warm-up: {warm_up}", flush=True)
    results: list[dict] = []
    for context in sorted(args.contexts):
        print(f"context {context}", flush=True)
        run_context(shapes, context, args, results)
    print(table(results), flush=True)
    print(f"crossover (hook + sparse SDPA < dense SDPA, eager): {crossover(results)}", flush=True)
    _save(args, results)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": getattr(triton, "__version__", None), "shapes": dataclasses.asdict(shapes),
            "results": results, "crossover": crossover(results), "warm_up": warm_up}


if __name__ == "__main__":
    main()
