"""store_backends.pausing: a medium that stopped answering is not asked again
for a while.  Real redis-servers stopped with SIGSTOP (a hung server: calls
wait the store's timeout), real shm and disk stores in a tier."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from store_backends import PausingStore, StoreUnavailableError, open_store, pause_unavailable
from store_backends.tiered import TieredStore
from ucm_testing.servers import RedisServer


@pytest.fixture
def private_server():
    server = RedisServer(password="s3cret-pw").start()
    yield server
    server.cleanup()


class Calls:
    """Counts the calls of this test's thread that reach a store's own
    methods (not the background probe's)."""

    def __init__(self, store, names=("get", "contains", "prefix_len", "put", "get_into", "delete")):
        self.count = 0
        for name in names:
            fn = getattr(store, name)
            setattr(store, name, self._counted(fn))

    def _counted(self, fn):
        def call(*args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                self.count += 1
            return fn(*args, **kwargs)
        return call


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _answers(store) -> bool:
    try:
        store.contains([b"k"])
        return True
    except StoreUnavailableError:
        return False


def test_a_hung_server_is_asked_once_then_paused_and_used_again_once_it_answers(private_server):
    url = f"redis://:s3cret-pw@127.0.0.1:{private_server.port}/0?timeout=0.3"
    inner = open_store(url)
    pauses = []
    store = PausingStore(inner, min_pause_s=0.5, max_pause_s=2.0, on_pause=lambda: pauses.append(1))
    assert store.put([b"k"], [b"v"]) == [True]
    calls = Calls(inner)
    os.kill(private_server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailableError):
            store.get([b"k"])
        assert calls.count == 1
        # Paused: every call fails at once without reaching the medium, and
        # says which store, why and for how long; no password in it.
        for op in (lambda: store.get([b"k"]), lambda: store.contains([b"k"]), lambda: store.prefix_len([b"k"]),
                   lambda: store.put([b"k2"], [b"v"]), lambda: store.get_into([b"k"], [bytearray(1)]),
                   lambda: store.delete([b"k2"])):
            with pytest.raises(StoreUnavailableError) as info:
                op()
            message = str(info.value)
            assert "stopped answering" in message and ":***@" in message and "s3cret-pw" not in message
        assert calls.count == 1
        # The background probe keeps finding it hung: still paused, still
        # not asked by callers.
        time.sleep(1.0)
        with pytest.raises(StoreUnavailableError):
            store.contains([b"k"])
        assert calls.count == 1
        assert pauses == [1]        # one run of failures, however long
    finally:
        os.kill(private_server.proc.pid, signal.SIGCONT)
    _wait_until(lambda: _answers(store), 10, "the store was not used again after its server came back")
    assert store.get([b"k"]) == [b"v"]
    assert pauses == [1]
    assert store.stats().num_blocks is not None      # never paused
    store.close()


def test_errors_other_than_unavailable_pass_through_and_pause_nothing(tmp_path):
    store = PausingStore(open_store(f"disk://{tmp_path}/d"))
    with pytest.raises(TypeError):
        store.put(["not bytes"], [b"v"])        # type: ignore[list-item]
    assert store.paused_for() == 0
    assert store.put([b"k"], [b"v"]) == [True] and store.get([b"k"]) == [b"v"]
    store.close()


def test_in_a_tier_only_the_hung_tier_is_paused(tmp_path, private_server):
    """A tier of shm over a Redis that hangs: the Redis tier is paused after
    its first timeout, the shm tier keeps serving, and the tier's reads of
    blocks only the Redis had are misses at once, not timeouts."""
    shm = f"shm://p{uuid.uuid4().hex[:10]}?capacity=16MiB&runtime_dir={tmp_path}"
    redis = f"redis://:s3cret-pw@127.0.0.1:{private_server.port}/0?timeout=0.3"
    store = pause_unavailable(open_store([shm, redis], write_mode="sync"))
    assert isinstance(store, TieredStore)
    top, bottom = store.stores
    assert isinstance(top, PausingStore) and isinstance(bottom, PausingStore)
    assert pause_unavailable(store) is store and store.stores == [top, bottom]   # not wrapped twice
    assert store.put([b"both"], [b"1"]) == [True]
    bottom.inner.put([b"below"], [b"2"])
    calls = Calls(bottom.inner)
    os.kill(private_server.proc.pid, signal.SIGSTOP)
    try:
        assert store.get([b"below"]) == [None]          # the first timeout
        assert store.get([b"both", b"below"]) == [b"1", None]
        assert store.get([b"below"]) == [None]
        assert calls.count == 1
        assert top.paused_for() == 0
    finally:
        os.kill(private_server.proc.pid, signal.SIGCONT)
    _wait_until(lambda: store.get([b"below"]) == [b"2"], 10, "the Redis tier was not used again")
    assert store.flush(timeout=10)      # the promotion of "below" into shm
    store.close()
    top.inner.shutdown_server()


def test_the_connector_opens_every_medium_behind_a_pause_and_counts_pauses(tmp_path, private_server):
    from ucm_connector.config import UCMConfig
    from ucm_connector.connector import _open_store
    from ucm_connector.counters import StatsCollector

    one = _open_store(UCMConfig.from_extra_config({"store": f"disk://{tmp_path}/one"}))
    assert isinstance(one, PausingStore) and one.url == f"disk://{tmp_path}/one"
    one.close()
    stats = StatsCollector()
    url = f"redis://:s3cret-pw@127.0.0.1:{private_server.port}/0?timeout=0.3"
    redis = _open_store(UCMConfig.from_extra_config({"store": url}), stats)
    os.kill(private_server.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            with pytest.raises(StoreUnavailableError):
                redis.contains([b"k"])
    finally:
        os.kill(private_server.proc.pid, signal.SIGCONT)
    assert stats.totals()["store_pauses"] == 1
    redis.close()
    tier = _open_store(UCMConfig.from_extra_config({"store": [f"disk://{tmp_path}/a", f"disk://{tmp_path}/b"]}))
    assert all(isinstance(t, PausingStore) for t in tier.stores)
    tier.close()
