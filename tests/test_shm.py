"""shm:// specific behaviour and faults, with real shared memory, real
server processes and real client processes.

Every test gets its own store NAME and runtime directory; the fixture stops
the server and checks that no /dev/shm file of that NAME is left behind.
"""

from __future__ import annotations

import enum
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from store_backends import OpenMode, StoreOpenError, StoreUnavailableError, open_store, which_store
from store_backends import shm_server
from store_backends.shm import keytable, uses
from store_backends.shm import (ServerStatus, ShmServerNotRunning, ShmStore, UnsafeRuntimeDir, check_runtime_dir,
                                list_servers, server_running, server_status, stop_server, valid_name)
from store_backends.process import pid_alive
from store_backends.shm.protocol import REQUEST, Alloc, Flag, Op, Status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def value_for(key: bytes, size: int, version: int = 0) -> bytes:
    """A value that can be checked from itself: 8 bytes of version, then a
    pattern derived from (key, version).  A torn read mixing two versions or
    two keys does not match."""
    seed = hashlib.blake2b(key + version.to_bytes(8, "little"), digest_size=32).digest()
    body = (seed * (size // 32 + 1))[: size - 8]
    return version.to_bytes(8, "little") + body


def check_value(key: bytes, value: bytes) -> bool:
    version = int.from_bytes(value[:8], "little")
    return value == value_for(key, len(value), version)


def server_processes(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"store_backends.shm_server" in argv and name.encode() in argv:
            pids.append(int(entry))
    return pids


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


class Env:
    def __init__(self) -> None:
        self.name = "t" + uuid.uuid4().hex[:12]
        # Short on purpose: a unix socket path must stay under ~100 bytes.
        self.rundir = tempfile.mkdtemp(prefix="ucmshm-", dir="/tmp")

    def url(self, **options: object) -> str:
        options.setdefault("runtime_dir", self.rundir)
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"shm://{self.name}?{query}"

    def leftovers(self) -> list[str]:
        return [n for n in os.listdir(shm_server.SEGMENT_DIR) if f".{self.name}." in n]

    def python(self, code: str, *args: str, wait: bool = True, timeout: float = 60):
        env = dict(os.environ, PYTHONPATH=ROOT)
        cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
        if not wait:
            return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr
        return done.stdout


@pytest.fixture
def shm():
    env = Env()
    try:
        yield env
    finally:
        shm_server.stop_server(env.name, env.rundir)
        stray = server_processes(env.name)
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
        leftovers = env.leftovers()
        for name in leftovers:
            os.unlink(os.path.join(shm_server.SEGMENT_DIR, name))
        shutil.rmtree(env.rundir, ignore_errors=True)
        assert not stray, f"servers still running after stop: {stray}"
        assert not leftovers, f"/dev/shm files left behind: {leftovers}"


# ---------------------------------------------------------------- capacity and LRU

def test_eviction_drops_least_recently_used_and_keeps_recently_read(shm):
    with open_store(shm.url(capacity="32KiB", chunk="4KiB")) as store:
        keys = [b"k%d" % i for i in range(8)]
        assert store.put(keys, [value_for(k, 4096) for k in keys]) == [True] * 8
        assert store.get([b"k0"]) == [value_for(b"k0", 4096)]  # k0 becomes the newest
        assert store.put([b"k8"], [value_for(b"k8", 4096)]) == [True]
        assert store.contains([b"k0", b"k1", b"k2", b"k8"]) == [True, False, True, True]
        stats = store.stats()
        assert stats.num_evictions == 1
        assert stats.num_blocks == 8


def test_contains_does_not_count_as_use(shm):
    with open_store(shm.url(capacity="16KiB", chunk="4KiB")) as store:
        keys = [b"a", b"b", b"c", b"d"]
        store.put(keys, [value_for(k, 4096) for k in keys])
        assert store.contains([b"a"]) == [True]
        store.put([b"e"], [value_for(b"e", 4096)])
        assert store.contains(keys + [b"e"]) == [False, True, True, True, True]


def test_capacity_is_never_exceeded(shm):
    rng = random.Random(7)
    capacity = 256 * 1024
    with open_store(shm.url(capacity=capacity, chunk="4KiB")) as store:
        written = {}
        for i in range(300):
            key = b"key-%d" % i
            written[key] = value_for(key, rng.randrange(1, 40_000))
            assert store.put([key], [written[key]]) == [True]
            stats = store.stats()
            assert stats.nbytes <= capacity
            assert stats.extra["used_chunks"] <= stats.extra["num_chunks"]
        assert os.path.getsize(stats.extra["data_path"]) == capacity
        values = store.get(list(written))
        assert any(v is None for v in values) and any(v is not None for v in values)
        assert all(v == written[k] for k, v in zip(written, values) if v is not None)
        assert stats.nbytes == sum(len(v) for v in values if v is not None)


def test_batch_larger_than_capacity_fails_only_what_does_not_fit(shm):
    with open_store(shm.url(capacity="64KiB", chunk="4KiB")) as store:
        keys = [b"k%02d" % i for i in range(20)]
        ok = store.put(keys, [value_for(k, 8192) for k in keys])
        assert ok == [True] * 8 + [False] * 12
        assert store.get(keys[:8]) == [value_for(k, 8192) for k in keys[:8]]
        assert store.stats().num_put_failures == 12


def test_get_into_copies_into_caller_buffer_and_rejects_wrong_size(shm):
    import numpy as np

    with open_store(shm.url(capacity="1MiB", chunk="4KiB")) as store:
        value = value_for(b"x", 10_000)
        store.put([b"x"], [value])
        exact = np.zeros(10_000, np.uint8)
        small, large = bytearray(9_999), bytearray(10_001)
        assert store.get_into([b"x", b"x", b"x", b"missing"], [exact, small, large, bytearray(1)]) == [
            True, False, False, False]
        assert exact.tobytes() == value


def test_put_of_stored_key_keeps_value_unless_overwrite(shm):
    with open_store(shm.url(capacity="1MiB")) as store:
        store.put([b"k"], [b"first"])
        assert store.put([b"k"], [b"second"]) == [True]
        assert store.get([b"k"]) == [b"first"]
    with open_store(shm.url(overwrite="true")) as store:
        assert store.put([b"k"], [b"third"]) == [True]
        assert store.get([b"k"]) == [b"third"]
        assert store.stats().nbytes == len(b"third")
        store.overwrite = False         # the attribute is the setting puts use
        assert store.put([b"k"], [b"fourth"]) == [True]
        assert store.get([b"k"]) == [b"third"]


def test_gets_from_published_locations_are_counted_and_used_by_the_server(shm):
    """Gets answered from the published locations send no request; the
    server still counts them (at the latest once this many are pending, and
    when the client closes) and keeps their keys recently used."""
    url = shm.url(capacity="32MiB", chunk="4KiB")
    many = [b"m%05d" % i for i in range(uses.TOUCH_FLUSH_KEYS + 10)]
    with open_store(url) as reader, open_store(url) as watcher:
        assert reader.put(many, [value_for(k, 10) for k in many]) == [True] * len(many)
        before = watcher.stats()
        assert reader.get(many[:3] + [b"absent"]) == [value_for(k, 10) for k in many[:3]] + [None]
        values = reader.get(many)
        assert values == [value_for(k, 10) for k in many]
        counted = watcher.stats()
        assert counted.num_gets - before.num_gets == len(many) + 4       # sent once this many were pending
        assert counted.num_hits - before.num_hits == len(many) + 3
        assert counted.num_misses - before.num_misses == 1
        assert reader.get(many[:2]) == [value_for(k, 10) for k in many[:2]]
        assert reader._uses.local_gets == len(many) + 6
    with open_store(url) as watcher:
        assert watcher.stats().num_gets - before.num_gets == len(many) + 6   # sent when the reader closed
        assert list(watcher.iter_keys(batch=len(many)))[0][-2:] == many[:2]  # the most recently used


def test_a_get_asks_the_server_only_for_values_the_locations_cannot_prove(shm):
    """A value split over two runs of chunks has no published location: a
    get of it with others asks the server for that one only, and every
    value comes back whole and in order."""
    with open_store(shm.url(capacity="16KiB", chunk="4KiB")) as store:
        four = [b"a", b"b", b"c", b"d"]
        assert store.put(four, [value_for(k, 4096) for k in four]) == [True] * 4
        store.delete([b"a", b"c"])
        assert store.put([b"split"], [value_for(b"split", 8192)]) == [True]    # chunks 0 and 2
        before = store.stats()
        keys = [b"b", b"split", b"absent", b"d"]
        want = [value_for(b"b", 4096), value_for(b"split", 8192), None, value_for(b"d", 4096)]
        assert store.get(keys) == want
        buffers = [bytearray(4096), bytearray(8192), bytearray(1), bytearray(4096)]
        assert store.get_into(keys, buffers) == [True, True, False, True]
        assert [bytes(b) for b in buffers[:2]] + [bytes(buffers[3])] == [want[0], want[1], want[3]]
        after = store.stats()
        assert after.extra["local_gets"] - before.extra["local_gets"] == 6      # all but "split", twice
        assert (after.num_gets - before.num_gets, after.num_hits - before.num_hits) == (8, 6)


def test_requests_and_replies_larger_than_the_socket_buffers_go_through_whole(shm):
    """100,000 keys of 40 bytes: the ALLOC request, the GET and its reply
    and the key listing are megabytes each, far above what a unix socket
    buffers, so both ends send and receive them in many parts."""
    keys = [b"big-%036d" % i for i in range(100_000)]
    with open_store(shm.url(capacity="1MiB")) as store:
        assert store.put(keys, [b""] * len(keys)) == [True] * len(keys)      # empty values take no chunk
        assert store.get(keys[::-1]) == [b""] * len(keys)
        listed = [k for batch in store.iter_keys(batch=30_000) for k in batch]
        assert sorted(listed) == keys
        store.delete(keys[::2])
        assert store.contains(keys[:4]) == [False, True, False, True]
        assert store.stats().num_blocks == len(keys) // 2


# ---------------------------------------------------------------- processes

def test_blocks_are_shared_across_processes_and_outlive_their_writer(shm):
    url = shm.url(capacity="4MiB")
    shm.python("""
        import sys
        from store_backends import open_store
        sys.path.insert(0, sys.argv[2])
        from test_shm import value_for
        store = open_store(sys.argv[1])
        keys = [b"blk%d" % i for i in range(10)]
        assert store.put(keys, [value_for(k, 100_000) for k in keys]) == [True] * 10
        store.close()
    """, url, os.path.dirname(__file__))
    (server_pid,) = server_processes(shm.name)
    with open_store(shm.url(server="connect")) as store:
        keys = [b"blk%d" % i for i in range(10)]
        assert store.get(keys) == [value_for(k, 100_000) for k in keys]
        assert store.stats().extra["server_pid"] == server_pid


def test_processes_racing_to_open_a_new_name_start_one_server(shm):
    start_at = time.time() + 1.5
    code = """
        import sys, time
        from store_backends import open_store
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        store = open_store(sys.argv[1])
        store.put([b"from-%s" % sys.argv[3].encode()], [b"v"])
        print(store.stats().extra["server_pid"])
        store.close()
    """
    procs = [shm.python(code, shm.url(capacity="1MiB"), str(start_at), str(i), wait=False) for i in range(5)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(int(out.strip()))
    assert len(set(outputs)) == 1
    assert server_processes(shm.name) == [outputs[0]]
    with open_store(shm.url()) as store:
        assert store.contains([b"from-%d" % i for i in range(5)]) == [True] * 5


WRITER_LOOP = """
    import sys, os
    from store_backends import open_store
    sys.path.insert(0, sys.argv[2])
    from test_shm import value_for
    store = open_store(sys.argv[1])
    print("ready", flush=True)
    i = 0
    while True:
        keys = [b"w%d" % (i + j) for j in range(4)]
        store.put(keys, [value_for(k, 512 * 1024) for k in keys])
        i += 4
"""


def test_writer_killed_mid_put_leaves_whole_values_and_frees_its_chunks(shm):
    url = shm.url(capacity="8MiB", chunk="64KiB")
    store = open_store(url)
    try:
        for round_ in range(3):
            writer = shm.python(WRITER_LOOP, url, os.path.dirname(__file__), wait=False)
            assert writer.stdout.readline().strip() == "ready"
            time.sleep(random.uniform(0.05, 0.4))
            writer.kill()
            writer.wait()
            keys = [b"w%d" % i for i in range(4000)]
            for key, value in zip(keys, store.get(keys)):
                assert value is None or value == value_for(key, 512 * 1024), key
            wait_for(lambda: store.stats().extra["leased_chunks"] == 0, 5, "the dead writer's lease to be reclaimed")
        # The whole capacity is usable again.
        keys = [b"fill%d" % i for i in range(16)]
        assert store.put(keys, [value_for(k, 512 * 1024) for k in keys]) == [True] * 16
        assert store.get(keys) == [value_for(k, 512 * 1024) for k in keys]
    finally:
        store.close()


def test_lease_of_a_killed_writer_is_reclaimed(shm):
    url = shm.url(capacity="1MiB", chunk="64KiB")
    # A writer that took chunks and dies before it commits them.
    writer = shm.python("""
        import sys, array, time
        from store_backends import open_store, shm_server as proto
        store = open_store(sys.argv[1])
        key_len, frames = proto.pack_keys([b"a", b"b"])
        sizes = array.array("q", [300_000, 300_000]).tobytes()
        store._request(proto.OP_ALLOC, [*frames, sizes], key_len=key_len, arg=store._pid)
        print("allocated", flush=True)
        time.sleep(600)
    """, url, wait=False)
    assert writer.stdout.readline().strip() == "allocated"
    with open_store(url) as store:
        assert store.stats().extra["leased_chunks"] == 10
        assert store.put([b"c"], [value_for(b"c", 600_000)]) == [False]  # leased chunks are not evictable
        writer.kill()
        writer.wait()
        wait_for(lambda: store.stats().extra["leased_chunks"] == 0, 5, "the lease to be reclaimed")
        assert store.contains([b"a", b"b"]) == [False, False]
        assert store.put([b"c"], [value_for(b"c", 1 << 20)]) == [True]
        assert store.stats().extra["leases_reclaimed"] == 1


def test_a_value_spread_over_several_runs_of_chunks_is_put_and_read_whole(shm):
    """With every other chunk free, a value of six chunks lands in six runs:
    put, get, get_into and get_into_parts all see its bytes in order."""
    with open_store(shm.url(capacity="64KiB", chunk="4KiB")) as store:
        keys = [b"k%d" % i for i in range(16)]
        assert store.put(keys, [bytes([i]) * 4096 for i in range(16)]) == [True] * 16
        store.delete(keys[0::2])
        value = bytes(range(256)) * 96
        assert store.put([b"big"], [value]) == [True]
        assert store.get([b"big"]) == [value]
        whole = bytearray(len(value))
        assert store.get_into([b"big"], [whole]) == [True] and bytes(whole) == value
        parts = [memoryview(bytearray(1000)), memoryview(bytearray(len(value) - 1000))]
        assert store.get_into_parts([b"big"], [parts]) == [True]
        assert b"".join(bytes(p) for p in parts) == value
        # put_parts: parts cut across the chunks' edges, into six runs again.
        store.delete([b"big"])
        cuts = [0, 64, 5000, 8192, 8193, len(value)]
        src = [memoryview(value)[lo:hi] for lo, hi in zip(cuts, cuts[1:])]
        assert store.put_parts([b"big2"], [src]) == [True]
        assert store.get([b"big2"]) == [value]


def test_a_value_reused_while_a_batch_is_read_into_parts_is_a_miss_and_never_called_back(shm):
    """Each value's generation is checked right after its copy: a value
    whose chunks are freed and reused between the batch's lookup and its
    copy (here by another client, while the caller checks the value
    before it) is a miss, and ``on_value`` never sees it."""
    url = shm.url(capacity="8KiB", chunk="4KiB")
    with open_store(url) as store, open_store(url) as other:
        store.put([b"a", b"b"], [value_for(b"a", 4096), value_for(b"b", 4096)])
        parts = [[memoryview(bytearray(64)), memoryview(bytearray(4096 - 64))] for _ in range(2)]
        called = []

        def on_value(i: int) -> None:
            called.append(i)
            if i == 0:
                other.delete([b"b"])
                assert other.put([b"c"], [value_for(b"c", 4096)]) == [True]

        assert store.get_into_parts([b"a", b"b"], parts, on_value) == [True, False]
        assert called == [0]
        assert b"".join(bytes(p) for p in parts[0]) == value_for(b"a", 4096)
        assert store.stats().extra["torn_reads"] == 1


def _check_every_value(store, keys, buffers) -> int:
    """Get ``keys`` both ways and check each value found: how many were found."""
    hits = 0
    for key, value in zip(keys, store.get(keys)):
        if value is not None:
            hits += 1
            assert check_value(key, value), key
    for key, buf, ok in zip(keys, buffers, store.get_into(keys, buffers)):
        if ok:
            hits += 1
            assert check_value(key, buf.tobytes()), key
    return hits


def test_reader_never_gets_a_wrong_value_while_values_are_overwritten_and_evicted(shm):
    import numpy as np

    size = 96 * 1024
    url = shm.url(capacity="1MiB", chunk="16KiB", overwrite="true")
    writer = shm.python("""
        import sys, time
        from store_backends import open_store
        sys.path.insert(0, sys.argv[2])
        from test_shm import value_for
        store = open_store(sys.argv[1])
        print("ready", flush=True)
        version = 1
        end = time.monotonic() + 30
        while time.monotonic() < end:
            keys = [b"r%d" % ((version + j) % 24) for j in range(3)]
            store.put(keys, [value_for(k, int(sys.argv[3]), version) for k in keys])
            version += 1
    """, url, os.path.dirname(__file__), str(size), wait=False)
    try:
        assert writer.stdout.readline().strip() == "ready"
        keys = [b"r%d" % i for i in range(24)]
        buffers = [np.empty(size, np.uint8) for _ in keys]
        hits = 0
        with open_store(url) as store:
            end = time.monotonic() + 4
            while time.monotonic() < end:
                hits += _check_every_value(store, keys, buffers)
            stats = store.stats()
        assert hits > 100
        assert stats.num_evictions > 0
        assert stats.extra["local_gets"] > 1000     # values found from the published locations, racing too
    finally:
        writer.kill()
        writer.wait()


def test_reader_never_gets_a_wrong_value_while_writers_put_into_reservations_delete_and_evict(shm):
    import numpy as np

    # Two processes of two writer threads each overwrite and delete 40 keys of
    # 3 chunks in a store of 128 chunks: freed chunks are reserved for next
    # puts, so most puts go into reservations while others evict around them.
    size = 48 * 1024
    url = shm.url(capacity="2MiB", chunk="16KiB", overwrite="true")
    code = """
        import random, sys, threading, time
        from store_backends import open_store
        sys.path.insert(0, sys.argv[2])
        from test_shm import value_for
        store = open_store(sys.argv[1])
        seed = int(sys.argv[4])
        print("ready", flush=True)

        def work(t):
            rng = random.Random(seed * 10 + t)
            version = (seed * 10 + t) * 1_000_000
            end = time.monotonic() + 5
            while time.monotonic() < end:
                version += 1
                keys = [b"w%02d" % k for k in rng.sample(range(40), 2)]
                if rng.random() < 0.1:
                    store.delete(keys[:1])
                store.put(keys, [value_for(k, int(sys.argv[3]), version) for k in keys])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print("reserved_puts", store.stats().extra["reserved_puts"], flush=True)
    """
    with open_store(url) as store:
        writers = [shm.python(code, url, os.path.dirname(__file__), str(size), str(seed), wait=False)
                   for seed in (1, 2)]
        try:
            for writer in writers:
                assert writer.stdout.readline().strip() == "ready"
            keys = [b"w%02d" % i for i in range(40)]
            buffers = [np.empty(size, np.uint8) for _ in keys]
            hits = 0
            deadline = time.monotonic() + 120
            while any(writer.poll() is None for writer in writers):
                assert time.monotonic() < deadline, "the writers did not finish"
                hits += _check_every_value(store, keys, buffers)
            outputs = [writer.communicate(timeout=30) for writer in writers]
        finally:
            for writer in writers:
                writer.kill()
                writer.wait()
        stats = store.stats()
    for writer, (out, err) in zip(writers, outputs):
        assert writer.returncode == 0, err
        assert int(out.split()[-1]) > 100, out      # the writers' puts went into reservations
    assert hits > 100
    assert stats.num_evictions > 0


# ---------------------------------------------------------------- server faults

def test_killed_server_raises_fast_and_embedded_client_restarts_it(shm):
    with open_store(shm.url(capacity="1MiB", timeout="10")) as store:
        store.put([b"k"], [value_for(b"k", 5000)])
        old = store.stats().extra
        os.kill(old["server_pid"], signal.SIGKILL)
        started = time.monotonic()
        # Until the process is gone a get may still be answered from its
        # published locations (its values are intact); after, never.
        wait_for(lambda: not pid_alive(old["server_pid"]), 2, "the killed server to be gone")
        with pytest.raises(StoreUnavailableError, match=shm.name):
            store.get([b"k"])
        assert time.monotonic() - started < 2.0
        # The next call starts a new server: the old contents are gone.
        assert store.get([b"k"]) == [None]
        new = store.stats().extra
        assert new["server_pid"] != old["server_pid"] and new["epoch"] != old["epoch"]
        assert store.put([b"k2"], [value_for(b"k2", 70_000)]) == [True]
        assert store.get([b"k2", b"k"]) == [value_for(b"k2", 70_000), None]
        # The dead server's segments were removed by its successor.
        assert sorted(shm.leftovers()) == sorted(os.path.basename(shm_server.Paths(shm.name).segment(
            new["epoch"], kind)) for kind in ("data", "gen", "keys", "where")
            if kind in ("data", "gen") or keytable.supported())


def test_client_of_a_restarted_server_remaps_and_never_reads_old_chunks(shm):
    url = shm.url(capacity="1MiB", chunk="4KiB")
    with open_store(url) as reader:
        reader.put([b"k"], [value_for(b"k", 4096, 1)])
        shm_server.stop_server(shm.name, shm.rundir)
        # Another process starts a new server and stores a different value.
        shm.python("""
            import sys
            from store_backends import open_store
            store = open_store(sys.argv[1])
            assert store.put([b"k"], [b"n" * 4096]) == [True]
        """, url)
        for _ in range(2):
            try:
                got = reader.get([b"k"])
                break
            except StoreUnavailableError:
                continue
        assert got == [b"n" * 4096]


def test_server_killed_mid_put_makes_put_return_false(shm):
    with open_store(shm.url(capacity="1MiB")) as store:
        pid = store.stats().extra["server_pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not shm_server.server_running(shm_server.Paths(shm.name, shm.rundir)), 5, "server exit")
        assert store.put([b"k"], [b"v"]) == [False]
        assert store.put([b"k"], [b"v"]) == [True]


def test_connect_mode_does_not_restart_a_dead_server(shm):
    with open_store(shm.url(capacity="1MiB")) as owner:
        with open_store(shm.url(server="connect")) as store:
            assert owner.shutdown_server()
            with pytest.raises(StoreUnavailableError, match="server=connect"):
                store.contains([b"k"])
            assert server_processes(shm.name) == []


def test_close_is_idempotent_and_leaves_the_server_running(shm):
    store = open_store(shm.url(capacity="1MiB"))
    store.put([b"k"], [b"v"])
    store.close()
    store.close()
    with open_store(shm.url(server="connect")) as again:
        assert again.get([b"k"]) == [b"v"]


def test_idle_timeout_stops_the_server_and_removes_its_files(shm):
    store = open_store(shm.url(capacity="1MiB", idle_timeout="1"))
    store.close()
    wait_for(lambda: not server_processes(shm.name), 10, "the idle server to exit")
    assert shm.leftovers() == []


def test_operator_commands_status_and_stop(shm):
    with open_store(shm.url(capacity="1MiB")) as store:
        store.put([b"k"], [b"v" * 10])
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "store_backends.shm_server"]
    status = subprocess.run(cmd + ["status", shm.name, "--runtime-dir", shm.rundir],
                            capture_output=True, text=True, env=env, timeout=30)
    assert status.returncode == 0 and '"num_blocks": 1' in status.stdout
    stop = subprocess.run(cmd + ["stop", shm.name, "--runtime-dir", shm.rundir],
                          capture_output=True, text=True, env=env, timeout=30)
    assert stop.returncode == 0
    assert server_processes(shm.name) == [] and shm.leftovers() == []
    status = subprocess.run(cmd + ["status", shm.name, "--runtime-dir", shm.rundir],
                            capture_output=True, text=True, env=env, timeout=30)
    assert status.returncode == 1


# ---------------------------------------------------------------- inspection and the admin API

def test_inspecting_a_name_with_no_server_raises_the_typed_error_and_starts_none(shm):
    for url, starts_one in ((shm.url(capacity="1MiB"), True), (shm.url(server="connect"), False)):
        with pytest.raises(ShmServerNotRunning) as err:
            open_store(url, OpenMode.INSPECT)
        assert isinstance(err.value, StoreOpenError)
        assert (err.value.name, err.value.runtime_dir, err.value.starts_one) == (shm.name, shm.rundir, starts_one)
        assert "no shm server is running" in str(err.value)
    assert server_processes(shm.name) == []
    assert os.listdir(shm.rundir) == [] and shm.leftovers() == []
    assert not server_running(shm.name, shm.rundir)


def test_connect_mode_without_a_server_raises_the_typed_error(shm):
    with pytest.raises(ShmServerNotRunning) as err:
        open_store(shm.url(server="connect"))
    assert err.value.name == shm.name and not err.value.starts_one


def test_which_store_sees_an_shm_store_only_while_its_server_runs_and_starts_none(shm):
    url = shm.url(capacity="1MiB")
    assert which_store(url) is None
    assert server_processes(shm.name) == [] and os.listdir(shm.rundir) == []
    with open_store(url) as store:
        assert store.stats().kind == "shm"
        assert which_store(url) == "shm"


def test_an_inspecting_client_does_not_restart_a_server_that_died(shm):
    with open_store(shm.url(capacity="1MiB")) as owner:
        owner.put([b"k"], [b"v"])
        with open_store(shm.url(capacity="1MiB"), OpenMode.INSPECT) as store:
            assert store.get([b"k"]) == [b"v"]
            assert owner.shutdown_server()
            for _ in range(2):   # noticing the death, then the reconnect
                with pytest.raises(StoreUnavailableError, match="server is not running|no shm server is running"):
                    store.contains([b"k"])
            assert server_processes(shm.name) == [] and not server_running(shm.name, shm.rundir)


def test_admin_api_lists_reports_and_stops_a_real_server(shm):
    assert list_servers(shm.rundir) == []
    absent = server_status(shm.name, shm.rundir)
    assert (absent.running, absent.answering, absent.num_blocks) == (False, False, None)
    with open_store(shm.url(capacity="1MiB", chunk="64KiB")) as store:
        keys = [b"a", b"b", b"c"]
        assert store.put(keys, [value_for(k, 100_000) for k in keys]) == [True] * 3
        server_pid = store.stats().extra["server_pid"]
    assert list_servers(shm.rundir) == [shm.name]
    assert server_running(shm.name, shm.rundir)
    status = server_status(shm.name, shm.rundir)
    assert isinstance(status, ServerStatus)
    assert (status.name, status.runtime_dir, status.running, status.answering) == (shm.name, shm.rundir, True, True)
    assert status.pid == server_pid and server_processes(shm.name) == [server_pid]
    assert (status.num_blocks, status.nbytes, status.puts) == (3, 300_000, 3)
    assert (status.capacity_nbytes, status.chunk_nbytes) == (1 << 20, 64 * 1024)
    assert status.used_nbytes == 3 * 2 * 64 * 1024      # 100 kB values take two chunks each
    assert status.log_path.startswith(shm.rundir) and status.pid_path.startswith(shm.rundir)
    assert stop_server(shm.name, shm.rundir)
    assert list_servers(shm.rundir) == [] and not server_running(shm.name, shm.rundir)
    assert server_processes(shm.name) == [] and shm.leftovers() == []
    assert not stop_server(shm.name, shm.rundir)


def test_admin_api_refuses_names_that_are_not_shm_names(shm):
    for bad in ("../etc", "a/b", "", ".."):
        assert not valid_name(bad)
        with pytest.raises(ValueError, match="not an shm store name"):
            server_status(bad, shm.rundir)
    assert valid_name("-cache") and valid_name(shm.name)


def test_check_runtime_dir_refuses_one_others_can_write_in(shm):
    assert check_runtime_dir(shm.rundir) == shm.rundir
    os.chmod(shm.rundir, 0o777)
    with pytest.raises(UnsafeRuntimeDir, match="mode 0777"):
        check_runtime_dir(shm.rundir)


def test_op_codes_are_an_int_enum_with_the_numbers_on_the_wire():
    # The numbers are the protocol: a running server of an older build
    # answers clients of a newer one, so they never change.
    assert issubclass(Op, enum.IntEnum)
    assert {op.name: op.value for op in Op} == {
        "HELLO": 1, "CONTAINS": 2, "PREFIX": 3, "GET": 4, "ALLOC": 5, "COMMIT": 6, "ABORT": 7, "DELETE": 8,
        "STATS": 9, "CLEAR": 10, "SHUTDOWN": 11, "KEYS": 12, "TOUCH": 13, "DECLARE": 14}
    assert {flag.name: flag.value for flag in Flag} == {"OVERWRITE": 1, "NO_TOUCH": 2, "TOUCHED": 4, "RESERVE": 8,
                                                     "RELEASE": 16}
    assert issubclass(Status, enum.IntEnum) and issubclass(Alloc, enum.IntEnum)
    assert issubclass(Flag, enum.IntFlag)
    assert REQUEST.unpack(REQUEST.pack(Op.GET, Flag.NO_TOUCH, 0, 1, 0, 0))[:2] == (Op.GET, Flag.NO_TOUCH)
    assert Op(REQUEST.unpack(REQUEST.pack(Op.KEYS, 0, 0, 1, 0, 0))[0]) is Op.KEYS


# ---------------------------------------------------------------- bad URLs

@pytest.mark.parametrize("url", ["shm://bad%2Fname", "shm://a b", "shm://", "shm://x/y", "shm://.."])
def test_bad_name_is_an_open_error_naming_the_url(url):
    with pytest.raises(StoreOpenError) as err:
        open_store(url)
    assert url in str(err.value)


def test_unknown_option_is_an_open_error_naming_it(shm):
    with pytest.raises(StoreOpenError, match="colour"):
        open_store(shm.url(colour="blue"))


def test_connect_mode_without_a_server_is_an_open_error_naming_the_url(shm):
    url = shm.url(server="connect")
    with pytest.raises(StoreOpenError) as err:
        open_store(url)
    assert url in str(err.value) and "no shm server is running" in str(err.value)
    assert server_processes(shm.name) == []


def test_shm_store_class_opens_by_url(shm):
    store = ShmStore.from_url(shm.url(capacity="1MiB"))
    try:
        assert store.stats().capacity_nbytes == 1 << 20
    finally:
        assert store.shutdown_server()


# ---------------------------------------------------------------- client details

def test_keys_of_mixed_lengths_and_empty_values_round_trip(shm):
    import numpy as np

    with open_store(shm.url(capacity="1MiB", chunk="4KiB")) as store:
        keys = [b"a", b"bb" * 40, b"\x00\x00", b"\x00", b"ccc"]
        values = [b"", value_for(b"bb", 9000), np.arange(100, dtype=np.uint16), memoryview(b"zz"), b"\x00" * 4096]
        assert store.put(keys, values) == [True] * 5
        assert store.get(keys) == [b"", value_for(b"bb", 9000), np.arange(100, dtype=np.uint16).tobytes(),
                                   b"zz", b"\x00" * 4096]
        assert store.contains([b"\x00", b"\x00\x00", b"\x00\x00\x00"]) == [True, True, False]
        assert store.prefix_len(keys + [b"nope"] + keys) == 5


def test_threads_share_one_client(shm):
    import threading

    errors = []
    with open_store(shm.url(capacity="4MiB", chunk="4KiB")) as store:
        def work(t: int) -> None:
            try:
                for i in range(40):
                    keys = [b"t%d-%d-%d" % (t, i, j) for j in range(4)]
                    values = [value_for(k, 6000 + 100 * t) for k in keys]
                    assert store.put(keys, values) == [True] * 4
                    got = store.get(keys)
                    assert all(g is None or g == v for g, v in zip(got, values))
                    assert store.prefix_len(keys) <= 4
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert store.stats().num_put_failures == 0


# ---------------------------------------------------------------- trust: the runtime directory

def test_runtime_dir_of_another_user_is_refused_even_for_root(shm):
    os.chown(shm.rundir, 65534, 65534)
    with pytest.raises(StoreOpenError) as err:
        open_store(shm.url(capacity="1MiB"))
    message = str(err.value)
    assert shm.rundir in message and "uid 65534" in message and "UCM_SHM_RUNTIME_DIR" in message
    assert server_processes(shm.name) == [] and os.listdir(shm.rundir) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_runtime_dir_writable_by_group_or_others_is_refused(shm, mode):
    os.chmod(shm.rundir, mode)
    with pytest.raises(StoreOpenError) as err:
        open_store(shm.url(capacity="1MiB"))
    message = str(err.value)
    assert shm.rundir in message and f"mode {mode:04o}" in message and f"chmod 700 {shm.rundir}" in message
    assert server_processes(shm.name) == [] and os.listdir(shm.rundir) == []


def test_runtime_dir_reached_through_a_symlink_of_another_user_is_refused(shm):
    # The link sits in a private directory of its own: the kernel's
    # protected_symlinks would otherwise stop root from following it in /tmp.
    link = os.path.join(shm.rundir, "link")
    target = os.path.join(shm.rundir, "target")
    os.mkdir(target, 0o700)
    os.symlink(target, link)
    os.lchown(link, 65534, 65534)
    with pytest.raises(StoreOpenError) as err:
        open_store(f"shm://{shm.name}?capacity=1MiB&runtime_dir={link}")
    assert link in str(err.value) and "uid 65534" in str(err.value)
    assert os.listdir(target) == []


def test_missing_runtime_dir_is_created_private_and_used(shm):
    rundir = os.path.join(shm.rundir, "new")
    with open_store(f"shm://{shm.name}?capacity=1MiB&runtime_dir={rundir}") as store:
        assert store.put([b"k"], [b"v"]) == [True]
        info = os.stat(rundir)
        assert (info.st_uid, info.st_mode & 0o7777) == (os.geteuid(), 0o700)
        assert shm_server.stop_server(shm.name, rundir)


def test_server_refuses_to_serve_in_a_runtime_dir_writable_by_others(shm):
    os.chmod(shm.rundir, 0o777)
    env = dict(os.environ, PYTHONPATH=ROOT)
    serve = subprocess.run([sys.executable, "-m", "store_backends.shm_server", "serve", shm.name, "--capacity",
                            "1MiB", "--runtime-dir", shm.rundir, "--detach"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert serve.returncode == 1 and "mode 0777" in serve.stderr
    assert server_processes(shm.name) == [] and os.listdir(shm.rundir) == []


# ---------------------------------------------------------------- trust: what the server says

# A server that answers every request the way a hostile or broken one could:
# its HELLO names DATA_PATH and GEN_PATH as the segments, and its ALLOC hands
# out chunk 0 for every key.
FAKE_SERVER = """
    import fcntl, json, os, socket, sys, array, time
    from store_backends import shm_server as proto
    from store_backends.shm import transport

    rundir, name, data_path, gen_path = sys.argv[1:5]
    paths = proto.Paths(name, rundir)
    lock = os.open(paths.pid_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(paths.socket)
    listener.listen(8)
    info = {"protocol": proto.PROTOCOL_VERSION, "name": name, "epoch": 7, "pid": os.getpid(),
            "chunk_nbytes": 4096, "num_chunks": 4, "data_path": data_path, "gen_path": gen_path,
            "num_blocks": 0, "nbytes": 0, "capacity_nbytes": 16384}
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.setblocking(False)
        while True:
            try:
                header, *frames = transport.receive(conn, time.monotonic() + 3600, lambda: True)
            except transport.PeerGone:
                break
            op, flags, key_len, rid, epoch, arg = proto.REQUEST.unpack(header)
            out = []
            if op in (proto.OP_HELLO, proto.OP_STATS):
                out = [json.dumps(info).encode()]
            elif op == proto.OP_ALLOC:
                keys, _ = proto.unpack_keys(key_len, frames)
                out = [(1).to_bytes(8, "little"), bytes(len(keys)), array.array("I", [1] * len(keys)).tobytes(),
                       array.array("i", [0, 1] * len(keys)).tobytes()]
            transport.send(conn, [proto.REPLY.pack(proto.ST_OK, rid, 7), *out], time.monotonic() + 5, lambda: True)
"""


OLD_SERVER = """
    import fcntl, os, socket, sys, time
    from store_backends import shm_server as proto

    rundir, name = sys.argv[1:3]
    paths = proto.Paths(name, rundir)
    lock = os.open(paths.pid_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(lock, b"%d\\n" % os.getpid())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(paths.socket)
    listener.listen(8)
    print("ready", flush=True)
    held = []
    while True:
        conn, _ = listener.accept()
        conn.sendall(b"\\xff" + bytes(8) + b"\\x7f")     # a ZeroMQ (ZMTP) greeting, and nothing else
        held.append(conn)
"""


def test_a_server_of_the_older_zeromq_protocol_is_named_and_can_be_stopped(shm):
    """Servers outlive the engines that started them, so one of the
    version before this transport may still run after an upgrade: a client
    says so and how to stop it, and stopping it works."""
    proc = shm.python(OLD_SERVER, shm.rundir, shm.name, wait=False)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        started = time.monotonic()
        with pytest.raises(StoreOpenError, match=r"older version that speaks ZeroMQ.*ucm shm stop"):
            open_store(shm.url(timeout="5"))
        assert time.monotonic() - started < 3
        assert stop_server(shm.name, shm.rundir, timeout_s=5)
        assert proc.wait(5) != 0 and not server_running(shm.name, shm.rundir)
    finally:
        proc.kill()
        proc.wait()
    with open_store(shm.url(capacity="1MiB")) as store:     # and a current one starts in its place
        assert store.put([b"k"], [b"v"]) == [True] and store.get([b"k"]) == [b"v"]


@pytest.fixture
def fake_server(shm):
    started = []

    def start(data_path: str, gen_path: str):
        proc = shm.python(FAKE_SERVER, shm.rundir, shm.name, data_path, gen_path, wait=False)
        started.append(proc)
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _put_through(url: str) -> str | None:
    """Open ``url`` and put one value; the open's error, or None."""
    try:
        store = open_store(url)
    except StoreOpenError as exc:
        return str(exc)
    try:
        store.put([b"k"], [b"overwritten!" * 300])
    finally:
        store.close()
    return None


def test_segment_path_outside_the_protocol_is_refused_and_nothing_is_written(shm, fake_server, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 2048)
    gen = tmp_path / "gen"
    gen.write_bytes(bytes(32))
    fake_server(str(victim), str(gen))
    error = _put_through(shm.url(server="connect", timeout=2))
    assert victim.read_bytes() == b"precious" * 2048
    assert error is not None and str(victim) in error and "/dev/shm/ucm-shm." in error


def test_segment_path_that_is_a_planted_symlink_is_refused_and_nothing_is_written(shm, fake_server, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 2048)
    paths = shm_server.Paths(shm.name, shm.rundir)
    data_path, gen_path = paths.segment(7, "data"), paths.segment(7, "gen")
    os.symlink(victim, data_path)
    try:
        with open(gen_path, "wb") as f:
            f.write(bytes(32))
        fake_server(data_path, gen_path)
        error = _put_through(shm.url(server="connect", timeout=2))
    finally:
        for path in (data_path, gen_path):
            os.unlink(path)
    assert victim.read_bytes() == b"precious" * 2048
    assert error is not None and data_path in error


def test_segment_smaller_than_the_server_says_is_refused(shm, fake_server):
    # mmap would refuse it with a bare ValueError out of open_store.
    paths = shm_server.Paths(shm.name, shm.rundir)
    data_path, gen_path = paths.segment(7, "data"), paths.segment(7, "gen")
    try:
        for path, nbytes in ((data_path, 4096), (gen_path, 32)):
            with open(path, "wb") as f:
                f.write(bytes(nbytes))
        fake_server(data_path, gen_path)
        error = _put_through(shm.url(server="connect", timeout=2))
    finally:
        for path in (data_path, gen_path):
            os.unlink(path)
    assert error is not None and data_path in error and "holds 4096 bytes" in error


# ---------------------------------------------------------------- timeouts

def test_each_operation_on_a_stopped_server_gives_up_within_its_timeout(shm):
    with open_store(shm.url(capacity="1MiB", timeout="2")) as store:
        assert store.put([b"k"], [b"v"]) == [True]
        pid = store.stats().extra["server_pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert store.put([b"k2"], [b"v"]) == [False]
            took = {"put": time.monotonic() - started}
            for op, call in (("contains", lambda: store.contains([b"k"])), ("stats", store.stats),
                             ("get", lambda: store.get([b"k"])), ("put again", lambda: store.put([b"k3"], [b"v"]))):
                started = time.monotonic()
                try:
                    result = call()
                except StoreUnavailableError:
                    result = None
                took[op] = time.monotonic() - started
                assert result in (None, [False]), op
            assert all(t < 2.0 + 0.7 for t in took.values()), took
        finally:
            os.kill(pid, signal.SIGCONT)
        # Once the server runs again, so does the store (no restart: same pid).
        assert store.put([b"k4"], [b"v"]) == [True]
        assert store.get([b"k", b"k4"]) == [b"v", b"v"]
        assert store.stats().extra["server_pid"] == pid


def test_a_stopped_server_with_a_full_accept_queue_costs_a_timeout_not_a_hang(shm):
    """Every request that timed out leaves a connection in a stopped
    server's accept queue; once the queue is full, connecting must fail
    within the timeout too, not block the caller until the server runs."""
    import socket

    with open_store(shm.url(capacity="1MiB", timeout="1")) as store:
        assert store.put([b"k"], [b"v"]) == [True]
        pid = store.stats().extra["server_pid"]
        os.kill(pid, signal.SIGSTOP)
        queued = []
        try:
            while True:         # fill the accept queue
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect(store.paths.socket)
                except BlockingIOError:
                    sock.close()
                    break
                queued.append(sock)
                assert len(queued) < 100_000
            started = time.monotonic()
            assert store.put([b"k2"], [b"v"]) == [False]
            with pytest.raises(StoreUnavailableError, match="did not answer|does not answer"):
                store.stats()
            status = server_status(shm.name, shm.rundir, timeout_s=0.5)    # operators' tools too
            assert status.running and not status.answering
            assert time.monotonic() - started < 2 * (1 + 0.7) + 0.7
        finally:
            for sock in queued:
                sock.close()
            os.kill(pid, signal.SIGCONT)
        assert store.get([b"k"]) == [b"v"]


def test_threads_waiting_on_another_threads_reconnect_give_up_within_their_timeout(shm):
    import threading

    with open_store(shm.url(capacity="1MiB", timeout="1.5")) as store:
        assert store.put([b"k"], [b"v"]) == [True]
        pid = store.stats().extra["server_pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            assert store.put([b"k2"], [b"v"]) == [False]  # the store now has to reconnect
            took = {}

            def get(i: int) -> None:
                started = time.monotonic()
                try:
                    store.get([b"k"])
                except StoreUnavailableError:
                    pass
                took[i] = time.monotonic() - started

            # Staggered, so that the later ones start while the first one is
            # reconnecting.
            threads = [threading.Thread(target=get, args=(i,)) for i in range(3)]
            for thread in threads:
                thread.start()
                time.sleep(0.3)
            for thread in threads:
                thread.join(30)
            assert len(took) == 3 and all(t < 1.5 + 0.6 for t in took.values()), took
        finally:
            os.kill(pid, signal.SIGCONT)
        assert store.get([b"k"]) == [b"v"]


def test_opening_a_store_whose_server_is_stopped_gives_up_within_its_timeout(shm):
    with open_store(shm.url(capacity="1MiB")) as store:
        pid = store.stats().extra["server_pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StoreOpenError, match="does not answer"):
            open_store(shm.url(timeout="2"))
        assert time.monotonic() - started < 2.0 + 0.7
    finally:
        os.kill(pid, signal.SIGCONT)


def test_an_operation_waiting_on_another_process_starting_the_server_gives_up_within_its_timeout(shm):
    import fcntl

    with open_store(shm.url(capacity="1MiB", timeout="1")) as store:
        assert shm_server.stop_server(shm.name, shm.rundir)
        assert store.put([b"k"], [b"v"]) == [False]  # notices the server is gone
        # Another process is starting a server and is slow about it.
        lock = os.open(shm_server.Paths(shm.name, shm.rundir).start_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="another process is starting"):
                store.contains([b"k"])
            assert time.monotonic() - started < 1.0 + 0.7
        finally:
            os.close(lock)
        # Then the store starts its server again (each try within its 1 s;
        # a loaded machine may need more than one).
        deadline = time.monotonic() + 20
        while store.put([b"k"], [b"v"]) != [True]:
            assert time.monotonic() < deadline, "the store never started its server again"
            time.sleep(0.2)


def test_stopping_a_server_that_does_not_answer_gives_up_within_its_timeout(shm):
    with open_store(shm.url(capacity="1MiB")) as store:
        pid = store.stats().extra["server_pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not exit within 1s"):
            shm_server.stop_server(shm.name, shm.rundir, timeout_s=1)
        assert time.monotonic() - started < 1.0 + 0.5
    finally:
        os.kill(pid, signal.SIGCONT)


# ---------------------------------------------------------------- names that start with '-'

def test_a_name_starting_with_a_dash_works_end_to_end(shm):
    shm.name = "-" + shm.name
    with open_store(shm.url(capacity="1MiB")) as store:
        assert store.put([b"k"], [b"v"]) == [True]
    with open_store(shm.url(server="connect")) as store:
        assert store.get([b"k"]) == [b"v"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "store_backends.shm_server"]
    status = subprocess.run(cmd + ["status", "--runtime-dir", shm.rundir, "--", shm.name],
                            capture_output=True, text=True, env=env, timeout=30)
    assert status.returncode == 0 and '"num_blocks": 1' in status.stdout
    stop = subprocess.run(cmd + ["stop", "--runtime-dir", shm.rundir, "--", shm.name],
                          capture_output=True, text=True, env=env, timeout=30)
    assert stop.returncode == 0 and server_processes(shm.name) == [] and shm.leftovers() == []


def test_a_commit_reaching_a_restarted_server_never_commits_another_writers_lease(shm):
    """A put whose server is replaced between its ALLOC and its COMMIT (the
    store reconnected meanwhile, on another thread) must fail, and must not
    commit the new server's lease of the same number: that is another
    writer's, whose chunks hold nothing yet."""
    import threading
    url = shm.url(capacity="4MiB", chunk="4KiB", timeout="10")
    a = open_store(url)
    b = open_store(url)
    b_copying = threading.Event()
    b_may_go = threading.Event()
    b_result = []

    def b_put():
        def wait(_i):
            b_copying.set()
            assert b_may_go.wait(30)
        for _attempt in range(3):       # the first put finds the old server gone
            result = b.put_parts([b"b-key"], [[value_for(b"b-key", 8192)]], before_value=wait)
            if result == [True] or b_copying.is_set():
                break
        b_result.append(result)

    def restart_meanwhile(_i):
        assert shm_server.stop_server(shm.name, shm.rundir)
        thread = threading.Thread(target=b_put)
        thread.start()
        assert b_copying.wait(30)       # b holds the new server's first lease, as a held the old one's
        # A get on another thread finds the new server and remaps.
        reconnect = threading.Thread(target=lambda: [_try(a.get, [b"x"]) for _ in range(2)])
        reconnect.start()
        reconnect.join()
        restart_meanwhile.thread = thread

    try:
        assert a.put_parts([b"a-key"], [[value_for(b"a-key", 8192)]], before_value=restart_meanwhile) == [False]
        other = open_store(url)
        assert other.contains([b"b-key", b"a-key"]) == [False, False]
        b_may_go.set()
        restart_meanwhile.thread.join(30)
        assert b_result == [[True]]
        assert other.get([b"b-key"]) == [value_for(b"b-key", 8192)]
    finally:
        b_may_go.set()
        for store in (a, b):
            store.close()
        if "other" in locals():
            other.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except StoreUnavailableError:
        return None


# ---------------------------------------------------------------- puts in one request

def _reservations(store) -> dict:
    extra = store.stats().extra
    return {k: extra.get(k, 0) for k in ("reserved_puts", "reserved_chunks", "reservations", "reservations_refused",
                                         "leased_chunks")}


def test_back_to_back_puts_copy_into_chunks_reserved_by_the_previous_one(shm):
    """Each put reserves chunks for a next one like it (from free chunks);
    a put that fits uses them in one request, smaller ones hand back what
    they leave, a larger one gives the reservation back with its ALLOC, and
    closing gives back the last."""
    url = shm.url(capacity="4MiB", chunk="4KiB")
    with open_store(url) as store:
        batches = [[b"r%d-%d" % (r, i) for i in range(8)] for r in range(4)]
        for keys in batches:
            assert store.put(keys, [value_for(k, 10_000) for k in keys]) == [True] * 8
        got = _reservations(store)
        # 3 chunks per value, 8 values: one reservation held, three used.
        assert got["reserved_puts"] == 3 and got["reserved_chunks"] == got["leased_chunks"] == 24
        smaller = [b"s%d" % i for i in range(3)]
        assert store.put(smaller, [value_for(k, 5000) for k in smaller]) == [True] * 3
        assert _reservations(store)["reserved_chunks"] == 6       # the next one is like this put
        larger = [b"l%d" % i for i in range(5)]
        assert store.put(larger, [value_for(k, 5000) for k in larger]) == [True] * 5
        got = _reservations(store)
        assert got["reserved_puts"] == 4 and got["reserved_chunks"] == got["leased_chunks"] == 10
        # An empty value and values that fill their chunks exactly.
        odd = [b"e", b"x", b"y"]
        assert store.put(odd, [b"", value_for(b"x", 8192), value_for(b"y", 4096)]) == [True] * 3
        everything = [k for keys in batches for k in keys] + smaller + larger + odd
        want = ([value_for(k, 10_000) for keys in batches for k in keys] + [value_for(k, 5000) for k in smaller]
                + [value_for(k, 5000) for k in larger] + [b"", value_for(b"x", 8192), value_for(b"y", 4096)])
        assert store.get(everything) == want
        stats = store.stats()
        assert stats.num_blocks == len(everything) and stats.nbytes == sum(map(len, want))
        # No chunks are reserved for an empty value; this put's reservation is given back at close.
        assert _reservations(store)["reserved_chunks"] == 0
        assert store.put([b"last"], [value_for(b"last", 4096)]) == [True]
        assert _reservations(store)["reserved_chunks"] == 1
    with open_store(url) as store:
        got = _reservations(store)
        assert got["reserved_chunks"] == got["leased_chunks"] == 0
        assert store.stats().extra["used_chunks"] == 32 * 3 + 8 * 2 + 2 + 1 + 1


def test_a_reservation_never_evicts_and_a_full_store_is_put_to_in_two_requests(shm):
    with open_store(shm.url(capacity="1MiB", chunk="4KiB")) as store:
        keys = [b"k%03d" % i for i in range(64)]
        for i in range(0, 64, 4):   # 16 KiB per put: the last ones find no free chunks to reserve
            assert store.put(keys[i:i + 4], [value_for(k, 16_384) for k in keys[i:i + 4]]) == [True] * 4
        got = _reservations(store)
        assert got["reservations_refused"] >= 1 and got["reserved_chunks"] == 0
        assert store.stats().num_evictions == 0
        assert store.get(keys) == [value_for(k, 16_384) for k in keys]


def test_a_reservation_past_its_use_window_is_given_back_not_used(shm):
    # A lease timeout of 3 s: reservations may be used for half of it.
    with open_store(shm.url(capacity="4MiB", chunk="4KiB", lease_timeout="3")) as store:
        assert store.put([b"a"], [value_for(b"a", 8000)]) == [True]
        assert _reservations(store)["reserved_chunks"] == 2
        time.sleep(1.6)
        assert store.put([b"b"], [value_for(b"b", 8000)]) == [True]
        got = _reservations(store)
        assert got["reserved_puts"] == 0 and got["reserved_chunks"] == got["leased_chunks"] == 2
        assert store.get([b"a", b"b"]) == [value_for(b"a", 8000), value_for(b"b", 8000)]


def test_the_reservation_of_a_killed_writer_is_reclaimed(shm):
    url = shm.url(capacity="4MiB", chunk="4KiB")
    writer = shm.python("""
        import sys, time
        from store_backends import open_store
        store = open_store(sys.argv[1])
        assert store.put([b"w"], [b"v" * 40_000]) == [True]
        print("reserved", flush=True)
        time.sleep(600)
    """, url, wait=False)
    assert writer.stdout.readline().strip() == "reserved"
    with open_store(url) as store:
        assert _reservations(store)["reserved_chunks"] == 10
        writer.kill()
        writer.wait()
        wait_for(lambda: _reservations(store)["leased_chunks"] == 0, 5, "the reservation to be reclaimed")
        assert _reservations(store)["reserved_chunks"] == 0
        assert store.get([b"w"]) == [b"v" * 40_000]


def test_a_put_that_does_not_fit_its_reservation_is_refused_and_frees_it():
    """DECLARE is not answered: one that does not fit leaves the reservation
    as it was, and the COMMIT that follows finds nothing to commit and
    frees it."""
    import array
    import numpy as np
    from store_backends.shm.index import ChunkIndex
    from store_backends.shm.protocol import RESERVATION, pack_keys
    index = ChunkIndex(64, 4096, lease_timeout_s=60)
    index.gen = np.zeros(64, np.uint64)
    assert index.op_commit(Flag.RESERVE, 0, 0, [array.array("q", [5000]).tobytes()]) == (Status.LEASE_GONE, [])
    (lease_id,) = RESERVATION.unpack(index._reserve(os.getpid(), array.array("q", [5000]).tobytes())[0])
    assert index.reserved_chunks == 2 and index.free_chunks == 62
    key_len, frames = pack_keys([b"k"])
    with pytest.raises(ValueError, match="does not fit"):
        index.op_declare(0, key_len, lease_id, [*frames, array.array("q", [9000]).tobytes()])
    assert index.reserved_chunks == index.leased_chunks == 2
    assert index.op_commit(0, 0, lease_id, []) == (Status.LEASE_GONE, [])
    assert index.reserved_chunks == index.leased_chunks == 0 and index.free_chunks == 64
    assert not index.index
    # One that fits: the chunk the value does not need is free at once.
    (lease_id,) = RESERVATION.unpack(index._reserve(os.getpid(), array.array("q", [5000]).tobytes())[0])
    assert index.op_declare(0, key_len, lease_id, [*frames, array.array("q", [10]).tobytes()]) is None
    assert index.reserved_chunks == 0 and index.leased_chunks == 1 and index.free_chunks == 63
    assert index.op_commit(0, 0, lease_id, [])[0] == Status.OK
    assert list(index.index) == [b"k"] and index.index[b"k"].size == 10 and index.leased_chunks == 0


def test_values_named_before_their_copy_stay_invisible_until_committed(shm):
    """A put into a reservation names its keys before copying (DECLARE) and
    its location records are written then: until its COMMIT no other
    client finds those keys, also not from the published locations, and a
    put that fails mid-copy leaves nothing behind."""
    url = shm.url(capacity="4MiB", chunk="4KiB")
    with open_store(url) as writer, open_store(url) as reader:
        # Reserves chunks for a next put like it.
        assert writer.put([b"first0", b"first1"], [value_for(b"first", 8192)] * 2) == [True, True]
        keys = [b"n0", b"n1"]
        seen = []

        def look(i):
            if i == 1:      # n0 is copied, n1 not yet
                seen.append((reader.contains(keys), reader.get(keys), reader.stats().num_blocks))

        assert writer.put_parts(keys, [[value_for(k, 8192)] for k in keys], before_value=look) == [True, True]
        assert writer.stats().extra["reserved_puts"] == 1
        assert seen == [([False, False], [None, None], 2)]
        local = reader.stats().extra["local_gets"]
        assert reader.get(keys) == [value_for(k, 8192) for k in keys]
        assert reader.stats().extra["local_gets"] == local + 2      # from the records the commit completed

        def fail(i):
            if i == 1:
                raise RuntimeError("copy failed")

        with pytest.raises(RuntimeError, match="copy failed"):
            writer.put_parts([b"f0", b"f1"], [[value_for(k, 8192)] for k in (b"f0", b"f1")], before_value=fail)
        assert reader.contains([b"f0", b"f1"]) == [False, False]
        assert writer.stats().extra["leased_chunks"] == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to choose one")
def test_a_server_started_with_cpus_runs_on_them_and_status_says_so(shm):
    cpu = max(os.sched_getaffinity(0))
    with open_store(shm.url(capacity="1MiB", cpus=str(cpu))) as store:
        pid = store.stats().extra["server_pid"]
        assert os.sched_getaffinity(pid) == {cpu}
        assert server_status(shm.name, shm.rundir).cpus == [cpu]
        assert store.put([b"k"], [b"v"]) == [True] and store.get([b"k"]) == [b"v"]
    text = subprocess.run([sys.executable, "-m", "ucm_connector.cli", "shm", "status", "--runtime-dir", shm.rundir,
                           shm.name], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    assert f"on CPUs {cpu}" in text


@pytest.mark.parametrize("cpus", ["", "x", "3-1", "-2", "1,,2", "0-4000000000"])
def test_a_cpu_list_that_is_not_one_is_an_open_error_naming_it(shm, cpus):
    with pytest.raises(StoreOpenError, match=r"cpus=.* is not a CPU list"):
        open_store(shm.url(cpus=cpus))
    assert server_processes(shm.name) == []


def test_serve_refuses_cpus_it_cannot_run_on(shm):
    cpus = str(max(os.sched_getaffinity(0)) + 1000)
    done = subprocess.run([sys.executable, "-m", "store_backends.shm_server", "serve", "--runtime-dir", shm.rundir,
                           "--cpus", cpus, shm.name], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 1 and f"--cpus='{cpus}' names no CPU this process may run on" in done.stderr
    assert server_processes(shm.name) == []


def test_a_forked_child_never_uses_its_parents_reservation(shm):
    """After a fork the parent's reservation stays the parent's: were the
    child to copy into it too, one of the two would overwrite values the
    other stored."""
    with open_store(shm.url(capacity="4MiB", chunk="4KiB")) as store:
        assert store.put([b"p0", b"p1"], [value_for(b"p0", 8192), value_for(b"p1", 8192)]) == [True, True]
        assert _reservations(store)["reserved_chunks"] == 4
        pid = os.fork()
        if pid == 0:    # the child: its like put takes chunks of its own
            try:
                ok = store.put([b"c0", b"c1"], [value_for(b"c0", 8192), value_for(b"c1", 8192)]) == [True, True]
                ok = ok and store._writer.reserved_puts == 0
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.put([b"q0", b"q1"], [value_for(b"q0", 8192), value_for(b"q1", 8192)]) == [True, True]
        assert store.stats().extra["reserved_puts"] == 1
        keys = [b"p0", b"p1", b"c0", b"c1", b"q0", b"q1"]
        assert store.get(keys) == [value_for(k, 8192) for k in keys]
