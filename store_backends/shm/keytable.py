"""The key table of an shm server: which keys are stored, readable by every
client without asking the server.

The server publishes, in a third shared-memory segment, an open-addressing
hash table of 64-bit key fingerprints (linear probing).  It is the only
writer; clients map the segment read-only and answer ``contains`` and
``prefix_len`` from it, with no round trip to the server.  A fingerprint
can in principle stand for two keys (about one chance in 2**64 per pair),
which makes a lookup say "stored" for a key that is not: the get that
follows then misses, as it would for a block evicted in between.

How a reader stays right while the server writes:

* single updates never move an entry: a commit writes a fingerprint into a
  free slot (empty, or a tombstone), a removal writes a tombstone over it.
  An aligned 8-byte store is seen whole or not at all, so a lookup racing
  an update answers as if it ran just before or just after it;
* whole-table changes (rebuild to clear tombstones, clear) are bracketed by
  a sequence number made odd first and even after (a seqlock): a reader
  that saw it odd or changed asks the server instead;
* the server marks the table closed when it exits, and a reader checks the
  server process is alive: a table left by a dead server is never used.

This relies on stores not being reordered with other stores, nor loads
with other loads (x86-64's memory model); elsewhere the server publishes
no table and clients ask it.  Owns the table's layout, the fingerprint and
both ends' operations on it.  Must not know keys' values, chunks or
sockets: ``index`` decides what is stored and calls the writer's methods,
``client`` calls the reader's.
"""

from __future__ import annotations

import platform
import threading

import numpy as np

#: The header: magic, seq, slots, live, used (live + tombstones), state.
HEADER_WORDS = 8
HEADER_NBYTES = HEADER_WORDS * 8
MAGIC = 0x3130_7962_6174_6B75      # "uktaby01" in little-endian bytes
_MAGIC, _SEQ, _SLOTS, _LIVE, _USED, _STATE = range(6)
ACTIVE, DISABLED, CLOSED = 1, 2, 3

EMPTY = np.uint64(0)
TOMBSTONE = np.uint64(1)
MIN_SLOTS = 4096
MAX_SLOTS = 1 << 23                 # 4M keys before the table switches itself off
MAX_PROBES = 64                     # a reader that probes this far asks the server
REBUILD_USED = 0.75                 # used/slots past which the writer rebuilds
MAX_LIVE = 0.5                      # live/slots past which the table is switched off

_K = np.uint64(0x9E3779B97F4A7C15)
_L = np.uint64(0x2545F4914F6CDD1D)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def supported() -> bool:
    """Whether this machine's memory model keeps the table's readers right."""
    return platform.machine().lower() in ("x86_64", "amd64")


def table_slots(num_chunks: int) -> int:
    """Slots for a server of ``num_chunks`` chunks: a power of two, four per
    chunk, so that the table is at most a quarter full while every value
    takes a chunk; at most ``MAX_SLOTS`` (64 MiB), for tiny chunks."""
    return min(MAX_SLOTS, max(MIN_SLOTS, 1 << (4 * max(1, num_chunks) - 1).bit_length()))


def segment_nbytes(slots: int) -> int:
    return HEADER_NBYTES + 8 * slots


class _Scratch:
    """A byte array reused across calls for the zero-padded keys: a fresh
    array of a few hundred KiB per call costs more than the arithmetic on it
    (the allocator maps it, the kernel faults it in, and it is handed back).
    One caller at a time holds it (``lock``); a caller that finds it held,
    or a batch too large, works with a fresh array."""

    LIMIT = 8 << 20

    def __init__(self) -> None:
        self.buffer = np.empty(0, np.uint8)
        self.lock = threading.Lock()

    def padded(self, n: int, width: int, held: bool) -> np.ndarray:
        """An (n, width) uint8 array of unspecified contents."""
        nbytes = n * width
        if not held or nbytes > self.LIMIT:
            return np.empty((n, width), np.uint8)
        if self.buffer.nbytes < nbytes:
            self.buffer = np.empty(max(nbytes, 64 << 10), np.uint8)
        return self.buffer[:nbytes].reshape(n, width)


_scratch = _Scratch()


def _fmix(h: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finaliser, in place (``tmp``: scratch of h's shape):
    a bijection with fmix(0) == 0."""
    for m in (_M1, _M2, None):
        np.right_shift(h, _S33, out=tmp)
        np.bitwise_xor(h, tmp, out=h)
        if m is not None:
            np.multiply(h, m, out=h)
    return h


def fingerprints(keys) -> np.ndarray:
    """A uint64 fingerprint per key (never 0 or 1), the same in every
    process of this host and whatever else is in the batch.  The key's
    bytes, zero-padded to 8-byte words, each word times an odd constant of
    its position and finalised, summed with the key's length, finalised
    again.  A zero word adds nothing, so padding a batch to its longest key
    changes no fingerprint, and the whole batch is a few array passes."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, np.uint64)
    held = _scratch.lock.acquire(blocking=False)
    try:
        return _fingerprints(keys, n, held)
    finally:
        if held:
            _scratch.lock.release()


def _fingerprints(keys, n: int, held: bool) -> np.ndarray:
    lengths = list(map(len, keys))
    first = lengths[0]
    data = np.frombuffer(b"".join(keys), np.uint8)
    if first and lengths.count(first) == n:     # keys of one length: content addresses
        width = -(-first // 8) * 8
        if width == first:
            raw = data.reshape(n, first)
        else:
            raw = _scratch.padded(n, width, held)
            raw[:, :first] = data.reshape(n, first)
            raw[:, first:] = 0
        h = np.full(n, first, np.uint64)
    else:
        lens = np.array(lengths, np.int64)
        if not lens.min():
            raise ValueError("store keys must not be empty")
        width = -(-int(lens.max()) // 8) * 8
        raw = _scratch.padded(n, width, held)
        raw.fill(0)
        # Row by row, the cells inside each key are the keys' bytes in order.
        raw[np.arange(width)[None, :] < lens[:, None]] = data
        h = lens.astype(np.uint64)
    words = raw.view(np.uint64)
    constants = _position_constants(words.shape[1])
    h *= _L
    if n <= _SMALL_BATCH:
        # All words of all keys at once: the same number of array passes
        # whatever the keys' length (for few keys, passes cost more than the
        # arithmetic).
        mixed = np.multiply(words, constants)
        h += _fmix(mixed, np.empty_like(mixed)).sum(axis=1, dtype=np.uint64)
        _fmix(h, np.empty(n, np.uint64))
    else:
        # A word position at a time, over columns that stay in cache.
        word, tmp = np.empty(n, np.uint64), np.empty(n, np.uint64)
        for j in range(words.shape[1]):
            np.multiply(words[:, j], constants[j], out=word)
            h += _fmix(word, tmp)
        _fmix(h, tmp)
    h[h < 2] += np.uint64(2)         # 0 and 1 mark empty slots and tombstones
    return h


_constants = np.zeros(0, np.uint64)
#: Batches of up to this many keys are fingerprinted all words at once.
_SMALL_BATCH = 256


def _position_constants(width: int) -> np.ndarray:
    """The odd multipliers of a key's words 0 .. width-1."""
    global _constants
    if len(_constants) < width:
        _constants = np.array([(2 * j + 1) * int(_K) % (1 << 64) for j in range(max(width, 16))], np.uint64)
    return _constants[:width]


class KeyTableWriter:
    """The server's side, over the writable segment ``buf`` of ``slots``
    slots (a power of two)."""

    def __init__(self, buf, slots: int) -> None:
        words = np.frombuffer(buf, np.uint64, count=HEADER_WORDS + slots)
        self.header = words[:HEADER_WORDS]
        self.table = words[HEADER_WORDS:]
        # The same words as Python ints: single slots are read and written
        # several times faster through these than through numpy scalars.
        self._head = memoryview(self.header).cast("B").cast("Q")
        self._slots = memoryview(self.table).cast("B").cast("Q")
        self.slots = slots
        self.mask = slots - 1
        self.table[:] = EMPTY
        self.header[:] = 0
        self.header[_SLOTS] = slots
        self.header[_STATE] = ACTIVE
        self.header[_MAGIC] = MAGIC

    @property
    def active(self) -> bool:
        return int(self.header[_STATE]) == ACTIVE

    def figures(self) -> dict:
        return {"key_table_slots": self.slots, "key_table_live": int(self.header[_LIVE]),
                "key_table_used": int(self.header[_USED]), "key_table_active": self.active}

    def insert(self, fp: int) -> int:
        """Publish ``fp``; its slot (-1 while the table is switched off).
        An insert that would fill more than half of the table switches it
        off instead (readers then ask the server), so that a batch of more
        keys than the table holds never probes a full table key by key;
        the caller's next rebuild switches it on again once the index is
        small enough."""
        head = self._head
        if head[_STATE] != ACTIVE:
            return -1
        if head[_LIVE] + 1 > MAX_LIVE * self.slots:
            head[_SEQ] += 1       # readers that started before see the change
            head[_STATE] = DISABLED
            head[_SEQ] += 1
            return -1
        table, mask = self._slots, self.mask
        pos = fp & mask
        for _ in range(self.slots):
            value = table[pos]
            if value <= 1:      # empty or a tombstone
                if value == 0:
                    head[_USED] += 1
                table[pos] = fp
                head[_LIVE] += 1
                return pos
            pos = (pos + 1) & mask
        return -1

    def remove(self, slot: int) -> None:
        head = self._head
        if slot >= 0 and head[_STATE] == ACTIVE:
            self._slots[slot] = 1       # a tombstone
            head[_LIVE] -= 1

    def needs_rebuild(self, num_stored: int) -> bool:
        """Whether to rebuild now, with ``num_stored`` keys stored: too many
        tombstones, or switched off and back to a quarter full."""
        if self.active:
            return int(self.header[_USED]) > REBUILD_USED * self.slots
        return num_stored <= MAX_LIVE * self.slots / 2

    def rebuild(self, fps: np.ndarray) -> np.ndarray | None:
        """Replace the table's contents with ``fps`` (every stored key's);
        their slots, or None with the table switched off when they would
        fill more than half of it.  Readers meanwhile ask the server."""
        header = self.header
        header[_SEQ] += np.uint64(1)          # odd: readers stay away
        try:
            self.table[:] = EMPTY
            header[_LIVE] = header[_USED] = 0
            if len(fps) > MAX_LIVE * self.slots:
                header[_STATE] = DISABLED
                return None
            slots = self._place(fps)
            header[_LIVE] = header[_USED] = len(fps)
            header[_STATE] = ACTIVE
            return slots
        finally:
            header[_SEQ] += np.uint64(1)

    def _place(self, fps: np.ndarray) -> np.ndarray:
        """Insert ``fps`` into the emptied table, all at once: each round
        places, for every free slot some pending key probes, the first such
        key, and moves the others one slot on."""
        table, mask = self.table, np.uint64(self.mask)
        n = len(fps)
        slots = np.empty(n, np.int64)
        pos = (fps & mask).astype(np.int64)
        pending = np.arange(n)
        placed = np.zeros(n, bool)
        while pending.size:
            cand = pos[pending]
            free = table[cand] == EMPTY
            uniq, first = np.unique(cand[free], return_index=True)
            winners = pending[free][first]
            table[uniq] = fps[winners]
            slots[winners] = uniq
            placed[winners] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + 1) & self.mask
        return slots

    def close(self) -> None:
        """The server is exiting: readers must ask (and find it gone)."""
        self.header[_STATE] = CLOSED


class KeyTableReader:
    """A client's side, over the read-only segment ``buf``."""

    def __init__(self, buf, slots: int) -> None:
        words = np.frombuffer(buf, np.uint64, count=HEADER_WORDS + slots)
        if int(words[_MAGIC]) != MAGIC or int(words[_SLOTS]) != slots or slots & (slots - 1):
            raise ValueError(f"the key table segment's header does not match {slots} slots")
        self.header = words[:HEADER_WORDS]
        self.table = words[HEADER_WORDS:]
        self.mask = np.int64(slots - 1)

    def lookup(self, fps: np.ndarray) -> np.ndarray | None:
        """Which of ``fps`` the table holds, or None when it cannot tell now
        (switched off, being rebuilt, closed, or a probe run too long)."""
        slots = self.find(fps)
        return None if slots is None else slots >= 0

    def find(self, fps: np.ndarray) -> np.ndarray | None:
        """The slot holding each of ``fps`` (-1: not held), or None when
        the table cannot tell now, as for ``lookup``."""
        header = self.header
        seq = int(header[_SEQ])
        if seq & 1 or int(header[_STATE]) != ACTIVE:
            return None
        table, mask = self.table, self.mask
        found = np.full(len(fps), -1, np.int64)
        pos = fps.astype(np.int64) & mask
        pending = np.arange(len(fps))
        for _ in range(MAX_PROBES):
            at = pos[pending]
            value = table[at]
            hit = value == fps[pending]
            found[pending[hit]] = at[hit]
            pending = pending[~hit & (value != EMPTY)]
            if not pending.size:
                break
            pos[pending] = (pos[pending] + 1) & mask
        else:
            return None
        if int(header[_SEQ]) != seq or int(header[_STATE]) != ACTIVE:
            return None
        return found
