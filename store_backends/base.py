"""The KVStore interface: opaque byte values under byte keys.

This module owns the contract every backend implements and the types that
cross the store boundary (``StoreStats`` and the error classes).  It knows
nothing of vLLM, torch or of what the bytes mean.

Rules every backend follows:

* Keys are ``bytes``.  Nothing a key contains can name a file outside the
  store's directory or a Redis key outside the store's namespace.
* ``put`` is atomic per key and idempotent: a reader sees the whole value or
  no value, never half of one.  A full store or a full disk makes ``put``
  return ``False`` for the keys it could not keep (or evict to make room); it
  never raises for those.  Only a medium that is gone raises, and then with
  the one typed error below.
* ``get_into`` copies a value straight into the caller's writable buffer.
  The buffer's size must equal the value's size: a value of another size is
  treated as a miss (so a truncated value is never returned as valid).
* ``get_into_parts`` is ``get_into`` with each value spread over several
  buffers, filled in order (a caller reads a block straight into the places
  it is used); a store that does so without a temporary buffer says
  ``reads_into_parts``.  ``put_parts`` is its mirror for writes
  (``writes_from_parts``).
* Reads that find nothing, or find something damaged, return a miss.
* A store whose medium is gone raises ``StoreUnavailableError`` quickly
  (bounded timeouts), and works again once the medium is back.

For operators (the ``ucm`` command) rather than the engine, a store can also
list its keys (``iter_keys``), read the start of values without counting a
use (``peek``), and say when a key was last used (``last_used``).  Only
``iter_keys`` has no generic fallback: a store that cannot list raises
``StoreError`` from it.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Callable, Iterator, Sequence


class StoreError(Exception):
    """Base class of every error a store raises."""


class StoreOpenError(StoreError, ValueError):
    """A store URL is malformed, names an unknown scheme, or the medium it
    names cannot be used (unwritable directory, wrong password...)."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The medium behind an open store stopped answering (server down,
    timeout).  Raised fast; the store recovers by itself once the medium is
    back."""


class OpenMode(str, enum.Enum):
    """Why a store is opened (like ``dbm.open``'s flag).

    ``serve``: for an engine: created if missing, kept within its capacity
    (eviction), an shm server started as its URL says.  ``inspect``: for an
    operator: only a store that exists is opened (else ``StoreOpenError``
    saying so), nothing is evicted, no server is started, no capacity is
    enforced; reads, listing and deletes work."""

    SERVE = "serve"
    INSPECT = "inspect"


@dataclasses.dataclass
class StoreStats:
    """What a store can tell about itself.  ``None`` means unknown.

    ``kind`` names the backend (``disk``, ``redis``, ``redis-cluster``,
    ``shm``, ``tier``, or a third-party scheme).  ``counts_scope`` is None
    when ``num_blocks`` and ``nbytes`` count this store's blocks, else what
    they count instead (a Redis database shared with other namespaces).
    ``read_only`` is None for a store that takes writes, else why it does
    not (a disk store on a full file system).  ``extra`` holds what only one
    backend knows, for display."""

    url: str
    kind: str = ""
    counts_scope: str | None = None
    read_only: str | None = None
    num_blocks: int | None = None
    nbytes: int | None = None
    capacity_nbytes: int | None = None
    num_evictions: int = 0
    num_puts: int = 0
    num_gets: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_put_failures: int = 0
    num_corrupt: int = 0
    extra: dict[str, object] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @property
    def counts_this_store(self) -> bool:
        return self.counts_scope is None


Buffer = bytearray | memoryview


class KVStore(abc.ABC):
    """A batched, thread-safe key/value store of opaque blocks."""

    #: The URL the store was opened with, with any password masked.
    url: str = ""

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], values: Sequence[bytes | Buffer]) -> list[bool]:
        """Store each value under its key.  ``True`` where the key is stored
        afterwards (also when it was there already), ``False`` where the store
        could not keep it (full, disk error, value larger than the store)."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Copy each key's value into the matching writable buffer.  ``True``
        where the whole value was copied; ``False`` on a miss, a damaged
        value, or a value whose size differs from the buffer's.  A buffer is
        left in an unspecified state where the answer is ``False``."""

    #: True where ``get_into_parts`` copies each value straight into its
    #: parts; the generic version reads into a temporary buffer first.
    reads_into_parts: bool = False

    def get_into_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                       on_value: Callable[[int], object] | None = None) -> list[bool]:
        """``get_into`` where key i's value lands in the buffers ``parts[i]``,
        filled in order: their total size must equal the value's (else
        ``False``, as for ``get_into``).

        ``on_value(i)``, when given, is called for each value that will be
        answered ``True``, once it is whole in its parts, before the next
        value is copied, so the caller can check it while it is still in the
        CPU's caches.  This version reads each value into a temporary
        buffer, then copies it into its parts."""
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} lists of parts")
        views = [[byte_view(p, writable=True) for p in value_parts] for value_parts in parts]
        temps = [bytearray(sum(v.nbytes for v in value_views)) for value_views in views]
        found = self.get_into(keys, temps)
        for i, (ok, temp, value_views) in enumerate(zip(found, temps, views)):
            if ok:
                copy_into_parts(value_views, [memoryview(temp)])
                if on_value is not None:
                    on_value(i)
        return found

    #: True where ``put_parts`` copies each value's parts straight into the
    #: medium; the generic version joins them into one buffer first.
    writes_from_parts: bool = False

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[Buffer]],
                  before_value: Callable[[int], object] | None = None) -> list[bool]:
        """``put`` where key i's value is the bytes of the buffers
        ``parts[i]``, in order (a caller writes a block straight from the
        places it is kept).  The buffers may be reused once it returns.

        ``before_value(i)``, when given, is called just before value i is
        copied (a store may skip it for a value it already holds), so the
        caller can finish the value's parts there, e.g. a header over a
        checksum of the rest, read while the rest is about to be copied
        from the CPU's caches.  This version joins each value's parts into
        one buffer, then puts."""
        if len(parts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parts)} lists of parts")
        values = []
        for i, value_parts in enumerate(parts):
            if before_value is not None:
                before_value(i)
            values.append(b"".join(byte_view(p) for p in value_parts))
        return self.put(keys, values)

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value, or ``None`` for a miss."""

    @abc.abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored.  Does not count as a use for LRU."""

    def prefix_len(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are all stored."""
        present = list(self.contains(keys))
        try:
            return present.index(False)     # a C loop: a Python one costs 0.2 ms on 8,192 keys
        except ValueError:
            return len(present)

    @abc.abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the keys; keys that are not stored are ignored."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Counts and sizes; cheap enough to call once a second."""

    def close(self) -> None:
        """Release connections, files and threads.  Idempotent."""

    # -- inspection, for operators (``ucm store ...``); not the hot path ----

    def iter_keys(self, batch: int = 1000) -> Iterator[list[bytes]]:
        """Every stored key, in lists of at most ``batch`` keys, in no set
        order.  A key stored for the whole walk is listed exactly once; one
        put or deleted during it may or may not be.  Deleting listed keys
        while walking is allowed.  Walks the whole store: for operators, not
        for the engine.  A store that cannot list raises ``StoreError``."""
        raise StoreError(
            f"store '{self.url}' cannot list its blocks ({type(self).__name__} does not "
            f"implement iter_keys); ask its maintainers, or clear it with its own tools")

    def peek(self, keys: Sequence[bytes], nbytes: int | None = None) -> list[tuple[int, bytes] | None]:
        """For each key, ``(size of the value, its first nbytes bytes)``
        (``nbytes=None``: the whole value), or ``None`` where nothing sound
        is stored.  Inspection: where the store can, it does not count as a
        use (LRU order, hit counters).  This fallback reads whole values."""
        values = self.get(keys)
        return [None if v is None else (len(v), v if nbytes is None else v[:nbytes]) for v in values]

    def last_used(self, keys: Sequence[bytes]) -> list[float | None]:
        """When each key was last written or read (seconds since the epoch),
        where the store keeps that; ``None`` where it does not, or for a key
        that is not stored."""
        check_batch(keys)
        return [None] * len(keys)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def byte_view(obj: object, writable: bool = False) -> memoryview:
    """A flat byte view of a value or buffer (bytes, bytearray, memoryview,
    numpy array...), without copying; ``writable`` for get_into's buffers."""
    view = obj if isinstance(obj, memoryview) else memoryview(obj)  # type: ignore[arg-type]
    if writable and view.readonly:
        raise TypeError(f"get_into needs writable buffers, got a read-only {type(obj).__name__}")
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise ValueError(f"store buffers must be C-contiguous, got {type(obj).__name__}")
        view = view.cast("B")
    return view


def copy_into_parts(dsts: Sequence[memoryview], srcs: Sequence[memoryview],
                    copy: Callable[[memoryview, memoryview], None] | None = None) -> None:
    """Copy the bytes of ``srcs`` (in order) into ``dsts`` (in order); their
    total sizes must be equal.  ``copy(dst, src)`` copies one overlap of
    equal size (default: a slice assignment)."""
    if sum(d.nbytes for d in dsts) != sum(s.nbytes for s in srcs):
        raise ValueError("the parts and the value differ in size")
    di = si = 0
    d_off = s_off = 0
    while di < len(dsts) and si < len(srcs):
        dst, src = dsts[di], srcs[si]
        n = min(dst.nbytes - d_off, src.nbytes - s_off)
        if n:
            if copy is None:
                dst[d_off:d_off + n] = src[s_off:s_off + n]
            else:
                copy(dst[d_off:d_off + n], src[s_off:s_off + n])
        d_off += n
        s_off += n
        if d_off == dst.nbytes:
            di, d_off = di + 1, 0
        if s_off == src.nbytes:
            si, s_off = si + 1, 0


def check_batch(keys: Sequence[bytes], others: Sequence[object] | None = None, what: str = "values") -> None:
    """Reject bad batches with a message that says what is wrong."""
    for key in keys:
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"store keys must be bytes, got {type(key).__name__}: {key!r}")
        if not key:
            raise ValueError("store keys must not be empty")
    if others is not None and len(others) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(others)} {what}")
