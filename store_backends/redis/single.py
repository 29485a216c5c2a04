"""The single-server Redis store: ``redis://``, ``rediss://`` (TLS) and
``unix://`` URLs.

This module owns opening one server from its URL (a redis-py connection
pool, checked with a ``PING``) and the calls a single server answers
faster than the shared per-key pipeline: ``contains`` and ``prefix_len``
ask for counts of runs of keys first.  It must not hold anything a cluster
needs too (``store.py``) nor parse options by hand (``options.py``).
"""

from __future__ import annotations

import urllib.parse
from typing import Sequence

import redis as redis_py
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..base import OpenMode, StoreOpenError, StoreStats
from ..urls import mask_password, query_options, split_store_url
from . import internals, resp
from .errors import ping
from .options import (COMMON_OPTIONS, DEFAULT_NAMESPACE, DEFAULT_TIMEOUT_S, SSL_OPTIONS, common_options, host_port,
                      parse_db, ssl_kwargs)
from .store import Group, RedisStoreBase

# From this many keys on, contains() asks for counts of runs first, runs of
# _SEGMENT keys.
_COUNT_FIRST = 64
_SEGMENT = 256


class RedisStore(RedisStoreBase):
    """One Redis (or Valkey) server, over TCP, TLS or a Unix socket."""

    KIND = "redis"
    COUNTS_SCOPE = "every key of the database and the server's used_memory, all namespaces and overhead included"

    def __init__(self, url: str, pool: redis_py.ConnectionPool, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(url, namespace, ttl_s, timeout_s)
        self._pool = pool
        self._client = redis_py.Redis(connection_pool=pool)

    @classmethod
    def from_url(cls, url: str, mode: OpenMode | str = OpenMode.SERVE) -> "RedisStore":
        """Open the server a URL names once it answers a ``PING`` with the
        URL's credentials and database.  Both modes open exactly that:
        Redis evicts by itself, and no server is ever started from here,
        so ``inspect`` too opens only a Redis that is there."""
        OpenMode(mode)
        masked = mask_password(url)
        parts = split_store_url(url, ("redis", "rediss", "unix"))
        scheme = parts.scheme.lower()
        allowed = set(COMMON_OPTIONS)
        if scheme == "rediss":
            allowed |= SSL_OPTIONS
        if scheme == "unix":
            allowed.add("db")
        options = query_options(url, allowed)
        common = common_options(url, options)
        username = urllib.parse.unquote(parts.username) if parts.username else None
        password = urllib.parse.unquote(parts.password) if parts.password is not None else None
        kwargs: dict[str, object] = dict(
            username=username, password=password,
            socket_timeout=common.timeout_s, socket_connect_timeout=common.timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0, protocol=resp.PROTOCOL,
        )
        pool_class = redis_py.ConnectionPool
        if common.max_connections:
            # Past the bound a call waits (up to the timeout) for a free
            # connection instead of failing at once.
            pool_class = redis_py.BlockingConnectionPool
            kwargs.update(max_connections=common.max_connections, timeout=common.timeout_s)
        if scheme == "unix":
            if not parts.path or parts.path == "/":
                raise StoreOpenError(
                    f"store '{masked}' names no socket: write it as unix:///path/to/redis.sock[?db=N]")
            kwargs.update(connection_class=redis_py.UnixDomainSocketConnection, path=urllib.parse.unquote(parts.path),
                          db=parse_db(url, options.get("db", "0")))
        else:
            host, port = host_port(url, parts)
            path = parts.path.strip("/")
            kwargs.update(host=host, port=port, db=parse_db(url, path or "0"))
            if scheme == "rediss":
                kwargs.update(connection_class=redis_py.SSLConnection, **ssl_kwargs(url, options))
            else:
                kwargs["socket_keepalive"] = True
        pool = pool_class(**kwargs)
        internals.check_pool(masked, pool)
        ping(masked, redis_py.Redis(connection_pool=pool), password, pool.disconnect,
             "the socket path" if scheme == "unix" else "host:port")
        return cls(url, pool, namespace=common.namespace, ttl_s=common.ttl_s, timeout_s=common.timeout_s)

    def _groups(self, keys: Sequence[bytes], positions: list[int] | None) -> list[Group]:
        return [(self._pool, positions)]

    def _segment_counts(self, keys: Sequence[bytes], deadline: float) -> list[int]:
        """How many keys of each run of ``_SEGMENT`` keys are stored: one
        multi-key EXISTS per run, all in one round trip.  The server answers
        these several times faster than one EXISTS per key.  A duplicate key
        counts once per occurrence, so a run's count reaches its length only
        when every key of it is stored."""
        counts: list[int] = []

        def build(_positions: None) -> list:
            chunks = []
            for lo in range(0, len(keys), _SEGMENT):
                part = keys[lo:lo + _SEGMENT]
                chunks.append(b"*%d\r\n$6\r\nEXISTS\r\n" % (len(part) + 1))
                chunks += self._pack(b"", part, None)
            return [b"".join(chunks)]

        def read(reader: resp.Reader, _positions: None) -> list[int]:
            counts[:] = [reader.integer() for _ in range(0, len(keys), _SEGMENT)]
            return []

        self._exchange(self._groups(keys, None), build, read, deadline)
        return counts

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        # The keys of a request were saved together, so runs of them are
        # nearly always all stored or all missing: counts settle those runs,
        # and only mixed runs are asked key by key.
        if len(keys) < _COUNT_FIRST:
            return super().contains(keys)
        self._check(keys)
        found = [False] * len(keys)
        mixed: list[int] = []
        deadline = self._deadline()
        for lo, count in zip(range(0, len(keys), _SEGMENT), self._segment_counts(keys, deadline)):
            hi = min(lo + _SEGMENT, len(keys))
            if count >= hi - lo:
                found[lo:hi] = [True] * (hi - lo)
            elif count > 0:
                mixed.extend(range(lo, hi))
        if mixed:
            self._contains_at(keys, mixed, found, deadline)
        return found

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        self._check(keys)
        if not keys:
            return 0
        deadline = self._deadline()
        for lo, count in zip(range(0, len(keys), _SEGMENT), self._segment_counts(keys, deadline)):
            hi = min(lo + _SEGMENT, len(keys))
            if count < hi - lo:
                # The first run that is not whole holds the end of the prefix.
                if count == 0:
                    return lo
                found = [False] * (hi - lo)
                self._contains_at(keys[lo:hi], None, found, deadline)
                return lo + (found.index(False) if False in found else hi - lo)
        return len(keys)

    def stats(self) -> StoreStats:
        return self._stats_from([self._client])

    def _scan_clients(self) -> list[redis_py.Redis]:
        return [self._client]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.disconnect()
