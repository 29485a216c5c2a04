"""The raw medium under a store, for the store/raw ratio.

Owns the plain way to move the same blocks through the medium a store sits
on: ``memcpy`` into /dev/shm for ``shm://``, plain files for ``disk://``,
plain redis-py for Redis and Redis Cluster (``open_raw`` picks one from the
URL).  Must not move bytes with the store's code or know its internals: a
baseline that shares the store's code measures nothing.  A cluster URL is
read with the Redis store's own parser, so that both reach the same nodes.
Everything it writes is under names of its own and removed again.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import urllib.parse

import numpy as np

from store_backends import KVStore, mask_password, url_scheme
from store_backends.urls import parse_bool, split_url

from .buffers import aligned_empty

_REDIS_SCHEMES = ("redis", "rediss", "unix")
# Query options of a store URL that redis-py's from_url understands too; the
# others (namespace, ttl...) belong to the store and would make redis-py fail.
_REDIS_PY_QUERY = {"db", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile",
                   "ssl_keyfile", "ssl_check_hostname", "socket_timeout", "socket_connect_timeout"}


class RawMedium:
    """The plain medium under a store, driven with the same block ranges."""

    name = ""
    description = ""
    has_lookup = True

    def start_round(self, label: str) -> None:
        """Name this round's blocks (fresh names, as for the store)."""

    def put(self, lo: int, hi: int) -> None:
        raise NotImplementedError

    def get(self, lo: int, hi: int) -> None:
        raise NotImplementedError

    def contains(self, lo: int, hi: int) -> list[bool]:
        raise NotImplementedError

    def prefix_len(self, lo: int, hi: int) -> int:
        n = 0
        for present in self.contains(lo, hi):
            if not present:
                break
            n += 1
        return n

    def end_round(self) -> None:
        """Remove this round's blocks."""

    def close(self) -> None:
        """Remove everything written; idempotent."""


def _shared_region(shape: tuple[int, ...]) -> tuple[mmap.mmap | None, np.ndarray]:
    """A mapped /dev/shm file of ``shape`` bytes (unlinked at once, so
    nothing is left behind), or private memory where there is no /dev/shm."""
    nbytes = int(np.prod(shape))
    if not os.path.isdir("/dev/shm"):
        return None, aligned_empty(*shape)
    fd, path = tempfile.mkstemp(prefix="ucm-bench-raw-", dir="/dev/shm")
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return region, np.frombuffer(region, dtype=np.uint8).reshape(shape)


class MemcpyRaw(RawMedium):
    name = "memcpy"
    description = "memcpy: numpy copyto between the buffers and a region of shared memory (/dev/shm)"
    has_lookup = False

    def __init__(self, values: np.ndarray, dest: np.ndarray) -> None:
        self.values = values
        self.dest = dest
        # The region a put copies into is shared memory, the medium an shm
        # store sits on (its pages behave unlike private anonymous memory,
        # which may be backed by huge pages); touched by the warm-up round so
        # page faults are not timed.
        self._map, self.region = _shared_region(values.shape)

    def close(self) -> None:
        self.region = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
            self._map = None

    def put(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            np.copyto(self.region[i], self.values[i])

    def get(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            np.copyto(self.dest[i], self.region[i])


class FileRaw(RawMedium):
    name = "file"
    has_lookup = True

    def __init__(self, directory: str, values: np.ndarray, dest: np.ndarray) -> None:
        self.dir = tempfile.mkdtemp(prefix=".ucm-bench-raw-", dir=directory)
        self.description = f"plain file open/write/close and open/readinto/close in {self.dir}"
        self.values = [memoryview(row) for row in values]
        self.dest = [memoryview(row) for row in dest]
        self.paths: list[str] = []

    def start_round(self, label: str) -> None:
        self.paths = [os.path.join(self.dir, f"{label}-{i}") for i in range(len(self.values))]

    def put(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            with open(self.paths[i], "wb", buffering=0) as f:
                f.write(self.values[i])

    def get(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            with open(self.paths[i], "rb", buffering=0) as f:
                f.readinto(self.dest[i])

    def contains(self, lo: int, hi: int) -> list[bool]:
        exists = os.path.exists
        return [exists(p) for p in self.paths[lo:hi]]

    def end_round(self) -> None:
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.paths = []

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisRaw(RawMedium):
    has_lookup = True

    def __init__(self, client, values: np.ndarray, run_id: str, cluster: bool, where: str) -> None:
        self.client = client
        self.cluster = cluster
        self.name = "redis-cluster" if cluster else "redis"
        if cluster:
            self.description = f"redis-py RedisCluster pipeline SET and mget_nonatomic on {where}"
        else:
            self.description = f"redis-py pipelined SET (transaction=False) and MGET on {where}"
        self.values = [memoryview(row) for row in values]
        self.prefix = f"ucm-bench-raw:{run_id}:".encode()
        self.keys: list[bytes] = []
        self.written: set[bytes] = set()

    def _pipeline(self):
        return self.client.pipeline() if self.cluster else self.client.pipeline(transaction=False)

    def start_round(self, label: str) -> None:
        self.keys = [self.prefix + f"{label}:{i}".encode() for i in range(len(self.values))]

    def put(self, lo: int, hi: int) -> None:
        pipe = self._pipeline()
        for key, value in zip(self.keys[lo:hi], self.values[lo:hi]):
            pipe.set(key, value)
        pipe.execute()

    def get(self, lo: int, hi: int) -> None:
        if self.cluster:
            self.client.mget_nonatomic(self.keys[lo:hi])
        else:
            self.client.mget(self.keys[lo:hi])

    def contains(self, lo: int, hi: int) -> list[bool]:
        pipe = self._pipeline()
        for key in self.keys[lo:hi]:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def end_round(self) -> None:
        self._delete(self.keys)
        self.keys = []

    def _delete(self, keys: list[bytes]) -> None:
        for a in range(0, len(keys), 512):
            pipe = self._pipeline()
            for key in keys[a:a + 512]:
                pipe.delete(key)
            pipe.execute()

    def close(self) -> None:
        try:
            if self.keys:
                self._delete(self.keys)
                self.keys = []
        finally:
            self.client.close()


def _redis_client(url: str):
    import redis

    parts = urllib.parse.urlsplit(url)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k in _REDIS_PY_QUERY]
    # Rebuilt by hand: urlunsplit turns unix:///path into unix:/path, which
    # redis-py rejects.
    clean = url.split("?", 1)[0] + (f"?{urllib.parse.urlencode(query)}" if query else "")
    return redis.Redis.from_url(clean, socket_connect_timeout=5, socket_timeout=30)


def _redis_cluster_client(url: str):
    from redis.cluster import ClusterNode, RedisCluster

    from store_backends.redis.options import cluster_seeds

    parts = split_url(url)
    seeds = cluster_seeds(url, parts.netloc)
    options = dict(urllib.parse.parse_qsl(parts.query))
    ssl = parse_bool(options.get("ssl", "false"), url=url, name="ssl")
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in seeds.nodes],
                        username=seeds.username, password=seeds.password, ssl=ssl,
                        socket_connect_timeout=5, socket_timeout=30)


def _disk_directory(store: KVStore) -> str | None:
    """The directory a ``disk://`` store keeps its files in: ``DiskStore.root``."""
    root = getattr(store, "root", None)
    return root if isinstance(root, str) and os.path.isdir(root) else None


def open_raw(urls: list[str], store: KVStore, values: np.ndarray, dest: np.ndarray,
             run_id: str) -> tuple[RawMedium | None, str]:
    """The raw medium for these store URLs, or None and why there is none."""
    if len(urls) > 1:
        return None, "n/a: a tier of stores has no single raw medium"
    url = urls[0]
    scheme = url_scheme(url)
    if scheme == "shm":
        return MemcpyRaw(values, dest), ""
    if scheme == "disk":
        directory = _disk_directory(store)
        if directory is None:
            return None, f"n/a: could not tell which directory {mask_password(url)} uses"
        return FileRaw(directory, values, dest), ""
    if scheme in _REDIS_SCHEMES:
        client = _redis_client(url)
        client.ping()
        return RedisRaw(client, values, run_id, cluster=False, where=mask_password(url)), ""
    if scheme == "redis-cluster":
        client = _redis_cluster_client(url)
        return RedisRaw(client, values, run_id, cluster=True, where=mask_password(url)), ""
    return None, f"n/a: no raw baseline for the scheme {scheme!r}"
