"""What the single-server and the cluster Redis store share: each block is
one Redis string ``<namespace>:<key>``, and every batched call is one
pipelined exchange per server, read with the codec in ``resp.py``.

This module owns key naming, the exchange (send everything, then read,
all within one deadline; a connection whose exchange failed half-way is
disconnected, never reused), the KVStore and inspection calls built on it,
the counters and ``stats()``.  It must not parse URLs (``options.py``),
know which server holds a key (the subclasses' ``_groups``), take replies
apart byte by byte (``resp.py``) or touch redis-py's internals
(``internals.py``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Sequence

import redis as redis_py

from ..base import Buffer, KVStore, StoreStats, StoreUnavailableError, byte_view, check_batch
from ..urls import mask_password
from . import internals, resp
from .errors import CONNECTION_ERRORS, describe

# A pool and the positions in the caller's batch whose keys it serves
# (``None``: the whole batch, which is what a single server always gets).
Group = tuple[redis_py.ConnectionPool, "list[int] | None"]


def _byte_view(obj: object, writable: bool = False) -> memoryview | bytes:
    # bytes go to the socket as they are.
    if isinstance(obj, bytes) and not writable:
        return obj
    return byte_view(obj, writable)


def _per_key(keys: Sequence[bytes], reply: Callable[[resp.Reader, int], object]
             ) -> Callable[[resp.Reader, list[int] | None], list[int]]:
    """The ``read`` of an exchange of one command per key: ``reply(reader,
    i)`` takes the reply for ``keys[i]``.  An error reply leaves key ``i`` as
    it is (not stored, not found: the server refused this key, which is not
    the caller's crash); one that says the slot lives elsewhere puts ``i``
    among the positions to send again."""

    def read(reader: resp.Reader, positions: list[int] | None) -> list[int]:
        redirected = []
        for i in range(len(keys)) if positions is None else positions:
            try:
                reply(reader, i)
            except resp.ReplyError as exc:
                if resp.is_redirect(exc):
                    redirected.append(i)
        return redirected

    return read


class RedisStoreBase(KVStore):
    """What single Redis and Redis Cluster share: key naming, the batched
    wire exchange, counters, error translation."""

    #: ``StoreStats.kind``.
    KIND: str = ""
    #: ``StoreStats.counts_scope``: what ``num_blocks`` and ``nbytes`` count
    #: (the server's figures: counting one namespace would need a full SCAN).
    COUNTS_SCOPE: str | None = None

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
    def _groups(self, keys: Sequence[bytes], positions: list[int] | None) -> list[Group]:
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
        ``positions`` (``None``: all)."""
        picked = keys if positions is None else [keys[i] for i in positions]
        return resp.pack(head, self._prefix, picked)

    def _deadline(self) -> float:
        """When a call starting now must give up."""
        return time.monotonic() + self._timeout_s

    def _exchange(self, groups: list[Group], build: Callable[[list[int]], list],
                  read: Callable[[resp.Reader, list[int]], list[int]], deadline: float | None = None) -> list[int]:
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
        internals.set_call_deadline(deadline)
        try:
            for pool, positions in groups:
                conn = internals.get_connection(pool)
                held.append((pool, conn, positions))
                resp.send(internals.socket_of(conn), build(positions), deadline)
            for _pool, conn, positions in held:
                redirected += read(resp.Reader(internals.socket_of(conn), deadline), positions)
            clean = True
        except resp.Unavailable as exc:
            self._on_connection_error()
            raise StoreUnavailableError(f"store '{self.url}' unavailable: the server answered {exc}") from None
        except CONNECTION_ERRORS as exc:
            self._on_connection_error()
            raise StoreUnavailableError(
                f"store '{self.url}' unavailable: {describe(exc)} (is the Redis server up? "
                f"calls give up after timeout={self._timeout_s:g}s)") from None
        finally:
            internals.set_call_deadline(None)
            for pool, conn, _positions in held:
                if not clean:
                    # Replies may still be in flight: this socket is out of step.
                    conn.disconnect()
                else:
                    internals.give_back_timeout(conn)
                pool.release(conn)
        return redirected

    def _run(self, keys: Sequence[bytes], build, read, positions: list[int] | None = None,
             deadline: float | None = None) -> None:
        """One exchange for the keys at ``positions`` (``None``: all), and
        one more for keys the cluster redirected, both by ``deadline``
        (default: the call's timeout from now).  A key still redirected
        after the slot map was reloaded (ASK, during a slot migration), or
        when no new map came in time, counts as not stored / not found this
        time."""
        if deadline is None:
            deadline = self._deadline()
        redirected = self._exchange(self._groups(keys, positions), build, read, deadline)
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
                if len(value) < resp.JOIN_BELOW:
                    small.append(value)
                else:
                    chunks.append(b"".join(small))
                    chunks.append(value)
                    small = []
                small.append(tail)
            chunks.append(b"".join(small))
            return chunks

        def was_set(reader: resp.Reader, i: int) -> None:
            # An error reply (OOM under noeviction when full, or anything
            # else the server refuses for this key) leaves it not stored.
            reader.status()
            ok[i] = True

        self._run(keys, build, _per_key(keys, was_set))
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

        def copied(reader: resp.Reader, i: int) -> None:
            n = reader.bulk_len()
            if n < 0:
                return
            if n == len(views[i]):
                reader.bulk_into(views[i], n)  # type: ignore[arg-type]
                ok[i] = True
            else:
                reader.skip(n + 2)

        self._run(keys, lambda positions: self._pack(resp.GET, keys, positions), _per_key(keys, copied))
        self._count_gets(len(keys), sum(ok))
        return ok

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._check(keys)
        if not keys:
            return []
        out: list[bytes | None] = [None] * len(keys)

        def value(reader: resp.Reader, i: int) -> None:
            n = reader.bulk_len()
            if n >= 0:
                out[i] = reader.bulk_bytes(n)

        self._run(keys, lambda positions: self._pack(resp.GET, keys, positions), _per_key(keys, value))
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

        def exists(reader: resp.Reader, i: int) -> None:
            found[i] = reader.integer() > 0

        one_by_one = _per_key(keys, exists)

        def read(reader: resp.Reader, positions: list[int] | None) -> list[int]:
            # Nearly always every reply is ":0\r\n" or ":1\r\n"; check that in
            # one pass over the bytes instead of parsing replies one by one.
            # Every reply is at least 4 bytes, so this never reads past them.
            n = len(keys) if positions is None else len(positions)
            raw = reader.fill(4 * n).tobytes()
            if raw[0::4] == b":" * n and raw[2::4] == b"\r" * n and raw[3::4] == b"\n" * n:
                reader.skip(4 * n)
                flags = list(map(resp.ONE.__eq__, raw[1::4]))
                if positions is None:
                    found[:] = flags
                else:
                    for i, flag in zip(positions, flags):
                        found[i] = flag
                return []
            return one_by_one(reader, positions)

        self._run(keys, lambda positions: self._pack(resp.EXISTS, keys, positions), read, positions, deadline)

    def delete(self, keys: Sequence[bytes]) -> None:
        self._check(keys)
        if not keys:
            return

        self._run(keys, lambda positions: self._pack(resp.DEL, keys, positions),
                  _per_key(keys, lambda reader, _i: reader.status()))

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
        except (*CONNECTION_ERRORS, redis_py.exceptions.RedisClusterException) as exc:
            self._on_connection_error()
            raise StoreUnavailableError(f"store '{self.url}' unavailable: {describe(exc)}") from None
        for client in clients:
            cursor = 0
            while True:
                try:
                    cursor, names = client.scan(cursor, match=prefix + b"*", count=batch)
                except CONNECTION_ERRORS as exc:
                    self._on_connection_error()
                    raise StoreUnavailableError(
                        f"store '{self.url}' unavailable: {describe(exc)} (while listing keys)") from None
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
            chunks = [resp.NO_TOUCH_ON]
            for i in range(len(keys)) if positions is None else positions:
                name = prefix + keys[i]
                if nbytes is None:
                    chunks.append(resp.command(b"GET", name))
                else:
                    chunks.append(resp.command(b"EXISTS", name) + resp.command(b"STRLEN", name))
                    if nbytes:
                        chunks.append(resp.command(b"GETRANGE", name, b"0", end))
            chunks.append(resp.NO_TOUCH_OFF)
            return [b"".join(chunks)]

        def bulk(reader: resp.Reader) -> bytes | None:
            n = reader.bulk_len()
            return None if n < 0 else reader.bulk_bytes(n)

        integer = resp.Reader.integer
        steps = [bulk] if nbytes is None else [integer, integer] + ([bulk] if nbytes else [])

        def peeked(reader: resp.Reader, i: int) -> None:
            # Every reply of the key is read, an error reply or not, so that
            # the next key's replies start where they should; then the key
            # counts as redirected if any of its replies said so.
            replies = []
            error: resp.ReplyError | None = None
            for step in steps:
                try:
                    replies.append(step(reader))
                except resp.ReplyError as exc:
                    if error is None or resp.is_redirect(exc):
                        error = exc
            if error is not None:
                raise error
            if nbytes is None:
                if replies[0] is not None:
                    out[i] = (len(replies[0]), replies[0])
            elif replies[0]:
                data = replies[2] if nbytes else b""
                if data is not None:
                    out[i] = (replies[1], data)

        each_key = _per_key(keys, peeked)

        def read(reader: resp.Reader, positions: list[int] | None) -> list[int]:
            resp.ignore_error(reader.status)   # CLIENT NO-TOUCH ON
            redirected = each_key(reader, positions)
            resp.ignore_error(reader.status)   # CLIENT NO-TOUCH OFF
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

        def idle_time(reader: resp.Reader, i: int) -> None:
            line = reader.head()
            if line[:1] == b":":
                idle[i] = int(line[1:])
            elif line[:1] == b"$" and line != b"$-1":
                reader.skip(int(line[1:]) + 2)

        self._run(keys, lambda positions: self._pack(resp.IDLETIME, keys, positions), _per_key(keys, idle_time))
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
        except CONNECTION_ERRORS as exc:
            self._on_connection_error()
            raise StoreUnavailableError(f"store '{self.url}' unavailable: {describe(exc)}") from None
        except redis_py.exceptions.ResponseError:
            # Managed services may refuse INFO or DBSIZE: then the figures are unknown.
            num_keys = used = capacity = None
        with self._lock:
            counts = dict(self._counts)
        return StoreStats(
            url=self.url,
            kind=self.KIND,
            counts_scope=self.COUNTS_SCOPE,
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
                "maxmemory_policy": ",".join(sorted(policies)),
                "num_servers": len(clients),
            },
        )
