"""The shm server's key table: lookups a client answers without a request.

The table's two ends are driven directly over a plain buffer (small tables,
so that probe chains, tombstones, rebuilds and switching off all happen),
against the server's own index (``ChunkIndex``) as the model; then a real
server and clients show lookups answered while the server cannot answer,
and never from a table its dead server left behind."""

from __future__ import annotations

import collections
import os
import random
import signal

import numpy as np
import pytest

from store_backends import OpenMode, StoreUnavailableError, open_store
from store_backends.shm import keytable, locations
from store_backends.shm.index import ChunkIndex
from store_backends.shm.keytable import KeyTableReader, KeyTableWriter, fingerprints
from store_backends.shm.protocol import Alloc, Status, pack_keys
from store_backends.process import pid_alive
from test_shm import shm, value_for, wait_for  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(not keytable.supported(), reason="the server publishes no key table here")


def _table(slots: int) -> tuple[KeyTableWriter, KeyTableReader]:
    buf = bytearray(keytable.segment_nbytes(slots))
    return KeyTableWriter(buf, slots), KeyTableReader(buf, slots)


def test_fingerprints_are_stable_distinct_and_never_mark_a_free_slot():
    keys = [b"a", b"a\0", b"\0a", b"ab", b"block-%06d" % 7, bytes(32), bytes(31) + b"\1"]
    one_by_one = np.concatenate([fingerprints([k]) for k in keys])
    assert fingerprints(keys).tolist() == one_by_one.tolist()
    assert len(set(one_by_one.tolist())) == len(keys)
    rng = random.Random(5)
    many = [rng.randbytes(32) for _ in range(50_000)] + [b"key-%08d" % i for i in range(50_000)]
    fps = fingerprints(many)
    assert len(set(fps.tolist())) == len(many)
    assert int(fps.min()) >= 2
    # Small batches are hashed all words at once, large ones a word at a
    # time: a key's fingerprint is the same either way, one length or mixed.
    for batch in (many[:1000], [b"x" * (i % 70 + 1) for i in range(1000)]):
        whole = fingerprints(batch).tolist()
        assert whole == np.concatenate([fingerprints(batch[i:i + 10]) for i in range(0, 1000, 10)]).tolist()
    # And the same as ever (clients and servers of other builds share tables).
    assert fingerprints([b"block-000007", bytes(40)]).tolist() == [3290453045244946923, 5826075939291131100]
    with pytest.raises(ValueError, match="empty"):
        fingerprints([b"x", b""])


def test_probe_chains_tombstones_and_when_a_reader_must_ask():
    writer, reader = _table(16)
    chain = np.array([3 + 16 * i for i in range(1, 7)], np.uint64)    # one home slot for all
    slots = [writer.insert(int(fp)) for fp in chain]
    assert slots == [3, 4, 5, 6, 7, 8]
    writer.remove(slots[1])
    assert reader.lookup(chain).tolist() == [True, False, True, True, True, True]
    assert writer.insert(int(chain[1])) == 4          # the tombstone is reused
    absent = np.array([3 + 16 * 9, 5], np.uint64)
    assert reader.lookup(np.concatenate([chain, absent])).tolist() == [True] * 6 + [False, False]
    header = writer.header
    header[1] += np.uint64(1)                          # a rebuild under way
    assert reader.lookup(chain) is None
    header[1] += np.uint64(1)
    assert reader.lookup(chain) is not None
    writer.close()
    assert reader.lookup(chain) is None


def test_an_insert_past_half_full_switches_the_table_off_at_once():
    """A batch of more keys than the table holds must not probe a full
    table key by key: the insert that would pass half full switches the
    table off, and readers ask the server."""
    writer, reader = _table(64)
    fps = np.arange(2, 2 + 40, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    fps[fps < 2] += np.uint64(2)
    slots = [writer.insert(int(fp)) for fp in fps]
    assert all(s >= 0 for s in slots[:32]) and slots[32:] == [-1] * 8
    assert not writer.active and reader.lookup(fps[:4]) is None


def test_the_table_answers_as_the_index_does_through_every_change():
    """Random puts (some of empty values, which take no chunk, so that the
    index outgrows a small table), overwrites, deletes, evictions and
    clears; after each, every key asked of the table is answered as the
    index answers, or the table says it cannot tell only while switched
    off."""
    index = ChunkIndex(num_chunks=12, chunk_nbytes=64, lease_timeout_s=60)
    index.gen = np.zeros(12, np.uint64)
    index.table, reader = _table(64)
    universe = [b"k%03d" % i for i in range(80)]
    fps = fingerprints(universe)
    rng = random.Random(11)
    seen = {"off": 0, "on_again": 0}
    was_active = True
    for step in range(1500):
        roll = rng.random()
        growing = (step // 250) % 2 == 0       # phases that fill the table past half, then empty it
        if roll < (0.85 if growing else 0.2):
            picked = rng.sample(universe, rng.randint(1, 6))
            key_len, frames = pack_keys(picked)
            sizes = np.array([rng.choice([0] * 12 + [40, 130]) for _ in picked], np.int64).tobytes()
            status, out = index.op_alloc(int(rng.random() < 0.2), key_len, os.getpid(), [*frames, sizes])
            lease = int.from_bytes(out[0], "little", signed=True)
            if lease:
                assert index.op_commit(0, 0, lease, [])[0] == Status.OK
            assert set(out[1]) <= {Alloc.NEW, Alloc.PRESENT, Alloc.FAILED}
        elif growing or roll < 0.97:
            key_len, frames = pack_keys(rng.sample(universe, rng.randint(1, 10)))
            index.op_delete(0, key_len, 0, frames)
        else:
            index.op_clear(0, 0, 0, [])
        found = reader.lookup(fps)
        stored = [k in index.index for k in universe]
        if index.table.active:
            assert found is not None and found.tolist() == stored
            seen["on_again"] += not was_active
        else:
            assert found is None
            seen["off"] += was_active
        was_active = index.table.active
    rebuilds = int(index.table.header[1]) // 2
    assert rebuilds > 3 and seen["off"] and seen["on_again"], (rebuilds, seen)


def test_lookups_and_gets_are_answered_while_the_server_cannot_answer(shm):
    """A stopped (SIGSTOP) server answers no request, so lookups and gets
    that asked it would fail after ``timeout``; they are answered from the
    key table and the published locations, including what another client
    changed just before.  Only a value the locations cannot prove (here a
    key longer than they hold) asks the server.  The gets reach the
    server's counters once it answers again."""
    long_key = b"L" * (locations.KEY_MAX + 1)
    with open_store(shm.url(capacity="1MiB", chunk="4KiB", timeout="1")) as store, \
            open_store(shm.url(capacity="1MiB", chunk="4KiB", timeout="1")) as other:
        keys = [b"blk%04d" % i for i in range(40)]
        assert store.put(keys[:30] + [long_key], [value_for(k, 100) for k in keys[:30] + [long_key]]) == [True] * 31
        other.delete([keys[5]])
        before = store.stats()
        pid = before.extra["server_pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            assert store.contains(keys) == [i < 30 and i != 5 for i in range(40)]
            assert store.prefix_len(keys) == 5
            assert other.prefix_len(keys[6:]) == 24
            assert other.get(keys[:8]) == [None if i == 5 else value_for(k, 100) for i, k in enumerate(keys[:8])]
            out = np.zeros(100, np.uint8)
            assert other.get_into([keys[29]], [out]) == [True] and out.tobytes() == value_for(keys[29], 100)
            assert other.get([keys[35]]) == [None]
            with pytest.raises(StoreUnavailableError):
                store.get([long_key])          # not in the locations: asks, and the server is what it waits on
        finally:
            os.kill(pid, signal.SIGCONT)
        assert other.stats().extra["local_gets"] == 10
        after = store.stats()
        assert after.extra["key_table_live"] == 30
        assert after.num_hits - before.num_hits >= 8
        assert after.num_gets - before.num_gets >= 10


def test_a_dead_servers_table_is_never_read(shm):
    with open_store(shm.url(capacity="1MiB", timeout="2")) as store:
        assert store.put([b"k"], [value_for(b"k", 5000)]) == [True]
        inspect = open_store(shm.url(), OpenMode.INSPECT)
        try:
            assert inspect.contains([b"k"]) == [True]
            pid = store.stats().extra["server_pid"]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(pid), 5, "the killed server to be gone")
            with pytest.raises(StoreUnavailableError):
                inspect.contains([b"k"])       # asks, and finds no server: not the stale table's True
        finally:
            inspect.close()
        with pytest.raises(StoreUnavailableError):
            store.contains([b"k"])                 # this client too asks, and learns the server died
        assert store.contains([b"k"]) == [False]   # a new server, empty


def test_table_size_follows_the_chunks_within_bounds():
    assert keytable.table_slots(16384) == 65536           # 1 GiB of 64 KiB chunks: 512 KiB of table
    assert keytable.table_slots(1) == keytable.MIN_SLOTS
    assert keytable.table_slots(1 << 30) == keytable.MAX_SLOTS   # tiny chunks: the table stays bounded
    assert all(s & (s - 1) == 0 for s in map(keytable.table_slots, (3, 1000, 5000, 123457)))


def test_published_locations_prove_only_current_values_through_every_change():
    """The locations a client reads beside the key table, against the
    server's own index as the model, through random puts (of one or several
    chunks, some in several runs once the free space is fragmented),
    overwrites, deletes, evictions, rebuilds and clears.  After each step
    every stored key of one run is located exactly where the index keeps
    it, and every location read through a slot remembered from any earlier
    step is either refused or the key's current one: never another key's
    value, nor a value since freed."""
    num_chunks, chunk = 24, 64
    index = ChunkIndex(num_chunks=num_chunks, chunk_nbytes=chunk, lease_timeout_s=60)
    index.gen = np.zeros(num_chunks, np.uint64)
    index.table, table = _table(64)
    buf = bytearray(locations.segment_nbytes(64, num_chunks))
    index.where = locations.LocationWriter(buf, 64, num_chunks)
    reader = locations.LocationReader(buf, 64, num_chunks)
    universe = [b"key-%03d" % i for i in range(200)]
    fps = fingerprints(universe)
    rng = random.Random(3)
    remembered: set[tuple[int, int]] = set()       # (key number, slot) seen at any step
    seen = collections.Counter()
    for step in range(600):
        roll = rng.random()
        if roll < 0.7:
            picked = rng.sample(universe, rng.randint(1, 4))
            key_len, frames = pack_keys(picked)
            sizes = np.array([rng.choice([1, 64, 65, 200, 300]) for _ in picked], np.int64).tobytes()
            status, out = index.op_alloc(int(rng.random() < 0.3), key_len, os.getpid(), [*frames, sizes])
            lease = int.from_bytes(out[0], "little", signed=True)
            if lease:
                assert index.op_commit(0, 0, lease, [])[0] == Status.OK
        elif roll < 0.97:
            key_len, frames = pack_keys(rng.sample(universe, rng.randint(1, 5)))
            index.op_delete(0, key_len, 0, frames)
        else:
            index.op_clear(0, 0, 0, [])
        slots = table.find(fps)
        assert slots is not None
        for k, key in enumerate(universe):
            entry = index.index.get(key)
            if entry is None:
                assert slots[k] == -1
                continue
            remembered.add((k, int(slots[k])))
            *got, proven = reader.locate([key], slots[k:k + 1], index.gen, chunk)
            if entry.nruns == 1:
                assert proven[0], (step, key)
                assert [int(x[0]) for x in got] == [entry.first, entry.size, entry.gen]
                seen["one run"] += 1
            else:
                assert not proven[0]
                seen["several runs"] += 1
        for k, slot in remembered:
            key = universe[k]
            *got, proven = reader.locate([key], np.array([slot]), index.gen, chunk)
            if not proven[0]:
                seen["stale slot refused"] += slot != int(slots[k])
                continue
            entry = index.index.get(key)
            assert entry is not None and [int(x[0]) for x in got] == [entry.first, entry.size, entry.gen], (step, key)
    assert seen["one run"] > 1000 and seen["several runs"] > 20 and seen["stale slot refused"] > 1000, seen
    assert index.counters["evictions"] > 50
    assert int(index.table.header[1]) // 2 > 3          # rebuilds, which move every key's slot


def test_a_record_being_written_or_of_another_key_is_refused():
    buf = bytearray(locations.segment_nbytes(16, 8))
    writer = locations.LocationWriter(buf, 16, 8)
    reader = locations.LocationReader(buf, 16, 8)
    gen = np.zeros(8, np.uint64)
    gen[3] = 5
    writer.publish(np.array([2]), np.array([3]), [b"alpha"], np.array([100]), np.array([5], np.uint64))

    def proven(keys, slots):
        *found, ok = reader.locate(keys, np.array(slots), gen, 64)
        return ok.tolist(), [int(x[0]) for x in found]

    assert proven([b"alpha"], [2]) == ([True], [3, 100, 5])
    assert proven([b"alphb"], [2])[0] == [False]                  # another key
    assert proven([b"alph"], [2])[0] == [False]                   # a prefix of it
    assert proven([b"x" * 65, b"alpha"], [2, 2])[0] == [False, True]   # too long to hold; the other stands
    assert proven([b"alpha"], [5])[0] == [False]                  # a slot pointing nowhere
    writer.records["ver"][3] += np.uint64(1)                       # a write under way
    assert proven([b"alpha"], [2])[0] == [False]
    writer.records["ver"][3] += np.uint64(1)
    gen[3] += np.uint64(1)                                         # chunk 3 freed since
    assert proven([b"alpha"], [2])[0] == [False]
    gen[3] -= np.uint64(1)
    writer.forget(2)
    assert proven([b"alpha"], [2])[0] == [False]
    with pytest.raises(ValueError, match="does not match"):
        locations.LocationReader(buf, 16, 4)


def test_a_record_prepared_before_its_copy_is_refused_until_completed():
    """A put that names its keys before copying has its records written
    then, left odd: even a reader holding a stale ``where`` that points at
    the chunk (a value of the same key evicted from it) is refused until
    the commit completes the record."""
    buf = bytearray(locations.segment_nbytes(16, 8))
    writer = locations.LocationWriter(buf, 16, 8)
    reader = locations.LocationReader(buf, 16, 8)
    gen = np.zeros(8, np.uint64)
    writer.publish(np.array([2]), np.array([3]), [b"alpha"], np.array([100]), np.array([0], np.uint64))

    def proven():
        return reader.locate([b"alpha"], np.array([2]), gen, 64)[3].tolist()

    assert proven() == [True]
    gen[3] += np.uint64(1)                  # evicted: chunk 3 freed, then reserved for the same key again
    writer.prepare(np.array([3]), [b"alpha"], np.array([200]), gen[[3]].copy())
    assert proven() == [False]              # where[2] still says chunk 3; the record is not whole
    writer.prepare(np.array([3, 4]), [b"alpha", b"x" * 65], np.array([200, 10]), np.array([1, 0], np.uint64))
    assert proven() == [False]              # prepared twice (a put that failed, then another): still odd
    writer.complete(np.array([2]), np.array([3]))
    *found, ok = reader.locate([b"alpha"], np.array([2]), gen, 64)
    assert ok.tolist() == [True] and [int(x[0]) for x in found] == [3, 200, 1]
    # A record prepared and never completed, then published by a plain commit, is whole.
    writer.prepare(np.array([5]), [b"beta"], np.array([50]), np.array([0], np.uint64))
    writer.publish(np.array([7]), np.array([5]), [b"beta"], np.array([60]), np.array([0], np.uint64))
    assert reader.locate([b"beta"], np.array([7]), gen, 64)[3].tolist() == [True]
