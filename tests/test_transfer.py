"""Whole-block gather/scatter between paged caches and host rows.

Every layout vLLM can hand to ``register_kv_caches`` is built the way vLLM
builds it (``ucm_connector.cache_views``, checked against vLLM's own
``create_kv_cache_views`` where vLLM is installed), filled with random bytes,
and copied both ways; expected bytes come from the caches' logical views, not
from the code under test.  Each test runs on CPU, and on CUDA wherever CUDA
exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ucm_connector.cache_views import (LAYOUTS, PAGE_ORDER, block_major_caches, fill_random_, kv_first_caches,
                                       mla_caches, vllm_layer_caches)
from ucm_connector import staging
from ucm_connector.transfer import BlockTransfer

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"))]
HEADER = 64     # the rows the worker uses: a block envelope's header, then the payload


def _caches(shape, layers=3, dtype=torch.bfloat16, device="cpu"):
    torch.manual_seed(0)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(*shape).to(dtype).to(device) for i in range(layers)}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _vllm(layout, device, *, layers=3, blocks=10, heads=2, tokens=4, head_size=8, seed=1, **kw):
    raw, caches = vllm_layer_caches(layout, num_layers=layers, num_blocks=blocks, num_heads=heads,
                                    block_size=tokens, content_nbytes=2 * head_size * 2, dtype=torch.bfloat16,
                                    device=device, **kw)
    fill_random_(caches, raw, seed=seed)
    return raw, caches


def _logical_page(view: torch.Tensor, block: int, order: str) -> bytes:
    """A [B, H, N, C] view's page in the stored order, from logical indexing."""
    page = view[block]
    return _bytes(page.permute(1, 0, 2) if order == "NHC" else page)


def _views_over(views: dict[str, torch.Tensor], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same strided views over another backing buffer."""
    out = {}
    for name, view in views.items():
        v8 = view.view(torch.int8)
        out[name] = torch.as_strided(raw, v8.shape, v8.stride(), v8.storage_offset()).view(view.dtype)
    return out


def _gather(transfer, block_ids):
    out = np.zeros((len(block_ids), transfer.payload_nbytes), dtype=np.uint8)
    transfer.gather(block_ids, out)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_block_major_pages_round_trip_byte_for_byte(device):
    src = _caches((10, 2, 32, 16), device=device)
    transfer = BlockTransfer(src, num_blocks=10)
    assert transfer.payload_nbytes == 3 * 2 * 32 * 16 * 2
    out = _gather(transfer, [3, 7])
    expected = b"".join(_bytes(t[3]) for t in src.values())
    assert out[0].tobytes() == expected

    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    BlockTransfer(dst, num_blocks=10).scatter([1, 2], out)
    for name in src:
        assert _bytes(dst[name][1]) == _bytes(src[name][3])
        assert _bytes(dst[name][2]) == _bytes(src[name][7])
        assert not dst[name][0].view(torch.uint8).any()  # other pages untouched


@pytest.mark.parametrize("device", DEVICES)
def test_kv_first_layout_takes_both_halves_of_a_page(device):
    src = _caches((2, 10, 32, 4, 16), layers=2, dtype=torch.float16, device=device)
    out = _gather(BlockTransfer(src, num_blocks=10), [4])
    expected = b"".join(_bytes(t[0, 4]) + _bytes(t[1, 4]) for t in src.values())
    assert out[0].tobytes() == expected


def test_an_unknown_layout_is_refused_with_the_layer_named():
    with pytest.raises(ValueError, match="model.layers.0.self_attn.attn"):
        BlockTransfer(_caches((7, 2, 32, 16), layers=1), num_blocks=10)


def test_a_cache_whose_last_dimension_is_strided_is_refused():
    cache = {"model.layers.0.self_attn.attn": torch.zeros(10, 2, 16, 32).transpose(2, 3)}
    with pytest.raises(ValueError, match="last dimension is not contiguous"):
        BlockTransfer(cache, num_blocks=10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_vllm_layout_round_trips_byte_for_byte(layout, device):
    raw, src = _vllm(layout, device)
    transfer = BlockTransfer(src, num_blocks=10)
    assert transfer.payload_nbytes == 3 * 2 * 4 * 32
    out = _gather(transfer, [3, 7, 0])
    for row, block in zip(out, [3, 7, 0]):
        assert row.tobytes() == b"".join(_logical_page(v, block, PAGE_ORDER[layout]) for v in src.values())

    dst_raw, dst = _vllm(layout, device, seed=2)
    want_raw = dst_raw.clone()
    want = _views_over(dst, want_raw)
    for name in src:
        for d, s in ((1, 3), (2, 7), (9, 0)):
            want[name][d] = src[name][s]
    BlockTransfer(dst, num_blocks=10).scatter([1, 2, 9], out)
    # Exactly the three pages of every layer changed, to the source's bytes.
    assert torch.equal(dst_raw, want_raw)


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_with_one_page_order_store_identical_blocks(device):
    """The namespace names a page order, not a layout: layouts that order a
    page's bytes alike must give the same payload for the same KV."""
    _, reference = _vllm("LBHNC", device, seed=5)
    payloads = {}
    for layout in LAYOUTS:
        _, caches = _vllm(layout, device, seed=9)
        for name, view in caches.items():
            view.copy_(reference[name])       # logical copy: same KV, other strides
        payloads[layout] = _gather(BlockTransfer(caches, num_blocks=10), [6, 1]).tobytes()
    for layout in LAYOUTS:
        same = [other for other in LAYOUTS if payloads[other] == payloads[layout]]
        assert same == [other for other in LAYOUTS if PAGE_ORDER[other] == PAGE_ORDER[layout]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_block_split_stores_the_same_payload_as_whole_blocks(layout, device):
    _, whole = _vllm(layout, device, tokens=8, seed=3)
    raw, split = _vllm(layout, device, tokens=8, kernel_block_size=4, seed=4)
    for name, view in split.items():  # kernel block b*2+j holds tokens [4j, 4j+4) of block b
        b, h, n, c = whole[name].shape
        view.copy_(whole[name].reshape(b, h, 2, n // 2, c).permute(0, 2, 1, 3, 4).reshape(b * 2, h, n // 2, c))
    payload = _gather(BlockTransfer(split, num_blocks=10), [5, 2])
    assert payload.tobytes() == _gather(BlockTransfer(whole, num_blocks=10), [5, 2]).tobytes()

    transfer = BlockTransfer(split, num_blocks=10)
    others = [b for b in range(10) if b not in (2, 5)]
    untouched = _gather(transfer, others)
    transfer.scatter([5, 2], payload[::-1].copy())     # the two blocks swap their KV
    assert _gather(transfer, [2, 5]).tobytes() == payload.tobytes()
    assert _gather(transfer, others).tobytes() == untouched.tobytes()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_mla_pages_copy_the_latent_and_leave_the_padding(layout, device):
    # 576 bf16 latents, 16 tokens: 18,432 bytes, padded to 20,480.
    raw, src = vllm_layer_caches(layout, num_layers=2, num_blocks=6, num_heads=1, block_size=16,
                                 content_nbytes=576 * 2, dtype=torch.bfloat16, device=device, page_pad_to=20480)
    fill_random_(src, raw, seed=7)
    transfer = BlockTransfer(src, num_blocks=6)
    assert transfer.payload_nbytes == 2 * 16 * 576 * 2
    out = _gather(transfer, [4])
    assert out[0].tobytes() == b"".join(_bytes(v[4]) for v in src.values())
    before = raw.clone()
    transfer.scatter([1], out)
    for name, view in src.items():
        assert _bytes(view[1]) == _bytes(view[4])
    changed = (raw != before).nonzero().flatten()
    pages = [range(v.storage_offset() * 2 + v.stride(0) * 2, v.storage_offset() * 2 + v.stride(0) * 2 + 18432)
             for v in src.values()]
    assert all(any(int(i) in page for page in pages) for i in changed)   # padding untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("build", [kv_first_caches, block_major_caches])
def test_older_per_layer_caches_round_trip(build, device):
    src = build(num_layers=2, num_blocks=8, num_heads=2, block_size=4, head_size=8, dtype=torch.float16,
                device=device)
    fill_random_(src, seed=8)
    out = _gather(BlockTransfer(src, num_blocks=8), [2, 6])
    dst = build(num_layers=2, num_blocks=8, num_heads=2, block_size=4, head_size=8, dtype=torch.float16,
                device=device)
    BlockTransfer(dst, num_blocks=8).scatter([0, 7], out)
    for name, t in src.items():
        page = (lambda x, b: x[:, b]) if build is kv_first_caches else (lambda x, b: x[b])
        assert _bytes(page(dst[name], 0)) == _bytes(page(t, 2))
        assert _bytes(page(dst[name], 7)) == _bytes(page(t, 6))


@pytest.mark.parametrize("device", DEVICES)
def test_mla_block_major_round_trips(device):
    src = mla_caches(num_layers=3, num_blocks=5, block_size=16, latent=576, dtype=torch.bfloat16, device=device)
    fill_random_(src, seed=9)
    out = _gather(BlockTransfer(src, num_blocks=5), [3])
    assert out[0].tobytes() == b"".join(_bytes(t[3]) for t in src.values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_vllm_cache_moves_with_one_index_operation(layout):
    _, caches = _vllm(layout, "cpu")
    assert BlockTransfer(caches, num_blocks=10).num_segments == 1
    assert BlockTransfer(caches, num_blocks=10, merge_layers=False).num_segments == 3


# -- host rows -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "LHBNC"])
def test_rows_carry_the_payload_after_the_header(layout, device):
    _, src = _vllm(layout, device)
    transfer = BlockTransfer(src, num_blocks=10, staging_nbytes=4096)   # several chunks per batch
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=8 * row_nbytes)
    rows = pool.take(5)
    transfer.gather_rows([9, 3, 0, 4, 7], rows).wait()
    expected = _gather(transfer, [9, 3, 0, 4, 7])
    assert np.array_equal(rows.rows[:, HEADER:], expected)

    _, dst = _vllm(layout, device, seed=3)
    target = BlockTransfer(dst, num_blocks=10, staging_nbytes=4096)
    before = {name: v.clone() for name, v in dst.items()}
    # Rows 1 and 3 failed their checks: only rows 0, 2, 4 are written.
    target.scatter_rows([1, 5, 6], rows, row_ids=[0, 2, 4]).synchronize()
    rows.release()
    for name in src:
        assert _bytes(dst[name][1]) == _bytes(src[name][9])
        assert _bytes(dst[name][5]) == _bytes(src[name][0])
        assert _bytes(dst[name][6]) == _bytes(src[name][7])
        for b in (0, 2, 3, 4, 7, 8, 9):
            assert _bytes(dst[name][b]) == _bytes(before[name][b])


def test_a_row_pool_lends_no_more_than_it_holds():
    _, src = _vllm("LBNHC", "cpu")
    transfer = BlockTransfer(src, num_blocks=10)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=4 * row_nbytes + row_nbytes // 2)
    assert pool.capacity == 4
    assert pool.take(5) is None
    first = pool.take(3)
    assert pool.take(2, wait=False) is None
    second = pool.take(1)
    assert not np.shares_memory(first.rows, second.rows)
    first.release()
    again = pool.take(2, wait=False)
    assert again is not None and np.shares_memory(again.rows, first.rows)   # the same memory, reused


def test_closing_a_row_pool_waits_for_the_copies_still_using_its_rows():
    """Pinned rows are unpinned at close: not while a copy given them back
    may still be reading or writing them."""
    _, src = _vllm("LBNHC", "cpu")
    transfer = BlockTransfer(src, num_blocks=10)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=4 * row_nbytes)

    class CopyInFlight:
        finished = False

        def done(self) -> bool:
            return self.finished

        def wait(self) -> None:
            self.finished = True

    copy = CopyInFlight()
    pool.take(3).release(after=copy)
    assert pool.take(4, wait=False) is None      # the copy still holds three rows
    pool.close()
    assert copy.finished
    assert pool.take(4, wait=False) is not None


@pytest.mark.parametrize("device", DEVICES)
def test_rows_return_to_the_pool_once_their_copy_is_done(device):
    _, src = _vllm("LBNHC", device, blocks=64, tokens=16, heads=8, head_size=128)
    transfer = BlockTransfer(src, num_blocks=64, staging_nbytes=8 << 20)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=32 * row_nbytes)
    rows = pool.take(32)
    rows.rows[:, HEADER:] = 0x77
    copy = transfer.scatter_rows(list(range(32, 64)), rows)
    rows.release(after=copy)              # no wait here: the pool waits if it must
    again = pool.take(32)                 # the same rows, once the upload has read them
    assert again is not None and np.shares_memory(again.rows, rows.rows)
    again.rows[:, HEADER:] = 0               # may not reach the pages any more
    copy.synchronize()
    assert all(bool((view[32:64].view(torch.uint8) == 0x77).all()) for view in src.values())


@pytest.mark.parametrize("device", DEVICES)
def test_saves_and_loads_on_two_threads_do_not_mix(device):
    import threading

    _, src = _vllm("LBNHC", device, blocks=96, tokens=16, heads=8, head_size=128, seed=11)
    transfer = BlockTransfer(src, num_blocks=96, staging_nbytes=4 << 20)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=64 * row_nbytes)
    saved = _gather(transfer, list(range(32)))
    loads = pool.take(32)
    loads.rows[:, HEADER:] = 0x42
    errors = []

    def save():
        rows = pool.take(32)
        for _ in range(5):
            transfer.gather_rows(list(range(32)), rows).wait()
            if not np.array_equal(rows.rows[:, HEADER:], saved):
                errors.append("a save read other bytes")
        rows.release()

    def load():
        for _ in range(5):
            transfer.scatter_rows(list(range(64, 96)), loads).synchronize()

    threads = [threading.Thread(target=save), threading.Thread(target=load)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(bool((view[64:96].view(torch.uint8) == 0x42).all()) for view in src.values())


# -- save_layerwise: a gather made a layer at a time ---------------------------


def _layered_cases():
    for layout in LAYOUTS:
        yield pytest.param(lambda device, layout=layout: _vllm(layout, device, layers=4)[1], id=layout)
    for build in (kv_first_caches, block_major_caches):
        yield pytest.param(lambda device, build=build: _filled(build(
            num_layers=4, num_blocks=10, num_heads=2, block_size=4, head_size=8, dtype=torch.float16,
            device=device)), id=build.__name__)
    yield pytest.param(lambda device: _filled(mla_caches(num_layers=4, num_blocks=10, block_size=16, latent=576,
                                                         dtype=torch.bfloat16, device=device)), id="mla")


def _filled(caches):
    fill_random_(caches, seed=11)
    return caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_by_page", [True, False], ids=["page-by-page", "fancy-index"])
@pytest.mark.parametrize("build", list(_layered_cases()))
def test_a_layer_gather_copies_what_a_whole_gather_does(build, page_by_page, device):
    """Layers told of in any order, one twice, one never (finish copies it):
    every row's payload equals a whole gather's (page by page: code of its
    own, checked against the logical views above), and the bytes around the
    payloads (the header, and rows not taken) are untouched."""
    src = build(device)
    want = _gather(BlockTransfer(src, num_blocks=10, page_by_page=True), [7, 0, 3, 9, 3])
    transfer = BlockTransfer(src, num_blocks=10, page_by_page=page_by_page)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=8 * row_nbytes)
    pool._array[:] = 0xA5
    rows = pool.take(5)
    blocks = [7, 0, 3, 9, 3]
    gather = transfer.layer_gather(blocks, rows)
    for layer in (2, 0, 2):
        gather.layer(layer)
    assert gather.layers_left == 2
    copy = gather.finish()
    copy.wait()
    assert gather.finish() is copy
    gather.layer(1)                                  # after finish: ignored
    assert np.array_equal(rows.payload, want)
    assert (rows.rows[:, :HEADER] == 0xA5).all()
    assert (pool._array[5:] == 0xA5).all()
    rows.release(after=copy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_by_page", [True, False], ids=["page-by-page", "fancy-index"])
@pytest.mark.parametrize("build", list(_layered_cases()))
def test_a_layer_scatter_writes_what_a_whole_scatter_does(build, page_by_page, device):
    """Rows 0, 2 and 3 of four (row 1 failed its check) go to three blocks a
    layer at a time, the last layer by finish(): the caches end exactly as
    after a whole scatter of the same rows (code of its own, checked
    against the logical views above), and each layer is in its pages once
    it is issued and ordered."""
    src = build(device)
    transfer = BlockTransfer(src, num_blocks=10, page_by_page=page_by_page)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=8 * row_nbytes)
    rows = pool.take(4)
    rows.payload[:] = _gather(transfer, [1, 5, 8, 2])
    # The same caches again (the same layout and bytes), three times.
    dst, want, fresh = build(device), build(device), build(device)
    whole_rows = pool.take(4)
    whole_rows.rows[:] = rows.rows
    BlockTransfer(want, num_blocks=10, page_by_page=page_by_page).scatter_rows(
        [7, 0, 4], whole_rows, row_ids=[0, 2, 3]).synchronize()
    into = BlockTransfer(dst, num_blocks=10, page_by_page=page_by_page)
    scatter = into.layer_scatter([7, 0, 4], rows, row_ids=[0, 2, 3])
    names = list(dst)
    for layer in (1, 0, 1):
        scatter.layer(layer)
        scatter.order(layer)
        assert _bytes(dst[names[layer]]) == _bytes(want[names[layer]])
    assert _bytes(dst[names[2]]) == _bytes(fresh[names[2]])    # not issued yet
    scatter.finish().synchronize()
    for name in names:
        assert _bytes(dst[name]) == _bytes(want[name]), name
        assert _bytes(dst[name]) != _bytes(fresh[name]), name
    rows.release()
    whole_rows.release()


@pytest.mark.parametrize("build", list(_layered_cases()))
def test_the_cuda_layer_copies_index_arithmetic_on_cpu_tensors(build):
    """What the CUDA layer copies do, with torch's index kernels on CPU
    tensors and each pitched DMA replaced by a numpy copy of the same
    pitches: a layer's pages of the blocks land in their payload columns
    (gather), and rows picked out of a slot land in the right pages
    (scatter, with a row that failed its check skipped)."""
    from ucm_connector.layer_copies import slot_pages

    src = build("cpu")
    transfer = BlockTransfer(src, num_blocks=10)
    blocks = [7, 0, 3, 9]
    want = _gather(BlockTransfer(src, num_blocks=10, page_by_page=True), blocks)
    payload = np.zeros((len(blocks), transfer.payload_nbytes), dtype=np.uint8)
    ids = torch.tensor(blocks)
    for layer in range(transfer.num_layers):
        segment = transfer.layer_segment(layer)
        slot = torch.zeros(len(blocks) * segment.nbytes, dtype=torch.uint8)
        torch.index_select(transfer.layer_source(layer, segment.align), 0, ids,
                           out=slot_pages(slot, len(blocks), segment, segment.align))
        payload[:, segment.offset:segment.offset + segment.nbytes] = slot.numpy().reshape(len(blocks), -1)
    assert np.array_equal(payload, want)

    dst, expected = build("cpu"), build("cpu")
    BlockTransfer(expected, num_blocks=10).scatter([1, 5, 2], want, row_ids=[0, 2, 3])
    into = BlockTransfer(dst, num_blocks=10)
    picks, targets = torch.tensor([0, 2, 3]), torch.tensor([1, 5, 2])
    for layer in range(into.num_layers):
        segment = into.layer_segment(layer)
        slot = torch.zeros(len(blocks) * segment.nbytes, dtype=torch.uint8)
        slot.numpy().reshape(len(blocks), -1)[:] = want[:, segment.offset:segment.offset + segment.nbytes]
        rows = slot_pages(slot, len(blocks), segment, segment.align).index_select(0, picks)
        into.layer_source(layer, segment.align).index_copy_(0, targets, rows)
    for name in dst:
        assert _bytes(dst[name]) == _bytes(expected[name]), name


def test_a_layer_gather_sees_what_each_layer_held_when_it_was_told():
    """CPU: a layer is copied when told of; pages written after that are
    not in the rows (the forward pass has moved on to later layers)."""
    _, src = _vllm("LBNHC", "cpu", layers=3)
    transfer = BlockTransfer(src, num_blocks=10)
    row_nbytes = HEADER + transfer.payload_nbytes
    pool = transfer.row_pool(row_nbytes, HEADER, max_nbytes=4 * row_nbytes)
    rows = pool.take(1)
    want = b"".join(_logical_page(v, 4, PAGE_ORDER["LBNHC"]) for v in src.values())
    gather = transfer.layer_gather([4], rows)
    gather.layer(0)
    next(iter(src.values()))[4].view(torch.uint8).fill_(0x11)
    gather.finish().wait()
    assert rows.payload[0].tobytes() == want


# -- the CUDA copies' issue code, on CPU tensors with logged streams ------------


class _LoggedStream:
    """Stands in for a CUDA stream (there is no GPU here): torch's kernels
    run at once on CPU tensors, and what a real stream would be asked to do
    is logged, so a test can read the ordering the code asks for."""

    cuda_stream = 0

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event.name))

    def synchronize(self):
        self.log.append((self.name, "synchronized", None))


@pytest.fixture
def logged_streams(monkeypatch):
    """torch.cuda's streams and events replaced by logged ones; the log."""
    import contextlib
    import itertools

    log, names, count = [], iter(["kernel", "copy"] * 8), itertools.count()
    compute = _LoggedStream(log, "compute")

    class Event:
        def __init__(self, *args, blocking=False, **kwargs):
            self.name = f"event{next(count)}"
            self.blocking = blocking

        def record(self, stream=None):
            log.append((stream.name, "records", self.name))

        def synchronize(self):
            log.append((self.name, "synchronized", "sleeping" if self.blocking else "spinning"))

        def query(self):
            return True

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _LoggedStream(log, next(names)))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    # Block ids go through a ring of (here unpinned) memory of the test's own.
    monkeypatch.setattr(staging, "_PINNED_IDS", staging._PinnedIds())
    return log


def test_block_ids_reuse_a_slice_of_pinned_memory_only_after_the_copy_that_read_it(logged_streams, monkeypatch):
    """Block ids reach the device from a ring of memory pinned once (pinning
    a buffer per copy cost the engine thread about 0.25 ms for every part of
    a save on an H100 machine): each copy reads a slice of its own, and the
    host waits for the copy that last read a slice before writing it again,
    never for one whose slice it does not overlap.  More ids than half the
    ring take memory of their own."""
    monkeypatch.setattr(staging._PinnedIds, "CAPACITY", 8)
    stream = torch.cuda.Stream()
    uploads = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11], [12], [13, 14, 15], [16, 17, 18, 19, 20]]
    got, waits = [], []
    for values in uploads:
        before = len(logged_streams)
        got.append(staging.ids_on_device(torch.device("cpu"), values, stream).tolist())
        waits.append([e for e in logged_streams[before:] if e[1] == "synchronized"])
    assert got == uploads
    ring = staging._PINNED_IDS
    # Slices [0,3) [3,6), then round to the start: [0,3) waits for the first
    # copy, [3,5) for the second, [5,6) for none (the second's, waited for),
    # round again: [0,3) waits for the third.  The last takes its own memory.
    sleeping = "sleeping"
    assert waits == [[], [], [("event0", "synchronized", sleeping)], [("event1", "synchronized", sleeping)], [],
                     [("event2", "synchronized", sleeping)], []]
    assert ring.host[:3].tolist() == [13, 14, 15] and ring.host[3:6].tolist() == [10, 11, 12]
    assert [(lo, hi) for lo, hi, _ in ring.reads] == [(3, 5), (5, 6), (0, 3)]


def _cuda_path(caches, staging_nbytes):
    """A BlockTransfer over CPU caches that takes its CUDA code path (two
    staging slots of half ``staging_nbytes`` each way), and a row pool."""
    from ucm_connector.rows import RowPool
    from ucm_connector.staging import StagingRing, round_up

    transfer = BlockTransfer(caches, num_blocks=10)
    transfer._cuda = True
    slot = round_up(max(staging_nbytes // 2, 1), 256)
    transfer._gather_ring = StagingRing(torch.device("cpu"), slot, 2)
    transfer._scatter_ring = StagingRing(torch.device("cpu"), slot, 2)
    transfer._views = {}
    row = HEADER + transfer.payload_nbytes
    return transfer, RowPool(row, HEADER, transfer.payload_nbytes, 16 * row, pinned=False)


def _zeroed(caches):
    for view in caches.values():
        view.view(torch.uint8).zero_() if view.dtype != torch.uint8 else view.zero_()
    return caches


@pytest.mark.parametrize("staging", [1, 1 << 20], ids=["a-row-per-chunk", "one-chunk"])
@pytest.mark.parametrize("build", list(_layered_cases()))
def test_the_cuda_gather_and_scatter_code_moves_the_right_bytes_on_cpu_tensors(build, staging, logged_streams):
    """The CUDA gather and scatter (staging slots, word views, chunks, rows
    picked out of a chunk), run on CPU tensors: byte for byte what the
    page-by-page code copies, for every layout, twice in a row."""
    src = build("cpu")
    want = _gather(BlockTransfer(src, num_blocks=10, page_by_page=True), [7, 0, 3, 9, 1])
    transfer, pool = _cuda_path(src, staging)
    for _ in range(2):
        rows = pool.take(5)
        transfer.gather_rows([7, 0, 3, 9, 1], rows)
        assert np.array_equal(rows.payload, want)
        rows.release()

    rows = pool.take(5)
    rows.payload[:] = want
    dst, expected = _zeroed(build("cpu")), _zeroed(build("cpu"))
    BlockTransfer(expected, num_blocks=10).scatter([4, 6, 5], want, row_ids=[0, 2, 3])
    into, _ = _cuda_path(dst, staging)
    into.scatter_rows([4, 6, 5], rows, row_ids=[0, 2, 3])
    into.scatter_rows([2], rows, row_ids=[4])
    BlockTransfer(expected, num_blocks=10).scatter([2], want, row_ids=[4])
    for name in dst:
        assert _bytes(dst[name]) == _bytes(expected[name]), name


def test_back_to_back_cuda_copies_take_turns_with_the_staging_slots_on_cpu_tensors(logged_streams):
    """A save comes in parts of one slot's worth each: the next part goes to
    the other slot, so its index kernel does not wait for the DMA of the
    part just before (and the compute stream behind it)."""
    _, src = _vllm("LBNHC", "cpu")
    transfer, pool = _cuda_path(src, 1 << 20)
    ring = transfer._gather_ring
    rows = pool.take(2)
    for part in range(3):
        transfer.gather_rows([part, part + 3], rows)
    waits = [entry[2] for entry in logged_streams if entry[:2] == ("kernel", "waits for")]
    assert waits == [ring.drained[0].name]        # only the third part waits, for the first's DMA


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_a_cuda_copy_that_fails_half_way_waits_for_what_it_issued_on_cpu_tensors(direction, logged_streams):
    """Chunk 2 of 3 fails to issue: before the error reaches the caller
    (which gives the host rows back and counts the blocks failed), the host
    waits for both side streams, where chunk 1's DMA still reads the rows
    and its kernel still writes pages.  The next copy starts at a fresh slot."""
    _, src = _vllm("LBNHC", "cpu")
    transfer, pool = _cuda_path(src, 1)          # a row per chunk
    ring = transfer._gather_ring if direction == "gather" else transfer._scatter_ring
    real_chunk, calls = ring.chunk, []

    def chunk(*args, **kwargs):
        calls.append(args[0])                     # the slot
        if len(calls) == 2:
            logged_streams.append(("test", "raises", None))
            raise RuntimeError("CUDA error: out of memory")
        return real_chunk(*args, **kwargs)

    ring.chunk = chunk
    rows = pool.take(3)
    copy = transfer.gather_rows if direction == "gather" else transfer.scatter_rows
    with pytest.raises(RuntimeError, match="out of memory"):
        copy([1, 2, 3], rows)
    after = logged_streams[logged_streams.index(("test", "raises", None)):]
    assert ("copy", "synchronized", None) in after and ("kernel", "synchronized", None) in after
    assert calls == [0, 1]
    copy([1], rows)
    assert calls == [0, 1, 1]                      # three chunks were planned: slot 1 is next


def test_staging_slots_reserved_at_start_up_serve_the_copies_on_cpu_tensors(logged_streams, monkeypatch):
    """Both directions' slots are allocated by ``reserve_staging`` (at
    start-up) and the copies use them, allocating nothing more; with no
    room, it raises, and the first copy tries again."""
    _, src = _vllm("LBNHC", "cpu")
    transfer, pool = _cuda_path(src, 1 << 20)
    rings = (transfer._gather_ring, transfer._scatter_ring)
    assert all(ring.buffer is None for ring in rings)
    # A direction the engine never copies in (a producer's loads) takes nothing.
    assert transfer.reserve_staging(pool.row_nbytes, scatter=False) == rings[0].slot_nbytes * rings[0].slots > 0
    assert rings[1].buffer is None
    assert transfer.reserve_staging(pool.row_nbytes) == sum(r.slot_nbytes * r.slots for r in rings)
    buffers = [ring.buffer for ring in rings]
    rows = pool.take(2)
    transfer.gather_rows([0, 3], rows).synchronize()
    transfer.scatter_rows([1, 2], rows).synchronize()
    assert all(ring.buffer is buffer for ring, buffer in zip(rings, buffers))

    fresh, fresh_pool = _cuda_path(src, 1 << 20)
    real = torch.empty

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        fresh.reserve_staging(fresh_pool.row_nbytes)
    monkeypatch.setattr(torch, "empty", real)
    rows = fresh_pool.take(2)
    fresh.gather_rows([0, 3], rows).synchronize()
    assert fresh._gather_ring.buffer is not None


def test_a_host_thread_that_waits_for_a_cuda_copy_sleeps_on_cpu_tensors(logged_streams):
    """The events a host thread waits on (a save's rows written, a load's
    pages written) are blocking ones: the writer or loader sleeps until the
    device signals, rather than spinning a core through the copy."""
    _, src = _vllm("LBNHC", "cpu")
    transfer, pool = _cuda_path(src, 1 << 20)
    rows = pool.take(2)
    transfer.gather_rows([0, 3], rows).synchronize()
    transfer.scatter_rows([1, 2], rows, ordered=False).synchronize()
    waits = [entry[2] for entry in logged_streams if entry[1] == "synchronized" and entry[0].startswith("event")]
    assert waits == ["sleeping"] * 4


# -- CUDA ordering -------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_a_gather_sees_compute_stream_writes_queued_just_before():
    _, src = _vllm("LBNHC", "cuda", blocks=64, tokens=16, heads=8, head_size=128)
    transfer = BlockTransfer(src, num_blocks=64)
    pool = transfer.row_pool(HEADER + transfer.payload_nbytes, HEADER, max_nbytes=64 << 20)
    rows = pool.take(1)
    torch.cuda._sleep(20_000_000)                      # the compute stream is busy ...
    for view in src.values():
        view[17].view(torch.uint8).fill_(0x5A)         # ... then writes the page
    transfer.gather_rows([17], rows).wait()
    assert (rows.rows[0, HEADER:] == 0x5A).all()


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_a_layer_gather_sees_the_layer_written_just_before_and_later_kernels_wait_for_it():
    """A layer told of right after the compute stream (busy) writes its
    pages: the rows hold those bytes.  A kernel queued after ``finish``
    that overwrites the pages runs after they were read."""
    _, src = _vllm("LBNHC", "cuda", blocks=64, tokens=16, heads=8, head_size=128)
    transfer = BlockTransfer(src, num_blocks=64)
    assert transfer.can_copy_by_layer
    pool = transfer.row_pool(HEADER + transfer.payload_nbytes, HEADER, max_nbytes=64 << 20)
    rows = pool.take(4)
    gather = transfer.layer_gather([17, 3, 40, 5], rows)
    for layer, view in enumerate(src.values()):
        torch.cuda._sleep(5_000_000)                   # the compute stream is busy ...
        view[17].view(torch.uint8).fill_(0x5A + layer)  # ... then writes the layer's page
        gather.layer(layer)
    copy = gather.finish()
    for view in src.values():
        view[17].view(torch.uint8).fill_(0)             # queued after finish: after the reads
    copy.wait()
    offset = 0
    for layer, segment in enumerate(transfer.layer_segment(i) for i in range(transfer.num_layers)):
        assert (rows.payload[0, segment.offset:segment.offset + segment.nbytes] == 0x5A + layer).all()
        offset += segment.nbytes
    assert offset == transfer.payload_nbytes
    torch.cuda.synchronize()
    assert all(not bool(view[17].view(torch.uint8).any()) for view in src.values())
    rows.release()


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_kernels_queued_after_a_scatter_read_the_loaded_pages():
    _, src = _vllm("LBNHC", "cuda", blocks=256, tokens=16, heads=8, head_size=128)
    transfer = BlockTransfer(src, num_blocks=256, staging_nbytes=8 << 20)
    pool = transfer.row_pool(HEADER + transfer.payload_nbytes, HEADER, max_nbytes=256 << 20)
    rows = pool.take(128)
    rows.rows[:, HEADER:] = 0x3C
    assert rows.tensor.is_pinned()
    transfer.scatter_rows(list(range(128)), rows)      # returns before the copy is done
    last = [view[127].view(torch.uint8).clone() for view in src.values()]   # queued on the compute stream
    assert all(bool((page == 0x3C).all()) for page in last)
    rows.release()


@pytest.mark.parametrize("page_by_page", [True, False], ids=["page-by-page", "fancy-index"])
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "LHBNC"])
def test_cpu_copies_checksum_pick_rows_and_expose_pages(layout, page_by_page):
    """On CPU, both ways of copying: a gather with a hasher returns each
    payload's xxh3 (the envelope's checksum); a scatter takes the rows it
    is told to; ``page_parts`` are the block's pages in payload order,
    where each page is one run of bytes."""
    import xxhash

    from ucm_connector import blockfmt

    _, caches = _vllm(layout, "cpu", blocks=12)
    t = BlockTransfer(caches, 12, page_by_page=page_by_page)
    out = np.zeros((3, t.payload_nbytes), dtype=np.uint8)
    checksums = t.gather([4, 0, 7], out, hasher=blockfmt.payload_hasher)
    assert checksums == [xxhash.xxh3_64_intdigest(row) for row in out]
    assert t.gather([4], np.zeros((1, t.payload_nbytes), dtype=np.uint8)) is None
    want = {b: _gather(t, [b])[0].tobytes() for b in (0, 4, 7)}
    assert [row.tobytes() for row in out] == [want[4], want[0], want[7]]
    # Rows 2 and 0 into blocks 9 and 10: block 9 gets block 7's bytes.
    t.scatter([9, 10], out, row_ids=[2, 0])
    assert _gather(t, [9, 10]).tobytes() == want[7] + want[4]
    # LHBNC keeps heads outside blocks: a page is a run per head, so no
    # store can read a block straight into it.
    assert t.pages_contiguous == (layout != "LHBNC")
    if t.pages_contiguous:
        assert b"".join(bytes(p) for p in t.page_parts(7)) == want[7]


def test_vllm_builds_the_same_views():
    """cache_views reproduces vLLM's own construction (where vLLM is here)."""
    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layers, blocks, heads, tokens, head_size = 3, 7, 2, 8, 8
    for name in LAYOUTS:
        layout = KVCacheLayout[name]
        for kernel_block_size, spec in (
                (None, kv.FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=head_size,
                                            dtype=torch.bfloat16)),
                (4, kv.FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=head_size,
                                         dtype=torch.bfloat16)),
                (None, kv.MLAAttentionSpec(block_size=tokens, num_kv_heads=1, head_size=20, dtype=torch.bfloat16,
                                           alignment=512))):
            per_block = layers * spec.page_size_bytes
            layer_stride, block_stride, *_ = kv.compute_layout_strides(
                spec, blocks, layers, layout,
                fixed_strides=(None, per_block if layout.is_block_outermost else None, None, None, None))
            tensor = kv.KVCacheTensor(size=per_block * blocks, layers=[str(i) for i in range(layers)],
                                      layer_stride=layer_stride, block_stride=block_stride)
            raw = torch.zeros(per_block * blocks, dtype=torch.int8)
            try:
                theirs = kv.create_kv_cache_views(raw, spec, blocks, layout, tensor,
                                                  kernel_block_size=kernel_block_size)
            except ValueError:
                theirs = None
            mla = isinstance(spec, kv.MLAAttentionSpec)
            kwargs = dict(num_layers=layers, num_blocks=blocks, num_heads=spec.num_kv_heads, block_size=tokens,
                          content_nbytes=spec.state_content_size_bytes, dtype=torch.bfloat16,
                          page_pad_to=spec.page_size_bytes if mla else None, kernel_block_size=kernel_block_size)
            if theirs is None:
                with pytest.raises(ValueError):
                    vllm_layer_caches(name, **kwargs)
                continue
            ours_raw, ours = vllm_layer_caches(name, **kwargs)
            assert ours_raw.numel() == raw.numel()
            for a, b in zip(theirs, ours.values()):
                assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == \
                    (b.shape, b.stride(), b.storage_offset(), b.dtype), (name, kernel_block_size, mla)
