"""A tier of stores, fastest first.

Reads go down the tiers until every key is found and promote what a lower
tier had into the tiers above it.  Writes go to the first tier in the
caller's thread and on to the lower tiers in a background thread
(``write_mode="async"``, the default), or to every tier before ``put``
returns (``write_mode="sync"``).  A tier that is down only makes the tier hit
less: its errors are counted, logged once, and the other tiers carry on.

Background writes are bounded (``max_pending_nbytes``); when the backlog is
full a write to a lower tier is dropped and counted, never waited for, so a
slow lower tier cannot stall the engine.

``put_parts`` (async) writes the first tier from the caller's buffers and
hands the lower tiers only the keys: the background thread reads the values
back from the first tier when it writes them, so no copy is kept meanwhile.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Iterator, Sequence

from .base import Buffer, KVStore, StoreError, StoreStats, StoreUnavailableError, byte_view, check_batch
from .urls import mask_password

logger = logging.getLogger(__name__)

WRITE_MODES = ("async", "sync")


class TieredStore(KVStore):
    def __init__(self, stores: Sequence[KVStore], *, write_mode: str = "async",
                 promote: bool = True, max_pending_nbytes: int = 256 << 20) -> None:
        if not stores:
            raise ValueError("a tier needs at least one store")
        if write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode={write_mode!r}: expected one of {', '.join(WRITE_MODES)}")
        self.stores = list(stores)
        self.write_mode = write_mode
        self.promote = promote
        self.max_pending_nbytes = max_pending_nbytes
        # A third-party store may not mask its own URL's password.
        self.url = "[" + ", ".join(mask_password(s.url) for s in self.stores) + "]"
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # (tier index, keys, values, bytes) batches waiting for the writer
        # thread; values None: read them back from the first tier then.
        self._pending: collections.deque[tuple[int, list[bytes], list[bytes] | None, int]] = collections.deque()
        self._pending_nbytes = 0
        self._in_flight = 0
        self._closed = False
        self._writer: threading.Thread | None = None
        self._errors = [0] * len(self.stores)
        self._logged = [False] * len(self.stores)
        self._hits = [0] * len(self.stores)
        self._num_misses = 0
        self._num_dropped = 0
        self._num_promoted = 0

    # -- errors --------------------------------------------------------------

    def _tier_failed(self, tier: int, exc: BaseException) -> None:
        with self._lock:
            self._errors[tier] += 1
            first = not self._logged[tier]
            self._logged[tier] = True
        if first:
            logger.warning("tier %d (%s) failed: %s; the other tiers carry on "
                           "(further errors of this tier are counted, not logged)",
                           tier, self.stores[tier].url, exc)

    # -- background writes ---------------------------------------------------

    def _enqueue(self, tier: int, keys: list[bytes], values: list[bytes] | None, nbytes: int | None = None) -> None:
        """Queue a write to ``tier``; ``values=None``: of the values the
        first tier holds under ``keys`` (``nbytes`` in all), read back when
        the write is made."""
        if nbytes is None:
            nbytes = sum(len(v) for v in values or ())
        with self._cond:
            if self._closed:
                return
            if self._pending_nbytes + nbytes > self.max_pending_nbytes and self._pending:
                self._num_dropped += len(keys)
                return
            self._pending.append((tier, keys, values, nbytes))
            self._pending_nbytes += nbytes
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="ucm-tier-writer", daemon=True)
                self._writer.start()
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                tier, keys, values, nbytes = self._pending.popleft()
                self._pending_nbytes -= nbytes
                self._in_flight += 1
            try:
                if values is None:
                    keys, values = self._read_back(keys)
                if keys:
                    self._put_tier(tier, keys, values)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every background write has been done; ``False`` on
        timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._in_flight, timeout)

    @staticmethod
    def _owned(values: Sequence[bytes | Buffer]) -> list[bytes]:
        # The caller may reuse its buffers once put() returns.
        return [v if isinstance(v, bytes) else bytes(v) for v in values]

    def _read_back(self, keys: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The first tier's values of ``keys`` (those it still holds), read
        without counting a use."""
        try:
            got = self.stores[0].peek(keys)
        except StoreError as exc:
            self._tier_failed(0, exc)
            got = [None] * len(keys)
        kept = [(key, value[1]) for key, value in zip(keys, got) if value is not None]
        if len(kept) < len(keys):
            with self._lock:
                self._num_dropped += len(keys) - len(kept)
        return [k for k, _ in kept], [v for _, v in kept]

    def _put_tier(self, tier: int, keys: list[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        try:
            return self.stores[tier].put(keys, values)
        except StoreError as exc:
            self._tier_failed(tier, exc)
            return [False] * len(keys)

    # -- KVStore -------------------------------------------------------------

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        check_batch(keys, values)
        keys = list(keys)
        if not keys:
            return []
        stored = [False] * len(keys)
        failures = 0
        owned: list[bytes] | None = None
        for tier in range(len(self.stores)):
            if tier > 0 and self.write_mode == "async" and any(stored):
                owned = owned if owned is not None else self._owned(values)
                self._enqueue(tier, keys, owned)
                continue
            try:
                ok = self.stores[tier].put(keys, values)
            except StoreError as exc:
                self._tier_failed(tier, exc)
                failures += 1
                continue
            stored = [a or b for a, b in zip(stored, ok)]
        if failures == len(self.stores):
            raise StoreUnavailableError(f"store {self.url}: every tier failed")
        return stored

    @property
    def writes_from_parts(self) -> bool:  # type: ignore[override]
        return self.write_mode == "async" and len(self.stores) > 1 and self.stores[0].writes_from_parts

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                  before_value: Callable[[int], object] | None = None) -> list[bool]:
        """With ``write_mode="async"``: the first tier writes the values
        from their parts; the lower tiers get them in the background, read
        back from the first tier (no copy of the values is kept meanwhile).
        A value the first tier could not keep is joined now and queued for
        the lower tiers too: nothing here waits on a lower tier, and the
        answer is the first tier's.  Otherwise as ``put``."""
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} lists of parts")
        check_batch(keys)
        keys = list(keys)
        if not keys or self.write_mode != "async" or len(self.stores) == 1:
            return super().put_parts(keys, parts, before_value)
        try:
            stored = self.stores[0].put_parts(keys, parts, before_value)
        except StoreError as exc:
            self._tier_failed(0, exc)
            stored = [False] * len(keys)
        kept = [i for i, ok in enumerate(stored) if ok]
        refused = [i for i, ok in enumerate(stored) if not ok]
        values = []
        for i in refused:
            if before_value is not None:
                before_value(i)     # the first tier may not have called it
            values.append(b"".join(byte_view(p) for p in parts[i]))
        kept_keys = [keys[i] for i in kept]
        kept_nbytes = sum(byte_view(p).nbytes for i in kept for p in parts[i])
        for tier in range(1, len(self.stores)):
            if kept:
                self._enqueue(tier, kept_keys, None, kept_nbytes)
            if refused:
                self._enqueue(tier, [keys[i] for i in refused], values)
        return stored

    def _read(self, keys: list[bytes], read_tier) -> list[bool]:
        """Fall through the tiers; ``read_tier(tier, positions) -> found``
        fills the results of the given positions."""
        found = [False] * len(keys)
        todo = list(range(len(keys)))
        failures = 0
        for tier in range(len(self.stores)):
            if not todo:
                break
            try:
                hit = read_tier(tier, todo)
            except StoreError as exc:
                self._tier_failed(tier, exc)
                failures += 1
                continue
            got = [i for i, h in zip(todo, hit) if h]
            for i in got:
                found[i] = True
            with self._lock:
                self._hits[tier] += len(got)
            todo = [i for i, h in zip(todo, hit) if not h]
        if failures == len(self.stores):
            raise StoreUnavailableError(f"store {self.url}: every tier failed")
        with self._lock:
            self._num_misses += len(todo)
        return found

    def _promote(self, tier: int, keys: list[bytes], positions: list[int], hit: list[bool],
                 value_of: Callable[[int], bytes]) -> None:
        """Queue for the tiers above ``tier`` the values it had (``hit`` at
        ``positions``); ``value_of(i)`` is called only for those, so a
        first-tier hit copies nothing."""
        if not self.promote or tier == 0:
            return
        got = [i for i, h in zip(positions, hit) if h]
        if not got:
            return
        with self._lock:
            self._num_promoted += len(got)
        hit_keys = [keys[i] for i in got]
        values = [value_of(i) for i in got]
        for upper in range(tier):
            self._enqueue(upper, hit_keys, values)

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        check_batch(keys, buffers, "buffers")
        keys = list(keys)

        def read_tier(tier: int, positions: list[int]) -> list[bool]:
            hit = self.stores[tier].get_into([keys[i] for i in positions], [buffers[i] for i in positions])
            self._promote(tier, keys, positions, hit, lambda i: bytes(buffers[i]))
            return hit

        return self._read(keys, read_tier)

    @property
    def reads_into_parts(self) -> bool:  # type: ignore[override]
        return all(store.reads_into_parts for store in self.stores)

    def get_into_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                       on_value: Callable[[int], object] | None = None) -> list[bool]:
        """Each tier reads the values it has straight into their parts (where
        every tier can: ``reads_into_parts``), falling through like
        ``get_into``; ``on_value(i)`` is called by the tier that read value
        i, as soon as it is whole.  Hits of a lower tier are promoted."""
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} lists of parts")
        if not self.reads_into_parts:
            return super().get_into_parts(keys, parts, on_value)
        check_batch(keys)
        keys = list(keys)

        def read_tier(tier: int, positions: list[int]) -> list[bool]:
            called = None if on_value is None else (lambda j: on_value(positions[j]))
            hit = self.stores[tier].get_into_parts([keys[i] for i in positions], [parts[i] for i in positions],
                                                   called)
            self._promote(tier, keys, positions, hit, lambda i: b"".join(parts[i]))
            return hit

        return self._read(keys, read_tier)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_batch(keys)
        keys = list(keys)
        values: list[bytes | None] = [None] * len(keys)

        def read_tier(tier: int, positions: list[int]) -> list[bool]:
            got = self.stores[tier].get([keys[i] for i in positions])
            for i, v in zip(positions, got):
                values[i] = v
            hit = [v is not None for v in got]
            self._promote(tier, keys, positions, hit, values.__getitem__)  # type: ignore[arg-type]
            return hit

        self._read(keys, read_tier)
        return values

    def _first_tier(self, keys: Sequence[bytes], ask, found) -> list:
        """Ask the tiers in order, each only for the keys no tier before it
        had; each key's answer is from the first tier that has it
        (``found(answer)``), else from the last tier that answered (None if
        none did).  Raises when every tier fails."""
        check_batch(keys)
        keys = list(keys)
        out: list = [None] * len(keys)
        todo = list(range(len(keys)))
        failures = 0
        for tier, store in enumerate(self.stores):
            if not todo:
                break
            try:
                got = ask(store, [keys[i] for i in todo])
            except StoreError as exc:
                self._tier_failed(tier, exc)
                failures += 1
                continue
            for i, answer in zip(todo, got):
                out[i] = answer
            todo = [i for i, answer in zip(todo, got) if not found(answer)]
        if failures == len(self.stores) and keys:
            raise StoreUnavailableError(f"store {self.url}: every tier failed")
        return out

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(h) for h in self._first_tier(keys, lambda store, ks: store.contains(ks), bool)]

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        check_batch(keys)
        keys = list(keys)
        # A leading run may be spread over the tiers: advance as far as any
        # tier reaches, then ask again from there.
        pos = 0
        while pos < len(keys):
            advance = 0
            failures = 0
            for tier, store in enumerate(self.stores):
                try:
                    advance = max(advance, store.prefix_len(keys[pos:]))
                except StoreError as exc:
                    self._tier_failed(tier, exc)
                    failures += 1
            if failures == len(self.stores):
                raise StoreUnavailableError(f"store {self.url}: every tier failed")
            if advance == 0:
                break
            pos += advance
        return pos

    def delete(self, keys: Sequence[bytes]) -> None:
        check_batch(keys)
        self.flush()
        failures = 0
        for tier, store in enumerate(self.stores):
            try:
                store.delete(keys)
            except StoreError as exc:
                self._tier_failed(tier, exc)
                failures += 1
        if failures == len(self.stores) and keys:
            raise StoreUnavailableError(f"store {self.url}: every tier failed")

    # -- inspection ------------------------------------------------------------

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """The union of every tier's keys, each listed once.  Unlike reads,
        a tier that fails (or cannot list) fails the walk: a partial list
        would make ``ucm store clear`` leave blocks behind unsaid."""
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.flush()
        seen: set[bytes] = set()
        pending: list[bytes] = []
        for store in self.stores:
            for keys in store.iter_keys(batch):
                for key in keys:
                    if key not in seen:
                        seen.add(key)
                        pending.append(key)
                if len(pending) >= batch:
                    yield pending[:batch]
                    pending = pending[batch:]
        while pending:
            yield pending[:batch]
            pending = pending[batch:]

    def peek(self, keys: Sequence[bytes], nbytes: int | None = None) -> list[tuple[int, bytes] | None]:
        """From the first tier that has each key; no promotion, no hit counted."""
        return self._first_tier(keys, lambda store, ks: store.peek(ks, nbytes), lambda got: got is not None)

    def last_used(self, keys: Sequence[bytes]) -> list[float | None]:
        """The latest use any tier knows of."""
        check_batch(keys)
        latest: list[float | None] = [None] * len(keys)
        failures = 0
        for tier, store in enumerate(self.stores):
            try:
                times = store.last_used(keys)
            except StoreError as exc:
                self._tier_failed(tier, exc)
                failures += 1
                continue
            latest = [a if b is None else b if a is None else max(a, b) for a, b in zip(latest, times)]
        if failures == len(self.stores) and keys:
            raise StoreUnavailableError(f"store {self.url}: every tier failed")
        return latest

    def stats(self) -> StoreStats:
        tiers = []
        for tier, store in enumerate(self.stores):
            try:
                tiers.append(store.stats().to_dict())
            except StoreError as exc:
                self._tier_failed(tier, exc)
                tiers.append({"url": store.url, "error": str(exc)})
        with self._lock:
            return StoreStats(
                url=self.url,
                num_hits=sum(self._hits),
                num_misses=self._num_misses,
                extra={
                    "tiers": tiers,
                    "hits_per_tier": list(self._hits),
                    "errors_per_tier": list(self._errors),
                    "num_promoted": self._num_promoted,
                    "num_dropped_writes": self._num_dropped,
                    "pending_write_nbytes": self._pending_nbytes,
                    "write_mode": self.write_mode,
                },
            )

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
        self.flush(timeout=30)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=30)
        for store in self.stores:
            store.close()
