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
* *selection*: ``before_attention`` per layer call, averaged over the steps'
  calls (the step's first layer included), timed with CUDA events around
  back-to-back eager steps (launch costs included: the host issues every
  launch), and as one CUDA-graph replay per step (the device's work alone);
  through the Triton kernels and through the torch path;
* *dense* / *sparse attention*: torch's SDPA over contiguous K/V of the whole
  context / of the kept share of it (what FlashAttention costs reading the
  kept blocks through the table), and a paged split-K decode kernel (here,
  in Triton) reading the cache through the block table, dense and with the
  selection's table and lengths (its output checked against SDPA over the
  chosen blocks);
* *syncs*: host synchronisations per layer call, counted by
  ``torch.cuda.set_sync_debug_mode("warn")``; kernels per layer call,
  counted by the profiler;
* at the smallest context, the CPU torch path on copies of the same inputs
  chooses the same blocks as CUDA (rows equal, and rows that differ only
  where two scores tie to rounding).

Prints a table last; ``main(argv)`` returns the results as a dict (for
benchmarks/gpu_bench.py).  Needs torch (and Triton for the kernels); never
imports vLLM.
"""

from __future__ import annotations

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


class Workload:
    """``rows`` requests of about ``context`` tokens (the i-th 13 * i shorter,
    so that last blocks are partial) over ``layers`` paged caches."""

    def __init__(self, shapes: Shapes, context: int, layers: int, device: str, seed: int = 0):
        self.s, self.context, self.device = shapes, context, torch.device(device)
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
        self.query = q.to(torch.bfloat16).to(self.device)
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
        last = torch.tensor(self.lens) - 1
        slots = [self.tables[i][int(p) // bs] * bs + int(p) % bs for i, p in enumerate(last)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.qsl = torch.arange(shapes.rows + 1, dtype=torch.int32, device=self.device)
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
                pages=FlashKeyPages(cache, s.head), step=0, max_seq_len=max(self.lens), max_query_len=1))
        return out

    def started(self) -> StepInfo:
        """The requests start with all but their last token already cached
        (a prefix-cache hit): the method reads those blocks from the pages."""
        return StepInfo(self.s.block_size, started=tuple(
            RequestStart(f"r{i}", tuple(t), n - 1) for i, (t, n) in enumerate(zip(self.tables, self.lens))),
            scheduled_req_ids=self.req_ids)

    def step(self, method: BlockTopK, batches: list[AttentionBatch], step: int, info: StepInfo | None = None):
        """One decode step: the step hook, then every layer's call."""
        method.begin_step(info or StepInfo(self.s.block_size, scheduled_req_ids=self.req_ids))
        selection = None
        for b in batches:
            b.step = step
            selection = method.before_attention(b)
        return selection


def _method(kernels: str, keep_ratio: float, dense_below: int = 0) -> BlockTopK:
    return BlockTopK(BlockTopKOptions.parse({"keep_ratio": keep_ratio, "dense_below": dense_below}),
                     kernels=kernels)


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
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def _kernels(fn) -> int | None:
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower())
    except Exception:
        return None


def measure_selection(work: Workload, kernels: str, steps: int) -> dict:
    method = _method(kernels, work.s.keep_ratio)
    batches = work.batches(LAYERS_PER_STEP)
    work.step(method, batches, 1, work.started())
    counter = [2]

    def one_step():
        counter[0] += 1
        return work.step(method, batches, counter[0])

    one_step()
    torch.cuda.synchronize()
    out = {"kernels": kernels}
    out["eager_ms"] = _events_ms(one_step, steps) / LAYERS_PER_STEP
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    out["host_ms"] = (time.perf_counter() - t0) * 1e3 / steps / LAYERS_PER_STEP
    torch.cuda.synchronize()
    out["syncs_per_call"] = _syncs(one_step) / LAYERS_PER_STEP
    launched = _kernels(one_step)
    out["kernels_per_call"] = None if launched is None else launched / LAYERS_PER_STEP
    try:
        out["graph_ms"] = _graph_ms(one_step, steps) / LAYERS_PER_STEP
    except Exception as exc:
        out["graph_ms"] = None
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
    # The fold alone (what a dense call below the crossover still pays, and
    # what reusing a selection for a few steps would leave per step).
    fold = _method(kernels, work.s.keep_ratio, dense_below=1 << 30)
    work.step(fold, batches, 1, work.started())
    counter2 = [2]

    def fold_step():
        counter2[0] += 1
        work.step(fold, batches, counter2[0])

    fold_step()
    out["fold_only_eager_ms"] = _events_ms(fold_step, steps) / LAYERS_PER_STEP
    selection = one_step()
    out["selection"] = (selection.block_table.clone(), selection.seq_lens.clone())
    out["read_fraction"] = method.stats().read_fraction
    return out


def measure_attention(work: Workload, selection, iters: int) -> dict:
    s = work.s
    rows, kvh, d = s.rows, s.kv_heads, s.head
    scale = 1 / math.sqrt(d)
    out = {}
    q4 = work.query.view(rows, s.heads, 1, d)
    for name, length in (("dense_sdpa_ms", work.context), ("sparse_sdpa_ms", work.context // 4)):
        k = torch.randn(rows, kvh, length, d, device=work.device, dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def sdpa(k=k, v=v):
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        sdpa()
        out[name] = _events_ms(sdpa, iters)
        try:
            out[name.replace("_ms", "_graph_ms")] = _graph_ms(sdpa, iters)
        except Exception as exc:
            out[name.replace("_ms", "_graph_ms")] = None
            out["sdpa_graph_error"] = str(exc)
        del k, v
    if triton is None:
        return out
    paged = PagedAttention(rows, s.heads, kvh, d, device=work.device)
    result = torch.empty(rows, s.heads, d, device=work.device, dtype=torch.bfloat16)
    view = work.views[0]
    table, seq_lens = selection
    out["dense_paged_ms"] = _events_ms(lambda: paged(work.query, view, work.table, work.seq_lens, result, scale),
                                       iters)
    out["sparse_paged_ms"] = _events_ms(lambda: paged(work.query, view, table, seq_lens, result, scale), iters)
    # Correctness: the paged kernel over the selection equals attention over
    # exactly the chosen blocks (one row per check, fp32 reference).
    paged(work.query, view, table, seq_lens, result, scale)
    worst = 0.0
    for r in (0, rows - 1):
        kept = _cdiv(int(seq_lens[r]), s.block_size)
        blocks = table[r, :kept].long()
        toks = view[blocks]                                            # [kept, B, H, 2D]
        fill = int(seq_lens[r]) - (kept - 1) * s.block_size
        keys = toks[..., :d].reshape(-1, kvh, d)[:(kept - 1) * s.block_size + fill].float()
        vals = toks[..., d:].reshape(-1, kvh, d)[:(kept - 1) * s.block_size + fill].float()
        q = work.query[r].float().view(kvh, s.heads // kvh, d)
        w = torch.einsum("hgd,lhd->hgl", q, keys).mul(scale).softmax(-1)
        ref = torch.einsum("hgl,lhd->hgd", w, vals).reshape(s.heads, d)
        worst = max(worst, float((result[r].float() - ref).norm() / ref.norm()))
    out["paged_sparse_rel_err"] = worst
    return out


def same_blocks_cpu_vs_cuda(work: Workload, kernels: str, steps: int = 2) -> dict:
    """The CPU torch path and the CUDA path on the same inputs: chosen
    blocks compared row by row over ``steps`` steps of 4 layers."""
    cpu = torch.device("cpu")
    methods = {"cuda": _method(kernels, work.s.keep_ratio), "cpu": _method("torch", work.s.keep_ratio)}
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


def run_context(shapes: Shapes, context: int, args) -> dict:
    work = Workload(shapes, context, args.layers, "cuda")
    res = {"context": context}
    kernels = ["triton", "torch"] if triton_select.available() else ["torch"]
    for k in kernels:
        try:
            sel = measure_selection(work, k, args.steps)
            res[k] = {key: v for key, v in sel.items() if key != "selection"}
            res.setdefault("_selection", sel["selection"])
            print(f"  {context}: selection {k}: {res[k]}", flush=True)
        except Exception:
            traceback.print_exc()
            res[k] = {"error": traceback.format_exc(limit=3)}
    if "_selection" in res:
        try:
            res["attention"] = measure_attention(work, res.pop("_selection"), args.iters)
            print(f"  {context}: attention {res['attention']}", flush=True)
        except Exception:
            traceback.print_exc()
    if context == min(args.contexts) and not args.skip_cpu_check:
        try:
            res["cpu_vs_cuda"] = same_blocks_cpu_vs_cuda(work, kernels[0])
            print(f"  {context}: cpu vs cuda {res['cpu_vs_cuda']}", flush=True)
        except Exception:
            traceback.print_exc()
    del work
    torch.cuda.empty_cache()
    return res


def _ratio(selection_ms: float | None, attention: dict, kind: str = "_ms") -> float:
    """(selection + sparse attention) / dense attention, SDPA timings of the
    same kind (eager or graph)."""
    dense, sparse = attention.get("dense_sdpa" + kind), attention.get("sparse_sdpa" + kind)
    if selection_ms is None or not dense or sparse is None:
        return float("nan")
    return (selection_ms + sparse) / dense


def crossover(results: list[dict], path: str = "triton") -> int | None:
    """The shortest context from which every measured longer one gains:
    (eager selection + sparse) below dense."""
    gains = [(r["context"], _ratio(r.get(path, {}).get("eager_ms"), r.get("attention", {})) < 1) for r in results]
    best = None
    for context, gain in sorted(gains, reverse=True):
        if not gain:
            break
        best = context
    return best


def table(results: list[dict]) -> str:
    head = ("| context | path | selection eager µs | graph µs | fold only µs | syncs/call | kernels/call "
            "| dense SDPA µs | sparse SDPA µs | (sel + sparse) / dense, eager | graph "
            "| dense paged µs | sparse paged µs |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        att = r.get("attention", {})
        for k in ("triton", "torch"):
            sel = r.get(k)
            if not sel or "eager_ms" not in sel:
                continue
            ratio = _ratio(sel.get("eager_ms"), att)
            graph_ratio = _ratio(sel.get("graph_ms"), att, "_graph_ms")

            def us(x):
                return "-" if x is None else f"{1e3 * x:.1f}"

            launched = sel.get("kernels_per_call")
            lines.append(
                f"| {r['context']} | {k} | {us(sel['eager_ms'])} | {us(sel.get('graph_ms'))} | "
                f"{us(sel.get('fold_only_eager_ms'))} | {sel['syncs_per_call']:.2f} | "
                f"{'-' if launched is None else f'{launched:.2f}'} | "
                f"{us(att.get('dense_sdpa_ms'))} | {us(att.get('sparse_sdpa_ms'))} | {ratio:.2f} | {graph_ratio:.2f} | "
                f"{us(att.get('dense_paged_ms'))} | {us(att.get('sparse_paged_ms'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4, help="physical caches the 32 layer calls cycle over")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timing round")
    ap.add_argument("--iters", type=int, default=200, help="attention calls per timing round")
    ap.add_argument("--keep-ratio", type=float, default=0.25)
    ap.add_argument("--skip-cpu-check", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sparse_bench needs CUDA")
    shapes = Shapes(rows=args.rows, keep_ratio=args.keep_ratio)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {getattr(triton, '__version__', None)}; {shapes}", flush=True)
    results = []
    for context in sorted(args.contexts):
        print(f"context {context}", flush=True)
        results.append(run_context(shapes, context, args))
    print(table(results), flush=True)
    print(f"crossover (triton, eager): {crossover(results)}; (torch path): {crossover(results, 'torch')}", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": getattr(triton, "__version__", None), "shapes": dataclasses.asdict(shapes),
           "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
