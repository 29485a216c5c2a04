"""block_topk under speculative decoding, without vLLM, on every device and
path ``test_sparse_select`` runs (the Triton kernels under its interpreter
in ``make test-kernels``).

A request that verifies drafts has a decode row of several query tokens:
the token it sampled last, then the drafts.  Told how many drafts the
engine makes (``speculate``), the method thins such rows like rows of one
token:

* it chooses the blocks ``_reference`` chooses (scored with the row's
  first query token, every block from the first new token's on forced in);
* the kernel, which lines a row's query tokens up with the end of what it
  reads, sees each query token at its own position: the tokens read end
  with exactly the row's new tokens (``_aligned``);
* a reused choice (``reselect_every``) still ends with them;
* a slot written again after its draft was rejected is counted once in its
  block's summary: a completed block's summary is the one its page gives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sparse_select import (PATHS, SETTINGS, OpLog, Requests, _cdiv, _differences, _llama_step, _method,
                                _reference, both_steps)

from ucm_connector.sparse import RequestStart, StepInfo


def _aligned(selection, reqs: Requests, ends: list[int], q_lens: list[int]) -> None:
    """Each row reads its tokens in position order, and the last ``q`` of
    what it reads are its ``q`` new tokens: attention lined up with the end
    puts every query token at its own position."""
    bs = reqs.block_size
    for r, (end, q) in enumerate(zip(ends, q_lens)):
        length = int(selection.seq_lens[r]) if selection is not None else end
        table = selection.block_table if selection is not None else reqs.table
        ids = table[r, :_cdiv(length, bs)].tolist()
        position = {b: p for p, b in enumerate(reqs.tables[r][:_cdiv(end, bs)])}
        assert all(b in position for b in ids), f"row {r} reads a block it does not own"
        read = [position[b] * bs + t for b in ids for t in range(bs)][:length]
        assert read == sorted(set(read)), f"row {r}: blocks out of order"
        assert read[length - q:] == list(range(end - q, end)), f"row {r}: its new tokens are not read last"


def _step_batch(reqs: Requests, step: int, starts: list[int], ends: list[int]):
    return reqs._batch("layers.0", step, list(zip(starts, ends)), ends, range(len(ends)))


# Rows 0 and 5 verify tokens that cross into a new block; row 3 is a
# prefill chunk; row 6 has more query tokens than a step with 3 drafts.
LENS = [1602, 700, 333, 977, 1500, 129, 800]
Q_LENS = [4, 4, 2, 64, 1, 3, 5]


@pytest.mark.parametrize("device, kernels", PATHS)
@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_rows_that_verify_drafts_are_thinned_and_read_their_new_tokens_last(device, kernels, options):
    compared = 0
    for seed in range(2):
        reqs = Requests(device, LENS, Q_LENS, seed=seed)
        method = _method(options, kernels)
        method.speculate(3)
        reqs.start(method)
        batch = reqs.step("layers.0", step=2)
        log = OpLog()
        with log:
            selection = method.before_attention(batch)
        if device == "cpu" and kernels == "torch":
            assert log.syncing == []
        reference = _reference(method.options, method._layers["layers.0"], batch, query_tokens=4)
        rows, real = _differences(selection, reference, batch)
        assert real == 0, f"seed {seed}: {real} of {rows} rows chose other blocks than the reference"
        thinned = set(reference[2].tolist())
        # Row 5 has 9 blocks: fewer than min_blocks, where set.
        assert {0, 1, 2, 4} <= thinned and not {3, 6} & thinned and (5 in thinned) != ("min_blocks" in options)
        # Rows 0 and 5 keep both blocks their new tokens are in.
        for row in {0, 5} & thinned:
            n = _cdiv(LENS[row], 16)
            kept = _cdiv(int(selection.seq_lens[row]), 16)
            assert selection.block_table[row, kept - 2:kept].tolist() == reqs.tables[row][n - 2:n]
        _aligned(selection, reqs, LENS, Q_LENS)
        stats = method.stats()
        assert stats.decode_rows == 5 and stats.sparse_rows == len(thinned)
        compared += rows
    assert compared >= 8


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_method_not_told_of_drafts_reads_rows_of_several_query_tokens_whole(device, kernels):
    reqs = Requests(device, LENS, Q_LENS, seed=1)
    method = _method({"keep_ratio": 0.25}, kernels)
    reqs.start(method)
    batch = reqs.step("layers.0", step=2)
    selection = method.before_attention(batch)
    assert selection.seq_lens.tolist()[:4] == [1602, 700, 333, 977]
    assert int(selection.seq_lens[4]) < 1500 // 2
    assert method.stats().decode_rows == 1


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_reused_choice_still_reads_a_verifying_rows_new_tokens_last(device, kernels):
    """Steps of two requests with 3 drafts each: (first new token, end) per
    step, the next step starting after the tokens accepted.  Row 0 starts a
    block at step 3 and verifies across two blocks; step 4 rejects every
    draft of both."""
    plan = {2: ([1595, 1200], [1599, 1204]), 3: ([1598, 1204], [1602, 1208]),
            4: ([1599, 1205], [1602, 1209]), 5: ([1602, 1207], [1606, 1211])}
    reqs = Requests(device, [1606, 1211], [11, 11], seed=4)
    reusing = _method({"keep_ratio": 0.25, "reselect_every": 2}, kernels)
    scoring = _method({"keep_ratio": 0.25}, kernels)
    for m in (reusing, scoring):
        m.speculate(3)
        reqs.start(m)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    chosen = {}
    for step, (starts, ends) in plan.items():
        q_lens = [e - s for s, e in zip(starts, ends)]
        _, reused, scored = both_steps(reusing, scoring, _step_batch(reqs, step, starts, ends), info)
        for selection in (reused, scored):
            _aligned(selection, reqs, ends, q_lens)
        chosen[step] = reused
    # Step 3 scores and is thinned; step 4 reads step 3's blocks (its rows
    # grew no block), step 5 those and row 0's new one.
    counts = {step: [_cdiv(int(n), 16) for n in chosen[step].seq_lens] for step in chosen}
    for row in (0, 1):
        assert counts[3][row] < _cdiv(plan[3][1][row], 16) // 2
        assert chosen[4].block_table[row, :counts[4][row]].tolist() == \
            chosen[3].block_table[row, :counts[3][row]].tolist()
    stats = reusing.stats()
    assert stats.rows_reused == 2 and stats.decode_rows == 8


def _summary_from_pages(layer, pages, block: int):
    ids = torch.tensor([block], device=layer.part_sum.device)
    kmin, kmax, sums = pages.reduce(ids, layer.parts)
    return sums[0].to(layer.part_sum.dtype), kmin[0], kmax[0]


@pytest.mark.parametrize("device, kernels", PATHS)
@pytest.mark.parametrize("options", [{"keep_ratio": 0.25}, {"keep_ratio": 0.25, "parts": 4},
                                     {"keep_ratio": 0.25, "score": "bound"}],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_slot_written_again_after_its_draft_was_rejected_counts_once_in_its_blocks_summary(
        device, kernels, options):
    # One request of 640 tokens (40 full blocks); its last block is filled
    # by verifying steps, the first of which writes drafts that are then
    # rejected: their slots are written again with the real tokens.
    end = 640
    reqs = Requests(device, [end], [8], seed=6)
    method = _method(options, kernels)
    method.speculate(3)
    reqs.start(method)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    real = reqs.keys[0].clone()
    drafts = real.clone()
    drafts[end - 7:end - 4] = (3 * torch.randn(3, reqs.kv_heads, reqs.head)).to(drafts.dtype)
    for step, (start, stop, keys) in enumerate([(end - 8, end - 4, drafts), (end - 7, end - 4, real),
                                                (end - 4, end, real)], start=2):
        # vLLM writes the step's keys into the cache before attention.
        reqs.keys[0] = keys
        reqs.write(reqs.slots(0, start, stop), keys[start:stop])
        method.begin_step(info)
        method.before_attention(_step_batch(reqs, step, [start], [stop]))
    layer = method._layers["layers.0"]
    block = reqs.tables[0][end // 16 - 1]
    sums, kmin, kmax = _summary_from_pages(layer, reqs.pages, block)
    torch.testing.assert_close(layer.part_sum[block], sums, rtol=1e-5, atol=1e-4)
    if layer.minmax is not None:
        torch.testing.assert_close(layer.kmin[block], kmin.to(layer.kmin.dtype))
        torch.testing.assert_close(layer.kmax[block], kmax.to(layer.kmax.dtype))
    # ... and it is current: the page's probe, at the block's epoch.
    assert bool((layer.made_at[block] == method._keeper.epochs.epochs[block]).item())
    assert torch.equal(layer.probe[block], reqs.pages.probe(torch.tensor([block], device=reqs.kv.device))[0]
                       .to(layer.probe.dtype))



@pytest.mark.parametrize("device, kernels", PATHS)
def test_where_pages_cannot_be_read_a_block_with_a_rewritten_slot_loses_its_summary_and_is_read(device, kernels):
    """Without pages (a quantized cache) the summary cannot be made again:
    the block is read whole instead of being scored by sums that count a
    rejected draft's key.  A block filled without rewrites keeps its own."""
    end = 640
    reqs = Requests(device, [end + 1, end + 1], [9, 9], seed=7)
    method = _method({"keep_ratio": 0.25}, kernels)
    method.speculate(3)
    info = StepInfo(16, scheduled_req_ids=frozenset(reqs.req_ids))
    method.begin_step(StepInfo(16, started=tuple(RequestStart(r, tuple(t), 0)
                                                 for r, t in zip(reqs.req_ids, reqs.tables)),
                               scheduled_req_ids=frozenset(reqs.req_ids)))
    method.before_attention(dataclasses.replace(reqs.history("layers.0", 1), pages=None))
    # Row 0 verifies drafts that are rejected, and writes their slots again;
    # row 1 fills the same positions once.
    for step, (starts, stops) in enumerate([([end - 8, end - 8], [end - 4, end - 5]),
                                            ([end - 7, end - 5], [end - 4, end - 4]),
                                            ([end - 4, end - 4], [end, end]),
                                            ([end, end], [end + 1, end + 1])], start=2):
        method.begin_step(info)
        before = method.stats().blocks_kept_unsummarized
        method.before_attention(dataclasses.replace(_step_batch(reqs, step, starts, stops), pages=None))
    layer = method._layers["layers.0"]
    rewritten, once = (reqs.tables[r][end // 16 - 1] for r in (0, 1))
    epochs = method._keeper.epochs.epochs
    assert int(layer.made_at[rewritten]) == -1
    assert int(layer.made_at[once]) == int(epochs[once])
    # The last step scored the rows' 41 blocks: that one was read unscored.
    assert method.stats().blocks_kept_unsummarized - before == 1


# What a later layer's call of a step of verifying rows dispatches on the
# torch path (counted here: 72; 50 for rows of one token, whose keys the
# Triton path folds in its scoring kernel): the keys folded in torch ops,
# and the blocks they complete summarised again from their pages.
VERIFY_LAYER_OPS = 75


def test_a_verifying_layer_call_on_cpu_dispatches_no_host_synchronising_op():
    reqs = _llama_step("cpu", 4)
    method = _method({"keep_ratio": 0.25}, "torch")
    method.speculate(3)
    reqs.start(method, layers=("layers.0", "layers.1"))
    step = reqs.step("layers.0", step=2)
    first, later = OpLog(), OpLog()
    with first:
        method.before_attention(step)
    with later:
        selection = method.before_attention(dataclasses.replace(step, layer_name="layers.1"))
    assert first.syncing == [] and later.syncing == []
    assert len(later.ops) <= VERIFY_LAYER_OPS, sorted(later.ops)
    assert method.stats().sparse_rows == 16
    _aligned(selection, reqs, reqs.lens, reqs.q_lens)
