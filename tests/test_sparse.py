"""Sparse attention without an engine: the page reader, the key summaries,
block_topk's selection checked against the real CPU attention kernel, the
method registry and options, and the patches' guards (apply / revert /
refusal)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import patches
from patches import PatchError
from patches.cpu_pages import key_pages
from patches.probes import cpu_attention_isa
from ucm_connector.config import UCMConfig, UCMConfigError
from ucm_connector.sparse import (
    AttentionBatch,
    RequestStart,
    SparseConfigError,
    SparseMethod,
    StepInfo,
    build_method,
    register_method,
    unregister_method,
    validate,
)
from ucm_connector.sparse.block_topk import BlockTopK
from ucm_connector.sparse.summaries import BlockEpochs, LayerSummaries, WritePlan

BLOCK = 128
HEADS, KV_HEADS, HEAD = 6, 2, 64


def _ops():
    from vllm import _custom_ops as ops

    return ops


class Cache:
    """A CPU paged KV cache ``[num_blocks, H, B, 2D]`` filled through vLLM's
    own cache-writing op, with the keys and values kept for reference."""

    def __init__(self, num_blocks=24, isa="vec"):
        self.isa = isa
        self.kv = torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16)
        self.key_cache, self.value_cache = self.kv.view(num_blocks, KV_HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)

    def write(self, keys, values, slots):
        _ops().cpu_attn_reshape_and_cache(keys, values, self.key_cache, self.value_cache,
                                          torch.as_tensor(slots, dtype=torch.int64), self.isa)


def _slots(table, start, end):
    return [table[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, end)]


# -- reading pages back -----------------------------------------------------------

@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_keys_read_back_from_pages_equal_the_keys_written(isa):
    if isa == "amx" and cpu_attention_isa(torch.bfloat16, BLOCK, HEAD, "auto") != "amx":
        pytest.skip("this CPU has no AMX: vLLM's CPU attention cannot write amx pages here")
    cache = Cache(isa=isa)
    keys = torch.randn(2 * BLOCK, KV_HEADS, HEAD).to(torch.bfloat16)
    cache.write(keys, torch.randn_like(keys), _slots([7, 3], 0, 2 * BLOCK))
    pages = key_pages(cache.kv, isa, HEAD, "auto")
    blocks = torch.tensor([7, 3])
    assert torch.equal(pages.read(blocks).reshape(2 * BLOCK, KV_HEADS, HEAD), keys)
    kmin, kmax, sums = pages.reduce(blocks, 4)
    assert torch.equal(kmin, keys.view(2, BLOCK, KV_HEADS, HEAD).amin(1))
    assert torch.equal(kmax, keys.view(2, BLOCK, KV_HEADS, HEAD).amax(1))
    want = keys.view(2, 4, BLOCK // 4, KV_HEADS, HEAD).float().sum(2)
    assert torch.allclose(sums, want, atol=1e-3)
    tokens = torch.arange(BLOCK)
    want = keys.view(2, BLOCK, KV_HEADS, HEAD)[:, tokens, 0, tokens % HEAD]
    assert torch.equal(pages.probe(blocks), want)


def test_a_quantized_cache_has_no_page_reader():
    assert key_pages(Cache().kv, "vec", HEAD, "fp8") is None


# -- summaries ----------------------------------------------------------------------

def test_summaries_follow_written_keys_and_restart_at_offset_zero():
    epochs = BlockEpochs().get(8, torch.device("cpu"))
    s = LayerSummaries(8, BLOCK, KV_HEADS, HEAD, torch.float32, torch.device("cpu"), parts=4)
    old = torch.randn(BLOCK, KV_HEADS, HEAD).to(torch.bfloat16) * 10
    s.add_keys(old, WritePlan(torch.arange(BLOCK) + 2 * BLOCK, BLOCK, s.trash, 1), epochs)   # another request's
    keys = torch.randn(200, KV_HEADS, HEAD).to(torch.bfloat16)
    slots = torch.tensor(_slots([5, 2], 0, 200))
    s.add_keys(keys[:150], WritePlan(slots[:150], BLOCK, s.trash, 1), epochs)                 # a prefill chunk
    s.add_keys(keys[150:], WritePlan(slots[150:], BLOCK, s.trash, 1), epochs)                 # the rest
    first, second = keys[:BLOCK].float(), keys[BLOCK:].float()
    assert torch.equal(s.kmin[5], first.amin(0)) and torch.equal(s.kmax[5], first.amax(0))
    assert torch.equal(s.kmin[2], second.amin(0)) and torch.equal(s.kmax[2], second.amax(0))
    assert torch.allclose(s.part_sum[5], first.view(4, 32, KV_HEADS, HEAD).sum(1), atol=1e-4)
    assert torch.allclose(s.part_sum[2, :2], second[:64].view(2, 32, KV_HEADS, HEAD).sum(1), atol=1e-4)
    assert torch.allclose(s.part_sum[2, 2], second[64:].sum(0), atol=1e-4)
    assert not s.part_sum[2, 3].any()
    assert not s.stale(torch.tensor([5, 2]), epochs).any()


def test_blocks_filled_behind_the_forward_are_stale_until_rebuilt_from_their_pages():
    cache = Cache()
    counter = BlockEpochs()
    epochs = counter.get(24, torch.device("cpu"))
    s = LayerSummaries(24, BLOCK, KV_HEADS, HEAD, torch.float32, torch.device("cpu"), parts=4)
    pages = key_pages(cache.kv, "vec", HEAD, "auto")
    first = torch.randn(BLOCK, KV_HEADS, HEAD).to(torch.bfloat16)
    cache.write(first, first, _slots([4], 0, BLOCK))
    s.add_keys(first, WritePlan(torch.arange(BLOCK) + 4 * BLOCK, BLOCK, s.trash, 1), epochs, pages)
    assert not s.probe[4].isnan().any()
    # A connector load puts other content in block 4 without a forward.
    loaded = torch.randn(100, KV_HEADS, HEAD).to(torch.bfloat16)
    cache.write(loaded, loaded, _slots([4], 0, 100))
    counter.bump([4])
    epochs = counter.get(24, torch.device("cpu"))
    assert s.stale(torch.tensor([4]), epochs).all()
    assert s.refresh(torch.tensor([4]), torch.tensor([100]), epochs, pages) == (0, 1)
    assert torch.equal(s.kmin[4], loaded.float().amin(0)) and torch.equal(s.kmax[4], loaded.float().amax(0))
    assert torch.allclose(s.part_sum[4, 3], loaded[96:].float().sum(0), atol=1e-4)
    assert torch.allclose(s.part_sum[4, 0], loaded[:32].float().sum(0), atol=1e-4)
    assert not s.stale(torch.tensor([4]), epochs).any()


def test_a_rebuild_reads_the_pages_a_bounded_pass_at_a_time_and_makes_the_same_summaries(monkeypatch):
    """Rebuilding a batch's blocks from their pages (when thinning starts at
    ``dense_below``) reads at most a pass's worth of keys at once, not the
    whole table's, and makes what one pass over everything makes: invalid
    entries and partly filled blocks included."""
    from ucm_connector.sparse import summaries as summaries_mod

    cache = Cache()
    pages = key_pages(cache.kv, "vec", HEAD, "auto")
    keys = torch.randn(5 * BLOCK, KV_HEADS, HEAD).to(torch.bfloat16)
    cache.write(keys, keys, _slots([3, 9, 1, 7, 12], 0, 5 * BLOCK))
    table = torch.tensor([[3, 9, 1, 0], [7, 12, 0, 0]])
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    fills = torch.tensor([[BLOCK, BLOCK, 40, 0], [BLOCK, 100, 0, 0]])

    def rebuilt(pass_nbytes):
        monkeypatch.setattr(summaries_mod, "REBUILD_PASS_NBYTES", pass_nbytes)
        reads = []

        class Recording:
            def read(self, blocks):
                reads.append(len(blocks))
                return pages.read(blocks)

            def probe(self, blocks):
                return pages.probe(blocks)

        epochs = BlockEpochs().get(24, torch.device("cpu"))
        s = LayerSummaries(24, BLOCK, KV_HEADS, HEAD, torch.float32, torch.device("cpu"), parts=4)
        s.rebuild(table, valid, fills, epochs, Recording())
        return s, reads

    one_block = BLOCK * KV_HEADS * HEAD * 4
    whole, whole_reads = rebuilt(1 << 30)
    bounded, bounded_reads = rebuilt(3 * one_block)
    assert whole_reads == [8] and bounded_reads == [3, 3, 2]
    for name in ("kmin", "kmax", "part_sum", "probe", "made_at"):
        assert torch.equal(getattr(whole, name), getattr(bounded, name)) or (
            name == "probe" and torch.equal(whole.probe.isnan(), bounded.probe.isnan())
            and torch.equal(whole.probe.nan_to_num(), bounded.probe.nan_to_num())), name
    assert torch.equal(bounded.kmax[1], keys[2 * BLOCK:2 * BLOCK + 40].float().amax(0))
    assert not bounded.behind


def test_a_block_refilled_with_the_same_keys_keeps_its_summary():
    cache = Cache()
    counter = BlockEpochs()
    epochs = counter.get(24, torch.device("cpu"))
    s = LayerSummaries(24, BLOCK, KV_HEADS, HEAD, torch.float32, torch.device("cpu"))
    keys = torch.randn(BLOCK, KV_HEADS, HEAD).to(torch.bfloat16)
    cache.write(keys, keys, _slots([9], 0, BLOCK))
    pages = key_pages(cache.kv, "vec", HEAD, "auto")
    # Written in two steps; the second completes the block and takes its probe.
    s.add_keys(keys[:100], WritePlan(torch.tensor(_slots([9], 0, 100)), BLOCK, s.trash, 1), epochs, pages)
    assert s.probe[9].isnan().all()
    s.add_keys(keys[100:], WritePlan(torch.tensor(_slots([9], 100, BLOCK)), BLOCK, s.trash, 1), epochs, pages)
    assert not s.probe[9].isnan().any()
    counter.bump([9])                   # a prefix-cache hit on block 9: same content
    epochs = counter.get(24, torch.device("cpu"))
    assert s.stale(torch.tensor([9]), epochs).all()
    assert s.refresh(torch.tensor([9]), torch.tensor([BLOCK]), epochs, pages) == (1, 0)
    assert not s.stale(torch.tensor([9]), epochs).any()
    assert torch.equal(s.kmax[9], keys.float().amax(0))


# -- block_topk against the kernel ---------------------------------------------------

def _reference(q, keys, values, scale):
    """Dense attention of one query over the given keys, in fp32."""
    group = HEADS // KV_HEADS
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    w = torch.einsum("hd,lhd->hl", q.float(), k).mul(scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", w, v)


def _kernel(cache, query, qsl, seq_lens, table, scale):
    ops = _ops()
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD,
        seq_lens=seq_lens, dtype=torch.bfloat16, query_start_loc=qsl, causal=True,
        sliding_window_size=-1, isa=cache.isa, enable_kv_split=False)
    out = torch.empty(query.shape[0], HEADS, HEAD, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=cache.key_cache, value_cache=cache.value_cache, output=out,
        query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=table, softcap=0, scheduler_metadata=meta, s_aux=None)
    return out


class Step:
    """Three requests in one step: a long decode (10 blocks), a prefill chunk
    of 64 tokens after 300 cached ones, and a short decode (2 blocks)."""

    def __init__(self, method: SparseMethod, hot_block=6):
        torch.manual_seed(0)
        self.cache = Cache(num_blocks=24)
        self.tables = [[3, 9, 1, 12, 17, 5, 20, 8, 14, 2], [4, 10, 11], [6, 7]]
        self.lens = [10 * BLOCK - 40, 364, 200]
        self.keys, self.values = [], []
        self.scale = 1 / math.sqrt(HEAD)
        direction = torch.randn(KV_HEADS, HEAD)
        for i, (table, length) in enumerate(zip(self.tables, self.lens)):
            keys = torch.randn(length, KV_HEADS, HEAD)
            if i == 0:   # a block whose keys line up with the query
                keys[hot_block * BLOCK:(hot_block + 1) * BLOCK] += 3 * direction
            keys, values = keys.to(torch.bfloat16), torch.randn(length, KV_HEADS, HEAD).to(torch.bfloat16)
            self.keys.append(keys)
            self.values.append(values)
        q_lens = [1, 64, 1]
        self.qsl = torch.tensor([0, 1, 65, 66], dtype=torch.int32)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32)
        self.table = torch.zeros(3, 12, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.table[i, :len(t)] = torch.tensor(t)
        self.query = torch.randn(66, HEADS, HEAD)
        self.query[0] = 2 * direction.repeat_interleave(HEADS // KV_HEADS, dim=0)
        self.query = self.query.to(torch.bfloat16)
        # Earlier steps wrote everything but this step's tokens; this step's
        # keys reach the method through the batch, as in the engine.
        step_keys, step_slots = [], []
        for i, (table, length, q_len) in enumerate(zip(self.tables, self.lens, q_lens)):
            self.cache.write(self.keys[i], self.values[i], _slots(table, 0, length))
            earlier = length - q_len
            method_keys = self.keys[i][:earlier]
            if earlier:
                batch = self._batch(method_keys, torch.tensor(_slots(table, 0, earlier)), decode_only=False)
                method.before_attention(batch)
            step_keys.append(self.keys[i][earlier:])
            step_slots += _slots(table, earlier, length)
        self.step_keys = torch.cat(step_keys)
        self.step_slots = torch.tensor(step_slots)

    def _batch(self, keys, slots, decode_only=True):
        # The summaries of earlier steps, fed as one "prefill" call.
        qsl = torch.tensor([0, keys.shape[0]], dtype=torch.int32)
        return AttentionBatch(
            layer_name="layer.0", layer_index=0, query=torch.zeros(keys.shape[0], HEADS, HEAD, dtype=torch.bfloat16),
            key=keys, slot_mapping=slots, query_start_loc=qsl,
            seq_lens=torch.tensor([keys.shape[0]], dtype=torch.int32),
            block_table=self.table[:1], block_size=BLOCK, num_cache_blocks=24, num_kv_heads=KV_HEADS,
            head_size=HEAD, scale=self.scale)

    def batch(self):
        return AttentionBatch(
            layer_name="layer.0", layer_index=0, query=self.query, key=self.step_keys, slot_mapping=self.step_slots,
            query_start_loc=self.qsl, seq_lens=self.seq_lens, block_table=self.table, block_size=BLOCK,
            num_cache_blocks=24, num_kv_heads=KV_HEADS, head_size=HEAD, scale=self.scale,
            pages=key_pages(self.cache.kv, "vec", HEAD, "auto"))


@pytest.mark.parametrize("score, parts", [("mean", 1), ("mean", 4), ("bound", 1)])
def test_block_topk_reads_sinks_the_hot_block_and_the_local_window_in_order(score, parts):
    method = BlockTopK.from_config({"budget_blocks": 3, "score": score, "parts": parts})
    step = Step(method, hot_block=6)
    sel = method.before_attention(step.batch())
    assert sel is not None
    chosen = sel.block_table[0, :3].tolist()
    t = step.tables[0]
    assert chosen == [t[0], t[6], t[9]]                     # sink, hot block, last (partial) block
    assert sel.seq_lens[0].item() == 2 * BLOCK + (step.lens[0] - 9 * BLOCK)
    # The prefill chunk and the short request are left alone.
    assert torch.equal(sel.block_table[1:], step.table[1:])
    assert sel.seq_lens[1:].tolist() == step.lens[1:]
    stats = method.stats()
    assert (stats.blocks_dense, stats.blocks_read, stats.sparse_rows) == (12, 5, 1)


def test_a_layer_whose_summaries_do_not_fit_in_device_memory_stays_dense(monkeypatch, caplog):
    """vLLM sizes its KV cache before any summary exists: a layer whose
    summaries do not fit in the device memory left (or whose allocation
    runs out of it) is attended densely, with one warning that says what to
    change, and is not tried again; layers that fit are still thinned."""
    import dataclasses

    from ucm_connector.sparse import summary_keeper

    free = [1 << 40]
    monkeypatch.setattr(summary_keeper, "device_free_nbytes", lambda device: free[0])
    method = BlockTopK.from_config({"budget_blocks": 3})
    step = Step(method, hot_block=6)
    assert method.before_attention(step.batch()) is not None
    free[0] = 1 << 20
    second = dataclasses.replace(step.batch(), layer_name="layer.1", layer_index=1)
    caplog.clear()
    assert method.before_attention(second) is None
    need = summary_keeper.LayerSummaries.nbytes(24, BLOCK, KV_HEADS, HEAD, torch.float32, parts=1, bounds=False)
    assert f"need {need / (1 << 20):.1f} MiB" in caplog.text and "1.0 MiB are free" in caplog.text
    assert "layer.1" in caplog.text and "--gpu-memory-utilization" in caplog.text
    free[0] = 1 << 40
    caplog.clear()
    assert method.before_attention(second) is None and not caplog.text
    assert method.before_attention(step.batch()) is not None

    class OutOfMemory(summary_keeper.LayerSummaries):
        def __init__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(summary_keeper, "LayerSummaries", OutOfMemory)
    third = dataclasses.replace(step.batch(), layer_name="layer.2", layer_index=2)
    assert method.before_attention(third) is None
    assert method.before_attention(step.batch()) is not None


def test_the_kernel_given_a_selection_computes_attention_over_exactly_the_chosen_blocks():
    method = BlockTopK.from_config({"budget_blocks": 4})
    step = Step(method)
    sel = method.before_attention(step.batch())
    out = _kernel(step.cache, step.query, step.qsl, sel.seq_lens, sel.block_table, step.scale)
    t = step.tables[0]
    picked = [t.index(b) for b in sel.block_table[0, :4].tolist()]
    idx = torch.cat([torch.arange(p * BLOCK, min((p + 1) * BLOCK, step.lens[0])) for p in picked])
    want = _reference(step.query[0], step.keys[0][idx], step.values[0][idx], step.scale)
    assert (out[0].float() - want).abs().max() < 2e-2
    dense = _kernel(step.cache, step.query, step.qsl, step.seq_lens, step.table, step.scale)
    assert torch.equal(out[1:], dense[1:])                  # untouched rows: bit for bit


def test_requests_under_min_blocks_are_read_whole():
    method = BlockTopK.from_config({"budget_blocks": 3, "min_blocks": 11})
    step = Step(method)
    assert method.before_attention(step.batch()) is None           # 10 blocks < 11
    assert method.stats().sparse_rows == 0


def test_a_budget_that_covers_every_block_changes_nothing():
    method = BlockTopK.from_config({"keep_ratio": 1.0})
    step = Step(method)
    assert method.before_attention(step.batch()) is None
    assert method.stats().blocks_read == method.stats().blocks_dense == 12


def test_blocks_loaded_behind_the_forward_get_summaries_from_their_pages():
    method = BlockTopK.from_config({"budget_blocks": 3})
    step = Step(method, hot_block=6)
    t = step.tables[0]
    # A connector load refills request 0's first 9 blocks with content whose
    # hot block is now block 2; the method saw none of it go by.
    direction = step.query[0, ::HEADS // KV_HEADS].float() / 2
    keys = torch.randn(9 * BLOCK, KV_HEADS, HEAD)
    keys[2 * BLOCK:3 * BLOCK] += 3 * direction
    keys = keys.to(torch.bfloat16)
    step.cache.write(keys, keys, _slots(t, 0, 9 * BLOCK))
    method.begin_step(StepInfo(block_size=BLOCK, started=(RequestStart("r0", tuple(t), 9 * BLOCK),)))
    sel = method.before_attention(step.batch())
    assert sel.block_table[0, :3].tolist() == [t[0], t[2], t[9]]
    assert method.stats().blocks_summarized_from_pages == 9


@pytest.mark.parametrize("parts", [1, 8])
def test_blocks_never_seen_get_summaries_from_their_pages(parts):
    step = Step(BlockTopK.from_config({"budget_blocks": 3, "parts": parts}), hot_block=6)
    fresh = BlockTopK.from_config({"budget_blocks": 3, "parts": parts})
    sel = fresh.before_attention(step.batch())
    assert sel.block_table[0, :3].tolist() == [step.tables[0][0], step.tables[0][6], step.tables[0][9]]
    assert fresh.stats().blocks_summarized_from_pages == 10


def test_without_a_page_reader_unsummarized_blocks_are_read_not_guessed():
    method = BlockTopK.from_config({"budget_blocks": 3})
    step = Step(method)
    fresh = BlockTopK.from_config({"budget_blocks": 3})
    batch = step.batch()
    batch.pages = None
    sel = fresh.before_attention(batch)
    assert sel is None or sel.seq_lens[0].item() == step.lens[0]
    assert fresh.stats().blocks_kept_unsummarized > 0


# -- registry and options --------------------------------------------------------------

def test_the_sparse_option_is_validated_when_the_connector_config_is_parsed():
    config = UCMConfig.from_extra_config({"sparse": {"method": "block_topk", "keep_ratio": 0.125}})
    assert config.sparse == {"method": "block_topk", "keep_ratio": 0.125}
    with pytest.raises(UCMConfigError, match="sparse: block_topk: keep_ratio: expected a number in"):
        UCMConfig.from_extra_config({"sparse": {"method": "block_topk", "keep_ratio": 2}})
    with pytest.raises(UCMConfigError, match="sparse: block_topk: unknown option 'ratio'"):
        UCMConfig.from_extra_config({"sparse": {"method": "block_topk", "ratio": 0.5}})
    with pytest.raises(UCMConfigError, match="no sparse-attention method named 'quest'; available: block_topk"):
        UCMConfig.from_extra_config({"sparse": {"method": "quest"}})


def test_options_are_checked_together():
    with pytest.raises(SparseConfigError, match="not both"):
        validate({"method": "block_topk", "keep_ratio": 0.5, "budget_blocks": 4})
    with pytest.raises(SparseConfigError, match="local_blocks: expected an integer >= 1"):
        validate({"method": "block_topk", "local_blocks": 0})
    with pytest.raises(SparseConfigError, match="score: expected 'mean' or 'bound'"):
        validate({"method": "block_topk", "score": "max"})
    with pytest.raises(SparseConfigError, match="dense_below: expected a number of tokens >= 0"):
        validate({"method": "block_topk", "dense_below": "8k"})
    assert validate({"method": "block_topk", "dense_below": 16384})["dense_below"] == 16384
    for bad in (0, 1.5, "2", True):
        with pytest.raises(SparseConfigError, match=r"reselect_every: expected a number of decode steps >= 1, got"):
            validate({"method": "block_topk", "reselect_every": bad})
    assert validate({"method": "block_topk", "reselect_every": 4})["reselect_every"] == 4


def test_a_third_party_method_is_found_by_name():
    class Nothing(SparseMethod):
        @classmethod
        def from_config(cls, options):
            return cls()

        def before_attention(self, batch):
            return None

    register_method("nothing", Nothing)
    try:
        assert isinstance(build_method({"method": "nothing"}), Nothing)
    finally:
        unregister_method("nothing")


def test_third_party_methods_come_from_the_entry_point_group(monkeypatch):
    import importlib.metadata

    from ucm_connector.sparse import registry

    ep = importlib.metadata.EntryPoint("mine", "ucm_connector.sparse.block_topk:BlockTopK",
                                       registry.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [ep] if group == registry.ENTRY_POINT_GROUP else real(group=group, **kw))
    assert isinstance(build_method({"method": "mine", "budget_blocks": 2}), BlockTopK)


# -- the patches ------------------------------------------------------------------------

@pytest.fixture
def clean_patches():
    patches.revert()
    yield
    patches.revert()


def _targets():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return CPUAttentionBackendImpl, GPUModelRunner


def test_apply_is_idempotent_and_revert_restores_every_original(clean_patches):
    impl, runner = _targets()
    forward, execute = impl.forward, runner.execute_model
    first, second = BlockTopK.from_config({}), BlockTopK.from_config({})
    patches.apply(first)
    patched = impl.forward
    assert patched is not forward and runner.execute_model is not execute
    patches.apply(second)                           # no second layer of wrapping
    assert impl.forward is patched and patches.active_hooks() is second
    patches.revert()
    patches.revert()
    assert impl.forward is forward and runner.execute_model is execute
    assert "forward" in vars(impl) and "execute_model" in vars(runner)
    assert not patches.applied() and patches.active_hooks() is None


def test_an_unsupported_vllm_version_is_refused_and_nothing_is_patched(clean_patches, monkeypatch):
    from patches import _core

    impl, runner = _targets()
    forward, execute = impl.forward, runner.execute_model
    monkeypatch.setattr(_core, "vllm_version", lambda: "0.35.1")
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.35.1")
    with pytest.raises(PatchError) as info:
        patches.apply(BlockTopK.from_config({}))
    message = str(info.value)
    assert "vLLM 0.35.1" in message and "nothing was patched" in message
    assert "'cpu_attention.forward' supports vLLM 0.32.x, 0.33.x" in message
    assert "'model_runner.execute_model'" in message
    assert impl.forward is forward and runner.execute_model is execute and not patches.applied()


def test_a_changed_signature_is_refused_and_nothing_is_patched(clean_patches, monkeypatch):
    impl, runner = _targets()
    execute = runner.execute_model

    def forward(self, layer, query, key, value, kv_cache, metadata, output):  # a renamed parameter
        raise AssertionError("never called")

    monkeypatch.setattr(impl, "forward", forward)
    with pytest.raises(PatchError) as info:
        patches.apply(BlockTopK.from_config({}))
    message = str(info.value)
    assert "'cpu_attention.forward'" in message and "metadata" in message and "attn_metadata" in message
    assert f"vLLM {patches.vllm_version()}" in message
    assert impl.forward is forward and runner.execute_model is execute and not patches.applied()


def test_a_missing_metadata_field_is_refused(clean_patches, monkeypatch):
    import dataclasses

    from vllm.v1.attention.backends import cpu_attn

    @dataclasses.dataclass
    class Renamed:                      # scheduler_metadata renamed upstream
        num_actual_tokens: int
        query_start_loc: object
        seq_lens: object
        block_table: object
        slot_mapping: object
        work_plan: object
        causal: bool = True
        dynamic_causal: object = None
        encoder_cache: object = None

    monkeypatch.setattr(cpu_attn, "CPUAttentionMetadata", Renamed)
    with pytest.raises(PatchError, match="'cpu_attention.forward'.*no field 'scheduler_metadata'"):
        patches.apply(BlockTopK.from_config({}))
    assert not patches.applied()


def test_the_patched_forward_keeps_the_original_signature(clean_patches):
    impl, _ = _targets()
    before = inspect.signature(impl.forward)
    patches.apply(BlockTopK.from_config({}))
    assert inspect.signature(impl.forward) == before     # __wrapped__ is followed


def test_on_cuda_the_step_hook_reaches_vllms_second_model_runner_too(clean_patches, monkeypatch):
    """vLLM builds its second model runner on CUDA by default (not a
    subclass of the first): its ``execute_model`` is patched as well, fits
    this vLLM, and tells the method of each real step but not of a dummy or
    profile run."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform
    from vllm.v1.core.sched.output import SchedulerOutput

    from patches import model_runner

    # Imported as this CPU is, before the platform claims CUDA: what vLLM
    # 0.33's runner imports on a CUDA platform calls CUDA kernels at once.
    import vllm.v1.worker.gpu.model_runner  # noqa: F401

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    targets = {p.target for p in patches.patches_for_platform()}
    assert {"vllm.v1.worker.gpu_model_runner.GPUModelRunner.execute_model",
            "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model"} <= targets
    assert patches.check([model_runner.EXECUTE_MODEL_V2]) == []

    steps, ran = [], []

    class Hooks:
        def begin_step(self, info):
            steps.append(info)

    def original(self, scheduler_output, *args, **kwargs):
        ran.append(kwargs.get("dummy_run", False))
        return "output"

    execute = model_runner._make_execute_model(original)
    runner = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    output = SchedulerOutput.make_empty()
    output.finished_req_ids = {"a"}
    monkeypatch.setattr(patches._core, "hooks", Hooks())
    assert execute(runner, output) == "output"
    assert execute(runner, SchedulerOutput.make_empty(), dummy_run=True) == "output"
    assert ran == [False, True]
    assert len(steps) == 1 and steps[0].finished_req_ids == {"a"} and steps[0].block_size == 16


def test_layers_whose_backend_the_hook_does_not_reach_are_named_in_a_warning(clean_patches, caplog):
    """A layer whose backend is not patched (another backend, or a subclass
    with its own forward) stays dense: the warning says how many, which
    backend, and what to start vLLM with."""
    from types import SimpleNamespace

    from ucm_connector.plugin import warn_of_dense_layers

    impl, _ = _targets()

    class OwnForward(impl):
        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    class Composite:
        """vLLM's composite impl (multimodal prefixes): its own forward hands
        decoder calls to a patched impl."""

        def forward(self, *args, **kwargs):
            raise AssertionError("never called")

    def layer(cls):
        return SimpleNamespace(impl=cls.__new__(cls))

    def ours():
        return [r for r in caplog.records if r.name.startswith("vllm.ucm_connector")]

    composite = layer(Composite)
    composite.impl.causal_impl = impl.__new__(impl)
    context = {"model.layers.0.self_attn.attn": layer(impl), "model.layers.1.self_attn.attn": layer(OwnForward),
               "model.layers.2.mixer": SimpleNamespace(), "model.layers.3.self_attn.attn": composite}
    engine = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))
    assert warn_of_dense_layers(engine) == {} and not ours()       # nothing patched: dense by choice
    patches.apply(BlockTopK.from_config({}))
    assert warn_of_dense_layers(engine) == {"model.layers.1.self_attn.attn": "OwnForward"}
    assert "does not reach 1 of 3 attention layers" in caplog.text and "(OwnForward)" in caplog.text
    assert "--attention-backend FLASH_ATTN" in caplog.text
    caplog.clear()
    del context["model.layers.1.self_attn.attn"]
    assert warn_of_dense_layers(engine) == {} and not ours()
