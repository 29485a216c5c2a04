"""The index of an shm server: which key holds which chunks, and the operations on it.

Owns the server's state and the requests that read or change it: the LRU
index ``key -> Entry`` (chunks + size), the free chunks, the leases of
writers that took chunks and have not committed them (also reservations:
free chunks held for a writer's next put, until it names their keys),
eviction, the sweep that reclaims the leases of dead or stuck writers, the
counters ``stats`` reports, and the handlers of the ops that touch them
(``op_get``, ``op_alloc``, ``op_declare``, ``op_commit``...), which unpack
keys and pack their replies as ``protocol`` says.  Bumps a chunk's
generation (in the array it is handed, the shared generation segment)
whenever it frees the chunk, before the chunk can be handed out again, and
keeps the key table (``keytable``) and the published locations
(``locations``), where the server publishes them, in step with the index.

Pure bookkeeping in one process: must not touch a socket, a file, a signal
or the values' bytes; the server process (``server``) owns those and calls
into this.
"""

from __future__ import annotations

import array
import collections
import struct
import time

import numpy as np

from ..process import pid_alive
from .keytable import KeyTableWriter, fingerprints
from .locations import KEY_MAX, LocationWriter
from .protocol import RELEASED, RESERVATION, TOUCH_COUNTS, Alloc, Flag, Status, pack_keys, unpack_keys

#: One reservation holds at most 1/RESERVE_ONE of the chunks, all of them
#: together at most 1/RESERVE_ALL.
RESERVE_ONE = 16
RESERVE_ALL = 8
_NO_RESERVATION = [RESERVATION.pack(0), b"", b""]
_RUN = struct.Struct("<ii")      # a run of chunks: first, count


def _flat(runs: list[tuple[int, int]]) -> bytes:
    """Runs as the wire and ``Entry.runs`` hold them: int32 first, count pairs."""
    return array.array("i", [x for run in runs for x in run]).tobytes()


def _take_runs(runs: collections.deque[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Take the first ``n`` chunks off ``runs`` (first chunk, count pairs)."""
    taken = []
    while n:
        start, count = runs[0]
        if n < count:
            runs[0] = (start + n, count - n)
            taken.append((start, n))
            break
        runs.popleft()
        taken.append((start, count))
        n -= count
    return taken


class Entry:
    """A committed value: ``runs`` is (start, count) int32 pairs as bytes;
    ``fp`` its key's fingerprint and ``slot`` where the key table holds it
    (-1: nowhere)."""

    __slots__ = ("size", "runs", "nruns", "nchunks", "first", "gen", "fp", "slot")

    def __init__(self, size: int, runs: bytes, nruns: int, nchunks: int, first: int, gen: int) -> None:
        self.size = size
        self.runs = runs
        self.nruns = nruns
        self.nchunks = nchunks
        self.first = first
        self.gen = gen
        self.fp = 0
        self.slot = -1


class Lease:
    """Chunks handed to one writer and not yet committed: for the keys of
    its ALLOC, or (``reserved``) for the values of its next put, keys not
    known yet."""

    __slots__ = ("pid", "created", "overwrite", "items", "reserved", "fps", "prepared")

    def __init__(self, pid: int, overwrite: bool, reserved: bool = False) -> None:
        self.pid = pid
        self.created = time.monotonic()
        self.overwrite = overwrite
        self.reserved = reserved
        self.fps: np.ndarray | None = None      # the keys' fingerprints, once known
        self.prepared = False                   # the values' location records are written, not yet whole
        self.items: list[tuple[bytes, Entry, list[tuple[int, int]]]] = []


class ChunkIndex:
    """The index, free list and leases of ``num_chunks`` chunks of
    ``chunk_nbytes``.  ``gen`` (one uint64 per chunk) must be set before the
    first request: the server creates it with the segments, and ``table``
    (and ``where``) with them where it publishes a key table (and
    locations)."""

    def __init__(self, num_chunks: int, chunk_nbytes: int, lease_timeout_s: float) -> None:
        self.num_chunks = num_chunks
        self.chunk_nbytes = chunk_nbytes
        self.lease_timeout_s = lease_timeout_s
        self.epoch = 0          # the server's, set by it
        self.gen: np.ndarray | None = None
        self.table: KeyTableWriter | None = None
        self.where: LocationWriter | None = None
        self.index: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.free: collections.deque[tuple[int, int]] = collections.deque([(0, num_chunks)])
        self.free_chunks = num_chunks
        self.leased_chunks = 0
        self.reserved_chunks = 0
        self.leases: dict[int, Lease] = {}
        self.next_lease = 1
        self.nbytes = 0
        self.counters = collections.Counter()

    # -- chunk bookkeeping

    def _free_runs(self, runs: list[tuple[int, int]] | bytes) -> None:
        if isinstance(runs, bytes):
            flat = array.array("i", runs)
            runs = list(zip(flat[0::2], flat[1::2]))
        gen = self.gen
        for start, count in runs:
            # Bump before the chunks can be handed out again, so a reader
            # that copied from them sees the change when it re-checks.
            gen[start:start + count] += 1
            self.free_chunks += count
            if self.free:
                s, c = self.free[-1]
                if s + c == start:
                    self.free[-1] = (s, c + count)
                    continue
            self.free.append((start, count))

    def _evict_oldest(self) -> None:
        key, entry = self.index.popitem(last=False)
        self._unpublish(entry)
        self._drop(entry)
        self.counters["evictions"] += 1

    def _drop(self, entry: Entry) -> None:
        self.nbytes -= entry.size
        if entry.nchunks:
            self._free_runs(entry.runs)

    def _unpublish(self, entry: Entry) -> None:
        if self.table is not None:
            self.table.remove(entry.slot)
            if self.where is not None:
                self.where.forget(entry.slot)
            entry.slot = -1

    def _publish_locations(self, items: list[tuple[bytes, Entry]]) -> None:
        """Tell clients where the values of ``items`` (stored, one run of
        chunks each) live, in their key-table slots."""
        where = self.where
        items = [(key, e) for key, e in items if e.nruns == 1 and e.slot >= 0]
        if where is None or not items:
            return
        n = len(items)
        where.publish(np.fromiter((e.slot for _k, e in items), np.int64, n),
                      np.fromiter((e.first for _k, e in items), np.int64, n),
                      [key for key, _e in items],
                      np.fromiter((e.size for _k, e in items), np.int64, n),
                      np.fromiter((e.gen for _k, e in items), np.uint64, n))

    def _prepare_locations(self, items: list[tuple[bytes, Entry, list]]) -> None:
        """Write the records of values being copied into their chunks, left
        unusable until ``_commit`` completes them."""
        items = [(key, e) for key, e, _r in items if e.nruns == 1]
        if self.where is None or not items:
            return
        n = len(items)
        self.where.prepare(np.fromiter((e.first for _k, e in items), np.int64, n), [key for key, _e in items],
                           np.fromiter((e.size for _k, e in items), np.int64, n),
                           np.fromiter((e.gen for _k, e in items), np.uint64, n))

    def _complete_locations(self, items: list[tuple[bytes, Entry]]) -> None:
        """``_publish_locations`` for values whose records were prepared."""
        items = [e for key, e in items if e.nruns == 1 and e.slot >= 0 and len(key) <= KEY_MAX]
        if self.where is not None and items:
            n = len(items)
            self.where.complete(np.fromiter((e.slot for e in items), np.int64, n),
                                np.fromiter((e.first for e in items), np.int64, n))

    def _sync_table(self) -> None:
        """Rebuild the key table when tombstones fill it, or when it was
        switched off and the index is small enough again."""
        table = self.table
        if table is None or not table.needs_rebuild(len(self.index)):
            return
        entries = list(self.index.values())
        if self.where is not None:
            self.where.clear()
        slots = table.rebuild(np.fromiter((e.fp for e in entries), np.uint64, len(entries)))
        for i, entry in enumerate(entries):
            entry.slot = -1 if slots is None else int(slots[i])
        self._publish_locations(list(self.index.items()))

    def _allocate(self, nchunks: int) -> list[tuple[int, int]] | None:
        if nchunks > self.num_chunks - self.leased_chunks:
            return None
        while self.free_chunks < nchunks and self.index:
            self._evict_oldest()
        if self.free_chunks < nchunks:
            return None
        runs: list[tuple[int, int]] = []
        need = nchunks
        free = self.free
        while need:
            start, count = free[0]
            if count <= need:
                free.popleft()
                take = count
            else:
                free[0] = (start + need, count - need)
                take = need
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + take)
            else:
                runs.append((start, take))
            need -= take
        self.free_chunks -= nchunks
        return runs

    def _release_lease(self, lease: Lease) -> None:
        for _key, entry, runs in lease.items:
            if entry.nchunks:
                self.leased_chunks -= entry.nchunks
                if lease.reserved:
                    self.reserved_chunks -= entry.nchunks
                self._free_runs(runs)

    def _add_lease(self, lease: Lease) -> int:
        lease_id = self.next_lease
        self.next_lease += 1
        self.leases[lease_id] = lease
        return lease_id

    def _reserve(self, pid: int, sizes_frame) -> list[bytes]:
        """A reservation for writer ``pid``'s next put, of values of the
        sizes in ``sizes_frame``: chunks taken from free ones only (a
        reservation never evicts, so LRU order is what the puts make it),
        within ``RESERVE_ONE`` and ``RESERVE_ALL``.  The reply frames."""
        sizes = array.array("q")
        sizes.frombytes(sizes_frame)
        chunk = self.chunk_nbytes
        need = [-(-size // chunk) for size in sizes]
        total = sum(need)
        if (not sizes or min(sizes) <= 0 or total > self.num_chunks // RESERVE_ONE
                or self.reserved_chunks + total > self.num_chunks // RESERVE_ALL or total > self.free_chunks):
            self.counters["reservations_refused"] += 1
            return _NO_RESERVATION
        lease = Lease(pid, overwrite=False, reserved=True)
        taken = self._allocate(total)       # free chunks cover them: nothing is evicted
        if len(taken) == 1:
            # The common case, one run: each value's chunks follow the last's
            # (packed here: ``_flat`` per value cost a quarter of a COMMIT).
            start = taken[0][0]
            for nchunks in need:
                lease.items.append((b"", Entry(nchunks * chunk, _RUN.pack(start, nchunks), 1, nchunks, start, 0),
                                    [(start, nchunks)]))
                start += nchunks
        else:
            rest = collections.deque(taken)
            for nchunks in need:
                # Each value's chunks, carved in order from what was taken.
                runs = _take_runs(rest, nchunks)
                lease.items.append((b"", Entry(nchunks * chunk, _flat(runs), len(runs), nchunks, runs[0][0], 0),
                                    runs))
        self.leased_chunks += total
        self.reserved_chunks += total
        self.counters["reservations"] += 1
        nruns = array.array("I", [entry.nruns for _k, entry, _r in lease.items])
        return [RESERVATION.pack(self._add_lease(lease)), nruns.tobytes(),
                b"".join(entry.runs for _k, entry, _r in lease.items)]

    def _bind(self, lease: Lease, keys: list[bytes], sizes) -> list[tuple[bytes, Entry, list[tuple[int, int]]]]:
        """The items of a used reservation: value i in item i's chunks,
        trimmed to its size; the chunks no value uses go back to the free
        ones."""
        chunk = self.chunk_nbytes
        self.reserved_chunks -= sum(entry.nchunks for _k, entry, _r in lease.items)
        items = []
        for i, (_none, held, runs) in enumerate(lease.items):
            need = -(-sizes[i] // chunk) if i < len(keys) else 0
            if need == held.nchunks:
                held.size = sizes[i]        # fills the chunks it reserved: they stand as they are
                items.append((keys[i], held, runs))
                continue
            spare = collections.deque(runs)
            keep = _take_runs(spare, need)
            self.leased_chunks -= held.nchunks - need
            self._free_runs(spare)
            if i < len(keys):
                items.append((keys[i], Entry(sizes[i], _flat(keep), len(keep), need, keep[0][0] if keep else -1, 0),
                              keep))
        # Generations as of now: the chunks' own, unchanged since they were reserved.
        firsts = [entry.first for _k, entry, _r in items if entry.nchunks]
        if firsts:
            gens = iter(self.gen[firsts].tolist())
            for _k, entry, _r in items:
                if entry.nchunks:
                    entry.gen = next(gens)
        return items

    def sweep(self, now: float) -> None:
        """Reclaim the leases of writers that are gone or older than
        ``lease_timeout_s``."""
        for lease_id, lease in list(self.leases.items()):
            if not pid_alive(lease.pid) or now - lease.created > self.lease_timeout_s:
                del self.leases[lease_id]
                self._release_lease(lease)
                self.counters["leases_reclaimed"] += 1

    def figures(self) -> dict:
        """What ``stats`` reports of the index (sizes in bytes, counts of
        chunks, blocks and leases)."""
        return {
            "num_blocks": len(self.index), "nbytes": self.nbytes,
            "capacity_nbytes": self.num_chunks * self.chunk_nbytes,
            "free_chunks": self.free_chunks, "leased_chunks": self.leased_chunks,
            "used_chunks": self.num_chunks - self.free_chunks - self.leased_chunks,
            "num_leases": len(self.leases), "reserved_chunks": self.reserved_chunks,
        }

    # -- ops: (flags, key_len, arg, frames) -> (status, reply frames)

    def op_contains(self, flags, key_len, arg, frames):
        keys, _ = unpack_keys(key_len, frames)
        return Status.OK, [bytes(map(self.index.__contains__, keys))]

    def op_prefix(self, flags, key_len, arg, frames):
        keys, _ = unpack_keys(key_len, frames)
        present = bytes(map(self.index.__contains__, keys))
        n = present.find(b"\x00")
        return Status.OK, [struct.pack("<q", len(keys) if n < 0 else n)]

    def op_get(self, flags, key_len, arg, frames):
        keys, _ = unpack_keys(key_len, frames)
        index = self.index
        touch = not flags & Flag.NO_TOUCH
        sizes = array.array("q")
        gens = array.array("Q")
        firsts = array.array("i")
        nruns = array.array("I")
        runs = []
        hits = 0
        for key in keys:
            entry = index.get(key)
            if entry is None:
                sizes.append(-1)
                gens.append(0)
                firsts.append(-1)
                nruns.append(0)
                continue
            if touch:
                index.move_to_end(key)
            hits += 1
            sizes.append(entry.size)
            gens.append(entry.gen)
            firsts.append(entry.first)
            nruns.append(entry.nruns)
            runs.append(entry.runs)
        if touch:
            # arg carries the reads the client found torn or mis-sized since
            # its last get: they were counted as hits here but were misses.
            late = max(0, min(arg, self.counters["hits"] + hits))
            self.counters["gets"] += len(keys)
            self.counters["hits"] += hits - late
            self.counters["misses"] += len(keys) - hits + late
        return Status.OK, [sizes.tobytes(), gens.tobytes(), firsts.tobytes(), nruns.tobytes(), b"".join(runs)]

    def op_alloc(self, flags, key_len, arg, frames):
        keys, used = unpack_keys(key_len, frames)
        sizes = array.array("q")
        sizes.frombytes(frames[used])
        if len(sizes) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        used += 1
        if flags & Flag.TOUCHED:
            used += self._touch(0, frames[used:])
        if flags & Flag.RELEASE:
            epoch, reservation = RELEASED.unpack(frames[used])
            held = self.leases.get(reservation)
            if held is not None and held.reserved and held.pid == arg and epoch == self.epoch:
                del self.leases[reservation]
                self._release_lease(held)
        overwrite = bool(flags & Flag.OVERWRITE)
        lease = Lease(pid=arg, overwrite=overwrite)
        chunk = self.chunk_nbytes
        status = bytearray(len(keys))
        nruns = array.array("I")
        run_frames = []
        index = self.index
        for i, (key, size) in enumerate(zip(keys, sizes)):
            if not overwrite and key in index:
                index.move_to_end(key)
                status[i] = Alloc.PRESENT
                nruns.append(0)
                continue
            nchunks = -(-size // chunk) if size > 0 else 0
            runs = self._allocate(nchunks) if size >= 0 else None
            if runs is None:
                status[i] = Alloc.FAILED
                nruns.append(0)
                self.counters["put_failures"] += 1
                continue
            self.leased_chunks += nchunks
            flat = _flat(runs)
            first = runs[0][0] if runs else -1
            gen = int(self.gen[first]) if runs else 0
            lease.items.append((key, Entry(size, flat, len(runs), nchunks, first, gen), runs))
            nruns.append(len(runs))
            run_frames.append(flat)
        self.counters["puts"] += len(keys)
        self._sync_table()   # evictions left tombstones
        lease_id = self._add_lease(lease) if lease.items else 0
        return Status.OK, [struct.pack("<q", lease_id), bytes(status), nruns.tobytes(), b"".join(run_frames)]

    def op_commit(self, flags, key_len, arg, frames):
        lease = self.leases.pop(arg, None)
        if lease is None:
            return Status.LEASE_GONE, []
        if lease.reserved:
            # A reservation its writer did not name keys for (its DECLARE
            # was refused): nothing to commit, and it is of no use now.
            self._release_lease(lease)
            return Status.LEASE_GONE, []
        self._commit(lease.items, lease.overwrite, lease.fps, lease.prepared)
        return Status.OK, self._reserve(lease.pid, frames[-1]) if flags & Flag.RESERVE else []

    def op_declare(self, flags, key_len, arg, frames):
        """Name the keys of the values a writer is about to copy into
        reservation ``arg``: from now on it is a lease of those keys, as
        an ALLOC hands out, and the writer's COMMIT commits it.  Sent
        ahead of the copies and not answered, so that this work overlaps
        them; a DECLARE that does not fit its reservation leaves it
        reserved, and the COMMIT finds nothing to commit."""
        keys, used = unpack_keys(key_len, frames)
        sizes = array.array("q")
        sizes.frombytes(frames[used])
        used += 1
        lease = self.leases.get(arg)
        if lease is None or not lease.reserved:
            return None
        if len(sizes) != len(keys) or len(keys) > len(lease.items) or any(
                not 0 <= size <= entry.nchunks * self.chunk_nbytes
                for size, (_k, entry, _r) in zip(sizes, lease.items)):
            raise ValueError(f"a put of {len(keys)} keys and {len(sizes)} sizes does not fit its reservation")
        if flags & Flag.TOUCHED:
            self._touch(0, frames[used:])
        lease.items = self._bind(lease, keys, sizes)
        lease.reserved = False
        lease.overwrite = bool(flags & Flag.OVERWRITE)
        if self.table is not None:
            lease.fps = fingerprints(keys)
        self._prepare_locations(lease.items)
        lease.prepared = True
        self.counters["puts"] += len(keys)
        return None

    def _commit(self, items: list[tuple[bytes, Entry, list[tuple[int, int]]]], overwrite: bool,
                fps: np.ndarray | None = None, prepared: bool = False) -> None:
        """Make leased values visible under their keys (a key another writer
        committed first keeps that value, unless ``overwrite``); ``fps``:
        the keys' fingerprints, where already known; ``prepared``: whether
        their location records are already written."""
        index = self.index
        table = self.table
        if table is not None and fps is None:
            fps = fingerprints([key for key, _entry, _runs in items])
        committed = []
        for i, (key, entry, runs) in enumerate(items):
            self.leased_chunks -= entry.nchunks
            old = index.get(key)
            if old is not None:
                if not overwrite:
                    # Another writer committed the same key first; its value
                    # stands and ours was never visible.
                    if entry.nchunks:
                        self._free_runs(runs)
                    index.move_to_end(key)
                    continue
                del index[key]
                self._drop(old)
                entry.fp, entry.slot = old.fp, old.slot     # the same key, already published
            elif table is not None:
                entry.fp = int(fps[i])
                entry.slot = table.insert(entry.fp)
            index[key] = entry
            self.nbytes += entry.size
            committed.append((key, entry))
        if prepared:
            self._complete_locations(committed)
        else:
            self._publish_locations(committed)
        self._sync_table()

    def op_abort(self, flags, key_len, arg, frames):
        lease = self.leases.pop(arg, None)
        if lease is not None:
            self._release_lease(lease)
        return Status.OK, []

    def op_delete(self, flags, key_len, arg, frames):
        keys, _ = unpack_keys(key_len, frames)
        for key in keys:
            entry = self.index.pop(key, None)
            if entry is not None:
                self._unpublish(entry)
                self._drop(entry)
        self._sync_table()
        return Status.OK, []

    def op_clear(self, flags, key_len, arg, frames):
        while self.index:
            _key, entry = self.index.popitem(last=False)
            self._drop(entry)
        if self.where is not None:
            self.where.clear()
        if self.table is not None:
            self.table.rebuild(np.zeros(0, np.uint64))
        return Status.OK, []

    def op_touch(self, flags, key_len, arg, frames):
        self._touch(arg, frames)
        return Status.OK, []

    def _touch(self, late: int, frames) -> int:
        """Apply a client's uses of keys it read from published locations
        (``TOUCH_COUNTS`` then the keys' frames): the keys still stored
        become the most recently used, and its gets and hits are counted,
        ``late`` of the hits as misses (reads found torn since).  How many
        frames they took."""
        touch_len, gets, hits = TOUCH_COUNTS.unpack(frames[0])
        if not 0 <= hits <= gets:
            raise ValueError(f"touch of {hits} hits in {gets} gets")
        keys, used = unpack_keys(touch_len, frames[1:])
        index = self.index
        for key in keys:
            if key in index:
                index.move_to_end(key)
        late = max(0, min(late, self.counters["hits"] + hits))
        self.counters["gets"] += gets
        self.counters["hits"] += hits - late
        self.counters["misses"] += gets - hits + late
        return 1 + used

    def op_keys(self, flags, key_len, arg, frames):
        # Every committed key, least recently used first, as key_len (i64)
        # and the key frames of pack_keys.  A snapshot: an index of a
        # million 18-byte keys is an 18 MB reply, sent once per walk.
        key_len, key_frames = pack_keys(list(self.index))
        return Status.OK, [struct.pack("<q", key_len), *key_frames]
