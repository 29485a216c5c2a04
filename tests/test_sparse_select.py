"""block_topk's selection without vLLM, on every device there is (CUDA cases
run where CUDA exists), through the torch path and, where Triton runs (CUDA,
or its interpreter with ``TRITON_INTERPRET=1``), through its kernels:

* it chooses the blocks the earlier selection chose (``_reference`` below
  transcribes it, op for op), up to scores that tie to rounding;
* a decode layer call dispatches no host-synchronising op, and few ops;
* below ``dense_below`` a call is left dense, and the summaries still follow;
* a new step is told by ``AttentionBatch.step``, not by tensor identity;
* blocks filled behind the forward (known from the step hook) are checked
  against their pages without waiting; blocks of requests that ran before the
  method started are found on the device (waiting) until those requests end;
* with ``reselect_every`` a step in between reads each row's blocks of the
  step before plus a block it started, without scoring or waiting; a row
  that holds another request is read whole, its own table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from patches.attention import FlashKeyPages
from ucm_connector.sparse import AttentionBatch, RequestStart, SparseStats, StepInfo, triton_select
from ucm_connector.sparse.block_topk import BlockTopK, BlockTopKOptions

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _kernels(device: str) -> list[str]:
    runs_triton = triton_select.available() and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    return ["torch", "triton"] if runs_triton else ["torch"]


PATHS = [(d, k) for d in DEVICES for k in _kernels(d)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _to_fp8(values: torch.Tensor, scale: float) -> torch.Tensor:
    """``values / scale`` in fp8 as vLLM's cache writes store it: saturated
    at the format's largest value, as vLLM's kernels clamp, whichever torch
    runs the test (torch 2.13's own cast saturates too)."""
    top = torch.finfo(torch.float8_e4m3fn).max
    return (values.float() / scale).clamp(-top, top).to(torch.float8_e4m3fn)


class Requests:
    """Rows of one step over a paged cache in FlashAttention's logical layout
    ``[num_blocks, kv_heads, block_size, 2 * head]``: ``lens`` tokens each,
    of which the last ``q_lens`` are this step's (1 = a decode row).  Each
    request's keys have a few "hot" blocks lined up with its query."""

    def __init__(self, device, lens, q_lens, block_size=16, heads=6, kv_heads=2, head=64, seed=0,
                 spare_blocks=5, table_width=None, fp8_scale=None):
        gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(device)
        self.lens, self.q_lens = list(lens), list(q_lens)
        self.block_size, self.heads, self.kv_heads, self.head = block_size, heads, kv_heads, head
        self.req_ids = [f"r{i}" for i in range(len(lens))]
        counts = [_cdiv(n, block_size) for n in lens]
        self.num_blocks = sum(counts) + spare_blocks
        order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.tables, at = [], 0
        for c in counts:
            self.tables.append(order[at:at + c])
            at += c
        width = table_width or max(counts) + 3
        self.table = torch.zeros(len(lens), width, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.kv = torch.zeros(self.num_blocks, kv_heads, block_size, 2 * head, dtype=torch.bfloat16)
        self.keys, self.queries = [], []
        group = heads // kv_heads
        for n, c in zip(lens, counts):
            direction = torch.randn(kv_heads, head, generator=gen)
            keys = torch.randn(n, kv_heads, head, generator=gen)
            for b in torch.randperm(c, generator=gen)[:max(1, c // 8)].tolist():
                keys[b * block_size:(b + 1) * block_size] += 2.5 * direction * torch.rand(1, generator=gen)
            self.keys.append(keys.to(torch.bfloat16))
            q = 2 * direction.repeat_interleave(group, dim=0) + torch.randn(heads, head, generator=gen)
            self.queries.append(q.to(torch.bfloat16))
        for i, keys in enumerate(self.keys):
            slots = self.slots(i, 0, lens[i])
            for h in range(kv_heads):
                self.kv[slots // block_size, h, slots % block_size, :head] = keys[:, h]
        self.fp8_scale = fp8_scale
        if fp8_scale is not None:
            # An fp8 cache as vLLM allocates it (bytes), keys stored divided by their scale.
            self.kv = _to_fp8(self.kv, fp8_scale).view(torch.uint8)
        self.kv = self.kv.to(self.device)
        self.table = self.table.to(self.device)
        self.pages = (FlashKeyPages(self.kv, head) if fp8_scale is None
                      else FlashKeyPages(self.kv, head, torch.float8_e4m3fn, fp8_scale))

    def write(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Put ``keys`` ``[n, kv_heads, head]`` into the cache at ``slots``
        (behind the forward's back, as a load or a prefix-cache hit does)."""
        kv = self.kv.cpu()
        if self.fp8_scale is not None:
            kv, keys = kv.view(torch.float8_e4m3fn), _to_fp8(keys, self.fp8_scale)
        for h in range(self.kv_heads):
            kv[slots // self.block_size, h, slots % self.block_size, :self.head] = keys[:, h].to(kv.dtype)
        self.kv.copy_(kv.view(self.kv.dtype))

    def slots(self, i: int, start: int, end: int) -> torch.Tensor:
        t = torch.arange(start, end)
        return torch.tensor(self.tables[i])[t // self.block_size] * self.block_size + t % self.block_size

    def _batch(self, layer, step, parts, lens, query_rows):
        tokens = [torch.arange(s, e) for s, e in parts]
        qsl = torch.tensor([0] + [len(t) for t in tokens]).cumsum(0).to(torch.int32)
        total = int(qsl[-1])
        key = torch.cat([self.keys[i][s:e] for i, (s, e) in enumerate(parts)])
        slots = torch.cat([self.slots(i, s, e) for i, (s, e) in enumerate(parts)])
        query = torch.zeros(total, self.heads, self.head, dtype=torch.bfloat16)
        for i in query_rows:
            query[int(qsl[i]):int(qsl[i + 1])] = self.queries[i]
        d = self.device
        return AttentionBatch(
            layer_name=layer, layer_index=0, query=query.to(d), key=key.to(d), slot_mapping=slots.to(d),
            query_start_loc=qsl.to(d), seq_lens=torch.tensor(lens, dtype=torch.int32, device=d),
            block_table=self.table, block_size=self.block_size, num_cache_blocks=self.num_blocks,
            num_kv_heads=self.kv_heads, head_size=self.head, scale=1 / math.sqrt(self.head), pages=self.pages,
            step=step, max_seq_len=max(lens), max_query_len=max(e - s for s, e in parts))

    def history(self, layer: str, step: int) -> AttentionBatch:
        """Everything before this step's tokens, as one prefill call."""
        parts = [(0, n - q) for n, q in zip(self.lens, self.q_lens)]
        return self._batch(layer, step, parts, [n - q for n, q in zip(self.lens, self.q_lens)], [])

    def step(self, layer: str, step: int) -> AttentionBatch:
        parts = [(n - q, n) for n, q in zip(self.lens, self.q_lens)]
        return self._batch(layer, step, parts, self.lens, range(len(self.lens)))

    def start(self, method: BlockTopK, layers=("layers.0",)) -> None:
        """Requests start (nothing cached) and their earlier tokens go by, in
        one step whose layers share vLLM's tensors."""
        method.begin_step(StepInfo(self.block_size, started=tuple(
            RequestStart(r, tuple(t), 0) for r, t in zip(self.req_ids, self.tables)),
            scheduled_req_ids=frozenset(self.req_ids)))
        history = self.history(layers[0], step=1)
        for layer in layers:
            method.before_attention(dataclasses.replace(history, layer_name=layer))
        method.begin_step(StepInfo(self.block_size, scheduled_req_ids=frozenset(self.req_ids)))


def _method(options: dict, kernels: str) -> BlockTopK:
    # These tests are about the selection itself: it runs at every context
    # unless a test sets dense_below (on CUDA the default leaves short
    # contexts dense).
    return BlockTopK(BlockTopKOptions.parse({"dense_below": 0, **options}), kernels=kernels)


def _reference(options: BlockTopKOptions, layer, batch: AttentionBatch, query_tokens: int = 1):
    """The selection as block_topk made it before it ran without waiting
    (commit 8767ccc), op for op, on current summaries: (table, lengths,
    thinned rows, their budgets, their scores) or None.  With
    ``query_tokens`` > 1, rows of up to that many query tokens are thinned
    too, every block from their first new token's on forced in."""
    bs = batch.block_size
    qsl, seq_lens = batch.query_start_loc, batch.seq_lens
    num_reqs = seq_lens.shape[0]
    query_lens = qsl[1:num_reqs + 1] - qsl[:num_reqs]
    num_blocks = torch.div(seq_lens + bs - 1, bs, rounding_mode="floor")
    tail = (num_blocks - torch.div(seq_lens - query_lens, bs, rounding_mode="floor")).clamp(min=options.local_blocks)
    keep = torch.maximum(options.budget(num_blocks), options.sink_blocks + tail)
    decode = (query_lens >= 1) & (query_lens <= query_tokens)
    rows = (decode & (keep < num_blocks) & (seq_lens > 0)).nonzero().flatten()
    if rows.numel() == 0:
        return None
    n_rows = num_blocks[rows].to(torch.int64)
    keep_rows = keep[rows].to(torch.int64)
    k, width = int(keep_rows.max()), int(n_rows.max())
    device = rows.device
    pos = torch.arange(width, device=device).unsqueeze(0)
    valid = pos < n_rows.unsqueeze(1)
    table = batch.block_table[rows, :width].to(torch.int64)
    table = torch.where(valid, table, torch.zeros_like(table))
    last_fill = seq_lens[rows].to(torch.int64) - (n_rows - 1) * bs
    fills = torch.where(pos == (n_rows - 1).unsqueeze(1), last_fill.unsqueeze(1), torch.full_like(table, bs))
    forced = ((pos < options.sink_blocks) | (pos >= (n_rows - tail[rows]).unsqueeze(1))) & valid
    in_budget = torch.arange(k, device=device).unsqueeze(0) < keep_rows.unsqueeze(1)
    q = batch.query.index_select(0, qsl[rows].to(torch.int64))
    n, num_heads, d = q.shape
    h = batch.num_kv_heads
    q = q.float().reshape(n * h, num_heads // h, d)
    if options.score == "bound":
        heads = torch.arange(h, device=device).view(1, -1, 1)
        index = (table.unsqueeze(1) * h + heads).flatten()
        summaries = layer.minmax.view(-1, 2 * d).index_select(0, index).view(n * h, width, 2 * d)
        q = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
        logits = torch.bmm(q, summaries.transpose(1, 2)).view(n, num_heads, width).mul_(batch.scale)
        logits.masked_fill_(~valid[:, None, :], float("-inf"))
    else:
        parts = layer.parts
        blocks = table.view(n, 1, width, 1)
        slices = torch.arange(parts, device=device).view(1, 1, 1, -1)
        heads = torch.arange(h, device=device).view(1, -1, 1, 1)
        index = ((blocks * parts + slices) * h + heads).flatten()
        summaries = layer.part_sum.view(-1, d).index_select(0, index).view(n * h, width * parts, d)
        logits = torch.bmm(q, summaries.transpose(1, 2)).view(n, num_heads, width, parts)
        starts = torch.arange(parts, device=device) * (bs // parts)
        count = (fills.masked_fill(~valid, 0).unsqueeze(2) - starts).clamp_(0, bs // parts)
        count = count.to(torch.float32).unsqueeze(1)
        logits.mul_(batch.scale / count.clamp(min=1)).add_(count.log())
        logits = logits.logsumexp(dim=-1) if parts > 1 else logits.squeeze(-1)
    scores = logits.softmax(dim=-1).mean(dim=1).masked_fill(forced, float("inf"))
    top = scores.topk(k, dim=1).indices
    top = torch.where(in_budget, top, width)
    chosen = top.sort(dim=1).values.clamp_(max=width - 1)
    out = batch.block_table.clone()
    out[rows, :k] = table.gather(1, chosen).to(out.dtype)
    lens = seq_lens.clone()
    lens[rows] = ((keep_rows - 1) * bs + last_fill).to(lens.dtype)
    return out, lens, rows, keep_rows, scores, table


def _differences(selection, reference, batch, tie=2e-6) -> tuple[int, int]:
    """(rows compared, rows whose chosen blocks differ by more than a
    rounding tie); rows the reference leaves alone must be untouched."""
    out, lens, rows, keep_rows, scores, table = (x.cpu() for x in reference)
    got_table, got_lens = selection.block_table.cpu(), selection.seq_lens.cpu()
    assert torch.equal(got_lens, lens)
    thinned = set(rows.tolist())
    for r in range(batch.seq_lens.shape[0]):
        if r not in thinned:
            n = _cdiv(int(batch.seq_lens[r]), batch.block_size)
            assert torch.equal(got_table[r, :n], batch.block_table[r, :n].cpu())
    real = 0
    for i, r in enumerate(rows.tolist()):
        k = int(keep_rows[i])
        want, got = out[r, :k].tolist(), got_table[r, :k].tolist()
        if want == got:
            continue
        position = {b: p for p, b in enumerate(table[i].tolist())}
        assert got == sorted(got, key=position.__getitem__), "chosen blocks out of position order"
        assert len(set(got)) == k and all(b in position for b in got), "a block the row does not own"
        ranked = scores[i].sort(descending=True).values
        edge = float(ranked[k - 1])
        odd = [position[b] for b in set(want) ^ set(got)]
        if any(abs(float(scores[i, p]) - edge) > tie for p in odd):
            real += 1
    return len(rows), real


SETTINGS = [
    {"keep_ratio": 0.25},
    {"keep_ratio": 0.25, "parts": 4},
    {"keep_ratio": 0.125, "score": "bound"},
    {"budget_blocks": 5, "sink_blocks": 2, "local_blocks": 2},
    {"keep_ratio": 0.3, "min_blocks": 12},
]


@pytest.mark.parametrize("device, kernels", PATHS)
@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("rows", ["decode", "mixed"])
def test_the_selection_chooses_the_blocks_the_earlier_selection_chose(device, kernels, options, rows):
    compared = 0
    for seed in range(3):
        lens = [700 + 97 * seed, 333, 1500, 129, 40, 977]
        # "mixed": one chunked-prefill row among decode rows.
        q_lens = [1, 1, 1, 64, 1, 1] if rows == "mixed" else [1] * 6
        reqs = Requests(device, lens, q_lens, seed=seed)
        method = _method(options, kernels)
        reqs.start(method)
        batch = reqs.step("layers.0", step=2)
        selection = method.before_attention(batch)
        reference = _reference(method.options, method._layers["layers.0"], batch)
        assert reference is not None and selection is not None
        rows, real = _differences(selection, reference, batch)
        assert real == 0, f"seed {seed}: {real} of {rows} rows chose other blocks than the earlier selection"
        compared += rows
    assert compared >= 9


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_pure_decode_step_over_128_token_blocks_matches_too(device, kernels):
    reqs = Requests(device, [2000, 1100, 3000, 700], [1, 1, 1, 1], block_size=128, head=64, seed=5)
    method = _method({"keep_ratio": 0.25, "parts": 4}, kernels)
    reqs.start(method)
    batch = reqs.step("layers.0", step=2)
    selection = method.before_attention(batch)
    rows, real = _differences(selection, _reference(method.options, method._layers["layers.0"], batch), batch)
    assert rows == 4 and real == 0


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_call_whose_only_decode_rows_come_after_the_first_128_counts_as_a_decode_call(device, kernels):
    """The kernels look for decode rows 128 rows at a time (the batch size
    is no compile-time constant): one found only in the second pass still
    counts the call."""
    rows = 131
    reqs = Requests(device, [40] * rows, [2] * (rows - 2) + [1, 1], seed=3, heads=2, kv_heads=1, head=16)
    method = _method({"budget_blocks": 2}, kernels)
    reqs.start(method)
    before = method.stats()
    assert method.before_attention(reqs.step("layers.0", step=2)) is not None
    after = method.stats()
    assert after.layer_calls - before.layer_calls == 1
    assert after.decode_rows - before.decode_rows == 2


@pytest.mark.parametrize("device, kernels", PATHS)
@pytest.mark.parametrize("options", [{"keep_ratio": 0.25}, {"keep_ratio": 0.25, "score": "bound"}],
                         ids=["mean", "bound"])
def test_rows_without_query_tokens_are_left_alone_and_the_others_still_thinned(device, kernels, options):
    """Rows of no query token (requests a batch is padded with), in the
    middle and at the end: not thinned, and no other row's query or key is
    taken for theirs (with one token for each of the other rows the call
    is no decode-only call, whose rows are its tokens)."""
    lens = [700, 333, 1500, 977]
    reqs = Requests(device, lens, [1, 0, 1, 0], seed=6)
    method = _method(options, kernels)
    reqs.start(method)
    batch = reqs.step("layers.0", step=2)
    selection = method.before_attention(batch)
    reference = _reference(method.options, method._layers["layers.0"], batch)
    rows, real = _differences(selection, reference, batch)
    assert rows == 2 and real == 0
    assert selection.seq_lens.tolist() == [_thinned_lens([700], 16, 0.25)[0], 333,
                                           _thinned_lens([1500], 16, 0.25)[0], 977]


@pytest.mark.parametrize("device, kernels", PATHS)
@pytest.mark.parametrize("score", ["bound", "mean", "parts"])
def test_a_summary_that_scores_nan_never_pushes_out_the_sinks_or_the_last_blocks(device, kernels, score):
    """A block whose summary bounds no key (min +inf, max -inf: 0 * inf is
    NaN in Quest's bound), or whose keys were NaN: topk ranks NaN above the
    forced blocks' inf.  The row still reads its sink and its last blocks,
    never that block, and the other rows choose as they would without it.
    With slices (``parts``), one slice of NaN keys costs the block that
    slice's share only: the row chooses as it does without it, in both
    paths."""
    lens = [1500, 977, 700]
    options = {"keep_ratio": 0.25, "score": score} if score != "parts" else {"keep_ratio": 0.25, "parts": 4}
    selections, poisoned = [], None
    for poison in (False, True):
        reqs = Requests(device, lens, [1] * 3, seed=4)
        method = _method(options, kernels)
        reqs.start(method)
        layer = method._layers["layers.0"]
        if poison:
            block = reqs.tables[0][10]          # neither a sink nor in the local window
            poisoned = block
            if score == "bound":
                layer.kmax[block] = float("-inf")
                layer.kmin[block] = float("inf")
            elif score == "mean":
                layer.part_sum[block] = float("nan")
            else:
                layer.part_sum[block, 3] = float("nan")
        selection = method.before_attention(reqs.step("layers.0", step=2))
        selections.append((selection.block_table.cpu(), selection.seq_lens.cpu()))
    (clean_table, clean_lens), (table, seq_lens) = selections
    assert torch.equal(seq_lens, clean_lens) and seq_lens.tolist() == _thinned_lens(lens, 16, 0.25)
    keep = _cdiv(int(seq_lens[0]), 16)
    chosen = table[0, :keep].tolist()
    own = reqs.tables[0]
    if score == "parts":
        # Its other slices still count: at most that block changes places.
        assert len(set(chosen) ^ set(clean_table[0, :keep].tolist())) <= 2
    else:
        assert poisoned not in chosen
    assert chosen[0] == own[0], "the sink block was pushed out"
    assert chosen[-1] == own[-1], "the block of the current token was pushed out"
    assert len(set(chosen)) == keep and set(chosen) <= set(own)
    for r in (1, 2):
        n = _cdiv(int(seq_lens[r]), 16)
        assert torch.equal(table[r, :n], clean_table[r, :n])


@pytest.mark.skipif(len(PATHS) == len(DEVICES), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)")
def test_the_kernels_score_a_slice_of_nan_keys_as_the_torch_path_does():
    """One slice of a chosen block holds NaN: both paths give that slice no
    share and keep the block's others, so they choose alike."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [1500, 977, 700]
    chosen = {}
    for kernels in ("torch", "triton"):
        reqs = Requests(device, lens, [1] * 3, seed=4)
        method = _method({"keep_ratio": 0.25, "parts": 4}, kernels)
        reqs.start(method)
        if not chosen:
            clean = method.before_attention(reqs.step("layers.0", step=2)).block_table[0].tolist()
            reqs = Requests(device, lens, [1] * 3, seed=4)
            method = _method({"keep_ratio": 0.25, "parts": 4}, kernels)
            reqs.start(method)
            # A block the clean choice took that is neither a sink nor in the local window.
            poisoned = next(b for b in clean[1:] if b in reqs.tables[0][1:-2])
        method._layers["layers.0"].part_sum[poisoned, 3] = float("nan")
        selection = method.before_attention(reqs.step("layers.0", step=2))
        chosen[kernels] = (selection.block_table.cpu(), selection.seq_lens.cpu())
    assert torch.equal(chosen["torch"][1], chosen["triton"][1])
    keep = _cdiv(int(chosen["torch"][1][0]), 16)
    assert chosen["torch"][0][0, :keep].tolist() == chosen["triton"][0][0, :keep].tolist()


@pytest.mark.skipif(len(PATHS) == len(DEVICES), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("score", ["mean", "bound", "channels"])
def test_the_kernels_keep_the_summaries_the_torch_path_keeps(score):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # 23 decode steps: blocks completed (probes taken) and started (reset).
    reqs = Requests(device, [700, 333, 1500, 977], [24] * 4, seed=11)
    options = {"mean": {"parts": 2}, "bound": {"score": "bound"}, "channels": {"channels": 8}}[score]
    methods = [_method({"keep_ratio": 0.25, **options}, k) for k in ("torch", "triton")]
    for m in methods:
        reqs.start(m)
    for step in range(23):
        lens = [n - 23 + step for n in reqs.lens]
        parts = [(n - 1, n) for n in lens]
        batch = reqs._batch("layers.0", 2 + step, parts, lens, range(4))
        for m in methods:
            m.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
            m.before_attention(dataclasses.replace(batch))
    a, b = (m._layers["layers.0"] for m in methods)
    assert torch.allclose(a.part_sum, b.part_sum, atol=1e-5)
    if score == "bound":
        assert torch.equal(a.minmax, b.minmax)
    assert torch.equal(a.made_at, b.made_at)
    # (The last row is the scratch row: writes that go nowhere land there.)
    pa, pb = a.probe[:-1], b.probe[:-1]
    assert torch.equal(pa.isnan(), pb.isnan())
    assert torch.equal(pa.nan_to_num(), pb.nan_to_num())
    assert (~pa.isnan()).any(dim=1).sum() > 10      # probes were taken
    sa, sb = (m.stats() for m in methods)
    assert sa == sb


# -- no waiting ----------------------------------------------------------------------------

# aten ops that read a device value back to the host (or make a shape of one).
_SYNCING = {"_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero", "masked_select",
            "_unique", "_unique2", "unique_dim", "unique_consecutive", "allclose", "tolist"}


class OpLog(TorchDispatchMode):
    """Every aten op dispatched, and those that wait for the device (boolean
    -mask indexing included: its result's shape is data)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in _SYNCING:
            self.syncing.append(name)
        elif name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.syncing.append(f"{name}[bool]")
        return func(*args, **(kwargs or {}))


def _thinned_lens(lens, block_size, ratio):
    out = []
    for n in lens:
        blocks = _cdiv(n, block_size)
        out.append((math.ceil(blocks * ratio) - 1) * block_size + n - (blocks - 1) * block_size)
    return out


def _llama_step(device, q_len: int = 1):
    """Batch 8, 8k context, Llama-3-8B attention shapes (32 / 8 heads of 128,
    16-token blocks): two layers' history, then a decode step (``q_len``
    query tokens a row: rows that verify ``q_len - 1`` drafts)."""
    lens = [8192 - 37 * i for i in range(8)]
    return Requests(device, lens, [q_len] * 8, block_size=16, heads=32, kv_heads=8, head=128, seed=1)


# What a decode layer call of the torch path dispatches, views included
# (counted here: 50 for a later layer of a step, two of them making NaN
# scores -inf; 164 for a step's first layer, which also works out the rows'
# tensors that all layers share).  The selection this replaced dispatched
# 154 on every call, 9 of them waiting.
LATER_LAYER_OPS, FIRST_LAYER_OPS = 52, 170


def test_a_decode_layer_call_on_cpu_dispatches_no_host_synchronising_op():
    reqs = _llama_step("cpu")
    method = _method({"keep_ratio": 0.25}, "torch")
    reqs.start(method, layers=("layers.0", "layers.1"))
    step = reqs.step("layers.0", step=2)
    # The layers of a step share vLLM's metadata tensors.
    batches = [step, dataclasses.replace(step, layer_name="layers.1")]
    first, later = OpLog(), OpLog()
    with first:
        selection = method.before_attention(batches[0])
    with later:
        method.before_attention(batches[1])
    print(f"ops: first layer {len(first.ops)}, later layer {len(later.ops)}")
    assert first.syncing == [] and later.syncing == []
    assert len(later.ops) <= LATER_LAYER_OPS, sorted(later.ops)
    assert len(first.ops) <= FIRST_LAYER_OPS, sorted(first.ops)
    # ... and it did thin: a quarter of each row's blocks, the last one partial.
    assert selection.seq_lens.tolist() == _thinned_lens(reqs.lens, 16, 0.25)


# A later layer's call that reuses the step before's choice (reselect_every):
# the fold of the new keys and a copy of the choice, no scoring (counted here: 54).
REUSED_LAYER_OPS = 60


def test_a_decode_layer_call_that_reuses_a_choice_on_cpu_dispatches_no_host_synchronising_op():
    reqs = _llama_step("cpu")
    method = _method({"keep_ratio": 0.25, "reselect_every": 2}, "torch")
    reqs.start(method, layers=("layers.0", "layers.1"))
    step = reqs.step("layers.0", step=2)
    for step_index in (2, 3, 4):                         # reuses the prefill's choice, scores, reuses
        method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
        step.step = step_index
        method.before_attention(dataclasses.replace(step, layer_name="layers.0"))
        later = OpLog()
        with later:
            selection = method.before_attention(dataclasses.replace(step, layer_name="layers.1"))
    print(f"ops: later layer reusing a choice {len(later.ops)}")
    assert later.syncing == [] and "bmm" not in later.ops
    assert len(later.ops) <= REUSED_LAYER_OPS, sorted(later.ops)
    assert selection.seq_lens.tolist() == _thinned_lens(reqs.lens, 16, 0.25)
    assert method.stats().rows_reused == 2 * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernels", _kernels("cuda"))
@pytest.mark.parametrize("reselect_every", [1, 2])
@pytest.mark.parametrize("drafts", [0, 3])
def test_a_decode_layer_call_on_cuda_never_synchronises(kernels, reselect_every, drafts):
    # With drafts, every row verifies 3 (two of them across a block boundary).
    reqs = _llama_step("cuda", 1 + drafts)
    method = _method({"keep_ratio": 0.25, "reselect_every": reselect_every}, kernels)
    if drafts:
        method.speculate(drafts)
    reqs.start(method, layers=("layers.0", "layers.1"))
    step = reqs.step("layers.0", step=2)
    batches = [step, dataclasses.replace(step, layer_name="layers.1")]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step_index in (2, 3, 4):               # with reselect_every 2, steps that score and that reuse
            method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
            for batch in batches:
                batch.step = step_index
                selection = method.before_attention(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert selection.seq_lens.tolist() == _thinned_lens(reqs.lens, 16, 0.25)
    assert (method.stats().rows_reused > 0) == (reselect_every > 1)


# -- dense below the crossover ---------------------------------------------------------------

def _decode(reqs: Requests, layer: str, step: int, back: int) -> AttentionBatch:
    """A decode step over everything but the last ``back`` tokens of each request."""
    lens = [n - back for n in reqs.lens]
    return reqs._batch(layer, step, [(n - 1, n) for n in lens], lens, range(len(lens)))


@pytest.mark.parametrize("device, kernels", PATHS)
def test_below_dense_below_a_call_costs_nothing_and_the_summaries_catch_up_from_the_pages(device, kernels):
    reqs = Requests(device, [900, 600, 1200], [4, 4, 4], seed=3)
    lazy = _method({"keep_ratio": 0.25, "dense_below": 1198}, kernels)
    eager = _method({"keep_ratio": 0.25, "dense_below": 0}, kernels)
    for m in (lazy, eager):
        reqs.start(m)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    for step, back in ((2, 3), (3, 2)):                    # longest rows 1,197 and 1,198
        batch = _decode(reqs, "layers.0", step, back)
        for m in (lazy, eager):
            m.begin_step(info)
        log = OpLog()
        with log:
            skipped = lazy.before_attention(batch)
        eager.before_attention(dataclasses.replace(batch))
        assert log.syncing == []
        if step == 2:
            assert skipped is None
    assert skipped is not None                             # 1,198: thinned again
    stats = lazy.stats()
    assert stats.sparse_rows == 3 and stats.blocks_dense == 2 * (57 + 38 + 75)
    # Every block the thinned call's rows read was summarised from its page.
    assert stats.blocks_summarized_from_pages == 57 + 38 + 75
    # The rebuilt summaries are the folded ones (to rounding), so the choice is too.
    a, b = lazy._layers["layers.0"], eager._layers["layers.0"]
    used = torch.cat([torch.tensor(t) for t in reqs.tables])
    assert torch.allclose(a.part_sum[used], b.part_sum[used], atol=1e-4)
    rows, real = _differences(skipped, _reference(eager.options, b, batch), batch)
    assert rows == 3 and real == 0


def test_a_request_that_wrote_keys_while_calls_were_dense_keeps_the_layers_rebuilding_until_covered():
    reqs = Requests("cpu", [900, 600, 1200], [4, 4, 4], seed=3)
    method = _method({"keep_ratio": 0.25, "dense_below": 1198}, "torch")
    reqs.start(method)
    # "rX" runs in the dense step, then is not scheduled in the next one.
    method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids) | {"rX"}))
    assert method.before_attention(_decode(reqs, "layers.0", 2, 3)) is None
    layer = method._layers["layers.0"]
    assert layer.behind
    method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
    assert method.before_attention(_decode(reqs, "layers.0", 3, 2)) is not None
    assert layer.behind                                  # rX's keys are still unfolded
    method.begin_step(StepInfo(16, finished_req_ids=frozenset({"rX"}), scheduled_req_ids=frozenset(reqs.req_ids)))
    assert method.before_attention(_decode(reqs, "layers.0", 4, 1)) is not None
    assert not layer.behind


def test_a_layer_left_behind_rebuilds_again_only_at_steps_that_run_a_request_it_has_not_covered():
    """A request that wrote keys while calls were dense and then does not
    run: the next thinned step rebuilds its rows once; steps without that
    request rebuild nothing (their rows' summaries are current), one that
    runs it again rebuilds."""
    reqs = Requests("cpu", [900, 600, 1200], [6] * 3, seed=3)
    method = _method({"keep_ratio": 0.25, "dense_below": 1196}, "torch")
    reqs.start(method)
    layer = method._layers["layers.0"]
    rebuilt = []
    for step, back, extra in ((2, 5, {"rX"}), (3, 4, set()), (4, 3, set()), (5, 2, {"rX"}), (6, 1, set())):
        method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids) | extra))
        selection = method.before_attention(_decode(reqs, "layers.0", step, back))
        assert (selection is None) == (step == 2)               # longest row 1,195: dense
        rebuilt.append(method.stats().blocks_summarized_from_pages)
        if step == 3:
            assert layer.behind                                 # rX's keys are still unfolded
    assert rebuilt[0] == 0 and rebuilt[1] == 56 + 38 + 75      # the rows read at step 3
    assert rebuilt[2] == rebuilt[1]                             # step 4: nothing
    assert rebuilt[3] > rebuilt[2]                              # rX again
    assert rebuilt[4] == rebuilt[3] and not layer.behind


def test_a_call_left_dense_dispatches_nothing_beyond_its_counters():
    reqs = Requests("cpu", [900, 600, 1200], [1, 1, 1], seed=3)
    method = _method({"keep_ratio": 0.25, "dense_below": 4096}, "torch")
    reqs.start(method, layers=("layers.0", "layers.1"))
    step = reqs.step("layers.0", step=2)
    first, later = OpLog(), OpLog()
    with first:
        assert method.before_attention(step) is None
    with later:
        assert method.before_attention(dataclasses.replace(step, layer_name="layers.1")) is None
    assert later.ops == [] and first.syncing == []
    assert method.stats().blocks_read == method.stats().blocks_dense == 2 * (57 + 38 + 75)


def test_counters_made_under_inference_mode_are_read_and_reset_outside_it():
    # vLLM runs the forward under torch.inference_mode(); stats() and
    # reset_stats() come from outside it.
    reqs = Requests("cpu", [900, 600], [1, 1], seed=2)
    method = _method({"keep_ratio": 0.25}, "torch")
    with torch.inference_mode():
        reqs.start(method)
        method.before_attention(reqs.step("layers.0", step=2))
    assert method.stats().sparse_rows == 2
    method.reset_stats()
    assert method.stats().sparse_rows == 0


def test_the_default_crossover_is_per_device():
    from ucm_connector.sparse.block_topk import DENSE_BELOW_DEFAULT

    assert DENSE_BELOW_DEFAULT["cpu"] == 0            # benchmarks/RESULTS.md: sparse pays from 2k at batch 8
    assert DENSE_BELOW_DEFAULT["cuda"] == 32768       # ... and on an H100, eagerly, from above 16k
    reqs = Requests("cpu", [900, 600, 1200], [1, 1, 1], seed=3)
    method = _method({"keep_ratio": 0.25}, "torch")
    reqs.start(method)
    assert method.before_attention(reqs.step("layers.0", step=2)) is not None    # CPU: no threshold


# -- steps -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_new_step_index_is_a_new_step_even_over_the_same_tensors(device, kernels):
    reqs = Requests(device, [1000, 1000], [1, 1], seed=4)
    method = _method({"keep_ratio": 0.25}, kernels)
    reqs.start(method)
    batch = reqs.step("layers.0", step=2)
    first = method.before_attention(batch).seq_lens.tolist()
    # vLLM refills its persistent buffers in place: same tensor objects, new
    # values (here: 8 tokens later, the last block full).
    batch.seq_lens += 8
    batch.max_seq_len += 8
    batch.slot_mapping.copy_(torch.tensor([reqs.tables[0][-1] * 16 + 15, reqs.tables[1][-1] * 16 + 15]))
    batch.step = 3
    second = method.before_attention(batch).seq_lens.tolist()
    assert first == [15 * 16 + 8, 15 * 16 + 8]          # 63 blocks, 8 tokens in the last: 16 read
    assert second == [15 * 16 + 16, 15 * 16 + 16]       # the last block now full


# -- blocks filled behind the forward ---------------------------------------------------------

@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_block_refilled_with_its_own_keys_keeps_its_summary(device, kernels):
    reqs = Requests(device, [1600, 800], [1, 1], seed=7)
    method = _method({"keep_ratio": 0.25}, kernels)
    reqs.start(method)
    # A prefix-cache hit on request 1's first 40 blocks: same content.
    method.begin_step(StepInfo(16, started=(RequestStart("r1", tuple(reqs.tables[1]), 40 * 16),),
                               scheduled_req_ids=frozenset(reqs.req_ids)))
    batch = reqs.step("layers.0", step=2)
    selection = method.before_attention(batch)
    stats = method.stats()
    assert (stats.blocks_probed_unchanged, stats.blocks_summarized_from_pages) == (40, 0)
    rows, real = _differences(selection, _reference(method.options, method._layers["layers.0"], batch), batch)
    assert rows == 2 and real == 0


@pytest.mark.parametrize("device, kernels", PATHS)
def test_requests_running_before_the_method_started_are_checked_until_they_finish(device, kernels):
    reqs = Requests(device, [1600, 1200], [1, 1], seed=8)
    fresh = _method({"budget_blocks": 3}, kernels)
    # The method starts while both requests run: it saw none of their keys.
    fresh.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
    batch = reqs.step("layers.0", step=1)
    log = OpLog()
    with log:
        selection = fresh.before_attention(batch)
    assert log.syncing                                   # it had to look
    assert fresh.stats().blocks_summarized_from_pages == 100 + 75
    rows, real = _differences(selection, _reference(fresh.options, fresh._layers["layers.0"], batch), batch)
    assert rows == 2 and real == 0
    # Once both are gone, a new request's steps never wait.
    fresh.begin_step(StepInfo(16, finished_req_ids=frozenset(reqs.req_ids), scheduled_req_ids=frozenset()))
    other = Requests(device, [1000], [1], seed=9)
    other.req_ids = ["r9"]
    other.start(fresh)
    batch = other.step("layers.0", step=4)
    log = OpLog()
    with log:
        fresh.before_attention(batch)
    assert log.syncing == []


# -- a choice reused over decode steps (reselect_every) ----------------------------------------

def _chosen(table: torch.Tensor, row: int, count: int) -> list[int]:
    return table[row, :count].tolist()


def both_steps(reusing: BlockTopK, scoring: BlockTopK, batch: AttentionBatch, info: StepInfo):
    """One step of two methods on the same batch: (the first's dispatched
    ops, which must not wait; its selection; the second's)."""
    for m in (reusing, scoring):
        m.begin_step(info)
    log = OpLog()
    with log:
        reused = reusing.before_attention(batch)
    scored = scoring.before_attention(dataclasses.replace(batch))
    assert log.syncing == []
    return log, reused, scored


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_reused_choice_reads_the_blocks_of_the_step_before_and_a_new_last_block(device, kernels):
    # Row 0 has 960 tokens at step 3 (60 full blocks) and starts block 61 at
    # step 4; the others stay inside their last block.
    reqs = Requests(device, [962, 600, 1200], [4, 4, 4], seed=3)
    reusing = _method({"keep_ratio": 0.25, "reselect_every": 2}, kernels)
    scoring = _method({"keep_ratio": 0.25}, kernels)
    for m in (reusing, scoring):
        reqs.start(m)                       # step 1: the prefill, which thins no row
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    backs = {2: 3, 3: 2, 4: 1, 5: 0}
    steps, ages = {}, {}
    for step, back in backs.items():
        log, reused, scored = both_steps(reusing, scoring, _decode(reqs, "layers.0", step, back), info)
        steps[step] = (log, reused.block_table.clone(), reused.seq_lens.clone(),
                       scored.block_table.clone(), scored.seq_lens.clone())
        # Steps a choice has served since it was scored (0: scored at this step).
        ages[step] = reusing._kept._choices["layers.0"].age
    lens = {step: [n - back for n in reqs.lens] for step, back in backs.items()}
    blocks = {step: [_cdiv(n, 16) for n in lens[step]] for step in lens}
    assert blocks[3][0] == 60 and blocks[4][0] == 61 and blocks[4][1:] == blocks[3][1:]
    # Step 2 reuses the prefill's choice, which thinned no row: all are read whole.
    assert ages == {2: 1, 3: 0, 4: 1, 5: 0}
    log, _, lens2, _, _ = steps[2]
    assert lens2.tolist() == lens[2]
    # Steps 3 and 5 score, and choose what a method that always scores
    # chooses: the summaries kept up at the steps in between.
    for step in (3, 5):
        log, table, seq_lens, scored, scored_lens = steps[step]
        assert torch.equal(seq_lens, scored_lens)
        for row, n in enumerate(blocks[step]):
            k = math.ceil(n * 0.25)
            assert _chosen(table, row, k) == scored[row, :k].tolist()
    # Step 4 scores nothing: each row reads what it read at step 3, row 0
    # its new block too.
    keep3 = [math.ceil(n * 0.25) for n in blocks[3]]
    log4, table4, lens4, _, _ = steps[4]
    if kernels == "torch":
        assert "bmm" not in log4.ops and "topk" not in log4.ops and "bmm" in steps[3][0].ops
    for row, k in enumerate(keep3):
        expected = _chosen(steps[3][1], row, k)
        if row == 0:
            expected.append(reqs.tables[0][60])
        assert _chosen(table4, row, len(expected)) == expected
        assert int(lens4[row]) == (len(expected) - 1) * 16 + lens[4][row] - (blocks[4][row] - 1) * 16
    stats = reusing.stats()
    assert (stats.sparse_rows, stats.rows_reused) == (9, 3)
    keep5 = [math.ceil(n * 0.25) for n in blocks[5]]
    assert stats.blocks_read == sum(blocks[2]) + 2 * sum(keep3) + 1 + sum(keep5)
    assert scoring.stats().rows_reused == 0


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_drafters_calls_inside_a_step_do_not_make_the_targets_choice_older(device, kernels):
    """Under EAGLE or MTP a drafter's layers run inside the target's step,
    with metadata of other shapes (here: two tokens per row, the drafter's
    first pass over the accepted tokens).  The target still reuses its
    choice at the next step."""
    reqs = Requests(device, [962, 600, 1200], [4, 4, 4], seed=3)
    method = _method({"keep_ratio": 0.25, "reselect_every": 2}, kernels)
    reqs.start(method)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    ages = {}
    for step, back in {2: 3, 3: 2, 4: 1, 5: 0}.items():
        method.begin_step(info)
        target = _decode(reqs, "layers.0", step, back)
        method.before_attention(target)
        lens = target.seq_lens.tolist()
        drafted = method.before_attention(reqs._batch("draft.0", step, [(n - 2, n) for n in lens], lens, []))
        assert drafted is None or drafted.seq_lens.tolist() == lens      # rows of two tokens: read whole
        ages[step] = method._kept._choices["layers.0"].age
    assert ages == {2: 1, 3: 0, 4: 1, 5: 0}
    assert method.stats().rows_reused == 3


def _swapped(reqs: Requests, order: list[int]) -> Requests:
    """The same requests in another row order (vLLM moves rows when others finish)."""
    other = Requests.__new__(Requests)
    other.__dict__.update(reqs.__dict__)
    for name in ("lens", "q_lens", "req_ids", "tables", "keys", "queries"):
        setattr(other, name, [getattr(reqs, name)[i] for i in order])
    other.table = reqs.table[order]
    return other


@pytest.mark.parametrize("device, kernels", PATHS)
def test_rows_that_hold_another_request_than_at_the_step_before_are_read_whole_at_a_reused_step(device, kernels):
    # Rows 0 and 1 have as many blocks as each other: only their block ids tell them apart.
    reqs = Requests(device, [1000, 1003, 1200], [5, 5, 5], seed=5)
    method = _method({"keep_ratio": 0.25, "reselect_every": 2}, kernels)
    reqs.start(method)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    method.begin_step(info)
    method.before_attention(_decode(reqs, "layers.0", 2, 4))    # reuses the prefill's choice
    method.begin_step(info)
    first = method.before_attention(_decode(reqs, "layers.0", 3, 3))
    kept = _chosen(first.block_table, 2, math.ceil(_cdiv(1197, 16) * 0.25))
    # Rows 0 and 1 trade places; row 2 stays.
    moved = _swapped(reqs, [1, 0, 2])
    method.begin_step(info)
    batch = _decode(moved, "layers.0", 4, 2)
    log = OpLog()
    with log:
        selection = method.before_attention(batch)
    assert log.syncing == [] and method._kept._choices["layers.0"].age == 1
    assert selection.seq_lens.tolist()[:2] == [1001, 998]                 # read whole
    assert torch.equal(selection.block_table[:2], batch.block_table[:2])
    assert _chosen(selection.block_table, 2, len(kept)) == kept          # reused
    assert method.stats().rows_reused == 1


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_row_read_whole_at_a_reused_step_reads_its_own_table_whatever_an_earlier_layer_wrote(device, kernels):
    reqs = Requests(device, [1000, 1200], [4, 4], seed=2)
    method = _method({"keep_ratio": 0.25, "reselect_every": 2}, kernels)
    layers = ("layers.0", "layers.1")
    reqs.start(method, layers)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    for step, back in ((2, 3), (3, 2)):                  # step 2 reuses the prefill's choice, step 3 scores
        method.begin_step(info)
        batch = _decode(reqs, "layers.0", step, back)
        for name in layers:
            method.before_attention(dataclasses.replace(batch, layer_name=name))
    # Layer 1's choice no longer holds row 0 (as if it had not thinned it),
    # and is narrower than layer 0's (as if a step apart in their cycles).
    choice = method._kept._choices["layers.1"]
    choice.thin = choice.thin.clone()
    choice.thin[0] = False
    choice.positions = choice.positions[:, :17].contiguous()
    method.begin_step(info)
    batch = _decode(reqs, "layers.0", 4, 1)
    first = method.before_attention(dataclasses.replace(batch, layer_name="layers.0"))
    assert int(first.seq_lens[0]) < 999 // 2                  # layer 0 reads its choice for row 0 ...
    second = method.before_attention(dataclasses.replace(batch, layer_name="layers.1"))
    n = _cdiv(999, 16)
    assert int(second.seq_lens[0]) == 999                     # ... layer 1 reads row 0 whole, its own blocks
    assert second.block_table[0, :n].tolist() == reqs.tables[0][:n]
    assert int(second.seq_lens[1]) < 1199 // 2


@pytest.mark.skipif(len(PATHS) == len(DEVICES), reason="needs Triton (CUDA, or TRITON_INTERPRET=1)")
def test_the_kernels_keep_the_choice_the_torch_path_keeps():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reqs = Requests(device, [963, 600, 1200, 100], [4, 4, 4, 4], seed=3)
    kept = {}
    for kernels in ("torch", "triton"):
        method = _method({"keep_ratio": 0.25, "reselect_every": 2}, kernels)
        reqs.start(method)
        info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
        method.begin_step(info)
        method.before_attention(_decode(reqs, "layers.0", 2, 3))      # reuses the prefill's choice
        method.begin_step(info)
        method.before_attention(_decode(reqs, "layers.0", 3, 2))      # scores
        kept[kernels] = method._kept._choices["layers.0"]
    torch_choice, kernel_choice = kept["torch"], kept["triton"]
    # Row 3 (100 tokens, 7 blocks: a budget of 2) is thinned too.
    assert kernel_choice.thin.tolist() == torch_choice.thin.tolist() == [True, True, True, True]
    for name in ("count", "num_blocks", "last_ids"):
        assert getattr(kernel_choice, name).tolist() == getattr(torch_choice, name).tolist(), name
    for row, k in enumerate(torch_choice.count.tolist()):
        assert kernel_choice.positions[row, :k].tolist() == torch_choice.positions[row, :k].tolist()


# -- Triton kernels compiled at start-up, never while serving ----------------------------------

def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor that starts one element into its buffer."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    buffer[1:] = t.flatten()
    return buffer[1:].view(t.shape)


def _launched(path) -> set[str]:
    from ucm_testing.triton_variants import variants

    return {json.dumps(v, sort_keys=True) for v in variants(str(path))} if path.exists() else set()


@pytest.mark.parametrize("device", [d for d, k in PATHS if k == "triton"])
@pytest.mark.parametrize("options", [
    {"keep_ratio": 0.25, "dense_below": 256},
    {"budget_blocks": 5, "reselect_every": 2, "score": "bound", "dense_below": 400},
    {"keep_ratio": 0.3, "parts": 2, "reselect_every": 3},
    {"budget_blocks": 5, "dense_below": 100000},       # never thins here: decode calls only fold their keys
    {"keep_ratio": 0.25, "reselect_every": 2, "speculate": 3},    # rows that verify 3 drafts decode too
    {"keep_ratio": 0.25, "channels": 16, "reselect_every": 2, "dense_below": 256},
])
def test_serving_launches_no_kernel_variant_that_the_warm_up_did_not(tmp_path, device, options):
    """Variants as Triton tells them apart on a GPU (argument types, what
    it specialises on, constants, options), recorded under the interpreter
    or on CUDA; on CUDA, Triton itself also compiles nothing after the
    warm-up."""
    from ucm_testing.triton_variants import record

    # vLLM's block table has one width for the engine's life: 120 blocks here.
    table = 120
    options = dict(options)
    drafts = options.pop("speculate", 0)
    method = _method(options, "triton")
    if drafts:
        method.speculate(drafts)
    warm, served = tmp_path / "warm.jsonl", tmp_path / "served.jsonl"
    example = Requests(device, [40], [1], table_width=table).step("layers.0", 1)
    with record(str(warm)):
        launches = method.warm_up(example)
    assert launches > 0 and method.stats() == SparseStats() and method._layers == {}
    compiled: list[str] = []
    if device == "cuda":
        import triton

        def note(*, repr, **_):
            compiled.append(repr)

        knobs = triton.knobs.runtime
        before, knobs.jit_post_compile_hook = knobs.jit_post_compile_hook, note
    # Serving: batches of 1, 2, 3 and 17 rows, decode steps (scored and
    # reused), a mixed step (one row still in prefill), a step of rows
    # verifying drafts (decode rows where the method speculates), a method started
    # while requests run (its first steps check what they read), and
    # longest rows from 5 to 100 blocks.
    try:
        with record(str(served)):
            for n, (lens, q_lens, running) in enumerate([
                ([1380], [1], False), ([900, 40], [1, 1], False), ([700, 1200, 300], [1, 6, 1], False),
                ([60 + 33 * i for i in range(17)], [1] * 17, False), ([256, 100], [1, 1], False),
                ([500], [1], False), ([70, 30], [1, 1], False), ([1600, 520], [1, 1], True),
                ([1250, 900], [4, 2], False),
                ([1000, 330], [1, 1], "unaligned"),
            ]):
                reqs = Requests(device, lens, q_lens, seed=n, table_width=table)
                reqs.req_ids = [f"b{n}r{i}" for i in range(len(lens))]
                if running:
                    method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
                else:
                    reqs.start(method)
                for step, back in enumerate((3, 2, 1, 0)):
                    method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
                    if q_lens != [1] * len(lens) and back == 0:
                        batch = reqs.step("layers.0", 10 * n + step + 2)
                    else:
                        batch = _decode(reqs, "layers.0", 10 * n + step + 2, back)
                    if running == "unaligned":
                        # Metadata that starts 4 or 8 bytes into a buffer (a
                        # micro-batch's slice, a row of a shared buffer).
                        batch = dataclasses.replace(batch, **{name: _unaligned(getattr(batch, name)) for name in (
                            "slot_mapping", "query_start_loc", "seq_lens", "block_table")})
                    method.before_attention(batch)
    finally:
        if device == "cuda":
            knobs.jit_post_compile_hook = before
    assert (method.stats().sparse_rows > 0) == (options["dense_below"] < 1600 if "dense_below" in options else True)
    missed = _launched(served) - _launched(warm)
    assert not missed, "served variants the warm-up did not launch:\n" + "\n".join(sorted(missed))
    assert compiled == []


@pytest.mark.parametrize("channels", [None, 16])
@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_query_quantized_for_an_fp8_cache_selects_the_blocks_its_full_precision_query_selects(
        device, kernels, channels):
    """vLLM hands an fp8 cache's attention an fp8 query holding q / q_scale;
    the patch folds q_scale into the call's scale, so the scores, and the
    blocks chosen, are those of the full-precision query."""
    from types import SimpleNamespace

    from patches.attention import _query_scale

    reqs = Requests(device, [1500, 900], [1, 1], seed=21)
    chosen = []
    for quantized in (False, True):
        method = _method({"keep_ratio": 0.25} if channels is None else {"keep_ratio": 0.25, "channels": channels},
                         kernels)
        reqs.start(method)
        method.begin_step(StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids)))
        batch = reqs.step("layers.0", step=2)
        layer = SimpleNamespace(_q_scale_float=0.25)
        if quantized:
            query = (batch.query.float() / layer._q_scale_float).to(torch.float8_e4m3fn)
            batch = dataclasses.replace(batch, query=query, scale=batch.scale * _query_scale(layer, query))
        else:
            assert _query_scale(layer, batch.query) == 1.0
        selection = method.before_attention(batch)
        chosen.append([_chosen(selection.block_table, r, math.ceil(_cdiv(n, 16) * 0.25))
                       for r, n in enumerate(reqs.lens)])
    if channels is None:
        assert chosen[0] == chosen[1]
    else:
        # Every key scored on its own feels the fp8 query's rounding: a
        # block or two at the edge of the budget may change.
        differ = sum(len(set(a) - set(b)) for a, b in zip(*chosen))
        assert differ <= 2, chosen


@pytest.mark.parametrize("channels", [None, 16])
@pytest.mark.parametrize("fp8_scale", [None, 0.05])
@pytest.mark.parametrize("device, kernels", PATHS)
def test_blocks_loaded_behind_the_forward_are_checked_without_waiting(device, kernels, fp8_scale, channels):
    """Blocks refilled behind the forward (a connector load, a prefix-cache
    hit) are checked without waiting for the device: one hit with the same
    keys keeps its summaries, new content is summarized from the pages, and
    the block that new content makes hot is chosen.  The same over
    FlashAttention's per-tensor fp8 cache, read back times its scale
    (probes as stored), and with ``channels``."""
    reqs = Requests(device, [1600, 800], [1, 1], seed=7, fp8_scale=fp8_scale)
    if fp8_scale is not None:
        ids = torch.tensor(reqs.tables[0][:3], device=reqs.device)
        stored = reqs.kv.view(torch.float8_e4m3fn).index_select(0, ids).transpose(1, 2)[..., :64]
        assert torch.equal(reqs.pages.read(ids), stored.float() * fp8_scale)
        truth = torch.stack([reqs.keys[0][b * 16:(b + 1) * 16] for b in range(3)]).to(reqs.device).float()
        assert (reqs.pages.read(ids) - truth).abs().max() < 0.1 * truth.abs().max()
    method = _method({"budget_blocks": 3, **({"channels": channels} if channels else {})}, kernels)
    reqs.start(method)
    # A connector load puts new content into request 0's first 99 blocks
    # (its hot block is now position 40); a prefix-cache hit on request 1's
    # first 40 blocks, same keys.
    keys = torch.randn(99 * 16, 2, 64)
    keys[40 * 16:41 * 16] += 4 * reqs.queries[0][::3].float()
    reqs.write(reqs.slots(0, 0, 99 * 16), keys)
    method.begin_step(StepInfo(16, started=(RequestStart("r0", tuple(reqs.tables[0]), 99 * 16),
                                            RequestStart("r1", tuple(reqs.tables[1]), 40 * 16)),
                               scheduled_req_ids=frozenset(reqs.req_ids)))
    batch = reqs.step("layers.0", step=2)
    log = OpLog()
    with log:
        selection = method.before_attention(batch)
    assert log.syncing == []
    table = reqs.tables[0]
    assert selection.block_table[0, :3].tolist() == [table[0], table[40], table[99]]
    stats = method.stats()
    # With channels, the history's call chose them and summarized its 150
    # blocks from the pages first.
    rebuilt = 99 if channels is None else 150 + 99
    assert (stats.blocks_summarized_from_pages, stats.blocks_probed_unchanged) == (rebuilt, 40)


def _fake_flash_layer(kv_cache_dtype: str, quantized_query: bool, k_scale, q_scale=1.0):
    """An attention layer and impl with FlashAttention's attributes, whose
    impl class carries the hook's ``key_pages`` as the patched one does
    (the test is skipped where vLLM is not installed: the GPU machines)."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")

    from vllm.v1.attention.backend import AttentionType

    from patches.attention import _fa_pages

    class Impl:
        def forward(self):
            pass

        forward.ucm_key_pages = _fa_pages

    impl = Impl()
    impl.__dict__.update(num_heads=6, num_kv_heads=2, head_size=64, scale=0.125, attn_type=AttentionType.DECODER,
                         alibi_slopes=None, sliding_window=None, kv_cache_dtype=kv_cache_dtype,
                         supports_quant_query_input=True)
    k = torch.as_tensor(k_scale, dtype=torch.float32)
    q = torch.as_tensor(q_scale, dtype=torch.float32)
    return SimpleNamespace(impl=impl, query_quant=object() if quantized_query else None,
                           _k_scale=k, _k_scale_float=float(k.max()), _q_scale=q, _q_scale_float=float(q.max()))


def test_the_example_call_of_an_fp8_layer_has_an_fp8_query_a_model_dtype_key_and_its_pages():
    from vllm.platforms import current_platform

    from patches.attention import example_batch

    reqs = Requests("cpu", [300], [1], fp8_scale=0.25)
    ids = torch.tensor(reqs.tables[0][:2])
    example = example_batch("model.layers.3.self_attn.attn", _fake_flash_layer("fp8", True, 0.25), reqs.kv,
                            torch.bfloat16, 4096)
    assert example.query.dtype == current_platform.fp8_dtype() and example.key.dtype == torch.bfloat16
    assert example.block_table.shape == (1, 4096 // 16) and example.block_table.dtype == torch.int32
    assert torch.equal(example.pages.read(ids), reqs.pages.read(ids))
    plain = Requests("cpu", [300], [1])
    example = example_batch("model.layers.3.self_attn.attn", _fake_flash_layer("auto", False, 1.0), plain.kv,
                            torch.bfloat16, 4096)
    assert example.query.dtype == example.key.dtype == torch.bfloat16

    class Composite:                       # vLLM's impl for multimodal prefixes: decoder calls go to causal_impl
        def forward(self):
            pass

    layer = _fake_flash_layer("auto", False, 1.0)
    composite = Composite()
    composite.causal_impl, layer.impl = layer.impl, composite
    example = example_batch("model.layers.3.self_attn.attn", layer, plain.kv, torch.bfloat16, 4096)
    assert example is not None and example.num_kv_heads == 2 and example.query.shape == (1, 6, 64)


def test_fp8_pages_are_read_with_the_layers_one_scale_and_per_head_scales_leave_the_call_to_vllm():
    """compressed-tensors' per-head scales: the one float vLLM keeps beside
    them is their largest, which would put other heads' scores and
    summaries at the wrong scale."""
    from patches.attention import _fa_pages, _query_scale

    reqs = Requests("cpu", [300], [1], fp8_scale=0.25)
    per_head = _fake_flash_layer("fp8", True, [0.25, 0.5], q_scale=[0.1, 0.2])
    assert _fa_pages(per_head.impl, per_head, reqs.kv) is None
    fp8_query = torch.zeros(1, 6, 64).to(torch.float8_e4m3fn)
    assert _query_scale(per_head, fp8_query) is None
    assert _query_scale(per_head, torch.zeros(1, 6, 64, dtype=torch.bfloat16)) == 1.0
    per_tensor = _fake_flash_layer("fp8", True, 0.25, q_scale=0.1)
    assert _query_scale(per_tensor, fp8_query) == pytest.approx(0.1)
    ids = torch.tensor(reqs.tables[0][:2])
    for dtype in ("fp8", "fp8_e4m3"):
        per_tensor.impl.kv_cache_dtype = dtype
        pages = _fa_pages(per_tensor.impl, per_tensor, reqs.kv)
        assert torch.equal(pages.read(ids), reqs.pages.read(ids))
        assert torch.equal(pages.probe(ids), reqs.pages.probe(ids))
    # Caches of another quantization are left unread.
    for dtype in ("fp8_e5m2", "nvfp4", "int8_per_token_head"):
        per_tensor.impl.kv_cache_dtype = dtype
        assert _fa_pages(per_tensor.impl, per_tensor, reqs.kv) is None


def test_kernels_that_cannot_be_built_at_the_warm_up_leave_the_torch_path_selecting(monkeypatch, caplog):
    """Triton refuses some kernels on some GPUs ("type fp8e4nv not
    supported in this architecture" for fp8 pages before sm_89): the
    warm-up then switches the method to its torch ops, whose selection is
    the same, rather than let the first decode call raise."""
    def cannot(*args, **kwargs):
        raise RuntimeError("type fp8e4nv not supported in this architecture")

    monkeypatch.setattr(triton_select, "fold_decode", cannot)
    reqs = Requests("cpu", [2000, 1100, 700], [1, 1, 1], seed=4)
    method = _method({"keep_ratio": 0.25}, "triton")
    assert method.warm_up(Requests("cpu", [40], [1], table_width=reqs.table.shape[1]).step("layers.0", 1)) == 0
    assert method.kernels == "torch" and "fp8e4nv not supported" in caplog.text
    reqs.start(method)
    batch = reqs.step("layers.0", step=2)
    selection = method.before_attention(batch)
    rows, real = _differences(selection, _reference(method.options, method._layers["layers.0"], batch), batch)
    assert rows == 3 and real == 0
