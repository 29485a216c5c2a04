"""Tiers of stores: fall-through reads, promotion, background writes, and a
tier that goes down."""

from __future__ import annotations

import time
import uuid

import pytest

from servers import RedisServer
from store_backends import StoreUnavailableError, open_store
from store_backends.tiered import TieredStore


def test_reads_fall_through_and_promote_hits_upward(tmp_path):
    top, bottom = f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"
    open_store(bottom).put([b"deep"], [b"from-the-bottom"])
    tier = open_store([top, bottom])
    try:
        assert open_store(top).contains([b"deep"]) == [False]
        assert tier.get([b"deep", b"nowhere"]) == [b"from-the-bottom", None]
        assert tier.flush(timeout=30)
        assert open_store(top).get([b"deep"]) == [b"from-the-bottom"]
        extra = tier.stats().extra
        assert extra["hits_per_tier"] == [0, 1]
        assert extra["num_promoted"] == 1
    finally:
        tier.close()


def test_get_into_promotes_too(tmp_path):
    top, bottom = f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"
    open_store(bottom).put([b"k"], [b"12345678"])
    tier = open_store([top, bottom])
    try:
        buf = bytearray(8)
        assert tier.get_into([b"k"], [buf]) == [True] and buf == b"12345678"
        tier.flush(timeout=30)
        assert open_store(top).get([b"k"]) == [b"12345678"]
    finally:
        tier.close()


def test_writes_reach_every_tier_in_the_background(tmp_path):
    top, bottom = f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"
    tier = open_store([top, bottom])
    try:
        source = bytearray(b"x" * 1000)
        assert tier.put([b"a"], [source]) == [True]
        source[:] = b"y" * 1000  # the caller's buffer is reused at once
        assert open_store(top).get([b"a"]) == [b"x" * 1000]
        assert tier.flush(timeout=30)
        assert open_store(bottom).get([b"a"]) == [b"x" * 1000]
    finally:
        tier.close()


def test_put_parts_writes_the_first_tier_from_the_parts_and_reads_back_for_the_lower_ones(tmp_path):
    """shm over disk, async: the shm tier copies each value from its parts
    (after ``before_value`` filled the header part); the disk tier gets the
    same bytes in the background, read back from shm without counting a
    get, once the caller's buffers are reused.  A value shm cannot keep
    (larger than it) still reaches the disk, with its header filled."""
    shm_url = f"shm://t{uuid.uuid4().hex[:10]}?capacity=4MiB&chunk=64KiB&runtime_dir={tmp_path}"
    bottom = f"disk://{tmp_path}/bottom"
    tier = open_store([shm_url, bottom])
    try:
        assert tier.writes_from_parts
        sizes = [100_000, 200_000, 5 << 20]       # the last is larger than the shm tier
        headers = [bytearray(8) for _ in sizes]
        bodies = [bytearray(bytes([i + 1]) * n) for i, n in enumerate(sizes)]
        keys = [b"p0", b"p1", b"big"]
        called = []

        def before_value(i: int) -> None:
            called.append(i)
            headers[i][:] = b"header%d!" % i

        assert tier.put_parts(keys, [[h, b] for h, b in zip(headers, bodies)], before_value) == \
            [True, True, False]
        want = [b"header%d!" % i + bytes([i + 1]) * n for i, n in enumerate(sizes)]
        for h, b in zip(headers, bodies):      # the caller reuses its buffers at once
            h[:] = bytes(8)
            b[:] = bytes(len(b))
        assert sorted(called) == [0, 1, 2]
        shm = tier.stores[0]
        gets = shm.stats().num_gets
        assert tier.flush(timeout=30)
        assert shm.stats().num_gets == gets     # read back without counting a use
        with open_store(bottom) as disk:
            assert disk.get(keys) == want
        assert shm.get(keys[:2]) == want[:2]
    finally:
        tier.close()
        tier.stores[0].shutdown_server()


def test_get_into_parts_reads_each_tier_straight_into_the_parts_and_promotes(tmp_path):
    """Two disk tiers, each reading into parts: a value of the top tier and
    one only the bottom tier has both land whole in their parts;
    ``on_value`` comes once per found value with its position in the
    caller's batch; the bottom tier's hit is promoted."""
    top, bottom = f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"
    with open_store(top) as t:
        t.put([b"up"], [b"U" * 5000])
    with open_store(bottom) as b:
        b.put([b"down"], [b"D" * 5000])
    tier = open_store([top, bottom])
    try:
        assert tier.reads_into_parts
        parts = [[memoryview(bytearray(64)), memoryview(bytearray(5000 - 64))] for _ in range(3)]
        seen = []
        found = tier.get_into_parts([b"absent", b"down", b"up"], parts,
                                    lambda i: seen.append((i, b"".join(parts[i]))))
        assert found == [False, True, True]
        assert sorted(seen) == [(1, b"D" * 5000), (2, b"U" * 5000)]
        assert tier.flush(timeout=30)
        with open_store(top) as t:
            assert t.get([b"down"]) == [b"D" * 5000]
    finally:
        tier.close()


def test_sync_mode_writes_every_tier_before_put_returns(tmp_path):
    top, bottom = f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"
    tier = open_store([top, bottom], write_mode="sync")
    try:
        tier.put([b"a"], [b"v"])
        assert open_store(bottom).get([b"a"]) == [b"v"]
    finally:
        tier.close()


def test_prefix_len_spans_tiers(tmp_path):
    top, bottom = f"disk://{tmp_path}/top", f"disk://{tmp_path}/bottom"
    open_store(top).put([b"k0", b"k2"], [b"0", b"2"])
    open_store(bottom).put([b"k1", b"k3"], [b"1", b"3"])
    tier = open_store([top, bottom])
    try:
        assert tier.prefix_len([b"k0", b"k1", b"k2", b"k3", b"k4"]) == 4
        assert tier.contains([b"k3", b"k4"]) == [True, False]
    finally:
        tier.close()


def test_a_full_backlog_drops_lower_tier_writes_instead_of_waiting(tmp_path):
    stores = [open_store(f"disk://{tmp_path}/top"), open_store(f"disk://{tmp_path}/bottom")]
    tier = TieredStore(stores, max_pending_nbytes=1)
    try:
        for i in range(50):
            assert tier.put([b"k%d" % i], [b"v" * 100]) == [True]
        assert tier.flush(timeout=30)
        dropped = tier.stats().extra["num_dropped_writes"]
        in_bottom = sum(stores[1].contains([b"k%d" % i for i in range(50)]))
        assert dropped + in_bottom == 50
        assert open_store(f"disk://{tmp_path}/top").prefix_len([b"k%d" % i for i in range(50)]) == 50
    finally:
        tier.close()


def test_a_lower_tier_that_goes_down_only_makes_the_tier_hit_less(tmp_path):
    server = RedisServer().start()
    try:
        tier = open_store([f"disk://{tmp_path}/top", server.url + "?timeout=1"])
        try:
            tier.put([b"a"], [b"va"])
            assert tier.flush(timeout=30)
            server.stop()
            t0 = time.monotonic()
            assert tier.get([b"a", b"b"]) == [b"va", None]
            assert tier.put([b"c"], [b"vc"]) == [True]
            assert tier.prefix_len([b"a", b"c", b"b"]) == 2
            tier.flush(timeout=30)
            assert time.monotonic() - t0 < 15
            assert tier.stats().extra["errors_per_tier"][1] >= 1
        finally:
            tier.close()
    finally:
        server.cleanup()


def test_every_tier_down_is_a_typed_error(tmp_path):
    server = RedisServer().start()
    try:
        tier = open_store([server.url + "?timeout=1"])
        tier2 = TieredStore([tier])
        server.stop()
        with pytest.raises(StoreUnavailableError):
            tier2.get([b"a"])
        tier2.close()
    finally:
        server.cleanup()
