"""A small third-party store, declared by the test suite and found through the
``ucm_connector.stores`` entry-point group like any installed plugin would be.

``memdict://NAME`` keeps values in a process-wide dict per NAME.
"""

from __future__ import annotations

import threading

from store_backends import KVStore, StoreOpenError, StoreStats
from store_backends.base import check_batch

_TABLES: dict[str, dict[bytes, bytes]] = {}
_LOCK = threading.Lock()


class MemDictStore(KVStore):
    def __init__(self, url: str, name: str) -> None:
        self.url = url
        with _LOCK:
            self._table = _TABLES.setdefault(name, {})
        self._hits = self._misses = 0

    @classmethod
    def from_url(cls, url: str) -> "MemDictStore":
        name = url.partition("://")[2]
        if not name.isidentifier():
            raise StoreOpenError(f"store '{url}': NAME must be an identifier")
        return cls(url, name)

    def put(self, keys, values):
        check_batch(keys, values)
        with _LOCK:
            for k, v in zip(keys, values):
                self._table[bytes(k)] = bytes(v)
        return [True] * len(keys)

    def get(self, keys):
        check_batch(keys)
        with _LOCK:
            out = [self._table.get(bytes(k)) for k in keys]
            hits = sum(v is not None for v in out)
            self._hits += hits
            self._misses += len(out) - hits
        return out

    def get_into(self, keys, buffers):
        check_batch(keys, buffers, "buffers")
        ok = []
        for value, buf in zip(self.get(keys), buffers):
            mv = memoryview(buf).cast("B")
            if value is None or len(value) != mv.nbytes:
                ok.append(False)
                continue
            mv[:] = value
            ok.append(True)
        return ok

    def contains(self, keys):
        check_batch(keys)
        with _LOCK:
            return [bytes(k) in self._table for k in keys]

    def delete(self, keys):
        check_batch(keys)
        with _LOCK:
            for k in keys:
                self._table.pop(bytes(k), None)

    def stats(self):
        with _LOCK:
            return StoreStats(url=self.url, num_blocks=len(self._table),
                              nbytes=sum(map(len, self._table.values())),
                              num_hits=self._hits, num_misses=self._misses)
