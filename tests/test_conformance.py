"""The KVStore contract, run against every backend: disk, Redis, Redis
Cluster, shared memory, a tier (shm over disk), and a third-party store found
through the ``ucm_connector.stores`` entry-point group.

Each test is one behaviour of ``store_backends.base.KVStore``; a backend that
breaks it fails here under its own name.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from store_backends import StoreError, StoreStats, open_store
from store_backends.tiered import TieredStore

BACKENDS = ["disk", "redis", "redis-cluster", "shm", "tier", "entry-point"]


def _shm_url(name: str) -> str:
    return f"shm://{name}?capacity=64MiB"


def _stop_shm(url: str) -> None:
    from store_backends import stop_server

    stop_server(url.partition("://")[2].partition("?")[0])


@pytest.fixture(params=BACKENDS)
def store_url(request, tmp_path):
    """A fresh, empty store URL of each kind; cleaned up afterwards."""
    name = "c" + uuid.uuid4().hex[:12]
    kind = request.param
    cleanup = []
    if kind == "disk":
        url = f"disk://{tmp_path}/store?capacity=256MiB"
    elif kind == "redis":
        url = request.getfixturevalue("redis_server").url + f"?namespace={name}"
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url + f"?namespace={name}"
    elif kind == "entry-point":
        request.getfixturevalue("thirdparty_entry_point")
        url = f"memdict://{name}"
    elif kind == "shm":
        url = _shm_url(name)
        cleanup.append(lambda: _stop_shm(url))
    else:
        shm = _shm_url(name)
        url = [shm, f"disk://{tmp_path}/tier?capacity=256MiB"]
        cleanup.append(lambda: _stop_shm(shm))
    yield url
    for fn in cleanup:
        fn()


@pytest.fixture
def store(store_url):
    s = open_store(store_url)
    yield s
    s.close()


def block(i: int, nbytes: int = 4096) -> bytes:
    """A distinct, reproducible value per index."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def settle(store) -> None:
    if isinstance(store, TieredStore):
        assert store.flush(timeout=30)


def test_put_then_get_returns_the_same_bytes(store):
    keys = [b"k%d" % i for i in range(10)]
    values = [block(i) for i in range(10)]
    assert store.put(keys, values) == [True] * 10
    assert store.get(keys) == values


def test_get_into_fills_the_callers_buffer(store):
    keys = [b"a", b"b"]
    values = [block(1, 65536), block(2, 65536)]
    store.put(keys, values)
    buffers = [bytearray(65536), memoryview(np.zeros(65536, dtype=np.uint8)).cast("B")]
    assert store.get_into(keys, buffers) == [True, True]
    assert bytes(buffers[0]) == values[0]
    assert bytes(buffers[1]) == values[1]


def test_missing_keys_are_misses(store):
    store.put([b"present"], [block(0)])
    assert store.get([b"absent", b"present"]) == [None, block(0)]
    assert store.get_into([b"absent"], [bytearray(4096)]) == [False]
    assert store.contains([b"absent", b"present"]) == [False, True]


def test_get_into_a_buffer_of_another_size_is_a_miss(store):
    store.put([b"k"], [block(0, 4096)])
    assert store.get_into([b"k"], [bytearray(4095)]) == [False]
    assert store.get_into([b"k"], [bytearray(4097)]) == [False]
    assert store.get_into([b"k"], [bytearray(4096)]) == [True]


@pytest.mark.parametrize("cuts", [[64, 65600, 300000], [0, 64, 64, 1 << 20], [7], []],
                         ids=["header-pages", "empty-parts", "odd", "one-part"])
def test_get_into_parts_fills_the_parts_in_order(store, cuts):
    """A value read into several buffers (a block's header and its pages):
    the parts hold the value's bytes in order, whatever the cuts, across a
    store's own chunks; a value of another total size, or a miss, is a
    False and a miss for the rest of the batch is no hit for them."""
    nbytes = (1 << 20) + 4096
    values = [block(11, nbytes), block(12, nbytes)]
    store.put([b"p1", b"p2"], values)
    edges = [0] + cuts + [nbytes]

    def parts():
        return [memoryview(bytearray(hi - lo)) for lo, hi in zip(edges, edges[1:])]

    one, two, short, absent = parts(), parts(), parts()[:-1], parts()
    assert store.get_into_parts([b"p1", b"p2", b"p1", b"absent"], [one, two, short, absent]) == \
        [True, True, False, False]
    assert b"".join(bytes(p) for p in one) == values[0]
    assert b"".join(bytes(p) for p in two) == values[1]
    with pytest.raises(ValueError):
        store.get_into_parts([b"p1"], [])


def test_get_into_parts_calls_back_each_whole_value_before_the_next(store):
    """``on_value(i)``: once per value answered True, in order, when the
    value is already whole in its parts (so the caller can check it while
    it is in the CPU's caches); never for a miss or a value of another size."""
    nbytes = (1 << 20) + 4096
    values = [block(21, nbytes), block(22, nbytes)]
    store.put([b"c1", b"c2"], values)
    parts = [[memoryview(bytearray(4096)), memoryview(bytearray(nbytes - 4096))] for _ in range(4)]
    parts[2] = parts[2][:1]                      # too short for c1
    seen: list[tuple[int, bytes]] = []

    def on_value(i: int) -> None:
        seen.append((i, b"".join(bytes(p) for p in parts[i])))

    found = store.get_into_parts([b"c1", b"absent", b"c1", b"c2"], parts, on_value)
    assert found == [True, False, False, True]
    assert seen == [(0, values[0]), (3, values[1])]


@pytest.mark.parametrize("cuts", [[64, 65600, 300000], [0, 64, 64, 1 << 20], []],
                         ids=["header-pages", "empty-parts", "one-part"])
def test_put_parts_stores_the_parts_joined_in_order(store, cuts):
    """A value written from several buffers (a block's header and its
    pages) is stored as their bytes in order; ``before_value(i)`` runs
    before value i is copied, so what it writes into a part (a header) is
    what is stored."""
    nbytes = (1 << 20) + 4096
    values = [block(31, nbytes), block(32, nbytes)]
    edges = [0] + cuts + [nbytes]
    parts = [[memoryview(bytearray(v[lo:hi])) for lo, hi in zip(edges, edges[1:])] for v in values]
    # The first 64 bytes of each value are written only in before_value.
    head = 64 if cuts and cuts[0] == 64 else None
    called = []

    def before_value(i: int) -> None:
        called.append(i)
        if head is not None:
            parts[i][0][:] = values[i][:head]

    if head is not None:
        for value_parts in parts:
            value_parts[0][:] = bytes(head)
    assert store.put_parts([b"w1", b"w2"], parts, before_value) == [True, True]
    settle(store)
    assert store.get([b"w1", b"w2"]) == values
    assert called == [0, 1]
    with pytest.raises(ValueError):
        store.put_parts([b"w1"], [])


def test_put_is_idempotent(store):
    assert store.put([b"k"], [block(7)]) == [True]
    assert store.put([b"k"], [block(7)]) == [True]
    assert store.get([b"k"]) == [block(7)]


def test_prefix_len_counts_only_the_leading_run(store):
    keys = [b"p%d" % i for i in range(8)]
    store.put(keys[:3] + keys[4:], [block(i, 512) for i in range(7)])
    settle(store)
    assert store.prefix_len(keys) == 3
    assert store.prefix_len(keys[4:]) == 4
    assert store.prefix_len([b"nothing"] + keys) == 0
    assert store.contains(keys) == [True, True, True, False, True, True, True, True]


def test_empty_batches(store):
    assert store.put([], []) == []
    assert store.get([]) == []
    assert store.get_into([], []) == []
    assert store.contains([]) == []
    assert store.prefix_len([]) == 0
    store.delete([])


def test_delete_removes_only_the_named_keys(store):
    store.put([b"x", b"y"], [block(1), block(2)])
    settle(store)
    store.delete([b"x", b"never-stored"])
    assert store.get([b"x", b"y"]) == [None, block(2)]
    assert store.contains([b"x"]) == [False]


def test_keys_must_be_bytes(store):
    with pytest.raises(TypeError, match="bytes"):
        store.put(["text-key"], [b"v"])
    with pytest.raises(ValueError, match="empty"):
        store.contains([b""])
    with pytest.raises(ValueError, match="2 keys but 1"):
        store.put([b"a", b"b"], [b"v"])


def test_hostile_keys_are_distinct_and_round_trip(store):
    keys = [b"../../etc/passwd", b"/", b"\x00", b"\x00\x00", b"a/b", b"A/B", b"..", b".",
            b"*", b"{slot}", b"\xff" * 600, b"\n", b" "]
    values = [block(i, 256) for i in range(len(keys))]
    assert store.put(keys, values) == [True] * len(keys)
    assert store.get(keys) == values


def test_put_accepts_any_buffer_and_keeps_a_copy(store):
    source = np.arange(8192, dtype=np.uint8)
    original = source.tobytes()
    ok = store.put([b"np", b"ba", b"mv"], [memoryview(source), bytearray(original), memoryview(original)])
    assert ok == [True, True, True]
    source[:] = 0  # the caller reuses its buffer
    settle(store)
    assert store.get([b"np", b"ba", b"mv"]) == [original] * 3


def test_large_values_round_trip(store):
    value = block(3, 4 << 20)
    assert store.put([b"big"], [value]) == [True]
    buf = bytearray(len(value))
    assert store.get_into([b"big"], [buf]) == [True]
    assert buf == value


def test_a_second_handle_sees_what_the_first_stored(store, store_url):
    store.put([b"shared"], [block(5)])
    settle(store)
    other = open_store(store_url)
    try:
        assert other.get([b"shared"]) == [block(5)]
        assert other.prefix_len([b"shared"]) == 1
    finally:
        other.close()


def test_concurrent_threads_read_their_own_writes(store):
    errors: list[str] = []

    def worker(t: int) -> None:
        keys = [b"t%d-%d" % (t, i) for i in range(20)]
        values = [block(t * 100 + i, 2048) for i in range(20)]
        for _ in range(3):
            if store.put(keys, values) != [True] * 20:
                errors.append(f"thread {t}: put failed")
            got = store.get(keys)
            if got != values:
                errors.append(f"thread {t}: wrong values")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_stats_report_the_url_and_count_hits(store):
    store.put([b"s1", b"s2"], [block(1), block(2)])
    settle(store)
    store.get([b"s1", b"s2", b"s3"])
    stats = store.stats()
    assert isinstance(stats, StoreStats)
    assert stats.url == store.url
    assert stats.num_hits >= 2
    assert stats.num_misses >= 1
    if stats.num_blocks is not None:
        assert stats.num_blocks >= 2


def test_close_is_idempotent(store_url):
    s = open_store(store_url)
    s.put([b"c"], [b"value"])
    s.close()
    s.close()
    # Neither close lost what the handle had stored.
    with open_store(store_url) as other:
        assert other.get([b"c"]) == [b"value"]


# -- inspection, for operators: iter_keys, peek, last_used -------------------

def lists_keys(store_url) -> bool:
    """Every built-in store lists its keys; the test suite's third-party
    store keeps the KVStore default, which refuses."""
    return not (isinstance(store_url, str) and store_url.startswith("memdict://"))


def all_keys(store, batch: int = 1000) -> list[bytes]:
    return [key for keys in store.iter_keys(batch) for key in keys]


def test_iter_keys_lists_every_key_once_in_batches(store, store_url):
    keys = [b"list-%d" % i for i in range(25)] + [b"\x00\xff/..", b"*"]
    store.put(keys, [block(i, 256) for i in range(len(keys))])
    settle(store)
    if not lists_keys(store_url):
        with pytest.raises(StoreError, match="cannot list its blocks"):
            all_keys(store)
        return
    batches = list(store.iter_keys(batch=7))
    assert all(0 < len(b) <= 7 for b in batches)
    listed = [key for b in batches for key in b]
    assert sorted(listed) == sorted(keys)
    assert all(type(key) is bytes for key in listed)


def test_iter_keys_follows_deletes_and_tolerates_them_mid_walk(store, store_url):
    if not lists_keys(store_url):
        pytest.skip("this store keeps the default iter_keys")
    keys = [b"walk-%d" % i for i in range(30)]
    store.put(keys, [block(i, 128) for i in range(30)])
    settle(store)
    store.delete(keys[:5])
    walked = []
    for batch in store.iter_keys(batch=4):
        walked += batch
        store.delete(batch)
    assert sorted(walked) == sorted(keys[5:])
    assert all_keys(store) == []
    assert store.contains(keys) == [False] * 30


def test_peek_returns_the_size_and_leading_bytes(store):
    values = [block(1, 5000), block(2, 10), b"x"]
    keys = [b"peek-a", b"peek-b", b"peek-c"]
    store.put(keys, values)
    settle(store)
    assert store.peek(keys + [b"peek-missing"], 64) == [
        (5000, values[0][:64]), (10, values[1]), (1, b"x"), None]
    assert store.peek(keys, None) == [(len(v), v) for v in values]
    assert store.peek(keys[:1], 0) == [(5000, b"")]
    assert store.peek([], 64) == []


def test_peek_is_not_counted_as_a_hit(store, store_url):
    if not lists_keys(store_url):
        pytest.skip("the default peek reads through get, which counts")
    store.put([b"quiet"], [block(3)])
    settle(store)
    before = store.stats()
    assert store.peek([b"quiet"], 16) == [(4096, block(3)[:16])]
    after = store.stats()
    assert (after.num_hits, after.num_misses) == (before.num_hits, before.num_misses)


def test_last_used_is_recent_or_unknown(store):
    t0 = time.time()
    store.put([b"used"], [block(4)])
    settle(store)
    store.get([b"used"])
    when, missing = store.last_used([b"used", b"never-stored"])
    assert missing is None
    assert when is None or t0 - 2 <= when <= time.time() + 2
