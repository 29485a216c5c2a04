"""Redis and Redis Cluster stores: each block is one Redis string.

URLs::

    redis://[user:password@]host[:port][/db][?options]
    rediss://[user:password@]host[:port][/db][?options]     (TLS)
    unix://[user:password@]/path/to/redis.sock[?db=N&options]
    redis-cluster://[user:password@]host:port[,host:port...][?options]

Options (query string; an unknown option is an error that names it):

``namespace`` (default ``ucm``)
    Every Redis key is ``<namespace>:<key bytes>``.  The namespace may use
    only letters, digits and ``_ . -``, so no namespace is a prefix of
    another's keys and nothing a key contains reaches outside it.
``ttl`` (default: none)
    Expiry of each block, a duration (``90``, ``10m``, ``2h``); a put of an
    existing block renews it.
``timeout`` (default ``2``)
    How long one call may wait in all on a stopped or unreachable server
    before ``StoreUnavailableError``: every send and read of the call, on
    every server it talks to, shares one deadline.  On a cluster that
    includes (re)connecting; the slot map is reloaded in the background,
    never inside a call.
``max_connections`` (default: unbounded; single server only)
    Connections in the pool (one per concurrent call); past it a call waits
    up to ``timeout`` for a free one.
``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_check_hostname`` (``rediss://`` and TLS clusters), ``ssl`` (cluster)
    Passed to redis-py's TLS connection.

Capacity is Redis's own business: set ``maxmemory`` on the server and a
``maxmemory-policy``.  ``allkeys-lru`` (or ``allkeys-lfu``) is the policy to
use for a cache: Redis evicts the least-used blocks and ``put`` keeps
succeeding.  With ``noeviction`` a full Redis refuses writes: ``put`` then
returns ``False`` for the blocks it could not store, and reads keep working.
``volatile-*`` policies only evict keys with a TTL, so they fit only with
the ``ttl`` option.  Give the store a database (or a server) of its own:
``stats()`` reports the server's key count and memory, not the namespace's,
since counting one namespace would need a full SCAN.

Why the hot path does not go through redis-py's command layer: a
``get_into`` of 1 MiB blocks through ``MGET`` costs a copy into hiredis's
buffer, a ``bytes`` object, then a copy into the caller's buffer; reading
the RESP reply here lets the payload go from the socket straight into the
caller's buffer (about twice the throughput on loopback).  Likewise
``contains`` on thousands of keys spends most of its time in redis-py's
per-command bookkeeping.  redis-py still owns everything around the bytes:
connecting, AUTH, SELECT, TLS, the connection pools, the cluster's slot map.
A connection whose exchange failed half-way is disconnected, never reused.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Callable, Iterator, Sequence

import numpy as np
import redis as redis_py
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from .base import Buffer, KVStore, byte_view, StoreOpenError, StoreStats, StoreUnavailableError, check_batch
from .urls import mask_password, parse_bool, parse_seconds, query_options, split_url

DEFAULT_NAMESPACE = "ucm"
DEFAULT_TIMEOUT_S = 2.0
# The reader below speaks RESP2: there the server never slips push messages
# (RESP3) in between the replies of a pipeline.
_PROTOCOL = 2

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_COMMON_OPTIONS = {"namespace", "ttl", "timeout", "max_connections"}
_SSL_OPTIONS = {"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"}
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_MAX_CONNECTIONS = 10000  # Redis's default maxclients

# Values at least this large are sent as their own buffer instead of being
# joined with the command around them (a copy that costs more than the
# extra iovec saves).
_JOIN_BELOW = 16 * 1024
# Commands per joined buffer when pipelining one-key commands: bounds each
# join while keeping the system calls few.
_PIPELINE_CHUNK = 512
_IOV_MAX = 512
# From this many keys on, contains() asks for counts of runs first, runs of
# _SEGMENT keys.
_COUNT_FIRST = 64
_SEGMENT = 256

_CONNECTION_ERRORS = (OSError, redis_py.exceptions.ConnectionError, redis_py.exceptions.TimeoutError)


def _left(deadline: float) -> float:
    """Seconds to the deadline of the current call; ``socket.timeout`` once
    it has passed, as a socket wait that ran out would raise."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    return left


# The deadline of the call running on this thread, for connections that a
# call makes (redis-py makes them inside ConnectionPool.get_connection).
_call = threading.local()


class _ConnectWithinDeadline:
    """Mixed into the connection class of the cluster store's own pools: a
    connection made or remade during a call gets only what is left of the
    call's time for the TCP connect and redis-py's handshake, which would
    otherwise take up to ``timeout`` each on a stopped node."""

    def connect(self, *args, **kwargs):
        deadline = getattr(_call, "deadline", None)
        if deadline is None:
            return super().connect(*args, **kwargs)
        left = _left(deadline)
        timeout, connect_timeout = self.socket_timeout, self.socket_connect_timeout
        self.socket_timeout = left if timeout is None else min(timeout, left)
        self.socket_connect_timeout = left if connect_timeout is None else min(connect_timeout, left)
        try:
            return super().connect(*args, **kwargs)
        finally:
            self.socket_timeout, self.socket_connect_timeout = timeout, connect_timeout


_within_deadline_classes: dict[type, type] = {}


def _within_deadline(connection_class: type) -> type:
    """``connection_class`` (plain, TLS...) with ``_ConnectWithinDeadline``."""
    if issubclass(connection_class, _ConnectWithinDeadline):
        return connection_class
    cls = _within_deadline_classes.get(connection_class)
    if cls is None:
        cls = type(f"Deadline{connection_class.__name__}", (_ConnectWithinDeadline, connection_class), {})
        _within_deadline_classes[connection_class] = cls
    return cls


class _ReplyError(Exception):
    """An error reply (``-ERR ...``) to one command of a pipeline."""


class _Unavailable(Exception):
    """An error reply that means the server cannot serve at all right now
    (cluster down, still loading, authentication lost)."""


_UNAVAILABLE_PREFIXES = ("CLUSTERDOWN", "LOADING", "NOAUTH", "WRONGPASS", "MASTERDOWN", "TRYAGAIN", "BUSY")


class _Reader:
    """RESP2 replies read off a socket through a small buffer; bulk payloads
    go straight into the caller's memory."""

    __slots__ = ("_sock", "_deadline", "_buf", "_view", "_start", "_end")

    def __init__(self, sock: socket.socket, deadline: float | None = None, size: int = 64 * 1024) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _recv(self, need: int = 1) -> None:
        """Read at least once, with room for ``need`` buffered bytes."""
        live = self._end - self._start
        if live == 0:
            self._start = self._end = 0
        if len(self._buf) - self._start < max(need, live + 1):
            if len(self._buf) < need or live == len(self._buf):
                grown = bytearray(max(need, 2 * len(self._buf)))
                grown[:live] = self._view[self._start:self._end]
                self._buf = grown
                self._view = memoryview(grown)
            else:
                self._buf[:live] = bytes(self._view[self._start:self._end])
            self._start, self._end = 0, live
        if self._deadline is not None:
            self._sock.settimeout(_left(self._deadline))
        n = self._sock.recv_into(self._view[self._end:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        self._end += n

    def fill(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` bytes, without consuming them."""
        while self._end - self._start < nbytes:
            self._recv(nbytes)
        return self._view[self._start:self._start + nbytes]

    def line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            self._recv(self._end - self._start + 1)

    def _head(self) -> bytes:
        line = self.line()
        if line[:1] == b"-":
            text = line[1:].decode("utf-8", "replace")
            if text.startswith(_UNAVAILABLE_PREFIXES):
                raise _Unavailable(text)
            raise _ReplyError(text)
        return line

    def status(self) -> None:
        """A simple-string or integer reply; an error reply raises."""
        line = self._head()
        if line[:1] not in (b"+", b":"):
            raise ConnectionError(f"unexpected reply {line[:40]!r}")

    def integer(self) -> int:
        line = self._head()
        if line[:1] != b":":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        return int(line[1:])

    def bulk_len(self) -> int:
        """The length of a bulk reply, -1 for nil; the payload (and its
        CRLF) must then be consumed with one of the methods below."""
        line = self._head()
        if line == b"_":
            return -1
        if line[:1] != b"$":
            raise ConnectionError(f"unexpected reply {line[:40]!r}")
        return int(line[1:])

    def bulk_into(self, dest: memoryview, n: int) -> None:
        have = min(self._end - self._start, n)
        if have:
            dest[:have] = self._view[self._start:self._start + have]
            self._start += have
        while have < n:
            if self._deadline is not None:
                self._sock.settimeout(_left(self._deadline))
            got = self._sock.recv_into(dest[have:n], n - have)
            if got == 0:
                raise ConnectionError("the server closed the connection")
            have += got
        self.skip(2)

    def bulk_bytes(self, n: int) -> bytes:
        if self._end - self._start >= n + 2:
            value = bytes(self._view[self._start:self._start + n])
            self._start += n + 2
            return value
        out = bytearray(n)
        self.bulk_into(memoryview(out), n)
        return bytes(out)

    def skip(self, n: int) -> None:
        while n > 0:
            if self._start == self._end:
                self._recv()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step


def _ignore_error(read: Callable[[], object]) -> None:
    """Read one reply and ignore an error reply (an optional command)."""
    try:
        read()
    except _ReplyError:
        pass


def _send(sock: socket.socket, chunks: list, deadline: float | None = None) -> None:
    """Write all chunks, gathering them into few system calls, by ``deadline``."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        for chunk in chunks:
            if deadline is not None:
                sock.settimeout(_left(deadline))
            sock.sendall(chunk)
        return
    i = 0
    while i < len(chunks):
        batch = chunks[i:i + _IOV_MAX]
        if deadline is not None:
            sock.settimeout(_left(deadline))
        sent = sock.sendmsg(batch)
        for chunk in batch:
            size = len(chunk)
            if sent >= size:
                sent -= size
                i += 1
                continue
            # A partial write: the rest of this chunk goes first next round.
            chunks[i] = memoryview(chunk)[sent:]
            break


def _byte_view(obj: object, writable: bool = False) -> memoryview | bytes:
    # bytes go to the socket as they are.
    if isinstance(obj, bytes) and not writable:
        return obj
    return byte_view(obj, writable)


def _get_connection(pool: redis_py.ConnectionPool) -> redis_py.Connection:
    # redis-py before 5.3 needs a command name here, later ones warn about it.
    if _POOL_WANTS_COMMAND:
        return pool.get_connection("GET")
    return pool.get_connection()


_POOL_WANTS_COMMAND = inspect.signature(redis_py.ConnectionPool.get_connection).parameters[
    "command_name"].default is inspect.Parameter.empty


def _sock_of(conn: redis_py.Connection) -> socket.socket:
    sock = getattr(conn, "_sock", None)
    if sock is None:
        conn.connect()
        sock = conn._sock
    return sock


# A pool and the positions in the caller's batch whose keys it serves
# (``None``: the whole batch, which is what a single server always gets).
_Group = tuple[redis_py.ConnectionPool, "list[int] | None"]

_GET = b"*2\r\n$3\r\nGET\r\n"
_IDLETIME = b"*3\r\n$6\r\nOBJECT\r\n$8\r\nIDLETIME\r\n"
_EXISTS = b"*2\r\n$6\r\nEXISTS\r\n"
_DEL = b"*2\r\n$3\r\nDEL\r\n"
_ONE = ord("1")


def _is_redirect(exc: _ReplyError) -> bool:
    return str(exc).startswith(("MOVED ", "ASK "))


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


# Inspection reads are wrapped in CLIENT NO-TOUCH (Redis 7.2+) so that they do
# not count as uses for Redis's LRU/LFU; older servers answer an error, which
# is read and ignored (there a peek is a use).
_NO_TOUCH_ON = _command(b"CLIENT", b"NO-TOUCH", b"ON")
_NO_TOUCH_OFF = _command(b"CLIENT", b"NO-TOUCH", b"OFF")


class _RedisStoreBase(KVStore):
    """What single Redis and Redis Cluster share: key naming, the batched
    wire exchange, counters, error translation."""

    def __init__(self, url: str, namespace: str, ttl_s: float | None, timeout_s: float) -> None:
        self.url = mask_password(url)
        self._timeout_s = timeout_s
        self.namespace = namespace
        self._prefix = namespace.encode() + b":"
        self._ttl_ms = int(round(ttl_s * 1000)) if ttl_s else None
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"puts": 0, "put_failures": 0, "gets": 0, "hits": 0, "misses": 0}

    # -- the parts a subclass supplies ---------------------------------
    def _groups(self, keys: Sequence[bytes], positions: list[int] | None) -> list[_Group]:
        """The pools that serve the keys at ``positions`` (``None``: all),
        each with its share of the positions."""
        raise NotImplementedError

    def _after_redirect(self, deadline: float) -> bool:
        """An answer said a slot lives elsewhere (cluster only): whether the
        redirected keys may be sent again before ``deadline``."""
        return True

    def _on_connection_error(self) -> None:
        """A server could not be reached (the cluster refreshes its map)."""

    # -- the wire ---------------------------------------------------------
    def _check(self, keys: Sequence[bytes], others: Sequence[object] | None = None, what: str = "values") -> None:
        # check_batch walks the keys in Python; this C-speed test passes the
        # well-formed batches of the hot path and leaves messages to it.
        if (others is None or len(others) == len(keys)) and keys and min(map(len, keys)) > 0 \
                and set(map(type, keys)) <= {bytes, bytearray}:
            return
        check_batch(keys, others, what)

    def _pack(self, head: bytes, keys: Sequence[bytes], positions: list[int] | None) -> list[bytes]:
        """``head`` + one namespaced key per command, for the keys at
        ``positions`` (``None``: all), in writes of ``_PIPELINE_CHUNK``."""
        picked = keys if positions is None else [keys[i] for i in positions]
        prefix = self._prefix
        out = []
        for start in range(0, len(picked), _PIPELINE_CHUNK):
            part = picked[start:start + _PIPELINE_CHUNK]
            lengths = set(map(len, part))
            if len(lengths) == 1:
                # Content addresses have one length: one join builds the lot.
                sep = b"\r\n" + head + b"$%d\r\n" % (len(prefix) + lengths.pop()) + prefix
                out.append(sep[2:] + sep.join(part) + b"\r\n")
            else:
                out.append(b"".join([b"%b$%d\r\n%b%b\r\n" % (head, len(prefix) + len(k), prefix, k)
                                     for k in part]))
        return out

    def _deadline(self) -> float:
        """When a call starting now must give up."""
        return time.monotonic() + self._timeout_s

    def _exchange(self, groups: list[_Group], build: Callable[[list[int]], list],
                  read: Callable[[_Reader, list[int]], list[int]], deadline: float | None = None) -> list[int]:
        """Send every group's commands on a connection of its pool, then read
        the replies group by group, all by ``deadline`` (a call of several
        exchanges passes its own).  ``read`` returns the positions whose key
        was redirected (cluster), to be retried by the caller."""
        if self._closed:
            raise StoreUnavailableError(f"store '{self.url}' is closed")
        if deadline is None:
            deadline = self._deadline()
        held: list[tuple[redis_py.ConnectionPool, redis_py.Connection, list[int]]] = []
        clean = False
        redirected: list[int] = []
        _call.deadline = deadline
        try:
            for pool, positions in groups:
                conn = _get_connection(pool)
                held.append((pool, conn, positions))
                _send(_sock_of(conn), build(positions), deadline)
            for _pool, conn, positions in held:
                redirected += read(_Reader(_sock_of(conn), deadline), positions)
            clean = True
        except _Unavailable as exc:
            self._on_connection_error()
            raise StoreUnavailableError(f"store '{self.url}' unavailable: the server answered {exc}") from None
        except _CONNECTION_ERRORS as exc:
            self._on_connection_error()
            raise StoreUnavailableError(
                f"store '{self.url}' unavailable: {_describe(exc)} (is the Redis server up? "
                f"calls give up after timeout={self._timeout_s:g}s)") from None
        finally:
            _call.deadline = None
            for pool, conn, _positions in held:
                if not clean:
                    # Replies may still be in flight: this socket is out of step.
                    conn.disconnect()
                elif getattr(conn, "_sock", None) is not None:
                    # redis-py's own commands share single-server pools and
                    # read with the socket's timeout: give it back.
                    conn._sock.settimeout(conn.socket_timeout)
                pool.release(conn)
        return redirected

    def _run(self, keys: Sequence[bytes], build, read) -> None:
        """One exchange, and one more for keys the cluster redirected, both
        within the call's timeout.  A key still redirected after the slot
        map was reloaded (ASK, during a slot migration), or when no new map
        came in time, counts as not stored / not found this time."""
        deadline = self._deadline()
        redirected = self._exchange(self._groups(keys, None), build, read, deadline)
        if redirected and self._after_redirect(deadline):
            self._exchange(self._groups(keys, redirected), build, read, deadline)

    # -- KVStore ------------------------------------------------------------
    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        self._check(keys, values)
        if not keys:
            return []
        prefix = self._prefix
        views = [_byte_view(v) for v in values]
        ok = [False] * len(keys)
        if self._ttl_ms is None:
            argc, tail = 3, b"\r\n"
        else:
            argc, tail = 5, b"\r\n$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(self._ttl_ms)), self._ttl_ms)

        def build(positions: list[int] | None) -> list:
            chunks: list = []
            small: list = []
            for i in range(len(keys)) if positions is None else positions:
                key, value = keys[i], views[i]
                small.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b%b\r\n$%d\r\n"
                             % (argc, len(prefix) + len(key), prefix, key, len(value)))
                if len(value) < _JOIN_BELOW:
                    small.append(value)
                else:
                    chunks.append(b"".join(small))
                    chunks.append(value)
                    small = []
                small.append(tail)
            chunks.append(b"".join(small))
            return chunks

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            redirected = []
            for i in range(len(keys)) if positions is None else positions:
                try:
                    reader.status()
                    ok[i] = True
                except _ReplyError as exc:
                    # OOM (noeviction and full) and anything else the server
                    # refuses for this key: not stored, and not the caller's crash.
                    if _is_redirect(exc):
                        redirected.append(i)
            return redirected

        self._run(keys, build, read)
        stored = sum(ok)
        with self._lock:
            self._counts["puts"] += stored
            self._counts["put_failures"] += len(keys) - stored
        return ok

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        self._check(keys, buffers, "buffers")
        if not keys:
            return []
        views = [_byte_view(b, writable=True) for b in buffers]
        ok = [False] * len(keys)

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            redirected = []
            for i in range(len(keys)) if positions is None else positions:
                try:
                    n = reader.bulk_len()
                except _ReplyError as exc:
                    if _is_redirect(exc):
                        redirected.append(i)
                    continue
                if n < 0:
                    continue
                if n == len(views[i]):
                    reader.bulk_into(views[i], n)  # type: ignore[arg-type]
                    ok[i] = True
                else:
                    reader.skip(n + 2)
            return redirected

        self._run(keys, lambda positions: self._pack(_GET, keys, positions), read)
        self._count_gets(len(keys), sum(ok))
        return ok

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._check(keys)
        if not keys:
            return []
        out: list[bytes | None] = [None] * len(keys)

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            redirected = []
            for i in range(len(keys)) if positions is None else positions:
                try:
                    n = reader.bulk_len()
                except _ReplyError as exc:
                    if _is_redirect(exc):
                        redirected.append(i)
                    continue
                if n >= 0:
                    out[i] = reader.bulk_bytes(n)
            return redirected

        self._run(keys, lambda positions: self._pack(_GET, keys, positions), read)
        self._count_gets(len(keys), sum(v is not None for v in out))
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check(keys)
        found = [False] * len(keys)
        if keys:
            self._contains_at(keys, None, found)
        return found

    def _contains_at(self, keys: Sequence[bytes], positions: list[int] | None, found: list[bool],
                     deadline: float | None = None) -> None:
        """Fill ``found`` at ``positions`` (``None``: all) with one EXISTS per key."""

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            # Nearly always every reply is ":0\r\n" or ":1\r\n"; check that in
            # one pass over the bytes instead of parsing replies one by one.
            # Every reply is at least 4 bytes, so this never reads past them.
            n = len(keys) if positions is None else len(positions)
            raw = reader.fill(4 * n).tobytes()
            if raw[0::4] == b":" * n and raw[2::4] == b"\r" * n and raw[3::4] == b"\n" * n:
                reader.skip(4 * n)
                flags = list(map(_ONE.__eq__, raw[1::4]))
                if positions is None:
                    found[:] = flags
                else:
                    for i, flag in zip(positions, flags):
                        found[i] = flag
                return []
            redirected = []
            for i in range(len(keys)) if positions is None else positions:
                try:
                    found[i] = reader.integer() > 0
                except _ReplyError as exc:
                    if _is_redirect(exc):
                        redirected.append(i)
            return redirected

        build = (lambda positions: self._pack(_EXISTS, keys, positions))
        if deadline is None:
            deadline = self._deadline()
        redirected = self._exchange(self._groups(keys, positions), build, read, deadline)
        if redirected and self._after_redirect(deadline):
            self._exchange(self._groups(keys, redirected), build, read, deadline)

    def delete(self, keys: Sequence[bytes]) -> None:
        self._check(keys)
        if not keys:
            return

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            redirected = []
            for i in range(len(keys)) if positions is None else positions:
                try:
                    reader.status()
                except _ReplyError as exc:
                    if _is_redirect(exc):
                        redirected.append(i)
            return redirected

        self._run(keys, lambda positions: self._pack(_DEL, keys, positions), read)

    # -- inspection (ucm store ...) --------------------------------------
    def _scan_clients(self) -> list[redis_py.Redis]:
        """One client per server that holds keys (each primary of a cluster)."""
        raise NotImplementedError

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """SCAN ``<namespace>:*`` on every server.  SCAN may return a key
        twice (when the server rehashes); those repeats are dropped here."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        if self._closed:
            raise StoreUnavailableError(f"store '{self.url}' is closed")
        prefix = self._prefix
        seen: set[bytes] = set()
        pending: list[bytes] = []
        try:
            clients = self._scan_clients()
        except (*_CONNECTION_ERRORS, redis_py.exceptions.RedisClusterException) as exc:
            self._on_connection_error()
            raise StoreUnavailableError(f"store '{self.url}' unavailable: {_describe(exc)}") from None
        for client in clients:
            cursor = 0
            while True:
                try:
                    cursor, names = client.scan(cursor, match=prefix + b"*", count=batch)
                except _CONNECTION_ERRORS as exc:
                    self._on_connection_error()
                    raise StoreUnavailableError(
                        f"store '{self.url}' unavailable: {_describe(exc)} (while listing keys)") from None
                for name in names:
                    if name not in seen:
                        seen.add(name)
                        pending.append(name[len(prefix):])
                while len(pending) >= batch:
                    yield pending[:batch]
                    pending = pending[batch:]
                if int(cursor) == 0:
                    break
        if pending:
            yield pending

    def peek(self, keys: Sequence[bytes], nbytes: int | None = None) -> list[tuple[int, bytes] | None]:
        """EXISTS + STRLEN + GETRANGE per key (GET for whole values), with
        no hit counted, pipelined like the hot path."""
        self._check(keys)
        if not keys:
            return []
        if nbytes is not None and nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        prefix = self._prefix
        out: list[tuple[int, bytes] | None] = [None] * len(keys)
        end = b"%d" % ((nbytes or 0) - 1)

        def build(positions: list[int] | None) -> list:
            chunks = [_NO_TOUCH_ON]
            for i in range(len(keys)) if positions is None else positions:
                name = prefix + keys[i]
                if nbytes is None:
                    chunks.append(_command(b"GET", name))
                else:
                    chunks.append(_command(b"EXISTS", name) + _command(b"STRLEN", name))
                    if nbytes:
                        chunks.append(_command(b"GETRANGE", name, b"0", end))
            chunks.append(_NO_TOUCH_OFF)
            return [b"".join(chunks)]

        def bulk(reader: _Reader) -> bytes | None:
            n = reader.bulk_len()
            return None if n < 0 else reader.bulk_bytes(n)

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            redirected = []
            _ignore_error(reader.status)
            steps = [bulk] if nbytes is None else [_Reader.integer, _Reader.integer] + ([bulk] if nbytes else [])
            for i in range(len(keys)) if positions is None else positions:
                replies = []
                moved = failed = False
                for step in steps:
                    try:
                        replies.append(step(reader))
                    except _ReplyError as exc:
                        moved = moved or _is_redirect(exc)
                        failed = True
                if moved:
                    redirected.append(i)
                elif failed:
                    continue
                elif nbytes is None:
                    if replies[0] is not None:
                        out[i] = (len(replies[0]), replies[0])
                elif replies[0]:
                    data = replies[2] if nbytes else b""
                    if data is not None:
                        out[i] = (replies[1], data)
            _ignore_error(reader.status)
            return redirected

        self._run(keys, build, read)
        return out

    def last_used(self, keys: Sequence[bytes]) -> list[float | None]:
        """``now - OBJECT IDLETIME`` (whole seconds; unknown under an LFU
        maxmemory-policy, where Redis keeps no idle time)."""
        self._check(keys)
        if not keys:
            return []
        idle: list[int | None] = [None] * len(keys)
        now = time.time()

        def read(reader: _Reader, positions: list[int] | None) -> list[int]:
            redirected = []
            for i in range(len(keys)) if positions is None else positions:
                try:
                    line = reader._head()
                except _ReplyError as exc:
                    if _is_redirect(exc):
                        redirected.append(i)
                    continue
                if line[:1] == b":":
                    idle[i] = int(line[1:])
                elif line[:1] == b"$" and line != b"$-1":
                    reader.skip(int(line[1:]) + 2)
            return redirected

        self._run(keys, lambda positions: self._pack(_IDLETIME, keys, positions), read)
        return [None if s is None else now - s for s in idle]

    def _count_gets(self, num_keys: int, num_hits: int) -> None:
        with self._lock:
            self._counts["gets"] += num_keys
            self._counts["hits"] += num_hits
            self._counts["misses"] += num_keys - num_hits

    def _stats_from(self, clients: list[redis_py.Redis]) -> StoreStats:
        """Server figures summed over ``clients`` (one per primary)."""
        if self._closed:
            raise StoreUnavailableError(f"store '{self.url}' is closed")
        num_keys: int | None = 0
        used: int | None = 0
        capacity: int | None = 0
        evicted = 0
        policies = set()
        try:
            for client in clients:
                pipe = client.pipeline(transaction=False)
                pipe.info("memory")
                pipe.info("stats")
                pipe.dbsize()
                memory, server_stats, dbsize = pipe.execute()
                num_keys += int(dbsize)
                used += int(memory.get("used_memory", 0))
                maxmemory = int(memory.get("maxmemory", 0))
                policies.add(str(memory.get("maxmemory_policy", "")))
                # One server without a bound makes the whole store unbounded.
                capacity = capacity + maxmemory if capacity is not None and maxmemory else None
                evicted += int(server_stats.get("evicted_keys", 0))
        except _CONNECTION_ERRORS as exc:
            self._on_connection_error()
            raise StoreUnavailableError(f"store '{self.url}' unavailable: {_describe(exc)}") from None
        except redis_py.exceptions.ResponseError:
            # Managed services may refuse INFO or DBSIZE: then the figures are unknown.
            num_keys = used = capacity = None
        with self._lock:
            counts = dict(self._counts)
        return StoreStats(
            url=self.url,
            num_blocks=num_keys,
            nbytes=used,
            capacity_nbytes=capacity,
            num_evictions=evicted,
            num_puts=counts["puts"],
            num_gets=counts["gets"],
            num_hits=counts["hits"],
            num_misses=counts["misses"],
            num_put_failures=counts["put_failures"],
            extra={
                "namespace": self.namespace,
                "ttl_s": self._ttl_ms / 1000 if self._ttl_ms else None,
                "num_blocks_means": "keys in the whole database (all namespaces)",
                "nbytes_means": "used_memory of the server(s), overhead included",
                "maxmemory_policy": ",".join(sorted(policies)),
                "num_servers": len(clients),
            },
        )


class RedisStore(_RedisStoreBase):
    """One Redis (or Valkey) server, over TCP, TLS or a Unix socket."""

    def __init__(self, url: str, pool: redis_py.ConnectionPool, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(url, namespace, ttl_s, timeout_s)
        self._pool = pool
        self._client = redis_py.Redis(connection_pool=pool)

    @classmethod
    def from_url(cls, url: str) -> "RedisStore":
        masked = mask_password(url)
        parts = split_url(url)
        scheme = parts.scheme.lower()
        if scheme not in ("redis", "rediss", "unix"):
            raise StoreOpenError(f"store '{masked}': RedisStore opens redis://, rediss:// and unix:// URLs")
        allowed = set(_COMMON_OPTIONS)
        if scheme == "rediss":
            allowed |= _SSL_OPTIONS
        if scheme == "unix":
            allowed.add("db")
        options = query_options(url, allowed)
        common = _common_options(url, options)
        username = urllib.parse.unquote(parts.username) if parts.username else None
        password = urllib.parse.unquote(parts.password) if parts.password is not None else None
        kwargs: dict[str, object] = dict(
            username=username, password=password,
            socket_timeout=common["timeout"], socket_connect_timeout=common["timeout"],
            retry=Retry(NoBackoff(), 0), health_check_interval=0, protocol=_PROTOCOL,
        )
        pool_class = redis_py.ConnectionPool
        if common["max_connections"]:
            # Past the bound a call waits (up to the timeout) for a free
            # connection instead of failing at once.
            pool_class = redis_py.BlockingConnectionPool
            kwargs.update(max_connections=common["max_connections"], timeout=common["timeout"])
        if scheme == "unix":
            if not parts.path or parts.path == "/":
                raise StoreOpenError(
                    f"store '{masked}' names no socket: write it as unix:///path/to/redis.sock[?db=N]")
            kwargs.update(connection_class=redis_py.UnixDomainSocketConnection, path=parts.path,
                          db=_parse_db(url, options.get("db", "0")))
        else:
            host, port = _host_port(url, parts)
            path = parts.path.strip("/")
            kwargs.update(host=host, port=port, db=_parse_db(url, path or "0"))
            if scheme == "rediss":
                kwargs.update(connection_class=redis_py.SSLConnection, **_ssl_kwargs(url, options))
            else:
                kwargs["socket_keepalive"] = True
        pool = pool_class(**kwargs)
        _ping(masked, redis_py.Redis(connection_pool=pool), pool.disconnect,
              "the socket path" if scheme == "unix" else "host:port")
        return cls(url, pool, namespace=common["namespace"], ttl_s=common["ttl"], timeout_s=common["timeout"])

    def _groups(self, keys: Sequence[bytes], positions: list[int] | None) -> list[_Group]:
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

        def read(reader: _Reader, _positions: None) -> list[int]:
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


@dataclasses.dataclass(frozen=True)
class _SlotMap:
    """Which pool serves each slot: ``pools[node_of_slot[slot]]`` (-1: no
    node).  Replaced whole, never changed, so a call that took it sees one
    consistent map while a reload runs."""

    pools: list[redis_py.ConnectionPool]
    node_of_slot: np.ndarray


class _Reload(threading.Event):
    """A background reload of the slot map: set when it ends; ``ok`` when it
    brought a new map."""

    ok = False


class RedisClusterStore(_RedisStoreBase):
    """A Redis Cluster: each key goes to the primary that owns its slot;
    a batch becomes one pipelined exchange per primary, all primaries at
    once.

    Exchanges go through pools of the store's own, one per primary, whose
    connections connect within the call's deadline; redis-py's pools serve
    its own commands (slot map, stats, SCAN).  The slot map is reloaded by a
    background thread, never inside a call: a reload asks nodes one after
    the other and can meet a stopped one first."""

    def __init__(self, url: str, cluster: redis_py.RedisCluster, *, namespace: str = DEFAULT_NAMESPACE,
                 ttl_s: float | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(url, namespace, ttl_s, timeout_s)
        self._cluster = cluster
        self._map_lock = threading.Lock()
        self._stale = False
        self._reloading: _Reload | None = None
        self._pools: dict[str, redis_py.ConnectionPool] = {}
        self._map = self._load_slots()

    @classmethod
    def from_url(cls, url: str) -> "RedisClusterStore":
        masked = mask_password(url)
        parts = split_url(url)
        if parts.scheme.lower() != "redis-cluster":
            raise StoreOpenError(f"store '{masked}': RedisClusterStore opens redis-cluster:// URLs")
        netloc, path = parts.netloc, parts.path
        if path.strip("/") not in ("", "0"):
            raise StoreOpenError(
                f"store '{masked}': a Redis Cluster has only database 0; drop '/{path.strip('/')}' from the URL")
        allowed = (_COMMON_OPTIONS - {"max_connections"}) | _SSL_OPTIONS | {"ssl"}
        options = query_options(url, allowed)
        common = _common_options(url, options)
        userinfo, at, hosts = netloc.rpartition("@")
        username = password = None
        if at:
            user, colon, secret = userinfo.partition(":")
            username = urllib.parse.unquote(user) or None
            password = urllib.parse.unquote(secret) if colon else None
        nodes = []
        for item in hosts.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                node = urllib.parse.urlsplit("//" + item)
            except ValueError:
                # Only the first node's brackets were checked with the URL.
                raise StoreOpenError(
                    f"store '{masked}': the node {item!r} is malformed; write it as host:port or "
                    f"[IPv6]:port") from None
            host, port = _host_port(url, node, default_port=None)
            nodes.append(redis_py.cluster.ClusterNode(host, port))
        if not nodes:
            raise StoreOpenError(
                f"store '{masked}' names no node: write it as redis-cluster://host:port[,host:port...]")
        kwargs: dict[str, object] = dict(
            username=username, password=password,
            socket_timeout=common["timeout"], socket_connect_timeout=common["timeout"],
            retry=Retry(NoBackoff(), 0), protocol=_PROTOCOL,
        )
        if "ssl" in options and parse_bool(options["ssl"], url=url, name="ssl"):
            kwargs.update(ssl=True, **_ssl_kwargs(url, options))
        elif set(options) & _SSL_OPTIONS:
            raise StoreOpenError(f"store '{masked}': ssl_* options need ssl=true")
        try:
            cluster = redis_py.RedisCluster(startup_nodes=nodes, **kwargs)
        except redis_py.exceptions.AuthenticationError:
            raise StoreOpenError(_auth_message(masked, password)) from None
        except (redis_py.exceptions.RedisError, redis_py.exceptions.RedisClusterException, OSError,
                UnicodeError) as exc:
            text = _describe(exc, password)
            if _is_auth_error(text):
                raise StoreOpenError(_auth_message(masked, password)) from None
            if "cluster" in text.lower() and "not enabled" in text.lower():
                raise StoreOpenError(
                    f"store '{masked}': the server there is not a Redis Cluster node ({text}); "
                    f"use redis://host:port for a single server") from None
            raise StoreOpenError(
                f"store '{masked}' unreachable: {text}; check that the cluster nodes are up and that "
                f"host:port names at least one of them") from None
        return cls(url, cluster, namespace=common["namespace"], ttl_s=common["ttl"], timeout_s=common["timeout"])

    def _own_pool(self, node: redis_py.cluster.ClusterNode) -> redis_py.ConnectionPool:
        pool = self._pools.get(node.name)
        if pool is None:
            theirs = self._cluster.get_redis_connection(node).connection_pool
            pool = redis_py.ConnectionPool(connection_class=_within_deadline(theirs.connection_class),
                                           **theirs.connection_kwargs)
            self._pools[node.name] = pool
        return pool

    def _load_slots(self) -> _SlotMap:
        """Slot -> the pool of the primary that owns it, from redis-py's map."""
        pools: list[redis_py.ConnectionPool] = []
        index: dict[str, int] = {}
        node_of_slot = np.full(16384, -1, dtype=np.int32)
        for slot, nodes in list(self._cluster.nodes_manager.slots_cache.items()):
            if not nodes:
                continue
            primary = nodes[0]
            n = index.get(primary.name)
            if n is None:
                n = index[primary.name] = len(pools)
                pools.append(self._own_pool(primary))
            node_of_slot[slot] = n
        return _SlotMap(pools, node_of_slot)

    def _reload_in_background(self) -> _Reload:
        """Start reloading the slot map unless a reload is running."""
        with self._map_lock:
            done = self._reloading
            if done is None:
                done = self._reloading = _Reload()
                threading.Thread(target=self._reload, args=(done,), name="ucm-cluster-slot-map",
                                 daemon=True).start()
        return done

    def _reload(self, done: _Reload) -> None:
        # Cleared first: a connection error seen while this runs marks the
        # map stale again, and is not lost.
        self._stale = False
        try:
            self._cluster.nodes_manager.initialize()
            if not self._closed:
                self._map = self._load_slots()
                done.ok = True
        except Exception:  # noqa: BLE001 - whatever failed, keep the old map; the next call asks again
            self._stale = True
        finally:
            with self._map_lock:
                self._reloading = None
            done.set()

    def _after_redirect(self, deadline: float) -> bool:
        self._stale = True
        reload = self._reload_in_background()
        return reload.wait(max(0.0, deadline - time.monotonic())) and reload.ok

    def _on_connection_error(self) -> None:
        # A primary may have failed over to a replica: reload the map.
        self._stale = True
        self._reload_in_background()

    def _groups(self, keys: Sequence[bytes], positions: list[int] | None) -> list[_Group]:
        if self._stale:
            self._reload_in_background()
        slot_map = self._map
        index = list(range(len(keys))) if positions is None else positions
        nodes = slot_map.node_of_slot[_slots(self._prefix, [keys[i] for i in index])]
        if (nodes < 0).any():
            self._stale = True
            self._reload_in_background()
            raise StoreUnavailableError(
                f"store '{self.url}' unavailable: no cluster node serves the slot of a key "
                f"(cluster resharding or down)")
        order = np.asarray(index)
        return [(slot_map.pools[n], order[nodes == n].tolist()) for n in np.unique(nodes).tolist()]

    def stats(self) -> StoreStats:
        primaries = self._cluster.get_primaries()
        return self._stats_from([self._cluster.get_redis_connection(node) for node in primaries])

    def _scan_clients(self) -> list[redis_py.Redis]:
        return [self._cluster.get_redis_connection(node) for node in self._cluster.get_primaries()]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            reloading = self._reloading
            if reloading is not None:
                reloading.wait(self._timeout_s)
            for pool in list(self._pools.values()):  # a reload still running may add one
                pool.disconnect()
            self._cluster.close()


# -- cluster slots -------------------------------------------------------------

def _crc16_tables() -> tuple[np.ndarray, np.ndarray]:
    """CRC16-XMODEM tables: one byte at a time, and two bytes at a time
    (the 16-bit register is shifted out whole, so the next state is a
    function of ``state ^ word`` alone)."""
    byte_table = np.zeros(256, dtype=np.int32)
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
        byte_table[byte] = crc & 0xFFFF
    state = np.arange(65536, dtype=np.int32)
    for _ in range(2):
        state = ((state << 8) & 0xFFFF) ^ byte_table[state >> 8]
    return byte_table, state.astype(np.uint16)


_CRC16, _CRC16_WORD = _crc16_tables()
_LBRACE = ord("{")
_RBRACE = ord("}")


def _slots(prefix: bytes, keys: list[bytes]) -> np.ndarray:
    """The cluster slot of ``prefix + key`` for each key (CRC16-XMODEM of
    the key, or of its ``{hash tag}``, modulo 16384), computed for all keys
    at once: a per-key Python loop costs milliseconds on thousands of keys.
    The namespace prefix has no braces, so a key without ``{`` is hashed
    whole; keys with one take the exact per-key rule."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    width = len(keys[0])
    if n < 32 or width == 0 or len(set(map(len, keys))) != 1:
        return np.fromiter((key_slot(prefix + k) for k in keys), dtype=np.int64, count=n)
    joined = b"".join(keys)
    rows = np.frombuffer(joined, dtype=np.uint8).reshape(n, width)
    crc = 0
    for byte in prefix:
        crc = ((crc << 8) & 0xFFFF) ^ int(_CRC16[((crc >> 8) ^ byte) & 0xFF])
    start = 0
    if width % 2:
        first = ((crc << 8) & 0xFFFF) ^ _CRC16.take((crc >> 8) ^ rows[:, 0].astype(np.int32))
        state = first.astype(np.uint16)
        start = 1
    else:
        state = np.full(n, crc, dtype=np.uint16)
    # One row per 16-bit column, so that each step reads contiguous memory.
    columns = np.ascontiguousarray(np.ascontiguousarray(rows[:, start:]).view(">u2").astype(np.uint16).T)
    for column in columns:
        state = _CRC16_WORD.take(state ^ column)
    slots = (state & 0x3FFF).astype(np.int64)
    if b"{" in joined and b"}" in joined:
        # Only a key with both braces can hold a hash tag.
        flat = rows.reshape(-1)
        tagged = np.intersect1d(np.flatnonzero(flat == _LBRACE) // width,
                                np.flatnonzero(flat == _RBRACE) // width)
        for i in tagged.tolist():
            slots[i] = key_slot(prefix + keys[i])
    return slots


# -- URL and open helpers ------------------------------------------------------

def _common_options(url: str, options: dict[str, str]) -> dict:
    masked = mask_password(url)
    namespace = options.get("namespace", DEFAULT_NAMESPACE)
    if not _NAMESPACE_RE.match(namespace):
        raise StoreOpenError(
            f"store '{masked}': namespace={namespace!r} may use only letters, digits, '_', '.' and '-' "
            f"(1 to 128 of them)")
    ttl = None
    if options.get("ttl"):
        ttl = parse_seconds(options["ttl"], url=url, name="ttl")
        if ttl < 0.001:
            raise StoreOpenError(f"store '{masked}': ttl={options['ttl']!r} must be at least 1ms")
    timeout = DEFAULT_TIMEOUT_S
    if "timeout" in options:
        timeout = parse_seconds(options["timeout"], url=url, name="timeout")
        if timeout <= 0:
            raise StoreOpenError(f"store '{masked}': timeout must be more than 0")
    max_connections = None
    if options.get("max_connections"):
        text = options["max_connections"]
        # redis-py's blocking pool fills a queue with max_connections
        # slots up front: an absurd bound would take all memory.
        if not _is_ascii_number(text) or not 1 <= int(text) <= _MAX_CONNECTIONS:
            raise StoreOpenError(
                f"store '{masked}': max_connections={text!r} must be a whole number from 1 to {_MAX_CONNECTIONS}")
        max_connections = int(text)
    return {"namespace": namespace, "ttl": ttl, "timeout": timeout, "max_connections": max_connections}


def _host_port(url: str, parts: urllib.parse.SplitResult, default_port: int | None = 6379) -> tuple[str, int]:
    masked = mask_password(url)
    host = parts.hostname
    if not host:
        raise StoreOpenError(f"store '{masked}' names no host: write it as redis://host:port/db")
    try:
        # The resolver's IDNA step raises UnicodeError (not a connection
        # error) on an empty or over-long label: say so before connecting.
        host.encode("idna")
    except UnicodeError:
        raise StoreOpenError(
            f"store '{masked}': {host!r} is not a host name (dot-separated labels of 1 to 63 characters)") from None
    try:
        port = parts.port
    except ValueError:
        raise StoreOpenError(
            f"store '{masked}': the port is not a number from 1 to 65535") from None
    if port is None:
        if default_port is None:
            raise StoreOpenError(f"store '{masked}': node {host!r} needs a port, as in {host}:6379")
        port = default_port
    if port == 0:
        raise StoreOpenError(f"store '{masked}': the port is not a number from 1 to 65535")
    return host, port


def _is_ascii_number(text: str) -> bool:
    # str.isdigit also says yes to '²' (which int() refuses) and to other
    # scripts' digits (which int() reads); a thousand digits is no number
    # any option takes, and int() refuses 4300.
    return text.isascii() and text.isdigit() and len(text) <= 18


def _parse_db(url: str, text: str) -> int:
    if not _is_ascii_number(text):
        raise StoreOpenError(
            f"store '{mask_password(url)}': the database {text!r} is not a number; "
            f"write redis://host:port/0 (or ?db=0 for unix://)")
    return int(text)


def _ssl_kwargs(url: str, options: dict[str, str]) -> dict[str, object]:
    kwargs: dict[str, object] = {}
    if "ssl_cert_reqs" in options:
        value = options["ssl_cert_reqs"].lower()
        if value not in _CERT_REQS:
            raise StoreOpenError(
                f"store '{mask_password(url)}': ssl_cert_reqs={options['ssl_cert_reqs']!r}; "
                f"write none, optional or required")
        kwargs["ssl_cert_reqs"] = value
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in options:
            kwargs[name] = _tls_file(url, name, options[name])
    _load_tls_files(url, kwargs)
    if "ssl_check_hostname" in options:
        kwargs["ssl_check_hostname"] = parse_bool(options["ssl_check_hostname"], url=url,
                                                  name="ssl_check_hostname")
    return kwargs


def _tls_file(url: str, name: str, path: str) -> str:
    """A TLS file option's path, checked now: redis-py reads the files
    only once connected, and reports a missing one as a failure to connect
    (or, with no server there, not at all)."""
    problem = None
    if not os.path.exists(path):
        problem = "no such file"
    elif not os.path.isfile(path):
        problem = "not a file"
    elif not os.access(path, os.R_OK):
        problem = "not readable by this user"
    if problem:
        raise StoreOpenError(
            f"store '{mask_password(url)}': {name}={path!r}: {problem}"
            f"; give the path of a PEM file that the user running vLLM can read")
    return path


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for the
    # passphrase of an encrypted key; no option passes one to redis-py.
    raise StoreOpenError("an encrypted ssl_keyfile is not supported")


def _load_tls_files(url: str, kwargs: dict[str, object]) -> None:
    """Load the CA bundle and the client certificate as redis-py will, so
    that a file that is not PEM is named now, not reported as a server
    that cannot be reached."""
    masked = mask_password(url)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca = kwargs.get("ssl_ca_certs")
    if ca:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise StoreOpenError(
                f"store '{masked}': ssl_ca_certs={ca!r} holds no PEM certificate that loads "
                f"({getattr(exc, 'reason', None) or exc})") from None
    cert, key = kwargs.get("ssl_certfile"), kwargs.get("ssl_keyfile")
    if key and not cert:
        raise StoreOpenError(f"store '{masked}': ssl_keyfile is the key of ssl_certfile; give both")
    if cert:
        try:
            context.load_cert_chain(cert, key, password=_no_passphrase)
        except StoreOpenError:
            raise StoreOpenError(
                f"store '{masked}': ssl_keyfile={key or cert!r} is encrypted; give a key without a "
                f"passphrase") from None
        except (ssl.SSLError, OSError) as exc:
            raise StoreOpenError(
                f"store '{masked}': ssl_certfile={cert!r} (with ssl_keyfile={key!r}) does not load as a PEM "
                f"certificate and its key ({getattr(exc, 'reason', None) or exc})") from None


def _describe(exc: BaseException, password: str | None = None) -> str:
    """A library's error text, for a message.  None seen quotes the
    password, but a message must never show it, so it is cut out anyway
    (short ones would only garble the text: nobody guards with them)."""
    text = str(exc).strip() or type(exc).__name__
    if password and len(password) >= 4:
        text = text.replace(password, "***")
    if isinstance(exc, (socket.timeout, redis_py.exceptions.TimeoutError)) and "timed out" not in text:
        text = f"timed out ({text})"
    return text


def _is_auth_error(text: str) -> bool:
    return any(mark in text for mark in ("NOAUTH", "WRONGPASS", "invalid password", "invalid username",
                                         "Authentication required", "AUTH <password>"))


def _auth_message(masked: str, password: str | None) -> str:
    if password is None:
        return (f"store '{masked}': the server requires a password; put it in the URL as "
                f"redis://[user]:PASSWORD@host:port/db")
    return (f"store '{masked}': authentication failed (wrong user name or password); "
            f"check the credentials in the URL")


def _ping(masked: str, client: redis_py.Redis, cleanup: Callable[[], None], where: str) -> None:
    """Open-time check: the server answers, the credentials and the
    database number are accepted."""
    password = client.connection_pool.connection_kwargs.get("password")
    try:
        client.ping()
        return
    except redis_py.exceptions.AuthenticationError:
        message = _auth_message(masked, password)
    except redis_py.exceptions.ResponseError as exc:
        text = _describe(exc, password)
        if _is_auth_error(text):
            message = _auth_message(masked, password)
        elif "DB index" in text:
            message = f"store '{masked}': {text}; the server has fewer databases (see its 'databases' setting)"
        else:
            message = f"store '{masked}': the server refused the connection: {text}"
    except _CONNECTION_ERRORS as exc:
        message = (f"store '{masked}' unreachable: {_describe(exc, password)}; start redis-server there or fix "
                   f"{where} in the URL")
    except redis_py.exceptions.RedisError as exc:
        message = (f"store '{masked}': the server there does not answer like Redis ({_describe(exc, password)}); "
                   f"check {where} in the URL")
    cleanup()
    raise StoreOpenError(message)
