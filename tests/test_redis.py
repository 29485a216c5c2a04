"""Redis-specific behaviour of RedisStore and RedisClusterStore, against real
redis-server processes: namespacing, TTL, size checks, authentication, TLS,
a full Redis, a stopped or hung Redis, and a real Redis Cluster."""

from __future__ import annotations

import array
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import redis

from servers import RedisCluster, RedisServer, free_port
from store_backends import OpenMode, registry
from store_backends.base import StoreOpenError, StoreUnavailableError
from store_backends.redis import RedisClusterStore, RedisStore, _SlotMap

NASTY_KEYS = [
    b"plain",
    b"\r\n*3\r\n$3\r\nSET\r\n$1\r\nx\r\n$1\r\ny\r\n",  # a RESP command inside a key
    b"\x00\x00\x00",
    b"../../etc/passwd",
    b"{hashtag}rest",
    b"}{",
    b"*",
    b"other:ns:key",
    b"ucm:",
    " \u00e9\u4e2d".encode(),
    bytes(range(256)),
    b"k" * 10_000,
]


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, password=server.password)


@pytest.fixture
def store(redis_server, unique_name):
    with RedisStore.from_url(f"{redis_server.url}?namespace={unique_name}") as s:
        yield s


@pytest.fixture
def private_server():
    server = RedisServer().start()
    yield server
    server.cleanup()


def elapsed(fn):
    """(exception raised by fn or None, seconds fn took)."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc, time.monotonic() - t0
    return None, time.monotonic() - t0


# -- keys and values -----------------------------------------------------------

def test_nasty_keys_round_trip_and_stay_inside_the_namespace(store, redis_server, unique_name):
    values = [os.urandom(10 + i) for i in range(len(NASTY_KEYS))]
    assert store.put(NASTY_KEYS, values) == [True] * len(NASTY_KEYS)
    assert store.get(NASTY_KEYS) == values

    stored = set(raw_client(redis_server).scan_iter(match=f"{unique_name}:*".encode(), count=1000))
    prefix = unique_name.encode() + b":"
    assert stored == {prefix + k for k in NASTY_KEYS}
    # The RESP text inside a key was data, not a command.
    assert raw_client(redis_server).exists(b"x") == 0


def test_namespaces_do_not_see_or_delete_each_others_keys(redis_server, unique_name):
    with RedisStore.from_url(f"{redis_server.url}?namespace={unique_name}") as a, \
            RedisStore.from_url(f"{redis_server.url}?namespace={unique_name}-b") as b:
        assert a.put([b"k1", b"k2"], [b"from-a", b"from-a"]) == [True, True]
        assert b.contains([b"k1", b"k2"]) == [False, False]
        assert b.get([b"k1"]) == [None]
        b.delete([b"k1", b"k2"])
        assert a.get([b"k1", b"k2"]) == [b"from-a", b"from-a"]


def test_delete_removes_only_namespaced_keys(store, redis_server, unique_name):
    raw = raw_client(redis_server)
    raw.set(b"bare-" + unique_name.encode(), b"not the store's")
    store.put([b"bare-" + unique_name.encode()], [b"the store's"])
    store.delete([b"bare-" + unique_name.encode()])
    assert raw.get(b"bare-" + unique_name.encode()) == b"not the store's"
    assert store.contains([b"bare-" + unique_name.encode()]) == [False]


def test_get_into_needs_the_exact_size(store):
    value = os.urandom(1000)
    store.put([b"sized"], [value])
    short, exact, long = bytearray(999), bytearray(1000), bytearray(1001)
    assert store.get_into([b"sized", b"sized", b"sized"], [short, exact, long]) == [False, True, False]
    assert bytes(exact) == value
    stats = store.stats()
    assert (stats.num_hits, stats.num_misses) == (1, 2)


def test_get_into_accepts_typed_buffers(store):
    floats = array.array("f", [1.5, -2.0, 3.25, 0.0])
    store.put([b"floats"], [floats])
    target = array.array("f", [0.0] * 4)
    assert store.get_into([b"floats"], [target]) == [True]
    assert target == floats
    with pytest.raises(TypeError):
        store.get_into([b"floats"], [bytes(16)])


def test_big_batches_of_mixed_sizes_round_trip(store):
    sizes = [0, 1, 100, 16 * 1024 - 1, 16 * 1024, 300_000, 1 << 20, 3 << 20] * 4
    keys = [b"mixed-%d" % i for i in range(len(sizes))]
    values = [os.urandom(n) for n in sizes]
    assert store.put(keys, [memoryview(v) for v in values]) == [True] * len(keys)
    buffers = [bytearray(n) for n in sizes]
    assert store.get_into(keys, buffers) == [True] * len(keys)
    assert [bytes(b) for b in buffers] == values
    assert store.get(keys) == values


def test_thousands_of_small_keys_in_one_batch(store):
    keys = [b"many-%06d" % i for i in range(5000)] + [b"odd-length-%d" % i for i in range(100)]
    values = [b"v%d" % i for i in range(len(keys))]
    assert all(store.put(keys, values))
    assert store.get(keys) == values
    absent = [b"absent-%d" % i for i in range(3000)]
    assert store.contains(keys + absent) == [True] * len(keys) + [False] * len(absent)
    assert store.prefix_len(keys + absent) == len(keys)
    store.delete(keys[::2])
    assert store.contains(keys[:4]) == [False, True, False, True]
    assert store.prefix_len(keys[1:2] + keys[3:4] + keys[:1]) == 2


def test_prefix_len_with_holes_and_duplicates(store):
    keys = [b"p%d" % i for i in range(200)]
    store.put(keys, [b"x"] * 200)
    store.delete([keys[120]])
    assert store.prefix_len(keys) == 120
    # A duplicate stored key must not make up for a missing one.
    assert store.prefix_len([keys[0], keys[0], b"missing"]) == 2
    assert store.prefix_len([b"missing", keys[0], keys[0]]) == 0


def test_contains_and_prefix_len_agree_with_the_truth_on_scattered_holes(store):
    keys = [b"h%05d" % i for i in range(3000)]
    store.put(keys, [b"x"] * len(keys))
    missing = set(range(700, 760)) | set(range(1000, 3000, 7)) | {2999}
    store.delete([keys[i] for i in sorted(missing)])
    assert store.contains(keys) == [i not in missing for i in range(len(keys))]
    assert store.prefix_len(keys) == 700
    assert store.prefix_len(keys[760:]) == 1000 - 760
    assert store.prefix_len(keys[:700]) == 700


def test_ttl_sets_an_expiry_and_blocks_expire(redis_server, unique_name):
    with RedisStore.from_url(f"{redis_server.url}?namespace={unique_name}&ttl=400ms") as s:
        s.put([b"short-lived"], [b"v"])
        pttl = raw_client(redis_server).pttl(f"{unique_name}:short-lived".encode())
        assert 0 < pttl <= 400
        assert s.contains([b"short-lived"]) == [True]
        time.sleep(0.6)
        assert s.contains([b"short-lived"]) == [False]


def test_keys_have_no_expiry_without_ttl(store, redis_server, unique_name):
    store.put([b"forever"], [b"v"])
    assert raw_client(redis_server).pttl(f"{unique_name}:forever".encode()) == -1


def test_counters_and_server_figures_in_stats(store):
    store.put([b"a", b"b"], [b"1", b"2"])
    store.get([b"a", b"zzz"])
    store.get_into([b"b"], [bytearray(1)])
    stats = store.stats()
    assert (stats.num_puts, stats.num_gets, stats.num_hits, stats.num_misses) == (2, 3, 2, 1)
    assert stats.num_blocks >= 2
    assert stats.nbytes > 0
    assert stats.capacity_nbytes is None  # no maxmemory on the test server
    assert stats.extra["namespace"] == store.namespace


def test_threads_share_one_store_without_mixing_replies(store):
    errors = []

    def worker(n: int) -> None:
        try:
            for round_ in range(30):
                keys = [b"t%d-%d-%d" % (n, round_, i) for i in range(20)]
                values = [os.urandom(100 + 37 * n + i) for i in range(20)]
                assert store.put(keys, values) == [True] * 20
                assert store.get(keys) == values
                buffers = [bytearray(len(v)) for v in values]
                assert store.get_into(keys, buffers) == [True] * 20
                assert [bytes(b) for b in buffers] == values
                assert store.prefix_len(keys + [b"nope"]) == 20
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- opening -------------------------------------------------------------------

@pytest.mark.parametrize("url, words", [
    ("redis://127.0.0.1:99999/0", "port"),
    ("redis://127.0.0.1:port/0", "port"),
    ("redis:///0", "no host"),
    ("redis://127.0.0.1:6379/zero", "database"),
    ("redis://127.0.0.1:6379/0?namespase=x", "'namespase'"),
    ("redis://127.0.0.1:6379/0?namespace=a:b", "namespace"),
    ("redis://127.0.0.1:6379/0?ttl=forever", "ttl"),
    ("redis://127.0.0.1:6379/0?timeout=0", "timeout"),
    ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "'ssl_cert_reqs'"),
    ("unix://", "socket"),
    ("redis-cluster://", "no node"),
    ("redis-cluster://127.0.0.1", "port"),
    ("redis-cluster://127.0.0.1:7000/2", "database 0"),
])
def test_malformed_urls_are_refused_with_the_reason(url, words):
    opener = RedisClusterStore if url.startswith("redis-cluster") else RedisStore
    with pytest.raises(StoreOpenError) as info:
        opener.from_url(url)
    assert url.split("?")[0] in str(info.value)
    assert words in str(info.value)


def test_wrong_password_is_an_open_error_with_the_password_masked():
    server = RedisServer(password="right-secret").start()
    try:
        with pytest.raises(StoreOpenError) as info:
            RedisStore.from_url(f"redis://:wrong-secret@127.0.0.1:{server.port}/0")
        message = str(info.value)
        assert f"redis://:***@127.0.0.1:{server.port}/0" in message
        assert "authentication failed" in message
        assert "wrong-secret" not in message

        with pytest.raises(StoreOpenError, match="requires a password"):
            RedisStore.from_url(f"redis://127.0.0.1:{server.port}/0")

        with RedisStore.from_url(f"redis://:right-secret@127.0.0.1:{server.port}/0") as s:
            assert "right-secret" not in s.url and "right-secret" not in repr(s)
            assert s.put([b"k"], [b"v"]) == [True]
            assert s.get([b"k"]) == [b"v"]
    finally:
        server.cleanup()


def test_unreachable_server_is_an_open_error_quickly():
    url = f"redis://127.0.0.1:{free_port()}/0?timeout=1"
    exc, seconds = elapsed(lambda: RedisStore.from_url(url))
    assert isinstance(exc, StoreOpenError)
    assert url in str(exc) and "unreachable" in str(exc)
    assert seconds < 3


def test_database_out_of_range_is_an_open_error(redis_server):
    with pytest.raises(StoreOpenError, match="DB index"):
        RedisStore.from_url(f"redis://127.0.0.1:{redis_server.port}/999")


def test_registry_opens_every_redis_scheme(redis_server, redis_cluster, tmp_path):
    with registry.open_store(redis_server.url) as s:
        assert type(s) is RedisStore
    with registry.open_store(redis_cluster.url) as s:
        assert type(s) is RedisClusterStore
    server = RedisServer(unixsocket=True).start()
    try:
        with registry.open_store(f"unix://{server.unixsocket}?db=3&namespace=u") as s:
            assert type(s) is RedisStore
            s.put([b"via-socket"], [b"v"])
        assert redis.Redis(port=server.port, db=3).get(b"u:via-socket") == b"v"
    finally:
        server.cleanup()


def test_a_unix_socket_path_is_percent_decoded_as_a_disk_path_is(tmp_path):
    """A socket in a directory whose name holds a ``#`` (which ends a URL's
    path unless written ``%23``) or a space is reached by its encoded URL."""
    import urllib.parse

    directory = tmp_path / "redis #1 %sock"
    directory.mkdir()
    server = RedisServer(unixsocket=True, directory=str(directory)).start()
    try:
        url = f"unix://{urllib.parse.quote(server.unixsocket)}?namespace=u"
        assert "%23" in url and "#" not in url
        with registry.open_store(url) as s:
            assert s.put([b"via-encoded-path"], [b"v"]) == [True]
        assert redis.Redis(port=server.port).get(b"u:via-encoded-path") == b"v"
    finally:
        server.cleanup()


def test_inspect_mode_opens_a_redis_that_answers_and_works_on_what_is_there(redis_server, unique_name):
    url = f"{redis_server.url}?namespace={unique_name}"
    with registry.open_store(url) as serving:
        assert serving.put([b"k"], [b"v"]) == [True]
    with registry.open_store(url, mode=OpenMode.INSPECT) as inspecting:
        assert type(inspecting) is RedisStore
        assert inspecting.get([b"k"]) == [b"v"]
        assert [key for batch in inspecting.iter_keys() for key in batch] == [b"k"]
        inspecting.delete([b"k"])
    assert raw_client(redis_server).exists(f"{unique_name}:k") == 0


def test_inspect_mode_opens_a_running_cluster(redis_cluster, unique_name):
    url = f"{redis_cluster.url}?namespace={unique_name}"
    with registry.open_store(url) as serving:
        assert serving.put([b"a", b"b"], [b"1", b"2"]) == [True, True]
    with registry.open_store(url, mode=OpenMode.INSPECT) as inspecting:
        assert type(inspecting) is RedisClusterStore
        assert inspecting.get([b"b", b"a"]) == [b"2", b"1"]


@pytest.mark.parametrize("url", ["redis://127.0.0.1:{port}/0?timeout=0.5",
                                 "redis-cluster://127.0.0.1:{port}?timeout=0.5"])
def test_inspect_mode_refuses_an_unreachable_redis_with_an_open_error(url):
    url = url.format(port=free_port())
    with pytest.raises(StoreOpenError, match="unreachable"):
        registry.open_store(url, mode=OpenMode.INSPECT)
    assert registry.which_store(url) is None


def test_which_store_names_a_running_redis_and_a_running_cluster(redis_server, redis_cluster):
    assert registry.which_store(redis_server.url) == "redis"
    assert registry.which_store(redis_cluster.url) == "redis-cluster"


def test_stats_say_the_server_figures_count_every_namespace(store, redis_server, unique_name):
    raw_client(redis_server).set(f"{unique_name}-other:k", b"not the store's")
    store.put([b"k"], [b"the store's"])
    stats = store.stats()
    assert stats.kind == "redis"
    assert not stats.counts_this_store
    assert "all namespaces" in stats.counts_scope
    assert stats.num_blocks >= 2
    assert not [name for name in stats.extra if name.endswith("_means")]


def test_cluster_stats_say_they_sum_every_primary(redis_cluster, unique_name):
    with RedisClusterStore.from_url(f"{redis_cluster.url}?namespace={unique_name}") as s:
        stats = s.stats()
    assert stats.kind == "redis-cluster"
    assert not stats.counts_this_store
    assert "every primary" in stats.counts_scope and "all namespaces" in stats.counts_scope


def _make_tls_files(directory: str) -> dict[str, str]:
    paths = {name: os.path.join(directory, name) for name in
             ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt", "ext.cnf")}
    with open(paths["ext.cnf"], "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=ucm-test-ca",
        "-keyout", paths["ca.key"], "-out", paths["ca.crt"])
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", paths["server.key"], "-out", paths["server.csr"])
    run("x509", "-req", "-in", paths["server.csr"], "-CA", paths["ca.crt"], "-CAkey", paths["ca.key"],
        "-CAcreateserial", "-days", "2", "-extfile", paths["ext.cnf"], "-out", paths["server.crt"])
    return paths


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_rediss_speaks_tls_with_options_from_the_url(tmp_path):
    tls = _make_tls_files(str(tmp_path))
    port = free_port()
    server = RedisServer(port=port, extra=[
        "--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no",
        "--tls-cert-file", tls["server.crt"], "--tls-key-file", tls["server.key"],
        "--tls-ca-cert-file", tls["ca.crt"]]).start()
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={tls['ca.crt']}"
        with RedisStore.from_url(url) as s:
            value = os.urandom(2 << 20)
            assert s.put([b"tls"], [value]) == [True]
            buffer = bytearray(len(value))
            assert s.get_into([b"tls"], [buffer]) == [True] and bytes(buffer) == value
        # Without the CA the server's certificate is not trusted.
        with pytest.raises(StoreOpenError):
            RedisStore.from_url(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&timeout=2")
        # Plain text to a TLS port is not mistaken for a working store.
        with pytest.raises(StoreOpenError):
            RedisStore.from_url(f"redis://127.0.0.1:{port}/0?timeout=1")
    finally:
        server.cleanup()


# -- capacity ------------------------------------------------------------------

def test_full_redis_with_noeviction_makes_put_return_false():
    server = RedisServer(extra=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]).start()
    try:
        with RedisStore.from_url(server.url) as s:
            keys = [b"fill-%d" % i for i in range(24)]
            values = [os.urandom(512 * 1024) for _ in keys]
            stored = s.put(keys, values)
            assert True in stored and False in stored
            assert s.contains(keys) == stored
            for key, value, ok in zip(keys, values, stored):
                if ok:
                    assert s.get([key]) == [value]
            stats = s.stats()
            assert stats.capacity_nbytes == 4 * 1024 * 1024
            assert stats.num_put_failures == stored.count(False)
            assert stats.extra["maxmemory_policy"] == "noeviction"
    finally:
        server.cleanup()


def test_allkeys_lru_evicts_and_put_keeps_succeeding():
    server = RedisServer(extra=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]).start()
    try:
        with RedisStore.from_url(server.url) as s:
            keys = [b"lru-%d" % i for i in range(24)]
            values = [os.urandom(512 * 1024) for _ in keys]
            for key, value in zip(keys, values):
                assert s.put([key], [value]) == [True]
            present = s.contains(keys)
            assert present[-1] and not all(present)
            assert s.stats().num_evictions > 0
    finally:
        server.cleanup()


# -- a stopped or hung server ----------------------------------------------------

def test_killed_server_fails_fast_and_the_same_store_recovers(private_server):
    s = RedisStore.from_url(f"{private_server.url}?timeout=1")
    s.put([b"before"], [b"v"])
    private_server.stop()

    for op in (lambda: s.put([b"k"], [b"v"]), lambda: s.get([b"before"]),
               lambda: s.get_into([b"before"], [bytearray(1)]), lambda: s.contains([b"before"]),
               lambda: s.prefix_len([b"before"]), lambda: s.delete([b"before"]), s.stats):
        exc, seconds = elapsed(op)
        assert isinstance(exc, StoreUnavailableError), exc
        assert f"127.0.0.1:{private_server.port}" in str(exc)
        assert seconds < 3

    restarted = RedisServer(port=private_server.port, directory=private_server.dir).start()
    try:
        assert s.put([b"after"], [b"back"]) == [True]
        assert s.get([b"after", b"before"]) == [b"back", None]  # no persistence: 'before' is gone
        assert s.prefix_len([b"after"]) == 1
    finally:
        s.close()
        restarted.stop()


def test_hung_server_times_out_and_recovers(private_server):
    with RedisStore.from_url(f"{private_server.url}?timeout=500ms") as s:
        s.put([b"k"], [b"v"])
        os.kill(private_server.proc.pid, signal.SIGSTOP)
        try:
            exc, seconds = elapsed(lambda: s.get([b"k"]))
            assert isinstance(exc, StoreUnavailableError) and "timeout=0.5s" in str(exc)
            assert seconds < 2.5
            exc, seconds = elapsed(lambda: s.put([b"k2"], [os.urandom(4 << 20)]))
            assert isinstance(exc, StoreUnavailableError)
            assert seconds < 2.5
        finally:
            os.kill(private_server.proc.pid, signal.SIGCONT)
        # The half-read exchange was dropped with its connection: no stale
        # reply is mistaken for the answer to a later command.
        assert s.get([b"k"]) == [b"v"]
        assert s.contains([b"k"]) == [True]


def test_password_never_appears_in_unavailable_errors():
    server = RedisServer(password="hunter2").start()
    s = RedisStore.from_url(f"redis://:hunter2@127.0.0.1:{server.port}/0?timeout=1")
    server.cleanup()
    with pytest.raises(StoreUnavailableError) as info:
        s.get([b"k"])
    assert "hunter2" not in str(info.value) and ":***@" in str(info.value)
    s.close()


def test_max_connections_makes_threads_wait_for_a_connection(private_server):
    url = f"{private_server.url}?max_connections=2"
    with RedisStore.from_url(url) as s:
        results = []

        def worker(n: int) -> None:
            value = os.urandom(256 * 1024)
            s.put([b"mc%d" % n], [value])
            results.append(s.get([b"mc%d" % n]) == [value])

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 6
        # The store's open connections, plus the one asking.
        assert raw_client(private_server).info("clients")["connected_clients"] <= 3


def test_closed_store_refuses_calls(store):
    store.close()
    store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        store.get([b"k"])


# -- Redis Cluster ---------------------------------------------------------------

def _node_clients(cluster: RedisCluster) -> list[redis.Redis]:
    return [redis.Redis(port=server.port) for server in cluster.servers]


def test_cluster_spreads_keys_over_the_nodes(redis_cluster, unique_name):
    with RedisClusterStore.from_url(f"{redis_cluster.url}?namespace={unique_name}") as s:
        keys = [os.urandom(16) for _ in range(300)]
        assert all(s.put(keys, [b"v"] * len(keys)))
        per_node = [len(list(c.scan_iter(match=f"{unique_name}:*".encode(), count=1000)))
                    for c in _node_clients(redis_cluster)]
        assert sum(per_node) == len(keys)
        assert sum(1 for n in per_node if n > 0) >= 2
        assert max(per_node) < len(keys) * 0.6


def test_cluster_round_trips_big_values_and_nasty_keys(redis_cluster, unique_name):
    with RedisClusterStore.from_url(f"{redis_cluster.url}?namespace={unique_name}") as s:
        values = [os.urandom(1 << 20) for _ in NASTY_KEYS]
        assert s.put(NASTY_KEYS, values) == [True] * len(NASTY_KEYS)
        buffers = [bytearray(1 << 20) for _ in NASTY_KEYS]
        assert s.get_into(NASTY_KEYS, buffers) == [True] * len(NASTY_KEYS)
        assert [bytes(b) for b in buffers] == values
        assert s.prefix_len(NASTY_KEYS + [b"absent"] + NASTY_KEYS) == len(NASTY_KEYS)
        stored = set()
        for client in _node_clients(redis_cluster):
            stored |= set(client.scan_iter(match=f"{unique_name}:*".encode(), count=1000))
        assert stored == {unique_name.encode() + b":" + k for k in NASTY_KEYS}
        s.delete(NASTY_KEYS)
        assert s.contains(NASTY_KEYS) == [False] * len(NASTY_KEYS)
        assert s.stats().extra["num_servers"] == 3


def test_cluster_follows_moved_replies_after_a_stale_slot_map(redis_cluster, unique_name):
    with RedisClusterStore.from_url(f"{redis_cluster.url}?namespace={unique_name}") as s:
        # As after a resharding: the store believes one node owns every slot.
        right = s._map
        s._map = _SlotMap(right.pools[:1], np.zeros_like(right.node_of_slot))
        keys = [b"moved-%d" % i for i in range(100)]
        values = [b"v%d" % i for i in range(100)]
        assert s.put(keys, values) == [True] * 100
        assert s.get(keys) == values
        assert len(s._map.pools) == 3


def test_cluster_password_in_the_first_seed():
    cluster = RedisCluster(3, password="clusterpw").start()
    try:
        with RedisClusterStore.from_url(cluster.url) as s:
            assert s.put([b"a", b"b", b"c"], [b"1", b"2", b"3"]) == [True] * 3
            assert s.get([b"c", b"a"]) == [b"3", b"1"]
            assert "clusterpw" not in s.url and ":***@" in s.url
        wrong = cluster.url.replace(":clusterpw@", ":nope@")
        with pytest.raises(StoreOpenError) as info:
            RedisClusterStore.from_url(wrong)
        assert "authentication failed" in str(info.value) and "nope" not in str(info.value)
    finally:
        cluster.cleanup()


def test_cluster_url_on_a_plain_server_is_an_open_error(redis_server):
    with pytest.raises(StoreOpenError) as info:
        RedisClusterStore.from_url(f"redis-cluster://127.0.0.1:{redis_server.port}")
    assert f"127.0.0.1:{redis_server.port}" in str(info.value)


def test_cluster_with_a_stopped_node_fails_fast_and_recovers():
    cluster = RedisCluster(3).start()
    try:
        with RedisClusterStore.from_url(f"{cluster.url}?timeout=1") as s:
            keys = [b"node-%d" % i for i in range(60)]
            assert all(s.put(keys, [b"v"] * len(keys)))
            cluster.servers[1].stop()
            for op in (lambda: s.get(keys), lambda: s.put(keys, [b"w"] * len(keys)),
                       lambda: s.contains(keys), lambda: s.prefix_len(keys)):
                exc, seconds = elapsed(op)
                assert isinstance(exc, StoreUnavailableError), exc
                assert seconds < 3

            # The node comes back on its port with its cluster state: the same
            # store object serves again once the cluster has seen it.
            down = cluster.servers[1]
            cluster.servers[1] = RedisServer(port=down.port, directory=down.dir, extra=down.extra).start()
            deadline = time.monotonic() + 20
            while True:
                try:
                    # The node kept nothing (no persistence): write again.
                    assert s.put(keys, [b"again"] * len(keys)) == [True] * len(keys)
                    break
                except StoreUnavailableError:
                    assert time.monotonic() < deadline, "the store did not recover"
                    time.sleep(0.2)
            assert s.get(keys) == [b"again"] * len(keys)
    finally:
        cluster.cleanup()


def test_cluster_calls_stay_within_their_timeout_while_primaries_are_stopped():
    """Each call's whole wait, slot-map refresh and reconnects included,
    stays within ``timeout`` (it took two timeouts: a refresh through a
    stopped node, then the exchange). Two of three primaries are stopped, so
    most refreshes meet a stopped node first."""
    cluster = RedisCluster(3).start()
    stopped = [server.proc.pid for server in cluster.servers[:2]]
    try:
        # timeout=1 with 0.7 s of slack for a loaded machine: the old code
        # took two timeouts (about 2 s).
        with RedisClusterStore.from_url(f"{cluster.url}?timeout=1") as s:
            keys = [b"deadline-%d" % i for i in range(60)]
            assert all(s.put(keys, [b"v"] * len(keys)))
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            try:
                ops = [lambda: s.get(keys), lambda: s.put(keys, [b"w"] * len(keys)),
                       lambda: s.contains(keys), lambda: s.prefix_len(keys)]
                for op in ops + ops[:2]:
                    exc, seconds = elapsed(op)
                    assert isinstance(exc, StoreUnavailableError), exc
                    assert seconds < 1 + 0.7, f"a call took {seconds:.2f} s with timeout=1"
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while True:  # the same store serves again once the nodes run
                try:
                    assert s.put(keys, [b"again"] * len(keys)) == [True] * len(keys)
                    assert s.get(keys) == [b"again"] * len(keys)
                    break
                except StoreUnavailableError:
                    assert time.monotonic() < deadline, "the store did not recover"
                    time.sleep(0.2)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cluster.cleanup()


# -- the redis-py this store leans on ----------------------------------------------

def test_a_redis_py_whose_connections_lost_their_socket_attribute_is_an_open_error_naming_it(
        redis_server, monkeypatch):
    # As if a redis-py release renamed Connection._sock, which the store reads.
    made = redis.Connection.__init__

    def without_sock(self, *args, **kwargs):
        made(self, *args, **kwargs)
        del self._sock

    monkeypatch.setattr(redis.Connection, "__init__", without_sock)
    with pytest.raises(StoreOpenError) as info:
        RedisStore.from_url(redis_server.url)
    message = str(info.value)
    assert f"redis-py {redis.__version__}" in message
    assert "Connection has no _sock" in message
    assert "pip install 'redis>=" in message


def test_a_redis_py_older_than_supported_is_an_open_error_naming_its_version(redis_server, monkeypatch):
    monkeypatch.setattr(redis, "__version__", "4.6.0")
    with pytest.raises(StoreOpenError, match=r"redis-py 4\.6\.0: it is older than 5\.0"):
        RedisStore.from_url(redis_server.url)


def test_a_redis_py_whose_cluster_lost_its_slot_map_is_an_open_error_naming_it(redis_cluster, monkeypatch):
    # As if a redis-py release renamed NodesManager.slots_cache.
    initialize = redis.cluster.NodesManager.initialize

    def renamed(self, *args, **kwargs):
        result = initialize(self, *args, **kwargs)
        self.slot_table = self.__dict__.pop("slots_cache")
        return result

    monkeypatch.setattr(redis.cluster.NodesManager, "initialize", renamed)
    with pytest.raises(StoreOpenError) as info:
        RedisClusterStore.from_url(redis_cluster.url)
    message = str(info.value)
    assert f"redis-py {redis.__version__}" in message
    assert "NodesManager has no slots_cache" in message


def test_the_installed_redis_py_passes_every_check(redis_server, redis_cluster):
    from store_backends.redis import internals

    assert internals.library_problems() == []
    with RedisStore.from_url(redis_server.url) as single:
        assert internals.pool_problems(single._pool) == []
    with RedisClusterStore.from_url(redis_cluster.url) as cluster:
        assert internals.cluster_problems(cluster._cluster) == []


# -- slot hashing --------------------------------------------------------------------

@pytest.mark.parametrize("width", [1, 15, 16, 33])
def test_batch_slot_hashing_agrees_with_redis_py_key_by_key(width):
    from redis.crc import key_slot

    from store_backends.redis.slots import slots_of

    rng = np.random.default_rng(width)
    keys = [bytes(row) for row in rng.integers(0, 256, size=(500, width), dtype=np.uint8)]
    keys[7] = b"{" + keys[7][1:]
    if width > 2:
        keys[9] = b"{" + keys[9][1:-1] + b"}"        # a hash tag: only what is inside counts
        keys[11] = b"}" + keys[11][1:-1] + b"{"      # braces the wrong way round: no tag
    assert slots_of(b"ucm:", keys).tolist() == [key_slot(b"ucm:" + k) for k in keys]
    assert slots_of(b"ucm:", keys[:5]).tolist() == [key_slot(b"ucm:" + k) for k in keys[:5]]
