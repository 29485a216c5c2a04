"""Where an shm server's values live, readable by every client without asking.

Beside the key table (``keytable``), the server publishes in a fourth
shared-memory segment, for each stored value that sits in one run of
chunks under a key of at most ``KEY_MAX`` bytes:

* ``where[slot]``: the first chunk of the value whose key the key table
  holds in ``slot`` (-1: none published);
* a record per chunk, written when a value whose first chunk it is gets
  committed: the key, the value's size and the chunk's generation at that
  time, bracketed by a version made odd first and even after (a seqlock).
  A put that names its keys before its values are copied (``prepare``)
  has its records written then and left odd, so unusable, until its commit
  makes them even (``complete``).

A client that finds a key in the key table reads ``where``, then the
chunk's generation, then the record, and uses the location only when the
record is whole (version even and unchanged), names the same key, and was
written for the chunk's current generation.  A chunk's generation is
bumped whenever it is freed, before it can be handed out again, so a record
of a value since evicted, overwritten or deleted never matches, whatever
``where`` said: ``where`` is only a hint, the record is the proof.  The
reader then copies the value and checks the generation again, as after a
server's answer; a value reused during the copy is a miss.

Relies, as the key table does, on x86-64 not reordering stores with stores
nor loads with loads.  Owns the segment's layout and both ends' operations
on it; must not know keys' fingerprints (``keytable``), decide what is
stored (``index``) or copy values (``client``).
"""

from __future__ import annotations

import numpy as np

#: Longest key whose location is published; longer keys' gets ask the server.
KEY_MAX = 64
#: Smallest chunk for which a server publishes locations: a record is 96
#: bytes per chunk, at most 2.3% of the data segment.
MIN_CHUNK_NBYTES = 4096

HEADER_WORDS = 8
HEADER_NBYTES = HEADER_WORDS * 8
MAGIC = 0x3130_7365_7265_6877      # "wheres01" in little-endian bytes
_MAGIC, _SLOTS, _CHUNKS = range(3)

RECORD = np.dtype([("ver", "<u8"), ("gen", "<u8"), ("size", "<i8"), ("key_len", "<u8"),
                   ("key", "u1", (KEY_MAX,))])


def published(chunk_nbytes: int) -> bool:
    """Whether a server of chunks of this size publishes locations."""
    return chunk_nbytes >= MIN_CHUNK_NBYTES


def segment_nbytes(slots: int, num_chunks: int) -> int:
    return HEADER_NBYTES + 8 * slots + RECORD.itemsize * num_chunks


def _views(buf, slots: int, num_chunks: int):
    header = np.frombuffer(buf, np.uint64, count=HEADER_WORDS)
    where = np.frombuffer(buf, np.int64, count=slots, offset=HEADER_NBYTES)
    records = np.frombuffer(buf, RECORD, count=num_chunks, offset=HEADER_NBYTES + 8 * slots)
    return header, where, records


def key_matrix(keys, width: int = KEY_MAX) -> tuple[np.ndarray, np.ndarray]:
    """The keys as an (n, width) uint8 matrix, zero-padded, and their
    lengths; a key longer than ``width`` gets a zero row and length -1,
    which no record holds."""
    n = len(keys)
    lengths = np.fromiter(map(len, keys), np.int64, n)
    matrix = np.zeros((n, width), np.uint8)
    if n and int(lengths.min()) == int(lengths.max()) <= width:
        first = int(lengths[0])
        matrix[:, :first] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, first)
        return matrix, lengths
    for i, key in enumerate(keys):
        if len(key) <= width:
            matrix[i, :len(key)] = np.frombuffer(key, np.uint8)
    lengths[lengths > width] = -1
    return matrix, lengths


class LocationWriter:
    """The server's side, over the writable segment ``buf``."""

    def __init__(self, buf, slots: int, num_chunks: int) -> None:
        self.header, self.where, self.records = _views(buf, slots, num_chunks)
        self.where[:] = -1
        self.records["ver"] = 0
        self.records["key_len"] = 0
        self.header[:] = 0
        self.header[_SLOTS] = slots
        self.header[_CHUNKS] = num_chunks
        self.header[_MAGIC] = MAGIC

    def publish(self, slots: np.ndarray, firsts: np.ndarray, keys, sizes: np.ndarray, gens: np.ndarray) -> None:
        """Record that key ``keys[i]`` holds ``sizes[i]`` bytes from chunk
        ``firsts[i]`` on (one run), committed while that chunk's generation
        is ``gens[i]``, and point key-table slot ``slots[i]`` at it.  The
        chunks are distinct (each is one value's first); keys longer than
        ``KEY_MAX`` and slots < 0 are left out."""
        lengths = np.fromiter(map(len, keys), np.int64, len(keys))
        keep = (slots >= 0) & (firsts >= 0) & (lengths <= KEY_MAX)
        idx = np.flatnonzero(keep)
        if not idx.size:
            return
        firsts = self._write(firsts, keys, sizes, gens, idx)
        self.records["ver"][firsts] += np.uint64(1)
        self.where[slots[idx]] = firsts

    def prepare(self, firsts: np.ndarray, keys, sizes: np.ndarray, gens: np.ndarray) -> None:
        """Write the records of values about to be copied in (as ``publish``
        says, with no slots yet), and leave them odd: no reader uses them
        until ``complete``.  A record prepared and never completed stays
        unusable until its chunk's next value is published."""
        lengths = np.fromiter(map(len, keys), np.int64, len(keys))
        idx = np.flatnonzero((firsts >= 0) & (lengths <= KEY_MAX))
        if idx.size:
            self._write(firsts, keys, sizes, gens, idx)

    def complete(self, slots: np.ndarray, firsts: np.ndarray) -> None:
        """Make the prepared records of ``firsts`` whole and point key-table
        ``slots`` at them (each first chunk once; as ``prepare`` left out,
        keys longer than ``KEY_MAX`` must be left out here)."""
        keep = (slots >= 0) & (firsts >= 0)
        firsts = firsts[keep]
        self.records["ver"][firsts] += np.uint64(1)
        self.where[slots[keep]] = firsts

    def _write(self, firsts: np.ndarray, keys, sizes: np.ndarray, gens: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Make records ``firsts[idx]`` odd and write them; those chunks."""
        matrix = key_matrix(keys if idx.size == len(keys) else [keys[i] for i in idx])
        firsts = firsts[idx]
        records = self.records
        records["ver"][firsts] |= np.uint64(1)          # odd: a reader of this record stays away
        records["gen"][firsts] = gens[idx]
        records["size"][firsts] = sizes[idx]
        records["key_len"][firsts] = matrix[1]
        records["key"][firsts] = matrix[0]
        return firsts

    def forget(self, slot: int) -> None:
        """The key in ``slot`` is gone (its record no longer matches anyway)."""
        if slot >= 0:
            self.where[slot] = -1

    def clear(self) -> None:
        self.where[:] = -1


class LocationReader:
    """A client's side, over the read-only segment ``buf``."""

    def __init__(self, buf, slots: int, num_chunks: int) -> None:
        self.header, self.where, self.records = _views(buf, slots, num_chunks)
        if (int(self.header[_MAGIC]) != MAGIC or int(self.header[_SLOTS]) != slots
                or int(self.header[_CHUNKS]) != num_chunks):
            raise ValueError(f"the locations segment's header does not match {slots} slots and "
                             f"{num_chunks} chunks")
        self.num_chunks = num_chunks

    def locate(self, keys, slots: np.ndarray, gen: np.ndarray, chunk_nbytes: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(first chunk, size, generation, proven) of each of ``keys``,
        found in key-table ``slots``, as a server's GET answers them; where
        ``proven`` is False the published records cannot prove the
        location now (the caller asks the server for that key).  ``gen`` is
        the chunks' shared generation array."""
        firsts = self.where[slots]
        ok = (firsts >= 0) & (firsts < self.num_chunks)
        firsts = np.where(ok, firsts, 0)
        gens = gen[firsts]                       # before the record: the record must be of this generation
        records = self.records
        before = records["ver"][firsts]
        rec_gens = records["gen"][firsts]
        sizes = records["size"][firsts]
        key_lens = records["key_len"][firsts]
        rec_keys = records["key"][firsts]
        after = records["ver"][firsts]
        matrix = key_matrix(keys)
        ok &= ((before == after) & (before & np.uint64(1) == 0) & (rec_gens == gens)
               & (key_lens == matrix[1].astype(np.uint64)) & (rec_keys == matrix[0]).all(axis=1)
               & (sizes > 0) & (firsts * chunk_nbytes + sizes <= self.num_chunks * chunk_nbytes))
        return firsts, sizes, gens, ok
