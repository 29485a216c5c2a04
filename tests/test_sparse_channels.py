"""block_topk's ``channels`` option, without vLLM, on the torch path and
(on CUDA, or under Triton's interpreter) the Triton path: every key scored
on its own, on a few channels.

* a block that matters for one key in it (a "needle": the token a copy
  continues from) is chosen, where blocks' mean keys pass it over for
  blocks whose every key is a little closer to the query;
* the summaries hold every key on the chosen channels, folded as keys are
  written or made from the pages;
* the channels are the ones where the keys are loudest, chosen from the
  pages at a layer's first call that can thin; calls before it (below
  ``dense_below``) are left dense and that call rebuilds from the pages
  what they did not fold;
* a decode call waits for nothing, also when rows verify drafts, and those
  rows read their new tokens last;
* bad option sets are refused with the option named.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_sparse_select import PATHS, OpLog, Requests, _cdiv, _kernels, _method
from test_sparse_speculative import LENS, Q_LENS, _aligned

from ucm_connector.sparse import RequestStart, SparseConfigError, StepInfo, torch_select
from ucm_connector.sparse.block_topk import BlockTopKOptions

# The first chunk is shorter than DENSE_BELOW: left dense, before any channel is chosen.
BS, LEN, NEEDLE, FIRST_CHUNK, DENSE_BELOW = 16, 1024, 150, 200, 400
# What a later layer's decode call dispatches with channels and rows that
# verify drafts, its first (counted here: 86, against 72 for a call scoring
# blocks' mean keys): the choice of the layer's channels, the catch-up from
# the pages and the projection of the query, keys and pages add the rest.
LATER_LAYER_OPS = 88


def _haystack(seed: int):
    """One request of 1,024 tokens (64 blocks of 16): keys loud on 8
    channels per KV head, 20 "warm" blocks whose every key is a little
    closer to the query than chance, and one key (token 150, block 9, not a
    warm one) far closer.  Returns the requests, the loud channels and the
    warm blocks' positions."""
    gen = torch.Generator().manual_seed(seed)
    reqs = Requests("cpu", [LEN], [1], block_size=BS, heads=6, kv_heads=2, head=64, seed=seed)
    loud = torch.stack([torch.randperm(64, generator=gen)[:8].sort().values for _ in range(2)])   # [kv, 8]
    sign = torch.tensor([1.0, -1.0] * 4)
    keys = torch.randn(LEN, 2, 64, generator=gen)
    query = 0.3 * torch.randn(6, 64, generator=gen)
    warm = [p for p in torch.randperm(62, generator=gen).add(1).tolist() if p != NEEDLE // BS][:20]
    for h in range(2):
        keys[:, h, loud[h]] += 4.0
        query[3 * h:3 * h + 3, loud[h]] = sign          # sums to 0 over the loud channels: the 4.0 cancels
        for p in warm:
            keys[p * BS:(p + 1) * BS, h, loud[h]] += 0.5 * sign
        keys[NEEDLE, h, loud[h]] += 6.0 * sign
    reqs.keys[0] = keys.to(torch.bfloat16)
    reqs.queries[0] = query.to(torch.bfloat16)
    reqs.write(reqs.slots(0, 0, LEN), reqs.keys[0])
    return reqs, loud, warm


def _run(reqs: Requests, options: dict, kernels: str = "torch"):
    """The request's history in two prefill calls (the first left dense for
    its length), then a decode call."""
    method = _method({"dense_below": DENSE_BELOW, **options}, kernels)
    ids = frozenset(reqs.req_ids)
    method.begin_step(StepInfo(BS, started=(RequestStart("r0", tuple(reqs.tables[0]), 0),), scheduled_req_ids=ids))
    first = reqs._batch("layers.0", 1, [(0, FIRST_CHUNK)], [FIRST_CHUNK], [])
    early = method.before_attention(first)
    made_early = "layers.0" in method._layers
    method.begin_step(StepInfo(BS, scheduled_req_ids=ids))
    method.before_attention(reqs._batch("layers.0", 2, [(FIRST_CHUNK, LEN - 1)], [LEN - 1], []))
    method.begin_step(StepInfo(BS, scheduled_req_ids=ids))
    assert not method._keeper.checking()       # nothing is looked for on the device
    selection = method.before_attention(reqs.step("layers.0", step=3))
    return method, selection, early, made_early


def _positions(reqs: Requests, selection) -> list[int]:
    position = {b: p for p, b in enumerate(reqs.tables[0])}
    length = int(selection.seq_lens[0])
    return [position[b] for b in selection.block_table[0, :_cdiv(length, BS)].tolist()]


@pytest.mark.parametrize("kernels", _kernels("cpu"))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_block_that_matters_for_one_key_is_chosen_where_mean_keys_pass_it_over(seed, kernels):
    reqs, loud, warm = _haystack(seed)
    method, selection, early, made_early = _run(reqs, {"keep_ratio": 0.125, "channels": 8}, kernels)
    # The first call came before the channels were chosen: dense, and no summaries yet.
    assert early is None and not made_early
    assert torch.equal(method._channels._layers["layers.0"].chosen, loud)
    read = _positions(reqs, selection)
    assert len(read) == 8 and read[0] == 0 and read[-1] == 63
    # The needle's block was in the call that folded nothing: the first
    # thinned call rebuilt it from the pages, and found it.
    assert NEEDLE // BS in read, read

    _, by_mean, _, _ = _run(reqs, {"keep_ratio": 0.125}, kernels)
    read = _positions(reqs, by_mean)
    assert NEEDLE // BS not in read and set(read[1:-1]) <= set(warm)


@pytest.mark.parametrize("kernels", _kernels("cpu"))
def test_an_fp16_model_keeps_fp16_summaries_and_finds_the_needle(kernels):
    """Summaries in the model's dtype whatever 16-bit one it is (on CPU an
    fp16 matmul is slow: they are scored in fp32 there)."""
    from patches.attention import FlashKeyPages

    reqs, _, _ = _haystack(0)
    reqs.kv = reqs.kv.half()
    reqs.pages = FlashKeyPages(reqs.kv, 64)
    make = reqs._batch
    reqs._batch = lambda *args: dataclasses.replace(b := make(*args), query=b.query.half(), key=b.key.half())
    method, selection, _, _ = _run(reqs, {"keep_ratio": 0.125, "channels": 8}, kernels)
    assert method._layers["layers.0"].part_sum.dtype == torch.float16
    assert NEEDLE // BS in _positions(reqs, selection)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_summaries_choose_the_same_blocks_whether_a_cpu_multiplies_them_in_bf16_or_fp32(seed, monkeypatch):
    """On a CPU with bf16 dot products (AVX512-BF16, AMX) the summaries are
    multiplied in bf16; elsewhere (AVX2) in fp32, where a bf16 matmul is
    several times slower.  Whichever this CPU is, both ways run here."""
    reqs, _, _ = _haystack(seed)
    chosen = {}
    for has_dot in (True, False):
        monkeypatch.setattr(torch_select, "_cpu_has_bf16_dot", lambda has_dot=has_dot: has_dot)
        method, selection, _, _ = _run(reqs, {"keep_ratio": 0.125, "channels": 8})
        assert method._layers["layers.0"].part_sum.dtype == torch.bfloat16
        chosen[has_dot] = _positions(reqs, selection)
    assert NEEDLE // BS in chosen[True]
    assert chosen[True] == chosen[False]


def test_the_summaries_hold_every_key_on_the_chosen_channels():
    reqs, loud, _ = _haystack(0)
    keys = reqs.keys[0].float()

    def check(layer, positions):
        for position in positions:
            block = keys[position * BS:(position + 1) * BS]
            on_loud = torch.stack([block[:, h, loud[h]] for h in range(2)], dim=1)
            assert torch.equal(layer.part_sum[reqs.tables[0][position]].float(), on_loud), position

    method = _method({"keep_ratio": 0.125, "dense_below": DENSE_BELOW, "channels": 8}, "torch")
    ids = frozenset(reqs.req_ids)
    method.begin_step(StepInfo(BS, started=(RequestStart("r0", tuple(reqs.tables[0]), 0),), scheduled_req_ids=ids))
    for step, (start, end) in enumerate([(0, FIRST_CHUNK), (FIRST_CHUNK, 600), (600, LEN - 1)], start=1):
        method.begin_step(StepInfo(BS, scheduled_req_ids=ids))
        method.before_attention(reqs._batch("layers.0", step, [(start, end)], [end], []))
    layer = method._layers["layers.0"]
    assert layer.part_sum.shape[1:] == (BS, 2, 8) and layer.minmax is None
    # Keys kept as they are: in the model's 16-bit dtype, exactly.
    assert layer.part_sum.dtype == torch.bfloat16
    # Made from the pages by the second call, which chose the channels
    # (the first call's keys went by unfolded; its own were in the pages) ...
    check(layer, (0, 9, 30))
    # ... and folded as the third call wrote their keys (block 37 both).
    check(layer, (37, 50, 62))


def test_channels_wider_than_a_key_score_every_channel():
    reqs, _, _ = _haystack(0)
    method, selection, _, _ = _run(reqs, {"keep_ratio": 0.125, "channels": 256})
    assert method._channels._layers["layers.0"].chosen.tolist() == [list(range(64))] * 2
    assert NEEDLE // BS in _positions(reqs, selection)


@pytest.mark.parametrize("device, kernels", PATHS)
def test_a_decode_call_with_channels_waits_for_nothing_and_verifying_rows_read_their_tokens_last(device, kernels):
    reqs = Requests(device, LENS, Q_LENS, seed=3)
    method = _method({"keep_ratio": 0.25, "channels": 8}, kernels)
    method.speculate(3)
    reqs.start(method, layers=("layers.0", "layers.1"))
    step = reqs.step("layers.0", step=2)
    method.before_attention(step)
    log = OpLog()
    with log:
        selection = method.before_attention(dataclasses.replace(step, layer_name="layers.1"))
    assert log.syncing == []
    print(f"ops: {len(log.ops)}")
    if kernels == "torch":      # (Triton's interpreter dispatches ops of its own)
        assert len(log.ops) <= LATER_LAYER_OPS
    thinned = [r for r in range(len(LENS)) if int(selection.seq_lens[r]) < LENS[r]]
    assert {0, 1, 2, 4, 5} <= set(thinned) and not {3, 6} & set(thinned)
    _aligned(selection, reqs, LENS, Q_LENS)


@pytest.mark.parametrize("options, named", [
    ({"channels": 0}, "channels: expected a number of key channels >= 1, got 0"),
    ({"channels": "8"}, "channels: expected a number of key channels >= 1, got '8'"),
    ({"channels": 8, "parts": 4}, "parts: 4"),
    ({"channels": 8, "score": "bound"}, "score: 'bound'"),
])
def test_bad_channel_options_are_refused_with_the_option_named(options, named):
    with pytest.raises(SparseConfigError, match="block_topk: ") as err:
        BlockTopKOptions.parse(options)
    assert named in str(err.value)
